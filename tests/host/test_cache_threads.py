"""The registration cache under threads: inserts racing hits, frees and reallocations,
evictions and close, in every validate mode, with the buffer id checked in Python and in C.

Each test names the defect it pins down and failed on the code before its fix.
"""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import gpupin
from gpupin._native import lib
from gpupin.cache import CacheFull, RegistrationCache
from gpupin.testing.fake import FakeDevice, FakeMemory

MiB = 1 << 20

# (validate, the buffer-id check in C): "kernel" has no buffer-id check to place.
MODES = [("both", False), ("both", True), ("buffer_id", False), ("buffer_id", True), ("kernel", False)]


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
    kept its reference forever (close() then raised InUse).  Threads here hit shared memory,
    free and reallocate their own at the same address, purge, drain and try close() while
    holding: only the documented errors, every registration is of the allocation there now,
    and at the end close() succeeds with no pin left."""
    mem = FakeMemory(direct_query=c_check)
    dev = FakeDevice(mem)
    # Nine allocations in use over four regions: inserts evict (LRU) as well as purge.
    cache = RegistrationCache(dev, mem, validate=validate, max_regions=4)  # type: ignore[arg-type]
    assert cache._py_buffer_id == (validate != "kernel" and not c_check)
    shared = [mem.alloc(MiB) for _ in range(5)]  # never freed while the threads run
    owned = [[mem.alloc(MiB) for _ in range(2)] for _ in range(2)]  # each churner's own
    shared_ids = {p: mem.buffer_id(p) for p in shared}
    wrong: list[str] = []
    errors: list[BaseException] = []
    start = time.monotonic()
    running = threading.Event()  # cleared by the housekeeper: 0.6 s and everything seen once
    running.set()
    counts = {"hits": 0, "reallocs": 0, "purged": 0, "refused_closes": 0}

    def check(reg: gpupin.Registration, want: int, what: str) -> None:
        pin = dev.pins.get(reg.handle)
        if reg.buffer_id != want or pin is None or not pin.is_valid() or not pin.base <= reg.ptr < pin.end:
            wrong.append(f"{what}: registration of buffer {reg.buffer_id} (pin {pin}), the memory is buffer {want}")

    def hitter(n: int) -> Callable[[], None]:
        def run() -> None:
            rng = random.Random(n)
            while running.is_set():
                p = rng.choice(shared)
                off = rng.randrange(MiB - 64)
                try:
                    if rng.random() < 0.5:
                        with cache.acquire(p + off, 64) as reg:
                            check(reg, shared_ids[p], f"hit at {p + off:#x}")
                    else:
                        tok = cache.fast_lookup(p + off, 64)
                        if tok < 0:
                            tok = cache.miss(p + off, 64, tok)
                        cache.release_token(tok)
                except CacheFull:
                    continue  # every region held at once: documented
                counts["hits"] += 1

        return run

    def churner(n: int) -> Callable[[], None]:
        def run() -> None:
            rng = random.Random(100 + n)
            mine = owned[n]
            while running.is_set():
                i = rng.randrange(len(mine))
                p = mine[i]
                want = mem.buffer_id(p)
                try:
                    reg = cache.acquire(p + rng.randrange(MiB - 64), 64)
                except CacheFull:
                    continue
                check(reg, want, f"own allocation at {p:#x}")
                if rng.random() < 0.5:
                    reg.release()
                mem.free(p)  # the same address comes back with a new buffer id
                mine[i] = mem.alloc(MiB, at=p)
                counts["reallocs"] += 1
                if not reg._released:
                    reg.release()  # a use that outlived its memory
            for p in mine:
                mem.free(p)

        return run

    def prober() -> None:
        """Spins on fast_lookup (a bare call into C: a miss does not wait for the cache's lock)
        until a purged allocation is back, then acquires it: its first hit comes as the insert
        ends, in the window an entry the cache had not stored yet was open."""
        rng = random.Random(55)
        while running.is_set():
            p = rng.choice(shared)
            try:
                for _ in range(5000):
                    tok = cache.fast_lookup(p, 64)
                    if tok >= 0:
                        cache.release_token(tok)
                        with cache.acquire(p, 64) as reg:
                            check(reg, shared_ids[p], f"first hit at {p:#x}")
                        break
            except CacheFull:
                continue

    def seen_all() -> bool:
        st = cache.stats()
        return st.evictions_limit > 0 and all(counts[k] > 0 for k in counts)

    def housekeeper() -> None:
        try:
            turn = 0
            while running.is_set():
                now = time.monotonic() - start
                if now > 20 or (now > 0.6 and seen_all()):  # at most 20 s on a loaded machine
                    running.clear()
                turn += 1
                if turn % 4 < 2:
                    counts["purged"] += cache.purge()  # the next hits race a new insert
                elif turn % 4 == 2:
                    cache.drain()
                else:
                    try:
                        with cache.acquire(shared[0], 8):
                            cache.close()  # a registration is held: must refuse
                    except gpupin.InUse:
                        counts["refused_closes"] += 1
                    except CacheFull:
                        pass
                time.sleep(0.0002)
        finally:
            running.clear()  # the others stop with it, even when it failed

    run_threads([hitter(n) for n in range(4)] + [churner(n) for n in range(2)] + [prober, housekeeper], errors)
    assert not errors, errors[:3]
    assert not wrong, wrong[:3]
    assert seen_all(), ("in 20 s the threads did not do each thing once", cache.stats(), counts)
    assert cache.held() == 0, "a reference was never released"
    closers: list[BaseException] = []
    run_threads([cache.close] * 3, closers)  # several at once: each closes or finds it closed
    assert not closers, closers[:3]
    assert cache.closed and dev.pins == {} and dev.pin_calls == dev.unpin_calls
