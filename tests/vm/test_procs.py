"""Processes: fork, fd passing, unprivileged callers, and death with pins held.

A test whose children only call gpupin (refused there) runs over either provider; one whose
children allocate or pin device memory is simulator-only: CUDA contexts do not survive fork."""

from __future__ import annotations

import errno
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

import gpupin
from conftest import GPU_ALLOC, GPU_PAGE, SLOW, MiB, in_child
from gpupin import Device, MemoryProvider, SimMemory, sim_stats
from gpupin.cache import RegistrationCache

pytestmark = pytest.mark.vm
FORKS = pytest.mark.simonly(reason="forks a child that allocates device memory: CUDA contexts do not survive fork")
NOBODY = 65534


def errno_of(fn: Callable[[], object]) -> int:
    try:
        fn()
    except gpupin.GpupinError as exc:
        return exc.errno or 98
    except OSError as exc:
        return exc.errno or 98
    return 0


def test_forked_child_cannot_pin_or_unpin(device: Device, memory: MemoryProvider, pci: str) -> None:
    """The children only call gpupin, which refuses them before any provider call."""
    va = memory.alloc(GPU_ALLOC)
    pin = device.pin(va, GPU_PAGE)
    assert in_child(lambda: errno_of(lambda: device.pin(va, GPU_PAGE))) == errno.EACCES
    assert in_child(lambda: errno_of(lambda: device.unpin(pin))) == errno.EACCES
    assert in_child(lambda: errno_of(lambda: device.dma_map(pin, pci))) == errno.EACCES
    # Reading state is allowed from anywhere.
    assert in_child(lambda: 0 if device.query(pin).state == "pinned" else 1) == 0
    assert device.query(pin).state == "pinned" and device.info().file_pins == 1
    device.unpin(pin)
    memory.free(va)


def forked_refusals(calls: list[Callable[[], object]], err: int, parent: int) -> int:
    """In a fork child: 0 if every call raises ForkedDevice with ``err``, naming the opener
    ``parent`` and the fix; else 10 + i (call i succeeded) or 20 + i (another error)."""
    for i, call in enumerate(calls):
        try:
            call()
            return 10 + i
        except gpupin.ForkedDevice as exc:
            msg = str(exc)
            if exc.errno != err or str(parent) not in msg or "Device.reopen()" not in msg:
                return 20 + i
    return 0


def test_forked_child_is_told_to_open_its_own_device(device: Device, memory: MemoryProvider) -> None:
    """The refused calls raise ForkedDevice naming the fork and the fix, never a bare OSError."""
    va = memory.alloc(GPU_ALLOC)
    pin = device.pin(va, GPU_PAGE)
    parent = os.getpid()

    calls: list[Callable[[], object]] = [
        lambda: device.pin(va, GPU_PAGE),
        lambda: device.unpin(pin),
        device.read_events,  # a bare PermissionError(13) before
    ]
    assert in_child(lambda: forked_refusals(calls, errno.EACCES, parent)) == 0
    assert device.query(pin).state == "pinned" and device.info().file_pins == 1
    device.unpin(pin)
    memory.free(va)


class PerProcessSim:
    """A memory provider with a simulator context per process (as CUDA needs one per process):
    a fork child allocates in a context of its own, the parent's stays the parent's."""

    name = "nvp2p_sim"

    def __init__(self) -> None:
        self._pid = -1
        self._sim: SimMemory | None = None

    @property
    def sim(self) -> SimMemory:
        if self._sim is None or self._pid != os.getpid():
            self._sim = SimMemory()
            self._pid = os.getpid()
        return self._sim

    def alloc(self, size: int) -> int:
        return self.sim.alloc(size)

    def free(self, ptr: int) -> None:
        self.sim.free(ptr)

    def range_of(self, ptr: int) -> gpupin.AllocationRange:
        return self.sim.range_of(ptr)

    def buffer_id(self, ptr: int) -> int:
        return self.sim.buffer_id(ptr)

    def enable_sync_memops(self, ptr: int) -> None:
        self.sim.enable_sync_memops(ptr)

    def close(self) -> None:
        if self._sim is not None:
            self._sim.close()


# A module-level cache, as a user's worker module would have.
MEM: PerProcessSim | None = None
DEV: Device | None = None
CACHE: RegistrationCache | None = None


def _pool_worker(i: int) -> tuple[int, int, int, bool, int, int]:
    """In a fork-pool worker: pid, handle, pins of the cache's device, whether that is the
    parent's Device, hits, and the parent's file's pins as seen from here."""
    assert MEM is not None and DEV is not None and CACHE is not None
    va = MEM.alloc((i + 1) * GPU_PAGE)
    with CACHE.acquire(va, 4096) as r:
        handle = r.handle
        assert r.valid
    with CACHE.acquire(va + 1, 10) as r:
        assert r.handle == handle
    mine = CACHE.device
    assert isinstance(mine, Device)
    return os.getpid(), handle, mine.info().file_pins, mine is DEV, CACHE.stats().hits, DEV.info().file_pins


@FORKS
def test_pool_worker_with_a_module_level_cache(gpupin_loaded: None, leakcheck: None) -> None:
    """A fork-based Pool worker using the parent's cache pins in a file of its own."""
    global MEM, DEV, CACHE
    MEM, DEV = PerProcessSim(), Device()
    CACHE = RegistrationCache(DEV, MEM, validate="both")
    try:
        va = MEM.alloc(MiB)
        with CACHE.acquire(va, 1) as r:
            parent_handle = r.handle
        with multiprocessing.get_context("fork").Pool(2) as pool:
            results = pool.map(_pool_worker, range(4), chunksize=1)
        assert len(results) == 4
        for pid, _handle, pins, is_parents, hits, parent_pins in results:
            assert pid != os.getpid() and not is_parents
            assert pins >= 1 and hits >= 1 and parent_pins == 1  # the parent's pin untouched
        assert DEV.info().file_pins == 1 and DEV.query(parent_handle).state == "pinned"
        with CACHE.acquire(va, 1) as r:
            assert r.handle == parent_handle and r.valid
        CACHE.purge()
        MEM.free(va)
    finally:
        CACHE.close()
        DEV.close()
        MEM.close()
        MEM = DEV = CACHE = None


@FORKS
def test_cache_in_a_forked_child_with_the_parents_device(gpupin_loaded: None, leakcheck: None) -> None:
    """Straight os.fork: the child's cache reopens /dev/gpupin, pins, and closing it there leaves
    the parent's pins alone."""
    mem = PerProcessSim()
    with Device() as dev:
        cache = RegistrationCache(dev, mem, validate="both")
        va = mem.alloc(MiB)
        held = cache.acquire(va, 1)

        def child() -> int:
            mine = mem.alloc(MiB)
            with cache.acquire(mine, 1) as r:
                own = cache.device
                if own is dev or own.info().file_pins != 1 or own.query(r.handle).state != "pinned":  # type: ignore[attr-defined]
                    return 2
            held.release()  # the parent's registration: nothing happens here
            cache.close()
            if not own.closed or dev.info().file_pins != 1:  # type: ignore[attr-defined]
                return 3
            mem.free(mine)
            return 0

        assert in_child(child) == 0
        assert dev.info().file_pins == 1 and held.valid
        held.release()
        cache.close()
        mem.free(va)
    mem.close()


def fd_receiver(child: Callable[[bytes, int], int]) -> tuple[int, socket.socket]:
    """Fork a child that receives one fd over a Unix socket and exits with child(message, fd);
    returns its pid and the socket to send on (send_fds, then waitpid and close)."""
    parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            parent_sock.close()
            msg, fds, _, _ = socket.recv_fds(child_sock, 64, 1)
            code = child(msg, fds[0])
        finally:
            os._exit(code)
    child_sock.close()
    return pid, parent_sock


@FORKS
def test_fd_passed_over_socket_is_refused(gpupin_loaded: None, leakcheck: None) -> None:
    def child(_msg: bytes, fd: int) -> int:
        with SimMemory() as mine:
            va = mine.alloc(GPU_PAGE)
            return -ffi_pin(fd, va)

    pid, parent_sock = fd_receiver(child)
    with Device() as dev:
        socket.send_fds(parent_sock, [b"x"], [dev.fileno()])
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == errno.EACCES
        assert dev.info().file_pins == 0
    parent_sock.close()


def test_forked_child_cannot_read_addresses(device: Device, memory: MemoryProvider, pci: str) -> None:
    """Physical and bus addresses are the opener's alone: a fork child shares the file (and the
    opener's privilege), but GET_PAGES and DMA_ADDRS refuse it with EPERM and a ForkedDevice that
    says what to do; the opener still reads them."""
    va = memory.alloc(GPU_ALLOC)
    pin = device.pin(va, GPU_PAGE)
    m = device.dma_map(pin, pci)
    parent = os.getpid()

    calls: list[Callable[[], object]] = [lambda: device.get_pages(pin), lambda: device.dma_addrs(m)]
    assert in_child(lambda: forked_refusals(calls, errno.EPERM, parent)) == 0
    assert len(device.get_pages(pin)) == pin.entries and len(device.dma_addrs(m)) == pin.entries
    device.dma_unmap(m)
    device.unpin(pin)
    memory.free(va)


def ffi_addrs(fd: int, handle: int, mapping_id: int | None) -> int:
    """GET_PAGES (mapping_id None) or DMA_ADDRS of one entry through ``fd``: 0 or -errno."""
    from gpupin._native import ffi, lib

    out = ffi.new("__u64[1]")
    if mapping_id is None:
        c = ffi.new("struct gpupin_get_pages *")
        cmd = lib.GPUPIN_IOC_GET_PAGES
    else:
        c = ffi.new("struct gpupin_dma_addrs *")
        c.mapping_id = mapping_id
        cmd = lib.GPUPIN_IOC_DMA_ADDRS
    c.handle, c.first, c.count = handle, 0, 1
    c.addrs = int(ffi.cast("uintptr_t", out))
    return int(lib.gpupin_call(fd, cmd, c))


@FORKS
def test_fd_receiver_cannot_read_addresses(gpupin_loaded: None, leakcheck: None, pci: str) -> None:
    """A process that got the opener's file over SCM_RIGHTS (opened after the fork, so not
    inherited) reads no physical or bus addresses through it: EPERM, and the Python error names
    both conditions and what to do.  The opener still reads them."""

    def child(msg: bytes, fd: int) -> int:
        handle, mapping_id = (int(x) for x in msg.split())
        if ffi_addrs(fd, handle, None) != -errno.EPERM:
            return 2
        if ffi_addrs(fd, handle, mapping_id) != -errno.EPERM:
            return 3
        # The same file under a Device of this process: the Python error says what to do.
        with Device() as mine:
            os.dup2(fd, mine.fileno())
            try:
                mine.get_pages(handle, 0, 1)
                return 4
            except gpupin.PermissionDenied as exc:
                text = str(exc)
                if exc.errno != errno.EPERM or "opened" not in text or "CAP_SYS_ADMIN" not in text:
                    return 5
        return 0

    pid, parent_sock = fd_receiver(child)
    with SimMemory() as sim, Device() as dev:
        va = sim.alloc(GPU_PAGE)
        pin = dev.pin(va, GPU_PAGE)
        m = dev.dma_map(pin, pci)
        socket.send_fds(parent_sock, [f"{pin.handle} {m.mapping_id}".encode()], [dev.fileno()])
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert len(dev.get_pages(pin)) == 1 and len(dev.dma_addrs(m)) == 1
        dev.dma_unmap(m)
        dev.unpin(pin)
        sim.free(va)
    parent_sock.close()


def ffi_pin(fd: int, va: int) -> int:
    from gpupin._native import ffi, lib

    c = ffi.new("struct gpupin_pin *")
    c.va, c.size = va, GPU_PAGE
    return int(lib.gpupin_call(fd, lib.GPUPIN_IOC_PIN, c))


@pytest.mark.simonly(
    reason="opens the simulator's node to nobody, exports a dma-buf from it, and a forked child allocates there"
)
def test_unprivileged_opener_cannot_read_addresses(gpupin_loaded: None, leakcheck: None) -> None:
    """Privilege is the opener's: a file that nobody opened reads no addresses, maps nothing
    (nor imports a dma-buf for a device, which maps it for that device)."""
    modes = {node: os.stat(node).st_mode & 0o777 for node in ("/dev/gpupin", "/dev/nvp2p_sim")}
    for node in modes:
        os.chmod(node, 0o666)
    try:

        def child() -> int:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            with SimMemory() as sim, Device() as dev:
                va = sim.alloc(GPU_PAGE)
                pin = dev.pin(va, GPU_PAGE)
                a = errno_of(lambda: dev.get_pages(pin, 0, 1))
                b = errno_of(lambda: dev.dma_map(pin, "0000:00:00.0"))
                fd = sim.export_dmabuf(va)
                c = errno_of(lambda: dev.pin_dmabuf(fd, pci="0000:00:00.0"))
                dev.pin_dmabuf(fd)  # holding the buffer maps nothing: allowed
                os.close(fd)
                return 0 if a == b == c == errno.EPERM else 1

        assert in_child(child) == 0
    finally:
        for node, mode in modes.items():
            os.chmod(node, mode)


def test_unprivileged_cannot_open_device(gpupin_loaded: None) -> None:
    def child() -> int:
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        try:
            Device()
        except gpupin.PermissionDenied as exc:
            return 0 if "gpupin" in str(exc) else 2
        return 1

    assert oct(os.stat("/dev/gpupin").st_mode & 0o777) == "0o660"
    assert in_child(child) == 0


HOLDER = textwrap.dedent("""
    import sys, gpupin
    sim = gpupin.SimMemory(); dev = gpupin.Device()
    va = sim.alloc(16 << 20)
    for i in range(1000):
        dev.pin(va + (i % 256) * 65536, 65536, user_tag=i)
    print("ready", flush=True)
    sys.stdin.read()
""")


@pytest.mark.simonly(reason="the holder allocates from the simulator; its counters after the death are the point")
@pytest.mark.parametrize("how", ["kill9", "exit"])
def test_process_death_with_1000_pins(gpupin_loaded: None, leakcheck: None, how: str) -> None:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdin is not None
    assert proc.stdout.readline().strip() == "ready"
    s = sim_stats()
    assert s.page_tables >= 1000 and s.alloc_bytes >= 16 * MiB
    if how == "kill9":
        proc.send_signal(signal.SIGKILL)
    else:
        proc.stdin.close()
    proc.wait(timeout=120 * SLOW)
    s = sim_stats()
    assert s.page_tables == 0 and s.bar_bytes == 0 and s.pinned_pages == 0 and s.alloc_bytes == 0


GPUPIN_GID = 4242  # stands for the "gpupin" group of packaging/99-gpupin.rules


def test_udev_rule_gives_the_group_access() -> None:
    rules = (Path(__file__).resolve().parents[2] / "packaging" / "99-gpupin.rules").read_text()
    line = next(ln for ln in rules.splitlines() if ln.startswith('KERNEL=="gpupin"'))
    assert 'GROUP="gpupin"' in line and 'MODE="0660"' in line


@FORKS
def test_group_member_may_pin_but_not_map_or_see_addresses(
    gpupin_loaded: None, leakcheck: None, sim_params, pci: str
) -> None:  # type: ignore[no-untyped-def]
    """What the udev rule gives a member of the gpupin group, as an unprivileged user."""
    sim_params("gpupin", debug=True)  # the debug log must not leak addresses either
    st = os.stat("/dev/gpupin")
    os.chown("/dev/gpupin", 0, GPUPIN_GID)
    mark = f"gpupin-privilege-test-{os.getpid()}"
    with open("/dev/kmsg", "w") as kmsg:
        kmsg.write(mark + "\n")
    try:

        def child() -> int:
            from gpupin.netlink import Netlink

            sim = SimMemory()  # the simulator's node is root's: opened before dropping root
            os.setgroups([GPUPIN_GID])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            with sim, Device() as dev:
                va = sim.alloc(GPU_PAGE)
                pin = dev.pin(va, GPU_PAGE)
                if errno_of(lambda: dev.get_pages(pin)) != errno.EPERM:
                    return 2
                if errno_of(lambda: dev.dma_map(pin, pci)) != errno.EPERM:
                    return 3
                with Netlink() as nl:
                    mine = nl.list_pins()
                    if {(p.pid, p.handle) for p in mine} != {(os.getpid(), pin.handle)}:
                        return 4
                    if errno_of(nl.subscribe) != errno.EPERM:
                        return 5
                sim.free(va)
                if [e.reason for e in dev.read_events()] != ["freed"]:
                    return 6
            return 0

        assert in_child(child) == 0
    finally:
        os.chown("/dev/gpupin", st.st_uid, st.st_gid)
    log = subprocess.run(["dmesg"], capture_output=True, text=True, check=True).stdout
    ours = log[log.rindex(mark) :]
    lines = [ln for ln in ours.splitlines() if "gpupin:" in ln]
    assert lines, "debug logging produced nothing to check"
    for ln in lines:
        assert not re.search(r"ffff[0-9a-f]{12}|0x[0-9a-f]{9,}", ln), f"address in the log: {ln}"
