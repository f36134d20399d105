"""Allocation failures inside gpupin leave no partial state.

gpupin's test builds fail their own allocations through the kernel's
fault-injection framework where the kernel has it (/sys/kernel/debug/gpupin/
fail_alloc, and /proc/thread-self/fail-nth), else through the fail_alloc_nth
parameter (Debian's kernels).  Provider failures (-ENOMEM/-EIO/-EINVAL from
get_pages) are in test_limits.py.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable

import pytest

from conftest import GPU_PAGE, SLOW, first_pci_device
from gpupin import Device, EventsLost, GpupinError, SimMemory, sim_stats
from gpupin.netlink import Netlink
from gpupin.peer import Peer

pytestmark = [
    pytest.mark.vm,
    pytest.mark.simonly(
        reason="each injected failure is checked against the simulator's counters and the example peer driver's holds"
    ),
]

PARAM = "/sys/module/gpupin/parameters/fail_alloc_nth"
ATTR = "/sys/kernel/debug/gpupin/fail_alloc"
FAIL_NTH = "/proc/thread-self/fail-nth"


def scenario(peer: Peer, pci: str, log: list[str]) -> None:
    """Every gpupin call that allocates, in order; ``log`` gets the steps that completed."""
    with SimMemory() as sim:
        va = sim.alloc(4 * GPU_PAGE)
        sim.write(va, b"x" * 100)
        dev = Device()  # file + validity map
        log.append("open")
        try:
            pin = dev.pin(va, 4 * GPU_PAGE)  # pin + its invalidation record
            log.append("pin")
            with Netlink() as nl:  # each reply is a message gpupin allocates
                assert nl.get_pin(os.getpid(), pin.handle).handle == pin.handle
                log.append("nl_get_pin")
                assert nl.info()["pinned_bytes"] >= 4 * GPU_PAGE
                log.append("nl_info")
                assert nl.stats()
                log.append("nl_stats")
            m = dev.dma_map(pin, pci)  # mapping
            log.append("dma_map")
            assert len(dev.get_pages(pin)) == 4  # address buffer
            log.append("get_pages")
            assert len(dev.dma_addrs(m)) == 4  # address buffer
            log.append("dma_addrs")
            hold = peer.hold(dev, pin)  # driver reference (shares the mapping)
            log.append("hold")
            try:
                assert peer.read(dev, pin, 0, 100) == b"x" * 100  # another reference
                log.append("peer_read")
            finally:
                peer.release(hold)
            dev.dma_unmap(m)
            dev.unpin(pin)
            log.append("unpin")
        finally:
            dev.close()
        sim.free(va)


def scenario_dmabuf(peer: Peer, pci: str, log: list[str]) -> None:
    """The same for a dma-buf pin: the import, a peer's attachment and the address buffers."""
    with SimMemory() as sim:
        va = sim.alloc(4 * GPU_PAGE)
        fd = sim.export_dmabuf(va)
        try:
            dev = Device()
            log.append("open")
            try:
                pin = dev.pin_dmabuf(fd, pci=pci)  # pin + its record + the import's address array
                log.append("pin")
                m = dev.dma_map(pin, pci)  # mapping + its address array
                log.append("dma_map")
                assert len(dev.get_pages(pin)) == pin.entries
                log.append("get_pages")
                assert len(dev.dma_addrs(m)) == pin.entries
                log.append("dma_addrs")
                dev.dma_unmap(m)
                dev.unpin(pin)
                log.append("unpin")
            finally:
                dev.close()
        finally:
            os.close(fd)
        sim.free(va)


def _write(path: str, value: int) -> None:
    with open(path, "w") as f:
        f.write(str(value))


def _read(path: str) -> int:
    with open(path) as f:
        return int(f.read())


def framework() -> bool:
    """True where the module fails allocations through a fault_attr, False for the parameter."""
    has_attr, has_param = os.path.isdir(ATTR), os.path.exists(PARAM)
    assert has_attr != has_param, f"expected exactly one of {ATTR} and {PARAM}"
    if os.environ.get("GPUPIN_EXPECT_FAULT_ATTR") == "1":
        assert has_attr, "this kernel has CONFIG_FAULT_INJECTION_DEBUG_FS, but gpupin did not use it"
    return has_attr


def arm(n: int) -> None:
    """Fail gpupin's own nth allocation from now (any context), once; 0 disarms."""
    if not framework():
        _write(PARAM, n)
        return
    _write(f"{ATTR}/probability", 0)  # off while the others change
    if n:
        _write(f"{ATTR}/verbose", 0)
        _write(f"{ATTR}/interval", 1)
        _write(f"{ATTR}/times", 1)
        _write(f"{ATTR}/space", n)  # n - 1 allocations pass, the nth fails
        _write(f"{ATTR}/probability", 100)
    else:
        _write(f"{ATTR}/times", 0)
        _write(f"{ATTR}/space", 0)


def armed() -> bool:
    """True while the armed failure has not happened yet."""
    return _read(f"{ATTR}/times") > 0 if framework() else _read(PARAM) > 0


NVP2P_STEPS = [
    "open",
    "pin",
    "nl_get_pin",
    "nl_info",
    "nl_stats",
    "dma_map",
    "get_pages",
    "dma_addrs",
    "hold",
    "peer_read",
]


@pytest.mark.parametrize(
    "scenario,steps",
    [(scenario, NVP2P_STEPS), (scenario_dmabuf, ["open", "pin", "dma_map", "get_pages", "dma_addrs"])],
    ids=["nvp2p", "dmabuf"],
)
def test_every_own_allocation_failure_is_clean(
    peer: Peer, scenario: Callable[[Peer, str, list[str]], None], steps: list[str]
) -> None:
    pci = first_pci_device()
    full: list[str] = []
    scenario(peer, pci, full)
    assert full[-1] == "unpin"
    failed_at = []
    try:
        for n in range(1, 20):
            arm(n)
            log: list[str] = []
            try:
                scenario(peer, pci, log)
            except (GpupinError, OSError) as exc:
                assert exc.errno == errno.ENOMEM, f"allocation {n}: {exc!r}"
                failed_at.append(full[len(log)])
            if armed():  # more allocations asked for than the scenario makes: done
                assert log == full
                break
            assert log != full, f"allocation {n} failed but every step succeeded"
            # Nothing left behind: no pin, no pages, no mapping, no reference.
            s = sim_stats()
            assert not s.leaks() and s.allocations == 0, (n, s)
            with Device() as dev:
                assert dev.info().pinned_bytes == 0
            assert peer.status().holds == 0
        else:
            pytest.fail("the scenario never ran out of allocations to fail")
    finally:
        arm(0)
    print(f"own-allocation failures injected at: {failed_at}")
    # Every step that allocates was hit at least once.
    assert set(steps) <= set(failed_at)
    log = []
    scenario(peer, pci, log)
    assert log == full


def test_fail_nth_fails_this_threads_allocation() -> None:
    """The framework's per-task fail-nth reaches gpupin's allocations like any other site."""
    if not framework():
        pytest.skip("this kernel has no fault-injection framework (CONFIG_FAULT_INJECTION_DEBUG_FS)")
    with SimMemory() as sim:
        va = sim.alloc(GPU_PAGE)
        try:
            with Device() as dev:
                _write(f"{ATTR}/verbose", 0)
                _write(FAIL_NTH, 1)  # the next should_fail() in this thread fails
                with pytest.raises(GpupinError) as ei:
                    dev.pin(va, GPU_PAGE)
                assert ei.value.errno == errno.ENOMEM
                assert _read(FAIL_NTH) == 0
                assert dev.info().pinned_bytes == 0
                assert not sim_stats().leaks()
                pin = dev.pin(va, GPU_PAGE)  # one failure only
                dev.unpin(pin)
        finally:
            _write(FAIL_NTH, 0)
            sim.free(va)


def test_an_event_that_cannot_be_allocated_is_reported_as_lost() -> None:
    """A listener learns that it missed an event (ENOBUFS, as for an overflow), and goes on."""
    with SimMemory() as sim, Device() as dev, Netlink() as nl:
        nl.subscribe()
        va = sim.alloc(GPU_PAGE)
        pin = dev.pin(va, GPU_PAGE)
        assert [e["event"] for e in nl.events(timeout=10 * SLOW, count=1)] == ["pinned"]
        try:
            arm(1)
            sim.free(va)  # the invalidation's event is gpupin's next allocation
            assert not armed(), "the free made no allocation in gpupin"
        finally:
            arm(0)
        with pytest.raises(EventsLost) as ei:
            list(nl.events(timeout=10 * SLOW, count=1))
        assert ei.value.errno == errno.ENOBUFS and "read the state again" in str(ei.value)
        assert dev.query(pin).state == "invalidated"  # what the event would have said
        dev.unpin(pin)
        evs = list(nl.events(timeout=10 * SLOW, count=1))
        assert [(e["event"], e["handle"]) for e in evs] == [("unpinned", pin.handle)]


def test_watch_all_reports_lost_events_and_goes_on(gpupin_loaded: None, leakcheck: None) -> None:
    import json
    import subprocess
    import sys

    w = subprocess.Popen(
        [sys.executable, "-m", "gpupin", "watch", "--all", "--count", "2", "--timeout", str(120 * SLOW), "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert w.stderr is not None
        line = w.stderr.readline()  # printed once subscribed
        assert line.startswith("watching the events"), line
        with SimMemory() as sim, Device() as dev:
            va = sim.alloc(GPU_PAGE)
            pin = dev.pin(va, GPU_PAGE)  # event 1
            try:
                arm(1)
                sim.free(va)  # its event cannot be allocated: lost
                assert not armed()
            finally:
                arm(0)
            dev.unpin(pin)  # event 2
        out, err = w.communicate(timeout=120 * SLOW)
    finally:
        w.kill()
    assert w.returncode == 0, err
    evs = json.loads(out)
    # The socket's error is reported before what is still queued (the kernel's datagram receive
    # checks sk_err first): a watcher that had not read "pinned" yet when the free's event was
    # lost sees "lost" first.  Either order is right; "unpinned" comes last.
    kinds = [e["event"] for e in evs]
    assert kinds in (["pinned", "lost", "unpinned"], ["lost", "pinned", "unpinned"]), evs
    lost = evs[kinds.index("lost")]
    pinned = evs[kinds.index("pinned")]
    assert "ENOBUFS" in lost["error"] and pinned["handle"] == evs[2]["handle"] == pin.handle


def test_failed_pin_allocations_are_counted() -> None:
    """GET_STATS' fail_enomem counts a PIN and a PIN_DMABUF that ran out of memory alike."""
    from gpupin import netlink

    with SimMemory() as sim, Device() as dev:
        va = sim.alloc(GPU_PAGE)
        fd = sim.export_dmabuf(va)
        try:
            before = netlink.stats()["fail_enomem"]
            for what, call in (("PIN", lambda: dev.pin(va, GPU_PAGE)), ("PIN_DMABUF", lambda: dev.pin_dmabuf(fd))):
                arm(1)  # the pin's own allocation is the call's first
                try:
                    with pytest.raises(GpupinError) as ei:
                        call()
                finally:
                    arm(0)
                assert ei.value.errno == errno.ENOMEM, (what, ei.value)
            assert netlink.stats()["fail_enomem"] == before + 2
            assert dev.info().file_pins == 0
        finally:
            os.close(fd)
            sim.free(va)
