"""GdsCache over the fake cuFile (gpupin.testing.fake.FakeCuFile: cuFile 1.15's measured behaviour)."""

from __future__ import annotations

import builtins
from typing import Any

import pytest

from gpupin.cache import CacheFull
from gpupin.errors import DriverNotLoaded, GdsError, InUse, InvalidArgument, NotGpuMemory, UnknownHandle
from gpupin.gds import CuFileDriver, GdsCache, GdsPolicy
from gpupin.testing.fake import FakeCuFile, FakeMemory

MiB = 1 << 20


def make(**kw: Any) -> tuple[FakeMemory, FakeCuFile, GdsCache]:
    mem = FakeMemory(granule=kw.pop("granule", 1 << 16))
    cf = FakeCuFile(mem, **{k: kw.pop(k) for k in ("bar_size", "max_pinned") if k in kw})
    cache = GdsCache(CuFileDriver(cf), mem, **kw)
    return mem, cf, cache


def test_whole_allocation_registered_once_and_hits_do_not_register() -> None:
    mem, cf, cache = make()
    p = mem.alloc(4 * MiB)
    for off in (0, 4096, MiB, 4 * MiB - 512):
        with cache.acquire(p + off, 512):
            pass
    assert cf.registered == {p: 4 * MiB}
    assert cf.register_calls == 1
    st = cache.stats()
    assert (st.acquires, st.hits, st.misses, st.pins, st.regions, st.bytes_pinned) == (4, 3, 1, 1, 1, 4 * MiB)
    tok = cache.fast_lookup(p + 100, 100)
    assert tok >= 0
    cache.release_token(tok)
    assert cf.register_calls == 1


def test_default_limit_is_cufiles_max_device_pinned_mem_size() -> None:
    _, _, cache = make(max_pinned=64 * MiB)
    assert cache.max_bytes == 64 * MiB
    _, _, cache = make(max_pinned=64 * MiB, max_bytes=8 * MiB)
    assert cache.max_bytes == 8 * MiB


def test_stale_registration_after_free_and_realloc_is_never_used() -> None:
    mem, cf, cache = make()
    p = mem.alloc(2 * MiB)
    cache.acquire(p, 8).release()
    old_id = mem.buffer_id(p)
    mem.free(p)
    q = mem.alloc(2 * MiB)
    assert q == p and mem.buffer_id(q) != old_id
    # cuFile alone would refuse the new memory (the freed address still counts as registered).
    with pytest.raises(FakeCuFile.cuFileError) as ei:
        cf.buf_register(q, 2 * MiB, 0)
    assert ei.value.status == 5023
    with cache.acquire(q, 8) as reg:
        assert reg._entry.buffer_id == mem.buffer_id(q)
    st = cache.stats()
    assert st.invalidations_buffer_id == 1 and st.pins == 2 and st.unpins == 1 and st.regions == 1
    assert cf.registered == {q: 2 * MiB} and cf.deregister_calls == 1


def test_stale_entry_held_in_use_is_superseded_not_deregistered_twice() -> None:
    mem, cf, cache = make()
    p = mem.alloc(MiB)
    held = cache.acquire(p, 8)  # an IO still holds the old registration
    mem.free(p)
    q = mem.alloc(MiB)
    assert q == p
    new = cache.acquire(q, 8)  # the address is deregistered and registered again
    assert cache.driver.superseded == 1
    held.release()  # the old entry goes; the new registration stays
    assert cf.registered == {q: MiB}
    new.release()
    cache.close()
    assert cf.registered == {}


def test_lru_eviction_by_count_and_bytes_and_in_use_never_evicted() -> None:
    mem, cf, cache = make(max_regions=2)
    a, b, c = (mem.alloc(MiB) for _ in range(3))
    cache.acquire(a, 8).release()
    cache.acquire(b, 8).release()
    cache.acquire(a, 8).release()  # b is now least recently used
    cache.acquire(c, 8).release()
    assert set(cf.registered) == {a, c}
    assert cache.stats().evictions_limit == 1
    ra, rc = cache.acquire(a, 8), cache.acquire(c, 8)
    with pytest.raises(CacheFull, match="release registrations first"):
        cache.acquire(b, 8)
    ra.release()
    rc.release()
    _, cf2, cache2 = make(max_bytes=3 * MiB)
    m2 = cache2.memory
    xs = [m2.alloc(MiB) for _ in range(4)]
    for x in xs:
        cache2.acquire(x, 8).release()
    assert sum(cf2.registered.values()) <= 3 * MiB and xs[0] not in cf2.registered


def test_pinned_memory_exhausted_evicts_lru_and_retries() -> None:
    mem, cf, cache = make(bar_size=2 * MiB)
    a, b, c = (mem.alloc(MiB) for _ in range(3))
    cache.acquire(a, 8).release()
    cache.acquire(b, 8).release()
    cache.acquire(c, 8).release()
    st = cache.stats()
    assert st.evictions_pressure == 1 and st.pin_failures == 1 and set(cf.registered) == {b, c}
    held = [cache.acquire(b, 8), cache.acquire(c, 8)]
    with pytest.raises(gpupin_bar_exhausted(), match="nothing is evictable"):
        cache.acquire(a, 8)
    for h in held:
        h.release()


def gpupin_bar_exhausted() -> type[Exception]:
    from gpupin.errors import BarExhausted

    return BarExhausted


def test_policy_leaves_small_one_shot_scarce_bar_and_oversized_buffers_unregistered() -> None:
    mem, cf, cache = make(max_pinned=64 * MiB, policy=GdsPolicy(min_size=MiB, bar_headroom=0.5))
    assert cache.advise(4 * MiB, reuse=10).register
    assert cache.advise(64 * 1024, reuse=10).reason == "small"
    assert cache.advise(4 * MiB, reuse=1).reason == "one-shot"
    assert cache.advise(128 * MiB, reuse=10).reason == "too-large"
    bar = cache.properties.bar1_bytes
    assert cache.advise(4 * MiB, reuse=10, bar_free=bar // 2).reason == "bar"
    small, big = mem.alloc(64 * 1024), mem.alloc(4 * MiB)
    u = cache.use(small, 4096, reuse=100)
    assert not u.registered and u.advice.reason == "small" and "bounce" in u.advice.detail
    u.release()
    with cache.buffer(big, 4096, reuse=1) as u:
        assert not u.registered and u.advice.reason == "one-shot"
    with cache.buffer(big, 4096, reuse=8) as u:
        assert u.registered and u.registration is not None and u.registration.ptr == big
    with cache.buffer(big, 4096, reuse=1) as u:  # cached already: a hit whatever the advice
        assert u.registered
    st = cache.stats()
    assert st.skipped == {"small": 1, "one-shot": 1}
    assert (st.acquires, st.hits, st.pins) == (4, 1, 1)
    assert list(cf.registered) == [big]


def test_policy_arguments_are_checked() -> None:
    for kw in ({"min_size": -1}, {"min_reuse": 0}, {"bar_headroom": 1.0}):
        with pytest.raises(InvalidArgument):
            GdsPolicy(**kw)  # type: ignore[arg-type]
    _, _, cache = make()
    with pytest.raises(InvalidArgument, match="size must be > 0"):
        cache.advise(0)


def test_bad_ranges_and_foreign_registrations_have_clear_errors() -> None:
    mem, cf, cache = make()
    p = mem.alloc(MiB)
    with pytest.raises(InvalidArgument, match="runs past its allocation"):
        cache.acquire(p, 2 * MiB)
    with pytest.raises(NotGpuMemory):
        cache.acquire(0x1000, 8)
    q = mem.alloc(MiB)
    cf.buf_register(q, MiB, 0)  # the application registered it itself
    with pytest.raises(GdsError, match="outside this cache") as ei:
        cache.acquire(q, 8)
    assert ei.value.status == 5023
    assert cache.stats().regions == 0


def test_close_deregisters_everything_and_closes_the_driver() -> None:
    mem, cf, cache = make()
    ptrs = [mem.alloc(MiB) for _ in range(5)]
    held = cache.acquire(ptrs[0], 8)
    for p in ptrs[1:]:
        cache.acquire(p, 8).release()
    with pytest.raises(InUse, match="1 registration"):
        cache.driver.close()  # an IO may still run through the held buffer: nothing closes
    assert len(cf.registered) == 5 and cf.opened == 1
    held.release()
    cache.driver.close()
    assert cf.registered == {}
    assert cf.opened == 0
    with pytest.raises(InvalidArgument, match="closed"):
        cache.acquire(ptrs[0], 8)


def test_driver_errors_and_missing_cuda_python(monkeypatch: pytest.MonkeyPatch) -> None:
    mem = FakeMemory()
    drv = CuFileDriver(FakeCuFile(mem))
    with pytest.raises(GdsError, match="CUDA_POINTER_INVALID") as ei:
        drv.pin(0x1000, 4096)
    assert ei.value.status == 5012
    with pytest.raises(UnknownHandle, match="not a registration"):
        drv.unpin(99)
    with pytest.raises(InvalidArgument, match="validate='buffer_id'"):
        drv.validity_map()
    real_import = builtins.__import__

    def no_cuda(name: str, *a: Any, **kw: Any) -> Any:
        if name.startswith("cuda"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_cuda)
    with pytest.raises(DriverNotLoaded, match="pip install nvidia-cufile"):
        CuFileDriver()


def test_file_reads_land_in_registered_and_unregistered_buffers(tmp_path: Any) -> None:
    from gpupin.gds import GdsFile

    mem, cf, cache = make(policy=GdsPolicy(min_size=MiB))
    path = tmp_path / "data.bin"
    payload = bytes(range(256)) * 4096 * 2  # 2 MiB
    path.write_bytes(payload)
    big, small = mem.alloc(2 * MiB), mem.alloc(64 * 1024)
    with GdsFile(cache.driver, str(path)) as f:
        with cache.buffer(big + 4096, MiB, reuse=4) as u:
            assert u.registered
            assert f.read(u, MiB, offset=MiB) == MiB
        assert mem.read(big + 4096, MiB) == payload[MiB : 2 * MiB]
        with cache.buffer(small, 4096) as u:
            assert not u.registered
            assert f.read(u, 4096, offset=8192) == 4096
        assert mem.read(small, 4096) == payload[8192 : 8192 + 4096]
    cf.handle_register_status = 5027
    with pytest.raises(GdsError, match="ID_FS_USAGE") as ei:
        GdsFile(cache.driver, str(path))
    assert ei.value.status == 5027
    with pytest.raises(GdsError, match="No such file") as e2:
        GdsFile(cache.driver, str(tmp_path / "missing"))
    assert "O_DIRECT (tmpfs" not in str(e2.value)


def test_allocation_bounds_are_registered_exactly() -> None:
    mem, cf, cache = make(granule=1)
    p = mem.alloc(300_000)  # like a pool block: no 64 KiB rounding
    with cache.acquire(p + 1000, 1000) as r:
        assert (r.aligned_va, r.aligned_size) == (p, 300_000)
    assert cf.registered == {p: 300_000}


def test_threads_using_new_buffers_at_once_never_supersede_live_ones() -> None:
    import threading

    mem, cf, cache = make()
    cf.register_latency = 0.001  # widen the window between a miss and its insert
    ptrs = [mem.alloc(1 << 20) for _ in range(20)]
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            for i in range(200):
                p = ptrs[(seed * 7 + i) % len(ptrs)]
                with cache.acquire(p + 64, 64) as r:
                    assert r.valid
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    st = cache.stats()
    assert cache.driver.registrations == 20 and cache.driver.superseded == 0
    assert st.invalidations_buffer_id == 0 and st.pins == 20 and st.regions == 20
    assert (st.acquires, st.hits, st.misses) == (800, 780, 20)
    assert set(cf.registered) == set(ptrs)


def test_one_cache_per_driver_and_closing_the_driver_closes_it() -> None:
    mem, cf, cache = make()
    with pytest.raises(InvalidArgument, match="already has a GdsCache"):
        GdsCache(cache.driver, mem)
    p = mem.alloc(1 << 20)
    cache.acquire(p, 8).release()
    cache.driver.close()  # deregisters through the cache, then closes cuFile
    assert cf.registered == {} and cf.opened == 0
    with pytest.raises(InvalidArgument, match="closed"):
        cache.acquire(p, 8)


def test_buffer_over_the_per_buffer_limit_is_an_error_not_an_eviction() -> None:
    mem, cf, cache = make(max_pinned=4 * MiB, max_bytes=0)
    small = [mem.alloc(MiB) for _ in range(3)]
    for p in small:
        cache.acquire(p, 8).release()
    big = mem.alloc(8 * MiB)
    with pytest.raises(GdsError, match="max_device_pinned_mem_size") as ei:
        cache.acquire(big, 8)
    assert ei.value.status == 5016
    st = cache.stats()
    assert st.regions == 3 and st.evictions_pressure == 0 and set(cf.registered) == set(small)


def test_failed_deregistration_keeps_the_record_and_recovers() -> None:
    mem, cf, cache = make()
    p = mem.alloc(MiB)
    cache.acquire(p, 8).release()
    cf.deregister_status = 5030
    with pytest.raises(GdsError, match="cuFileBufDeregister") as ei:
        cache.purge()
    assert ei.value.status == 5030
    st = cache.stats()
    assert st.regions == 0 and st.unpins == 1 and p in cf.registered  # cuFile still has it
    with cache.acquire(p, 8):  # the driver deregisters the leftover, then registers
        pass
    assert cf.registered == {p: MiB} and cache.driver.superseded == 1


@pytest.mark.parametrize("held", [False, True])
def test_stale_registration_is_dropped_even_when_the_new_buffer_is_left_unregistered(held: bool) -> None:
    mem, cf, cache = make(policy=GdsPolicy(min_size=MiB))
    p = mem.alloc(4 * MiB)
    u = cache.use(p, 4096, reuse=8)
    assert u.registered
    if not held:
        u.release()
    mem.free(p)
    q = mem.alloc(64 * 1024)  # the same address, now too small to register
    assert q == p
    v = cache.use(q, 4096, reuse=8)
    assert not v.registered and v.advice.reason == "small"
    assert q not in cf.registered  # an IO here must not use the freed memory's registration
    u.release()  # (a no-op when it was released already)
    assert cf.registered == {} and cache.stats().regions == 0
