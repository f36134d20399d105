"""The registration cache end to end through gpupin.ko, over either provider; the tests that
set the simulator's BAR, rely on its address reuse or fork are simulator-only."""

from __future__ import annotations

import os
import random
import sys
from typing import Any

import pytest

import gpupin
from conftest import GPU_ALLOC, GPU_PAGE, MiB, need_dmabuf_export
from gpupin import Device, MemoryProvider, SimMemory, sim_stats
from gpupin._native import lib
from gpupin.cache import RegistrationCache
from gpupin.sim import BAR1_RESERVE
from gpupin.testing import NATIVE

# The threads test's buffers: 1 MiB over the simulator, 2 MiB natively (whole, aligned GPU pages).
ALLOC = max(GPU_ALLOC, MiB)

pytestmark = pytest.mark.vm


@pytest.mark.simonly(reason="needs the simulator to hand the freed address out again (cuMemAlloc may not)")
@pytest.mark.parametrize("validate", ["kernel", "buffer_id", "both"])
def test_free_and_realloc_at_same_address_misses(device: Device, sim: SimMemory, validate: str) -> None:
    cache = RegistrationCache(device, sim, validate=validate)  # type: ignore[arg-type]
    va = sim.alloc(MiB)
    with cache.acquire(va + 10, 100) as r:
        h1 = r.handle
        assert r.valid and r.aligned_va == va and r.aligned_size == MiB
    with cache.acquire(va, MiB) as r:
        assert r.handle == h1
    sim.free(va)
    va2 = sim.alloc(MiB)
    assert va2 == va
    with cache.acquire(va2, 64) as r:
        assert r.handle != h1 and r.valid
    st = cache.stats()
    assert (st.hits, st.misses, st.pins, st.unpins) == (1, 2, 2, 1)
    assert st.invalidations_kernel + st.invalidations_buffer_id == 1
    cache.purge()
    sim.free(va2)
    assert device.info().file_pins == 0


@pytest.mark.simonly(reason="the simulator's own buffer-id query, and its address reuse")
@pytest.mark.parametrize("validate", ["buffer_id", "both"])
def test_a_validated_sim_hit_runs_no_python(device: Device, sim: SimMemory, validate: str) -> None:
    """SimMemory's buffer-id check runs in C, as CudaMemory's does: a validated hit is one
    call into C (its query an ioctl from C), no Python function and no Python ioctl wrapper;
    a free and reallocation at the same address is seen there too (with validate="buffer_id"
    the buffer id is all the core checks)."""
    cache = RegistrationCache(device, sim, validate=validate)  # type: ignore[arg-type]
    va = sim.alloc(MiB)
    cache.acquire(va, 64).release()  # the miss that pins
    events: list[tuple[str, str]] = []

    def record(frame: Any, event: str, arg: Any) -> None:
        name = getattr(arg, "__name__", "") if event.startswith("c_") else frame.f_code.co_name
        if name != "setprofile":
            events.append((event, name))

    def profiled_lookup(ptr: int) -> int:
        sys.setprofile(record)
        try:
            return cache.fast_lookup(ptr, 64)
        finally:
            sys.setprofile(None)

    tok = profiled_lookup(va + 4096)
    assert tok >= 0, f"no hit: {tok}"
    assert events == [("c_call", "fast_lookup"), ("c_return", "fast_lookup")], events
    cache.release_token(tok)
    sim.free(va)
    assert sim.alloc(MiB) == va  # the same address, a new buffer id
    events.clear()
    code = profiled_lookup(va + 4096)
    assert code == -(tok + lib.GPC_STALE_BASE), f"the old pin was handed out or missed: {code}"
    assert events == [("c_call", "fast_lookup"), ("c_return", "fast_lookup")], events
    with cache.acquire(va, 64) as reg:
        assert reg.buffer_id == sim.buffer_id(va) and reg.valid
    cache.close()
    sim.free(va)
    assert device.info().file_pins == 0


def test_invalidated_while_in_use_is_reported(device: Device, memory: MemoryProvider) -> None:
    cache = RegistrationCache(device, memory, validate="kernel")
    va = memory.alloc(2 * MiB)
    r = cache.acquire(va, 10)
    memory.free(va)
    assert not r.valid
    assert cache.drain() == 1
    r.release()
    assert device.info().file_pins == 0 and cache.stats().unpins == 1


def _over_working_set(
    device: Device, memory: MemoryProvider, buffers: int, acquires: int, seed: int
) -> tuple[RegistrationCache, list[int]]:
    """A cache over ``buffers`` allocations of 2 MiB, acquired and released at random
    ``acquires`` times: each valid, the stats showing evictions for pressure and nothing else
    failing.  The cache and the allocations, for the caller to check and free."""
    cache = RegistrationCache(device, memory, validate="both")
    bufs = [memory.alloc(2 * MiB) for _ in range(buffers)]
    rng = random.Random(seed)
    for _ in range(acquires):
        with cache.acquire(rng.choice(bufs), 4096) as r:
            assert r.valid
    st = cache.stats()
    assert st.evictions_pressure > 0 and st.pin_failures == st.evictions_pressure
    return cache, bufs


@pytest.mark.simonly(reason="sets the simulator's BAR size (bar_size)")
def test_bar_smaller_than_working_set(device: Device, sim: SimMemory, sim_params) -> None:  # type: ignore[no-untyped-def]
    sim_params(bar_size=BAR1_RESERVE + 16 * MiB)  # NVIDIA keeps 36 MiB of BAR1 free
    cache, bufs = _over_working_set(device, sim, 32, 400, seed=3)  # 64 MiB working set
    assert cache.stats().peak_bytes <= 16 * MiB and sim_stats().bar_bytes <= 16 * MiB
    cache.purge()
    for b in bufs:
        sim.free(b)


def test_file_budget_smaller_than_working_set(device: Device, memory: MemoryProvider, sim_params) -> None:  # type: ignore[no-untyped-def]
    """A share (EDQUOT: max_file_pinned_bytes here; a cgroup's dmem.max gives the same errno)
    a quarter of the working set: the cache evicts idle registrations, least recently used
    first, and retries; every acquire succeeds and the stats say so."""
    sim_params("gpupin", max_file_pinned_bytes=8 * MiB)
    cache, bufs = _over_working_set(device, memory, 16, 200, seed=5)  # 32 MiB working set
    assert cache.stats().peak_bytes <= 8 * MiB and device.info().pinned_bytes <= 8 * MiB
    held = [cache.acquire(b, 4096) for b in bufs[:4]]  # the whole share in use
    with pytest.raises(gpupin.QuotaExceeded, match="dmem.max or max_file_pinned_bytes"):
        cache.acquire(bufs[4], 4096)
    for r in held:
        r.release()
    cache.purge()
    for b in bufs:
        memory.free(b)


@pytest.mark.simonly(reason="sets the simulator's BAR size (bar_size)")
def test_all_in_use_under_bar_pressure_is_a_clean_error(device: Device, sim: SimMemory, sim_params) -> None:  # type: ignore[no-untyped-def]
    sim_params(bar_size=BAR1_RESERVE + 2 * MiB)
    cache = RegistrationCache(device, sim)
    held = [cache.acquire(sim.alloc(MiB), 1) for _ in range(2)]
    with pytest.raises(gpupin.BarExhausted, match="nothing is evictable"):
        cache.acquire(sim.alloc(MiB), 1)
    for r in held:
        r.release()
    cache.purge()


def test_dma_map_through_the_cache(device: Device, memory: MemoryProvider, pci: str) -> None:
    cache = RegistrationCache(device, memory)
    va = memory.alloc(2 * MiB)
    with cache.acquire(va, 1) as r:
        m = r.dma_map(pci)  # the whole allocation is registered
        assert m.entries == 2 * MiB // GPU_PAGE and device.query(r.handle).dma_mappings == 1
    cache.purge()
    memory.free(va)
    if not NATIVE:
        assert sim_stats().dma_mappings == 0


def test_device_close_closes_its_caches(memory: MemoryProvider) -> None:
    dev = Device()
    cache = RegistrationCache(dev, memory, validate="both")
    va = memory.alloc(2 * MiB)
    r = cache.acquire(va, 10)
    assert dev.info().file_pins == 1
    with pytest.raises(gpupin.InUse, match="1 registration"):
        dev.close()  # a NIC may still move data through r's pin: nothing closes
    assert not dev.closed and r.valid and dev.info().file_pins == 1
    r.release()
    dev.close()  # closes the cache, unmaps the validity map, releases the pins
    assert dev.closed and (NATIVE or sim_stats().page_tables == 0)
    with pytest.raises(gpupin.InvalidArgument, match="closed"):
        cache.acquire(va, 10)
    memory.free(va)


@pytest.mark.simonly(reason="forks a child that allocates device memory: CUDA contexts do not survive fork")
def test_a_saved_fast_path_outlives_the_cache_and_the_device(gpupin_loaded: None, leakcheck: None) -> None:
    """fast_lookup kept, the cache dropped without close(), the Device closed (the validity
    map unmapped): the saved entry point raises.  It read the unmapped map before: the
    process died with SIGSEGV, so this runs in a child."""
    from gpupin.testing import in_child

    def child() -> int:
        import gc

        with SimMemory() as sim:
            dev = Device()
            cache = RegistrationCache(dev, sim, validate="kernel")
            va = sim.alloc(MiB)
            tok = cache.fast_lookup(va, 1)
            cache.release_token(cache.miss(va, 1, tok))
            fl = cache.fast_lookup
            del cache
            gc.collect()
            if dev.info().file_pins != 0:
                return 2  # the dropped cache left its unheld pin behind
            dev.close()
            try:
                fl(va, 1)
                return 3
            except gpupin.InvalidArgument as exc:
                if "closed" not in str(exc):
                    return 4
            sim.free(va)
        return 0

    assert in_child(child) == 0


def test_threads_hit_miss_evict_and_free_over_the_kernel(device: Device, memory: MemoryProvider) -> None:
    """Six threads mix hits, misses, frees (kernel invalidations), purges and bare tokens on
    one cache over gpupin.ko, with a region limit; another thread drains records with
    wait_invalidations.  No hang, nothing left pinned, counters add up."""
    import threading
    import time

    cache = RegistrationCache(device, memory, validate="both", max_regions=8)
    lock = threading.Lock()
    ptrs = [memory.alloc(ALLOC) for _ in range(16)]
    errors: list[BaseException] = []
    stop = threading.Event()

    def worker(n: int) -> None:
        rng = random.Random(n)
        try:
            for _ in range(400):
                i = rng.randrange(len(ptrs))
                op = rng.random()
                if op < 0.05:
                    with lock:
                        memory.free(ptrs[i])
                        ptrs[i] = memory.alloc(ALLOC)
                    continue
                if op < 0.07:
                    cache.purge()
                    continue
                with lock:
                    p = ptrs[i]
                try:
                    if op < 0.5:
                        tok = cache.fast_lookup(p + 8, 8)
                        if tok < 0:
                            tok = cache.miss(p + 8, 8, tok)
                        cache.release_token(tok)
                    else:
                        with cache.acquire(p, 8):
                            pass
                except gpupin.NotGpuMemory:
                    pass  # freed by another thread meanwhile
                except gpupin.BudgetExceeded:
                    pass  # all eight regions in use at once
        except BaseException as exc:  # reported below
            errors.append(exc)

    def drainer() -> None:
        while not stop.is_set():
            device.wait_invalidations(0.01)  # takes records the cache also reads: shares them
            cache.drain()

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
    d = threading.Thread(target=drainer)
    d.start()
    for t in threads:
        t.start()
    deadline = time.monotonic() + 600
    for t in threads:
        t.join(max(1.0, deadline - time.monotonic()))
    stop.set()
    d.join(30)
    assert not any(t.is_alive() for t in [*threads, d]), "a thread hung"
    assert not errors, errors[:3]
    st = cache.stats()
    assert st.in_use == 0 and st.acquires == st.hits + st.misses
    assert st.pins - st.unpins == st.regions == len(cache) <= 8
    cache.close()
    assert device.info().file_pins == 0
    for p in ptrs:
        memory.free(p)


# -- pins the kernel never invalidates (static exporters): the cache must not trust their word ----------


def test_pins_say_whether_the_kernel_invalidates_them(device: Device, memory: MemoryProvider) -> None:
    """The contract validate='kernel' relies on (GPUPIN_PIN_REVOCABLE): a non-persistent nv-p2p
    pin is invalidated when its memory goes, a persistent one never is."""
    va = memory.alloc(2 * MiB)
    pin = device.pin(va, MiB)
    assert pin.revocable and device.query(pin).revocable, "gpupin.ko must set GPUPIN_PIN_REVOCABLE here"
    device.unpin(pin)
    if device.info().persistent:
        p = device.pin(va, MiB, persistent=True)
        assert not p.revocable and not device.query(p).revocable
        device.unpin(p)
    memory.free(va)


def test_kernel_validation_follows_the_dmabuf_exporter(device: Device, memory: MemoryProvider) -> None:
    """validate='kernel' over dma-buf pins works for an exporter that revokes and is refused,
    with nothing left pinned, for one that holds the memory (NVIDIA's kind, and the
    simulator's by default)."""
    need_dmabuf_export(memory)
    va = memory.alloc(2 * MiB)
    fd = memory.export_dmabuf(va)  # type: ignore[attr-defined]
    try:
        probe = device.pin_dmabuf(fd, user_tag=va)
    finally:
        os.close(fd)
    revocable = probe.revocable
    device.unpin(probe)
    cache = RegistrationCache(device, memory, validate="kernel", backend="dmabuf")
    if revocable:
        with cache.acquire(va, 10) as r:
            h1 = r.handle
            assert device.query(h1).revocable
        memory.free(va)
        va2 = memory.alloc(2 * MiB)
        with cache.acquire(va2, 10) as r:
            assert r.handle != h1 and r.valid
        assert cache.stats().invalidations_kernel + cache.stats().invalidations_buffer_id == 1
        cache.close()
        memory.free(va2)
    else:
        with pytest.raises(gpupin.NotRevocable, match="validate='buffer_id' or 'both'"):
            cache.acquire(va, 10)
        assert device.info().file_pins == 0 and len(cache) == 0
        checked = RegistrationCache(device, memory, validate="both", backend="dmabuf")
        with checked.acquire(va, 10) as r:
            assert r.valid
        checked.close()
        cache.close()
        memory.free(va)
    assert device.info().file_pins == 0 and (NATIVE or sim_stats().dmabuf_exports == 0)
