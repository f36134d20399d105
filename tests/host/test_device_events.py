"""Device's invalidation records shared by threads, without the kernel: a Device
whose file is the non-blocking read end of a pipe, records written into the other end.

A reader that another thread leaves asleep in read() is a hang: every thread is joined with a
timeout, and one still running fails the test (and is woken, so that none outlives it)."""

from __future__ import annotations

import mmap
import os
import random
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator

import pytest

from gpupin import device as device_mod
from gpupin._native import ffi, lib
from gpupin.device import Device, Event
from gpupin.testing import PausedThread, after_poll, after_read, in_child

pytestmark = pytest.mark.timeout(120)  # a backstop: the tests fail on their own well before
JOIN = 10.0  # seconds a thread may take before it counts as hung


def record(handle: int) -> bytes:
    """One ``struct gpupin_event`` as the kernel's read() gives it."""
    c = ffi.new("struct gpupin_event *")
    c.handle, c.user_tag, c.reason, c.slot = handle, handle * 10, lib.GPUPIN_INVAL_FREED, handle % 1000
    return bytes(ffi.buffer(c))


def handles(events: list[Event]) -> list[int]:
    return [int(e.handle) for e in events]


def bare_device(fd: int = -1) -> Device:
    """A Device on ``fd``, with what ``__init__`` sets, opening nothing."""
    dev = Device.__new__(Device)
    dev.path = f"pipe:{fd}"
    dev._pid = os.getpid()
    dev._fd = fd
    dev._map = None
    dev._words = None
    dev._lock = threading.Lock()
    dev._children = weakref.WeakSet()
    return dev


class Pipe:
    """A Device reading a non-blocking pipe, and the pipe's (blocking) write end."""

    def __init__(self) -> None:
        r, self.w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        os.set_blocking(self.w, True)  # the writer's own file: it waits when the pipe is full
        self.dev = bare_device(r)
        self.threads: list[threading.Thread] = []

    def write(self, hs: range | list[int]) -> None:
        os.write(self.w, b"".join(record(h) for h in hs))

    def hung(self, threads: list[threading.Thread]) -> list[str]:
        """The threads still running JOIN seconds from now.  Each is woken afterwards (the
        file made non-blocking, a record for it), so a failing test leaves no thread behind."""
        end = time.monotonic() + JOIN
        for t in threads:
            t.join(max(0.0, end - time.monotonic()))
        names = [t.name for t in threads if t.is_alive()]
        if names:
            os.set_blocking(self.dev.fileno(), False)
            self.write([0] * len(names))
            for t in threads:
                t.join(1.0)
        return names

    def close(self) -> None:
        self.hung(self.threads)
        self.dev.close()
        os.close(self.w)


@pytest.fixture
def pipe() -> Iterator[Pipe]:
    p = Pipe()
    yield p
    p.close()


def test_a_reader_is_not_left_asleep_when_another_empties_the_queue(pipe: Pipe) -> None:
    """B has read some records (a read takes 64) when A reads the rest: B's next read must
    say EAGAIN, not sleep until a record that may never come (the cache's lock held)."""
    dev = pipe.dev
    pipe.write(range(1, 101))
    b = PausedThread(dev.read_events, Device.read_events, after_read, JOIN)
    pipe.threads.append(b)
    b.start_and_pause()
    a_got = dev.read_events()
    b.resume()
    assert not pipe.hung([b]), "read_events() slept in read() after another thread emptied the queue"
    assert b.error is None and b.result is not None, b.error
    assert len(b.result) == 64 and len(a_got) == 36
    assert sorted(handles(a_got) + handles(b.result)) == list(range(1, 101))
    assert not os.get_blocking(dev.fileno()), "read_events() changed the shared file's flags"


def test_wait_goes_on_when_another_thread_takes_the_records(pipe: Pipe) -> None:
    """A's poll sees a record that B then reads: A waits on, and gets the next one."""
    dev = pipe.dev
    pipe.write([1])
    a = PausedThread(lambda: dev.wait_invalidations(JOIN), Device.wait_invalidations, after_poll, JOIN)
    pipe.threads.append(a)
    a.start_and_pause()
    assert handles(dev.read_events()) == [1]
    a.resume()
    a.join(0.3)
    assert a.is_alive(), f"wait_invalidations({JOIN}) returned {a.result} before its timeout, with no record"
    pipe.write([2])
    assert not pipe.hung([a])
    assert a.error is None and a.result is not None and handles(a.result) == [2], (a.result, a.error)


def test_wait_returns_nothing_only_when_the_timeout_is_over(pipe: Pipe) -> None:
    dev = pipe.dev
    t0 = time.monotonic()
    assert dev.wait_invalidations(0) == [] and dev.wait_invalidations(-1) == []
    assert dev.wait_invalidations(0.2) == [] and time.monotonic() - t0 >= 0.2
    pipe.write([1])
    timeout = 0.5
    a = PausedThread(lambda: dev.wait_invalidations(timeout), Device.wait_invalidations, after_poll, JOIN)
    pipe.threads.append(a)
    t0 = time.monotonic()
    a.start_and_pause()
    assert handles(dev.read_events()) == [1]  # taken between A's poll and A's read
    a.resume()
    assert not pipe.hung([a])
    took = time.monotonic() - t0
    assert a.error is None and a.result == [], (a.result, a.error)
    assert took >= timeout, f"wait_invalidations({timeout}) gave up after {took:.3f} s"


@pytest.mark.parametrize("seed", range(3))
def test_threads_racing_for_records_get_each_exactly_once(pipe: Pipe, seed: int) -> None:
    """Readers (read_events, wait_invalidations with a short timeout) race a producer: none
    hangs, every record goes to exactly one of them, and the file stays non-blocking."""
    dev, rng, n = pipe.dev, random.Random(seed), 5000
    stop = threading.Event()
    got: dict[str, list[int]] = {}
    errors: list[BaseException] = []

    def reader(name: str, read: Callable[[], list[Event]]) -> threading.Thread:
        mine = got.setdefault(name, [])

        def body() -> None:
            try:
                while not stop.is_set():
                    mine.extend(handles(read()))
            except BaseException as exc:  # noqa: B036 - handed to the test
                errors.append(exc)

        return threading.Thread(target=body, name=name, daemon=True)

    readers = [reader(f"read_events {i}", dev.read_events) for i in range(2)]
    readers += [reader(f"wait_invalidations {i}", lambda: dev.wait_invalidations(0.01)) for i in range(2)]
    pipe.threads += readers
    for t in readers:
        t.start()
    h = 1
    while h <= n:
        burst = min(rng.randint(1, 50), n - h + 1)
        pipe.write(range(h, h + burst))
        h += burst
        if rng.random() < 0.3:
            time.sleep(rng.random() / 1000)
    end = time.monotonic() + JOIN
    while sum(len(v) for v in got.values()) < n and time.monotonic() < end and not errors:
        time.sleep(0.01)
    stop.set()
    hung = pipe.hung(readers)
    assert not hung and not errors, f"hung (asleep in read()): {hung}; errors: {errors}"
    counts = Counter(x for v in got.values() for x in v)
    assert sorted(counts) == list(range(1, n + 1)), f"{n - len(counts)} records never read"
    assert max(counts.values()) == 1, "a record was read twice"
    assert not os.get_blocking(dev.fileno()), "read_events() changed the shared file's flags"


def test_one_fork_hook_covers_every_live_devices_map() -> None:
    """The module's fork hook: in the child each live Device's validity map reads zeros and
    its lock is a new one (the parent's may be held by a thread that is not in the child)."""
    devs = [bare_device() for _ in range(3)]
    for d in devs[:2]:
        d._map = mmap.mmap(-1, 2 * mmap.PAGESIZE)
        d._map.write(b"\xff" * len(d._map))
    for d in devs:
        device_mod._DEVICES.add(d)
    held = devs[0]._lock
    held.acquire()
    try:

        def child() -> int:
            for d in devs[:2]:
                assert d._map is not None
                if d._map[:] != bytes(len(d._map)):
                    return 2
            if devs[0]._lock is held or not devs[0]._lock.acquire(blocking=False):
                return 3
            return 0 if devs[2]._map is None else 4

        assert in_child(child) == 0
        for d in devs[:2]:
            assert d._map is not None and d._map[:] == b"\xff" * len(d._map), "the parent's map changed"
        assert devs[0]._lock is held
    finally:
        held.release()
        for d in devs:
            d.close()
