"""Free callbacks for pins gpupin let go: late, or repeated.

NVIDIA's put_pages finds a mapping through the calling process's registration, which an MPS
client's teardown prunes while the memory and the armed callback stay with the MPS server.
put_pages then returns 0 having released nothing, gpupin frees its pin, and the callback comes
later with the data gpupin gave: it must find nothing, and touch neither freed memory nor a
newer pin.  A callback repeated with the same data must find nothing either.  And as gpupin
cannot know that such a callback is still armed, it may come after gpupin.ko was unloaded: it
then lands in gpupin_cb.ko, which stays loaded, and touches nothing.

The simulator plays the teardown (``SimMemory.forget_owner``) and the repeat
(``callback_twice``): simulator-only."""

from __future__ import annotations

import os
import time

import pytest

from conftest import GPU_PAGE
from gpupin import Device, SimMemory, kmod, sim_stats
from gpupin.sim import get_sim_param
from gpupin.testing import ensure_loaded

pytestmark = [
    pytest.mark.vm,
    pytest.mark.simonly(reason="drops registrations (forget_owner), repeats callbacks (callback_twice)"),
]


def test_unpin_after_teardown_releases_nothing(device: Device, sim: SimMemory) -> None:
    """put_pages says 0 and releases nothing: gpupin lets its pin go all the same, and the
    callback that comes with the memory's free finds nothing to touch."""
    va = sim.alloc(2 * GPU_PAGE)
    pin = device.pin(va, 2 * GPU_PAGE)
    sim.forget_owner(va)
    assert get_sim_param("forget_owner") == "1"
    before = sim_stats()
    device.unpin(pin)  # put_pages: 0, nothing released
    s = sim_stats()
    assert s.page_tables == 1 and s.live_callbacks == 1 and s.puts_not_found == 0, s
    assert device.info().file_pins == 0 and device.info().pinned_bytes == 0
    sim.free(va)  # the callback, with the data of the pin gpupin freed
    s = sim_stats()
    assert s.callbacks_run == before.callbacks_run + 1, s
    assert s.page_tables == 0 and s.live_callbacks == 0 and s.use_after_free_calls == 0, s
    assert get_sim_param("forget_owner") == "0"
    assert device.read_events() == [], "no pin of this file was invalidated"


def test_close_after_teardown_then_callback(sim: SimMemory) -> None:
    """The same through close: the file and every pin go, then the callback comes."""
    refs = kmod.info("gpupin").refcount
    va = sim.alloc(4 * GPU_PAGE)
    dev = Device()
    try:
        for i in range(4):
            dev.pin(va + i * GPU_PAGE, GPU_PAGE)
        sim.forget_owner()
    finally:
        dev.close()  # put_pages: 0 for each, nothing released; gpupin frees its pins
    s = sim_stats()
    assert s.page_tables == 4 and s.live_callbacks == 4, s
    assert kmod.info("gpupin").refcount == refs, "gpupin holds nothing for these callbacks"
    sim.free(va)  # four callbacks for pins gpupin freed
    s = sim_stats()
    assert s.page_tables == 0 and s.live_callbacks == 0 and s.use_after_free_calls == 0, s


def test_late_callback_leaves_newer_pins_alone(device: Device, sim: SimMemory) -> None:
    """A callback for a pin gpupin freed, after newer pins were made (whose objects may sit
    where the freed one was): every newer pin stays valid, and no event comes."""
    va = sim.alloc(GPU_PAGE)
    old = device.pin(va, GPU_PAGE)
    sim.forget_owner(va)
    device.unpin(old)
    n = 16
    vb = sim.alloc(n * GPU_PAGE)
    newer = [device.pin(vb + i * GPU_PAGE, GPU_PAGE) for i in range(n)]
    sim.free(va)  # the old pin's callback
    assert all(p.is_valid() for p in newer), "a late callback invalidated a newer pin"
    assert device.read_events() == []
    s = sim_stats()
    assert s.page_tables == n and s.live_callbacks == n and s.use_after_free_calls == 0, s
    for p in newer:
        device.unpin(p)
    sim.free(vb)


def test_forgotten_pin_of_another_allocation_is_untouched(device: Device, sim: SimMemory) -> None:
    """forget_owner(ptr) drops only the registration of the pins on ptr's allocation: the
    others are put as usual, and a normal unpin leaves no callback behind."""
    va = sim.alloc(GPU_PAGE)
    vb = sim.alloc(GPU_PAGE)
    a = device.pin(va, GPU_PAGE)
    b = device.pin(vb, GPU_PAGE)
    sim.forget_owner(va)
    device.unpin(b)  # found: released, its callback disarmed
    s = sim_stats()
    assert s.page_tables == 1 and s.live_callbacks == 1, s
    calls = s.callbacks_run
    sim.free(vb)  # nothing armed there any more
    assert sim_stats().callbacks_run == calls
    device.unpin(a)
    sim.free(va)
    s = sim_stats()
    assert s.callbacks_run == calls + 1 and s.page_tables == 0, s


def test_a_repeated_callback_finds_nothing(device: Device, sim: SimMemory, sim_params) -> None:  # type: ignore[no-untyped-def]
    """The same callback data a second time, the table already freed (callback_twice): the
    first invalidates the pin and queues its event, the second finds nothing, and a pin
    beside it stays valid."""
    sim_params(callback_twice=1)
    va = sim.alloc(GPU_PAGE)
    vb = sim.alloc(GPU_PAGE)
    pin = device.pin(va, GPU_PAGE)
    other = device.pin(vb, GPU_PAGE)
    calls = sim_stats().callbacks_run
    sim.free(va)  # the callback, twice
    assert sim_stats().callbacks_run == calls + 1
    assert [(e.handle, e.reason) for e in device.read_events()] == [(pin.handle, "freed")]
    assert not pin.is_valid() and other.is_valid()
    device.unpin(pin)
    device.unpin(other)
    sim.free(vb)
    s = sim_stats()
    assert s.page_tables == 0 and s.live_callbacks == 0 and s.use_after_free_calls == 0, s


def _kernel_log_after(mark: str) -> list[str]:
    """The kernel log's messages after the line ``mark`` (written to /dev/kmsg before)."""
    lines: list[str] = []
    with open("/dev/kmsg", "rb", buffering=0) as kmsg:  # one record per read, from the start
        os.set_blocking(kmsg.fileno(), False)
        while True:
            try:
                rec = kmsg.read(8192)
            except BlockingIOError:
                break
            except BrokenPipeError:  # records overwritten before we read them
                continue
            if not rec:
                break
            lines.append(rec.decode(errors="replace").split(";", 1)[-1].strip())
    return lines[max(i for i, ln in enumerate(lines) if ln == mark) + 1 :]


def _orphaned() -> str | None:
    return kmod.parameters("gpupin_cb").get("orphaned_callbacks")


def test_callback_after_gpupin_unloaded_lands_in_gpupin_cb(gpupin_loaded: None, leakcheck: None) -> None:
    """Callbacks left armed by an MPS client's teardown come after gpupin.ko was unloaded: the
    first while it is gone (gpupin_cb.ko counts it, nothing jumps into freed text), the second
    after it was loaded again, with an id the new gpupin.ko never gave (ids go on counting in
    gpupin_cb.ko), so a newer pin stays valid."""
    if kmod.is_loaded("gpupin_peer"):
        kmod.unload("gpupin_peer")  # it holds gpupin
    mark = f"gpupin-callback-after-unload-{os.getpid()}-{time.monotonic_ns()}"
    with open("/dev/kmsg", "w") as kmsg:
        kmsg.write(mark + "\n")
    try:
        with SimMemory() as sim:
            va = sim.alloc(GPU_PAGE)
            vb = sim.alloc(GPU_PAGE)
            dev = Device()
            try:
                dev.pin(va, GPU_PAGE)
                dev.pin(vb, GPU_PAGE)
                sim.forget_owner()  # the MPS client's teardown
            finally:
                dev.close()  # put_pages: 0 for both, nothing released, callbacks armed
            s = sim_stats()
            assert s.page_tables == 2 and s.live_callbacks == 2, s
            orphaned = _orphaned()
            last_id = kmod.parameters("gpupin_cb").get("last_id")
            kmod.unload("gpupin")
            calls = sim_stats().callbacks_run
            sim.free(va)  # the callback, gpupin.ko gone
            s = sim_stats()
            assert s.callbacks_run == calls + 1 and s.use_after_free_calls == 0, (
                f"a callback armed in gpupin.ko after its unload: {s}"
            )
            assert orphaned is not None and _orphaned() == str(int(orphaned) + 1), (orphaned, _orphaned())

            ensure_loaded()
            with Device() as dev:
                vc = sim.alloc(GPU_PAGE)
                newer = dev.pin(vc, GPU_PAGE)
                assert last_id is not None and int(kmod.parameters("gpupin_cb")["last_id"]) > int(last_id), (
                    "callback ids started again with the reloaded gpupin"
                )
                sim.free(vb)  # the other old callback, now reaching the new gpupin.ko
                assert newer.is_valid(), "an old callback invalidated a pin of the reloaded gpupin"
                assert dev.read_events() == []
                assert _orphaned() == str(int(orphaned) + 1), "gpupin was there to take it"
                dev.unpin(newer)
            sim.free(vc)
            s = sim_stats()
            assert s.page_tables == 0 and s.live_callbacks == 0 and s.use_after_free_calls == 0, s
        log = _kernel_log_after(mark)
        bad = [ln for ln in log if any(w in ln for w in ("BUG", "Oops", "KASAN", "WARNING", "general protection"))]
        assert not bad, bad
        assert any(ln.startswith("gpupin_cb: free callback for id ") for ln in log), log[-20:]
    finally:
        ensure_loaded()
