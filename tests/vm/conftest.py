"""VM suites: run inside the guest by scripts/vm-run.sh (make test-vm)."""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from gpupin._native import ffi, lib
from gpupin.sim import MISUSE, get_sim_param, reset_misuse, set_sim_param, sim_stats
from gpupin.testing import (
    NATIVE,
    in_child,  # noqa: F401  (the VM tests import it from here)
)

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
# The smallest allocation that starts on a GPU page over either provider: cuMemAlloc aligns
# allocations of 2 MiB and more to 2 MiB, smaller ones only to 256 bytes.
GPU_ALLOC = 2 * MiB if NATIVE else GPU_PAGE
# The second kernel of make test's matrix runs the races, the fuzzer and the thread races at a
# quarter of their CI counts (GPUPIN_STRESS_SCALE=0.25, set by make test-vm-6.12): the first
# kernel runs them whole, make test-long at their full counts.
STRESS_SCALE = float(os.environ.get("GPUPIN_STRESS_SCALE") or 1)
if not 0 < STRESS_SCALE <= 1:
    raise ValueError(f"GPUPIN_STRESS_SCALE={STRESS_SCALE}: a fraction of the CI counts, in (0, 1]")


def scaled(n: int, step: int = 1) -> int:
    """A stress test's CI count ``n`` at GPUPIN_STRESS_SCALE: a multiple of ``step`` (a test that
    runs in batches of ``step`` counts whole batches), at least one ``step``."""
    return max(step, round(n * STRESS_SCALE / step) * step)


def pytest_ignore_collect(collection_path: Any, config: pytest.Config) -> bool | None:
    """make vm-test T=...: import only the test files that hold a selected test.

    vm-run.sh collects the selection on the host and names its files in GPUPIN_VM_FILES;
    importing the other two dozen modules under software emulation takes most of a minute.
    The selection itself still comes from the arguments pytest gets, unchanged.
    """
    files = os.environ.get("GPUPIN_VM_FILES")
    name = collection_path.name
    if not files or not (name.startswith("test_") and name.endswith(".py")):
        return None
    return name not in files.split() or None


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


def gets_per_pin() -> int:
    """nv-p2p get_pages calls a PIN makes: 2 where gpupin charges BAR1 to the dmem cgroup
    controller (its parameter dmem is Y), which first pins 64 KiB persistently to learn the
    GPU (the charge comes before the memory is taken), else 1."""
    param = "/sys/module/gpupin/parameters/dmem"
    with open(param) as f:
        return 2 if f.read().strip() == "Y" else 1


def first_pci_device() -> str:
    devs = sorted(os.listdir("/sys/bus/pci/devices"))
    assert devs, "the guest has no PCI device to map for"
    return devs[-1]


@pytest.fixture
def pci() -> str:
    """A PCI device to DMA-map for: the VM's last one; natively the peer the user names
    (GPUPIN_PEER_PCI, a NIC: ``make test-native PEER_PCI=...``), as nvidia.ko checks the
    topology between the GPU and the peer."""
    if NATIVE:
        named = os.environ.get("GPUPIN_PEER_PCI", "")
        if not named:
            pytest.skip("GPUPIN_PEER_PCI is not set: name a peer PCI device (a NIC) to DMA-map for")
        return named
    return first_pci_device()


EINVAL = -errno.EINVAL


@pytest.fixture
def leakcheck(gpupin_loaded: None) -> Iterator[None]:
    """gpupin.testing's leakcheck (every counter of ``SimStats.leaks()`` 0 after the test),
    except that misuse counters found non-zero are zeroed once reported: the misuse fails the
    test that caused it, not every test after it (the counters only ever grow otherwise)."""
    yield
    if NATIVE:
        return
    leaks = sim_stats().leaks()
    if any(k in MISUSE for k in leaks):
        reset_misuse()
    assert not leaks, f"simulator counters not back to zero after the test: {leaks}"


@pytest.fixture
def sim_misuse(leakcheck: None) -> Iterator[Callable[..., None]]:
    """``sim_misuse(counter=n, ...)``: the test provokes ``n`` strict misuses of each named
    counter (``gpupin.sim.MISUSE``) on purpose.  The simulator logs those without a kernel
    WARNING (its ``expect_misuse`` budget); at the end each named counter must have grown by
    exactly ``n``, every other misuse counter not at all, and the budget must be spent.  The
    counters are then zeroed, so the leakcheck after the test (which requires 0) holds."""
    before = sim_stats()
    expected: dict[str, int] = {}

    def expect(**counts: int) -> None:
        for name, n in counts.items():
            assert name in MISUSE, f"{name} is not a misuse counter"
            expected[name] = expected.get(name, 0) + n
        set_sim_param("expect_misuse", int(get_sim_param("expect_misuse")) + sum(counts.values()))

    try:
        yield expect
    finally:
        left = int(get_sim_param("expect_misuse"))
        set_sim_param("expect_misuse", 0)
        after = sim_stats()
        reset_misuse()
    grown = {k: getattr(after, k) - getattr(before, k) for k in MISUSE if getattr(after, k) != getattr(before, k)}
    assert grown == expected, f"misuse counted {grown}, the test expected {expected}"
    assert left == 0, f"{left} expected misuse(s) never happened"


def _pci_devices(vendor: int, device: int | None = None) -> list[str]:
    out = []
    for d in sorted(os.listdir("/sys/bus/pci/devices")):
        base = f"/sys/bus/pci/devices/{d}"
        with open(f"{base}/vendor") as v, open(f"{base}/device") as i:
            if int(v.read(), 16) == vendor and (device is None or int(i.read(), 16) == device):
                out.append(d)
    return out


@pytest.fixture
def bar_device() -> str:
    """The VM's ivshmem device (scripts/vm-run.sh adds it): a PCI memory BAR for the
    simulator's bar_device parameter, so page tables hold MMIO addresses as a GPU's do."""
    devs = _pci_devices(0x1AF4, 0x1110)
    assert devs, "no ivshmem device in this VM: boot it with scripts/vm-run.sh (it adds one)"
    return devs[0]


@pytest.fixture
def virtio_pci() -> str:
    """A virtio PCI device of the VM: a peer with a 64-bit DMA mask."""
    devs = [d for d in _pci_devices(0x1AF4) if int(open(f"/sys/bus/pci/devices/{d}/device").read(), 16) < 0x1100]
    assert devs, "no virtio PCI device in this VM"
    return devs[0]


def can_export_dmabuf(memory: Any) -> bool:
    """Whether ``memory`` can export its allocations as dma-bufs: the simulator always can;
    natively the GPU and driver must say so (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)."""
    return not NATIVE or bool(memory.dmabuf_supported())


def need_dmabuf_export(memory: Any) -> None:
    if not can_export_dmabuf(memory):
        pytest.skip("this GPU and driver cannot export dma-bufs (DMA_BUF_SUPPORTED is 0)")
