"""RegistrationCache scenarios (after UCX's and libfabric's cache tests) on FakeDevice/FakeMemory."""

from __future__ import annotations

import errno
import os
import random
import threading
from typing import Any

import pytest

import gpupin
from gpupin.cache import CacheFull, RegistrationCache
from gpupin.gds import CuFileDriver, GdsCache
from gpupin.testing.fake import GPU_PAGE, FakeCuFile, FakeDevice, FakeEvent, FakeMemory, FakePin

MiB = 1 << 20


def make(**kw):  # type: ignore[no-untyped-def]
    mem = FakeMemory()
    dev = FakeDevice(mem, bar_size=kw.pop("bar_size", 0))
    return mem, dev, RegistrationCache(dev, mem, **kw)


def counters(cache: RegistrationCache, **expected: int) -> None:
    st = cache.stats()
    got = {k: getattr(st, k) for k in expected}
    assert got == expected


@pytest.mark.parametrize("validate", ["kernel", "buffer_id", "both"])
def test_hit_and_subrange_hit(validate: str) -> None:
    mem, dev, cache = make(validate=validate)
    a = mem.alloc(MiB)
    r1 = cache.acquire(a, 100)
    assert (r1.aligned_va, r1.aligned_size) == (a, MiB) and r1.valid and r1.offset == 0
    r1.release()
    with cache.acquire(a + 4096, 8192) as r2:  # inside the same allocation
        assert r2.handle == r1.handle and r2.offset == 4096
    with cache.acquire(a + MiB - 1, 1) as r3:  # last byte
        assert r3.handle == r1.handle
    counters(cache, acquires=3, hits=2, misses=1, pins=1, unpins=0, regions=1, bytes_pinned=MiB)
    assert dev.pin_calls == 1


def test_end_of_range_and_spanning_refused() -> None:
    mem, dev, cache = make()
    a = mem.alloc(MiB)
    b = mem.alloc(MiB)
    assert b == a + MiB  # adjacent allocations
    cache.acquire(a, 10).release()
    with pytest.raises(gpupin.InvalidArgument, match="runs past its allocation"):
        cache.acquire(a + MiB - 10, 20)  # spans a and b
    with cache.acquire(b, 10) as rb:  # adjacent: its own entry
        assert rb.aligned_va == b
    counters(cache, misses=3, hits=0, pins=2, regions=2)


def test_refcount_and_in_use_not_evicted() -> None:
    mem, dev, cache = make(max_regions=2)
    bufs = [mem.alloc(GPU_PAGE) for _ in range(3)]
    r0 = cache.acquire(bufs[0], 1)
    r0b = cache.acquire(bufs[0], 1)
    r1 = cache.acquire(bufs[1], 1)
    counters(cache, in_use=2, regions=2)
    with pytest.raises(CacheFull, match="all 2 in use"):
        cache.acquire(bufs[2], 1)
    r0.release()
    with pytest.raises(CacheFull):  # r0b still holds entry 0
        cache.acquire(bufs[2], 1)
    r0b.release()
    r0b.release()  # a second release is a no-op
    r2 = cache.acquire(bufs[2], 1)  # evicts entry 0, the only unused one
    counters(cache, evictions_limit=1, unpins=1, regions=2, in_use=2)
    assert r1.valid and r2.valid
    r1.release()
    r2.release()


def test_lru_order() -> None:
    mem, dev, cache = make(max_regions=3)
    bufs = [mem.alloc(GPU_PAGE) for _ in range(4)]
    for b in bufs[:3]:
        cache.acquire(b, 1).release()
    cache.acquire(bufs[0], 1).release()  # 0 is now most recent; 1 is the LRU
    cache.acquire(bufs[3], 1).release()  # evicts 1
    cache.acquire(bufs[0], 1).release()
    cache.acquire(bufs[2], 1).release()
    counters(cache, hits=3, misses=4, evictions_limit=1)
    cache.acquire(bufs[1], 1).release()  # 1 was evicted: a miss, evicting 3
    counters(cache, misses=5, evictions_limit=2)
    cache.acquire(bufs[0], 1).release()
    counters(cache, hits=4)


def test_limit_by_bytes() -> None:
    mem, dev, cache = make(max_bytes=2 * MiB)
    a, b, c = (mem.alloc(MiB) for _ in range(3))
    for p in (a, b, c):
        cache.acquire(p, 1).release()
    counters(cache, regions=2, bytes_pinned=2 * MiB, peak_bytes=2 * MiB, evictions_limit=1)
    with pytest.raises(CacheFull, match="more than max_bytes"):
        cache.acquire(mem.alloc(3 * MiB), 1)


def test_evict_and_retry_under_bar_pressure() -> None:
    mem, dev, cache = make(bar_size=3 * MiB)
    bufs = [mem.alloc(MiB) for _ in range(6)]
    for p in bufs:
        cache.acquire(p, 1).release()
    st = cache.stats()
    assert st.pin_failures == 3 and st.evictions_pressure == 3 and st.regions == 3
    assert dev.bar_used == 3 * MiB


def test_clean_error_when_all_in_use_under_pressure() -> None:
    mem, dev, cache = make(bar_size=2 * MiB)
    held = [cache.acquire(mem.alloc(MiB), 1) for _ in range(2)]
    with pytest.raises(gpupin.BarExhausted, match=r"nothing is evictable: 2097152 bytes pinned in 2 regions, 2 in use"):
        cache.acquire(mem.alloc(MiB), 1)
    for r in held:
        r.release()


@pytest.mark.parametrize(
    "validate,reason",
    [("kernel", "invalidations_kernel"), ("buffer_id", "invalidations_buffer_id"), ("both", "invalidations_kernel")],
)
def test_same_va_reuse_misses(validate: str, reason: str) -> None:
    mem, dev, cache = make(validate=validate)
    a = mem.alloc(MiB)
    r = cache.acquire(a, 64)
    h = r.handle
    r.release()
    mem.free(a)
    a2 = mem.alloc(MiB)
    assert a2 == a
    r2 = cache.acquire(a2, 64)
    assert r2.handle != h and r2.valid
    counters(cache, misses=2, hits=0, pins=2, unpins=1, regions=1, **{reason: 1})
    r2.release()


def test_buffer_id_checked_at_the_pointer_not_the_base() -> None:
    """A freed allocation replaced by two smaller ones: the second starts inside the old entry."""
    mem, dev, cache = make(validate="buffer_id")
    a = mem.alloc(2 * MiB)
    cache.acquire(a, 1).release()
    mem.free(a)
    x = mem.alloc(MiB)
    y = mem.alloc(MiB)
    assert (x, y) == (a, a + MiB)
    with cache.acquire(y + 10, 10) as r:
        assert r.aligned_va == y and r.aligned_size == MiB
    counters(cache, invalidations_buffer_id=1, misses=2)


def test_freed_allocation_is_refused() -> None:
    mem, dev, cache = make(validate="buffer_id")
    a = mem.alloc(MiB)
    cache.acquire(a, 1).release()
    mem.free(a)
    with pytest.raises(gpupin.NotGpuMemory):
        cache.acquire(a, 1)
    counters(cache, regions=0, unpins=1, invalidations_buffer_id=1)
    assert dev.live_pins == 0


def test_invalidated_while_in_use() -> None:
    mem, dev, cache = make(validate="kernel")
    a = mem.alloc(MiB)
    r = cache.acquire(a, 1)
    mem.free(a)
    assert not r.valid
    a2 = mem.alloc(MiB)
    r2 = cache.acquire(a2, 1)  # new entry; the old one waits for its holder
    assert r2.valid and r2.handle != r.handle
    counters(cache, regions=1, unpins=0, in_use=2)
    r.release()  # last release cleans it up
    counters(cache, unpins=1, in_use=1)
    assert r.handle not in dev.pins
    r2.release()


def test_drain_releases_freed_entries_promptly() -> None:
    mem, dev, cache = make(validate="kernel")
    bufs = [mem.alloc(MiB) for _ in range(4)]
    for p in bufs:
        cache.acquire(p, 1).release()
    mem.free(bufs[1])
    mem.free(bufs[2])
    assert cache.drain() == 2
    counters(cache, regions=2, unpins=2, invalidations_kernel=2)
    assert len(dev.pins) == 2


def test_vmm_like_chunks_are_separate_entries() -> None:
    """Chunks mapped back to back have their own ranges and ids: one entry each, no merging."""
    mem, dev, cache = make()
    base = mem.alloc(2 * MiB)
    mem.free(base)
    c0 = mem.alloc(MiB, at=base)
    c1 = mem.alloc(MiB, at=base + MiB)
    with cache.acquire(c0, 10) as r0, cache.acquire(c1, 10) as r1:
        assert r0.handle != r1.handle and r0.aligned_size == r1.aligned_size == MiB
    with pytest.raises(gpupin.InvalidArgument):
        cache.acquire(c0 + MiB - 4, 8)
    mem.free(c1)  # unmap + remap: a new id
    c1b = mem.alloc(MiB, at=base + MiB)
    with cache.acquire(c1b, 10):
        pass
    counters(cache, misses=4, pins=3, invalidations_kernel=1)


def test_sync_memops_once_per_allocation() -> None:
    mem, dev, cache = make()
    a = mem.alloc(MiB)
    for off in (0, 100, 4096):
        cache.acquire(a + off, 1).release()
    cache.purge()
    cache.acquire(a, 1).release()  # re-pinned: same allocation, no second call
    assert mem.sync_memops_calls == 1


def test_purge_and_exact_stats() -> None:
    mem, dev, cache = make()
    bufs = [mem.alloc(GPU_PAGE * (i + 1)) for i in range(5)]
    held = cache.acquire(bufs[0], 1)
    for p in bufs:
        cache.acquire(p, 1).release()
    assert cache.purge() == 4
    counters(
        cache,
        acquires=6,
        hits=1,
        misses=5,
        pins=5,
        unpins=4,
        regions=1,
        bytes_pinned=GPU_PAGE,
        peak_bytes=GPU_PAGE * 15,
        in_use=1,
        pin_failures=0,
        evictions_limit=0,
        evictions_pressure=0,
    )
    held.release()


def test_bad_arguments() -> None:
    mem, dev, cache = make()
    with pytest.raises(gpupin.InvalidArgument, match="size must be > 0"):
        cache.acquire(mem.alloc(1), 0)
    with pytest.raises(gpupin.InvalidArgument, match="validate"):
        RegistrationCache(dev, mem, validate="sometimes")  # type: ignore[arg-type]
    with pytest.raises(gpupin.NotGpuMemory):
        cache.acquire(0x1234, 1)


def test_dma_map_once_per_entry_and_peer() -> None:
    mem, dev, cache = make()
    a = mem.alloc(MiB)
    with cache.acquire(a, 1) as r:
        m1 = r.dma_map("0000:00:03.0")
        assert r.dma_map("0000:00:03.0") is m1
        assert r.dma_map("0000:00:04.0") is not m1


def test_threads_hammering() -> None:
    mem, dev, cache = make(max_regions=8, validate="both")
    bufs = [mem.alloc(GPU_PAGE) for _ in range(16)]
    lock = threading.Lock()
    errors: list[BaseException] = []
    frees = [0]

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(2000):
                i = rng.randrange(16)
                op = rng.random()
                if op < 0.02:
                    with lock:  # free and reallocate at the same address
                        mem.free(bufs[i])
                        bufs[i] = mem.alloc(GPU_PAGE, at=bufs[i])
                        frees[0] += 1
                    continue
                with lock:
                    p = bufs[i]
                try:
                    r = cache.acquire(p, 16)
                except (CacheFull, gpupin.NotGpuMemory):
                    continue
                r.release()
        except BaseException as exc:  # noqa: B036 - handed to the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    st = cache.stats()
    assert st.in_use == 0 and st.regions <= 8
    assert st.hits + st.misses == st.acquires == 4 * 2000 - frees[0]
    assert st.pins - st.unpins == st.regions == len(dev.pins)
    assert st.invalidations_kernel + st.invalidations_buffer_id > 0
    cache.purge()
    assert len(dev.pins) == 0 and cache.stats().bytes_pinned == 0


def test_fork_child_starts_empty() -> None:
    mem, dev, cache = make()
    a = mem.alloc(MiB)
    cache.acquire(a, 1).release()
    pid = os.fork()
    if pid == 0:
        ok = len(cache) == 0 and cache.stats().regions == 0
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert len(cache) == 1


def test_close_unpins_everything_and_refuses_use() -> None:
    mem, dev, cache = make()
    a, b = mem.alloc(MiB), mem.alloc(MiB)
    cache.acquire(a, 1).release()
    cache.acquire(b, 1).release()
    assert len(dev.pins) == 2
    cache.close()
    assert len(dev.pins) == 0 and cache.stats().unpins == 2
    with pytest.raises(gpupin.InvalidArgument, match="closed"):
        cache.acquire(a, 1)
    with pytest.raises(gpupin.InvalidArgument, match="closed"):
        cache.fast_lookup(a, 1)
    cache.close()  # idempotent


def test_close_refuses_while_a_registration_is_held() -> None:
    """A held registration may have DMA or IO in flight: close() says InUse and changes
    nothing (the pin, the hit path, the other entries stay); after the release it closes."""
    mem, dev, cache = make()
    a, b = mem.alloc(MiB), mem.alloc(MiB)
    held = cache.acquire(a, 1)
    tok = cache.fast_lookup(b + 5, 1)
    if tok < 0:
        tok = cache.miss(b + 5, 1, tok)
    with pytest.raises(gpupin.InUse, match="2 registration") as ei:
        cache.close()
    assert ei.value.errno == errno.EBUSY
    assert len(dev.pins) == 2 and held.valid and cache.stats().unpins == 0
    again = cache.fast_lookup(a, 1)  # still open: a hit
    assert again == held.token
    cache.release_token(again)
    held.release()
    with pytest.raises(gpupin.InUse, match="1 registration"):
        cache.close()
    cache.release_token(tok)
    cache.close()
    assert len(dev.pins) == 0 and cache.stats().unpins == 2
    held.release()  # a second release of a Registration does nothing
    with pytest.raises(gpupin.InvalidArgument, match="closed"):
        cache.release_token(tok)  # a token after close is an error, not silently taken


def test_python_buffer_id_check_cache_is_freed_without_gc() -> None:
    import gc
    import weakref

    mem, dev, cache = make(validate="both")
    cache.acquire(mem.alloc(MiB), 1).release()
    ref = weakref.ref(cache)
    gc.disable()
    try:
        del cache
        assert ref() is None, "a reference cycle keeps the cache (and the validity map export) alive"
    finally:
        gc.enable()


@pytest.mark.parametrize(
    "space, unit, units",
    [
        (1 << 20, 16, 64),  # small ranges, many in one 64 KiB page of the core's hash
        (1 << 14, 1 << 16, 200),  # up to 12.5 MiB: ranges over many hashed pages
        (1 << 30, 1 << 21, 3),  # sparse, aligned, in a 2**51-byte space
        (1 << 12, 1 << 24, 8),  # up to 112 MiB: some past the hash's 32 MiB, found by the sorted index
    ],
)
def test_core_index_matches_a_model(space: int, unit: int, units: int) -> None:
    """The C core's index (insert, remove, evict, lookup, find, overlap; the sorted starts
    and the page hash) against a plain Python model, over random operations on up to 300
    ranges."""
    from gpupin._native import ffi, lib

    words = ffi.new("uint64_t[]", 8)
    c = ffi.gc(lib.gpc_new(words, 8, 0, 0), lib.gpc_free)
    rng = random.Random(7)
    model: dict[int, tuple[int, int]] = {}  # token -> [start, end)
    refs: dict[int, int] = {}
    order: list[int] = []  # unreferenced tokens, least recently released first
    free_ids: list[int] = []
    next_id = reused = 0

    def covering(p: int, size: int = 1) -> int:
        return next((t for t, (s, e) in model.items() if s <= p and p + size <= e), -1)

    def retire(tok: int) -> None:
        assert lib.gpc_retire(c, tok) == 0
        free_ids.append(tok & 0xFFFFFFFF)

    for step in range(6000):
        op = rng.random()
        if op < 0.35 and len(model) < 300:
            start = rng.randrange(0, space) * unit
            end = start + rng.randrange(1, units) * unit
            slot = free_ids.pop() if free_ids else next_id
            reused += slot != next_id
            if any(s < end and start < e for s, e in model.values()):
                assert lib.gpc_insert(c, slot, start, end, 0, 0, 0) == -1  # overlaps are refused
                if slot != next_id:
                    free_ids.append(slot)
                    reused -= 1
                continue
            tok = lib.gpc_insert(c, slot, start, end, 0, 0, 0)
            assert tok >= 0 and tok & 0xFFFFFFFF == slot
            assert lib.gpc_insert(c, slot, start + space * unit * 4, end + space * unit * 4, 0, 0, 0) == -1
            next_id += slot == next_id
            model[tok], refs[tok] = (start, end), 0
            order.append(tok)
        elif op < 0.45 and model:
            t = rng.choice(list(model))
            assert lib.gpc_remove(c, t) == 0
            del model[t]
            order.remove(t)
            retire(t)
        elif op < 0.5:
            got = lib.gpc_evict_lru(c)
            assert got == (order[0] if order else -1), step  # least recently released first
            if got >= 0:
                del model[got]
                order.pop(0)
                assert lib.gpc_remove(c, got) == -1  # out of the index already
                retire(got)
        else:
            # Mostly addresses inside some range (hits), some anywhere (misses).
            if model and rng.random() < 0.7:
                s, e = model[rng.choice(list(model))]
                p = rng.randrange(s, e)
            else:
                p = rng.randrange(0, space * unit + units * unit)
            size = rng.randrange(1, 2 * unit)
            want = covering(p, size)
            got = lib.gpc_lookup(c, p, size)
            assert got == (want if want >= 0 else -1), (step, p, size)
            if got >= 0:
                assert lib.gpc_refs(c, got) == 1 and lib.gpc_retire(c, got) == -1  # held: not reusable
                order.remove(got)
                assert lib.gpc_release(c, got) == 0
                order.append(got)
            assert lib.gpc_find(c, p) == covering(p)
            stop = p + size
            over = lib.gpc_overlap(c, p, stop)
            overlapping = {t for t, (s, e) in model.items() if s < stop and p < e}
            assert (over in overlapping) if overlapping else over == -1, (step, p, stop)
    assert model, "the walk should leave ranges behind"
    assert reused > 100, "the walk should reuse slots (under new generations)"


def test_fake_memory_first_fit_matches_a_model() -> None:
    """FakeMemory allocates first fit (the tests' address reuse depends on it), also on
    its fast path without gaps: against a brute-force model over random allocs and frees."""
    rng = random.Random(3)
    mem = FakeMemory(granule=16)
    live: dict[int, int] = {}
    for step in range(4000):
        if live and rng.random() < 0.4:
            va = rng.choice(list(live))
            mem.free(va)
            del live[va]
            continue
        size = rng.randrange(1, 200) * 16
        want = mem.BASE
        for b in sorted(live):
            if b - want >= size:
                break
            want = b + live[b]
        got = mem.alloc(size)
        assert got == want, step
        live[got] = size
    top = max(b + s for b, s in live.items())
    assert mem.alloc(16, at=top + 4096) == top + 4096  # leaves a gap: first fit finds it
    assert mem.alloc(16) == (min(b for b in _gaps(live)) if _gaps(live) else top)


def _gaps(live: dict[int, int]) -> list[int]:
    out, va = [], FakeMemory.BASE
    for b in sorted(live):
        if b - va >= 16:
            out.append(va)
        va = b + live[b]
    return out


def test_an_unknown_validate_mode_is_refused_naming_the_modes() -> None:
    """'tag' was the name of 'buffer_id' before the first release; no alias is kept."""
    mem = FakeMemory()
    dev = FakeDevice(mem)
    for bad in ("tag", "tags", ""):
        with pytest.raises(gpupin.InvalidArgument, match="'both', 'kernel' or 'buffer_id'"):
            RegistrationCache(dev, mem, validate=bad)  # type: ignore[arg-type]
    assert dev.live_pins == 0


# Each entry point over each fast path: the vectorcall entry points (C), the buffer-id check in
# Python, and the cffi calls where the vectorcall entry points are missing (gpc_bind None).
FAST_PATHS = ["c", "python", "cffi"]


def make_fast_path(kind: str, monkeypatch: pytest.MonkeyPatch) -> tuple[FakeMemory, RegistrationCache]:
    if kind == "cffi":
        monkeypatch.setattr(gpupin.cache, "gpc_bind", None)
    mem = FakeMemory()
    return mem, RegistrationCache(FakeDevice(mem), mem, validate="both" if kind == "python" else "kernel")


@pytest.mark.parametrize("kind", FAST_PATHS)
@pytest.mark.parametrize(
    ("ptr", "size", "bad"),
    [
        (-1, 8, "ptr=-1"),
        (1 << 64, 8, "ptr=18446744073709551616"),
        (0, -8, "size=-8"),
        (0, 1 << 64, "size=18446744073709551616"),
    ],
)
def test_out_of_range_arguments_are_invalid_not_overflow(
    kind: str, ptr: int, size: int, bad: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A negative address or size, or one of 2**64 or more, raised OverflowError (from cffi or
    the vectorcall entry points) out of acquire, lookup and fast_lookup: the cache's
    InvalidArgument, naming the value and what is taken."""
    mem, cache = make_fast_path(kind, monkeypatch)
    a = mem.alloc(MiB)
    if ptr == 0:
        ptr = a
    calls = {
        "acquire": lambda: cache.acquire(ptr, size),
        "lookup": lambda: cache.lookup(ptr, size),
        "fast_lookup": lambda: cache.fast_lookup(ptr, size),
        "miss": lambda: cache.miss(ptr, size, -1),
    }
    for name, call in calls.items():
        with pytest.raises(gpupin.InvalidArgument) as got:
            call()
        text = str(got.value)
        assert bad in text or bad.replace("=", "=0x") in text, (name, text)
        assert "2**64 - 1" in text, (name, text)
    assert cache.held() == 0
    cache.close()


@pytest.mark.parametrize("kind", FAST_PATHS)
@pytest.mark.parametrize("token", [1 << 63, 1 << 64, -(1 << 63) - 1])
def test_out_of_range_tokens_are_invalid_not_overflow(kind: str, token: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """release_token of an int that is no int64 raised OverflowError: InvalidArgument, naming it."""
    _, cache = make_fast_path(kind, monkeypatch)
    with pytest.raises(gpupin.InvalidArgument, match=rf"release_token\({token}\): not a token .*2\*\*62 - 1"):
        cache.release_token(token)
    cache.close()


@pytest.mark.parametrize("validate", ["buffer_id", "both"])
def test_valid_says_what_the_buffer_id_check_says(validate: str) -> None:
    """Registration.valid stayed True after a free and a new allocation at the same address
    for pins whose validity word never changes (a dma-buf the exporter holds): it now asks the
    buffer id, as a lookup would."""
    mem = FakeMemory()
    dev = FakeDevice(mem, dmabuf_revocable=False)
    cache = RegistrationCache(dev, mem, validate=validate, backend="dmabuf")  # type: ignore[arg-type]
    a = mem.alloc(MiB)
    reg = cache.acquire(a + 100, 10)
    assert reg.valid
    mem.free(a)
    assert not reg.valid  # freed: no allocation there
    assert mem.alloc(MiB) == a
    assert dev.pins[reg.handle].is_valid()  # the word alone says nothing
    assert not reg.valid  # another allocation there now
    with cache.acquire(a + 100, 10) as fresh:
        assert fresh.handle != reg.handle and fresh.valid
    reg.release()
    cache.close()


def test_valid_of_a_gds_registration_after_free_and_reallocation() -> None:
    """GDS registrations have no validity word at all: valid is the buffer-id check."""
    mem = FakeMemory()
    cache = GdsCache(CuFileDriver(FakeCuFile(mem)), mem)
    a = mem.alloc(MiB)
    reg = cache.acquire(a, MiB)
    assert reg.valid
    mem.free(a)
    assert mem.alloc(MiB) == a
    assert not reg.valid
    reg.release()
    cache.close()


@pytest.mark.parametrize("validate", ["kernel", "buffer_id", "both"])
def test_caches_sharing_a_device_each_get_their_own_records(validate: str) -> None:
    """The device hands each record to one reader, and a cache dropped the records of pins it
    did not own: a second cache over the same Device never heard its pins were freed.  Every
    record now reaches the cache that owns its pin, whichever cache reads the device."""
    mem = FakeMemory()
    dev = FakeDevice(mem)
    one = RegistrationCache(dev, mem, validate=validate)  # type: ignore[arg-type]
    two = RegistrationCache(dev, mem, validate=validate)  # type: ignore[arg-type]
    a, b = mem.alloc(MiB), mem.alloc(MiB)
    one.acquire(a, 8).release()
    two.acquire(b, 8).release()
    mem.free(a)
    mem.free(b)
    assert two.drain() == 1  # reads both records off the device; applies its own
    assert one.drain() == 1  # gets the one two read for it
    assert len(one) == len(two) == 0 and dev.pins == {}
    assert one.stats().invalidations_kernel == two.stats().invalidations_kernel == 1
    one.close()
    two.close()


def test_an_overflow_record_reaches_every_cache_over_the_device() -> None:
    """Records were lost (the kernel's queue overflowed): each cache must check its own pins, not
    only the one cache that happened to read the overflow record."""
    mem = FakeMemory()
    dev = FakeDevice(mem)
    caches = [RegistrationCache(dev, mem, validate="buffer_id") for _ in range(3)]
    ptrs = [mem.alloc(MiB) for _ in caches]
    for cache, p in zip(caches, ptrs, strict=True):
        cache.acquire(p, 8).release()
    for p in ptrs:
        mem.free(p)
    dev.events = [FakeEvent(0, 0, "overflow", 0)]  # the records of the frees were lost
    assert [c.drain() for c in caches] == [1, 1, 1]
    assert dev.pins == {}
    for cache in caches:
        cache.close()


def test_a_record_read_before_its_cache_took_the_handle_still_reaches_it() -> None:
    """A record read by another cache between a pin and its cache taking the handle waits for it."""
    mem = FakeMemory()
    dev = FakeDevice(mem)
    one = RegistrationCache(dev, mem, validate="buffer_id")
    two = RegistrationCache(dev, mem, validate="buffer_id")
    a = mem.alloc(MiB)
    real_pin = dev.pin

    def pin_then_free_then_other_reads(va: int, size: int, **kw: object) -> FakePin:
        p = real_pin(va, size, **kw)  # type: ignore[arg-type]
        dev.invalidate_range(a, a + MiB)  # freed at once: its record is queued
        two.drain()  # and read by the other cache before `one` indexed the pin
        return p

    dev.pin = pin_then_free_then_other_reads  # type: ignore[method-assign]
    one.acquire(a, 8).release()
    dev.pin = real_pin  # type: ignore[method-assign]
    assert one.drain() == 1 and len(one) == 0 and dev.pins == {}
    one.close()
    two.close()


def test_core_hands_the_query_its_context_and_checks_its_answer() -> None:
    """The hit path calls the provider's buffer-id query with the context the provider set
    (SimMemory's carries its fd), and a hit needs both a 0 return and the stored buffer id;
    NULL puts libcuda's query back (no libcuda here: every check then fails)."""
    from gpupin._native import ffi, lib

    c = ffi.gc(lib.gpc_new(ffi.NULL, 0, 0, 1), lib.gpc_free)
    ctx = ffi.new("uint64_t[2]", [0, 7])  # [calls, the buffer id the query reports]
    seen: list[int] = []

    @ffi.callback("gpc_buffer_id_query_t", error=-1)
    def query(qctx: Any, ptr: int, out: Any) -> int:
        seen.append(int(ffi.cast("uintptr_t", qctx)))
        box = ffi.cast("uint64_t *", qctx)
        box[0] += 1
        out[0] = box[1]
        return 0 if box[1] else 1

    lib.gpc_set_buffer_id_query(c, query, ctx)
    tok = lib.gpc_insert(c, 0, 1 << 20, 2 << 20, 7, 0, 0)
    assert tok >= 0
    assert lib.gpc_lookup(c, (1 << 20) + 64, 64) == tok  # a hit: its own buffer id
    assert seen == [int(ffi.cast("uintptr_t", ctx))] and ctx[0] == 1
    lib.gpc_release(c, tok)
    ctx[1] = 8  # another allocation there now
    assert lib.gpc_lookup(c, 1 << 20, 1) == -(tok + lib.GPC_STALE_BASE)
    ctx[1] = 0  # the query says "none there"
    assert lib.gpc_lookup(c, 1 << 20, 1) == -(tok + lib.GPC_STALE_BASE)
    assert ctx[0] == 3
    lib.gpc_set_buffer_id_query(c, ffi.NULL, ffi.NULL)  # libcuda's, which is not here
    assert lib.gpc_lookup(c, 1 << 20, 1) == -(tok + lib.GPC_STALE_BASE) and ctx[0] == 3
