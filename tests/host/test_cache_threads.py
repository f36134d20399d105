"""The registration cache under threads: inserts racing hits, frees and reallocations,
evictions and close, in every validate mode, with the buffer id checked in Python and in C.

Each test names the defect it pins down and failed on the code before its fix.  The stress
lasts a few seconds per mode; GPUPIN_LONG=1 (make test-long) runs ten minutes in all, 100 s per
mode; GPUPIN_CACHE_STRESS_S sets the seconds per mode.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import gpupin
from gpupin._native import lib
from gpupin.cache import RegistrationCache
from gpupin.testing.fake import FakeDevice, FakeMemory
from gpupin.testing.stress import stress_cache

MiB = 1 << 20

# (validate, the provider offers its buffer-id query in C): every pair; "kernel" checks no
# buffer id, with or without a query to offer.
MODES = [(v, c) for v in ("both", "buffer_id", "kernel") for c in (False, True)]
LONG = os.environ.get("GPUPIN_LONG") == "1"
# Seconds per mode that a stress lasts however soon it did everything (0: until it did).
STRESS_S = float(os.environ.get("GPUPIN_CACHE_STRESS_S") or (100 if LONG else 0))


@pytest.fixture(autouse=True)
def fine_switching() -> Iterator[None]:
    """Threads switch every 50 µs instead of 5 ms: races show within a second."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(5e-5)
    yield
    sys.setswitchinterval(old)


def run_threads(targets: list[Callable[[], None]], errors: list[BaseException]) -> None:
    def guard(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # reported by the test
                errors.append(exc)

        return run

    threads = [threading.Thread(target=guard(fn)) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not [t for t in threads if t.is_alive()], "a thread hung"


@pytest.mark.parametrize(("validate", "c_check"), MODES)
def test_no_lookup_finds_an_entry_before_the_cache_stored_it(validate: str, c_check: bool) -> None:
    """The race of the stress test below, made certain: after every call the inserting thread
    makes into the C core, a lookup (the bare core, as another thread's hit path) either misses
    or names an entry that acquire() resolves.  Before the fix the core showed the entry
    before the cache stored it: acquire() failed its assertion and kept the reference."""
    mem = FakeMemory(direct_query=c_check)
    dev = FakeDevice(mem)
    cache = RegistrationCache(dev, mem, validate=validate)  # type: ignore[arg-type]
    p = mem.alloc(MiB)
    seen: list[str] = []
    problems: list[BaseException] = []

    def after_core_calls(frame: Any, event: str, arg: Any) -> None:
        if event != "c_return" or not getattr(arg, "__name__", "").startswith("gpc_"):
            return
        tok = lib.gpc_lookup(cache.core, p, 64)
        if tok < 0:
            return
        seen.append(arg.__name__)
        lib.gpc_release(cache.core, tok)
        try:
            cache.acquire(p, 64).release()
        except BaseException as exc:  # reported below
            problems.append(exc)

    sys.setprofile(after_core_calls)
    try:
        reg = cache.acquire(p, 64)  # the miss that inserts
    finally:
        sys.setprofile(None)
    reg.release()
    assert not problems, f"a hit after {seen[0]} failed: {problems[0]!r}"
    assert seen, "no lookup hit during the insert: the test saw nothing"
    assert cache.held() == 0
    cache.close()
    assert dev.pins == {}


@pytest.mark.parametrize(("validate", "c_check"), MODES)
def test_threads_never_get_a_half_inserted_entry_or_another_allocation(validate: str, c_check: bool) -> None:
    """Hits through C raced another thread's insert: the C core showed the entry before the
    cache stored it, and the hit's acquire found no entry for its token (AssertionError) and
    kept its reference forever (close() then raised InUse).  gpupin.testing.stress's threads
    hit shared memory, free and reallocate their own at the same address, purge, drain, and
    try close() and close(timeout=) while holding: only the documented errors, every hand-out
    is of the allocation there now, and at the end close() succeeds with no pin left."""
    mem = FakeMemory(direct_query=c_check)
    dev = FakeDevice(mem)
    # Nine allocations in use over four regions: inserts evict (LRU) as well as purge.
    cache = RegistrationCache(dev, mem, validate=validate, max_regions=4)  # type: ignore[arg-type]
    assert cache._py_buffer_id == (validate != "kernel" and not c_check)

    def pin_ok(reg: gpupin.Registration) -> bool:
        pin = dev.pins.get(reg.handle)
        return pin is not None and pin.is_valid() and pin.base <= reg.ptr < pin.end

    limit = STRESS_S or 20  # at most 20 s on a loaded machine
    kw = {"at_least": STRESS_S} if STRESS_S else {}
    res = stress_cache(cache, mem, size=MiB, seconds=limit, realloc=lambda p: mem.alloc(MiB, at=p), pin_ok=pin_ok, **kw)
    assert not res.hung, "a thread hung"
    assert not res.errors, res.errors[:3]
    assert not res.wrong, res.wrong[:3]
    assert res.did_everything, (f"in {limit} s the threads did not do each thing once", cache.stats(), res)
    assert cache.held() == 0, "a reference was never released"
    closers: list[BaseException] = []
    run_threads([cache.close] * 3, closers)  # several at once: each closes or finds it closed
    assert not closers, closers[:3]
    assert cache.closed and dev.pins == {} and dev.pin_calls == dev.unpin_calls
