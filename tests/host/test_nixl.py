"""gpupin.nixl over NIXL's UCX backend with host memory (DRAM), two processes.

The same scenarios run on a GPU with VRAM in tests/gpu/test_nixl.py.  NIXL is an optional
dependency; 'make setup' installs it (nixl-cu13 without torch).
"""

from __future__ import annotations

import contextlib
import dataclasses
import struct
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("nixl_cu13", reason="NIXL is not installed: run 'make setup' (pip install --no-deps nixl-cu13)")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nixl_target import (  # noqa: E402
    MiB,
    RemoteBufferOf,
    Target,
    deregistered_through_nixl,
    scenario_churn,
    scenario_freed_target,
    scenario_prepared,
)

import gpupin  # noqa: E402
from gpupin.hostmem import HostMemory  # noqa: E402
from gpupin.nixl import NixlEndpoint, NixlError, RemoteBuffer, StaleRemote  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def target() -> Iterator[Target]:
    t = Target("host")
    yield t
    if t.proc.poll() is None:
        t.kill()


@pytest.fixture
def ep(target: Target) -> Iterator[tuple[NixlEndpoint, HostMemory]]:
    mem = HostMemory(128 << 20)
    # auto_progress: the initiator answers the target's revocations while a test waits on it.
    e = NixlEndpoint("initiator", mem, mem_type="DRAM", auto_progress=True)
    e.connect(target.metadata)
    target.call("connect", e.metadata())
    yield e, mem
    e.close()
    mem.close()


def test_churn_every_byte_lands_where_named(ep: tuple[NixlEndpoint, HostMemory], target: Target) -> None:
    e, mem = ep
    out = scenario_churn(e, mem, target, rounds=40)
    assert out["registrations"] < out["rounds"]  # the cache, not a registration per transfer
    x = mem.alloc(MiB)
    rb = RemoteBufferOf(target, target.call("alloc", MiB), MiB)
    e.write(x, 4096, rb)
    assert not deregistered_through_nixl(e, x, 4096, rb)  # the check can tell
    agent = e.agent  # close() retires the endpoint's agent; this reference keeps it for the check
    e.close()
    assert e.driver.live == 0 and deregistered_through_nixl(e, x, 4096, rb, agent)
    assert target.close() == 0


def test_a_prepared_write_lands_while_what_it_names_changes(
    ep: tuple[NixlEndpoint, HostMemory], target: Target
) -> None:
    e, mem = ep
    assert scenario_prepared(e, mem, target) == {"lists_prepped": 4, "local_again": 1}


def test_a_write_into_a_freed_target_buffer_is_prevented(ep: tuple[NixlEndpoint, HostMemory], target: Target) -> None:
    e, mem = ep
    assert scenario_freed_target(e, mem, target) == "refused"
    e.close()
    assert target.close() == 0


def test_bad_ranges_and_memory_are_refused_with_nothing_registered(
    ep: tuple[NixlEndpoint, HostMemory], target: Target
) -> None:
    e, mem = ep
    a, b = mem.alloc(MiB), mem.alloc(MiB)
    rb = RemoteBufferOf(target, target.call("alloc", 4 * MiB), 4 * MiB)
    with pytest.raises(gpupin.InvalidArgument, match="runs past its allocation"):
        e.write(a + MiB - 4096, 8192, rb)  # spans a and b
    with pytest.raises(gpupin.NotGpuMemory):
        e.write(mem.BASE + mem.arena_size + (1 << 30), 4096, rb)  # not the provider's memory
    with pytest.raises(gpupin.InvalidArgument, match="inside the remote buffer"):
        e.write(a, 8192, rb, offset=4 * MiB - 4096)
    assert e.driver.live == 0 and e.cache.stats().pins == 0
    mem.free(a)
    mem.free(b)


def test_a_bad_block_of_a_scatter_list_is_named_with_nothing_registered(
    ep: tuple[NixlEndpoint, HostMemory], target: Target
) -> None:
    """Blocks into one exposure are checked column by column; the one that does not fit is
    the one the error names, wherever it is in the list."""
    e, mem = ep
    a = mem.alloc(MiB)
    rb = RemoteBufferOf(target, target.call("alloc", 4 * MiB), 4 * MiB)
    good = [(a + i * 4096, 4096, rb, i * 65536) for i in range(8)]
    for bad, why in (
        ((a + 5 * 4096, 8192, rb, 4 * MiB - 4096), f"8192, offset={4 * MiB - 4096}"),
        ((a + 5 * 4096, 0, rb, 0), "0, offset=0"),
        ((a + 5 * 4096, 4096, rb, -4096), "4096, offset=-4096"),
    ):
        with pytest.raises(gpupin.InvalidArgument, match=f"{why}\\): .* inside the remote buffer of {4 * MiB} bytes"):
            e.write_blocks([*good[:5], bad, *good[6:]])
    assert e.driver.live == 0 and e.cache.stats().pins == 0
    e.write_blocks(good)
    mem.free(a)


def test_a_remote_that_went_away_is_a_clear_error(ep: tuple[NixlEndpoint, HostMemory], target: Target) -> None:
    e, mem = ep
    src = mem.alloc(MiB)
    rb = RemoteBufferOf(target, target.call("alloc", MiB), MiB)
    e.write(src, MiB, rb)
    target.kill()
    with pytest.raises(NixlError) as ei:
        e.write(src, MiB, rb, timeout=5)
    assert not isinstance(ei.value, StaleRemote)
    assert e.cache.held() == 0  # the failed transfer let go of its registration
    mem.free(src)
    e.close()
    assert e.driver.live == 0


def test_remote_buffer_round_trips_through_bytes() -> None:
    rb = RemoteBuffer(
        "peer-1", 0x7F00_0000_1000, 12345, 2, "VRAM", 77, 2**63 + 5, 2**64 - 1, (5 << 32) | 9, 3, 2**63 - 1, b"\x00md"
    )
    assert RemoteBuffer.from_bytes(rb.to_bytes()) == rb
    wide = RemoteBuffer("wörker-ü", 1, 2, 0, "DRAM", 3, 4, 0, 5, 0, 6, b"md")  # a name in more bytes than letters
    assert RemoteBuffer.from_bytes(wide.to_bytes()) == wide
    for bad in (b"", b"gprb" + bytes(10), b"xxxx" + rb.to_bytes()[4:]):
        with pytest.raises(gpupin.InvalidArgument, match="RemoteBuffer"):
            RemoteBuffer.from_bytes(bad)


def test_one_process_two_agents_and_the_cache_counts(tmp_path: Path) -> None:
    """Two endpoints in one process: hits, re-registration after a free, LRU under max_bytes."""
    mt, mi = HostMemory(64 << 20), HostMemory(64 << 20)
    tgt = NixlEndpoint("t1", mt, mem_type="DRAM")
    ini = NixlEndpoint("i1", mi, mem_type="DRAM", max_bytes=3 * MiB)
    try:
        ini.connect(tgt.metadata())
        tgt.connect(ini.metadata())
        import threading

        stop = threading.Event()
        pump = threading.Thread(target=lambda: tgt.serve(120, stop.is_set))
        pump.start()
        dst = mt.alloc(MiB)
        rb = tgt.expose(dst, MiB)
        bufs = [mi.alloc(MiB) for _ in range(4)]
        for i, p in enumerate(bufs):
            mi.write(p, bytes([i + 1]) * 4096)
            ini.write(p, 4096, rb)
            assert mt.read(dst, 4096) == bytes([i + 1]) * 4096
        st = ini.cache.stats()
        assert (st.pins, st.evictions_limit, ini.driver.live) == (4, 1, 3)  # 3 MiB budget: LRU went
        ini.write(bufs[3], 4096, rb)  # a hit
        mi.free(bufs[3])
        assert mi.alloc(MiB) == bufs[3]
        ini.write(bufs[3], 4096, rb)  # a new buffer id: registered again
        st = ini.cache.stats()
        assert (st.pins, st.hits, st.invalidations_buffer_id) == (5, 1, 1)
    finally:
        try:
            ini.close()  # while the target serves: it acknowledges the lease drop
        finally:
            stop.set()
            pump.join()
            tgt.close()
            mi.close()
            mt.close()
    assert ini.driver.live == 0 and tgt.driver.live == 0


class Pair:
    """A target and an initiator endpoint in this process, the target answering from a thread.
    The garbage collector runs as it will: gpupin makes no NIXL call from it."""

    def __init__(
        self, *, connect_back: bool = True, target_max_bytes: int = 0, tag: str = "", auto_progress: bool = False
    ) -> None:
        import threading

        self.mt, self.mi = HostMemory(16 << 20), HostMemory(16 << 20)
        self.tgt = NixlEndpoint(f"t-pair{tag}", self.mt, mem_type="DRAM", max_bytes=target_max_bytes)
        self.ini = NixlEndpoint(f"i-pair{tag}", self.mi, mem_type="DRAM", auto_progress=auto_progress)
        self.ini.connect(self.tgt.metadata())
        if connect_back:
            self.tgt.connect(self.ini.metadata())
        self.stop = threading.Event()
        self.pump = threading.Thread(target=lambda: self.tgt.serve(120, self.stop.is_set))
        self.pump.start()

    def serve_again(self) -> None:
        """The target answers from its thread again (after a test stopped it)."""
        import threading

        if not self.pump.is_alive():
            self.stop.clear()
            self.pump = threading.Thread(target=lambda: self.tgt.serve(120, self.stop.is_set))
            self.pump.start()

    def close(self) -> None:
        self.serve_again()
        try:
            self.ini.close()  # while the target serves: it acknowledges the lease drops
        finally:
            self.stop.set()
            self.pump.join()
        self.tgt.close()
        self.mi.close()
        self.mt.close()


def test_answers_are_matched_to_the_endpoint_and_peer_that_asked() -> None:
    """A verdict goes to the endpoint and peer that asked (a second endpoint on one agent, which
    would read the first one's notifications, is refused).  The target's allocation is freed
    behind the provider's back (what gpupin cannot prevent): the check that confirm=True asks
    for says so, to that initiator alone."""
    p = Pair()
    try:
        p.tgt.watch_interval = 3600.0  # the check, not the watch, is what this test is about
        with pytest.raises(gpupin.InvalidArgument, match="one endpoint per agent"):
            NixlEndpoint("i-pair-2", p.mi, mem_type="DRAM", agent=p.ini.agent)  # would take i-pair's answers
        other = NixlEndpoint("i-pair-2", p.mi, mem_type="DRAM")
        other.connect(p.tgt.metadata())
        p.tgt.connect(other.metadata())
        a, b = p.mt.alloc(MiB), p.mt.alloc(MiB)
        ra, rb = p.tgt.expose(a, MiB), p.tgt.expose(b, MiB)
        src = p.mi.alloc(MiB)
        p.ini.write(src, 4096, ra, confirm=True)
        p.mt._fit.free(a)  # behind the hold: another allocator's free
        assert p.mt.alloc(MiB) == a
        for _ in range(3):
            other.write(src, 4096, rb, confirm=True)  # good transfers, answered on the shared agent
            other.write(src, 4096, rb)
        with pytest.raises(StaleRemote, match="detected after the fact"):
            p.ini.write(src, 4096, ra, confirm=True)
        assert p.tgt.stale_transfers == 1 and p.ini.stale_answers == 1 and other.stale_answers == 0
        with pytest.raises(StaleRemote, match="found stale on arrival"):
            p.ini.write(src, 4096, ra)  # the lease is broken: refused before sending
        assert not p.ini._waiting and not other._waiting  # nothing left behind
        other.close()
    finally:
        p.close()


def test_application_notifications_survive_a_transfer() -> None:
    p = Pair()
    try:
        dst = p.mt.alloc(MiB)
        rb = p.tgt.expose(dst, MiB)
        with p.tgt.driver.lock:
            p.tgt.agent.send_notif("i-pair", b"app-hello")
        src = p.mi.alloc(MiB)
        p.ini.write(src, 4096, rb)  # waits for its answer, reading notifications meanwhile
        got = p.ini.progress()
        for _ in range(200):
            if got:
                break
            got = p.ini.progress()
        assert ("t-pair", b"app-hello") in got
    finally:
        p.close()


def test_a_target_that_cannot_answer_is_named() -> None:
    """The target never loaded the initiator's metadata: it cannot answer, and both sides say so."""
    p = Pair(connect_back=False)
    try:
        rb = p.tgt.expose(p.mt.alloc(MiB), MiB)
        with pytest.warns(RuntimeWarning, match="connect\\(\\) with its metadata"):
            with pytest.raises(NixlError, match="loaded this endpoint's metadata"):
                p.ini.write(p.mi.alloc(MiB), 4096, rb, timeout=3)
            p.stop.set()
            p.pump.join()
        assert p.tgt.unanswered >= 1 and p.ini.cache.held() == 0
    finally:
        p.close()


def test_an_exposed_buffer_stays_registered_until_unexposed() -> None:
    p = Pair(target_max_bytes=MiB, auto_progress=True)
    try:
        a, b = p.mt.alloc(MiB), p.mt.alloc(MiB)
        ra = p.tgt.expose(a, MiB)
        with pytest.raises(gpupin.BudgetExceeded):
            p.tgt.expose(b, MiB)  # a is exposed: the LRU may not take it
        p.ini.write(p.mi.alloc(MiB), 4096, ra)
        p.tgt.unexpose(ra)
        rb = p.tgt.expose(b, MiB)  # now a may go
        assert p.tgt.cache.stats().evictions_limit == 1 and rb.addr == b
    finally:
        p.close()


def _watch_calls(ep: NixlEndpoint, calls: list[tuple[str, bool]]) -> weakref.ref[Any]:
    """Record each deregistration, notification read and transfer release of ``ep``'s agent,
    and its destruction, with whether the garbage collector was running on that thread; a
    weak reference to the agent."""
    agent = ep.agent
    ref = weakref.ref(agent, lambda _: calls.append(("destroyed", gpupin.nixl.collecting())))
    for name in ("deregister_memory", "get_new_notifs", "release_xfer_handle"):

        def spy(*args: Any, _name: str = name) -> Any:
            calls.append((_name, gpupin.nixl.collecting()))
            return getattr(type(ref()), _name)(ref(), *args)

        setattr(agent, name, spy)  # the spy holds the agent weakly: no cycle keeps it
    return ref


def test_endpoints_left_to_the_collector_make_no_nixl_call_from_it() -> None:
    """Pairs of endpoints dropped without close(), in reference cycles, collected on another
    thread while a third pair transfers on this one, many times: no NIXL call is made from the
    collector (the registrations wait for reap()), nothing aborts, and once reaped every
    dropped agent is destroyed with nothing left registered."""
    import gc
    import threading

    busy = Pair(tag="-busy")
    calls: list[tuple[str, bool]] = []
    agents: list[weakref.ref[Any]] = []
    stop = threading.Event()
    collections = [0]

    def collect() -> None:
        while not stop.is_set():
            gc.collect()
            collections[0] += 1
            time.sleep(0.002)

    collector = threading.Thread(target=collect)
    try:
        dst, src = busy.mt.alloc(MiB), busy.mi.alloc(MiB)
        rb = busy.tgt.expose(dst, MiB)
        collector.start()
        for i in range(12):
            mt, mi = HostMemory(4 << 20), HostMemory(4 << 20)
            tgt = NixlEndpoint(f"t-drop-{i}", mt, mem_type="DRAM")
            ini = NixlEndpoint(f"i-drop-{i}", mi, mem_type="DRAM")
            agents += [_watch_calls(tgt, calls), _watch_calls(ini, calls)]
            ini.connect(tgt.metadata())
            tgt.connect(ini.metadata())
            r = tgt.expose(mt.alloc(MiB), MiB)  # registered, held until close
            with ini.cache.acquire(mi.alloc(MiB), MiB):  # registered, then idle in the cache
                pass
            if i % 2:  # a registration held by the garbage too: close() refuses (InUse) in there
                tgt.held = tgt.cache.acquire(mt.alloc(MiB), MiB)  # type: ignore[attr-defined]
            tgt.cycle, ini.cycle = ini, tgt  # type: ignore[attr-defined] - only the collector frees them
            del tgt, ini, r
            for _ in range(5):
                busy.ini.write(src, 4096, rb)
    finally:
        stop.set()
        if collector.is_alive():
            collector.join()
        busy.close()
    gc.collect()
    gpupin.nixl.reap()
    assert collections[0] > 0
    assert not [c for c in calls if c[1]], "a NIXL call was made (or an agent destroyed) in the garbage collector"
    assert sum(1 for name, _ in calls if name == "destroyed") == len(agents)
    # Each idle registration deregistered (after the collector, by reap()); an exposed one, still
    # held when the cache's finalizer ran, went with its agent.
    assert sum(1 for name, _ in calls if name == "deregister_memory") >= 12
    assert all(ref() is None for ref in agents), "a dropped endpoint's agent outlived reap()"


def test_a_malformed_notification_loses_nothing() -> None:
    """A notification with gpupin's prefix but not its layout, in one batch with the
    application's own: progress() raises nothing and returns every application message, the
    malformed one too (counted and warned about once)."""
    p = Pair()
    try:
        bad = [
            b"gpupin-nixl-ack/1:short",  # an older gpupin's
            b"gpupin-nixl/5:H" + bytes(3),  # too short for its head
            b"gpupin-nixl/5:G" + struct.pack("<QH", 1, 5),  # five entries announced, none there
            b"gpupin-nixl/5:X" + struct.pack("<QH", 1, 60000) + bytes(16),  # over the entry limit
            b"gpupin-nixl/5:Z" + bytes(8),  # no such kind
        ]
        with p.tgt.driver.lock:
            p.tgt.agent.send_notif("i-pair", b"app-1")
            for m in bad:
                p.tgt.agent.send_notif("i-pair", m)
            p.tgt.agent.send_notif("i-pair", b"app-2")
        got: list[tuple[str, bytes]] = []
        with pytest.warns(RuntimeWarning, match="not one of gpupin's messages"):
            for _ in range(2000):
                got += p.ini.progress()
                if len(got) >= 2 + len(bad):
                    break
                time.sleep(0.001)
        assert sorted(m for _, m in got) == sorted([b"app-1", b"app-2", *bad])
        assert p.ini.malformed_notifications == len(bad)
    finally:
        p.close()


def test_a_message_whose_handling_fails_loses_nothing_else() -> None:
    """A message of gpupin's layout whose handling raises (here: NIXL refusing the metadata a
    request asked for) took the rest of its batch with it: the application's messages
    after it were lost and progress() raised."""
    p = Pair()
    p.stop.set()
    p.pump.join()  # the target takes its notifications here

    def refuse() -> bytes:
        raise RuntimeError("NIXL refused")

    try:
        with p.ini.driver.lock:
            p.ini.agent.send_notif("t-pair", b"gpupin-nixl/5:M" + struct.pack("<Q", 7))  # a metadata request
            p.ini.agent.send_notif("t-pair", b"app-after")
        p.tgt.agent.get_agent_metadata = refuse
        got: list[tuple[str, bytes]] = []
        with pytest.warns(RuntimeWarning, match="a message from i-pair failed .RuntimeError: NIXL refused"):
            for _ in range(2000):
                got += p.tgt.progress()
                if got:
                    break
                p.ini.progress()  # a new connection moves with both sides' progress
                time.sleep(0.001)
        assert got == [("i-pair", b"app-after")] and p.tgt.unanswered == 1
    finally:
        del p.tgt.agent.get_agent_metadata
        p.close()


@contextlib.contextmanager
def _slow_transfers(ep: NixlEndpoint) -> Iterator[list[bool]]:
    """Make ``ep``'s transfers report PROC (posted for real) while the flag it gives is set;
    NIXL's own calls again when the block ends."""
    agent = ep.agent
    slow = [True]
    real_transfer, real_check = type(agent).transfer, type(agent).check_xfer_state
    ref = weakref.ref(agent)

    def transfer(h: Any, *a: Any) -> str:
        state = real_transfer(ref(), h, *a)
        return "PROC" if slow[0] else state

    def check(h: Any) -> str:
        state = real_check(ref(), h)
        return "PROC" if slow[0] and state in ("PROC", "DONE") else state

    agent.transfer, agent.check_xfer_state = transfer, check
    try:
        yield slow
    finally:
        slow[0] = False
        del agent.transfer, agent.check_xfer_state


@contextlib.contextmanager
def _served(tgt: NixlEndpoint) -> Iterator[None]:
    """``tgt`` answers from a thread (serve()) while the block runs: leases are granted."""
    import threading

    stop = threading.Event()
    server = threading.Thread(target=tgt.serve, args=(30, stop.is_set))
    server.start()
    try:
        yield
    finally:
        stop.set()
        server.join()


def test_a_transfer_past_its_timeout_keeps_its_buffer_registered_until_it_ends() -> None:
    """NIXL still says PROC when write() gives up: the handle is not released (that would cancel
    UCX's requests, not bytes on their way) and the local registration stays held, so the cache
    can neither evict nor deregister it; settle() lets both go once NIXL says it ended, and
    close() refuses while one runs."""
    p = Pair()
    try:
        with _slow_transfers(p.ini) as slow:
            dst = p.mt.alloc(MiB)
            rb = p.tgt.expose(dst, MiB)
            src = p.mi.alloc(MiB)
            with pytest.raises(NixlError, match="stays registered") as ei:
                p.ini.write(src, 4096, rb, timeout=0.2)
            assert ei.value.status == "timeout"
            assert p.ini.pending_transfers() == 1 and p.ini.cache.held() == 1
            assert p.ini.settle(0.05) == 1
            with pytest.raises(gpupin.InUse, match="NIXL has not ended"):
                p.ini.close()  # waits 5 s for it, then refuses, changing nothing
            assert p.ini.cache.held() == 1 and p.ini.driver.live == 1
            slow[0] = False
            assert p.ini.settle(5) == 0
            assert p.ini.cache.held() == 0 and p.ini.pending_transfers() == 0
    finally:
        p.close()


def test_a_transfer_goes_through_nixl_bindings_unless_the_agent_methods_are_replaced() -> None:
    """The hot path calls NIXL's binding (gpupin.nixl._Direct) behind nixl_agent's transfer
    methods; a method replaced on the agent (a test's double) takes every call again, and
    the bytes land either way.  Fails with another NIXL whose agent is not read so."""
    p = Pair()
    try:
        dst, src = p.mt.alloc(MiB), p.mi.alloc(MiB)
        rb = p.tgt.expose(dst, MiB)
        assert p.ini.driver.direct() is not None, "NIXL's agent is not the one gpupin.nixl._Direct reads"
        agent = p.ini.agent
        real, ref, calls = type(agent).transfer, weakref.ref(agent), []

        def transfer(h: Any, *a: Any) -> str:
            calls.append(h)
            return real(ref(), h, *a)

        agent.transfer = transfer
        try:
            assert p.ini.driver.direct() is None
            p.mi.write(src, b"\x11" * 4096)
            p.ini.write(src, 4096, rb)
            assert len(calls) == 1 and p.mt.read(dst, 4096) == b"\x11" * 4096
        finally:
            del agent.transfer
        assert p.ini.driver.direct() is not None
        p.mi.write(src, b"\x22" * 4096)
        p.ini.write(src, 4096, rb)
        assert len(calls) == 1 and p.mt.read(dst, 4096) == b"\x22" * 4096
    finally:
        p.close()


def _running_post(d: Any) -> Any:
    """For NIXL's bindings ``d`` (gpupin.nixl._Direct): a post that posts for real (``d``'s
    post as it is now) and says the transfer runs on, as NIXL says of most VRAM transfers."""
    real = d.post

    def post_runs(h: int, notif: bytes) -> int:
        real(h, notif)
        return d.in_prog

    return post_runs


def test_the_binding_path_fails_as_the_wrappers_do() -> None:
    """Faults injected behind gpupin.nixl._Direct (the doubles the other tests set on the agent
    turn it off): a post that fails after NIXL made the request holds nothing afterwards and
    the next write goes through; a status query that says NOT_FOUND while the transfer runs
    leaves it lost (held until forget_peer), as _check would."""

    class nixlNotFoundError(Exception):  # noqa: N801 - NIXL's name, which gpupin reads
        pass

    p = Pair()
    try:
        dst, src = p.mt.alloc(MiB), p.mi.alloc(MiB)
        rb = p.tgt.expose(dst, MiB)
        p.ini.write(src, 4096, rb)
        d = p.ini.driver._direct
        assert d is not None and p.ini.driver.direct() is d
        real_post, real_status = d.post, d.status
        lease = p.ini._leases[(rb.agent, rb.xid)]

        def post_fails(h: int, notif: bytes) -> int:
            raise RuntimeError("injected")

        d.post = post_fails
        live = len(gpupin.nixl._LIVE_XFERS)
        with pytest.raises(NixlError, match="injected"):
            p.ini.write(src, 4096, rb)
        d.post = real_post
        assert p.ini.cache.held() == 0 and not p.ini._running and lease.inflight == 0
        assert len(gpupin.nixl._LIVE_XFERS) == live
        p.mi.write(src, b"\x66" * 4096)
        p.ini.write(src, 4096, rb)
        assert p.mt.read(dst, 4096) == b"\x66" * 4096

        post_runs = _running_post(d)

        def not_found(h: int) -> int:
            raise nixlNotFoundError("injected")

        d.post, d.status = post_runs, not_found
        try:
            with pytest.raises(NixlError, match="lost its view") as ei:
                p.ini.write(src, 4096, rb)
        finally:
            d.post, d.status = real_post, real_status
        assert ei.value.status == "lost" and p.ini.cache.held() == 1 and lease.lost == 1
        p.ini.forget_peer(rb.agent)
        assert p.ini.cache.held() == 0 and p.ini.pending_transfers() == 0
    finally:
        p.close()


def test_a_steady_write_that_runs_past_its_post_ends_in_one_frame(monkeypatch: pytest.MonkeyPatch) -> None:
    """A steady write that NIXL does not end within its post (VRAM's case) is polled in
    _quick's frame (NixlEndpoint._quick_wait): no Transfer is made where NIXL says DONE, and
    what the transfer held is let go.  A revocation taken while it ran waits for it: the lease
    is dropped once it ended, not before.  Any other answer, a poll past the spin and an
    interrupt each make the Transfer it would have been, which ends as _spin would end it:
    a failure holds nothing, an interrupted one is polled until settle() sees it over."""
    import threading

    import gpupin.nixl as gn

    monkeypatch.setattr(gn, "_PUMP_EVERY_S", 60.0)  # a post's own pump would take _post's path
    monkeypatch.setattr(gn, "_SPIN_S", 30.0)  # polled in the frame until the answers say otherwise
    made: list[object] = []

    class Counted(gn.Transfer):
        __slots__ = ()

        def __init__(self, *a: Any) -> None:
            made.append(self)
            super().__init__(*a)

    p = Pair()
    try:
        dst, src = p.mt.alloc(MiB), p.mi.alloc(MiB)
        rb = p.tgt.expose(dst, MiB)
        p.ini.write(src, 4096, rb)  # the lease: through _post
        monkeypatch.setattr(gn, "Transfer", Counted)
        d = p.ini.driver._direct
        assert d is not None and p.ini.driver.direct() is d
        real_status = d.status
        lease = p.ini._leases[(rb.agent, rb.xid)]
        live = len(gn._LIVE_XFERS)
        polls: list[int] = []
        answers: list[Any] = []

        post_runs = _running_post(d)

        def scripted(h: int) -> int:  # the scripted answers first, then NIXL's own
            polls.append(h)
            if answers:
                a = answers.pop(0)
                if isinstance(a, BaseException):
                    raise a
                return a() if callable(a) else int(a)
            return int(real_status(h))

        d.post, d.status = post_runs, scripted

        def held_nothing() -> None:
            assert p.ini.cache.held() == 0 and lease.inflight == 0 and not p.ini._running
            assert len(gn._LIVE_XFERS) == live

        # (a) DONE after three polls that said it ran: no Transfer, nothing held.
        answers[:] = [d.in_prog] * 3
        p.mi.write(src, b"\x31" * 4096)
        p.ini.write(src, 4096, rb)
        assert p.mt.read(dst, 4096) == b"\x31" * 4096
        assert len(polls) >= 4 and made == []  # (and as many more as NIXL said it ran)
        held_nothing()

        # (b) NIXL's failure, said by the poll: the Transfer, failed; nothing held.
        answers[:] = [-1]
        with pytest.raises(NixlError, match="failed"):
            p.ini.write(src, 4096, rb)
        assert len(made) == 1
        held_nothing()

        # (c) Still running past the spin: the Transfer's wait goes on from there.
        monkeypatch.setattr(gn, "_SPIN_S", 0.001)
        # (running until the spin gave up and made the Transfer: by count, not by the clock,
        # which a loaded machine may let pass before the write starts)
        answers[:] = [(lambda: d.ok if len(made) >= 2 else d.in_prog)] * 1000000
        p.ini.write(src, 4096, rb)
        monkeypatch.setattr(gn, "_SPIN_S", 30.0)
        assert len(made) == 2 and made[-1].state == "DONE"  # type: ignore[attr-defined]
        answers.clear()
        held_nothing()

        # (d) Interrupted while polled: polled from then on, over once settle() sees it.
        answers[:] = [d.in_prog, KeyboardInterrupt()]
        with pytest.raises(KeyboardInterrupt):
            p.ini.write(src, 4096, rb)
        assert len(made) == 3 and made[-1] in p.ini._inflight and lease.inflight == 1  # (not polled yet)
        assert p.ini.settle(5) == 0
        held_nothing()

        # (e) A revocation taken while it runs: the lease stays until the transfer ended.
        polling, go = threading.Event(), threading.Event()
        answers[:] = [lambda: polling.set() or (d.ok if go.is_set() else d.in_prog)] * 1000000
        p.stop.set()
        p.pump.join()  # the target's unexpose() below takes its notifications itself
        unexposed: list[BaseException | None] = []

        def take_back() -> None:
            try:
                p.tgt.unexpose(rb, timeout=10)
                unexposed.append(None)
            except BaseException as exc:  # noqa: BLE001 - reported below
                unexposed.append(exc)

        def revoke() -> None:
            polling.wait(5)
            taker = threading.Thread(target=take_back)
            taker.start()
            end = time.monotonic() + 5
            while lease.state != "revoked" and time.monotonic() < end:
                p.ini.progress()  # between two polls: the writer lets the locks go
                time.sleep(0.001)
            time.sleep(0.01)
            dropped_early = (rb.agent, rb.xid) not in p.ini._leases
            go.set()
            taker.join(15)
            unexposed.append(AssertionError("dropped while it ran") if dropped_early else None)

        th = threading.Thread(target=revoke)
        th.start()
        p.ini.write(src, 4096, rb, timeout=20)
        th.join(20)
        answers.clear()
        assert lease.state == "dropped" and unexposed == [None, None]
        assert (rb.agent, rb.xid) not in p.ini._leases and lease.inflight == 0 and len(made) == 3
    finally:
        p.close()


class _InterruptedAfter:
    """NIXL's binding agent, but its ``name`` call raises KeyboardInterrupt once it returned,
    as CPython raises a Ctrl-C that came while NIXL ran the call."""

    def __init__(self, inner: Any, name: str) -> None:
        self._inner, self._name = inner, name

    def __getattr__(self, attr: str) -> Any:
        real = getattr(self._inner, attr)
        if attr != self._name:
            return real

        def call(*a: Any) -> Any:
            real(*a)
            raise KeyboardInterrupt

        return call


def _interrupted_release(ep: NixlEndpoint, src: int, rb: Any, kept: list[Any]) -> Any:
    """Post a write from ``ep`` that is still running after its post (it has a handle to
    release: NIXL's post is said to run on, through the bindings; an agent without them says so
    itself), then wait for it with a Ctrl-C landing as NIXL releases its handle: the handle
    must be marked released (else NIXL's finalizer frees it again).  Returns the Transfer;
    the handle goes into ``kept`` (the caller marks it released at the end, which keeps the
    process from that second release on code that fails this)."""
    d = ep.driver.direct()
    if d is not None:
        real = d.post
        d.post = _running_post(d)
    try:
        t = ep.post_write([(src, 4096, rb, 0)])
    finally:
        if d is not None:
            d.post = real
    assert t._h is not None and t.state == "PROC"
    h = t._h
    kept.append(h)
    h._agent = _InterruptedAfter(h._agent, "releaseXferReq")
    with pytest.raises(KeyboardInterrupt):
        t.wait()
    assert h._released, "NIXL released the handle and it is marked live: its finalizer frees it again"
    import gpupin.nixl as gn

    assert id(h) not in gn._LIVE_XFERS, "a released handle is still kept as live"
    assert gn._Direct.wrapped(h._handle) is None, "a released handle is handed out for its address"
    return t


def test_a_ctrl_c_as_nixl_releases_a_handle_leaves_it_released_once() -> None:
    """NIXL's own release() marks its handle object released only after NIXL's call returned:
    a Ctrl-C in between left it marked live, and NIXL's finalizer freed it a second time at
    exit (SIGSEGV).  gpupin marks it first, for a transfer's handle and a prepped list's."""
    p = Pair()
    kept: list[Any] = []
    try:
        dst, src = p.mt.alloc(MiB), p.mi.alloc(MiB)
        rb = p.tgt.expose(dst, MiB)
        p.ini.write(src, 4096, rb)
        lease = p.ini._leases[(rb.agent, rb.xid)]
        t = _interrupted_release(p.ini, src, rb, kept)
        # The transfer left the endpoint's books all the same: nothing counted or held for ever.
        assert t.state == "DONE" and t not in p.ini._running and lease.inflight == 0
        assert p.ini.cache.held() == 0
        prep = p.ini.prepare("WRITE", [(src, 4096, rb, 0)])
        prep.run()
        local = prep._prep.local
        kept.append(local)
        local._agent = _InterruptedAfter(local._agent, "releasedDlistH")
        with pytest.raises(KeyboardInterrupt):
            prep.close()
        assert local._released, "NIXL released the prepped list and it is marked live"
    finally:
        for h in kept:  # (on the code before, keep this process from that second release)
            h._released = True
        p.close()


def test_a_ctrl_c_as_a_steady_write_ends_leaves_nothing_held(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C landing as NIXL releases a steady write's handle (_quick's frame, the write
    over within its post or polled to its end there): the write raises it, and the token, the
    lease's count and the handle are each let go once: nothing stays held, and connect() (which
    waits for the peer's transfers) goes through."""
    import gpupin.nixl as gn

    monkeypatch.setattr(gn, "_PUMP_EVERY_S", 60.0)  # the writes take _quick
    monkeypatch.setattr(gn, "_SPIN_S", 30.0)  # and end in its frame
    p = Pair()
    try:
        dst, src = p.mt.alloc(MiB), p.mi.alloc(MiB)
        rb = p.tgt.expose(dst, MiB)
        p.ini.write(src, 4096, rb)  # the lease: through _post
        lease = p.ini._leases[(rb.agent, rb.xid)]
        d = p.ini.driver._direct
        assert d is not None
        real_post, real_status, real_release = d.post, d.status, p.ini.driver.release_id

        def release_then_ctrl_c(direct: Any, hid: int) -> None:
            real_release(direct, hid)
            raise KeyboardInterrupt

        def post_over(h: int, notif: bytes) -> int:  # over within its post (DRAM's usual case)
            real_post(h, notif)
            while real_status(h) != d.ok:
                pass
            return d.ok

        post_runs = _running_post(d)  # still running after its post (VRAM's)

        for post in (post_over, post_runs):
            d.post = post
            p.ini.driver.release_id = release_then_ctrl_c  # type: ignore[method-assign]
            try:
                with pytest.raises(KeyboardInterrupt):
                    p.ini.write(src, 4096, rb)
            finally:
                d.post = real_post
                del p.ini.driver.release_id
            assert p.ini.cache.held() == 0, f"{post.__name__}: the write's token stays held"
            assert lease.inflight == 0 and not p.ini._running, f"{post.__name__}: the lease counts it"
            p.ini.connect(p.tgt.metadata(), timeout=2)  # waits for no transfer
            p.mi.write(src, b"\x5a" * 4096)
            p.ini.write(src, 4096, rb)
            assert p.mt.read(dst, 4096) == b"\x5a" * 4096
    finally:
        p.close()


def _ctrl_c_after_send(agent: Any, kind: bytes) -> list[bytes]:
    """Make ``agent.send_notif`` raise KeyboardInterrupt once, after it really sent the first
    message of gpupin's ``kind`` (as a Ctrl-C that came while NIXL sent it)."""
    import gpupin.nixl as gn

    real, sent = agent.send_notif, []

    def send_notif(peer: Any, msg: bytes) -> Any:
        r = real(peer, msg)
        if not sent and msg.startswith(gn._PREFIX + kind):
            sent.append(msg)
            raise KeyboardInterrupt
        return r

    agent.send_notif = send_notif
    return sent


def test_a_ctrl_c_as_a_transfer_ends_with_messages_leaves_nothing_counted() -> None:
    """Ending a transfer sends messages (the target's check for confirm=True, the drop of a
    lease revoked meanwhile); a Ctrl-C as one of those sends returns left the transfer counted
    on its leases (connect, forget_peer and close refused for ever, a revoked lease never
    dropped).  The books are done before any send, and each revoked lease is dropped whatever
    another's drop raised."""
    import gpupin.nixl as gn

    p = Pair()
    try:
        a, b, src = p.mt.alloc(MiB), p.mt.alloc(MiB), p.mi.alloc(MiB)
        ra, rb = p.tgt.expose(a, MiB), p.tgt.expose(b, MiB)
        p.ini.write_blocks([(src, 4096, ra, 0), (src + 4096, 4096, rb, 0)])  # both leases
        la, lb = p.ini._leases[(ra.agent, ra.xid)], p.ini._leases[(rb.agent, rb.xid)]
        agent = p.ini.driver._agent
        sent = _ctrl_c_after_send(agent, gn._XFER)  # the target's check of a confirmed write
        try:
            with pytest.raises(KeyboardInterrupt):
                p.ini.write(src, 4096, ra, confirm=True)
        finally:
            del agent.send_notif
        assert sent, "no check was sent"
        assert la.inflight == 0 and not p.ini._running and p.ini.cache.held() == 0
        p.ini.connect(p.tgt.metadata(), timeout=2)  # waits for no transfer
        # Both leases revoked while a transfer into both runs; the first drop is interrupted.
        d = p.ini.driver._direct
        assert d is not None
        real_post = d.post

        d.post = _running_post(d)
        try:
            t = p.ini.post_write([(src, 4096, ra, 0), (src + 4096, 4096, rb, 0)])
        finally:
            d.post = real_post
        with p.ini._lock:  # what taking the target's REVOKE of each does to a lease in use
            la.state = lb.state = "revoked"
        sent = _ctrl_c_after_send(agent, gn._DROP)
        try:
            with pytest.raises(KeyboardInterrupt):
                t.wait()
        finally:
            del agent.send_notif
        assert len(sent) == 1 and t.state == "DONE"
        assert la.inflight == lb.inflight == 0, "a lease still counts the transfer: never dropped"
        assert (ra.agent, ra.xid) not in p.ini._leases and (rb.agent, rb.xid) not in p.ini._leases
        assert p.ini.cache.held() == 0 and not p.ini._running
    finally:
        p.close()


def _ctrl_c_after(obj: Any, name: str) -> None:
    """Make ``obj.name`` (set on the instance) raise KeyboardInterrupt once its real call
    returned (as a Ctrl-C that came while NIXL ran it)."""
    real = getattr(obj, name)

    def call(*a: Any, **k: Any) -> Any:
        real(*a, **k)
        raise KeyboardInterrupt

    setattr(obj, name, call)


def test_a_ctrl_c_as_nixl_changes_a_view_or_registration_leaves_nothing_trusted() -> None:
    """A Ctrl-C as NIXL's load of a peer's metadata, its removal of a peer, or its
    deregistration returns: the endpoint trusts no view of unknown age (the next transfer loads
    the peer's current metadata), keeps no connection NIXL dropped, and counts the dropped
    registration (peers renew their view of it)."""
    p = Pair()
    try:
        dst, src = p.mt.alloc(MiB), p.mi.alloc(MiB)
        rb = p.tgt.expose(dst, MiB)
        p.ini.write(src, 4096, rb)
        assert rb.agent in p.ini._views
        agent = p.ini.driver._agent
        _ctrl_c_after(agent, "add_remote_agent")
        try:
            with pytest.raises(KeyboardInterrupt):
                p.ini.connect(p.tgt.metadata())
        finally:
            del agent.add_remote_agent
        assert rb.agent not in p.ini._views, "a view loaded from the application's metadata is still trusted"
        p.mi.write(src, b"\x21" * 4096)
        p.ini.write(src, 4096, rb)
        assert p.mt.read(dst, 4096) == b"\x21" * 4096
        _ctrl_c_after(agent, "remove_remote_agent")
        try:
            with pytest.raises(KeyboardInterrupt):
                p.ini.forget_peer(rb.agent)
        finally:
            del agent.remove_remote_agent
        assert rb.agent not in p.ini._views and rb.agent not in p.ini._connected
        drv = p.tgt.driver
        reg = drv.pin(p.mt.alloc(MiB), MiB)
        before, live = drv.deregistrations, drv.live
        tagent = drv._agent
        _ctrl_c_after(tagent, "deregister_memory")
        try:
            with pytest.raises(KeyboardInterrupt):
                drv.unpin(reg)
        finally:
            del tagent.deregister_memory
        assert drv.deregistrations == before + 1, "NIXL dropped a registration that peers are not told of"
        assert drv.live == live - 1, "a registration NIXL dropped is still counted live"
    finally:
        p.close()


def test_a_ctrl_c_between_the_lease_counts_of_a_post_leaves_nothing_posted() -> None:
    """A transfer's leases count it before NIXL posts it: a Ctrl-C between two of the counts
    (Python raises one at a loop's back edge) leaves nothing posted and nothing counted.  Before,
    they counted it after the post: the later leases did not count a running transfer (a
    revocation answered at once, while its bytes still moved) and it was never polled."""
    import gpupin.nixl as gn

    class Tripwire(gn._Lease):
        """A lease whose next increment of ``inflight`` is interrupted before it happens."""

        armed = False

        @property  # type: ignore[override]
        def inflight(self) -> int:
            return self.__dict__.get("n", 0)

        @inflight.setter
        def inflight(self, v: int) -> None:
            if Tripwire.armed and v > self.__dict__.get("n", 0):
                Tripwire.armed = False
                raise KeyboardInterrupt
            self.__dict__["n"] = v

    p = Pair()
    try:
        a, b, src = p.mt.alloc(MiB), p.mt.alloc(MiB), p.mi.alloc(MiB)
        ra, rb = p.tgt.expose(a, MiB), p.tgt.expose(b, MiB)
        p.ini.write_blocks([(src, 4096, ra, 0), (src + 4096, 4096, rb, 0)])  # both leases
        la = p.ini._leases[(ra.agent, ra.xid)]
        old = p.ini._leases[(rb.agent, rb.xid)]
        lb = Tripwire(**{f: getattr(old, f) for f in old.__dataclass_fields__ if f != "inflight"})
        p.ini._leases[(rb.agent, rb.xid)] = lb
        p.mt.write(a, bytes(4096))
        p.mi.write(src, b"\x77" * 8192)
        Tripwire.armed = True
        with pytest.raises(KeyboardInterrupt):
            p.ini.write_blocks([(src, 4096, ra, 0), (src + 4096, 4096, rb, 0)])
        assert la.inflight == 0 and lb.inflight == 0, "a lease counts a transfer that was not posted"
        assert p.ini.pending_transfers() == 0 and p.ini.cache.held() == 0
        assert p.mt.read(a, 4096) == bytes(4096), "NIXL moved bytes of a transfer no lease counts"
        p.ini.write_blocks([(src, 4096, ra, 0), (src + 4096, 4096, rb, 0)])
        assert p.mt.read(b, 4096) == b"\x77" * 4096
    finally:
        Tripwire.armed = False
        p.close()


def _nixl_holds(drv: Any, va: int, size: int) -> bool:
    """Whether NIXL's agent under ``drv`` holds a registration of [va, va + size): deregistering
    it by range succeeds (it is gone then), NIXL refuses when it holds none."""
    agent = drv._agent
    try:
        agent.deregister_memory(agent.get_reg_descs([(va, size, drv.devid, "")], drv.mem_type))
    except Exception:  # noqa: BLE001 - NIXL's NOT_FOUND
        return False
    return True


def test_a_ctrl_c_as_nixl_registers_leaves_no_registration_behind() -> None:
    """A Ctrl-C as NIXL's register_memory returns lost its descriptor list: NIXL held a
    registration nothing ever deregistered (it outlived the buffer's free, went out in the
    agent's metadata for ever, and NIXL finds it first at its base).  It is recorded before
    NIXL's call and deregistered before the next registration and at close, counted as a drop."""
    p = Pair()
    try:
        drv = p.ini.driver
        va = p.mi.alloc(MiB)
        agent = drv._agent
        _ctrl_c_after(agent, "register_memory")
        try:
            with pytest.raises(KeyboardInterrupt):
                drv.pin(va, MiB)
        finally:
            del agent.register_memory
        before = drv.deregistrations
        reg = drv.pin(va, MiB)  # the same range again, as the cache does on the next miss
        assert drv.deregistrations == before + 1, "the interrupted registration's drop is not counted"
        drv.unpin(reg)
        assert drv.live == 0
        assert not _nixl_holds(drv, va, MiB), "NIXL holds a registration gpupin never deregisters"
        _ctrl_c_after(agent, "register_memory")  # and at close, with no registration after it
        try:
            with pytest.raises(KeyboardInterrupt):
                drv.pin(va, MiB)
        finally:
            del agent.register_memory
        p.ini.cache.close()
        with drv.lock:
            drv._drop_unsure()  # what close() does before the agent goes
        assert not _nixl_holds(drv, va, MiB), "NIXL holds a registration gpupin never deregisters"
    finally:
        p.close()


class _Tripwire:
    """Makes a lease's ``inflight`` and ``lost`` raise KeyboardInterrupt once, right after the
    first decrement of either among the leases so made (armed): as a Ctrl-C that Python raises
    at the back edge of the loop that made it."""

    armed = False

    @staticmethod
    def lease(old: Any) -> Any:
        import gpupin.nixl as gn

        class Lease(gn._Lease):
            def __setattr__(self, name: str, v: Any) -> None:
                before = self.__dict__.get(name, 0)
                object.__setattr__(self, name, v)
                if _Tripwire.armed and name in ("inflight", "lost") and v < before:
                    _Tripwire.armed = False
                    raise KeyboardInterrupt

        return Lease(**{f: getattr(old, f) for f in old.__dataclass_fields__})


def test_a_ctrl_c_between_the_lease_counts_of_an_ending_leaves_none_counted() -> None:
    """Ending a transfer takes it off each of its leases' counts, one pass each; a Ctrl-C
    between two passes left the later leases counting a transfer that was over, for ever
    (connect() and close() refused with InUse, a revoked lease never dropped).  The rest is
    finished whatever comes between two passes."""
    p = Pair()
    try:
        a, b, src = p.mt.alloc(MiB), p.mt.alloc(MiB), p.mi.alloc(MiB)
        ra, rb = p.tgt.expose(a, MiB), p.tgt.expose(b, MiB)
        blocks = [(src, 4096, ra, 0), (src + 4096, 4096, rb, 0)]
        p.ini.write_blocks(blocks)  # both leases
        for r in (ra, rb):
            p.ini._leases[(r.agent, r.xid)] = _Tripwire.lease(p.ini._leases[(r.agent, r.xid)])
        la, lb = p.ini._leases[(ra.agent, ra.xid)], p.ini._leases[(rb.agent, rb.xid)]
        _Tripwire.armed = True
        with pytest.raises(KeyboardInterrupt):
            p.ini.write_blocks(blocks)
        assert not _Tripwire.armed, "no lease's count was taken down"
        assert la.inflight == lb.inflight == 0, "a lease still counts a transfer that is over"
        assert p.ini.pending_transfers() == 0 and p.ini.cache.held() == 0
        p.ini.connect(p.tgt.metadata(), timeout=2)  # waits for no transfer
        # A transfer NIXL lost track of, found over by forget_peer: the same for ``lost``.
        with _not_found(p.ini):
            with pytest.raises(NixlError):
                p.ini.write_blocks(blocks, timeout=2)
        assert la.lost == lb.lost == 1
        _Tripwire.armed = True
        with pytest.raises(KeyboardInterrupt):
            p.ini.forget_peer(ra.agent)
        assert not _Tripwire.armed, "no lease's lost count was taken down"
        assert la.lost == lb.lost == 0, "a lease still counts a lost transfer that is over"
    finally:
        _Tripwire.armed = False
        p.close()


def test_a_ctrl_c_between_the_token_releases_of_an_ending_leaves_none_held() -> None:
    """A transfer from two local allocations holds two cache references; a Ctrl-C as the first
    release returned left the second held for ever (close() InUse, never evicted)."""
    p = Pair()
    try:
        dst, s1, s2 = p.mt.alloc(MiB), p.mi.alloc(MiB), p.mi.alloc(MiB)
        rb = p.tgt.expose(dst, MiB)
        blocks = [(s1, 4096, rb, 0), (s2, 4096, rb, 4096)]
        p.ini.write_blocks(blocks)
        cache = p.ini.cache
        real, released = cache.release_token, []

        def release(tok: int) -> Any:
            r = real(tok)
            if not released:
                released.append(tok)
                raise KeyboardInterrupt
            return r

        cache.release_token = release
        try:
            with pytest.raises(KeyboardInterrupt):
                p.ini.write_blocks(blocks)
        finally:
            cache.release_token = real
        assert released, "no reference was released"
        assert cache.held() == 0, "a reference of a transfer that is over is held for ever"
    finally:
        p.close()


def test_a_ctrl_c_before_a_lease_drop_is_sent_leaves_it_to_the_next_progress() -> None:
    """A lease revoked while a transfer under it runs is dropped when that ends; a Ctrl-C
    before its drop was sent (as the call that sends it starts) lost the drop, and the target's
    unexpose waited for it until its timeout.  The lease stays revoked until its drop went:
    the next progress() sends it."""
    import gpupin.nixl as gn

    p = Pair()
    try:
        with _slow_transfers(p.ini) as slow:
            dst, src = p.mt.alloc(MiB), p.mi.alloc(MiB)
            rb = p.tgt.expose(dst, MiB)
            with pytest.raises(NixlError, match="stays registered"):
                p.ini.write(src, 4096, rb, timeout=0.2)  # still "running" at NIXL
            lease = p.ini._leases[(rb.agent, rb.xid)]
            done = threading.Event()
            th = threading.Thread(target=lambda: (p.tgt.unexpose(rb, timeout=30), done.set()))
            th.start()
            end = time.monotonic() + 10
            while lease.state != "revoked" and time.monotonic() < end:
                p.ini.progress()
                time.sleep(0.01)
            assert lease.state == "revoked" and lease.inflight == 1
            agent = p.ini.driver._agent
            real, tried = agent.send_notif, []

            def send_notif(peer: Any, msg: bytes) -> Any:
                if not tried and msg.startswith(gn._PREFIX + gn._DROP):
                    tried.append(msg)
                    raise KeyboardInterrupt  # before NIXL sent it
                return real(peer, msg)

            agent.send_notif = send_notif
            try:
                slow[0] = False
                with pytest.raises(KeyboardInterrupt):
                    p.ini.settle(5)
            finally:
                del agent.send_notif
            assert tried and not done.is_set()
            p.ini.progress()
            assert done.wait(10), "the target still waits for a drop that was never sent"
            th.join()
    finally:
        p.close()


def _unexpose_returns_while_a_transfer_runs(p: Pair, src: int, rb: Any) -> tuple[bool, int]:
    """Post a transfer NIXL says still runs, then have the target unexpose ``rb`` while the
    initiator takes its notifications: (whether unexpose returned while the transfer still
    ran, the lease's count of running transfers meanwhile)."""
    p.stop.set()
    p.pump.join()  # the target's unexpose takes its own notifications
    lease = p.ini._leases[(rb.agent, rb.xid)]
    returned = threading.Event()
    th = threading.Thread(target=lambda: (p.tgt.unexpose(rb, timeout=3), returned.set()))
    with _slow_transfers(p.ini) as slow:
        t = p.ini.post_write([(src, 4096, rb, 0)])
        counted = lease.inflight
        th.start()
        end = time.monotonic() + 2
        while th.is_alive() and time.monotonic() < end:
            p.ini.progress()  # takes the REVOKE
            time.sleep(0.001)
        early = returned.is_set() and t.state == "PROC"
        slow[0] = False
    th.join(10)
    p.ini.settle(5)
    return early, counted


def test_a_steady_write_whose_post_raises_leaves_its_lease_counting_right(monkeypatch: pytest.MonkeyPatch) -> None:
    """A steady write (one frame, _quick) counted its lease only after NIXL's post returned;
    a post that raised (NIXL refusing it, or a Ctrl-C as it returned) made a Transfer its
    lease never counted, and its end took the count to -1: every later transfer under that
    lease ran uncounted, and a revocation meanwhile was dropped at once, so the target's
    unexpose returned (and the buffer could be freed) while NIXL still moved its bytes."""
    import gpupin.nixl as gn

    class nixlBackendError(Exception):  # noqa: N801 - NIXL's name
        pass

    monkeypatch.setattr(gn, "_PUMP_EVERY_S", 60.0)  # the writes below take _quick
    p = Pair()
    try:
        dst, src = p.mt.alloc(MiB), p.mi.alloc(MiB)
        rb = p.tgt.expose(dst, MiB)
        p.ini.write(src, 4096, rb)  # the lease (through _post)
        lease = p.ini._leases[(rb.agent, rb.xid)]
        d = p.ini.driver._direct
        assert d is not None
        real = d.post
        quick: list[bool] = []
        real_quick = NixlEndpoint._quick

        def spy(self: NixlEndpoint, *a: Any) -> Any:
            quick.append(True)
            return real_quick(self, *a)

        def refused(h: int, notif: bytes) -> int:
            raise nixlBackendError("injected: the backend failed to post")

        def posted_then_ctrl_c(h: int, notif: bytes) -> int:
            real(h, notif)
            raise KeyboardInterrupt

        monkeypatch.setattr(NixlEndpoint, "_quick", spy)
        for post, raised in ((refused, NixlError), (posted_then_ctrl_c, KeyboardInterrupt)):
            d.post = post
            try:
                with pytest.raises(raised):
                    p.ini.write(src, 4096, rb)
            finally:
                d.post = real
            assert quick, "the write did not take the steady path"
            quick.clear()
            assert p.ini.settle(5) == 0
            assert lease.inflight == 0, f"a steady write whose post raised left the lease counting {lease.inflight}"
        monkeypatch.undo()
        early, counted = _unexpose_returns_while_a_transfer_runs(p, src, rb)
        assert counted == 1 and not early, "unexpose returned while a transfer into the range still ran"
    finally:
        p.close()


def test_a_ctrl_c_as_a_steady_write_starts_its_wait_leaves_it_polled(monkeypatch: pytest.MonkeyPatch) -> None:
    """A steady write still running after its post is polled in _quick_wait's frame; a Ctrl-C
    before that frame's try took it (at its entry) left a running transfer nothing tracked,
    its reference held and its lease counting it for ever (connect() InUse, the target's
    unexpose waiting).  It is polled to its end like any interrupted transfer."""
    import gpupin.nixl as gn

    monkeypatch.setattr(gn, "_PUMP_EVERY_S", 60.0)
    p = Pair()
    try:
        dst, src = p.mt.alloc(MiB), p.mi.alloc(MiB)
        rb = p.tgt.expose(dst, MiB)
        p.ini.write(src, 4096, rb)
        lease = p.ini._leases[(rb.agent, rb.xid)]
        d = p.ini.driver._direct
        assert d is not None
        real = d.post
        d.post = _running_post(d)

        def entered(self: NixlEndpoint, *a: Any, **k: Any) -> Any:
            raise KeyboardInterrupt  # as at _quick_wait's entry

        monkeypatch.setattr(NixlEndpoint, "_quick_wait", entered)
        try:
            with pytest.raises(KeyboardInterrupt):
                p.ini.write(src, 4096, rb)
        finally:
            d.post = real
        monkeypatch.undo()
        assert p.ini.settle(5) == 0
        assert lease.inflight == 0 and p.ini.cache.held() == 0, "a transfer nothing tracks is counted for ever"
        p.ini.connect(p.tgt.metadata(), timeout=1)
    finally:
        p.close()


class _InterruptingLock:
    """A lock whose ``acquire`` (that took it) or ``__exit__`` (a release) raises
    KeyboardInterrupt once after the real call, the first time ``when()`` holds then (as
    Python raises a Ctrl-C as the call returns)."""

    def __init__(self, inner: Any, at: str, when: Callable[[], bool]) -> None:
        self.inner, self.at, self.when, self.armed = inner, at, when, True

    def _trip(self, at: str) -> None:
        if self.armed and at == self.at and self.when():
            self.armed = False
            raise KeyboardInterrupt

    def acquire(self, *a: Any, **k: Any) -> bool:
        got = self.inner.acquire(*a, **k)
        if got:
            self._trip("acquire")
        return bool(got)

    def __enter__(self) -> Any:
        return self.inner.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        r = self.inner.__exit__(*exc)
        if exc[0] is None:
            self._trip("__exit__")
        return r

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_ctrl_c_while_a_batch_of_notifications_is_handled_loses_only_that_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NIXL hands over every notification it has at once; a Ctrl-C while the endpoint handled
    one lost the rest of the batch: an application's messages never returned by progress(), a
    confirmed write's check never counted (the target's unexpose InUse at every call until
    forget_peer).  The batch is kept, each message taken off it as it is handled: the next
    progress() goes on with the rest."""
    p = Pair()
    try:
        rb = p.tgt.expose(p.mt.alloc(MiB), MiB)
        p.ini.write(p.mi.alloc(MiB), 4096, rb)  # (the connection both ways)
        p.stop.set()
        p.pump.join()  # the target takes notifications only where this test says
        with p.ini.driver.lock:
            for m in (b"first", b"interrupted", b"last"):
                p.ini.agent.send_notif(p.tgt.name, m)
        for _ in range(30):  # the initiator's progress sends them: then all three wait at the target
            p.ini.progress()
            time.sleep(0.01)
        real = NixlEndpoint._on_message
        seen: list[bytes] = []

        def on_message(self: NixlEndpoint, peer: str, m: bytes) -> None:
            seen.append(m)
            if m == b"interrupted":
                raise KeyboardInterrupt  # as at its entry
            real(self, peer, m)

        monkeypatch.setattr(NixlEndpoint, "_on_message", on_message)
        with pytest.raises(KeyboardInterrupt):
            p.tgt.progress()
        assert seen == [b"first", b"interrupted"]
        monkeypatch.undo()
        got = p.tgt.progress()
        assert [m for _, m in got] == [b"first", b"last"], "the rest of the batch was lost"
    finally:
        p.close()


def test_a_ctrl_c_as_a_pump_takes_its_lock_leaves_it_free() -> None:
    """One thread at a time takes NIXL's notifications (the pump's lock); a Ctrl-C as that
    lock's acquire returned came before the try that lets it go: the lock stayed taken, every
    later pump returned at once, and the endpoint took no grant, revocation or message again."""

    p = Pair()
    try:
        dst, src = p.mt.alloc(MiB), p.mi.alloc(MiB)
        rb = p.tgt.expose(dst, MiB)
        p.ini.write(src, 4096, rb)
        real = p.ini._plock
        p.ini._plock = _InterruptingLock(real, "acquire", lambda: True)  # type: ignore[assignment]
        try:
            with pytest.raises(KeyboardInterrupt):
                p.ini.progress()
        finally:
            p.ini._plock = real
        rb2 = p.tgt.expose(p.mt.alloc(MiB), MiB)
        p.ini.write(src, 4096, rb2, timeout=2)  # a new lease: its grant must be taken
    finally:
        p.close()


def _interrupted_at_entry(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """NixlEndpoint.<name> raises KeyboardInterrupt at its first entry, as Python raises a
    Ctrl-C that came in the bytecodes before a call at the callee's entry."""
    real, hits = getattr(NixlEndpoint, name), []

    def entered(self: NixlEndpoint, *a: Any, **k: Any) -> Any:
        hits.append(1)
        if len(hits) == 1:
            raise KeyboardInterrupt
        return real(self, *a, **k)

    monkeypatch.setattr(NixlEndpoint, name, entered)


@pytest.mark.parametrize("where", ["_account", "_complete"])
def test_a_ctrl_c_as_a_transfer_starts_ending_leaves_nothing_counted(
    monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A Ctrl-C at the entry of the call that ends a transfer: at _account's (after the
    transfer's state was set) the transfer stayed in the endpoint's books, counted by its
    leases for ever (close(), connect() InUse; a revocation never answered); at _complete's,
    for a blocking write NIXL ended within its post, nothing tracked it any more.  The books
    are done before any call, and a transfer not yet ending is polled to its end."""
    p = Pair()
    try:
        a, b, src = p.mt.alloc(MiB), p.mt.alloc(MiB), p.mi.alloc(MiB)
        ra, rb = p.tgt.expose(a, MiB), p.tgt.expose(b, MiB)
        blocks = [(src, 4096, ra, 0), (src + 4096, 4096, rb, 0)]
        p.ini.write_blocks(blocks)
        la = p.ini._leases[(ra.agent, ra.xid)]
        d = p.ini.driver._direct
        assert d is not None
        real = d.post

        def over_in_its_post(h: int, notif: bytes) -> int:  # (DRAM's usual answer)
            real(h, notif)
            while d.status(h) != d.ok:
                pass
            return d.ok

        d.post = _running_post(d) if where == "_account" else over_in_its_post
        _interrupted_at_entry(monkeypatch, where)
        try:
            with pytest.raises(KeyboardInterrupt):
                if where == "_account":
                    p.ini.post_write(blocks).wait(5)
                else:
                    p.ini.write_blocks(blocks)
        finally:
            d.post = real
            monkeypatch.undo()
        assert p.ini.settle(5) == 0
        assert la.inflight == 0 and not p.ini._running and p.ini.cache.held() == 0, "the transfer is counted for ever"
        p.ini.connect(p.tgt.metadata(), timeout=1)
    finally:
        p.close()


def test_a_ctrl_c_as_forget_peer_marks_the_peer_leaves_no_mark() -> None:
    """forget_peer() marks the peer (no transfer with it starts) and takes the mark back in a
    finally; the mark was a method call, a check point before that try: a Ctrl-C there left the
    peer marked for ever (every transfer with it refused, forget_peer() itself InUse).  The
    mark is an operator now, and made inside the try."""

    class Marking(set):  # type: ignore[type-arg]
        armed = True

        def add(self, x: Any) -> None:
            super().add(x)
            if Marking.armed:
                Marking.armed = False
                raise KeyboardInterrupt

    p = Pair()
    try:
        dst, src = p.mt.alloc(MiB), p.mi.alloc(MiB)
        rb = p.tgt.expose(dst, MiB)
        p.ini.write(src, 4096, rb)
        p.ini._forgetting = Marking()  # type: ignore[assignment]
        try:  # (marked with no call: no check point there, and nothing raised)
            p.ini.forget_peer(rb.agent)
        except KeyboardInterrupt:
            pass
        assert not p.ini._forgetting, "the peer stays marked: no transfer with it starts again"
        p.ini.write(src, 4096, rb, timeout=2)
        p.ini.forget_peer(rb.agent)
    finally:
        p.ini._forgetting = set()
        p.close()


@pytest.mark.parametrize(
    ("when", "closing"), [("as it returns", False), ("at its entry", False), ("at its entry", True)]
)
def test_a_ctrl_c_as_an_exposure_lets_go_of_its_hold_lets_go_of_all_it_holds(when: str, closing: bool) -> None:
    """An exposure taken back lets go of the provider's free hold, then of its cache reference;
    a Ctrl-C as the hold's release returned skipped the second (the reference held for ever,
    close() InUse, NIXL's registration outliving the buffer's free), and one at its entry left
    the hold for ever too (free() refused at every call; unexpose() returned at once, the
    exposure marked done).  Both are journaled first: what an interrupt left, the next
    unexpose(), pump or close() finishes."""
    p = Pair()
    try:
        dst = p.mt.alloc(MiB)
        rb = p.tgt.expose(dst, MiB)
        real, armed = p.mt.release_free_hold, [True]

        def release_free_hold(hold: int) -> None:
            if armed[0] and when == "at its entry":
                armed[0] = False
                raise KeyboardInterrupt
            real(hold)
            if armed[0]:
                armed[0] = False
                raise KeyboardInterrupt

        p.mt.release_free_hold = release_free_hold  # type: ignore[method-assign]
        try:
            with pytest.raises(KeyboardInterrupt):
                p.tgt.unexpose(rb)
        finally:
            del p.mt.release_free_hold
        if closing:
            p.ini.close()
            p.stop.set()
            p.pump.join()
            p.tgt.close()  # (no unexpose, no pump first)
        else:
            p.tgt.unexpose(rb)  # again, as the docs advise
            assert p.tgt.cache.held() == 0, "a finished exposure's reference is held for ever"
        p.mt.free(dst)  # the hold went: the provider lets the allocation go
    finally:
        if closing:
            p.stop.set()
            p.pump.join()
            p.mi.close()
            p.mt.close()
        else:
            p.close()


def test_a_driver_left_to_the_collector_after_a_ctrl_c_in_a_registration_calls_nixl_outside_it() -> None:
    """What an interrupted registration left for the driver to deregister (NIXL may hold it) is
    deregistered at close(); a driver finalized by the garbage collector did that from inside
    the collector, a NIXL call where gpupin promises none.  It waits for reap()."""
    import gc

    import gpupin.nixl as gn

    calls: list[bool] = []
    mem = HostMemory(4 << 20)
    try:
        ep = NixlEndpoint("i-collected", mem, mem_type="DRAM")
        drv, agent = ep.driver, ep.driver._agent
        va = mem.alloc(1 << 20)
        _ctrl_c_after(agent, "register_memory")
        with pytest.raises(KeyboardInterrupt):
            drv.pin(va, 1 << 20)
        del agent.register_memory
        ref = weakref.ref(agent)

        def spy(*a: Any) -> Any:
            calls.append(gn.collecting())
            return type(ref()).deregister_memory(ref(), *a)  # type: ignore[union-attr]

        agent.deregister_memory = spy
        ep.cycle = ep  # type: ignore[attr-defined] - only the collector frees it
        del ep, drv, agent
        gc.collect()
        gn.reap()
        assert calls and not any(calls), "a NIXL call from inside the garbage collector"
    finally:
        gn.reap()
        mem.close()


def test_an_interrupted_close_keeps_answering_peers(monkeypatch: pytest.MonkeyPatch) -> None:
    """close() stops the endpoint's progress thread first; a refused close started it again,
    an interrupted one (a Ctrl-C in its waits) did not: the endpoint, still open, answered its
    peers no more by itself and their unexpose() waited."""
    p = Pair(auto_progress=True)
    try:
        _interrupted_at_entry(monkeypatch, "_close")
        with pytest.raises(KeyboardInterrupt):
            p.ini.close()
        monkeypatch.undo()
        stop = p.ini._progress_stop
        assert stop is not None and not stop.is_set(), "the open endpoint's progress thread stays stopped"
    finally:
        p.close()


def test_a_registration_beside_a_live_one_at_the_same_address_is_refused() -> None:
    """A registration held past its allocation's free (a reference an interrupt leaked, a
    transfer past its timeout) stays in NIXL; one of the next allocation at that address was
    registered beside it, and NIXL resolves a block at their base to the older one
    (getCoveringIndex): a transfer through the old memory, reported done.  It is refused."""
    p = Pair()
    try:
        drv = p.ini.driver
        va = p.mi.alloc(2 * MiB)
        old = drv.pin(va, MiB)  # (kept, as a leaked reference keeps it)
        with pytest.raises(gpupin.InUse, match="earlier allocation"):
            drv.pin(va, 2 * MiB)
        with pytest.raises(gpupin.InUse, match="earlier allocation"):
            drv.pin(va + 4096, 4096)
        assert drv.live == 1 and not _nixl_holds(drv, va, 2 * MiB), "registered beside the live one"
        drv.unpin(old)
        drv.unpin(drv.pin(va, 2 * MiB))  # once it went, the address registers again
    finally:
        p.close()


def test_a_ctrl_c_as_a_pump_lets_go_of_its_lock_leaves_it_free() -> None:
    """The pump asked its lock whether this thread held it before releasing it: a Ctrl-C as
    that question returned left the lock held for ever, the endpoint deaf.  It releases with no
    question first."""

    class AskedThenCtrlC:
        def __init__(self, inner: Any) -> None:
            self.inner, self.armed = inner, True

        def _is_owned(self) -> bool:
            owned = bool(self.inner._is_owned())
            if owned and self.armed:
                self.armed = False
                raise KeyboardInterrupt
            return owned

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    p = Pair()
    real = p.ini._plock
    try:
        dst, src = p.mt.alloc(MiB), p.mi.alloc(MiB)
        p.ini.write(src, 4096, p.tgt.expose(dst, MiB))
        p.ini._plock = AskedThenCtrlC(real)  # type: ignore[assignment]
        try:
            p.ini.progress()
        except KeyboardInterrupt:
            pass
        finally:
            p.ini._plock = real
        assert not real._is_owned(), "the pump's lock stays held: the endpoint takes no notification again"
        p.ini.write(src, 4096, p.tgt.expose(p.mt.alloc(MiB), MiB), timeout=2)  # a new lease's grant
    finally:
        while real._is_owned():
            real.release()
        p.close()


@pytest.mark.parametrize("how", ["write_blocks", "Prepared.run"])
def test_a_ctrl_c_as_a_blocking_post_returns_leaves_its_transfer_polled(how: str) -> None:
    """A blocking transfer is not tracked while its caller waits; a Ctrl-C as _post let go of
    its lock on the way back (the lock's release is a call) lost it: never polled, its lease
    counting it and its references held for ever.  The caller holds it from its making on."""
    import sys

    p = Pair()
    try:
        dst, src = p.mt.alloc(MiB), p.mi.alloc(MiB)
        rb = p.tgt.expose(dst, MiB)
        blocks = [(src, 4096, rb, 0), (src + 8192, 4096, rb, 8192)]
        p.ini.write_blocks(blocks)  # the lease
        lease = p.ini._leases[(rb.agent, rb.xid)]
        prep = p.ini.prepare("WRITE", blocks)
        d = p.ini.driver._direct
        assert d is not None

        def returning() -> bool:  # in _post's frame, a running Transfer made
            f = sys._getframe(1)
            while f is not None:
                if f.f_code is NixlEndpoint._post.__code__:
                    t = f.f_locals.get("t")
                    return t.__class__ is gn_transfer and t.state == "PROC"
                f = f.f_back
            return False

        import gpupin.nixl as gn

        gn_transfer = gn.Transfer
        real_post, real_lock = d.post, p.ini._lock
        d.post = _running_post(d)
        p.ini._lock = _InterruptingLock(real_lock, "__exit__", returning)  # type: ignore[assignment]
        try:
            with pytest.raises(KeyboardInterrupt):
                if how == "write_blocks":
                    p.ini.write_blocks(blocks)
                else:
                    prep.run()
        finally:
            d.post, p.ini._lock = real_post, real_lock
        assert p.ini.settle(5) == 0
        assert lease.inflight == 0 and p.ini.cache.held() == 0, "a running transfer nothing polls"
        prep.close()
    finally:
        p.close()


def test_a_confirm_check_lost_to_a_ctrl_c_is_asked_for_again_by_unexpose(monkeypatch: pytest.MonkeyPatch) -> None:
    """A target counts a confirmed write's check before it lets the exposure go; a Ctrl-C as it
    took the check off its batch lost it, and every later unexpose() said InUse until
    forget_peer of a live peer.  A later unexpose() asks the holder again: it knows the lease no
    more, and answers with a drop of no check."""
    p = Pair(auto_progress=True)
    try:
        dst, src = p.mt.alloc(MiB), p.mi.alloc(MiB)
        rb = p.tgt.expose(dst, MiB)
        p.ini.write(src, 4096, rb)  # the lease, while the target serves
        p.stop.set()
        p.pump.join()  # from here the target takes notifications on this thread only
        real, hits = NixlEndpoint._on_xfer, []

        def on_xfer(self: NixlEndpoint, *a: Any) -> Any:
            hits.append(1)
            if len(hits) == 1:
                raise KeyboardInterrupt  # as at its entry
            return real(self, *a)

        monkeypatch.setattr(NixlEndpoint, "_on_xfer", on_xfer)
        t = p.ini.post("WRITE", [(src, 4096, rb, 0)], confirm=True)
        with pytest.raises(KeyboardInterrupt):
            for _ in range(400):
                t.done()  # DONE: its check is sent
                p.tgt.progress()
                time.sleep(0.005)
        monkeypatch.undo()
        p.serve_again()
        with pytest.raises(gpupin.InUse):
            p.tgt.unexpose(rb, timeout=0.5)  # the drop came, its check never will
        p.tgt.unexpose(rb, timeout=5)
    finally:
        p.close()


def test_a_ctrl_c_as_a_handle_is_wrapped_leaves_no_finalizer_to_release_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """_Direct.wrap makes NIXL's handle object for a running request; an interrupt after the
    object is made and before gpupin keeps it dropped the object, whose finalizer released
    the request under its poller (a crash once polled).  It is made marked released, and
    marked live only once kept: dropped before that, it releases nothing."""
    import gc

    import gpupin.nixl as gn

    class Recorder:
        def __init__(self) -> None:
            self.released: list[int] = []

        def releaseXferReq(self, hid: int) -> None:  # noqa: N802 - NIXL's name
            self.released.append(hid)

    class Interrupting(dict):  # type: ignore[type-arg]
        def __setitem__(self, key: Any, value: Any) -> None:
            raise KeyboardInterrupt

    p = Pair()
    try:
        d = gn._Direct.of(p.ini.driver._agent)
        assert d is not None
        d.inner = rec = Recorder()  # (this _Direct only: the endpoint's own is untouched)
        monkeypatch.setattr(gn, "_LIVE_XFERS", Interrupting())
        with pytest.raises(KeyboardInterrupt):
            d.wrap(0x1234)
        gc.collect()
        assert rec.released == [], "the dropped handle object released a running request"
    finally:
        monkeypatch.undo()
        p.close()


def test_a_ctrl_c_as_a_subclassed_agent_releases_a_handle_leaves_it_released_once() -> None:
    """An application's agent of a subclass of NIXL's (no binding path: _Direct.of refuses
    it) releases a transfer's handle through NIXL's own release_xfer_handle, which marks it
    after NIXL's call; gpupin marks it first there too, the subclass keeping NIXL's method."""
    import threading

    import gpupin.nixl as gn

    api = gn.load_nixl()

    class AppAgent(api.nixl_agent):  # type: ignore[misc,name-defined]
        def transfer(self, handle: Any, notif_msg: bytes = b"") -> str:
            super().transfer(handle, notif_msg)
            return "PROC"  # (said to run on: the test's transfer has a handle to release)

    mt, mi = HostMemory(16 << 20), HostMemory(16 << 20)
    tgt = NixlEndpoint("t-subclass", mt, mem_type="DRAM")
    own = AppAgent("i-subclass", api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    ini = NixlEndpoint("i-subclass", mi, mem_type="DRAM", agent=own)
    stop = threading.Event()
    pump = threading.Thread(target=lambda: tgt.serve(60, stop.is_set))
    kept: list[Any] = []
    try:
        assert ini.driver.direct() is None
        ini.connect(tgt.metadata())
        tgt.connect(ini.metadata())
        pump.start()
        dst, src = mt.alloc(MiB), mi.alloc(MiB)
        rb = tgt.expose(dst, MiB)
        ini.write(src, 4096, rb)
        _interrupted_release(ini, src, rb, kept)
    finally:
        for h in kept:
            h._released = True
        try:
            ini.close()
        finally:
            stop.set()
            if pump.is_alive():
                pump.join()
            tgt.close()
            mi.close()
            mt.close()


def test_a_peer_restarted_under_the_same_name_is_reached_again() -> None:
    """The target process dies and another starts under the same agent name (its generations
    counted anew): NIXL refuses the new incarnation's metadata until the old one is forgotten;
    the endpoint forgets it and every write lands."""
    mem = HostMemory(16 << 20)
    e = NixlEndpoint("initiator", mem, mem_type="DRAM")
    src = mem.alloc(MiB)
    try:
        for n in range(3):
            t = Target("host")
            try:
                t.call("connect", e.metadata())
                dst = t.call("alloc", MiB)
                t.call("fill", dst, MiB, 0)
                mem.write(src, bytes([n + 1]) * MiB)
                e.write(src, MiB, RemoteBufferOf(t, dst, MiB), timeout=10)
                assert t.call("read", dst, MiB) == bytes([n + 1]) * MiB
            finally:
                t.kill()
    finally:
        mem.free(src)
        with warnings.catch_warnings():  # the last target is dead: it hears no lease drop
            warnings.simplefilter("ignore", RuntimeWarning)
            e.close(timeout=0.5)
        mem.close()


def test_what_an_initiator_remembers_of_a_peer_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpupin.nixl, "_LOADED_PER_PEER", 4, raising=False)
    p = Pair()
    try:
        src = p.mi.alloc(MiB)
        for _ in range(10):  # ten registrations exposed, each a new generation of the target
            dst = p.mt.alloc(MiB // 2)
            p.ini.write(src, 4096, p.tgt.expose(dst, MiB // 2))
        assert len(p.ini._views["t-pair"][1]) == 4
    finally:
        p.close()


# -- prevention: no byte of a transfer lands in memory a new owner holds ---------------------------
def test_unexpose_waits_for_a_transfer_in_flight_and_the_free_waits_for_unexpose() -> None:
    import threading

    p = Pair(auto_progress=True)
    try:
        with _slow_transfers(p.ini) as slow:
            dst = p.mt.alloc(MiB)
            rb = p.tgt.expose(dst, MiB)
            src = p.mi.alloc(MiB)
            with pytest.raises(NixlError, match="stays registered"):
                p.ini.write(src, 4096, rb, timeout=0.2)  # still "running" at NIXL
            done = threading.Event()
            th = threading.Thread(target=lambda: (p.tgt.unexpose(rb, timeout=20), done.set()))
            th.start()
            assert not done.wait(0.5), "unexpose returned while a peer's transfer into the range still ran"
            with pytest.raises(gpupin.InUse, match="unexpose"):
                p.mt.free(dst)  # the provider refuses: a peer may still write there
            slow[0] = False
            assert p.ini.settle(5) == 0  # NIXL says it ended: the lease is dropped
            assert done.wait(10), "unexpose did not return once the transfer ended"
            th.join()
            p.mt.free(dst)
            assert p.tgt.driver.live <= 1 and not p.tgt._exposures
    finally:
        p.close()


def test_an_epoch_names_one_use_of_a_block() -> None:
    """Allocator-level reuse without a free: the block is taken back (unexpose) and exposed under
    a new epoch; a write meant for the old use is refused before any byte moves."""
    p = Pair(auto_progress=True)
    try:
        seg = p.mt.alloc(MiB)
        block = seg + 64 * 1024
        old = p.tgt.expose(block, 65536, epoch=1)
        src = p.mi.alloc(MiB)
        p.mi.write(src, b"\x11" * 4096)
        p.ini.write(src, 4096, old)
        assert p.tgt.expose(block, 65536, epoch=1) == old  # the same use: the same descriptor
        with pytest.raises(gpupin.InUse, match="unexpose"):
            p.tgt.expose(block, 65536, epoch=2)
        p.tgt.unexpose(old)
        p.mt.write(block, bytes(4096))  # the block's new use
        new = p.tgt.expose(block, 65536, epoch=2)
        p.mi.write(src, b"\x22" * 4096)
        with pytest.raises(StaleRemote, match="before any byte moved|took the exposure back"):
            p.ini.write(src, 4096, old)
        assert p.mt.read(block, 4096) == bytes(4096), "a write meant for the old use landed in the new one"
        p.ini.write(src, 4096, new, confirm=True)
        assert p.mt.read(block, 4096) == b"\x22" * 4096
        forged = dataclasses.replace(new, epoch=1)  # the new exposure under the old epoch
        with pytest.raises(StaleRemote, match="another epoch"):
            p.ini.write(src, 4096, forged)
    finally:
        p.close()


def _freed_behind_the_providers_back(p: Pair) -> tuple[int, RemoteBuffer, int]:
    """A 1 MiB target buffer exposed and leased by a write, then freed behind the provider's
    hold and allocated again at its address; returns (that address, its old descriptor, the
    initiator's source) once the target's watch saw it change."""
    dst = p.mt.alloc(MiB)
    rb = p.tgt.expose(dst, MiB)
    src = p.mi.alloc(MiB)
    p.ini.write(src, 4096, rb)
    p.mt._fit.free(dst)  # another allocator's free: the hold cannot see it
    assert p.mt.alloc(MiB) == dst
    deadline = time.monotonic() + 10
    while p.tgt.stale_exposures == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert p.tgt.stale_exposures == 1
    return dst, rb, src


@pytest.mark.filterwarnings("ignore:gpupin.nixl.*changed while exposed:RuntimeWarning")
def test_a_free_behind_the_providers_back_is_detected_and_revoked() -> None:
    """What gpupin cannot prevent (a free it does not see) it detects: the target's watch
    finds the allocation changed, revokes the leases with the reason, and the initiator's next
    transfer into it is refused."""
    p = Pair(auto_progress=True)
    try:
        dst, rb, src = _freed_behind_the_providers_back(p)
        deadline = time.monotonic() + 10
        while p.ini._leases and time.monotonic() < deadline:  # the revocation reaches the initiator
            time.sleep(0.005)
        with pytest.raises(StaleRemote):
            p.ini.write(src, 4096, rb)
        assert not p.tgt._exposures  # taken back and let go once the initiator dropped its lease
    finally:
        p.close()


def test_an_idle_initiator_takes_a_waiting_revocation_before_it_posts() -> None:
    """The same detection with no progress thread and no progress() call: the revocation waits
    in NIXL's queue, and the initiator's next write, after a pause, takes it before posting:
    refused, and the new owner's bytes stay as they were."""
    p = Pair()
    try:
        dst, rb, src = _freed_behind_the_providers_back(p)
        p.mt.write(dst, bytes(4096))  # the new owner's bytes
        time.sleep(0.2)  # the revocation reaches the initiator's queue; nobody reads it yet
        p.mi.write(src, b"\x33" * 4096)
        with pytest.raises(StaleRemote):
            p.ini.write(src, 4096, rb)
        assert p.mt.read(dst, 4096) == bytes(4096), "the write landed in the new owner's memory"
    finally:
        p.close()


@pytest.mark.filterwarnings("ignore:gpupin.nixl.*changed while exposed:RuntimeWarning")
def test_a_steady_write_takes_one_frame_and_a_revocation_still_stops_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A write of one block whose lease is held goes through NixlEndpoint._quick, not _post;
    a revocation the initiator took (here by progress(), with no pump of its own in the way)
    sends the next write to _post, which refuses it: nothing reaches the new owner."""
    import gpupin.nixl as gn

    monkeypatch.setattr(gn, "_PUMP_EVERY_S", 60.0)  # a post's own pump would take _post's path
    p = Pair()
    posts: list[str] = []
    real = NixlEndpoint._post

    def post(self: NixlEndpoint, op: str, *a: Any, **k: Any) -> Any:
        posts.append(op)
        return real(self, op, *a, **k)

    try:
        dst, rb, src = _freed_behind_the_providers_back(p)  # the lease is asked for: _post
        monkeypatch.setattr(NixlEndpoint, "_post", post)
        p.mt.write(dst, bytes(4096))  # the new owner's bytes
        p.ini.progress()  # takes the revocation
        p.mi.write(src, b"\x55" * 4096)
        with pytest.raises(StaleRemote):
            p.ini.write(src, 4096, rb)
        assert posts == ["WRITE"] and p.mt.read(dst, 4096) == bytes(4096)
        b = p.mt.alloc(MiB)
        rb2 = p.tgt.expose(b, MiB)
        p.ini.write(src, 4096, rb2)  # a new lease: _post again
        for i in range(3):
            p.mi.write(src, bytes([i + 1]) * 4096)
            p.ini.write(src, 4096, rb2)
            assert p.mt.read(b, 4096) == bytes([i + 1]) * 4096
        assert posts == ["WRITE", "WRITE"], "a steady write went through _post"
    finally:
        p.close()


def test_a_smaller_buffer_at_the_same_base_gets_the_bytes() -> None:
    """NIXL keeps a dropped registration's descriptor beside a new one at the same base and may
    route a write through it (on an H100: a write reported done, 0 bytes in the new buffer).
    The initiator forgets the peer's view when the target dropped a registration since."""
    p = Pair(auto_progress=True)
    try:
        a = p.mt.alloc(MiB)
        ra = p.tgt.expose(a, MiB)
        src = p.mi.alloc(MiB)
        p.ini.write(src, MiB, ra)
        p.tgt.unexpose(ra)
        p.mt.free(a)
        b = p.mt.alloc(MiB // 2)
        assert b == a
        p.mt.write(b, bytes(MiB // 2))
        rb = p.tgt.expose(b, MiB // 2)
        assert rb.dereg > ra.dereg  # the old registration went first
        p.mi.write(src, b"\xa5" * (MiB // 2))
        p.ini.write(src, MiB // 2, rb, confirm=True)
        assert p.mt.read(b, MiB // 2) == b"\xa5" * (MiB // 2)
        assert p.ini.renewals == 1
    finally:
        p.close()


def test_many_blocks_in_one_transfer_posted_without_waiting() -> None:
    import asyncio

    p = Pair()
    try:
        seg, local = p.mt.alloc(8 * MiB), p.mi.alloc(8 * MiB)
        region = p.tgt.expose(seg, 8 * MiB)
        blocks = []
        for i in range(64):
            data = bytes([i + 1]) * 4096
            p.mi.write(local + i * 65536, data)
            blocks.append((local + i * 65536, 4096, region, (63 - i) * 131072))
        p.ini.write_blocks(blocks)
        for i in range(64):
            assert p.mt.read(seg + (63 - i) * 131072, 4096) == bytes([i + 1]) * 4096
        t = p.ini.post_write(blocks[:8])
        t.wait(10)
        assert t.done() and t.state == "DONE"
        t2 = p.ini.post_read([(local + 7 * MiB, 4096, region, 0)])
        asyncio.run(t2.wait_async(10))
        assert p.mi.read(local + 7 * MiB, 4096) == bytes([64]) * 4096
        t3 = p.ini.post("WRITE", [(local, 4096, region, 0)], confirm=True)
        asyncio.run(t3.wait_async(10, confirm=True))  # the target's check, awaited
        assert t3.verdict is not None and t3.verdict[0] == 0
        with pytest.raises(gpupin.InvalidArgument, match="needs post"):
            asyncio.run(p.ini.post_write(blocks[:1]).wait_async(10, confirm=True))
        assert p.ini.leases_asked == 1  # one lease for the region, asked for once
        other = p.tgt.expose(p.mt.alloc(MiB), MiB)
        other_peer = dataclasses.replace(other, agent="someone-else")
        with pytest.raises(gpupin.InvalidArgument, match="one peer"):
            p.ini.write_blocks([blocks[0], (local, 4096, other_peer, 0)])
    finally:
        p.close()


def test_a_target_answers_only_for_what_it_exposed() -> None:
    p = Pair()
    try:
        rb = p.tgt.expose(p.mt.alloc(MiB), MiB)
        src = p.mi.alloc(MiB)
        for forged in (dataclasses.replace(rb, xid=rb.xid + 2), dataclasses.replace(rb, xid=12345)):
            with pytest.raises(StaleRemote, match="no longer exposes it"):
                p.ini.write(src, 4096, forged)
        assert not p.ini._leases
        p.ini.write(src, 4096, rb)
    finally:
        p.close()


def test_a_holder_that_never_answers_keeps_the_range_until_forgotten() -> None:
    p = Pair()  # the initiator takes no notifications of its own: it never sees the revocation
    try:
        dst = p.mt.alloc(MiB)
        rb = p.tgt.expose(dst, MiB)
        p.ini.write(p.mi.alloc(MiB), 4096, rb)
        with pytest.raises(gpupin.InUse, match="i-pair .no drop yet. still hold"):
            p.tgt.unexpose(rb, timeout=0.3)
        with pytest.raises(gpupin.InUse):
            p.mt.free(dst)
        with pytest.raises(gpupin.InUse, match="still being taken back from i-pair"):
            p.tgt.expose(dst, MiB, epoch=2)  # the block's next use, while i-pair may still write
        p.tgt.forget_peer("i-pair")  # the application knows the peer can transfer no more
        p.tgt.unexpose(rb, timeout=0.3)
        p.mt.free(dst)
        # The initiator still holds its lease; a target that forgot it does not answer its drop.
        with pytest.warns(RuntimeWarning, match="closed without word from t-pair that it has 1 lease drop"):
            p.ini.close(timeout=0.2)
    finally:
        p.close()


def test_a_closing_initiator_gives_its_leases_back() -> None:
    """close() returns once the target has the drop: a notification NIXL accepted may still
    wait inside UCX and die with the agent (a target then waited for it in vain, 1 run in 15
    of this file on a loaded machine)."""
    p = Pair()
    try:
        rb = p.tgt.expose(p.mt.alloc(MiB), MiB)
        p.ini.write(p.mi.alloc(MiB), 4096, rb)
        p.ini.close()
        assert p.tgt._exposures[rb.xid].holders["i-pair"][1] == 0, "the target has not heard the drop"
        p.tgt.unexpose(rb, timeout=5)  # no revocation round trip needed: the drop came already
        assert not p.tgt._exposures
    finally:
        p.close()


def test_an_old_descriptor_never_brings_a_dropped_registration_back() -> None:
    """NIXL matches a transfer to the covering remote descriptor: a dropped 1 MiB registration
    loaded again beside a live 512 KiB one at the same base would take writes past 512 KiB.
    Using the old descriptor is refused, and loads nothing."""
    p = Pair(auto_progress=True)
    try:
        a = p.mt.alloc(MiB)
        ra = p.tgt.expose(a, MiB)
        src = p.mi.alloc(MiB)
        p.ini.write(src, 4096, ra)
        p.tgt.unexpose(ra)
        p.mt.free(a)
        assert p.mt.alloc(MiB // 2) == a
        rb = p.tgt.expose(a, MiB // 2)
        p.ini.write(src, 4096, rb)
        beyond = dataclasses.replace(rb, addr=a + 600 * 1024, size=4096)  # inside the old, past the new
        assert deregistered_through_nixl(p.ini, src, 4096, beyond)
        with pytest.raises(StaleRemote):
            p.ini.write(src, 4096, ra)  # the old descriptor, shown again
        assert deregistered_through_nixl(p.ini, src, 4096, beyond), "the dropped registration is back in NIXL's view"
    finally:
        p.close()


def test_a_posted_transfer_never_waited_for_still_ends_its_lease() -> None:
    import gc

    p = Pair(auto_progress=True)
    try:
        with _slow_transfers(p.ini) as slow:
            dst = p.mt.alloc(MiB)
            rb = p.tgt.expose(dst, MiB)
            src = p.mi.alloc(MiB)
            t = p.ini.post_write([(src, 4096, rb, 0)])
            assert not t.done()
            del t
            gc.collect()  # the endpoint keeps it: no NIXL finalizer releases its handle behind gpupin
            slow[0] = False
            p.tgt.unexpose(rb, timeout=10)  # the initiator's progress finds it over and drops the lease
            assert p.ini.cache.held() == 0 and not p.ini._running
            p.mt.free(dst)
    finally:
        p.close()


def test_close_keeps_the_lease_of_a_transfer_posted_and_never_waited_for() -> None:
    """close() waited only for transfers past their wait's timeout: with one posted and never
    waited for still running it cleared every lease, sent no drop for it, then refused (its
    registration held): a second close() sent nothing, and the target waited in vain."""
    p = Pair(auto_progress=True)
    try:
        with _slow_transfers(p.ini) as slow:
            dst = p.mt.alloc(MiB)
            rb = p.tgt.expose(dst, MiB)
            t = p.ini.post_write([(p.mi.alloc(MiB), 4096, rb, 0)])
            with pytest.raises(gpupin.InUse, match="1 transfer.s. NIXL has not ended"):
                p.ini.close(timeout=0.2)
            assert ("t-pair", rb.xid) in p.ini._leases, "the running transfer's lease was let go"
            slow[0] = False
            assert t.done() and t.state == "DONE"
            p.ini.close()  # now the drop goes, and the target hears it
            assert p.tgt._exposures[rb.xid].holders["i-pair"][1] == 0
            p.tgt.unexpose(rb, timeout=5)
            p.mt.free(dst)
    finally:
        p.close()


def test_no_metadata_of_a_peer_is_loaded_while_a_transfer_with_it_runs() -> None:
    """A load NIXL refuses erases its whole view of the peer, and a transfer running with it is
    then reported NOT_FOUND, which gpupin took for over while UCX could still move its bytes:
    a known peer's new metadata now waits until no transfer with it runs, and forget_peer()
    refuses meanwhile."""
    import threading

    p = Pair(auto_progress=True)
    try:
        with _slow_transfers(p.ini) as slow:
            rb = p.tgt.expose(p.mt.alloc(MiB), MiB)
            src = p.mi.alloc(MiB)
            t = p.ini.post_write([(src, 4096, rb, 0)])
            with pytest.raises(gpupin.InUse, match="a transfer with t-pair still runs"):
                p.ini.forget_peer("t-pair")
            loads: list[bytes] = []
            real = p.ini._add
            p.ini._add = lambda md, peer: (loads.append(md), real(md, peer))[1]  # type: ignore[method-assign]
            other = p.tgt.expose(p.mt.alloc(2 * MiB), 2 * MiB)  # new metadata to load
            second = threading.Thread(target=lambda: p.ini.write(src, 4096, other))
            second.start()
            time.sleep(0.3)
            assert not loads and second.is_alive(), "a peer's metadata was loaded while a transfer with it ran"
            slow[0] = False
            second.join(10)
            assert not second.is_alive() and loads and t.done()
            del p.ini._add
    finally:
        p.close()


def test_a_grant_that_came_too_late_is_given_back() -> None:
    """A lease request given up on (its timeout) and answered afterwards: the target holds a
    lease nobody uses, and its unexpose() waited for a drop that never came."""
    p = Pair()
    p.stop.set()
    p.pump.join()  # the target takes no notifications for now
    rb = p.tgt.expose(p.mt.alloc(MiB), MiB)
    with pytest.raises(NixlError, match="no answer from t-pair to a lease request"):
        p.ini.write(p.mi.alloc(MiB), 4096, rb, timeout=0.2)
    deadline = time.monotonic() + 5
    while p.tgt._exposures[rb.xid].holders.get("i-pair", [0, -1])[1] < 0 and time.monotonic() < deadline:
        p.tgt.progress()  # the request arrives late: granted
        p.ini.progress()  # the late grant: given back
    assert p.tgt._exposures[rb.xid].holders["i-pair"][1] == 0, "the late grant was not given back"
    p.tgt.unexpose(rb, timeout=1)  # no round trip needed: the initiator does not progress here
    p.close()


def test_an_interrupted_blocking_transfer_is_polled_to_its_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """write()'s transfer is left to the waiting thread; interrupted there (KeyboardInterrupt)
    it must be polled by the endpoint from then on, or its registration and lease stay held
    forever."""
    p = Pair(auto_progress=True)
    try:
        with _slow_transfers(p.ini) as slow:
            rb = p.tgt.expose(p.mt.alloc(MiB), MiB)
            src = p.mi.alloc(MiB)
            real_done, calls = gpupin.nixl.Transfer.done, [0]

            def done(t: gpupin.nixl.Transfer) -> bool:
                calls[0] += 1
                if calls[0] == 3:
                    raise KeyboardInterrupt
                return real_done(t)

            monkeypatch.setattr(gpupin.nixl.Transfer, "done", done)
            with pytest.raises(KeyboardInterrupt):
                p.ini.write(src, 4096, rb)
            monkeypatch.undo()
            assert p.ini.cache.held() == 1 and len(p.ini._running) == 1
            slow[0] = False
            assert p.ini.settle(5) == 0
            deadline = time.monotonic() + 5
            while p.ini._running and time.monotonic() < deadline:
                time.sleep(0.001)  # the progress thread finds it over
            assert not p.ini._running and p.ini.cache.held() == 0
            p.tgt.unexpose(rb, timeout=5)
    finally:
        p.close()


def test_threads_using_a_new_exposure_at_once_all_get_the_lease() -> None:
    """The first transfers into an exposure, from four threads at once: one asks, the others
    wait for its answer (none takes the lease still asked for as taken back)."""
    import threading

    p = Pair()
    try:
        errors: list[BaseException] = []
        srcs = [p.mi.alloc(65536) for _ in range(4)]
        for _ in range(5):
            rb = p.tgt.expose(p.mt.alloc(MiB), MiB)  # a new exposure each round
            start = threading.Barrier(4)

            def one(i: int, rb: RemoteBuffer = rb, start: threading.Barrier = start) -> None:
                try:
                    start.wait()
                    p.ini.write(srcs[i], 4096, rb, offset=i * 4096)
                except BaseException as exc:  # noqa: BLE001 - collected for the assertion
                    errors.append(exc)

            threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
        assert not errors, errors
        assert p.ini.leases_asked == 5
    finally:
        p.close()


def test_an_endpoint_left_to_the_collector_holds_its_exposed_memory_until_reaped() -> None:
    """Collected without close(), a target can ask no peer to let go: its exposed memory stays
    held from free() until reap() has retired its agent (and the registrations with it)."""
    import gc

    mem = HostMemory(4 << 20)
    tgt = NixlEndpoint("t-collected", mem, mem_type="DRAM")
    dst = mem.alloc(MiB)
    tgt.expose(dst, MiB)
    tgt.cycle = tgt  # type: ignore[attr-defined] - only the collector frees it
    agent = weakref.ref(tgt.agent)
    del tgt
    gc.collect()
    assert agent() is not None  # retirement waits for reap()
    with pytest.raises(gpupin.InUse):
        mem.free(dst)
    gpupin.nixl.reap()
    assert agent() is None
    mem.free(dst)
    mem.close()


def test_metadata_loaded_by_connect_is_renewed_once_the_target_dropped_a_registration() -> None:
    """connect() loads metadata of unknown age: if the target dropped a registration since, the
    first grant makes the initiator forget that view, or its dropped descriptor would stay."""
    p = Pair(auto_progress=True)
    try:
        a = p.mt.alloc(MiB)
        ra = p.tgt.expose(a, MiB)
        p.ini.connect(p.tgt.metadata())  # the 1 MiB registration is now in NIXL's view of t-pair
        p.tgt.unexpose(ra)
        p.mt.free(a)
        assert p.mt.alloc(MiB // 2) == a
        rb = p.tgt.expose(a, MiB // 2)  # the 1 MiB registration is dropped first
        src = p.mi.alloc(MiB)
        p.ini.write(src, 4096, rb)
        beyond = dataclasses.replace(rb, addr=a + 600 * 1024, size=4096)
        assert deregistered_through_nixl(p.ini, src, 4096, beyond), "the dropped registration is still reachable"
        assert p.ini.renewals == 1
    finally:
        p.close()


def test_a_busy_initiator_takes_the_revocation_between_its_writes() -> None:
    """An initiator that only posts (no progress thread, no progress() call) still hears the
    target take its range back: its writes take notifications themselves, and the next one
    after the revocation is refused with nothing sent, so the target's unexpose returns."""
    import threading

    p = Pair()
    try:
        dst, src = p.mt.alloc(MiB), p.mi.alloc(MiB)
        rb = p.tgt.expose(dst, MiB)
        p.ini.write(src, 4096, rb)
        done = threading.Event()
        th = threading.Thread(target=lambda: (p.tgt.unexpose(rb, timeout=20), done.set()))
        th.start()
        deadline = time.monotonic() + 20
        writes = 0
        with pytest.raises(StaleRemote, match="took it back|refused before any byte moved"):
            while time.monotonic() < deadline:
                p.ini.write(src, 4096, rb)
                writes += 1
        assert done.wait(20), f"unexpose did not return ({writes} writes went before the refusal)"
        th.join()
        p.mt.free(dst)
    finally:
        p.close()


def test_a_scatter_list_takes_one_registration_and_asks_the_provider_once() -> None:
    """Blocks of one local allocation share one registration: the provider is asked where
    the allocation lies only on the first post (a miss); later posts are one cache hit.
    Blocks from two allocations take one registration each, still land, and count one lookup
    each in stats()."""
    p = Pair()
    try:
        seg, local, other = p.mt.alloc(4 * MiB), p.mi.alloc(MiB), p.mi.alloc(MiB)
        region = p.tgt.expose(seg, 4 * MiB)
        asked: list[int] = []
        range_of = p.mi.range_of
        p.mi.range_of = lambda ptr: (asked.append(ptr), range_of(ptr))[1]  # type: ignore[method-assign]
        blocks = [(local + i * 8192, 4096, region, i * 65536) for i in range(16)]
        for n in range(3):
            p.mi.write(local, bytes([n + 1]) * MiB)
            p.ini.write_blocks(blocks)
            assert p.mt.read(seg + 15 * 65536, 4096) == bytes([n + 1]) * 4096
            if n == 0:
                assert asked and set(asked) == {local}  # the miss: where the allocation lies
                asked.clear()
        assert not asked  # the hits: the cache's C query alone
        st = p.ini.cache.stats()
        assert (st.misses, st.hits, st.pins) == (1, 2, 1)
        p.mi.write(other, b"\x77" * 4096)
        p.ini.write_blocks([*blocks[:2], (other, 4096, region, 3 * MiB)])
        assert p.mt.read(seg + 3 * MiB, 4096) == b"\x77" * 4096
        st = p.ini.cache.stats()
        assert st.pins == 2  # the second allocation's own registration
        # Counted per block: two hits and the new allocation's miss; the span lookup that found
        # the blocks in two allocations is not one more miss.
        assert (st.acquires, st.misses, st.hits) == (6, 2, 4)
    finally:
        p.close()


def test_a_running_transfer_of_an_endpoint_left_to_the_collector_is_released_by_reap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An initiator dropped without close() while a transfer it posted (never waited for) still
    runs: the endpoint and the transfer are garbage together (it polls the transfer, the
    transfer names it).  NIXL's transfer handle is not released from the collector (its
    finalizer would call NIXL in there): reap() releases it, before the agent goes."""
    import gc

    import nixl_cu13._api as nixl_api

    released: list[bool] = []  # collecting() at each release of a handle NIXL had not released
    real_del = nixl_api.nixl_xfer_handle.__del__
    real_release = gpupin.nixl._release  # (gpupin releases NIXL's handle objects through it)

    def spy_del(self: Any) -> None:
        if not self._released:
            released.append(gpupin.nixl.collecting())
        real_del(self)

    def spy_release(h: Any, **kw: Any) -> None:
        if not h._released and isinstance(h, nixl_api.nixl_xfer_handle):
            released.append(gpupin.nixl.collecting())
        real_release(h, **kw)

    monkeypatch.setattr(nixl_api.nixl_xfer_handle, "__del__", spy_del)
    monkeypatch.setattr(gpupin.nixl, "_release", spy_release)
    mt, mi = HostMemory(4 << 20), HostMemory(4 << 20)
    tgt = NixlEndpoint("t-running-drop", mt, mem_type="DRAM")
    ini = NixlEndpoint("i-running-drop", mi, mem_type="DRAM")
    try:
        ini.connect(tgt.metadata())
        tgt.connect(ini.metadata())
        rb = tgt.expose(mt.alloc(MiB), MiB)
        src = mi.alloc(MiB)
        with _served(tgt):
            ini.write(src, 4096, rb)  # the lease, granted while the target serves
        with _slow_transfers(ini) as slow:
            t = ini.post_write([(src, 4096, rb, 0)])
            assert not t.done() and ini._running
            slow[0] = False  # NIXL's own answer from here: the transfer ends when polled
            del t
            gc.disable()  # the cycle goes in the collect below, on this thread
            ini.cycle = tgt  # type: ignore[attr-defined]
            tgt.cycle = ini  # type: ignore[attr-defined]
            del ini, tgt, rb
        released.clear()
        gc.collect()
        assert True not in released, "a NIXL transfer handle was released from the garbage collector"
        gpupin.nixl.reap()
        assert released == [False], "reap() did not release the dropped endpoint's running transfer"
    finally:
        gc.enable()
        gc.collect()
        gpupin.nixl.reap()
        mi.close()
        mt.close()


def test_a_transfer_kept_after_close_does_not_keep_the_agent() -> None:
    """NIXL's transfer handle refers to its agent: a Transfer the application keeps must not
    keep it once the transfer is over, else the agent goes wherever the Transfer goes (inside
    the garbage collector, for one in a reference cycle) instead of at close()."""

    mt, mi = HostMemory(4 << 20), HostMemory(4 << 20)
    tgt = NixlEndpoint("t-kept", mt, mem_type="DRAM")
    ini = NixlEndpoint("i-kept", mi, mem_type="DRAM")
    events: list[bool] = []  # collecting() when the agent's binding was destroyed
    try:
        ini.connect(tgt.metadata())
        tgt.connect(ini.metadata())
        with _served(tgt):
            rb = tgt.expose(mt.alloc(MiB), MiB)
            t = ini.post_write([(mi.alloc(MiB), 4096, rb, 0)])
            t.wait(10)
        binding = weakref.ref(ini.agent.agent, lambda _: events.append(gpupin.nixl.collecting()))
        ini.close()
        assert events == [False], "the agent outlived close(): something still holds it"
        assert t.state == "DONE"
    finally:
        tgt.close()
        mi.close()
        mt.close()
    assert binding() is None


def test_memory_leased_to_a_peer_stays_held_when_its_endpoint_is_left_to_the_collector() -> None:
    """A target dropped without close(), over an agent the application keeps, while an
    initiator holds a lease on its exposed buffer: from the collector no revocation can be
    sent and the agent lives on, so the initiator could still write there. The provider keeps
    refusing the free (a warning says why) instead of letting a new owner have the memory."""
    import gc

    mt, mi = HostMemory(4 << 20), HostMemory(4 << 20)
    api = gpupin.nixl.load_nixl()
    agent = api.nixl_agent("t-leased-gc", api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    tgt = NixlEndpoint("t-leased-gc", mt, mem_type="DRAM", agent=agent)
    ini = NixlEndpoint("i-leased-gc", mi, mem_type="DRAM")
    try:
        ini.connect(tgt.metadata())
        tgt.connect(ini.metadata())
        dst, src = mt.alloc(MiB), mi.alloc(MiB)
        rb = tgt.expose(dst, MiB)
        with _served(tgt):
            ini.write(src, 4096, rb)  # the initiator holds a lease from here
        tgt.cycle = tgt  # type: ignore[attr-defined] - only the collector frees it
        del tgt
        with pytest.warns(RuntimeWarning, match="peers held leases on 1 exposed range"):
            gc.collect()
            gpupin.nixl.reap()
        with pytest.raises(gpupin.InUse, match="unexpose"):
            mt.free(dst)
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # its target is gone: no word on its drop
            ini.close(timeout=0.5)
        gpupin.nixl.reap()
        del agent
        mi.close()


def test_connect_waits_while_a_transfer_with_that_peer_runs() -> None:
    """connect() is public and says "again after it registered more": called while a transfer
    with that peer runs, a load NIXL refuses would erase its view of the peer under the transfer
    (reported NOT_FOUND while UCX may still move its bytes).  It waits for the transfer (InUse
    past its timeout); metadata of a peer it does not transfer with loads at once."""
    p = Pair()
    try:
        with _served(p.tgt), _slow_transfers(p.ini) as slow:
            rb = p.tgt.expose(p.mt.alloc(MiB), MiB)
            t = p.ini.post_write([(p.mi.alloc(MiB), 4096, rb, 0)])
            loads: list[bytes] = []
            real = p.ini._add
            p.ini._add = lambda md, peer: (loads.append(md), real(md, peer))[1]  # type: ignore[method-assign]
            with pytest.raises(gpupin.InUse, match="a transfer with t-pair still runs"):
                p.ini.connect(p.tgt.metadata(), timeout=0.2)
            assert not loads and not t.done()
            other = NixlEndpoint("t-other", HostMemory(1 << 20), mem_type="DRAM")
            try:
                assert p.ini.connect(other.metadata(), timeout=0.2) == "t-other" and len(loads) == 1
            finally:
                other.close()
            slow[0] = False
            assert p.ini.connect(p.tgt.metadata(), timeout=5) == "t-pair" and t.done()
            del p.ini._add
    finally:
        p.close()


def test_a_ctrl_c_as_connect_starts_waiting_leaves_no_peer_marked_draining() -> None:
    """connect() marks the peer draining (no new transfer with it starts) while it waits for the
    running ones; a Ctrl-C as it let the endpoint's lock go after the mark, before the try that
    takes the mark back, left every later transfer with that peer waiting for ever."""

    p = Pair()
    try:
        with _served(p.tgt), _slow_transfers(p.ini) as slow:
            rb = p.tgt.expose(p.mt.alloc(MiB), MiB)
            src = p.mi.alloc(MiB)
            t = p.ini.post_write([(src, 4096, rb, 0)])
            lock = p.ini._lock
            p.ini._lock = _InterruptingLock(lock, "__exit__", lambda: bool(p.ini._draining))  # type: ignore[assignment]
            try:
                with pytest.raises(KeyboardInterrupt):
                    p.ini.connect(p.tgt.metadata(), timeout=5)
            finally:
                p.ini._lock = lock
            assert not p.ini._draining, "the peer stays marked draining: no transfer with it starts again"
            slow[0] = False
            t.wait(5)
            assert t.state == "DONE"
            p.ini.write(src, 4096, rb, timeout=5)
    finally:
        p.close()


@contextlib.contextmanager
def _not_found(ep: NixlEndpoint) -> Iterator[list[bool]]:
    """Inside _slow_transfers: make ``ep``'s agent answer a transfer's state with NIXL's own
    NOT_FOUND (its view of the peer erased under the transfer: getXferStatus in
    nixl_agent.cpp) while the flag it gives is set."""
    import nixl_cu13._bindings as bind

    agent = ep.agent
    on = [True]
    before = agent.check_xfer_state  # _slow_transfers' double

    def check(h: Any) -> str:
        if on[0]:
            raise bind.nixlNotFoundError("NIXL_ERR_NOT_FOUND")
        return str(before(h))

    agent.check_xfer_state = check
    try:
        yield on
    finally:
        agent.check_xfer_state = before


def test_a_transfer_nixl_lost_track_of_stays_held_until_the_peer_is_forgotten() -> None:
    """NOT_FOUND for a running transfer (NIXL erased its view of the peer: a refused load, a
    disconnect) says nothing of UCX's puts: it counted as over, the lease went and the target's
    unexpose() returned while bytes could still land.  Now it stays running, its buffer
    registered and its lease counting it, until the peer is forgotten; loading the peer again
    does not end it (NIXL 1.5.1 ties the transfer to the view it lost)."""
    p = Pair(auto_progress=True)  # the initiator takes the revocation while it waits
    try:
        with _served(p.tgt):
            dst, src = p.mt.alloc(MiB), p.mi.alloc(MiB)
            rb = p.tgt.expose(dst, MiB)
            with _slow_transfers(p.ini) as slow:
                t = p.ini.post_write([(src, 4096, rb, 0)])
                start = time.monotonic()
                with _not_found(p.ini), pytest.raises(NixlError, match="NIXL lost its view of the peer") as ei:
                    t.wait(timeout=30)  # at once: NIXL would only say NOT_FOUND again
                assert time.monotonic() - start < 10, "wait() of a lost transfer waited for its timeout"
                assert ei.value.status == "lost" and t.lost and p.ini.lost_transfers == 1
                assert p.ini.pending_transfers() == 1 and p.ini.cache.held() == 1
                with pytest.raises(gpupin.InUse):
                    p.tgt.unexpose(rb, timeout=0.3)  # the lease still counts the transfer
                with pytest.raises(gpupin.InUse, match="lost"):
                    p.ini.close(timeout=0.2)
                slow[0] = False
                p.ini.connect(p.tgt.metadata())  # loaded again: the lost transfer stays held
                assert t.lost and p.ini.pending_transfers() == 1 and p.ini.lost_transfers == 1
                p.ini.forget_peer("t-pair")  # the caller says the peer transfers no more
                assert t.state == "ERR" and p.ini.pending_transfers() == 0 and p.ini.cache.held() == 0
            p.tgt.forget_peer("i-pair")
            p.tgt.unexpose(rb, timeout=5)
            p.ini.connect(p.tgt.metadata())
            p.tgt.connect(p.ini.metadata())
    finally:
        p.close()


def test_confirmations_nobody_waits_for_leave_nothing_behind() -> None:
    """post(confirm=True) waited without confirm, or dropped unwaited: each answer was kept for a
    wait(confirm=True) that never came, without bound.  Now an answer goes onto its transfer, and
    a transfer dropped before its answer came leaves nothing behind."""
    import gc

    from gpupin.nixl import OK

    p = Pair()
    try:
        src = p.mi.alloc(MiB)
        rb = p.tgt.expose(p.mt.alloc(MiB), MiB)
        ts = [p.ini.post("WRITE", [(src, 4096, rb, 0)], confirm=True) for _ in range(50)]
        for t in ts:
            t.wait()
        deadline = time.monotonic() + 10
        while p.ini._waiting and time.monotonic() < deadline:
            p.ini.progress()
        assert not p.ini._waiting and all(t.verdict is not None and t.verdict[0] == OK for t in ts)
        for _ in range(50):  # dropped at once: most answers come after their transfer went
            p.ini.post("WRITE", [(src, 4096, rb, 0)], confirm=True).wait()
        gc.collect()
        assert not p.ini._waiting
        p.ini.write(src, 4096, rb, confirm=True)  # answers come to those waiting still
    finally:
        p.close()


def test_lease_messages_from_strangers_go_unanswered_and_drops_are_not_retried_forever(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A revocation or a late grant from a name the endpoint never connected queued a lease drop
    that NIXL could never deliver, sent again at every pump (and each failure marked the peer
    failed) for the endpoint's life.  Now it is counted unanswered; and a drop to a connected
    peer whose sending keeps failing is tried a bounded number of times, then a warning."""
    from gpupin import nixl

    p = Pair()
    try:
        with p.ini._lock:
            p.ini._on_message("stranger", nixl._pack(nixl._REVOKE, (12345, nixl.OK)))
            p.ini._on_message("stranger", nixl._pack(nixl._GRANT, (777, 1), [(12345, nixl.OK, 0, 0, 0)]))
        assert not p.ini._drops and p.ini.unanswered == 2
        monkeypatch.setattr(nixl, "_DROP_TRIES", 3)
        sends: list[bytes] = []
        monkeypatch.setattr(p.ini, "_send", lambda peer, msg: sends.append(msg) and False)
        with p.ini._lock:
            p.ini._send_drop("t-pair", nixl._pack(nixl._DROP, (12345, 0, 0, 0)))
        with pytest.warns(RuntimeWarning, match="gave up sending a lease drop to t-pair after 3 tries"):
            deadline = time.monotonic() + 5
            while p.ini._drops and time.monotonic() < deadline:
                p.ini.progress()
                time.sleep(0.001)
        assert not p.ini._drops and len(sends) == 3
    finally:
        monkeypatch.undo()
        p.close()


def test_deferred_cleanup_never_runs_under_an_endpoints_locks() -> None:
    """Work a collected endpoint left (an agent to retire spins it for up to 0.3 s) ran inside
    NixlDriver.pin, which a cache miss calls under the endpoint's lock and the cache's: every
    other thread of that endpoint (its posts, its progress thread, its lease answers) stalled
    behind it.  Now it runs before those locks are taken."""
    from gpupin import nixl

    p = Pair()
    try:
        rb = p.tgt.expose(p.mt.alloc(MiB), MiB)
        p.ini.write(p.mi.alloc(MiB), 4096, rb)  # the lease is held: the next post goes straight on
        seen: list[tuple[bool, bool]] = []
        nixl._defer(lambda: seen.append((p.ini._lock._is_owned(), p.ini.cache._lock._is_owned())))  # type: ignore[attr-defined]
        p.ini.write(p.mi.alloc(MiB), 4096, rb)  # a new allocation: a cache miss, pinned
        assert seen == [(False, False)]
        seen.clear()
        nixl._defer(lambda: seen.append((p.tgt._lock._is_owned(), p.tgt.cache._lock._is_owned())))  # type: ignore[attr-defined]
        p.tgt.expose(p.mt.alloc(MiB), MiB)
        assert seen == [(False, False)]
    finally:
        p.close()


def test_no_reap_is_called_under_an_endpoints_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    """expose() reaped before its lock, then the cache's acquire() reaped again under it: work
    another thread's finalizer queued in between (another endpoint's cleanup, which takes that
    endpoint's lock: two such endpoints deadlock; an agent's retirement, which spins it for
    SETTLE_S) ran under this endpoint's lock.  The test above queues its work before expose()
    and misses that window; this one sees every reap() call, wherever it is made from."""
    from gpupin import nixl

    p = Pair()
    try:
        calls: list[tuple[str, bool]] = []
        real = nixl.reap

        def watched() -> int:
            for who, ep in (("target", p.tgt), ("initiator", p.ini)):
                calls.append((who, ep._lock._is_owned()))  # type: ignore[attr-defined]
            return real()

        monkeypatch.setattr(nixl, "reap", watched)
        rb = p.tgt.expose(p.mt.alloc(MiB), MiB)
        p.ini.write(p.mi.alloc(MiB), 4096, rb)
        assert calls, "neither expose() nor write() reaped"
        assert not [c for c in calls if c[1]], calls
    finally:
        p.close()


def test_a_thread_waiting_on_another_threads_load_says_so() -> None:
    """Thread A's lease on a new exposure is granted and A loads its registration, which waits
    for a running transfer with the peer; thread B, wanting the same exposure, waits for A's
    lease.  At its timeout B said the target did not answer the lease request (it must call
    progress()...), though the target had answered at once: B waited for A's load."""
    p = Pair()
    try:
        src = p.mi.alloc(MiB)
        ra = p.tgt.expose(p.mt.alloc(MiB), MiB)
        p.ini.write(src, 4096, ra, timeout=10)
        errors: list[str] = []
        with _slow_transfers(p.ini) as slow:
            t = p.ini.post_write([(src, 4096, ra, 0)])  # runs until the flag goes
            rb = p.tgt.expose(p.mt.alloc(2 * MiB), 2 * MiB)  # a new allocation: A must load it
            a = _writer("A", lambda: p.ini.write(src, 4096, rb, timeout=5), errors)
            deadline = time.monotonic() + 5
            while p.ini._lease_state(p.tgt.name, rb.xid) != "granted":
                assert time.monotonic() < deadline, "A's lease was never granted"
                time.sleep(0.01)
            with pytest.raises(NixlError) as got:
                p.ini.write(src, 4096, rb, timeout=0.3)
            slow[0] = False
            a.join()
            t.wait(5)
        assert not errors, errors
        assert "no answer" not in str(got.value), got.value
        assert "another thread of this endpoint is still loading" in str(got.value), got.value
    finally:
        p.close()


def test_a_timeout_spent_before_the_lease_wait_says_so() -> None:
    """A lease wait entered with its deadline already past blamed the target for not
    answering, though no time was left for any answer; the next write goes through."""
    p = Pair()
    try:
        src = p.mi.alloc(MiB)
        rb = p.tgt.expose(p.mt.alloc(MiB), MiB)
        with pytest.raises(NixlError, match="timeout ran out before a lease request could be answered"):
            p.ini.write(src, 4096, rb, timeout=0)
        p.ini.write(src, 4096, rb, timeout=5)
    finally:
        p.close()


def test_a_refused_endpoint_leaves_the_applications_agent_free() -> None:
    """NixlEndpoint(agent=a, max_bytes=-1) raised after claiming ``a`` for the endpoint, and
    the half-made endpoint's finalizer could not let go of it: ``a`` could serve no endpoint
    again ("already serves endpoint")."""
    import nixl_cu13

    mem = HostMemory(16 << 20)
    a = nixl_cu13.nixl_agent("refused-agent", nixl_cu13.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    try:
        with pytest.raises(gpupin.InvalidArgument, match="max_bytes"):
            NixlEndpoint("refused", mem, mem_type="DRAM", agent=a, max_bytes=-1)
        NixlEndpoint("refused", mem, mem_type="DRAM", agent=a).close()
    finally:
        mem.close()


def test_a_blocking_write_keeps_to_its_timeout() -> None:
    """write(timeout=T) gave its lease request T and then its wait a fresh T: a target that
    answered late and a slow transfer made write(timeout=2) return after 3.3 s.  Now one T
    bounds the whole call: it raises (status "timeout"), the transfer held until it ends."""
    p = Pair(auto_progress=True)
    try:
        src = p.mi.alloc(MiB)
        rb = p.tgt.expose(p.mt.alloc(MiB), MiB)
        p.stop.set()
        p.pump.join()  # the target answers the lease request 1.5 s from now
        with _slow_transfers(p.ini) as slow:
            late = threading.Timer(1.5, p.serve_again)
            done = threading.Timer(3.3, lambda: slow.__setitem__(0, False))
            late.start()
            done.start()
            with pytest.raises(NixlError, match="not done after") as ei:
                p.ini.write(src, 4096, rb, timeout=2)
            assert ei.value.status == "timeout"
            late.join()
            done.join()
            assert p.ini.settle(timeout=10) == 0
    finally:
        p.close()


def test_no_lease_is_asked_for_once_forget_peer_marked_the_peer() -> None:
    """A writer past the first check of forget_peer's mark, preempted, asked for a lease while
    forget_peer waited for its drops to be acknowledged; the forget's last step deleted that
    lease with no drop, and the live target held the exposure for that initiator for ever
    (its unexpose raised InUse).  Now the lease is not asked for: the write says so, and
    the target's unexpose completes."""
    p = Pair(auto_progress=True)
    try:
        src = p.mi.alloc(MiB)
        ra = p.tgt.expose(p.mt.alloc(MiB), MiB)
        rb = p.tgt.expose(p.mt.alloc(MiB), MiB)
        p.ini.write(src, 4096, ra, timeout=10)
        reached, go = threading.Event(), threading.Event()
        real_wl, real_pump = p.ini._wait_and_load, p.ini._pump

        def wl(*a: Any, **k: Any) -> Any:
            if threading.current_thread().name == "w" and not reached.is_set():
                reached.set()
                go.wait(10)  # preempted here, past the first check of the mark
            return real_wl(*a, **k)

        def pump(*a: Any, **k: Any) -> Any:
            if threading.current_thread().name == "f" and not go.is_set():
                go.set()  # forget_peer's first hold is over: it waits for its drops' acks
                time.sleep(0.5)
            return real_pump(*a, **k)

        p.ini._wait_and_load = wl  # type: ignore[method-assign]
        p.ini._pump = pump  # type: ignore[method-assign]
        errors: list[str] = []
        w = _writer("w", lambda: p.ini.write(src, 4096, rb, timeout=5), errors)
        assert reached.wait(5)
        f_errors: list[str] = []
        f = _writer("f", lambda: p.ini.forget_peer(p.tgt.name, timeout=2), f_errors)
        w.join()
        f.join()
        del p.ini._wait_and_load, p.ini._pump
        assert not f_errors, f_errors
        assert len(errors) == 1 and "forget_peer" in errors[0] and "nothing was sent" in errors[0], errors
        p.tgt.unexpose(ra, timeout=2)
        p.tgt.unexpose(rb, timeout=2)  # no holder left behind
    finally:
        if p.ini.name in p.tgt._connected:
            p.tgt.forget_peer(p.ini.name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            p.close()


def test_a_transfer_failed_after_posting_part_of_it_stays_held_until_the_peer_is_forgotten() -> None:
    """NIXL's UCX backend stops a scatter list at the put that failed, and the puts before it are
    under way with nothing to wait for them: the error counted the transfer over, its lease
    went and its buffers were let go while those puts could still land.  Now it stays held until
    forget_peer(); a single block that fails had nothing under way and is let go at once."""
    import nixl_cu13._bindings as bind

    p = Pair(auto_progress=True)
    try:
        with _served(p.tgt):
            dst, src = p.mt.alloc(MiB), p.mi.alloc(MiB)
            rb = p.tgt.expose(dst, MiB)
            p.ini.write(src, 4096, rb)  # the lease is held
            agent = p.ini.agent
            real = type(agent).transfer
            ref = weakref.ref(agent)

            def fails_after_posting(h: Any, *a: Any) -> str:
                real(ref(), h, *a)  # posted for real (in this process: landed at once)
                raise bind.nixlBackendError("NIXL_ERR_BACKEND")

            agent.transfer = fails_after_posting
            try:
                with pytest.raises(NixlError, match="failed after NIXL posted part of it"):
                    p.ini.write_blocks([(src, 4096, rb, 0), (src + 8192, 4096, rb, 8192)])
                assert p.ini.lost_transfers == 1 and p.ini.pending_transfers() == 1 and p.ini.cache.held() == 1
                with pytest.raises(NixlError, match="with t-pair failed"):
                    p.ini.write(src, 4096, rb)  # one block: nothing under way, let go once NIXL says so
                deadline = time.monotonic() + 5
                while p.ini.pending_transfers() > 1 and time.monotonic() < deadline:
                    time.sleep(0.001)
                assert p.ini.pending_transfers() == 1
            finally:
                del agent.transfer
            with pytest.raises(gpupin.InUse):
                p.tgt.unexpose(rb, timeout=0.3)  # the held transfer's lease still counts it
            p.ini.connect(p.tgt.metadata())  # loading the peer again does not let it go
            assert p.ini.pending_transfers() == 1
            p.ini.forget_peer("t-pair")
            assert p.ini.pending_transfers() == 0 and p.ini.cache.held() == 0
            p.tgt.forget_peer("i-pair")
            p.tgt.unexpose(rb, timeout=5)
    finally:
        p.close()


_COLLECT_UNDER_THE_REGISTRY_LOCK = r"""
import faulthandler, gc, sys, weakref
faulthandler.dump_traceback_later(60, exit=True)  # a deadlock: the stacks, and a failure
import gpupin.nixl as gn
from gpupin.hostmem import HostMemory

class Collecting(weakref.WeakKeyDictionary):
    # What an automatic collection at one of these allocations does, made certain.
    def __setitem__(self, k, v):
        gc.collect()
        super().__setitem__(k, v)
    def pop(self, k, *d):
        gc.collect()
        return super().pop(k, *d)

gc.disable()  # the garbage waits for the collections above
gn._AGENT_LOCKS = Collecting(gn._AGENT_LOCKS)
gn._ENDPOINT_OF = Collecting(gn._ENDPOINT_OF)
gn._PROGRESS_THREADS = Collecting(gn._PROGRESS_THREADS)
m = HostMemory(16 << 20)
for n in range(4):
    old = gn.NixlEndpoint(f"old{n}", m, mem_type="DRAM")  # left in a cycle: finalized in there
    old.expose(m.alloc(4096), 4096)
    old.cycle = old
    del old
    new = gn.NixlEndpoint(f"new{n}", m, mem_type="DRAM", auto_progress=n % 2 == 1)
    new.close()
gn.reap()
print("no deadlock")
"""


def test_a_collection_under_the_registry_lock_finalizes_without_deadlock() -> None:
    """An allocation made under the module's registry lock (a weak dictionary's entry, made when
    an endpoint is made, claims its agent, starts its progress thread or closes) can start a
    collection on that thread, whose finalizers (endpoints left in cycles) took the same lock:
    the thread waited on itself for ever.  No finalizer takes a lock now."""
    import os
    import subprocess

    # (gpupin first, then what the caller's path has: NIXL may be installed on it)
    path = os.pathsep.join(filter(None, [str(Path(gpupin.__file__).parents[1]), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "NIXL_LOG_LEVEL": "ERROR"}
    r = subprocess.run(
        [sys.executable, "-c", _COLLECT_UNDER_THE_REGISTRY_LOCK], env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and "no deadlock" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


def test_a_refused_close_keeps_answering_peers() -> None:
    """close() stopped the progress thread and then refused (InUse: a transfer still runs): the
    endpoint lived on without it, a target's revocation went unanswered and its unexpose()
    timed out.  A refused close() changes nothing now."""
    p = Pair(auto_progress=True)
    try:
        x = p.tgt.expose(p.mt.alloc(MiB), MiB)
        y = p.tgt.expose(p.mt.alloc(MiB), MiB)
        src = p.mi.alloc(MiB)
        p.ini.write(src, 4096, y)  # a lease on y, idle
        with _slow_transfers(p.ini) as slow:
            p.ini.post_write([(src, 4096, x, 0)])
            with pytest.raises(gpupin.InUse, match="NIXL has not ended"):
                p.ini.close(timeout=0.2)
            assert p.ini._progress_thread.is_alive()
            p.tgt.unexpose(y, timeout=5)  # the initiator's thread answers the revocation
            slow[0] = False
        assert p.ini.settle(5) == 0
    finally:
        p.close()


def test_a_late_grant_given_back_does_not_end_the_lease_asked_for_again() -> None:
    """A lease request times out; the application asks again; the first grant then arrives and
    is given back.  The target took that drop for the drop of the lease the second request
    holds: unexpose() returned at once without revoking it, and the next write through the held
    lease landed in the memory's new owner, reported done.  A drop names its grant now."""
    p = Pair()
    p.stop.set()
    p.pump.join()  # the target does not answer: the first request times out
    try:
        dst, src = p.mt.alloc(MiB), p.mi.alloc(MiB)
        rb = p.tgt.expose(dst, MiB)
        with pytest.raises(NixlError, match="no answer"):
            p.ini.write(src, 4096, rb, timeout=0.2)
        with _served(p.tgt):
            p.ini.write(src, 4096, rb, timeout=10)  # asked again, granted, held
            for _ in range(100):  # the first grant comes too, and is given back
                p.ini.progress()
                time.sleep(0.002)
            holder = p.tgt._exposures[rb.xid].holders["i-pair"]
            assert holder[1] == -1, "the target took the late grant's drop for the held lease's"
            with pytest.raises(gpupin.InUse, match="still hold a lease"):
                p.tgt.unexpose(rb, timeout=0.3)  # the holder is revoked, and has not answered
            p.ini.progress()  # it answers the revocation
            p.tgt.unexpose(rb, timeout=5)
            with pytest.raises(StaleRemote, match="refused before any byte moved"):
                p.ini.write(src, 4096, rb)  # nothing lands in the freed memory
    finally:
        p.close()


def _a_registration_dropped_at_the_base_of_a_live_one(p: Pair) -> tuple[RemoteBuffer, RemoteBuffer, int, RemoteBuffer]:
    """A 1 MiB exposure written, taken back and freed; 512 KiB exposed at its base and written
    (the initiator's view renewed: the 1 MiB registration gone from NIXL's view).  Returns the
    old descriptor, the new one, the source buffer and a descriptor past the new registration
    inside the old (deregistered_through_nixl tells whether NIXL still holds the old one)."""
    a, src = p.mt.alloc(MiB), p.mi.alloc(MiB)
    ra = p.tgt.expose(a, MiB)
    p.ini.write(src, 4096, ra)
    p.tgt.unexpose(ra)
    p.mt.free(a)
    b = p.mt.alloc(MiB // 2)
    assert b == a
    rb = p.tgt.expose(b, MiB // 2)
    p.ini.write(src, 4096, rb)
    beyond = dataclasses.replace(rb, addr=a + 600 * 1024, size=4096)
    assert deregistered_through_nixl(p.ini, src, 4096, beyond)
    return ra, rb, src, beyond


def test_connect_with_old_metadata_never_brings_a_dropped_registration_back() -> None:
    """connect() with metadata older than the endpoint's view (the blob of start-up, an old
    descriptor's) put a registration the target had dropped back into NIXL's view, beside the
    live one at its base, and the endpoint went on posting through that view.  Now the next
    transfer with that peer loads the peer's current metadata first."""
    p = Pair(auto_progress=True)
    try:
        ra, rb, src, beyond = _a_registration_dropped_at_the_base_of_a_live_one(p)
        p.ini.connect(ra.metadata)  # the application loads an old blob again
        assert not deregistered_through_nixl(p.ini, src, 4096, beyond)  # NIXL holds it again
        renewals = p.ini.renewals
        p.ini.write(src, 4096, rb)
        assert p.ini.renewals == renewals + 1 and p.ini.view_reloads_asked == 1
        assert deregistered_through_nixl(p.ini, src, 4096, beyond)
    finally:
        p.close()


def test_a_refused_lease_leaves_the_others_of_its_request_usable() -> None:
    """One transfer into two exposures, one of them refused: the lease granted for the other
    stayed "granted" for ever (its registration never loaded), and every later transfer into
    that exposure waited for it until its timeout.  The request's other leases are given back."""
    p = Pair()
    try:
        good = p.tgt.expose(p.mt.alloc(MiB), MiB)
        gone = p.tgt.expose(p.mt.alloc(MiB), MiB)
        p.tgt.unexpose(gone)
        src = p.mi.alloc(MiB)
        with pytest.raises(StaleRemote, match="refused before any byte moved"):
            p.ini.write_blocks([(src, 4096, good, 0), (src + 4096, 4096, gone, 0)], timeout=5)
        p.ini.write(src, 4096, good, timeout=5)
    finally:
        p.close()


def test_a_thread_waiting_on_another_threads_lease_request_asks_itself_when_that_one_gives_up() -> None:
    """Thread B waits for the lease thread A asked for; A's request times out first: B got
    StaleRemote ("the target no longer exposes it") though the target never answered and B's own
    timeout was far off.  B asks for the lease itself now."""
    import threading

    p = Pair()
    p.stop.set()
    p.pump.join()  # no answers for now
    try:
        rb = p.tgt.expose(p.mt.alloc(MiB), MiB)
        s1, s2 = p.mi.alloc(MiB), p.mi.alloc(MiB)
        out: dict[str, BaseException | None] = {}

        def write(key: str, src: int, timeout: float) -> None:
            try:
                p.ini.write(src, 4096, rb, timeout=timeout)
                out[key] = None
            except BaseException as exc:  # noqa: BLE001 - looked at below
                out[key] = exc

        a = threading.Thread(target=write, args=("A", s1, 0.3))
        a.start()
        time.sleep(0.05)
        b = threading.Thread(target=write, args=("B", s2, 20))
        b.start()
        a.join()
        assert isinstance(out["A"], NixlError) and "no answer" in str(out["A"])
        with _served(p.tgt):
            b.join(20)
        assert not b.is_alive() and out["B"] is None, out["B"]
    finally:
        p.close()


def test_warnings_as_errors_lose_no_message_of_a_batch() -> None:
    """Where warnings are errors (python -W error, pytest's filterwarnings), a warning raised in
    the middle of a batch of notifications (a malformed one) left the rest of the batch lost:
    the application's messages after it and a revocation.  Warnings now come once the batch
    is handled."""
    from gpupin import nixl

    p = Pair()
    try:
        rb = p.tgt.expose(p.mt.alloc(MiB), MiB)
        p.ini.write(p.mi.alloc(MiB), 4096, rb)  # the initiator holds a lease
        p.stop.set()
        p.pump.join()
        with p.tgt.driver.lock:
            p.tgt.agent.send_notif("i-pair", b"app-1")
            p.tgt.agent.send_notif("i-pair", nixl._PREFIX + b"Z" + bytes(8))  # malformed
            p.tgt.agent.send_notif("i-pair", b"app-2")
            p.tgt.agent.send_notif("i-pair", nixl._pack(nixl._REVOKE, (rb.xid, nixl.OK)))
        got: list[tuple[str, bytes]] = []
        raised = 0
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for _ in range(500):
                try:
                    got += p.ini.progress()
                except RuntimeWarning:
                    raised += 1
                if len(got) >= 3:
                    break
                time.sleep(0.002)
        assert raised == 1 and [m for _, m in got] == [b"app-1", nixl._PREFIX + b"Z" + bytes(8), b"app-2"]
        assert ("t-pair", rb.xid) not in p.ini._leases  # the revocation was taken: the lease dropped
    finally:
        p.close()


def _refuse_the_next_load(ep: NixlEndpoint) -> list[int]:
    """Make ``ep``'s next metadata load fail as NIXL refuses one on VRAM (nixlInvalidParamError),
    the later ones go through; returns the count of loads (del ep._add ends it)."""
    real, calls = ep._add, [0]

    def refuse_once(md: bytes, peer: str | None) -> str:
        calls[0] += 1
        if calls[0] == 1:
            raise NixlError("add_remote_agent: nixlInvalidParamError (as NIXL on VRAM)", "nixlInvalidParamError")
        return real(md, peer)

    ep._add = refuse_once  # type: ignore[method-assign]
    return calls


def test_leases_are_kept_or_given_back_never_dropped_silently() -> None:
    """The initiator forgot its leases with a peer without telling it: when NIXL refused a reload
    of the same peer (on VRAM: a registration at an address an earlier one had), the lease just
    granted went too (a false StaleRemote) and the target waited for its drop in unexpose();
    forget_peer() on the initiator left the target waiting the same way.  And a descriptor of a
    peer's earlier incarnation, used after the new one was met, switched the endpoint back to
    the dead one.  Now the leases stay across a refused reload, forget_peer() gives them back,
    and an old incarnation's descriptor is refused."""
    p = Pair(auto_progress=True)
    try:
        src = p.mi.alloc(MiB)
        ra = p.tgt.expose(p.mt.alloc(MiB), MiB)
        p.ini.write(src, 4096, ra)
        rb = p.tgt.expose(p.mt.alloc(2 * MiB), 2 * MiB)  # new metadata to load
        calls = _refuse_the_next_load(p.ini)
        p.ini.write(src, 4096, rb)  # reloaded after forgetting NIXL's view: the leases stay
        del p.ini._add
        # refused, loaded after forgetting NIXL's view, then the current metadata (what newer
        # exposures registered: the descriptor's own metadata may lack it)
        assert calls[0] == 3 and ("t-pair", ra.xid) in p.ini._leases
        p.ini.write(src, 4096, ra)
        p.ini.forget_peer("t-pair")  # given back: the target's unexpose need not wait
        p.tgt.unexpose(ra, timeout=5)
        p.tgt.unexpose(rb, timeout=5)
        rc = p.tgt.expose(p.mt.alloc(MiB), MiB)
        p.ini.connect(p.tgt.metadata())
        p.tgt.connect(p.ini.metadata())  # the initiator's forget_peer closed the connection both ways
        p.ini.write(src, 4096, rc)
        rd = p.tgt.expose(p.mt.alloc(MiB), MiB)
        other = dataclasses.replace(rd, incarnation=rc.incarnation + 1)  # an incarnation it does not run
        with pytest.raises(StaleRemote, match="not the one it runs"):
            p.ini.write(src, 4096, other)  # the live peer says which it runs: not a restart
        p.ini.write(src, 4096, rd)  # nothing of the live incarnation was forgotten
        p.ini.write(src, 4096, rc)
    finally:
        p.close()


def test_an_endpoint_collected_while_its_cache_is_held_lets_unleased_memory_go() -> None:
    """An endpoint left to the collector while the application still held a registration of its
    cache: close() from the collector stopped at the driver's InUse before it let go of the free
    holds of exposures no peer had leased, and that memory could never be freed."""
    import gc

    from gpupin import nixl

    mt = HostMemory(8 << 20)
    try:
        tgt = NixlEndpoint("t-gc-held", mt, mem_type="DRAM")
        dst, other = mt.alloc(MiB), mt.alloc(MiB)
        tgt.expose(dst, MiB)  # exposed, never leased
        held = tgt.cache.acquire(other, MiB)
        tgt.cycle = tgt  # type: ignore[attr-defined]
        del tgt
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gc.collect()
            nixl.reap()
        mt.free(dst)  # no peer leased it: free as soon as its endpoint went
        held.release()
        del held
        gc.collect()
        nixl.reap()
    finally:
        mt.close()


def test_a_descriptor_must_name_the_range_its_exposure_has() -> None:
    """A lease covered (xid, epoch), not the range: a descriptor with a live exposure's xid and
    another address (patched or mixed up by the application) was granted, and its write went
    to whatever the target had registered there (here: memory unexposed, freed and owned anew),
    reported done and confirmed.  The grant now says the range, and a descriptor must name it."""
    p = Pair(auto_progress=True)
    try:
        y, x, src = p.mt.alloc(MiB), p.mt.alloc(MiB), p.mi.alloc(MiB)
        ry, rx = p.tgt.expose(y, MiB), p.tgt.expose(x, MiB)
        p.ini.write(src, 4096, ry)
        p.ini.write(src, 4096, rx)
        p.tgt.unexpose(ry)
        p.mt.free(y)
        z = p.mt.alloc(MiB)
        assert z == y  # the new owner (the registration is still cached at the target)
        p.mt.write(z, bytes(4096))
        p.mi.write(src, b"\xcc" * 4096)
        for bad in (dataclasses.replace(rx, addr=y), dataclasses.replace(rx, size=2 * MiB)):
            with pytest.raises(gpupin.InvalidArgument, match="the descriptor names"):
                p.ini.write(src, 4096, bad, confirm=True)
            with pytest.raises(gpupin.InvalidArgument, match="name different ranges"):
                p.ini.write_blocks([(src, 4096, bad, 0), (src, 4096, rx, 8192)], confirm=True)
        assert p.mt.read(z, 4096) == bytes(4096)
        p.ini.write(src, 4096, rx)  # the right descriptor still goes
    finally:
        p.close()


def test_small_misuses_get_clear_errors() -> None:
    """A failed constructor left the application's agent claimed (the next endpoint on it was
    refused); corrupt descriptor bytes raised UnicodeDecodeError; a transfer into the
    endpoint's own exposure failed with advice to make a new endpoint; and expose() of a range
    freed behind the provider's hold returned the exposure of the memory gone."""
    from gpupin.nixl import load_nixl

    api = load_nixl()
    agent = api.nixl_agent("app-agent", api.nixl_agent_config(backends=["UCX"]))
    m = HostMemory(8 << 20)
    try:
        with pytest.raises(gpupin.InvalidArgument, match="mem_type"):
            NixlEndpoint("e", m, mem_type="HBM", agent=agent)
        NixlEndpoint("e", m, mem_type="DRAM", agent=agent).close()  # the agent is free again
        ep = NixlEndpoint("loop", m, mem_type="DRAM")
        try:
            buf = m.alloc(MiB)
            rb = ep.expose(buf, MiB)
            data = bytearray(rb.to_bytes())
            at = data.index(b"loop")
            data[at : at + 4] = b"\xff\xfe\xfd\xfc"
            with pytest.raises(gpupin.InvalidArgument, match="not text"):
                RemoteBuffer.from_bytes(bytes(data))
            with pytest.raises(gpupin.InvalidArgument, match="own exposure"):
                ep.write(m.alloc(MiB), 4096, rb)
            m.release_free_hold(ep._exposures[rb.xid].hold)  # freed behind the hold
            m.free(buf)
            assert m.alloc(MiB) == buf
            again = ep.expose(buf, MiB)
            assert again.xid != rb.xid and again.buffer_id != rb.buffer_id
        finally:
            ep.close()
    finally:
        del agent
        m.close()


def test_two_threads_asking_for_one_lease_at_once_share_one_request() -> None:
    """Two threads making the first transfer into one exposure at once each asked for the lease
    and shared one lease object: the later grant set a held lease back to "granted" (later
    transfers waited for a load nobody did), and the lease named whichever request came last, so
    its drop could be ignored (unexpose() timed out) or, after a failure of one thread's
    request, accepted while the other thread's transfer ran.  The second thread now waits for
    the first one's request."""
    import threading

    from gpupin import nixl

    p = Pair(auto_progress=True)
    try:
        x = p.tgt.expose(p.mt.alloc(MiB), MiB)
        src = p.mi.alloc(MiB)
        both = threading.Barrier(2)
        real_wait, real_send = p.ini._wait_and_load, p.ini._send

        def wait_and_load(*a: Any, **k: Any) -> Any:
            if threading.current_thread().name in ("T1", "T2"):
                both.wait()  # both found no lease on x
                if threading.current_thread().name == "T2":
                    time.sleep(0.05)  # T1 makes its request first
            return real_wait(*a, **k)

        def send(peer: str, msg: bytes) -> bool:
            if threading.current_thread().name == "T1" and msg.startswith(nixl._PREFIX + nixl._HOLD):
                time.sleep(0.2)  # and is preempted before it sends it
            return real_send(peer, msg)

        p.ini._wait_and_load, p.ini._send = wait_and_load, send  # type: ignore[method-assign]
        out: dict[str, BaseException | None] = {}

        def write(name: str) -> None:
            try:
                p.ini.write(src, 4096, x, timeout=5)
                out[name] = None
            except BaseException as exc:  # noqa: BLE001 - looked at below
                out[name] = exc

        ts = [threading.Thread(target=write, args=(n,), name=n) for n in ("T1", "T2")]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        del p.ini._wait_and_load, p.ini._send
        assert out == {"T1": None, "T2": None} and p.ini.leases_asked == 1
        time.sleep(0.1)
        assert p.ini._leases[("t-pair", x.xid)].state == "held"
        p.ini.write(src, 4096, x, timeout=5)
        p.tgt.unexpose(x, timeout=5)
    finally:
        p.close()


def test_connect_from_another_thread_never_slips_between_a_load_and_its_record() -> None:
    """connect() with old metadata from another thread, landing between a post's lease check and
    its post, or between a renewal's load and the endpoint's record of the view, left the
    endpoint posting through a NIXL view that held a dropped registration, with no renewal.  A
    post now checks the view under the lock it posts under, and a load and its record are one
    step.  (The other thread's call is made at those points by hooks: the windows are a few
    lines wide.)"""
    p = Pair(auto_progress=True)
    try:
        ra, rb, src, beyond = _a_registration_dropped_at_the_base_of_a_live_one(p)
        # (a) after the lease check, before the post
        real_leases, fired = p.ini._leases_for, []

        def leases_then_connect(*a: Any, **k: Any) -> Any:
            got = real_leases(*a, **k)
            if not fired:
                fired.append(1)
                p.ini.connect(ra.metadata)
            return got

        p.ini._leases_for = leases_then_connect  # type: ignore[method-assign]
        p.ini._quick = lambda *a: None  # type: ignore[method-assign]  # (_post's window; the one-frame path's below)
        renewals = p.ini.renewals
        p.ini.write(src, 4096, rb)
        del p.ini._leases_for, p.ini._quick
        assert fired and p.ini.renewals == renewals + 1 and deregistered_through_nixl(p.ini, src, 4096, beyond)
        # (a2) the same for a write of one block that would take NixlEndpoint._quick: the other
        # thread's connect() lands as it starts (its call of driver.direct()), before its checks
        p.ini.write(src, 4096, rb)  # the view is current again: the next write takes _quick
        real_direct, fired = p.ini.driver.direct, []

        def direct_then_connect() -> Any:
            if not fired:
                fired.append(1)
                p.ini.connect(ra.metadata)
            return real_direct()

        p.ini.driver.direct = direct_then_connect  # type: ignore[method-assign]
        renewals = p.ini.renewals
        p.ini.write(src, 4096, rb)
        del p.ini.driver.direct
        assert fired and p.ini.renewals == renewals + 1 and deregistered_through_nixl(p.ini, src, 4096, beyond)
        # (b) right after a renewal's load, before (formerly) its record
        p.ini.connect(ra.metadata)  # the next write renews
        real_reload, fired = p.ini._reload, []

        def reload_then_connect(peer: str, md: bytes, deadline: float, plan: Any, **k: Any) -> int:
            before = p.ini.renewals
            serial = real_reload(peer, md, deadline, plan, **k)
            if p.ini.renewals > before and not fired:  # a renewal
                fired.append(1)
                p.ini.connect(ra.metadata)
            return serial

        p.ini._reload = reload_then_connect  # type: ignore[method-assign]
        renewals = p.ini.renewals
        p.ini.write(src, 4096, rb)  # renewed, connect(old) after it, renewed again before the post
        del p.ini._reload
        assert fired and p.ini.renewals == renewals + 2 and deregistered_through_nixl(p.ini, src, 4096, beyond)
        # (c) before a load that would add to the view (no renewal needed): it decides again in
        # the hold that loads
        p.mt.alloc(MiB // 2)  # fills the hole past rb, so that the next allocation lies outside it
        rc = p.tgt.expose(p.mt.alloc(MiB // 4), MiB // 4)  # new metadata for the view
        assert not rc.addr <= beyond.addr < rc.addr + rc.size
        fired = []

        def connect_then_reload(peer: str, md: bytes, deadline: float, plan: Any, **k: Any) -> int:
            if not k.get("current") and p.ini._views.get(peer) is not None and not fired:
                fired.append(1)
                p.ini.connect(ra.metadata)
            return real_reload(peer, md, deadline, plan, **k)

        p.ini._reload = connect_then_reload  # type: ignore[method-assign]
        p.ini.write(src, 4096, rc)
        del p.ini._reload
        assert fired and deregistered_through_nixl(p.ini, src, 4096, beyond)
    finally:
        p.close()


def test_a_refused_reload_leaves_no_view_lacking_a_held_lease() -> None:
    """A reload NIXL refused was retried with the metadata of the descriptor at hand only; when
    that descriptor was older than another held lease's exposure, NIXL's view lacked that
    registration while the endpoint trusted it, and every transfer into the other exposure
    failed in NIXL until something renewed the view.  Such a view is not trusted now: the next
    transfer loads the peer's current metadata."""
    p = Pair(auto_progress=True)
    try:
        x = p.tgt.expose(p.mt.alloc(MiB), MiB)
        y = p.tgt.expose(p.mt.alloc(2 * MiB), 2 * MiB)  # its metadata names x's registration and y's
        src = p.mi.alloc(MiB)
        p.ini.write(src, 4096, y)
        _refuse_the_next_load(p.ini)
        p.ini.write(src, 4096, x)  # x's metadata (older: no y) refused once, then loaded alone
        del p.ini._add
        p.ini.write(src, 4096, y, timeout=5)
    finally:
        p.close()


def test_forget_peer_close_and_a_new_endpoint_finish_what_they_start() -> None:
    """Three small ones.  An initiator's forget_peer() deleted a lease still asked for without a
    word (the target's unexpose() then waited until its timeout); under warnings-as-errors a
    warning from the notifications close() takes left close() half done; and an endpoint the
    collector took kept its claim on the application's agent until something reaped."""
    import gc
    import threading

    from gpupin import nixl

    p = Pair(auto_progress=True)
    p.stop.set()
    p.pump.join()  # the target does not answer yet
    try:
        x = p.tgt.expose(p.mt.alloc(MiB), MiB)
        src = p.mi.alloc(MiB)

        def write() -> None:
            with contextlib.suppress(NixlError):
                p.ini.write(src, 4096, x, timeout=5)

        writer = threading.Thread(target=write)
        writer.start()
        time.sleep(0.2)  # the lease request is on its way
        assert p.ini.leases_asked == 1
        p.ini.forget_peer("t-pair", timeout=0.2)
        writer.join()
        unanswered = p.ini.unanswered
        with _served(p.tgt):
            time.sleep(0.3)  # the target grants late; the initiator had given the lease back
            t0 = time.monotonic()
            p.tgt.unexpose(x, timeout=5)  # the asked-for lease was given back too
            assert time.monotonic() - t0 < 2
        time.sleep(0.3)
        # The late grant of a forgotten peer gets no second drop (none could be sent).
        assert not p.ini._drops and p.ini.unanswered <= unanswered + 1
        p.ini.connect(p.tgt.metadata())
        p.tgt.connect(p.ini.metadata())
    finally:
        p.close()

    p = Pair()  # the initiator takes its notifications in close()
    try:
        x = p.tgt.expose(p.mt.alloc(MiB), MiB)
        p.ini.write(p.mi.alloc(MiB), 4096, x)
        with p.tgt.driver.lock:
            p.tgt.agent.send_notif("i-pair", nixl._PREFIX + b"Z" + bytes(8))  # malformed: a warning
        time.sleep(0.1)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(RuntimeWarning, match="starts with gpupin's prefix"):
                p.ini.close(timeout=5)
        assert p.ini.driver._agent is None and not p.ini._leases  # closed whole before the warning
    finally:
        p.stop.set()
        p.pump.join()
        p.tgt.close()
        p.mi.close()
        p.mt.close()

    api = nixl.load_nixl()
    agent = api.nixl_agent("app-agent-2", api.nixl_agent_config(backends=["UCX"]))
    m = HostMemory(4 << 20)
    try:
        one = NixlEndpoint("one", m, mem_type="DRAM", agent=agent)
        one.cycle = one  # type: ignore[attr-defined]
        del one
        gc.collect()
        NixlEndpoint("two", m, mem_type="DRAM", agent=agent).close()  # no reap() called in between
    finally:
        nixl.reap()
        del agent
        m.close()


def test_metadata_older_than_the_view_is_never_loaded_on_top_of_it() -> None:
    """Two leases of one transfer granted together; the first one's renewal sees the target drop
    registration A (the target unexposes, frees and reuses it in between); the second one's
    descriptor metadata, older than that view, was added on top of it with no renewal and the
    view recorded as clean: A's descriptor came back into NIXL's view.  Older metadata now makes
    the endpoint load the peer's current metadata instead.  (A hook times the target's own
    actions between the grant and its metadata answer.)"""
    kib = 1024
    p = Pair(auto_progress=True)
    try:
        src = p.mi.alloc(MiB)
        a = p.mt.alloc(256 * kib)
        ra = p.tgt.expose(a, 256 * kib)
        rr1 = p.tgt.expose(p.mt.alloc(64 * kib), 64 * kib)
        x = p.mt.alloc(64 * kib)
        rx = p.tgt.expose(x, 64 * kib)
        p.tgt.unexpose(rx)
        p.mt.free(x)
        r2 = p.mt.alloc(64 * kib)
        assert r2 == x
        rr2 = p.tgt.expose(r2, 64 * kib)  # its metadata still names A
        probe = dataclasses.replace(rr2, addr=a, size=256 * kib)  # only A's own descriptor covers it
        real, fired = p.ini._current_metadata, []

        def target_drops_a_first(peer: str, deadline: float) -> tuple[int, bytes]:
            if not fired:
                fired.append(1)
                p.tgt.unexpose(ra)
                p.mt.free(a)
                p.tgt.expose(p.mt.alloc(128 * kib), 128 * kib)  # A deregistered now
            return real(peer, deadline)

        p.ini._current_metadata = target_drops_a_first  # type: ignore[method-assign]
        p.ini.write_blocks([(src, 4096, rr1, 0), (src + 4096, 4096, rr2, 0)])
        del p.ini._current_metadata
        assert fired and deregistered_through_nixl(p.ini, src, 256 * kib, probe)
    finally:
        p.close()


def test_a_prepared_transfer_is_made_again_when_what_it_names_changed() -> None:
    """A Prepared keeps NIXL's prepped lists, which point at the registrations' metadata as NIXL
    held it then (makeXferReq checks only that the peer is known).  They are used while nothing
    they name changed, and made again after the peer's view was renewed (the target dropped a
    registration) and after the local buffer was registered anew (freed, allocated again);
    the bytes land where the blocks say every time."""
    p = Pair(auto_progress=True)
    try:
        seg, local = p.mt.alloc(MiB), p.mi.alloc(MiB)
        region = p.tgt.expose(seg, MiB)
        blocks = [(local + i * 8192, 4096, region, (7 - i) * 65536) for i in range(8)]
        prep = p.ini.prepare("WRITE", blocks)

        def run_and_check(fill: int) -> None:
            for i in range(8):
                p.mi.write(local + i * 8192, bytes([fill + i]) * 4096)
            prep.run()
            for i in range(8):
                assert p.mt.read(seg + (7 - i) * 65536, 4096) == bytes([fill + i]) * 4096

        run_and_check(1)
        assert p.ini.lists_prepped == 2  # one local list, one remote
        run_and_check(11)
        t = prep.post()
        t.wait(10)
        assert t.state == "DONE" and p.ini.lists_prepped == 2  # used as they are
        # The target drops a registration: the next grant renews NIXL's view of it.
        x = p.mt.alloc(MiB)
        rx = p.tgt.expose(x, MiB)
        p.ini.write(local, 4096, rx)
        p.tgt.unexpose(rx)
        p.mt.free(x)
        y = p.mt.alloc(MiB // 2)
        renewals = p.ini.renewals
        p.ini.write(local, 4096, p.tgt.expose(y, MiB // 2))
        assert p.ini.renewals == renewals + 1
        run_and_check(21)
        assert p.ini.lists_prepped == 3  # the remote list again, the local one as it was
        # The local buffer freed and allocated again: registered anew, so its list is made again.
        p.mi.free(local)
        assert p.mi.alloc(MiB) == local
        run_and_check(31)
        assert p.ini.lists_prepped == 4
        reader = p.ini.prepare("READ", [(local + MiB // 2, 4096, region, 0)])
        reader.post().wait(10)
        assert p.mi.read(local + MiB // 2, 4096) == bytes([31 + 7]) * 4096
        reader.close()
        prep.close()
        with pytest.raises(gpupin.InvalidArgument, match="closed"):
            prep.run()
        assert not p.ini._preps
    finally:
        p.close()


def test_prepare_refuses_what_post_refuses_and_close_releases_every_list() -> None:
    p = Pair(auto_progress=True)
    try:
        before = len(gpupin.nixl._LIVE_DLISTS)
        seg, local = p.mt.alloc(MiB), p.mi.alloc(MiB)
        region = p.tgt.expose(seg, MiB)
        with pytest.raises(gpupin.InvalidArgument, match="'WRITE' or 'READ'"):
            p.ini.prepare("COPY", [(local, 4096, region, 0)])
        with pytest.raises(gpupin.InvalidArgument, match="no blocks"):
            p.ini.prepare("WRITE", [])
        with pytest.raises(gpupin.InvalidArgument, match="inside the remote buffer"):
            p.ini.prepare("WRITE", [(local, 8192, region, MiB - 4096)])
        with pytest.raises(gpupin.InvalidArgument, match="own exposure"):
            p.tgt.prepare("WRITE", [(seg, 4096, region, 0)])
        kept = p.ini.prepare("WRITE", [(local, 4096, region, 0)])
        kept.run()
        assert len(gpupin.nixl._LIVE_DLISTS) == before + 2
        p.ini.close()  # the endpoint's close releases the lists of a Prepared still open
        assert len(gpupin.nixl._LIVE_DLISTS) == before
        with pytest.raises(gpupin.InvalidArgument, match="closed"):
            kept.run()
    finally:
        p.close()


def test_a_prepared_transfer_left_to_the_collector_is_released_outside_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Prepared dropped unclosed inside a reference cycle: its lists are released by reap(),
    never from the garbage collector (a NIXL call there may meet the thread's own NIXL call)."""
    import gc

    calls: list[bool] = []
    drop = gpupin.nixl._Prep.drop

    def spy(self: Any, **kw: bool) -> None:
        calls.append(gpupin.nixl.collecting())
        drop(self, **kw)

    monkeypatch.setattr(gpupin.nixl._Prep, "drop", spy)
    p = Pair(auto_progress=True)
    try:
        before = len(gpupin.nixl._LIVE_DLISTS)
        seg, local = p.mt.alloc(MiB), p.mi.alloc(MiB)
        region = p.tgt.expose(seg, MiB)
        for _ in range(5):
            prep = p.ini.prepare("WRITE", [(local, 4096, region, 0)])
            prep.run()
            prep.cycle = prep  # type: ignore[attr-defined] - only the collector frees it
            del prep
            gc.collect()
        # Each earlier one was released by the next post's reap(); the last waits for one.
        assert len(gpupin.nixl._LIVE_DLISTS) == before + 2
        gpupin.nixl.reap()
        assert len(gpupin.nixl._LIVE_DLISTS) == before
        assert calls and not any(calls), "a list was released from the garbage collector"
        assert not p.ini._preps
    finally:
        p.close()


def _hold_at_reload(ep: NixlEndpoint, thread_name: str) -> tuple[threading.Event, threading.Event]:
    """Hold the thread named ``thread_name`` at the entry of ``ep._reload`` (once): a scheduling
    delay of that thread, the real _reload running afterwards as the endpoint called it.
    Returns (reached, go)."""
    real, reached, go = ep._reload, threading.Event(), threading.Event()

    def hook(*a: Any, **k: Any) -> Any:
        if threading.current_thread().name == thread_name and not reached.is_set():
            reached.set()
            go.wait(30)
        return real(*a, **k)

    ep._reload = hook  # type: ignore[method-assign]
    return reached, go


def _writer(name: str, write: Any, errors: list[str]) -> threading.Thread:
    def run() -> None:
        try:
            write()
        except Exception as exc:  # noqa: BLE001 - the test reads them
            errors.append(repr(exc))

    t = threading.Thread(name=name, target=run)
    t.start()
    return t


def test_a_load_decided_before_another_threads_renewal_never_brings_a_dropped_registration_back() -> None:
    """Thread A's load of a descriptor's metadata (as old as the view: nothing to renew) was
    decided in one hold of the lock and made in a later one; thread B renewed the view in
    between (the target had dropped registration R and reused its memory), and A's metadata,
    naming R, went on top of the renewed view, which was recorded as clean: the next write into
    the reused memory was posted through a view holding R.  A load now decides in the hold that
    loads.  (Thread A is held at the load's entry; the target's own actions come meanwhile.)"""
    kib = 1024
    p = Pair(auto_progress=True)
    try:
        peer = p.tgt.name
        src = p.mi.alloc(MiB)
        a = p.mt.alloc(256 * kib)
        ra = p.tgt.expose(a, 256 * kib)  # registration R
        p.ini.write(src, 4096, ra)  # the view: (0, ...), R in it
        rr1 = p.tgt.expose(p.mt.alloc(64 * kib), 64 * kib)  # its metadata names R
        reached, go = _hold_at_reload(p.ini, "A")
        errors: list[str] = []
        ta = _writer("A", lambda: p.ini.write(src, 4096, rr1, timeout=20), errors)
        assert reached.wait(30)
        p.tgt.unexpose(ra)
        p.mt.free(a)
        b = p.mt.alloc(128 * kib)
        assert b == a
        rb = p.tgt.expose(b, 128 * kib)  # R dropped first
        _writer("B", lambda: p.ini.write(src + 8192, 4096, rb, timeout=20), errors).join()
        probe = dataclasses.replace(rb, addr=a, size=256 * kib)  # only R's own descriptor covers it
        assert deregistered_through_nixl(p.ini, src, 256 * kib, probe)  # B's renewal dropped R
        go.set()
        ta.join()
        del p.ini._reload
        assert not errors, errors
        assert deregistered_through_nixl(p.ini, src, 256 * kib, probe), "A's load brought R back"
        p.ini.write(src, 4096, rb, 4096)
        assert deregistered_through_nixl(p.ini, src, 256 * kib, probe)
        assert p.ini._views[peer][0] == p.tgt.driver.deregistrations
    finally:
        p.close()


def test_an_older_renewal_never_replaces_a_newer_one() -> None:
    """Thread B1's renewal had the target's metadata (naming registration R) when thread B2's,
    asked for after the target dropped R and reused its memory, replaced the view; B1 then
    replaced B2's view with its older metadata, recorded below B2's held lease, and B2's next
    write was posted through it (R back, B's own registration missing).  A renewal now keeps a
    newer view, and a held lease granted past its view's record loads the current metadata
    before it posts.  (B1 is held at its load's entry.)"""
    kib = 1024
    p = Pair(auto_progress=True)
    try:
        peer = p.tgt.name
        src = p.mi.alloc(MiB)
        r0 = p.tgt.expose(p.mt.alloc(64 * kib), 64 * kib)
        a = p.mt.alloc(256 * kib)
        ra = p.tgt.expose(a, 256 * kib)  # registration R
        p.ini.write(src, 4096, r0)  # the view: (0, ...)
        x = p.mt.alloc(64 * kib)
        rx = p.tgt.expose(x, 64 * kib)
        p.tgt.unexpose(rx)
        p.mt.free(x)  # a drop: the next grant renews the view
        rr1 = p.tgt.expose(p.mt.alloc(64 * kib), 64 * kib)
        reached, go = _hold_at_reload(p.ini, "B1")
        errors: list[str] = []
        t1 = _writer("B1", lambda: p.ini.write(src, 4096, rr1, timeout=20), errors)
        assert reached.wait(30)  # B1 holds the metadata answer (naming R)
        p.tgt.unexpose(ra)
        p.mt.free(a)
        b = p.mt.alloc(128 * kib)
        assert b == a
        rb = p.tgt.expose(b, 128 * kib)
        _writer("B2", lambda: p.ini.write(src + 8192, 4096, rb, timeout=20), errors).join()
        probe = dataclasses.replace(rb, addr=a, size=256 * kib)
        newer = p.ini._views[peer][0]
        assert deregistered_through_nixl(p.ini, src, 256 * kib, probe)
        go.set()
        t1.join()
        del p.ini._reload
        assert not errors, errors
        assert p.ini._views[peer][0] == newer, "an older renewal replaced the newer view"
        assert deregistered_through_nixl(p.ini, src, 256 * kib, probe), "R is back in NIXL's view"
        p.mt.write(b, bytes(128 * kib))
        p.mi.write(src, b"\x5a" * 4096)
        p.ini.write(src, 4096, rb, 4096)
        assert p.mt.read(b + 4096, 4096) == b"\x5a" * 4096
        assert deregistered_through_nixl(p.ini, src, 256 * kib, probe)
    finally:
        p.close()


def test_old_descriptors_of_live_exposures_need_no_renewal() -> None:
    """Blocks of a pool exposed long ago (their descriptors older than the target's last drop)
    each cost a renewal (a metadata round trip, NIXL's connection to the peer dropped and made
    again) though the view, taken after that drop, held their registrations already."""
    p = Pair(auto_progress=True)
    try:
        src = p.mi.alloc(MiB)
        blocks = [p.tgt.expose(p.mt.alloc(64 << 10), 64 << 10) for _ in range(4)]
        x = p.mt.alloc(MiB)
        rx = p.tgt.expose(x, MiB)
        p.ini.write(src, 4096, rx)
        p.tgt.unexpose(rx)
        p.mt.free(x)  # a drop after the blocks were exposed
        p.ini.write(src, 4096, p.tgt.expose(p.mt.alloc(MiB), MiB))  # renews the view
        renewals = p.ini.renewals
        for i, rb in enumerate(blocks):
            p.mi.write(src, bytes([i + 1]) * 4096)
            p.ini.write(src, 4096, rb)
            assert p.mt.read(rb.addr, 4096) == bytes([i + 1]) * 4096
        assert p.ini.renewals == renewals, "an old descriptor of a live exposure renewed the view"
    finally:
        p.close()


@contextlib.contextmanager
def _initiator_with_targets(*, auto_progress: bool = True) -> Iterator[tuple[NixlEndpoint, HostMemory, int, Any]]:
    """An initiator endpoint (its memory and a 1 MiB source buffer) and ``target()``, which
    starts a target process of agent name "target" (a restart under its name, when called
    again); every target is killed and the endpoint closed however the test ends."""
    mem = HostMemory(16 << 20)
    e = NixlEndpoint("initiator", mem, mem_type="DRAM", auto_progress=auto_progress)
    targets: list[Target] = []

    def target() -> Target:
        targets.append(Target("host"))
        return targets[-1]

    try:
        yield e, mem, mem.alloc(MiB), target
    finally:
        for t in targets:
            t.kill()  # (a stopped one too: SIGKILL)
        with warnings.catch_warnings():  # the targets are dead: they hear no lease drop
            warnings.simplefilter("ignore", RuntimeWarning)
            e.close(timeout=0.5)
        mem.close()


def test_a_forgotten_peers_old_descriptor_never_retires_its_restarted_incarnation() -> None:
    """forget_peer() forgot the peer's incarnation too; after the peer restarted under its name
    and was reached again, one use of a descriptor of the dead incarnation was taken for a
    restart: the live incarnation's view and leases were forgotten without a drop and it was
    retired for good (every later descriptor of it refused, its unexpose() waiting for drops
    that never came).  The old descriptor is refused now, and the live peer goes on."""
    with _initiator_with_targets() as (e, mem, src, target):
        t1 = target()
        t1.call("connect", e.metadata())
        rb1 = RemoteBufferOf(t1, t1.call("alloc", MiB), MiB)
        e.write(src, 4096, rb1, timeout=10)
        t1.kill()
        e.forget_peer("target")  # the peer is dead: as the docs ask
        t2 = target()
        t2.call("connect", e.metadata())
        rb2 = RemoteBufferOf(t2, t2.call("alloc", MiB), MiB)
        e.write(src, 4096, rb2, timeout=10)
        with pytest.raises(StaleRemote, match="not the one it runs"):
            e.write(src, 4096, rb1, timeout=3)
        assert e._lease_state("target", rb2.xid) == "held"
        t2.call("unexpose", rb2.to_bytes(), 5.0)  # the live initiator gives its lease back
        e.write(src, 4096, RemoteBufferOf(t2, t2.call("alloc", MiB), MiB), timeout=10)


def test_a_transfer_failed_part_way_leaves_no_view_trusted_that_nixl_kept() -> None:
    """A scatter transfer NIXL failed after posting part of it was taken for an erasure of
    NIXL's view of the peer (only a disconnect or NOT_FOUND erases it): the next exposure looked
    like a first contact, its metadata went on top of the view NIXL kept, which held a
    registration the target had dropped meanwhile, and the view was recorded clean.  Now that
    view is kept untrusted: the next load renews it."""
    import nixl_cu13._bindings as bind

    kib = 1024
    p = Pair(auto_progress=True)
    try:
        src = p.mi.alloc(MiB)
        a = p.mt.alloc(256 * kib)
        ra = p.tgt.expose(a, 256 * kib)  # registration R
        re_ = p.tgt.expose(p.mt.alloc(MiB), MiB)
        p.ini.write(src, 4096, ra)
        p.ini.write(src, 4096, re_)
        agent = p.ini.agent
        real = type(agent).transfer
        ref = weakref.ref(agent)

        def fails_after_posting(h: Any, *a: Any) -> str:
            real(ref(), h, *a)
            raise bind.nixlBackendError("NIXL_ERR_BACKEND")

        agent.transfer = fails_after_posting
        try:
            with pytest.raises(NixlError, match="failed after NIXL posted part of it"):
                p.ini.write_blocks([(src, 4096, re_, 0), (src + 8192, 4096, re_, 8192)])
        finally:
            del agent.transfer
        p.tgt.unexpose(ra)
        p.mt.free(a)
        b = p.mt.alloc(128 * kib)
        assert b == a
        rb = p.tgt.expose(b, 128 * kib)  # R dropped first
        probe = dataclasses.replace(rb, addr=a, size=256 * kib)  # only R's own descriptor covers it
        p.ini.write(src, 4096, rb)
        assert deregistered_through_nixl(p.ini, src, 256 * kib, probe), "R is still in NIXL's view"
        p.ini.forget_peer(p.tgt.name)
        p.tgt.forget_peer(p.ini.name)
    finally:
        p.close()


def test_threads_meeting_a_restarted_peer_at_once_take_it_for_one_restart() -> None:
    """The target restarts under its name and two threads write into new descriptors at once.
    The incarnation check ran outside the endpoint's lock: both threads took the new one for a
    restart, and the second retired the live incarnation (every later descriptor of it refused
    for the endpoint's life).  Now the check and its update are one step under the lock.  (The
    first thread to forget the old incarnation is delayed there for 0.2 s.)"""
    with _initiator_with_targets(auto_progress=False) as (e, mem, src, target):
        t1 = target()
        t1.call("connect", e.metadata())
        e.write(src, 4096, RemoteBufferOf(t1, t1.call("alloc", MiB), MiB), timeout=10)
        t1.kill()  # restarts under its name
        t2 = target()
        t2.call("connect", e.metadata())
        ra, rb = (RemoteBufferOf(t2, t2.call("alloc", MiB), MiB) for _ in range(2))
        real, calls = e._new_incarnation, []

        def slow_first(peer: str) -> None:
            calls.append(peer)
            if len(calls) == 1:
                time.sleep(0.2)
            real(peer)

        e._new_incarnation = slow_first  # type: ignore[method-assign]
        errors: list[str] = []
        threads = [_writer("A", lambda: e.write(src, 4096, ra, timeout=10), errors)]
        time.sleep(0.05)
        threads.append(_writer("B", lambda: e.write(src, 4096, rb, timeout=10), errors))
        for t in threads:
            t.join()
        del e._new_incarnation
        assert not errors, errors
        assert ra.incarnation not in e._retired.get("target", ()), "the live incarnation was retired"
        assert len(calls) == 1
        e.write(src, 4096, RemoteBufferOf(t2, t2.call("alloc", MiB), MiB), timeout=10)


def test_a_descriptor_of_an_earlier_incarnation_met_after_a_later_one_is_refused() -> None:
    """A descriptor received before the target restarted and used after the initiator met the
    restarted one: incarnations have no order, and the old one was taken for a restart: the live
    incarnation's view and leases were forgotten without a drop and it was retired for good.
    Now the live peer says which incarnation it runs: the old one is refused, the live peer goes
    on."""
    with _initiator_with_targets() as (e, mem, src, target):
        t1 = target()
        t1.call("connect", e.metadata())
        rb1 = RemoteBufferOf(t1, t1.call("alloc", MiB), MiB)  # received, not used yet
        t1.kill()  # restarts under its name
        t2 = target()
        t2.call("connect", e.metadata())
        rb2 = RemoteBufferOf(t2, t2.call("alloc", MiB), MiB)
        e.write(src, 4096, rb2, timeout=10)
        with pytest.raises(StaleRemote, match="not the one it runs"):
            e.write(src, 4096, rb1, timeout=3)
        assert e._lease_state("target", rb2.xid) == "held"
        t2.call("unexpose", rb2.to_bytes(), 5.0)  # the live initiator gives its lease back
        e.write(src, 4096, RemoteBufferOf(t2, t2.call("alloc", MiB), MiB), timeout=10)


def test_a_warm_spare_made_before_the_primary_takes_over_its_name() -> None:
    """Two processes of one agent name, the spare started first: when the primary dies, the
    spare's descriptors are the peer's (whatever the order their incarnations were made in):
    NIXL cannot reach the primary any more, so the initiator takes the spare for a restart."""
    with _initiator_with_targets() as (e, mem, src, target):
        spare = target()
        primary = target()
        rs = RemoteBufferOf(spare, spare.call("alloc", MiB), MiB)  # made first, not used yet
        primary.call("connect", e.metadata())
        rp = RemoteBufferOf(primary, primary.call("alloc", MiB), MiB)
        e.write(src, 4096, rp, timeout=10)
        primary.kill()
        spare.call("connect", e.metadata())
        mem.write(src, b"\x77" * 4096)
        e.write(src, 4096, rs, timeout=10)
        assert spare.call("read", rs.addr, 4096) == b"\x77" * 4096
        assert rp.incarnation in e._retired["target"]


def test_a_live_peer_that_does_not_say_its_incarnation_changes_nothing() -> None:
    """A descriptor of another incarnation while the one this endpoint talks to is alive but not
    taking notifications: no answer, so neither a restart nor a refusal: NixlError, and the
    endpoint keeps what it had."""
    p = Pair(auto_progress=True)
    try:
        src = p.mi.alloc(MiB)
        ra = p.tgt.expose(p.mt.alloc(MiB), MiB)
        p.ini.write(src, 4096, ra)
        p.stop.set()
        p.pump.join()  # the target stops answering
        other = dataclasses.replace(ra, incarnation=ra.incarnation + 1, xid=ra.xid + 2)
        with pytest.raises(NixlError, match="does not say which it runs"):
            p.ini.write(src, 4096, other, timeout=0.5)
        assert p.ini._incarnations[p.tgt.name] == ra.incarnation and not p.ini._retired.get(p.tgt.name)
        assert p.ini._lease_state(p.tgt.name, ra.xid) == "held"
        p.serve_again()  # (its agent moves the bytes over TCP only while progressed)
        p.ini.write(src, 4096, ra)
    finally:
        p.close()


def test_a_silent_peer_forgotten_lets_its_restart_in() -> None:
    """The incarnation the initiator talks to stops answering without refusing connections (a
    stopped process, a host cut off): a descriptor of another incarnation cannot be decided on
    (NixlError, nothing changed); once the application forgets the peer (it can transfer no
    more), the other incarnation is its restart.  The initiator went on trying to reach the
    forgotten one from its stored metadata, and the replacement was refused for good."""
    import signal

    with _initiator_with_targets() as (e, mem, src, target):
        t1 = target()
        t1.call("connect", e.metadata())
        e.write(src, 4096, RemoteBufferOf(t1, t1.call("alloc", MiB), MiB), timeout=10)
        t1.proc.send_signal(signal.SIGSTOP)  # silent, its connections still accepted by the kernel
        t2 = target()
        t2.call("connect", e.metadata())
        rb2 = RemoteBufferOf(t2, t2.call("alloc", MiB), MiB)
        with pytest.raises(NixlError, match="does not say which it runs"):
            e.write(src, 4096, rb2, timeout=1)
        with warnings.catch_warnings():  # the stopped target hears no drop
            warnings.simplefilter("ignore", RuntimeWarning)
            e.forget_peer("target", timeout=0.2)
        e.write(src, 4096, rb2, timeout=10)


def test_a_pipelined_writer_does_not_starve_a_load_of_its_peer() -> None:
    """One thread keeps three transfers in flight to a target, each taking 10 ms of one link
    (NIXL says PROC until 10 ms after the one before it ended: a bandwidth-bound transfer;
    DRAM copies here end before Python posts the next one).  Another thread's first write into
    a new allocation of that target must load the target's metadata, which waits for a moment
    with no transfer running: new transfers now wait for the load, so it comes.  Before, none
    came while the pipeline ran: InUse at the write's timeout, however long."""
    import collections

    p = Pair()
    stop = threading.Event()
    errors: list[BaseException] = []
    agent = p.ini.agent
    cls, ref = type(agent), weakref.ref(agent)
    ends: dict[int, float] = {}
    link = [0.0]

    def transfer(h: Any, *a: Any) -> str:
        state = cls.transfer(ref(), h, *a)
        link[0] = max(link[0], time.monotonic()) + 0.010
        ends[id(h)] = link[0]
        return "PROC" if state in ("PROC", "DONE") else state

    def check(h: Any) -> str:
        state = cls.check_xfer_state(ref(), h)
        return "PROC" if state in ("PROC", "DONE") and time.monotonic() < ends.get(id(h), 0.0) else state

    def pipeline() -> None:
        q: collections.deque[Any] = collections.deque()
        try:
            while not stop.is_set():
                while len(q) < 3:
                    q.append(p.ini.post_write([(src, 4096, rb, 0)]))
                q.popleft().wait(10)
            while q:
                q.popleft().wait(10)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    try:
        rb = p.tgt.expose(p.mt.alloc(2 * MiB), 2 * MiB)
        src = p.mi.alloc(2 * MiB)
        p.ini.write(src, 4096, rb, timeout=10)  # lease held, view loaded
        agent.transfer, agent.check_xfer_state = transfer, check
        th = threading.Thread(target=pipeline)
        th.start()
        time.sleep(0.2)
        rb2 = p.tgt.expose(p.mt.alloc(4 * MiB), 4 * MiB)  # a new allocation: new metadata
        src2 = p.mi.alloc(MiB)
        p.mi.write(src2, b"after the load" * 256)
        try:
            p.ini.write(src2, 3584, rb2, timeout=5)
        finally:
            stop.set()
            th.join()
        assert not errors, errors
        assert p.mt.read(rb2.addr, 3584) == b"after the load" * 256
    finally:
        stop.set()
        with contextlib.suppress(AttributeError):
            del agent.transfer, agent.check_xfer_state
        p.close()


def test_a_peer_forgotten_and_connected_again_is_not_retired_on_one_refused_send() -> None:
    """After forget_peer() and connect() of the same live process, NIXL's view of it is erased
    (a disconnect) and a descriptor of another incarnation comes: the endpoint connects to the
    one it talks to afresh, that one answers, and only the descriptor is refused.  The metadata
    for the fresh connection was gone since forget_peer(): the refused send (no connection) was
    taken for the live peer's death, and it was retired with its leases."""
    p = Pair(auto_progress=True)
    name = p.tgt.name
    try:
        src = p.mi.alloc(MiB)
        ra = p.tgt.expose(p.mt.alloc(MiB), MiB)
        p.ini.write(src, 4096, ra, timeout=10)
        p.ini.forget_peer(name, timeout=2)
        p.ini.connect(p.tgt.metadata())  # the same live process, reached again
        p.ini.write(src, 4096, ra, timeout=10)
        with p.ini._lock, p.ini.driver.lock:  # NIXL's view erased, as a disconnect does
            p.ini.agent.remove_remote_agent(name)
            p.ini._view_erased(name)
        other = dataclasses.replace(ra, incarnation=ra.incarnation ^ 1, xid=ra.xid + 2)
        with pytest.raises(StaleRemote, match="not the one it runs"):
            p.ini.write(src, 4096, other, timeout=5)
        assert ra.incarnation not in p.ini._retired.get(name, ())
        p.mi.write(src, b"\x5a" * 4096)
        p.ini.write(src, 4096, ra, timeout=10)  # the live one, still reached
        assert p.mt.read(ra.addr, 4096) == b"\x5a" * 4096
    finally:
        p.tgt.forget_peer(p.ini.name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            p.close()


def test_no_transfer_starts_once_forget_peer_marked_the_peer() -> None:
    """forget_peer() marks the peer, lets the endpoint's lock go and takes it again; a one-block
    write on a held lease in between is refused (NixlError), not posted."""
    p = Pair(auto_progress=True)
    try:
        src = p.mi.alloc(MiB)
        ra = p.tgt.expose(p.mt.alloc(MiB), MiB)
        p.ini.write(src, 4096, ra, timeout=10)
        inside, go = threading.Event(), threading.Event()
        real = p.ini._forget_peer

        def paused(peer: str, timeout: float) -> None:
            inside.set()
            go.wait(5)  # (preempted right after the mark)
            real(peer, timeout)

        p.ini._forget_peer = paused  # type: ignore[method-assign]
        th = threading.Thread(target=lambda: p.ini.forget_peer(p.tgt.name, timeout=2))
        th.start()
        try:
            assert inside.wait(5)
            transfers = p.ini.transfers
            with pytest.raises(NixlError, match="forget_peer.*runs; nothing was sent"):
                p.ini.write(src, 4096, ra, timeout=5)
            assert p.ini.transfers == transfers
        finally:
            go.set()
            th.join()
            del p.ini._forget_peer
    finally:
        p.tgt.forget_peer(p.ini.name)
        p.close()


def test_a_crash_looping_target_is_reached_once_an_incarnation_runs() -> None:
    """The target crash-loops: its first process dies and the application forgets it; the
    second publishes a descriptor and dies too (its write fails: NIXL cannot connect); the
    third runs.  A write into the third's buffer succeeds within its timeout.  The peer stayed
    marked forgotten after the second was adopted, so asking the second which one runs was
    refused and asked again at once, for ever: the write never returned."""
    import threading

    with _initiator_with_targets() as (e, mem, src, target):
        t1 = target()
        t1.call("connect", e.metadata())
        e.write(src, 4096, RemoteBufferOf(t1, t1.call("alloc", MiB), MiB), timeout=10)
        t1.kill()
        e.forget_peer("target", timeout=0.5)
        t2 = target()
        t2.call("connect", e.metadata())
        rb2 = RemoteBufferOf(t2, t2.call("alloc", MiB), MiB)
        t2.kill()
        with pytest.raises(NixlError):
            e.write(src, 4096, rb2, timeout=2)
        t3 = target()
        t3.call("connect", e.metadata())
        rb3 = RemoteBufferOf(t3, t3.call("alloc", MiB), MiB)
        mem.write(src, b"third" * 800)
        got: list[BaseException | None] = []

        def write() -> None:
            try:
                e.write(src, 4000, rb3, timeout=5)
                got.append(None)
            except BaseException as exc:  # noqa: BLE001 - reported below
                got.append(exc)

        th = threading.Thread(target=write, daemon=True)
        th.start()
        th.join(20)
        assert not th.is_alive(), "write(timeout=5) into the live third incarnation still runs after 20 s"
        assert got == [None], got
        assert t3.call("read", rb3.addr, 4000) == b"third" * 800


def test_a_held_lease_of_a_dead_incarnation_never_writes_through_its_restart() -> None:
    """The target dies while the initiator holds a lease on one of its exposures; a transfer
    meets the disconnect (NIXL erases its view of the peer: invalidateRemoteData; the endpoint
    keeps the lease, which the same incarnation granted).  The target restarts under its name,
    the application connects the new process, which puts the memory at the old exposure's
    address to other use.  A write with the old descriptor took the held lease as good, asked
    the name for its current metadata (the new process answered) and wrote into that memory.
    Now the answer says which incarnation gave it: the old descriptor is refused, nothing
    lands.  (One process plays both incarnations, so that the second can own the first one's
    memory; the disconnect is what the endpoint does on nixlRemoteDisconnectError.)"""
    mt, mi = HostMemory(16 << 20), HostMemory(16 << 20)
    ini = NixlEndpoint("initiator", mi, mem_type="DRAM", auto_progress=True)
    old = NixlEndpoint("target", mt, mem_type="DRAM")
    new: NixlEndpoint | None = None
    stops: list[tuple[threading.Event, threading.Thread]] = []

    def serve(ep: NixlEndpoint) -> None:
        stop = threading.Event()
        t = threading.Thread(target=lambda: ep.serve(60, stop.is_set))
        t.start()
        stops.append((stop, t))

    try:
        serve(old)
        ini.connect(old.metadata())
        old.connect(ini.metadata())
        a, src = mt.alloc(MiB), mi.alloc(MiB)
        r_old = old.expose(a, MiB)
        ini.write(src, 4096, r_old, timeout=10)
        assert ini._lease_state("target", r_old.xid) == "held"
        stops[0][0].set()
        stops[0][1].join()  # the old incarnation dies (no revocation)
        with ini._lock, ini.driver.lock:
            ini.agent.remove_remote_agent("target")
            ini._view_erased("target")
        for ex in list(old._exposures.values()):  # (dead: what it held goes, with no word)
            ex.revoked = True
            ex.holders.clear()
            old._finish_if_settled(ex)
        old._by_range.clear()
        new = NixlEndpoint("target", mt, mem_type="DRAM")
        serve(new)
        new.connect(ini.metadata())
        ini.connect(new.metadata())  # the application reaches the restarted peer
        new.unexpose(new.expose(a, MiB, epoch=7))  # the memory is the new process's, used and let go
        mt.write(a, bytes(4096))
        mi.write(src, b"\xee" * 4096)
        with pytest.raises(StaleRemote, match="no longer answers under its name"):
            ini.write(src, 4096, r_old, timeout=5)
        assert mt.read(a, 4096) == bytes(4096), "the old incarnation's lease wrote into the new one's memory"
        assert ini._incarnations["target"] == new.incarnation
        r_new = new.expose(a, MiB, epoch=8)
        ini.write(src, 4096, r_new, timeout=10)  # the live incarnation goes on
        assert mt.read(a, 4096) == b"\xee" * 4096
    finally:
        for stop, t in stops:
            stop.set()
            t.join()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            for ep in (ini, new, old):
                if ep is not None:
                    ep.close(timeout=0.5)
        mi.close()
        mt.close()


def test_a_warm_spare_refused_while_the_primary_runs_is_taken_once_it_dies() -> None:
    """A descriptor of a warm spare used while the primary still runs is refused (the name
    reaches the primary); the spare's incarnation was then refused for the endpoint's life,
    also once the primary died and the spare took the name over.  Now it is asked about again."""
    with _initiator_with_targets() as (e, mem, src, target):
        spare = target()
        primary = target()
        primary.call("connect", e.metadata())
        spare.call("connect", e.metadata())
        rp = RemoteBufferOf(primary, primary.call("alloc", MiB), MiB)
        rs = RemoteBufferOf(spare, spare.call("alloc", MiB), MiB)
        e.write(src, 4096, rp, timeout=10)
        with pytest.raises(StaleRemote, match="not the one it runs"):
            e.write(src, 4096, rs, timeout=3)
        primary.kill()
        mem.write(src, b"\x5a" * 4096)
        e.write(src, 4096, rs, timeout=10)
        assert spare.call("read", rs.addr, 4096) == b"\x5a" * 4096


def test_a_dead_incarnation_that_takes_the_question_is_found_by_asking_again() -> None:
    """Between hosts, UCX makes a connection to a dead process without reaching it, and takes
    the first notification (queued; its failure comes later): the initiator waited for an
    answer to its one question until the transfer's timeout, on every transfer with the
    restarted peer.  Now the question is sent again while unanswered, and the refused send that
    follows (after a fresh connection) is the dead incarnation's.  Modelled on one host: the
    connection to the dead process is made without contacting it, its first notification is
    taken and lost, the later ones are refused as UCX refuses them once the endpoint failed."""
    import nixl_cu13._bindings as bind

    from gpupin.nixl import _PREFIX, _WHO

    WHO = _PREFIX + _WHO
    with _initiator_with_targets() as (e, mem, src, target):
        t1 = target()
        t1.call("connect", e.metadata())
        rb1 = RemoteBufferOf(t1, t1.call("alloc", MiB), MiB)
        e.write(src, 4096, rb1, timeout=10)
        t1.kill()
        t2 = target()
        t2.call("connect", e.metadata())
        rb2 = RemoteBufferOf(t2, t2.call("alloc", MiB), MiB)
        agent = e.agent
        cls = type(agent)
        ref = weakref.ref(agent)
        sends: list[bytes] = []

        def add(md: bytes) -> Any:
            if md == rb1.metadata:  # the dead one's: a connection that reaches nobody yet
                return b"target"
            return cls.add_remote_agent(ref(), md)

        def send(peer: str, msg: bytes) -> None:
            if msg.startswith(WHO):  # the incarnation question, to the dead one
                sends.append(msg)
                if len(sends) > 1:
                    raise bind.nixlRemoteDisconnectError("NIXL_ERR_REMOTE_DISCONNECT")
                return  # taken, never arrives
            cls.send_notif(ref(), peer, msg)

        with e._lock, e.driver.lock:  # the dead one's connection broke: NIXL forgot it
            cls.remove_remote_agent(agent, "target")
            e._connected.discard("target")
            e._views.pop("target", None)
        agent.add_remote_agent = add
        agent.send_notif = send
        try:
            start = time.monotonic()
            e.write(src, 4096, rb2, timeout=10)
            took = time.monotonic() - start
        finally:
            del agent.add_remote_agent, agent.send_notif
        assert len(sends) == 2 and took < 5, (sends, took)
        assert e._incarnations["target"] == rb2.incarnation


def test_loads_of_other_peers_leave_a_dead_incarnation_to_be_found() -> None:
    """A refused question counts against a peer only over a connection made afresh that no
    change of NIXL's view came after; that rule compared one serial shared by every peer, so
    an initiator loading other peers all the time (a decode worker meeting its prefill peers'
    new exposures) never found a dead incarnation dead, and every write into the restarted
    peer failed at its timeout.  Modelled as in the test above: a send within 3 ms of the
    fresh connection to the dead one is taken and lost, later ones are refused; a third
    endpoint is connected every 2 ms meanwhile.  The write reaches the live spare."""
    import nixl_cu13._bindings as bind

    from gpupin.nixl import _PREFIX, _WHO

    WHO = _PREFIX + _WHO
    p = Pair(auto_progress=True)
    name = p.tgt.name
    ms, mo = HostMemory(8 << 20), HostMemory(4 << 20)
    spare = NixlEndpoint(name, ms, mem_type="DRAM")
    other = NixlEndpoint("t-other", mo, mem_type="DRAM")
    stop, sstop = threading.Event(), threading.Event()
    server = threading.Thread(target=lambda: spare.serve(120, sstop.is_set))
    errors: list[str] = []
    try:
        src = p.mi.alloc(MiB)
        ra = p.tgt.expose(p.mt.alloc(MiB), MiB)
        p.ini.write(src, 4096, ra, timeout=10)
        spare.connect(p.ini.metadata())
        rs = spare.expose(ms.alloc(MiB), MiB)
        server.start()
        agent = p.ini.agent
        cls, ref = type(agent), weakref.ref(agent)
        made = [0.0]

        def add(md: bytes) -> Any:
            if md == ra.metadata:  # the dead primary's: a connection that reaches nobody yet
                made[0] = time.monotonic()
                return name.encode()
            return cls.add_remote_agent(ref(), md)

        def send(peer: str, msg: bytes) -> None:
            if msg.startswith(WHO):
                if time.monotonic() - made[0] < 0.003:
                    return  # taken, never arrives
                raise bind.nixlRemoteDisconnectError("NIXL_ERR_REMOTE_DISCONNECT")
            cls.send_notif(ref(), peer, msg)

        with p.ini._lock, p.ini.driver.lock:  # the primary's connection broke: NIXL forgot it
            cls.remove_remote_agent(agent, name)
            p.ini._connected.discard(name)
            p.ini._views.pop(name, None)
        agent.add_remote_agent, agent.send_notif = add, send

        def loads() -> None:
            while not stop.is_set():
                p.ini.connect(other.metadata())
                time.sleep(0.002)

        loader = _writer("loads", loads, errors)
        try:
            p.ini.write(src, 4096, rs, timeout=5)
        finally:
            stop.set()
            loader.join()
            del agent.add_remote_agent, agent.send_notif
        assert not errors, errors
        assert p.ini._incarnations[name] == rs.incarnation
    finally:
        stop.set()
        sstop.set()
        if server.is_alive():
            server.join()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            # The primary, taken for dead, never got its lease back: it forgets the initiator.
            p.tgt.forget_peer(p.ini.name, timeout=0.1)
            p.close()
            spare.close(timeout=0.5)
            other.close(timeout=0.5)
            ms.close()
            mo.close()


def test_no_lease_is_asked_for_while_forget_peer_waits_for_its_drops() -> None:
    """forget_peer() lets go of the lock while it waits for the peer to acknowledge its drops;
    another thread's transfer asked for a new lease meanwhile, which the forget then deleted
    without a drop (the target's unexpose waiting for it in vain) or refused the forget half
    done.  Now no transfer with the peer starts while it is being forgotten."""
    p = Pair(auto_progress=True)
    try:
        src = p.mi.alloc(MiB)
        ra = p.tgt.expose(p.mt.alloc(MiB), MiB)
        rb = p.tgt.expose(p.mt.alloc(MiB), MiB)
        p.ini.write(src, 4096, ra)
        p.stop.set()
        p.pump.join()  # the target takes no notification: the drop is not acknowledged
        errors: list[str] = []
        forget = _writer("forget", lambda: p.ini.forget_peer(p.tgt.name, timeout=1.5), errors)
        time.sleep(0.3)
        with pytest.raises(NixlError, match="forget_peer.*runs; nothing was sent"):
            p.ini.write(src, 4096, rb, timeout=0.5)
        forget.join()
        assert not errors, errors
        assert not any(k[0] == p.tgt.name for k in p.ini._leases)
        p.serve_again()
        p.tgt.forget_peer(p.ini.name)
        p.ini.connect(p.tgt.metadata())
        p.tgt.connect(p.ini.metadata())
        p.ini.write(src, 4096, rb, timeout=10)  # reached again once forgotten
    finally:
        p.close()


def test_a_live_peer_whose_metadata_nixl_refuses_is_not_taken_for_restarted() -> None:
    """Asking which incarnation runs may need a fresh connection to the current one; NIXL
    refusing its metadata (NOT_ALLOWED: it says nothing of the process, e.g. a VRAM peer NIXL
    will not load again) was taken for the process being gone: the live incarnation was retired
    and its leases forgotten without a drop.  Now only a connection NIXL's backend cannot make
    counts; the refusal is raised and nothing changes."""
    import nixl_cu13._bindings as bind

    from gpupin.nixl import _PREFIX, _WHO

    WHO = _PREFIX + _WHO
    p = Pair(auto_progress=True)
    try:
        src = p.mi.alloc(MiB)
        ra = p.tgt.expose(p.mt.alloc(MiB), MiB)
        p.ini.write(src, 4096, ra)
        agent = p.ini.agent
        cls = type(agent)
        ref = weakref.ref(agent)
        first = [True]

        def add(md: bytes) -> Any:
            raise bind.nixlNotAllowedError("NIXL_ERR_NOT_ALLOWED")

        def send(peer: str, msg: bytes) -> None:
            if msg.startswith(WHO) and first[0]:  # a broken connection: refused once
                first[0] = False
                raise bind.nixlRemoteDisconnectError("NIXL_ERR_REMOTE_DISCONNECT")
            cls.send_notif(ref(), peer, msg)

        other = dataclasses.replace(ra, incarnation=ra.incarnation + 1, xid=ra.xid + 2)
        agent.add_remote_agent = add
        agent.send_notif = send
        try:
            with pytest.raises(NixlError, match="NIXL will not load") as got:
                p.ini.write(src, 4096, other, timeout=2)
        finally:
            del agent.add_remote_agent, agent.send_notif
        assert got.value.status == "nixlNotAllowedError"
        assert p.ini._incarnations[p.tgt.name] == ra.incarnation
        assert not p.ini._retired.get(p.tgt.name)
        p.ini.connect(p.tgt.metadata())
        p.ini.write(src, 4096, ra, timeout=10)  # the live incarnation goes on
    finally:
        p.close()


def test_a_live_peer_is_not_taken_for_gone_when_a_reload_races_the_question() -> None:
    """The primary runs and answers.  The application loaded a warm spare's metadata under the
    name (NIXL refuses it: NOT_ALLOWED; the endpoint no longer counts the primary connected).
    Thread A meets the spare's descriptor: it reconnects the primary afresh to ask which
    incarnation runs.  Thread B, holding a lease on the primary, finds the view record that
    A's fresh reconnect dropped and renews it (remove_remote_agent, then add_remote_agent,
    under _lock).  A sends its question with only the agent's lock: landing between B's
    remove and add, the send was refused, and A took the refusal "after a fresh connection"
    for the primary's death: the live primary was retired and its held leases forgotten without
    a drop.  Now the question is sent under the lock every view change takes, and a refusal
    counts only over the view A connected.  (B's window is widened to 0.3 s.)"""
    p = Pair(auto_progress=True)
    ms = HostMemory(16 << 20)
    spare = NixlEndpoint(p.tgt.name, ms, mem_type="DRAM")
    name = p.tgt.name
    try:
        src = p.mi.alloc(MiB)
        ra = p.tgt.expose(p.mt.alloc(MiB), MiB)
        p.ini.write(src, 4096, ra, timeout=10)
        rs = spare.expose(ms.alloc(MiB), MiB)
        with pytest.raises(NixlError):  # NOT_ALLOWED: NIXL keeps the primary's connection
            p.ini.connect(spare.metadata())
        assert name not in p.ini._connected
        in_window = threading.Event()
        real_remove = p.ini._remove_view
        real_reconnect = p.ini._reconnect_to_ask
        b_errors: list[BaseException] = []

        def remove_view(peer: str) -> None:
            real_remove(peer)
            if threading.current_thread().name == "B":
                in_window.set()
                time.sleep(0.3)  # between B's remove_remote_agent and its add_remote_agent

        def b() -> None:
            try:
                p.ini.write(src, 4096, ra, timeout=10)
            except BaseException as exc:  # noqa: BLE001
                b_errors.append(exc)

        tb = threading.Thread(target=b, name="B")
        real_ask = p.ini._ask_incarnation

        def reconnect_to_ask(peer: str, current: int, md: bytes, deadline: float) -> int:
            ok = real_reconnect(peer, current, md, deadline)
            if threading.current_thread().name == "A":
                tb.start()
                assert in_window.wait(5)
            return ok

        def ask_incarnation(peer: str, current: int, deadline: float) -> int | None:
            live = real_ask(peer, current, deadline)
            if threading.current_thread().name == "A" and tb.ident is not None:
                tb.join()  # B's 4 KiB write is over by now in practice (else A finds it running: NixlError)
            return live

        p.ini._ask_incarnation = ask_incarnation  # type: ignore[method-assign]

        p.ini._remove_view = remove_view  # type: ignore[method-assign]
        p.ini._reconnect_to_ask = reconnect_to_ask  # type: ignore[method-assign]
        got: list[str] = []
        _writer("A", lambda: p.ini.write(src, 4096, rs, timeout=5), got).join()
        time.sleep(0.5)
        del p.ini._remove_view, p.ini._reconnect_to_ask, p.ini._ask_incarnation
        print("A got:", got, "B got:", b_errors)
        retired = ra.incarnation in p.ini._retired.get(name, ())
        assert got and got[0].startswith("StaleRemote(") and "not the one it runs" in got[0], (
            f"the live primary was taken for restarted: A got {got!r}; primary retired: {retired}"
        )
        assert p.ini._incarnations[name] == ra.incarnation and not retired
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            try:
                p.close()  # (InUse when the primary's unexpose waits for the drop the retirement never sent)
            except Exception as exc:  # noqa: BLE001
                print("teardown:", type(exc).__name__, exc)
            finally:
                spare.close(timeout=0.5)
                ms.close()


def test_a_first_contact_after_an_erased_view_leaves_no_view_lacking_a_held_lease() -> None:
    """NIXL's view of the peer is gone with a lease still held (what the endpoint does on a
    lost transfer's NOT_FOUND or a refused load that erased the peer: _view_erased).  The next
    transfer goes into an exposure with no lease yet: no held lease of its own, so not
    "regained" but a first contact, and its descriptor's own metadata is loaded and recorded as
    the view.  That metadata predates the other exposure, whose lease is held: the post check
    (lease.dereg <= view dereg) passed, and every transfer into it failed in NIXL (NOT_FOUND),
    again and again, until something renewed the view.  Now any held lease of the peer makes the
    load the peer's current metadata."""
    p = Pair(auto_progress=True)
    try:
        x = p.tgt.expose(p.mt.alloc(MiB), MiB)  # its metadata lacks y's registration
        y = p.tgt.expose(p.mt.alloc(2 * MiB), 2 * MiB)
        src = p.mi.alloc(MiB)
        p.ini.write(src, 4096, y)
        name = p.tgt.name
        with p.ini._lock, p.ini.driver.lock:
            p.ini.agent.remove_remote_agent(name)
            p.ini._view_erased(name)
        p.ini.write(src, 4096, x, timeout=5)  # first contact: x's metadata alone
        fails = 0
        for _ in range(3):
            try:
                p.ini.write(src, 4096, y, timeout=5)
            except NixlError as exc:
                fails += 1
                last = exc
        assert fails == 0, f"{fails} of 3 writes into y failed: {last}"
    finally:
        p.close()


def test_a_grant_loaded_after_a_restart_was_met_is_asked_about_again() -> None:
    """A thread got its lease granted by the incarnation it knows, and before it loaded the
    registration another thread met a restart of the peer (the endpoint now talks to another
    incarnation, whose view it forgot).  The load went ahead: the old incarnation's metadata
    was recorded as the peer's view, and the name's connection led back to the old process.
    Now a load is made only for the incarnation the endpoint talks to: the thread asks again
    (here the old incarnation is in fact the live one, and says so)."""
    p = Pair(auto_progress=True)
    try:
        src = p.mi.alloc(MiB)
        ra = p.tgt.expose(p.mt.alloc(MiB), MiB)
        p.ini.write(src, 4096, ra)
        rb = p.tgt.expose(p.mt.alloc(MiB), MiB)
        name = p.tgt.name
        real, fired = p.ini._load_granted, []

        def restart_met_first(peer: str, r: RemoteBuffer, lease: Any, deadline: float) -> None:
            if not fired:  # what _meet_incarnation does on meeting another incarnation
                fired.append(1)
                with p.ini._lock:  # (not retired: the live one is asked about below)
                    p.ini._new_incarnation(peer)
                    p.ini._incarnations[peer] = ra.incarnation + 1
                    p.ini._inc_md[peer] = ra.metadata
            real(peer, r, lease, deadline)

        p.ini._load_granted = restart_met_first  # type: ignore[method-assign]
        try:
            p.ini.write(src, 4096, rb, timeout=10)
        finally:
            del p.ini._load_granted
        assert fired and p.ini._incarnations[name] == ra.incarnation
        assert p.ini._lease_state(name, rb.xid) == "held"
        p.tgt.forget_peer(p.ini.name)  # (the lease on ra the hook forgot gets no drop)
    finally:
        p.close()
