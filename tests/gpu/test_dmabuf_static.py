"""NVIDIA's dma-buf exporter is static (no pin/unpin ops, no move_notify), measured on the real driver.

Export duplicates the memory handle, so the GPU memory lives as long as the dma-buf: cuMemFree of
the allocation frees nothing while the fd (or a gpupin pin of it) holds the buffer, no revoke ever
comes, and a new allocation may get the same address with other memory and a new buffer id.  This
is why the registration cache refuses validate='kernel' for such pins (NotRevocable) and checks
buffer ids instead.  CUDA user space only: nothing here needs gpupin.ko.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import pytest

from gpupin.errors import GpupinError

MiB = 1 << 20
GiB = 1 << 30


def free_bytes(cu) -> int:  # type: ignore[no-untyped-def]
    err, free, _total = cu.cuMemGetInfo()
    assert int(err) == 0, f"cuMemGetInfo failed: {err}"
    return int(free)


def settle(cu, ok: Callable[[int], bool], timeout: float = 5.0) -> int:  # type: ignore[no-untyped-def]
    """Free bytes once ``ok(free)`` holds (the driver may return memory a little later), or the
    last reading when ``timeout`` seconds passed."""
    deadline = time.monotonic() + timeout
    free = free_bytes(cu)
    while not ok(free) and time.monotonic() < deadline:
        time.sleep(0.05)
        free = free_bytes(cu)
    return free


def test_nvidia_dmabuf_holds_freed_memory_until_the_fd_closes(cuda, cu) -> None:  # type: ignore[no-untyped-def]
    free0 = free_bytes(cu)
    # Two allocations of `size` live at once (the freed-but-held one and the new one): take
    # 2 GiB, or a quarter of what is free, in 2 MiB units.
    size = min(2 * GiB, free0 // 4) // (2 * MiB) * (2 * MiB)
    if size < 256 * MiB:
        pytest.skip(f"only {free0 >> 20} MiB of GPU memory free: the measurement needs 1 GiB")
    tol = max(64 * MiB, size // 16)  # the driver's own allocations (page tables, bookkeeping)
    a = cuda.alloc(size)
    id_a = cuda.buffer_id(a)
    try:
        fd = cuda.export_dmabuf(a)
    except GpupinError as exc:
        cuda.free(a)
        # Skip only where the device says it cannot (proprietary modules, older GPUs); where it
        # says it can, a failed export is a failure (test_cuda's export test fails alike).
        attr = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED
        err, supported = cu.cuDeviceGetAttribute(attr, cuda.device)
        assert int(err) == 0, f"cuDeviceGetAttribute(DMA_BUF_SUPPORTED) failed: {err}"
        if supported:
            raise
        pytest.skip(f"the device cannot export GPU memory as a dma-buf (DMA_BUF_SUPPORTED is 0): {exc}")
    b = None
    fd_open = True
    try:
        held = free_bytes(cu)
        assert free0 - held >= size - tol, f"the allocation of {size >> 20} MiB took {(free0 - held) >> 20} MiB"
        cuda.free(a)
        after_free = settle(cu, lambda f: f > held + size - tol, timeout=1.0)
        assert after_free < held + tol, (
            f"cuMemFree with the dma-buf open gave {(after_free - held) >> 20} MiB back of {size >> 20} MiB: "
            "the exporter is not static (it frees on cuMemFree)"
        )
        b = cuda.alloc(size)
        id_b = cuda.buffer_id(b)
        after_b = free_bytes(cu)
        assert after_free - after_b >= size - tol, (
            f"the new allocation took only {(after_free - after_b) >> 20} MiB: it reused the held memory"
        )
        # Buffer ids are per allocation: a new one even where the address came back.
        assert id_b != id_a, f"buffer id {id_a} at {a:#x} and {id_b} at {b:#x}"
        same_va = b == a
        os.close(fd)
        fd_open = False
        after_close = settle(cu, lambda f: f - after_b >= size - tol)
        assert after_close - after_b >= size - tol, (
            f"closing the dma-buf gave back {(after_close - after_b) >> 20} MiB of {size >> 20} MiB"
        )
        cuda.free(b)
        b = None
        end = settle(cu, lambda f: f >= free0 - tol)
        assert end >= free0 - tol, f"{(free0 - end) >> 20} MiB not given back at the end"
        print(
            f"static exporter, {size >> 20} MiB: free {free0 >> 20} -> allocated {held >> 20} -> "
            f"cuMemFree with the fd open {after_free >> 20} -> new allocation {after_b >> 20} "
            f"(same address: {same_va}, buffer id {id_a} -> {id_b}) -> close(fd) {after_close >> 20} MiB"
        )
    finally:
        if fd_open:
            os.close(fd)
        if b is not None:
            cuda.free(b)
