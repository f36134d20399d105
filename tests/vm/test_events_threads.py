"""Threads sharing one Device's invalidation records: none is left asleep in read(),
each record goes to exactly one reader, and the file's flags never change.

A reader left asleep in read() while another thread took the records is the hang: every
thread is joined with a timeout, one still running fails the test, and is woken then (the file
made non-blocking again, a record queued) so that none outlives it.  Over either provider."""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator

import pytest

from conftest import GPU_ALLOC, GPU_PAGE, SLOW, scaled
from gpupin import Device, Event, MemoryProvider, Pin
from gpupin.cache import RegistrationCache
from gpupin.testing import PausedThread, after_poll, after_read

pytestmark = pytest.mark.vm
JOIN = 10.0 * SLOW  # seconds a thread may take before it counts as hung


class Waker:
    """A pin whose memory is freed only to wake readers asleep in read()."""

    def __init__(self, device: Device, memory: MemoryProvider) -> None:
        self.device, self.memory = device, memory
        self.va = memory.alloc(GPU_ALLOC)
        self.pin = device.pin(self.va, GPU_PAGE)
        self.freed = False

    def hung(self, threads: list[threading.Thread]) -> list[str]:
        """The threads still running JOIN seconds from now, woken afterwards."""
        end = time.monotonic() + JOIN
        for t in threads:
            t.join(max(0.0, end - time.monotonic()))
        names = [t.name for t in threads if t.is_alive()]
        if names and not self.freed:
            # The kernel checks O_NONBLOCK again after a wake-up: every sleeper returns.
            os.set_blocking(self.device.fileno(), False)
            self.memory.free(self.va)
            self.freed = True
            for t in threads:
                t.join(JOIN)
        return names

    def close(self) -> None:
        self.device.unpin(self.pin)
        if not self.freed:
            self.memory.free(self.va)


@pytest.fixture
def waker(device: Device, memory: MemoryProvider) -> Iterator[Waker]:
    w = Waker(device, memory)
    yield w
    w.close()


def handles(events: list[Event]) -> list[int]:
    return [e.handle for e in events]


def freed_pins(device: Device, memory: MemoryProvider, n: int) -> list[Pin]:
    """``n`` pins whose memory is freed: ``n`` records queued."""
    vas = [memory.alloc(GPU_ALLOC) for _ in range(n)]
    pins = [device.pin(va, GPU_PAGE) for va in vas]
    for va in vas:
        memory.free(va)
    return pins


def test_a_reader_is_not_left_asleep_when_another_empties_the_queue(
    device: Device, memory: MemoryProvider, waker: Waker
) -> None:
    """B has read 64 records (one read's worth) when A reads the other 36: B's next read must
    say EAGAIN, not sleep until a record that may never come."""
    pins = freed_pins(device, memory, 100)
    b = PausedThread(device.read_events, Device.read_events, after_read, JOIN)
    b.start_and_pause()
    a_got = device.read_events()
    b.resume()
    assert not waker.hung([b]), "read_events() slept in read() after another thread emptied the queue"
    assert b.error is None, b.error
    assert len(b.result) == 64 and len(a_got) == 36
    assert sorted(handles(a_got) + handles(b.result)) == sorted(p.handle for p in pins)
    assert not os.get_blocking(device.fileno()), "read_events() changed the shared file's flags"
    for p in pins:
        device.unpin(p)


def test_a_cache_draining_is_not_left_asleep_by_a_user_waiting(
    device: Device, memory: MemoryProvider, waker: Waker
) -> None:
    """The hang as a user meets it: the cache drains records under its lock while the user's
    wait_invalidations() takes the rest; the drain must end, and the cache still close."""
    cache = RegistrationCache(device, memory, validate="kernel")
    vas = [memory.alloc(GPU_ALLOC) for _ in range(100)]
    for va in vas:
        cache.acquire(va, GPU_PAGE).release()
    for va in vas:
        memory.free(va)
    drain = PausedThread(cache.drain, Device.read_events, after_read, JOIN)
    drain.start_and_pause()  # inside drain(), the cache's lock held, 64 records read
    user = device.wait_invalidations(0)
    drain.resume()
    closer = threading.Thread(target=cache.close, name="cache.close", daemon=True)
    closer.start()
    assert not waker.hung([drain, closer]), "the cache's drain slept in read() with its lock held"
    assert drain.error is None, drain.error
    assert drain.result == 64 and len(user) == 36
    assert device.info().file_pins == 1  # the waker's: close() unpinned the cache's
    assert not os.get_blocking(device.fileno())


def test_wait_goes_on_when_another_thread_takes_the_records(
    device: Device, memory: MemoryProvider, waker: Waker
) -> None:
    """A's poll sees a record that B then reads: A waits on, and gets the next record."""
    first = freed_pins(device, memory, 1)[0]
    va = memory.alloc(GPU_ALLOC)
    second = device.pin(va, GPU_PAGE)
    a = PausedThread(lambda: device.wait_invalidations(JOIN), Device.wait_invalidations, after_poll, JOIN)
    a.start_and_pause()
    assert handles(device.read_events()) == [first.handle]
    a.resume()
    a.join(0.3)
    assert a.is_alive(), f"wait_invalidations({JOIN}) returned {a.result} before its timeout, with no record"
    memory.free(va)
    assert not waker.hung([a])
    assert a.error is None and handles(a.result) == [second.handle], (a.result, a.error)
    device.unpin(first)
    device.unpin(second)


@pytest.mark.parametrize("seed", range(3))
def test_threads_racing_for_records_get_each_exactly_once(
    device: Device, memory: MemoryProvider, waker: Waker, seed: int
) -> None:
    """Readers (read_events, wait_invalidations with a short timeout) race a thread freeing
    pinned memory: none hangs, each record goes to exactly one, the file stays non-blocking."""
    rng, n = random.Random(seed), scaled(1000)  # 64 MiB pinned: within the 256 MiB simulated BAR
    vas = [memory.alloc(GPU_ALLOC) for _ in range(n)]
    pins = {device.pin(va, GPU_PAGE).handle for va in vas}
    stop = threading.Event()
    got: dict[str, list[int]] = {}
    errors: list[BaseException] = []

    def thread(name: str, body: Callable[[], None]) -> threading.Thread:
        def run() -> None:
            try:
                body()
            except BaseException as exc:  # noqa: B036 - handed to the test
                errors.append(exc)

        return threading.Thread(target=run, name=name, daemon=True)

    def reader(name: str, read: Callable[[], list[Event]]) -> threading.Thread:
        mine = got.setdefault(name, [])

        def body() -> None:
            while not stop.is_set():
                mine.extend(handles(read()))

        return thread(name, body)

    def free() -> None:
        for i, va in enumerate(vas):
            memory.free(va)
            if i % 50 == 0:
                time.sleep(rng.random() / 1000)

    readers = [reader(f"read_events {i}", device.read_events) for i in range(2)]
    readers += [reader(f"wait_invalidations {i}", lambda: device.wait_invalidations(0.01)) for i in range(2)]
    freer = thread("free", free)
    for t in [*readers, freer]:
        t.start()
    end = time.monotonic() + 6 * JOIN
    while sum(len(v) for v in got.values()) < n and time.monotonic() < end and not errors:
        time.sleep(0.01)
    stop.set()
    hung = waker.hung([*readers, freer])
    assert not hung and not errors, f"hung (asleep in read()): {hung}; errors: {errors}"
    counts = Counter(h for v in got.values() for h in v)
    assert set(counts) == pins, f"{len(pins - set(counts))} records never read, {len(set(counts) - pins)} unknown"
    assert max(counts.values()) == 1, "a record was read twice"
    assert not os.get_blocking(device.fileno()), "read_events() changed the shared file's flags"
    for h in pins:
        device.unpin(h)
