"""The registration cache's lifetime model: tokens, fast paths, close, fork, threads.

Each test names the defect it pins down; each failed on the code before the fix (a crash or
a hang shows as a failed fork child or a thread that never finished, never as a hung pytest).
"""

from __future__ import annotations

import errno
import gc
import os
import random
import threading
import time
from typing import Any

import pytest

import gpupin
from gpupin._native import lib
from gpupin.cache import RegistrationCache
from gpupin.gds import CuFileDriver, GdsCache
from gpupin.testing import in_child
from gpupin.testing.fake import GPU_PAGE, FakeCuFile, FakeDevice, FakeMemory, FakePin

MiB = 1 << 20


def make(**kw: Any) -> tuple[FakeMemory, FakeDevice, RegistrationCache]:
    mem = FakeMemory()
    dev = FakeDevice(mem)
    return mem, dev, RegistrationCache(dev, mem, **kw)


def token(cache: RegistrationCache, ptr: int, size: int = 1) -> int:
    tok = cache.fast_lookup(ptr, size)
    return cache.miss(ptr, size, tok) if tok < 0 else tok


# -- a saved fast path outlives the cache ---------------------------------------------------
def test_a_saved_fast_path_after_the_cache_is_dropped_raises_instead_of_crashing() -> None:
    """fast_lookup kept, the cache dropped without close(), the validity map unmapped: the
    bound entry point must not read the unmapped map (SIGSEGV before).  In a fork child, so
    a crash fails this test instead of killing pytest."""

    def child() -> int:
        mem = FakeMemory()
        dev = FakeDevice(mem)
        cache = RegistrationCache(dev, mem, validate="kernel")
        a = mem.alloc(MiB)
        cache.release_token(token(cache, a))
        fl, rel = cache.fast_lookup, cache.release_token
        del cache
        gc.collect()
        dev._words.release()
        dev._map.close()  # what Device.close() does: the map is gone
        try:
            fl(a, 1)
            return 3
        except gpupin.InvalidArgument as exc:
            if "closed" not in str(exc):
                return 4
        try:
            rel(1 << 32)
            return 5
        except gpupin.InvalidArgument:
            pass
        return 0 if len(dev.pins) == 0 else 2  # the dropped cache's unheld pin went

    assert in_child(child) == 0


def test_a_dropped_cache_unpins_what_nobody_holds_and_keeps_what_a_token_holds() -> None:
    mem, dev, cache = make()
    a, b = mem.alloc(MiB), mem.alloc(MiB)
    cache.acquire(a, 1).release()
    tok = token(cache, b)  # a bare token: does not keep the cache alive
    fl = cache.fast_lookup
    del cache
    gc.collect()
    assert [p.va for p in dev.pins.values()] == [b]  # b's pin may still be in use: kept
    with pytest.raises(gpupin.InvalidArgument, match="closed"):
        fl(a, 1)
    del tok


# -- tokens carry a generation ----------------------------------------------------------
def test_a_doubled_release_after_the_slot_was_reused_is_refused() -> None:
    """Token ABA: a second release_token of an entry whose slot now holds another entry
    used to drop that entry's reference, leaving it evictable (and unpinned) while held."""
    mem, dev, cache = make()
    a, b = mem.alloc(MiB), mem.alloc(MiB)
    old = token(cache, a)
    cache.release_token(old)
    assert cache.purge() == 1  # a's entry goes; its slot is free
    new = token(cache, b)  # the same slot, a new entry, held
    with pytest.raises(gpupin.InvalidArgument, match="not a held token"):
        cache.release_token(old)
    assert cache.purge() == 0 and len(dev.pins) == 1  # b is still held: not evicted
    assert cache.stats().in_use == 1
    reg = cache.acquire(b, 1)
    assert reg.token == new
    reg.release()
    reg.release()  # a Registration releases once
    cache.release_token(new)
    with pytest.raises(gpupin.InvalidArgument, match="not a held token"):
        cache.release_token(new)  # a doubled release of an unreferenced entry
    cache.close()


def test_a_slot_with_references_is_never_reused() -> None:
    """An entry invalidated while held keeps its slot until its last release."""
    mem, dev, cache = make()
    a = mem.alloc(MiB)
    held = cache.acquire(a, 1)
    mem.free(a)
    a2 = mem.alloc(MiB)
    assert a2 == a
    fresh = cache.acquire(a2, 1)  # the old entry went stale (still held), a new one came
    assert fresh.token & 0xFFFFFFFF != held.token & 0xFFFFFFFF
    assert not held.valid and fresh.valid
    held.release()
    fresh.release()
    cache.close()


def test_reference_count_overflow_is_an_error() -> None:
    mem, dev, cache = make(validate="kernel")
    a = mem.alloc(MiB)
    lib.gpc_set_max_refs(cache.core, 3)
    toks = [token(cache, a) for _ in range(3)]
    assert cache.fast_lookup(a, 1) == lib.GPC_TOO_MANY_REFS
    with pytest.raises(gpupin.InvalidArgument, match="held 2147483647 times"):
        cache.acquire(a, 1)
    for t in toks:
        cache.release_token(t)
    cache.acquire(a, 1).release()
    cache.close()


def test_generations_never_wrap_to_a_token_given_out_before() -> None:
    """Generations wrapped to 1 after 2**30 - 1 inserts: a slot then got a token it had had
    before, and a late release of the old token dropped the new entry's reference.  Running
    out of generations is now an error (CacheExhausted) and nothing is left pinned by it."""
    mem, dev, cache = make(validate="kernel")
    a = mem.alloc(MiB)
    first = token(cache, a)  # slot 0, generation 1
    cache.release_token(first)
    assert cache.purge() == 1  # slot 0 is free again
    lib.gpc_set_gen(cache.core, (1 << 30) - 2)
    last = token(cache, a)  # the last generation there is
    assert last >> 32 == (1 << 30) - 1 and last & 0xFFFFFFFF == first & 0xFFFFFFFF
    cache.release_token(last)
    assert cache.purge() == 1
    pins = len(dev.pins)
    with pytest.raises(gpupin.CacheExhausted, match=r"2\*\*30 - 1 entries.*make a new cache"):
        again = token(cache, a)  # before: generation 1 again, the same token as the first
        assert again != first, "a token came back: a late release of the first would drop this one"
    assert len(dev.pins) == pins and cache.held() == 0
    cache.close()
    assert dev.pins == {}


# -- close() and held registrations -----------------------------------------------------
def test_a_fork_child_with_a_closed_cache_finds_it_closed() -> None:
    mem, dev, cache = make(validate="kernel")
    a = mem.alloc(MiB)
    cache.acquire(a, 1).release()
    fl = cache.fast_lookup
    cache.close()

    def child() -> int:
        for call in (lambda: cache.acquire(a, 1), lambda: fl(a, 1), lambda: cache.lookup(a, 1)):
            try:
                call()
                return 2
            except gpupin.InvalidArgument as exc:
                if "closed" not in str(exc):
                    return 3
        cache.close()
        return 0 if cache.device is dev else 4  # no device of its own was opened

    assert in_child(child) == 0


# -- the GIL while waiting for the core ---------------------------------------------------
def test_the_hit_path_waits_for_a_busy_core_without_the_gil() -> None:
    """A thread whose fast_lookup finds the core's mutex taken must let other threads run
    (before, it waited holding the GIL: here the holder could never let go).  In a child,
    so the old deadlock is a failed test."""

    def child() -> int:
        mem, dev, cache = make(validate="kernel")
        a = mem.alloc(MiB)
        cache.release_token(token(cache, a))
        got: list[int] = []
        lib.gpc_lock(cache.core)  # a cffi call: returns holding the core's mutex
        t = threading.Thread(target=lambda: got.append(cache.fast_lookup(a, 1)))
        t.start()
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:  # this thread must get to run meanwhile
            time.sleep(0.01)
        lib.gpc_unlock(cache.core)
        t.join(10)
        if t.is_alive() or len(got) != 1 or got[0] < 0:
            return 2
        cache.release_token(got[0])
        return 0

    assert in_child(child, timeout=30) == 0


# -- smaller defects ------------------------------------------------------------------------
class Index:
    """An int-like without being an int (numpy.uint64 and friends)."""

    def __init__(self, v: int) -> None:
        self.v = v

    def __index__(self) -> int:
        return self.v


def test_fast_lookup_takes_what_lookup_takes() -> None:
    mem, dev, cache = make()
    a = mem.alloc(MiB)
    t1 = cache.lookup(Index(a), Index(8))  # type: ignore[arg-type]
    t2 = cache.fast_lookup(Index(a), Index(8))  # type: ignore[arg-type]
    assert t1 == t2 >= 0
    cache.release_token(t1)
    cache.release_token(t2)
    with pytest.raises(TypeError):
        cache.fast_lookup("0x1000", 1)  # type: ignore[arg-type]
    cache.close()


class FlakyBufferId(FakeMemory):
    """A provider whose buffer-id query can fail with something other than NotGpuMemory."""

    fail = False

    def buffer_id(self, ptr: int) -> int:
        if self.fail:
            raise OSError(errno.EIO, "cuPointerGetAttribute failed")
        return super().buffer_id(ptr)


def test_a_failing_buffer_id_check_on_a_hit_keeps_no_reference() -> None:
    mem = FlakyBufferId()
    dev = FakeDevice(mem)
    cache = RegistrationCache(dev, mem, validate="both")
    a = mem.alloc(MiB)
    cache.acquire(a, 1).release()
    mem.fail = True
    with pytest.raises(OSError):
        cache.acquire(a, 1)
    assert cache.held() == 0 and cache.purge() == 1  # nothing leaked a reference
    cache.close()


def test_at_fork_hooks_do_not_pile_up(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[object] = []
    monkeypatch.setattr(os, "register_at_fork", lambda **kw: calls.append(kw))
    mem = FakeMemory()
    dev = FakeDevice(mem)
    for _ in range(50):
        RegistrationCache(dev, mem).close()
    assert calls == []  # one hook for every cache, registered at import


class PageDevice(FakeDevice):
    """Pins whole 64 KiB pages across neighbouring allocations, as nv-p2p pins a page that a
    suballocator shares between small allocations (the pin is of the page, not the block)."""

    def pin(self, va: int, size: int, *, persistent: bool = False, user_tag: int = 0) -> FakePin:
        with self._lock:
            self.pin_calls += 1
            r = self.memory.range_of(user_tag)
            p = FakePin(self, next(self._handles), va, size, self._free_slots.pop(), user_tag, alloc=r)
            return self._add(p, f"PIN(va={va:#x}, size={size})")


def test_blocks_sharing_a_gpu_page_do_not_invalidate_each_other() -> None:
    """Two pool blocks in one 64 KiB page: each hit stays inside its own allocation (a hit
    used to accept the rounded page, and each block's miss took the other for stale)."""
    mem = FakeMemory(granule=16)
    dev = PageDevice(mem)
    cache = RegistrationCache(dev, mem, validate="both")
    a = mem.alloc(GPU_PAGE // 2)
    b = mem.alloc(GPU_PAGE // 2)
    assert a // GPU_PAGE == b // GPU_PAGE
    for _ in range(3):
        cache.acquire(a, 16).release()
        cache.acquire(b + 16, 16).release()
    st = cache.stats()
    assert (st.pins, st.invalidations_buffer_id, st.hits) == (2, 0, 4)
    with pytest.raises(gpupin.InvalidArgument, match="runs past its allocation"):
        cache.acquire(a, GPU_PAGE // 2 + 16)  # inside the pinned page, past a: a miss refuses
    cache.close()


# -- GDS -------------------------------------------------------------------------------------
def gds(**kw: Any) -> tuple[FakeMemory, FakeCuFile, GdsCache]:
    mem = FakeMemory(granule=16)
    cf = FakeCuFile(mem)
    return mem, cf, GdsCache(CuFileDriver(cf), mem, **kw)


def test_gds_use_leaves_a_live_entry_in_a_reused_slot_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """use() found an entry stale in C, then (before it looked the entry up in Python) the
    entry went and its slot was reused by a live, held registration: that one must not be
    invalidated and deregistered under its IO."""
    mem, cf, cache = gds()
    a = mem.alloc(2 * MiB)
    cache.use(a, MiB).release()
    stale_tok = cache.acquire(a, 1)
    stale_tok.release()
    gone = stale_tok.token
    mem.free(a)
    assert cache.purge() == 1  # the stale entry went; its slot is free
    c = mem.alloc(4 * MiB)
    live = cache.use(c, MiB)  # a held registration in the same slot
    assert live.registration is not None and live.registration.token & 0xFFFFFFFF == gone & 0xFFFFFFFF
    a2 = mem.alloc(2 * MiB)
    real = cache._lookup

    def raced(core: Any, ptr: int, size: int) -> int:
        real(core, ptr, size)  # counts the acquire (a miss)
        return -(gone + lib.GPC_STALE_BASE)  # what C said before the entry went

    monkeypatch.setattr(cache, "_lookup", raced)
    u = cache.use(a2, MiB, reuse=1)  # one-shot: not registered, the stale path runs
    assert not u.registered
    monkeypatch.undo()
    assert c in cf.registered and live.registration.valid
    assert cache.driver.superseded == 0
    live.release()
    cache.close()


def test_gds_failed_deregistration_is_counted_raised_and_retried() -> None:
    mem, cf, cache = gds(max_regions=1)
    a, b = mem.alloc(2 * MiB), mem.alloc(2 * MiB)
    cache.acquire(a, 1).release()
    cf.deregister_status = 5030  # cuFile refuses the next deregistration (eviction of a)
    with pytest.raises(gpupin.GdsError, match="cuFileBufDeregister"):
        cache.acquire(b, 1)
    st = cache.stats()
    assert st.unpin_failures == 1 and st.regions == 0 and st.in_use == 0
    drv = cache.driver
    assert drv._by_handle == {} and drv.live == 1  # a's address: still registered with cuFile
    mem.free(a)
    a2 = mem.alloc(2 * MiB)
    assert a2 == a
    cache.acquire(a2, 1).release()  # deregisters the leftover first, then registers
    assert drv.superseded == 1 and list(cf.registered) == [a2]
    cache.acquire(b, 1).release()
    cache.close()
    assert cf.registered == {}


# -- threads ---------------------------------------------------------------------------------
def test_threads_acquire_release_miss_evict_and_close_exactly() -> None:
    """Eight threads mix hits, misses, frees (buffer-id invalidation), purges and bare tokens over
    a small cache with limits.  No hang, no leaked pin or reference, counters add up."""
    mem = FakeMemory()
    dev = FakeDevice(mem)
    cache = RegistrationCache(dev, mem, validate="both", max_regions=12)
    mem_lock = threading.Lock()
    ptrs = [mem.alloc(MiB) for _ in range(24)]
    errors: list[BaseException] = []
    ops = [0] * 8

    def worker(n: int) -> None:
        rng = random.Random(n)
        try:
            for _ in range(1500):
                i = rng.randrange(len(ptrs))
                op = rng.random()
                if op < 0.04:
                    with mem_lock:  # free and reallocate: the old entry goes stale
                        p = ptrs[i]
                        mem.free(p)
                        ptrs[i] = mem.alloc(MiB, at=p)
                    continue
                if op < 0.06:
                    cache.purge()
                    continue
                try:
                    with mem_lock:
                        p = ptrs[i]
                    if op < 0.5:
                        tok = token(cache, p + rng.randrange(MiB - 8), 8)
                        cache.release_token(tok)
                    else:
                        with cache.acquire(p, 8) as reg:
                            assert reg.ptr == p
                except gpupin.NotGpuMemory:
                    pass  # freed by another thread between the read and the pin
                except gpupin.BudgetExceeded:
                    pass  # all twelve regions in use at once
                ops[n] += 1
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    hung = [t for t in threads if t.is_alive()]
    assert not hung, "a worker hung"
    assert not errors, errors[:3]
    st = cache.stats()
    assert st.in_use == 0 and cache.held() == 0
    assert st.pins - st.unpins == st.regions == len(cache) <= 12
    assert st.acquires == st.hits + st.misses and st.acquires >= sum(ops)
    assert len(dev.pins) == st.regions
    cache.close()
    assert len(dev.pins) == 0 and dev.pin_calls == dev.unpin_calls
    assert cache.stats().unpins == cache.stats().pins


def test_close_races_holders_and_waits_for_them() -> None:
    """close() from one thread while others hold and release: without a timeout InUse while
    anything is held; with one it stops new references, waits for the last release and
    closes; never an unpin under a holder."""
    mem, dev, cache = make()
    ptrs = [mem.alloc(MiB) for _ in range(4)]
    bad: list[str] = []
    refused_acquires = [0]
    started = threading.Barrier(len(ptrs) + 1)

    def holder(p: int) -> None:
        started.wait()
        while True:
            try:
                reg = cache.acquire(p, 8)
            except gpupin.InvalidArgument:
                refused_acquires[0] += 1
                return  # closing or closed
            time.sleep(0.0005)  # a transfer: close() must not unpin meanwhile
            if not reg.valid or reg.handle not in dev.pins:
                bad.append(f"{p:#x}: unpinned while held")
            reg.release()

    threads = [threading.Thread(target=holder, args=(p,)) for p in ptrs]
    for t in threads:
        t.start()
    started.wait()
    time.sleep(0.05)
    mine = cache.acquire(mem.alloc(MiB), 8)  # held across the plain close: it must refuse
    with pytest.raises(gpupin.InUse):
        cache.close()
    assert not cache.closed
    mine.release()
    cache.close(timeout=20)
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads) and not bad
    assert cache.closed and len(dev.pins) == 0 and refused_acquires[0] == len(ptrs)


def test_validity_words_are_read_from_live_memory_only() -> None:
    """After close() the core reads no validity word: the view on the map is released."""
    mem, dev, cache = make(validate="kernel")
    cache.acquire(mem.alloc(MiB), 1).release()
    cache.close()
    assert cache._life.map_buf is None
    dev._words.release()
    dev._map.close()  # would raise BufferError if the cache still exported the map


# -- fork during a close, a GDS race, Device.close atomicity -------------------------------
def test_forking_while_another_thread_closes_a_big_cache() -> None:
    """A fork child inherits a core another thread was freeing (cffi calls run without the
    GIL): resetting it in the child must not free those arrays again (children died of
    'double free or corruption' before)."""
    mem = FakeMemory()
    dev = FakeDevice(mem, slots=1 << 16)
    ptrs = [mem.alloc(GPU_PAGE) for _ in range(20000)]
    died = total = 0
    for _ in range(3):
        cache = RegistrationCache(dev, mem, validate="buffer_id")
        for p in ptrs:
            cache.release_token(cache.lookup(p, 1))
        t = threading.Thread(target=cache.close)
        t.start()
        pids = []
        while t.is_alive() and len(pids) < 200:
            pid = os.fork()
            if pid == 0:
                os._exit(0)  # the at-fork hook has reset the core by now
            pids.append(pid)
        t.join()
        for pid in pids:
            _, status = os.waitpid(pid, 0)
            total += 1
            died += os.waitstatus_to_exitcode(status) != 0
    assert total > 0 and died == 0, f"{died} of {total} children died"


def test_gds_use_supersedes_only_the_stale_registration(monkeypatch: pytest.MonkeyPatch) -> None:
    """use() found a stale entry that an IO still holds; before it took the lock another
    thread registered the new allocation at that address.  Only the stale registration may
    be superseded, never the new one (its IO would lose it)."""
    mem, cf, cache = gds()
    a = mem.alloc(2 * MiB)
    old = cache.acquire(a, 1)  # an IO still holds the old registration
    mem.free(a)
    assert mem.alloc(2 * MiB) == a
    live: list[Any] = []
    real = cache.advise

    def advise(size: int, reuse: int = 2, bar_free: int | None = None) -> Any:
        if not live:  # the other thread, between this one's lookup and its lock
            monkeypatch.setattr(cache, "advise", real)
            live.append(cache.use(a, MiB))
            monkeypatch.setattr(cache, "advise", advise)
        return real(size, 1, bar_free)  # one-shot: this use is left unregistered

    monkeypatch.setattr(cache, "advise", advise)
    u = cache.use(a, 4096, reuse=1)
    assert not u.registered
    assert a in cf.registered and live[0].registration.valid
    live[0].release()
    old.release()
    cache.close()


def test_device_close_counts_holders_that_cannot_change() -> None:
    """Device.close() checks every cache for holders and then closes them; a hit arriving in
    between used to make a later cache refuse after earlier ones were closed already."""
    from gpupin.device import Device

    dev = Device.__new__(Device)  # the close logic only: no kernel file
    dev.path, dev._fd, dev._map, dev._words = "/dev/gpupin", -1, None, None
    import weakref

    dev._children = weakref.WeakSet()
    mem = FakeMemory()
    fake = FakeDevice(mem)
    c1, c2 = RegistrationCache(fake, mem), RegistrationCache(fake, mem)
    dev.register_child(c1)
    dev.register_child(c2)
    a = mem.alloc(MiB)
    c2.release_token(token(c2, a))
    hits: list[object] = []
    real = c1.held

    def held_then_a_hit() -> int:
        try:
            hits.append(c2.fast_lookup(a, 1))  # a holder arriving during the count
        except gpupin.InvalidArgument as exc:
            hits.append(str(exc))
        return real()

    c1.held = held_then_a_hit  # type: ignore[method-assign]
    dev.close()
    assert hits == ["this RegistrationCache is closed (or closing)"]  # nothing handed out meanwhile
    assert c1.closed and c2.closed and len(fake.pins) == 0
