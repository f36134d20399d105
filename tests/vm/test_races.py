"""Races between the free callback and unpin, close, dma_unmap, queries, netlink dumps and peer
driver transfers; put_pages racing the callback; SIGKILL in the middle of a pin.

Counts default to CI size (scaled by GPUPIN_STRESS_SCALE); GPUPIN_LONG=1 (make test-long) runs
the full ones.  The races over plain frees run over either provider (allocations of GPU_ALLOC:
2 MiB natively, as cuMemAlloc aligns only those to 2 MiB); those needing a simulator knob or a
forked child stay simulator-only.
"""

from __future__ import annotations

import os
import random
import select
import signal
import threading
import time

import pytest

import gpupin
from conftest import GPU_ALLOC, GPU_PAGE, scaled
from gpupin import Device, MemoryProvider, SimMemory, sim_stats
from gpupin.netlink import Netlink
from gpupin.peer import Peer
from gpupin.testing import NATIVE

pytestmark = pytest.mark.vm
LONG = os.environ.get("GPUPIN_LONG") == "1"
ITER = 10_000
BATCH = 500


def run_pair(a, b) -> None:  # type: ignore[no-untyped-def]
    """Run two callables at once, ``a`` on this thread and ``b`` on another; re-raise the first
    error.  ``a`` frees memory in the tests: on this thread, where CUDA's context is current."""
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def wrap(fn):  # type: ignore[no-untyped-def]
        def body() -> None:
            try:
                start.wait()
                fn()
            except BaseException as exc:  # noqa: B036 - handed to the main thread
                errors.append(exc)

        return body

    other = threading.Thread(target=wrap(b))
    other.start()
    wrap(a)()
    other.join()
    if errors:
        raise errors[0]


def test_unpin_races_free(device: Device, memory: MemoryProvider) -> None:
    invalidated = 0
    n = ITER if LONG else scaled(ITER, step=BATCH)
    for _ in range(n // BATCH):
        vas = [memory.alloc(GPU_ALLOC) for _ in range(BATCH)]
        pins = [device.pin(va, GPU_PAGE) for va in vas]
        run_pair(lambda: [memory.free(va) for va in vas], lambda: [device.unpin(p) for p in pins])
        invalidated += len(device.read_events())
        assert device.info().file_pins == 0
        if not NATIVE:
            s = sim_stats()
            assert s.page_tables == 0 and s.tables_not_freed == 0 and s.allocations == 0
    print(f"{n} unpin/free races: the callback came first {invalidated} times")


@pytest.mark.simonly(reason="sets the simulator's race_put_pages knob and counts its callbacks_run")
def test_put_pages_races_callback(device: Device, sim: SimMemory, sim_params) -> None:  # type: ignore[no-untyped-def]
    sim_params(race_put_pages=True)
    va = sim.alloc(4 * GPU_PAGE)
    before = sim_stats().callbacks_run
    n = ITER if LONG else scaled(2000)
    for i in range(n):
        pin = device.pin(va + (i % 4) * GPU_PAGE, GPU_PAGE)
        device.unpin(pin)
    s = sim_stats()
    assert s.callbacks_run - before == n  # every put_pages met a callback
    assert s.page_tables == 0 and s.tables_not_freed == 0
    assert device.read_events() == []  # unpin owned those pins: no invalidation records
    sim.free(va)


def test_close_races_free(memory: MemoryProvider) -> None:
    rounds = 100 if LONG else scaled(20)
    for _ in range(rounds):
        dev = Device()
        vas = [memory.alloc(GPU_ALLOC) for _ in range(100)]
        for va in vas:
            dev.pin(va, GPU_PAGE)
        run_pair(lambda: [memory.free(va) for va in vas], dev.close)
        if not NATIVE:
            assert sim_stats().page_tables == 0


def test_dma_unmap_races_free(device: Device, memory: MemoryProvider, pci: str) -> None:
    n = ITER if LONG else scaled(2000, step=200)
    for _ in range(n // 200):
        vas = [memory.alloc(GPU_ALLOC) for _ in range(200)]
        pins = [device.pin(va, GPU_PAGE) for va in vas]
        maps = [device.dma_map(p, pci) for p in pins]

        def unmap_all() -> None:
            for m in maps:
                try:
                    device.dma_unmap(m)
                except Exception as exc:  # invalidated first: the mapping went with it
                    assert type(exc).__name__ == "PinInvalidated"

        run_pair(lambda: [memory.free(va) for va in vas], unmap_all)
        for p in pins:
            device.unpin(p)
        device.read_events()
        if not NATIVE:
            s = sim_stats()
            assert s.dma_mappings == 0 and s.mappings_not_freed == 0 and s.page_tables == 0


def test_queries_race_free(device: Device, memory: MemoryProvider) -> None:
    """GET_PAGES/QUERY users in flight while the callback waits for them."""
    n = ITER if LONG else scaled(400)
    batch = min(n, 2000)  # 2000 pins of 64 KiB fit the simulated 256 MiB BAR
    for _ in range(n // batch):
        vas = [memory.alloc(GPU_ALLOC) for _ in range(batch)]
        pins = [device.pin(va, GPU_PAGE) for va in vas]

        def readers() -> None:
            for p in pins:
                try:
                    device.get_pages(p, 0, 1)
                except Exception as exc:
                    assert type(exc).__name__ == "PinInvalidated"
                assert device.query(p).state in ("pinned", "invalidated")

        run_pair(lambda: [memory.free(va) for va in vas], readers)
        assert all(device.query(p).state == "invalidated" for p in pins)
        for p in pins:
            device.unpin(p)
        device.read_events()


def test_netlink_dump_races_free(device: Device, memory: MemoryProvider) -> None:
    """GET_PINS dumps walking pins while their callbacks run."""
    n = ITER if LONG else scaled(2000, step=BATCH)
    seen = 0
    with Netlink() as nl:
        for _ in range(n // BATCH):
            vas = [memory.alloc(GPU_ALLOC) for _ in range(BATCH)]
            pins = [device.pin(va, GPU_PAGE) for va in vas]
            done = threading.Event()

            def dump() -> None:
                nonlocal seen
                while not done.is_set():
                    for p in nl.list_pins():
                        assert p.state in ("pinned", "invalidated")
                        seen += 1

            def free_all() -> None:
                for va in vas:
                    memory.free(va)
                done.set()

            run_pair(free_all, dump)
            for p in pins:
                device.unpin(p)
            device.read_events()
    if not NATIVE:
        assert sim_stats().page_tables == 0
    print(f"{n} frees raced netlink dumps that reported {seen} pins")


def test_peer_transfers_race_free(device: Device, memory: MemoryProvider, peer: Peer) -> None:
    """Driver accesses (kernel API) in flight while the callback notifies and waits for them."""
    n = ITER if LONG else scaled(1000, step=100)
    completed = aborted = refused = 0
    for _ in range(n // 100):
        vas = [memory.alloc(max(GPU_ALLOC, 2 * GPU_PAGE)) for _ in range(100)]
        pins = [device.pin(va, 2 * GPU_PAGE) for va in vas]
        refused_pins = []

        def transfers() -> None:
            nonlocal completed, aborted
            for p in pins:
                try:
                    peer.read(device, p, GPU_PAGE - 512, 1024)  # spans both GPU pages
                    completed += 1
                except gpupin.TransferAborted as exc:
                    assert exc.errno in (19, 5)  # ENODEV, EIO
                    aborted += 1
                except gpupin.InvalidArgument:
                    # The provider refuses dma_map_pages once it started freeing the memory,
                    # which can be before gpupin's callback (and the peer's notifier) ran.
                    refused_pins.append(p)

        run_pair(lambda: [memory.free(va) for va in vas], transfers)
        assert all(device.query(p).state == "invalidated" for p in refused_pins)
        refused += len(refused_pins)
        for p in pins:
            device.unpin(p)
        device.read_events()
        if not NATIVE:
            s = sim_stats()
            assert s.page_tables == 0 and s.dma_mappings == 0 and s.poison_errors == 0
    assert completed + aborted + refused == n
    print(
        f"{n} peer transfers raced frees: {completed} completed, {aborted} stopped cleanly, "
        f"{refused} refused by the provider mid-free"
    )


@pytest.mark.simonly(
    reason="slows get_pages with the simulator's pin_latency_us knob; forked children allocate device memory"
)
def test_sigkill_during_pin(gpupin_loaded: None, leakcheck: None, sim_params) -> None:  # type: ignore[no-untyped-def]
    """A process killed while its PIN is inside get_pages leaves nothing behind."""
    sim_params(pin_latency_us=3000)
    n = ITER if LONG else scaled(200)
    rng = random.Random(n)
    for _ in range(n):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            code = 3  # ended on its own: the kill never met a PIN
            try:
                sim = SimMemory()
                dev = Device()
                va = sim.alloc(4 * GPU_PAGE)
                dev.unpin(dev.pin(va, 4 * GPU_PAGE))
                os.write(w, b"p")  # pinning now: the kill lands in the loop (mostly in get_pages)
                while True:
                    dev.unpin(dev.pin(va, 4 * GPU_PAGE))
            finally:
                os._exit(code)
        os.close(w)
        ready = select.select([r], [], [], 30)[0] and os.read(r, 1) == b"p"
        os.close(r)
        time.sleep(rng.random() * 0.02)
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        assert ready, "the child never got to pinning: nothing raced"
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (
            f"the child ended on its own (status {status}) instead of being killed while pinning"
        )
    s = sim_stats()
    assert s.page_tables == 0 and s.bar_bytes == 0 and s.allocations == 0, s
    with Device() as dev:
        assert dev.info().pinned_bytes == 0
