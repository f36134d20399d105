"""Processes: fork, fd passing, unprivileged callers, and death with pins held."""

from __future__ import annotations

import errno
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
from conftest import GPU_PAGE, MiB, in_child
from gpupin import Device, SimMemory, sim_stats

pytestmark = [pytest.mark.vm, pytest.mark.simonly]
NOBODY = 65534


def errno_of(fn: Callable[[], object]) -> int:
    try:
        fn()
    except gpupin.GpupinError as exc:
        return exc.errno or 98
    except OSError as exc:
        return exc.errno or 98
    return 0


def test_forked_child_cannot_pin_or_unpin(device: Device, sim: SimMemory, pci: str) -> None:
    va = sim.alloc(GPU_PAGE)
    pin = device.pin(va, GPU_PAGE)
    assert in_child(lambda: errno_of(lambda: device.pin(va, GPU_PAGE))) == errno.EACCES
    assert in_child(lambda: errno_of(lambda: device.unpin(pin))) == errno.EACCES
    assert in_child(lambda: errno_of(lambda: device.dma_map(pin, pci))) == errno.EACCES
    # Reading state is allowed from anywhere.
    assert in_child(lambda: 0 if device.query(pin).state == "pinned" else 1) == 0
    assert device.query(pin).state == "pinned" and device.info().file_pins == 1
    device.unpin(pin)
    sim.free(va)


def test_fd_passed_over_socket_is_refused(gpupin_loaded: None, leakcheck: None) -> None:
    parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)

    def child() -> int:
        parent_sock.close()
        _, fds, _, _ = socket.recv_fds(child_sock, 16, 1)
        with SimMemory() as mine:
            va = mine.alloc(GPU_PAGE)
            c = ffi_pin(fds[0], va)
            return -c

    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            code = child()
        finally:
            os._exit(code)
    child_sock.close()
    with Device() as dev:
        socket.send_fds(parent_sock, [b"x"], [dev.fileno()])
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == errno.EACCES
        assert dev.info().file_pins == 0
    parent_sock.close()


def ffi_pin(fd: int, va: int) -> int:
    from gpupin._native import ffi, lib

    c = ffi.new("struct gpupin_pin *")
    c.va, c.size = va, GPU_PAGE
    return int(lib.gpupin_call(fd, lib.GPUPIN_IOC_PIN, c))


def test_unprivileged_opener_cannot_read_addresses(gpupin_loaded: None, leakcheck: None) -> None:
    """Privilege is the opener's: a file that nobody opened reads no addresses, maps nothing."""
    st = os.stat("/dev/gpupin")
    os.chmod("/dev/gpupin", 0o666)
    try:

        def child() -> int:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            with SimMemory() as sim, Device() as dev:
                va = sim.alloc(GPU_PAGE)
                pin = dev.pin(va, GPU_PAGE)
                a = errno_of(lambda: dev.get_pages(pin, 0, 1))
                b = errno_of(lambda: dev.dma_map(pin, "0000:00:00.0"))
                return 0 if a == b == errno.EPERM else 1

        assert in_child(child) == 0
    finally:
        os.chmod("/dev/gpupin", st.st_mode & 0o777)


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
    proc.wait(timeout=120)
    s = sim_stats()
    assert s.page_tables == 0 and s.bar_bytes == 0 and s.pinned_pages == 0 and s.alloc_bytes == 0


GPUPIN_GID = 4242  # stands for the "gpupin" group of packaging/99-gpupin.rules


def test_udev_rule_gives_the_group_access() -> None:
    rules = (Path(__file__).resolve().parents[2] / "packaging" / "99-gpupin.rules").read_text()
    line = next(ln for ln in rules.splitlines() if ln.startswith('KERNEL=="gpupin"'))
    assert 'GROUP="gpupin"' in line and 'MODE="0660"' in line


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

            os.setgroups([GPUPIN_GID])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            with SimMemory() as sim, Device() as dev:
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
