"""gpupin against what NVIDIA's driver really does: its static dma-buf exporter,
DMA mappings that a free cannot race, put_pages only while the pin is ours, and an unload
that waits for a free callback still leaving gpupin's code.

Mostly the simulator playing NVIDIA's driver (its exporter, knobs and counters): simulator-only.
The checks that need none of that run over either provider too."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import pytest

import gpupin
from conftest import GPU_ALLOC, GPU_PAGE, MiB, first_pci_device
from gpupin import Device, MemoryProvider, SimMemory, kmod, netlink, sim_stats
from gpupin.peer import Peer
from gpupin.testing import ensure_loaded

pytestmark = pytest.mark.vm
EXPORTER = pytest.mark.simonly(reason="pins dma-bufs of the simulator's exporter and counts its attachments")
PAGE = os.sysconf("SC_PAGE_SIZE")


# -- dma-buf: the importing device is a PCI device the caller names, or none ---------------------


@EXPORTER
def test_static_export_without_device_holds_memory(device: Device, sim: SimMemory) -> None:
    """NVIDIA's exporter: nothing is attached, the free frees nothing, the pin is never
    invalidated, and UNPIN gives the memory back."""
    va = sim.alloc(2 * GPU_PAGE)
    fd = sim.export_dmabuf(va)
    pin = device.pin_dmabuf(fd)
    os.close(fd)
    assert pin.dmabuf and not pin.revocable and not device.query(pin).revocable
    assert sim_stats().dmabuf_attachments == 0, "no device named: nothing attached"
    with pytest.raises(gpupin.GpupinError) as exc:
        device.get_pages(pin)
    assert exc.value.errno == errno.EOPNOTSUPP
    sim.free(va)  # cuMemFree: NVIDIA keeps the memory while the buffer lives
    s = sim_stats()
    assert s.allocations == 1 and s.dmabuf_exports == 1, s
    assert pin.is_valid() and device.read_events() == []
    m = device.dma_map(pin, first_pci_device())  # addresses per device still come
    assert len(device.dma_addrs(m)) == pin.entries
    device.dma_unmap(m)
    device.unpin(pin)
    s = sim_stats()
    assert s.allocations == 0 and s.dmabuf_exports == 0 and s.dmabuf_attachments == 0, s


@EXPORTER
def test_static_export_for_a_named_device(device: Device, sim: SimMemory) -> None:
    va = sim.alloc(2 * GPU_PAGE)
    fd = sim.export_dmabuf(va)
    pci = first_pci_device()
    pin = device.pin_dmabuf(fd, pci=pci)
    os.close(fd)
    assert not pin.revocable
    assert sim_stats().dmabuf_attachments == 1
    m = device.dma_map(pin, pci)
    assert device.get_pages(pin) == device.dma_addrs(m), "both: the same device's addresses"
    device.dma_unmap(m)
    device.unpin(pin)
    sim.free(va)


@EXPORTER
def test_named_device_must_exist(device: Device, sim: SimMemory) -> None:
    va = sim.alloc(GPU_PAGE)
    fd = sim.export_dmabuf(va)
    try:
        with pytest.raises(gpupin.GpupinError, match="no PCI device") as exc:
            device.pin_dmabuf(fd, pci="0000:ff:1f.7")
        assert exc.value.errno == errno.ENODEV
    finally:
        os.close(fd)
    assert device.info().file_pins == 0 and sim_stats().dmabuf_attachments == 0
    sim.free(va)


@pytest.mark.simonly(reason="needs the simulator's revocable dma-buf export: NVIDIA's exporter never revokes")
def test_revocable_export_needs_a_device(device: Device, sim: SimMemory) -> None:
    """An exporter that revokes is heard only through an attachment."""
    va = sim.alloc(GPU_PAGE)
    fd = sim.export_dmabuf(va, revocable=True)
    try:
        with pytest.raises(gpupin.InvalidArgument, match="importing device"):
            device.pin_dmabuf(fd)
        assert device.info().file_pins == 0 and sim_stats().dmabuf_attachments == 0
        pin = device.pin_dmabuf(fd, pci=first_pci_device())
    finally:
        os.close(fd)
    assert pin.revocable
    sim.free(va)  # revoked: move_notify
    assert not pin.is_valid()
    assert [e.handle for e in device.read_events()] == [pin.handle]
    device.unpin(pin)
    assert sim_stats().dmabuf_exports == 0


def test_nv_p2p_pins_say_whether_they_are_revocable(device: Device, memory: MemoryProvider) -> None:
    va = memory.alloc(max(GPU_ALLOC, 2 * GPU_PAGE))
    a = device.pin(va, GPU_PAGE)
    b = device.pin(va + GPU_PAGE, GPU_PAGE, persistent=True)
    assert a.revocable and not b.revocable
    assert device.query(a).revocable and not device.query(b).revocable
    device.unpin(b)
    memory.free(va)
    assert not a.is_valid()
    device.unpin(a)


@EXPORTER
def test_dma_unmap_racing_unpin_of_a_dmabuf_pin(device: Device, sim: SimMemory, sim_params) -> None:  # type: ignore[no-untyped-def]
    """DMA_UNMAP decides how to destroy its mapping from the mapping itself, never from the
    pin, whose buffer an UNPIN may let go of meanwhile; the mapping holds its own reference
    to the buffer.  The order is forced: the unmap stops using the pin, then pauses
    (unmap_late_delay_ms) while the unpin runs to its end, then destroys the mapping."""
    sim_params("gpupin", unmap_late_delay_ms=1000)
    pci = first_pci_device()
    va = sim.alloc(GPU_PAGE)
    for _ in range(3):
        fd = sim.export_dmabuf(va)
        pin = device.pin_dmabuf(fd, pci=pci)
        os.close(fd)
        m = device.dma_map(pin, pci)
        go = threading.Barrier(2)
        done: dict[str, float] = {}

        def unmap(m: gpupin.DmaMapping = m) -> None:
            go.wait()
            device.dma_unmap(m)
            done["unmap"] = time.monotonic()

        t = threading.Thread(target=unmap)
        t.start()
        go.wait()
        time.sleep(0.3)  # the unmap has stopped using the pin and pauses
        device.unpin(pin)  # lets the pin's buffer go
        done["unpin"] = time.monotonic()
        t.join()
        assert "unmap" in done, "DMA_UNMAP failed: its exception is printed above"
        assert done["unpin"] < done["unmap"], f"the unpin did not end inside the unmap's pause: {done}"
        s = sim_stats()
        assert s.dmabuf_attachments == 0 and s.dmabuf_mappings == 0 and s.dmabuf_exports == 0, s
    sim.free(va)


# -- DMA mappings: NVIDIA's call only where no free callback can race it -----------------------


@pytest.mark.simonly(
    reason="the simulator's dma_mappings counter is the point (nvidia_p2p_dma_map_pages not called); no IOMMU in the VM"
)
def test_non_persistent_pins_are_mapped_by_gpupin(device: Device, sim: SimMemory) -> None:
    va = sim.alloc(4 * GPU_PAGE)
    pin = device.pin(va, 4 * GPU_PAGE)
    before = sim_stats()
    m = device.dma_map(pin, first_pci_device())
    s = sim_stats()
    assert s.dma_mappings == before.dma_mappings == 0, "nvidia_p2p_dma_map_pages was called"
    # No IOMMU in the VM: the bus addresses are the pages' physical addresses.
    assert device.dma_addrs(m) == device.get_pages(pin)
    assert device.query(pin).dma_mappings == 1
    sim.free(va)  # the free callback unmaps gpupin's own mapping
    assert device.query(pin).dma_mappings == 0 and not pin.is_valid()
    with pytest.raises(gpupin.PinInvalidated):
        device.dma_unmap(m)
    device.unpin(pin)


@pytest.mark.simonly(reason="the simulator's dma_mappings counter is the point: nvidia_p2p_dma_map_pages called")
def test_persistent_pins_are_mapped_by_nvidia(device: Device, sim: SimMemory) -> None:
    va = sim.alloc(2 * GPU_PAGE)
    pin = device.pin(va, 2 * GPU_PAGE, persistent=True)
    m = device.dma_map(pin, first_pci_device())
    assert sim_stats().dma_mappings == 1
    assert device.dma_addrs(m) == device.get_pages(pin)
    device.unpin(pin)  # unmaps, then puts
    assert sim_stats().dma_mappings == 0
    sim.free(va)


@pytest.mark.simonly(reason="widens the race with the simulator's dma_map_latency_us and reads its dma_map_races")
def test_dma_map_racing_the_free_is_safe(device: Device, sim: SimMemory, sim_params) -> None:  # type: ignore[no-untyped-def]
    """The free callback waits for gpupin's own mapper and unmaps what it made.  Under the old
    design NVIDIA's dma_map_pages waited (dma_map_latency_us) while the table was freed:
    heap corruption on a real driver, dma_map_races in the simulator."""
    sim_params(dma_map_latency_us=20_000)
    pci = first_pci_device()
    outcomes: dict[str, int] = {}
    for i in range(30):
        va = sim.alloc(8 * GPU_PAGE)
        pin = device.pin(va, 8 * GPU_PAGE)
        go = threading.Barrier(2)
        got: list[str] = []

        def mapper(pin: gpupin.Pin = pin) -> None:
            go.wait()
            try:
                device.dma_map(pin, pci)
                got.append("mapped")
            except gpupin.PinInvalidated:
                got.append("gone")

        t = threading.Thread(target=mapper)
        t.start()
        go.wait()
        if i % 2:
            time.sleep(0.001)
        sim.free(va)
        t.join()
        outcomes[got[0]] = outcomes.get(got[0], 0) + 1
        assert device.query(pin).dma_mappings == 0, "the callback unmapped every own mapping"
        device.unpin(pin)
    s = sim_stats()
    assert s.dma_map_races == 0 and s.use_after_free_calls == 0 and s.dma_mappings == 0, s
    assert sum(outcomes.values()) == 30, outcomes


# -- Unload: a free callback still on its way out of gpupin -------------------------------------


@pytest.mark.simonly(
    reason="unloads gpupin.ko mid-callback (callback_tail_delay_ms) and loads it back over the simulator"
)
def test_unload_is_refused_while_a_callback_leaves_gpupin(gpupin_loaded: None, leakcheck: None, sim_params) -> None:  # type: ignore[no-untyped-def]
    """A detached pin's callback drops the module reference it held, then returns through
    gpupin's code: gpupin_cb.ko, through which every callback comes, holds the module until
    it is back, so an unload in that window is refused, and works once the callback returned
    (callback_tail_delay_ms widens the window; the kernel log would show a crash)."""
    for m in ("gpupin_peer",):
        if kmod.is_loaded(m):
            kmod.unload(m)
    try:
        with SimMemory() as sim:
            dev = Device()
            va = sim.alloc(GPU_PAGE)
            dev.pin(va, GPU_PAGE)
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(w)
                os.read(r, 1)
                os._exit(0)  # the last close of the gpupin file: the pin goes DETACHED
            os.close(r)
            dev.close()
            os.write(w, b"x")
            os.close(w)
            assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0, "the child that closed the file last failed"
            deadline = time.monotonic() + 10
            while gpupin.kmod.info("gpupin").refcount != 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert kmod.info("gpupin").refcount == 1, "only the detached pin holds the module"
            sim_params("gpupin", callback_tail_delay_ms=3000)
            freer = threading.Thread(target=sim.free, args=(va,))
            freer.start()
            deadline = time.monotonic() + 10
            while netlink.stats()["detached"] and time.monotonic() < deadline:
                time.sleep(0.01)
            # The callback let go of the pin and its module reference, and is in its tail now.
            assert netlink.stats()["detached"] == 0, "the callback did not come"
            with pytest.raises(gpupin.ModuleError, match="in use") as refused:
                kmod.unload("gpupin")
            assert refused.value.errno in (errno.EAGAIN, errno.EBUSY), refused.value
            freer.join()
            kmod.unload("gpupin")
            assert not kmod.is_loaded("gpupin")
            s = sim_stats()
            assert s.page_tables == 0 and s.live_callbacks == 0 and s.use_after_free_calls == 0, s
    finally:
        ensure_loaded()


@pytest.mark.simonly(
    reason="loads gpupin.ko with an init that fails (fail_init_ms) while an earlier pin's callback is in it"
)
def test_a_failed_load_waits_for_a_callback_inside_it(gpupin_loaded: None, leakcheck: None) -> None:
    """An MPS client's pin whose put_pages said 0 and released nothing keeps its callback armed
    after gpupin.ko is unloaded.  It comes while a new gpupin.ko is loading, and gpupin_cb.ko
    passes it to that module; if the load then fails, the loader frees the module's memory as
    soon as its init returns.  So init waits for the callback to leave first
    (callback_tail_delay_ms keeps it in gpupin 2 s; without the wait it returns into freed text)."""
    for m in ("gpupin_peer",):
        if kmod.is_loaded(m):
            kmod.unload(m)
    orphaned = "/sys/module/gpupin_cb/parameters/orphaned_callbacks"
    try:
        with SimMemory() as sim:
            dev = Device()
            va = sim.alloc(GPU_PAGE)
            dev.pin(va, GPU_PAGE)
            sim.forget_owner(va)
            dev.close()  # put_pages says 0 and releases nothing: the callback stays armed
            kmod.unload("gpupin")
            before = int(Path(orphaned).read_text())
            freed_at: list[float] = []

            def free_while_loading() -> None:
                deadline = time.monotonic() + 30
                state = Path("/sys/module/gpupin/initstate")
                while time.monotonic() < deadline:
                    if state.exists() and state.read_text().strip() == "coming":
                        break
                    time.sleep(0.005)
                time.sleep(0.2)  # well inside init's 1.5 s pause, with the handler registered
                freed_at.append(time.monotonic())
                sim.free(va)

            freer = threading.Thread(target=free_while_loading)
            freer.start()
            with pytest.raises(gpupin.ModuleError) as failed:
                kmod.load(kmod.module_file("gpupin"), {"fail_init_ms": 1500, "callback_tail_delay_ms": 2000})
            returned = time.monotonic()
            freer.join()
            assert failed.value.errno == errno.EAGAIN, failed.value
            assert freed_at, "the load never reached its init"
            assert int(Path(orphaned).read_text()) == before, "the callback came before or after the loading gpupin"
            assert returned - freed_at[0] >= 1.9, (
                f"the failed load returned {returned - freed_at[0]:.2f} s after the free, "
                "with the callback still in its 2 s tail"
            )
            assert not kmod.is_loaded("gpupin")
            s = sim_stats()
            assert s.page_tables == 0 and s.live_callbacks == 0 and s.use_after_free_calls == 0, s
    finally:
        ensure_loaded()


def test_dma_map_of_a_large_pin_is_unmapped_by_the_callback(device: Device, memory: MemoryProvider, pci: str) -> None:
    va = memory.alloc(16 * MiB)
    pin = device.pin(va, 16 * MiB)
    maps = [device.dma_map(pin, pci) for _ in range(3)]
    assert device.query(pin).dma_mappings == 3 and all(m.entries == 256 for m in maps)
    memory.free(va)
    assert device.query(pin).dma_mappings == 0
    device.unpin(pin)


def test_driver_maps_one_reference_from_two_threads(device: Device, memory: MemoryProvider, peer: Peer) -> None:
    """gpupin_ref_dma_map() calls on one reference are serialised: two racing calls share one
    mapping, and the reference's put drops it (no share left behind on the pin)."""
    va = memory.alloc(16 * MiB)
    pin = device.pin(va, 16 * MiB)  # 256 pages: each map takes a while, so the calls overlap
    for _ in range(20):
        hold = peer.hold(device, pin, map_race=True)
        assert device.query(pin).dma_mappings == 1
        peer.release(hold)
        assert device.query(pin).dma_mappings == 0, "a racing map left its share behind"
    device.unpin(pin)
    memory.free(va)


# -- put_pages only while the pin is the unpin's --------------------------------------------------


def _free_and_pin_while_an_unpin_is_held(device: Device, sim: SimMemory) -> None:
    """Unpin on another thread, held by the caller's knob; meanwhile free the pin's memory (the
    callback takes the pin, NVIDIA frees its table) and pin another range, whose table gets
    the freed address (reuse_freed_tables).  The unpin's put must leave that newer pin alone:
    NVIDIA finds a non-persistent mapping by the table's pointer."""
    va = sim.alloc(GPU_PAGE)
    vb = sim.alloc(GPU_PAGE)  # before the free, so not at va: a table is reused for another range
    pin = device.pin(va, GPU_PAGE)
    t = threading.Thread(target=device.unpin, args=(pin,))
    t.start()
    time.sleep(0.3)  # the unpin is held, before its put_pages or inside it
    sim.free(va)
    other = device.pin(vb, GPU_PAGE)  # this process's next table: the freed one's address
    t.join()
    s = sim_stats()
    assert s.stale_table_puts == 0 and s.use_after_free_calls == 0, s
    assert other.is_valid() and s.page_tables == 1 and s.live_callbacks == 1, s
    device.unpin(other)
    sim.free(vb)


@pytest.mark.simonly(reason="makes the simulator reuse freed page tables (reuse_freed_tables) to catch a stale put")
def test_unpin_racing_the_free_puts_no_stale_table(device: Device, sim: SimMemory, sim_params) -> None:  # type: ignore[no-untyped-def]
    """The free callback takes a pin that an unpin claimed before the unpin's put_pages
    (release_delay_ms holds it between its claim and the put): the unpin must see that and
    put nothing."""
    sim_params(reuse_freed_tables=1)
    sim_params("gpupin", release_delay_ms=1000)
    _free_and_pin_while_an_unpin_is_held(device, sim)


@pytest.mark.simonly(reason="holds put_pages before NVIDIA's lock (put_latency_us) and reuses freed tables")
def test_put_waiting_for_the_lock_never_meets_a_newer_pin(device: Device, sim: SimMemory, sim_params) -> None:  # type: ignore[no-untyped-def]
    """The callback takes the pin after the unpin checked it, while its put_pages waits for
    NVIDIA's lock (put_latency_us): gpupin must not let the newer pin's get_pages run before
    that put has returned."""
    sim_params(reuse_freed_tables=1, put_latency_us=800_000)
    _free_and_pin_while_an_unpin_is_held(device, sim)


@pytest.mark.simonly(reason="injects a put_pages failure with the simulator's fail_put_nth")
def test_put_pages_failure_keeps_the_pin_for_its_callback(device: Device, sim: SimMemory, sim_params) -> None:  # type: ignore[no-untyped-def]
    """NVIDIA's put_pages can fail and leave the callback armed with gpupin's pin as its data:
    the pin must then wait for that callback (DETACHED), never be freed under it."""
    va = sim.alloc(2 * GPU_PAGE)
    pin = device.pin(va, 2 * GPU_PAGE)
    refs = kmod.info("gpupin").refcount
    sim_params(fail_errno=errno.EINVAL, fail_put_nth=1)
    device.unpin(pin)  # put_pages fails: the pin is kept for its callback
    s = sim_stats()
    assert s.page_tables == 1 and s.live_callbacks == 1, s
    assert device.info().file_pins == 0 and device.info().pinned_bytes == 2 * GPU_PAGE
    assert kmod.info("gpupin").refcount == refs + 1, "the detached pin holds the module"
    sim.free(va)  # the callback releases it now
    s = sim_stats()
    assert s.page_tables == 0 and s.live_callbacks == 0 and s.use_after_free_calls == 0, s
    assert kmod.info("gpupin").refcount == refs and device.info().pinned_bytes == 0


# -- BAR pages, as a discrete GPU hands them out ---------------------------------------------------


def _largest_mem_bar(pci: str) -> tuple[int, int]:
    """[start, end] of the device's largest memory BAR, from sysfs."""
    best = (0, -1)
    with open(f"/sys/bus/pci/devices/{pci}/resource") as f:
        for line in f.read().splitlines()[:6]:  # the six standard BARs
            start, end, flags = (int(x, 16) for x in line.split())
            if flags & 0x200 and end - start > best[1] - best[0]:  # IORESOURCE_MEM
                best = (start, end)
    return best


@pytest.mark.simonly(reason="backs the simulator's pages with the VM's ivshmem BAR (bar_device)")
def test_bar_pages_are_mapped_as_mmio(  # type: ignore[no-untyped-def]
    device: Device, sim: SimMemory, sim_params, bar_device: str, virtio_pci: str
) -> None:
    """With the simulator's bar_device, page tables hold addresses inside a PCI memory BAR, as
    NVIDIA's hold BAR1 addresses: gpupin finds the BAR's device and maps the pages with
    dma_map_resource (its own mappings), NVIDIA's dma_map_pages maps them for persistent pins,
    and the free callback unmaps gpupin's."""
    sim_params(bar_device=bar_device)
    start, end = _largest_mem_bar(bar_device)
    va = sim.alloc(4 * GPU_PAGE)
    pin = device.pin(va, 4 * GPU_PAGE)
    phys = device.get_pages(pin)
    assert all(start <= p and p + GPU_PAGE - 1 <= end for p in phys), (hex(start), [hex(p) for p in phys])
    m = device.dma_map(pin, virtio_pci)
    assert sim_stats().dma_mappings == 0, "gpupin's own mapping, not NVIDIA's"
    # No IOMMU in the VM: dma_map_resource gives the BAR's bus address, the physical one here.
    assert device.dma_addrs(m) == phys
    vb = sim.alloc(2 * GPU_PAGE)
    per = device.pin(vb, 2 * GPU_PAGE, persistent=True)
    pm = device.dma_map(per, virtio_pci)
    assert sim_stats().dma_mappings == 1 and device.dma_addrs(pm) == device.get_pages(per)
    device.unpin(per)
    sim.free(vb)
    sim.free(va)  # the callback unmaps gpupin's own BAR mapping
    assert device.query(pin).dma_mappings == 0 and not pin.is_valid()
    device.unpin(pin)
    s = sim_stats()
    assert s.dma_mappings == 0 and s.page_tables == 0, s
