"""A cache (or device) used in a forked child: never the parent's pins, on FakeDevice/FakeMemory
with real forks (os.fork and a multiprocessing pool with the fork start method)."""

from __future__ import annotations

import errno
import multiprocessing
import os
from collections.abc import Callable

import pytest

import gpupin
from gpupin.cache import RegistrationCache
from gpupin.testing import in_child
from gpupin.testing.fake import FakeDevice, FakeMemory

MiB = 1 << 20


def test_fake_device_refuses_a_fork_child_by_name() -> None:
    mem = FakeMemory()
    dev = FakeDevice(mem)
    a = mem.alloc(MiB)
    p = dev.pin(a, MiB)

    def child() -> int:
        calls: list[Callable[[], object]] = [
            lambda: dev.pin(a, MiB),
            lambda: dev.unpin(p),
            lambda: dev.dma_map(p, "0000:00:03.0"),
            dev.read_events,
            dev.validity_map,
        ]
        for i, call in enumerate(calls):
            try:
                call()
                return 10 + i
            except gpupin.ForkedDevice as exc:
                if exc.errno != errno.EACCES or "reopen" not in str(exc):
                    return 30 + i
        if p.is_valid():  # the kernel's map is not inherited: the child reads zeros
            return 2
        return 0 if p.handle in dev.pins and dev.unpin_calls == 0 and dev.info().dmabuf else 1

    assert in_child(child) == 0
    assert p.is_valid()
    dev.unpin(p)


@pytest.mark.parametrize("validate", ["kernel", "buffer_id", "both"])
def test_cache_in_a_fork_child_pins_afresh_and_leaves_the_parents_pins(validate: str) -> None:
    mem = FakeMemory()
    dev = FakeDevice(mem)
    cache = RegistrationCache(dev, mem, validate=validate)  # type: ignore[arg-type]
    a, b = mem.alloc(MiB), mem.alloc(MiB)
    held = cache.acquire(a, 1)
    cache.acquire(b, 1).release()
    parent_handles = set(dev.pins)

    def child() -> int:
        if len(cache) != 0 or cache.stats().regions != 0:
            return 2
        with cache.acquire(a, 10) as r:
            mine = cache.device
            if mine is dev or not isinstance(mine, FakeDevice) or mine._pid != os.getpid():
                return 3
            if set(mine.pins) != {r.handle} or not r.valid:
                return 4
        with cache.acquire(a, 10):  # a hit now, on the child's own pin
            pass
        st = cache.stats()
        if (st.pins, st.hits, st.misses) != (1, 1, 1):
            return 5
        held.release()  # the parent's registration: harmless here, unpins nothing
        cache.close()
        if mine.pins or dev.unpin_calls != 0 or set(dev.pins) != parent_handles:
            return 6
        return 0

    assert in_child(child) == 0
    # The parent's cache, pins and registration are as they were.
    assert set(dev.pins) == parent_handles and dev.unpin_calls == 0 and held.valid
    with cache.acquire(b, 1):
        pass
    assert cache.stats().hits == 1
    held.release()
    cache.close()
    assert dev.pins == {}


def test_fast_path_bound_before_the_fork_misses_in_the_child() -> None:
    """Bound entry points keep the core they were made with: it is emptied in place."""
    mem = FakeMemory()
    dev = FakeDevice(mem)
    cache = RegistrationCache(dev, mem, validate="kernel")
    a = mem.alloc(MiB)
    fast_lookup, release_token = cache.fast_lookup, cache.release_token
    tok = fast_lookup(a, 1)
    tok = cache.miss(a, 1, tok) if tok < 0 else tok
    release_token(tok)
    assert fast_lookup(a, 1) >= 0  # a hit in the parent (the fake validity map is shared)
    release_token(tok)

    def child() -> int:
        r = fast_lookup(a, 1)
        if r >= 0:
            return 2  # the parent's entry
        t = cache.miss(a, 1, r)
        mine = cache.device
        if mine is dev or set(mine.pins) != {cache._entry_of(t).pin.handle}:  # type: ignore[union-attr]
            return 3
        release_token(t)
        if fast_lookup(a, 1) != t:
            return 4
        release_token(t)
        return 0

    assert in_child(child) == 0
    assert fast_lookup(a, 1) == tok and dev.unpin_calls == 0
    release_token(tok)
    cache.close()


def test_the_parents_tokens_never_touch_the_childs_entries() -> None:
    mem = FakeMemory()
    dev = FakeDevice(mem)
    cache = RegistrationCache(dev, mem)
    a = mem.alloc(MiB)
    held = cache.acquire(a, 1)
    tok = cache.lookup(a, 1)

    def child() -> int:
        mine = cache.acquire(a, 1)  # the child's own entry, referenced once
        held.release()  # the parent's registration: nothing to do here
        try:
            cache.release_token(tok)
            return 2
        except gpupin.InvalidArgument as exc:
            if "not a held token" not in str(exc):
                return 3
        if cache.stats().in_use != 1 or mine.token == tok:
            return 4
        mine.release()
        return 0 if cache.stats().in_use == 0 else 5

    assert in_child(child) == 0
    assert cache.stats().in_use == 1
    held.release()
    cache.release_token(tok)
    cache.close()


def test_closing_in_the_child_unpins_nothing_of_the_parent() -> None:
    mem = FakeMemory()
    dev = FakeDevice(mem)
    cache = RegistrationCache(dev, mem)
    a = mem.alloc(MiB)
    cache.acquire(a, 1).release()

    def child() -> int:
        cache.close()
        return 0 if dev.unpin_calls == 0 and len(dev.pins) == 1 else 1

    assert in_child(child) == 0
    assert len(cache) == 1 and dev.unpin_calls == 0
    cache.close()


def test_a_device_that_cannot_be_reopened_names_the_fix() -> None:
    class NoReopen(FakeDevice):
        reopen = None  # type: ignore[assignment]

    mem = FakeMemory()
    dev = NoReopen(mem)
    cache = RegistrationCache(dev, mem)
    a = mem.alloc(MiB)
    cache.acquire(a, 1).release()

    def child() -> int:
        try:
            cache.acquire(a, 1)
        except gpupin.ForkedDevice as exc:
            ok = "make the cache" in str(exc) and str(dev.opener_pid) in str(exc) and dev.unpin_calls == 0
            return 0 if ok else 2
        return 1

    assert in_child(child) == 0
    cache.close()


# -- as a user would: a module-level cache and a fork-based worker pool ----------------------
MEM: FakeMemory | None = None
CACHE: RegistrationCache | None = None


def _pool_worker(ptr: int) -> tuple[int, int, int, bool, int]:
    """pid, the handle used, the pins of the worker's device, whether it is the parent's, hits."""
    assert CACHE is not None
    with CACHE.acquire(ptr, 4096) as r:
        handle = r.handle
    with CACHE.acquire(ptr, 4096):
        pass
    dev = CACHE.device
    assert isinstance(dev, FakeDevice)
    return os.getpid(), handle, len(dev.pins), dev is PARENT_DEV, CACHE.stats().hits


PARENT_DEV: FakeDevice | None = None


def test_pool_worker_with_a_module_level_cache() -> None:
    global MEM, CACHE, PARENT_DEV
    MEM = FakeMemory()
    PARENT_DEV = FakeDevice(MEM)
    CACHE = RegistrationCache(PARENT_DEV, MEM)
    try:
        bufs = [MEM.alloc(MiB) for _ in range(4)]
        with CACHE.acquire(bufs[0], 1) as r:
            parent_handle = r.handle
        ctx = multiprocessing.get_context("fork")
        with ctx.Pool(2) as pool:
            results = pool.map(_pool_worker, bufs, chunksize=1)
        assert len(results) == 4
        for pid, _handle, pins, is_parents, hits in results:
            assert pid != os.getpid() and not is_parents and pins >= 1 and hits >= 1
        # The parent's cache is untouched: one entry, its pin, a hit.
        assert len(CACHE) == 1 and set(PARENT_DEV.pins) == {parent_handle} and PARENT_DEV.unpin_calls == 0
        with CACHE.acquire(bufs[0], 1) as r:
            assert r.handle == parent_handle
    finally:
        CACHE.close()
        MEM = CACHE = PARENT_DEV = None
