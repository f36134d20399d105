"""``CudaMemory``: device memory from the CUDA driver through cuda-python.

cuda-python is imported only when a CudaMemory is made, so hosts without CUDA
can use the rest of gpupin.  Managed and host memory are refused: nv-p2p pins
device memory only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Any, NamedTuple

from ._native import cuda_buffer_id, ffi, lib
from .errors import DriverNotLoaded, GpupinError, NotGpuMemory
from .memory import AllocationRange, ProviderBase


def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError:
        try:
            from cuda import cuda as driver  # cuda-python < 12.6 layout
        except ImportError:
            raise DriverNotLoaded("cuda-python is not installed: pip install 'gpupin[cuda]' (or cuda-python)") from None
    return driver


class GpuListing(NamedTuple):
    """The NVIDIA GPUs a host shows without CUDA, and which listing showed them."""

    source: str  # "nvidia-smi -L" or the /proc directory; "" where neither lists one
    gpus: list[str]


def visible_gpus(proc: str = "/proc/driver/nvidia/gpus") -> GpuListing:
    """Whether this host has an NVIDIA GPU, asked without CUDA; never raises.

    ``nvidia-smi -L`` (found on PATH) is asked first: its "GPU n: ..." lines.  Where it is
    missing or fails, the NVIDIA driver's ``proc`` directory names each GPU by its PCI address.
    A GPU listed here should be usable through CUDA: test suites fail, rather than skip,
    where it is not.
    """
    exe = shutil.which("nvidia-smi")
    if exe is not None:
        try:
            r = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            pass
        else:
            gpus = [line.strip() for line in r.stdout.splitlines() if line.startswith("GPU ")]
            if r.returncode == 0 and gpus:
                return GpuListing("nvidia-smi -L", gpus)
    try:
        entries = sorted(os.listdir(proc))
    except OSError:
        entries = []
    return GpuListing(proc if entries else "", entries)


def driver_status() -> tuple[bool, str]:
    """Whether CudaMemory can work here, and what was seen; never raises.

    Asked through cuda-python, which CudaMemory needs anyway: cuInit, the device count and the
    driver version.  Without cuda-python the answer is that it is missing (and how to install it).
    """
    try:
        cu = _driver()
    except DriverNotLoaded as exc:
        return False, str(exc)
    ok = cu.CUresult.CUDA_SUCCESS
    try:
        (err,) = cu.cuInit(0)
    except RuntimeError as exc:  # cuda-python found no libcuda.so.1 to load
        return False, f"no CUDA driver here (libcuda.so.1 does not load: {exc})"
    if err != ok:
        return False, f"the CUDA driver is not usable here: cuInit returned {_name(err)}"
    err, count = cu.cuDeviceGetCount()
    if err != ok or count == 0:
        return False, f"the CUDA driver sees no device ({_name(err) if err != ok else '0 devices'})"
    _, version = cu.cuDriverGetVersion()
    return True, f"CUDA driver {version // 1000}.{version % 1000 // 10}, {count} device(s)"


def _name(err: Any) -> str:
    """A CUresult's name (CUDA_ERROR_...), as cuda-python's enum gives it."""
    return str(getattr(err, "name", f"CUresult {int(err)}"))


class CudaMemory(ProviderBase):
    """CUDA device memory of one GPU's primary context."""

    name = "cuda"

    def __init__(self, device: int = 0) -> None:
        cu = _driver()
        self._cu = cu
        self._ok = cu.CUresult.CUDA_SUCCESS
        try:
            (err,) = cu.cuInit(0)
        except RuntimeError as exc:  # libcuda.so missing
            raise DriverNotLoaded(f"the CUDA driver library is not available: {exc}") from None
        if err != self._ok:
            raise DriverNotLoaded(f"the CUDA driver is not usable here: cuInit returned {err.name}")
        dev = self._check(cu.cuDeviceGet(device), f"cuDeviceGet({device})")
        self._dev = dev
        self._ctx = self._check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        self._check(cu.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
        P = cu.CUpointer_attribute
        self._attrs = [
            P.CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            P.CU_POINTER_ATTRIBUTE_IS_MANAGED,
            P.CU_POINTER_ATTRIBUTE_BUFFER_ID,
            P.CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
            P.CU_POINTER_ATTRIBUTE_RANGE_SIZE,
        ]
        self._buffer_id_attr = P.CU_POINTER_ATTRIBUTE_BUFFER_ID
        self._sync_attr = P.CU_POINTER_ATTRIBUTE_SYNC_MEMOPS
        self._device_type = cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
        self._synced: set[tuple[int, int]] = set()
        self.sync_memops_calls = 0
        self.device = device
        # The buffer-id query on the hot path goes straight to libcuda (no cuda-python layer).
        self.direct_buffer_id_query = lib.gp_cuda_open(int(self._buffer_id_attr)) == 0
        # The same query for the cache's hit path (see MemoryProvider): no context.
        self.c_buffer_id_query: Any = ffi.addressof(lib, "gp_cuda_query") if self.direct_buffer_id_query else None
        self.c_buffer_id_ctx: Any = ffi.NULL
        self._direct = cuda_buffer_id or lib.gp_cuda_buffer_id_or_0
        # VMM chunks: RANGE_* spans the whole reserved range, MAPPING_* the chunk
        # (measured on an H200, driver 580); cuda-python does not wrap MAPPING_*.
        self._mapping_attrs = tuple(
            int(getattr(P, n))
            for n in ("CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR", "CU_POINTER_ATTRIBUTE_MAPPING_SIZE")
            if hasattr(P, n)
        )

    def _check(self, result: Any, call: str) -> Any:
        err = result[0] if isinstance(result, tuple) else result
        if err != self._ok:
            raise GpupinError(f"{call} failed: {getattr(err, 'name', err)}")
        if isinstance(result, tuple):
            return result[1] if len(result) == 2 else result[1:]
        return None

    def close(self) -> None:
        if getattr(self, "_ctx", None) is not None:
            self._cu.cuDevicePrimaryCtxRelease(self._dev)
            self._ctx = None

    def range_of(self, ptr: int) -> AllocationRange:
        err, vals = self._cu.cuPointerGetAttributes(len(self._attrs), self._attrs, ptr)
        if err != self._ok:
            raise NotGpuMemory(f"{ptr:#x} is not CUDA memory ({err.name}): freed, or never allocated")
        mtype, managed, buf_id, start, size = vals
        if int(mtype) != int(self._device_type):
            raise NotGpuMemory(
                f"{ptr:#x} is not device memory (memory type {int(mtype)}): "
                "only cuMemAlloc/VMM device memory can be pinned"
            )
        if int(managed):
            raise NotGpuMemory(f"{ptr:#x} is managed (unified) memory, which GPUDirect RDMA cannot pin: use cuMemAlloc")
        base, end = int(start), int(start) + int(size)
        if self.direct_buffer_id_query and len(self._mapping_attrs) == 2:
            # The allocation is where the address range and the physical mapping overlap:
            # a VMM chunk is a mapping inside a larger reserved range, while a small
            # cuMemAlloc or pool allocation sits inside a larger mapping (measured: 1 MiB
            # cuMemAlloc in a 2 MiB mapping, a 300,000-byte pool block in 32 MiB).
            out = ffi.new("uint64_t[2]")
            if (
                lib.gp_cuda_attr_u64(ptr, self._mapping_attrs[0], out) == 0
                and lib.gp_cuda_attr_u64(ptr, self._mapping_attrs[1], out + 1) == 0
                and out[1]
            ):
                base, end = max(base, int(out[0])), min(end, int(out[0]) + int(out[1]))
        return AllocationRange(base, end - base, int(buf_id))

    def export_dmabuf(self, ptr: int) -> int:
        """A dma-buf fd for the allocation holding ``ptr`` (cuMemGetHandleForAddressRange).

        The range is the allocation (the VMM chunk for VMM memory), rounded up to the host
        page size as the call requires; the caller closes the fd.
        """
        self._current()
        r = self.range_of(ptr)
        page = os.sysconf("SC_PAGE_SIZE")
        size = -(-r.size // page) * page
        cu = self._cu
        kind = cu.CUmemRangeHandleType.CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
        err, fd = cu.cuMemGetHandleForAddressRange(r.base, size, kind, 0)
        if err != self._ok:
            raise GpupinError(
                f"cuMemGetHandleForAddressRange({r.base:#x}, {size}, DMA_BUF_FD) failed: {err.name}; "
                "dma-buf export needs the open kernel modules (R515+) and a GPU that supports it"
            )
        return int(fd)

    def buffer_id(self, ptr: int) -> int:
        """The allocation's buffer id, queried directly through libcuda when possible."""
        if self.direct_buffer_id_query:
            bid = int(self._direct(ptr))
            if bid == 0:
                raise NotGpuMemory(f"{ptr:#x} is not CUDA memory: freed, or never allocated")
            return bid
        return self.buffer_id_cuda_python(ptr)

    def buffer_id_cuda_python(self, ptr: int) -> int:
        """The same query through cuda-python (the baseline the direct query is measured against)."""
        err, val = self._cu.cuPointerGetAttribute(self._buffer_id_attr, ptr)
        if err != self._ok:
            raise NotGpuMemory(f"{ptr:#x} is not CUDA memory ({err.name}): freed, or never allocated")
        return int(val)

    def enable_sync_memops(self, ptr: int) -> None:
        """Set SYNC_MEMOPS once per allocation (keyed by base and buffer id)."""
        r = self.range_of(ptr)
        key = (r.base, r.buffer_id)
        if key in self._synced:
            return
        flag = ffi.new("unsigned int *", 1)  # cuda-python takes the value's address
        res = self._cu.cuPointerSetAttribute(int(ffi.cast("uintptr_t", flag)), self._sync_attr, r.base)
        err = res[0] if isinstance(res, tuple) else res
        self.sync_memops_calls += 1
        self._synced.add(key)
        # VMM (cuMemCreate/cuMemMap) memory answers NOT_SUPPORTED: its operations are
        # already synchronous with respect to peer access, so there is nothing to set.
        if err != self._ok and err != self._cu.CUresult.CUDA_ERROR_NOT_SUPPORTED:
            raise GpupinError(f"cuPointerSetAttribute(SYNC_MEMOPS) on {r.base:#x} failed: {err.name}")

    def sync_memops(self, ptr: int) -> bool:
        """Whether SYNC_MEMOPS is set on the allocation holding ``ptr`` (as CUDA reads it back)."""
        return bool(int(self._check(self._cu.cuPointerGetAttribute(self._sync_attr, ptr), "cuPointerGetAttribute")))

    def dmabuf_supported(self) -> bool:
        """Whether the device says it can export dma-bufs (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)."""
        attr = getattr(self._cu.CUdevice_attribute, "CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED", None)
        if attr is None:
            return False
        return bool(self._check(self._cu.cuDeviceGetAttribute(attr, self._dev), "cuDeviceGetAttribute"))

    def _current(self) -> None:
        """Make this GPU's context current on the calling thread: a context is current per
        thread, and the calls below use whichever is (another GPU's, or none on a new thread)."""
        self._check(self._cu.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")

    def alloc(self, size: int) -> int:
        self._current()
        return int(self._check(self._cu.cuMemAlloc(size), f"cuMemAlloc({size})"))

    def free(self, ptr: int) -> None:
        self.refuse_held_free(ptr)
        self._current()
        self._check(self._cu.cuMemFree(ptr), f"cuMemFree({ptr:#x})")

    def write(self, ptr: int, data: bytes) -> None:
        self._current()
        self._check(self._cu.cuMemcpyHtoD(ptr, data, len(data)), "cuMemcpyHtoD")

    def read(self, ptr: int, size: int) -> bytes:
        self._current()
        out = bytearray(size)
        self._check(self._cu.cuMemcpyDtoH(out, ptr, size), "cuMemcpyDtoH")
        return bytes(out)
