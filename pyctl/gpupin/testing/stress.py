"""A thread stress of one RegistrationCache, run by the host suite (FakeMemory) and the VM suite
(SimMemory over gpupin.ko) alike.

Threads hit shared allocations (``acquire`` and the bare ``fast_lookup``/``miss``/
``release_token``), free and reallocate their own (a new buffer id, often at the same address),
spin on ``fast_lookup`` until a purged allocation is back, and a housekeeper purges, drains,
tries ``close()`` while holding a registration and ``close(timeout=)`` while holding one (both
must refuse with InUse, the second after stopping every lookup for the wait).  Every hand-out
is checked against the allocation there at that moment.  Nothing here asserts: the caller gets a
``StressResult`` and says what must hold.
"""

from __future__ import annotations

import functools
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..cache import CacheFull, Registration, RegistrationCache
from ..errors import InUse, InvalidArgument
from ..memory import MemoryProvider

# What the threads must each have done once before a short run may stop.
COUNTS = ("hits", "reallocs", "purged", "refused_closes", "refused_timed_closes")


@dataclass
class StressResult:
    """What a run saw: errors that escaped a thread, wrong hand-outs, what was done how often."""

    errors: list[BaseException] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTS, 0))
    evictions: int = 0
    seconds: float = 0.0
    hung: int = 0  # threads still running after the join

    @property
    def did_everything(self) -> bool:
        """Each kind of operation ran at least once, and inserts evicted (LRU) at least once."""
        return self.evictions > 0 and all(self.counts[k] > 0 for k in COUNTS)


def _closing(exc: InvalidArgument) -> bool:
    """The refusal a lookup gets while ``close(timeout=)`` waits for holders (documented)."""
    return "clos" in str(exc)


def stress_cache(
    cache: RegistrationCache,
    memory: MemoryProvider,
    *,
    size: int,
    seconds: float,
    at_least: float = 0.6,
    realloc: Callable[[int], int] | None = None,
    pin_ok: Callable[[Registration], bool] | None = None,
) -> StressResult:
    """Run the threads for ``at_least`` seconds and until each did everything once, or for
    ``seconds`` at most; the allocations it made are freed again.

    ``realloc(old_address)`` allocates ``size`` bytes after a free of ``old_address`` (default
    ``memory.alloc(size)``: FakeMemory can ask for the same address, the simulator hands the
    lowest free one out).  ``pin_ok(reg)``: what the device says of a registration's pin
    (default: ``reg.valid`` and the pin covers ``reg.ptr``).
    """
    res = StressResult()
    again = realloc or (lambda _old: memory.alloc(size))
    shared = [memory.alloc(size) for _ in range(5)]  # never freed while the threads run
    owned = [[memory.alloc(size) for _ in range(2)] for _ in range(2)]  # each churner's own
    shared_ids = {p: memory.buffer_id(p) for p in shared}
    counts = res.counts
    start = time.monotonic()
    running = threading.Event()  # cleared by the housekeeper
    running.set()

    def good_pin(reg: Registration) -> bool:
        if pin_ok is not None:
            return pin_ok(reg)
        return reg.valid and reg.aligned_va <= reg.ptr < reg.aligned_va + reg.aligned_size

    def check(reg: Registration, want: int, what: str) -> None:
        if reg.buffer_id != want or not good_pin(reg):
            res.wrong.append(f"{what}: {reg!r} is of buffer {reg.buffer_id}, the memory is buffer {want}")

    def check_token(tok: int, want: int, what: str) -> None:
        e: Any = cache._entry_of(tok)  # what the token names: the cache's own bookkeeping
        if e is None or e.buffer_id != want:
            res.wrong.append(f"{what}: token {tok:#x} names {e}, the memory is buffer {want}")

    def hitter(n: int) -> None:
        rng = random.Random(n)
        while running.is_set():
            p = rng.choice(shared)
            off = rng.randrange(size - 64)
            try:
                if rng.random() < 0.5:
                    with cache.acquire(p + off, 64) as reg:
                        check(reg, shared_ids[p], f"hit at {p + off:#x}")
                else:
                    tok = cache.fast_lookup(p + off, 64)
                    if tok < 0:
                        tok = cache.miss(p + off, 64, tok)
                    check_token(tok, shared_ids[p], f"token for {p + off:#x}")
                    cache.release_token(tok)
            except CacheFull:
                continue  # every region held at once: documented
            except InvalidArgument as exc:
                if not _closing(exc):
                    raise
                continue
            counts["hits"] += 1

    def churner(n: int) -> None:
        rng = random.Random(100 + n)
        mine = owned[n]
        while running.is_set():
            i = rng.randrange(len(mine))
            p = mine[i]
            want = memory.buffer_id(p)
            try:
                reg = cache.acquire(p + rng.randrange(size - 64), 64)
            except CacheFull:
                continue
            except InvalidArgument as exc:
                if not _closing(exc):
                    raise
                continue
            check(reg, want, f"own allocation at {p:#x}")
            if rng.random() < 0.5:
                reg.release()
            memory.free(p)  # the address comes back (here or in the other churner) with a new id
            mine[i] = again(p)
            counts["reallocs"] += 1
            if not reg._released:
                reg.release()  # a use that outlived its memory

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
                        check_token(tok, shared_ids[p], f"first hit at {p:#x}")
                        cache.release_token(tok)
                        with cache.acquire(p, 64) as reg:
                            check(reg, shared_ids[p], f"first hit at {p:#x}")
                        break
            except CacheFull:
                continue
            except InvalidArgument as exc:
                if not _closing(exc):
                    raise

    def refuse_close(timeout: float, key: str) -> None:
        try:
            with cache.acquire(shared[0], 8):
                cache.close(timeout=timeout)  # a registration is held: must refuse
            res.wrong.append(f"close(timeout={timeout}) closed the cache while a registration was held")
            running.clear()
        except InUse:
            counts[key] += 1
        except CacheFull:
            pass

    def housekeeper() -> None:
        try:
            turn = 0
            while running.is_set():
                now = time.monotonic() - start
                res.evictions = cache.stats().evictions_limit
                if now > seconds or (now > at_least and res.did_everything):
                    running.clear()
                turn += 1
                if turn % 5 < 2:
                    counts["purged"] += cache.purge()  # the next hits race a new insert
                elif turn % 5 == 2:
                    cache.drain()
                elif turn % 5 == 3:
                    refuse_close(0.0, "refused_closes")
                else:
                    refuse_close(0.002, "refused_timed_closes")  # lookups refused meanwhile
                time.sleep(0.0002)
        finally:
            running.clear()  # the others stop with it, even when it failed

    def guard(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # reported to the caller
                res.errors.append(exc)
                running.clear()

        return run

    targets: list[Callable[[], None]] = [functools.partial(hitter, n) for n in range(4)]
    targets += [functools.partial(churner, n) for n in range(2)] + [prober, housekeeper]
    threads = [threading.Thread(target=guard(fn)) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 60)
    res.hung = sum(t.is_alive() for t in threads)
    res.seconds = time.monotonic() - start
    res.evictions = cache.stats().evictions_limit
    if not res.hung:
        for p in shared + [p for mine in owned for p in mine]:
            memory.free(p)
    return res
