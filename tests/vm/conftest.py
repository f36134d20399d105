"""VM suites: run inside the guest by scripts/vm-run.sh (make test-vm)."""

from __future__ import annotations

import ctypes
import errno
import os
import sys
from collections.abc import Callable
from typing import Any

import pytest

from gpupin._native import ffi, lib

MiB = 1 << 20
# libc for what Python's os module lacks (mprotect; read into a raw address), errno kept.
libc = ctypes.CDLL(None, use_errno=True)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.read.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
libc.read.restype = ctypes.c_ssize_t
# Timeouts stretch under a debug kernel (KASAN, lockdep: make test-debug), which is ~10x slower.
SLOW = 10 if os.path.exists("/sys/kernel/debug/kmemleak") else 1
KiB = 1 << 10
GPU_PAGE = 64 * KiB


def raw(fd: int, cmd: int, ctype: str, /, **fields: Any) -> tuple[int, Any]:
    """Issue an ioctl with exactly the given field values; returns (-errno or 0, struct)."""
    c = ffi.new(f"{ctype} *")
    for name, value in fields.items():
        if isinstance(value, list):
            for i, v in enumerate(value):
                getattr(c, name)[i] = v
        else:
            setattr(c, name, value)
    return lib.gpupin_call(fd, cmd, c), c


def pattern(n: int, seed: int = 0) -> bytes:
    """n bytes that differ per seed, with no long run of the simulator's poison value."""
    block = bytes(((i * 131 + seed * 7 + 1) % 251) for i in range(65521))
    return (block * (n // len(block) + 1))[:n]


def in_child(fn: Callable[[], int]) -> int:
    """Run fn in a forked child; return its exit status (fn's return value)."""
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            code = fn()
        except BaseException as exc:  # report, never return into pytest
            print(f"child failed: {exc!r}", file=sys.stderr)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def first_pci_device() -> str:
    devs = sorted(os.listdir("/sys/bus/pci/devices"))
    assert devs, "the guest has no PCI device to map for"
    return devs[-1]


@pytest.fixture
def pci() -> str:
    return first_pci_device()


EINVAL = -errno.EINVAL
