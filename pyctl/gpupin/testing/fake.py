"""In-process stand-ins for Device and a memory provider, for host tests and benchmarks.

``FakeDevice`` keeps its validity map in an anonymous shared mapping read the
same way as the kernel's page, so a cache hit costs what it costs against
gpupin.ko; ``FakeMemory`` hands out addresses first-fit (a freed address comes
back) with a new buffer id per allocation, and invalidates the fake pins on
free like the nv-p2p free callback.  Nothing here touches a kernel.

What the kernel says of a pin's future is modelled too: a non-persistent pin
is ``revocable`` (invalidated when its memory is freed); a persistent pin is
not, nor is a dma-buf pin from a static exporter (NVIDIA's, the default:
``dmabuf_revocable=False``), whose memory stays held, and its validity word
valid, until the pin goes.  Like the kernel, a FakeDevice refuses pins,
mappings and records to a process other than the one that made it
(ForkedDevice), and a child reads its validity words as 0; ``reopen()``
gives the calling process one of its own.
"""

from __future__ import annotations

import errno
import itertools
import mmap
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from .._native import ffi
from ..errors import BarExhausted, ForkedDevice, InvalidArgument, NotGpuMemory, PinInvalidated, UnknownHandle
from ..hostmem import FirstFit
from ..memory import AllocationRange

GPU_PAGE = 1 << 16


@dataclass(frozen=True)
class FakeEvent:
    handle: int
    user_tag: int
    reason: str
    slot: int


@dataclass(frozen=True)
class FakeMapping:
    handle: int
    mapping_id: int
    entries: int
    pci: str


class FakePin:
    __slots__ = (
        "device",
        "handle",
        "va",
        "size",
        "aligned_va",
        "aligned_size",
        "entries",
        "slot",
        "valid_word",
        "user_tag",
        "persistent",
        "dmabuf",
        "revocable",
        "base",
        "end",
    )

    def __init__(
        self,
        device: FakeDevice,
        handle: int,
        va: int,
        size: int,
        slot: int,
        tag: int,
        *,
        alloc: AllocationRange,
        persistent: bool = False,
        dmabuf: bool = False,
        revocable: bool = True,
    ) -> None:
        self.device = device
        self.handle = handle
        self.va = va
        self.size = size
        self.aligned_va = va & ~(GPU_PAGE - 1)
        self.aligned_size = -(-(va + size) // GPU_PAGE) * GPU_PAGE - self.aligned_va
        self.entries = self.aligned_size // GPU_PAGE
        self.slot = slot
        self.valid_word = handle
        self.user_tag = tag
        self.persistent = persistent
        self.dmabuf = dmabuf
        self.revocable = revocable
        self.base = alloc.base  # the allocation whose free invalidates (or not) this pin
        self.end = alloc.base + alloc.size

    def is_valid(self) -> bool:
        return self.device.read_word(self.slot) == self.valid_word


@dataclass(frozen=True)
class FakeInfo:
    dmabuf: bool = True


class FakeDevice:
    """Pins against a provider (FakeMemory, or CudaMemory on a GPU host without gpupin.ko);
    ``bar_size`` bytes of fake BAR, ``pin_latency`` seconds per pin; ``dmabuf_revocable``:
    the exporter of FakeMemory's dma-bufs revokes them on free (amdgpu, vfio-pci) instead of
    holding the memory (NVIDIA's static exporter)."""

    def __init__(
        self,
        memory: Any,
        *,
        bar_size: int = 0,
        pin_latency: float = 0.0,
        slots: int = 1 << 18,
        dmabuf_revocable: bool = False,
    ) -> None:
        self.memory = memory
        if isinstance(memory, FakeMemory):
            memory.devices.append(self)
        self.bar_size = bar_size
        self.pin_latency = pin_latency
        self.slots = slots
        self.dmabuf_revocable = dmabuf_revocable
        self._pid = os.getpid()
        self._map = mmap.mmap(-1, slots * 8, mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
        self._words = memoryview(self._map).cast("Q")
        self._free_slots = list(range(slots - 1, -1, -1))
        self._handles = itertools.count(1)
        self.pins: dict[int, FakePin] = {}
        self._live: dict[int, bool] = {}
        self.events: list[FakeEvent] = []
        self.bar_used = 0
        self.pin_calls = 0
        self.unpin_calls = 0
        self._lock = threading.Lock()

    def _check_pid(self, call: str) -> None:
        if self._pid != os.getpid():
            raise ForkedDevice(
                f"{call}: this FakeDevice was made by process {self._pid}, not this one ({os.getpid()}): "
                "use reopen() in the child",
                errno.EACCES,
            )

    @property
    def opener_pid(self) -> int:
        """The process that made this FakeDevice (Device.opener_pid)."""
        return self._pid

    def reopen(self) -> FakeDevice:
        """A FakeDevice of the calling process on the same memory (what Device.reopen() is)."""
        return FakeDevice(
            self.memory,
            bar_size=self.bar_size,
            pin_latency=self.pin_latency,
            slots=self.slots,
            dmabuf_revocable=self.dmabuf_revocable,
        )

    def close(self) -> None:
        """Nothing to release (the kernel's close would release the pins; tests count them)."""

    def info(self) -> FakeInfo:
        return FakeInfo(dmabuf=True)  # reading state is allowed from any process

    def read_word(self, slot: int) -> int:
        """What Device.read_word is: the fake validity map's word for ``slot``."""
        if self._pid != os.getpid():
            return 0  # the kernel's map is not inherited: a child reads the zero cover
        return int(self._words[slot])

    def pin(self, va: int, size: int, *, persistent: bool = False, user_tag: int = 0) -> FakePin:
        self._check_pid("PIN")
        if size <= 0:
            raise InvalidArgument(f"PIN(va={va:#x}, size={size}): size must be > 0", errno.EINVAL)
        if self.pin_latency:
            deadline = time.perf_counter() + self.pin_latency
            while time.perf_counter() < deadline:
                pass
        with self._lock:
            self.pin_calls += 1
            try:
                r = self.memory.range_of(va)
            except NotGpuMemory:
                r = None
            if r is None or va + size > r.base + r.size:
                raise NotGpuMemory(f"PIN(va={va:#x}, size={size}): not fake device memory", errno.EINVAL)
            p = FakePin(
                self,
                next(self._handles),
                va,
                size,
                self._free_slots.pop(),
                user_tag,
                alloc=r,
                persistent=persistent,
                revocable=not persistent,
            )
            return self._add(p, f"PIN(va={va:#x}, size={size})")

    def _add(self, p: FakePin, what: str) -> FakePin:
        if self.bar_size and self.bar_used + p.aligned_size > self.bar_size:
            self._free_slots.append(p.slot)
            raise BarExhausted(f"{what}: fake BAR exhausted", errno.ENOMEM)
        self.bar_used += p.aligned_size
        self._words[p.slot] = p.handle
        self.pins[p.handle] = p
        self._live[p.handle] = True
        return p

    def pin_dmabuf(
        self, fd: int, size: int | None = None, *, offset: int = 0, user_tag: int = 0, pci: str | None = None
    ) -> FakePin:
        """Pin a dma-buf that FakeMemory.export_dmabuf made (its memory, not its pages)."""
        self._check_pid("PIN_DMABUF")
        with self._lock:
            self.pin_calls += 1
            r = self.memory.exported(fd) if isinstance(self.memory, FakeMemory) else None
            if r is None:
                raise InvalidArgument(f"PIN_DMABUF(fd={fd}): not a dma-buf of this FakeMemory", errno.EINVAL)
            if size is None:
                size = r.size - offset
            if size <= 0 or offset < 0 or offset + size > r.size:
                raise InvalidArgument(f"PIN_DMABUF(fd={fd}, offset={offset}, size={size}): outside the buffer")
            p = FakePin(
                self,
                next(self._handles),
                offset,
                size,
                self._free_slots.pop(),
                user_tag,
                alloc=r,
                dmabuf=True,
                revocable=self.dmabuf_revocable,
            )
            return self._add(p, f"PIN_DMABUF(fd={fd}, size={size})")

    def unpin(self, handle: int | FakePin) -> None:
        h = handle.handle if isinstance(handle, FakePin) else handle
        self._check_pid("UNPIN")
        with self._lock:
            p = self.pins.pop(h, None)
            if p is None:
                raise UnknownHandle(f"UNPIN(handle={h}): no such pin", errno.ENOENT)
            self.unpin_calls += 1
            if self._live.pop(h):
                self.bar_used -= p.aligned_size
            self._words[p.slot] = 0
            self._free_slots.append(p.slot)

    def invalidate_range(self, base: int, end: int) -> None:
        """The memory [base, end) was freed: revoke its revocable pins (the others hold it).
        FakeMemory.free calls it, as nv-p2p's free callback reaches gpupin.ko."""
        with self._lock:
            for p in self.pins.values():
                if self._live.get(p.handle) and p.revocable and p.base < end and base < p.end:
                    self._live[p.handle] = False
                    self.bar_used -= p.aligned_size
                    self._words[p.slot] = 0
                    self.events.append(FakeEvent(p.handle, p.user_tag, "freed", p.slot))

    def validity_map(self) -> mmap.mmap:
        self._check_pid("mmap")
        return self._map

    def read_events(self) -> list[FakeEvent]:
        self._check_pid("read")
        with self._lock:
            out, self.events = self.events, []
        return out

    def dma_map(self, handle: int | FakePin, pci: str) -> FakeMapping:
        h = handle.handle if isinstance(handle, FakePin) else handle
        self._check_pid("DMA_MAP")
        p = self.pins.get(h)
        if p is None:
            raise UnknownHandle(f"DMA_MAP(handle={h}): no such pin", errno.ENOENT)
        if not self._live[h]:
            raise PinInvalidated(f"DMA_MAP(handle={h}): invalidated", errno.ENXIO)
        return FakeMapping(h, 1, p.entries, pci)

    def dma_unmap(self, mapping: FakeMapping) -> None:
        if mapping.handle not in self.pins:
            raise UnknownHandle("DMA_UNMAP: no such pin", errno.ENOENT)

    @property
    def live_pins(self) -> int:
        return sum(1 for v in self._live.values() if v)


def _fake_query(ctx: Any, ptr: int, out: Any) -> int:
    """FakeMemory's query for the cache's C hit path: ``ctx`` is a handle to the FakeMemory."""
    mem: FakeMemory = ffi.from_handle(ctx)
    return mem._c_query(ptr, out)


_fake_buffer_id_query: Any = ffi.callback("gpc_buffer_id_query_t", _fake_query, error=-1)


class FakeMemory:
    """Fake device memory: first-fit addresses, a new buffer id per allocation.

    ``direct_query=True``: the buffer-id query is offered to the cache's C hit path too
    (``direct_buffer_id_query``, ``c_buffer_id_query``: a C callback into this object, which
    ``c_buffer_id_ctx`` names), as CudaMemory offers libcuda's and SimMemory an ioctl: the
    cache then checks buffer ids in C, as it does on a GPU host."""

    name = "fake"
    BASE = 1 << 40

    def __init__(self, *, granule: int = GPU_PAGE, direct_query: bool = False) -> None:
        self.granule = granule  # sizes round up to this (1: exact, like a pool block)
        self.direct_buffer_id_query = direct_query
        self.c_buffer_id_query: Any = _fake_buffer_id_query if direct_query else None
        self.c_buffer_id_ctx: Any = ffi.new_handle(self) if direct_query else ffi.NULL
        self._fit = FirstFit(self.BASE, granule=granule)
        self.devices: list[FakeDevice] = []
        self.sync_memops_calls = 0
        self._synced: set[tuple[int, int]] = set()
        # Contents only of allocations that were written: a region costs its bookkeeping,
        # not its size (benchmarks hold 100,000 of them).
        self.data: dict[int, bytearray] = {}
        self._lock = threading.Lock()
        self._exports: dict[tuple[int, int], AllocationRange] = {}  # (st_dev, st_ino) -> allocation
        self.exports = 0

    def alloc(self, size: int, *, at: int | None = None) -> int:
        return self._fit.alloc(size, at=at).base

    def free(self, ptr: int) -> None:
        r = self._fit.free(ptr)
        self.data.pop(ptr, None)
        for d in self.devices:
            d.invalidate_range(r.base, r.base + r.size)

    def range_of(self, ptr: int) -> AllocationRange:
        return self._fit.holding(ptr, "fake device memory")

    def buffer_id(self, ptr: int) -> int:
        return self.range_of(ptr).buffer_id

    def _c_query(self, ptr: int, out: Any) -> int:
        """c_buffer_id_query: 0 and the buffer id in ``out[0]``, or 1 (no allocation there)."""
        r = self._fit.find(ptr)
        if r is None:
            return 1
        out[0] = r.buffer_id
        return 0

    def export_dmabuf(self, ptr: int) -> int:
        """A stand-in dma-buf fd of the allocation holding ``ptr`` (a memfd of its size; caller closes)."""
        r = self.range_of(ptr)
        fd = os.memfd_create("fake-dmabuf", os.MFD_CLOEXEC)
        os.ftruncate(fd, r.size)
        st = os.fstat(fd)
        with self._lock:
            self._exports[(st.st_dev, st.st_ino)] = r
            self.exports += 1
        return fd

    def exported(self, fd: int) -> AllocationRange | None:
        """The allocation that ``fd`` (from export_dmabuf) is a buffer of, or None."""
        try:
            st = os.fstat(fd)
        except OSError:
            return None
        with self._lock:
            return self._exports.get((st.st_dev, st.st_ino))

    def is_device_memory(self, ptr: int) -> bool:
        return self._fit.find(ptr) is not None

    def enable_sync_memops(self, ptr: int) -> None:
        r = self.range_of(ptr)
        if (r.base, r.buffer_id) not in self._synced:
            self._synced.add((r.base, r.buffer_id))
            self.sync_memops_calls += 1

    def write(self, ptr: int, data: bytes) -> None:
        r = self._fit.for_write(ptr, len(data), "fake device memory")
        buf = self.data.get(r.base)
        if buf is None:
            buf = self.data[r.base] = bytearray(r.size)
        buf[ptr - r.base : ptr - r.base + len(data)] = data

    def read(self, ptr: int, size: int) -> bytes:
        r = self.range_of(ptr)
        size = min(size, r.base + r.size - ptr)
        buf = self.data.get(r.base)
        return bytes(size) if buf is None else bytes(buf[ptr - r.base : ptr - r.base + size])

    def close(self) -> None:
        pass


class FakeCuFileError(Exception):
    """What cuda.bindings.cufile raises: ``status`` is the CUfileOpError number."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"{text} ({status})")
        self.status = status


class _Params:
    """Stand-ins for cufile's config-parameter enums (only names are compared)."""

    def __init__(self, *names: str) -> None:
        for n in names:
            setattr(self, n, n)


class FakeCuFile:
    """``cuda.bindings.cufile`` over a memory provider, as measured on cuFile 1.15 (compat mode).

    - registration is keyed by address and outlives the memory: after a free and a new
      allocation at the same address, ``buf_register`` answers MEMORY_ALREADY_REGISTERED
      (5023) until the old address is deregistered; deregistering after the free works;
    - a range past its allocation is CUDA_POINTER_RANGE_ERROR (5014), memory that is
      not the provider's CUDA_POINTER_INVALID (5012); a buffer over
      ``max_device_pinned_mem_size`` is INVALID_MAPPING_SIZE (5016);
    - ``bar_size`` (0 = unlimited) bounds the bytes registered at once, answered with
      GPU_MEMORY_PINNING_FAILED (5036): what nvidia-fs mode runs out of;
    - ``register_latency`` seconds per registration (4-5 ms measured for 64 KiB-1 MiB).
    """

    cuFileError = FakeCuFileError
    SizeTConfigParameter = _Params(
        "PROPERTIES_MAX_DEVICE_PINNED_MEM_SIZE_KB",
        "PROPERTIES_PER_BUFFER_CACHE_SIZE_KB",
        "PROPERTIES_MAX_DIRECT_IO_SIZE_KB",
    )
    BoolConfigParameter = _Params("PROPERTIES_ALLOW_COMPAT_MODE", "FORCE_COMPAT_MODE")

    def __init__(
        self,
        memory: Any,
        *,
        bar_size: int = 0,
        max_pinned: int = 32 << 30,
        register_latency: float = 0.0,
        bar1_kb: int = 128 << 20,
    ) -> None:
        self.memory = memory
        self.bar_size = bar_size
        self.max_pinned = max_pinned
        self.register_latency = register_latency
        self.bar1_kb = bar1_kb
        self.registered: dict[int, int] = {}
        self.opened = 0
        self.register_calls = 0
        self.deregister_calls = 0
        self.handle_register_status = 0  # set to a CUfileOpError to refuse files
        self.deregister_status = 0  # set to a CUfileOpError to refuse the next deregistration
        self._lock = threading.Lock()

    def driver_open(self) -> None:
        self.opened += 1

    def driver_close(self) -> None:
        if self.opened == 0:
            raise FakeCuFileError(5001, "DRIVER_NOT_INITIALIZED")
        self.opened -= 1

    def get_version(self) -> int:
        return 1150

    def get_bar_size_in_kb(self, gpu: int) -> int:
        return self.bar1_kb

    def get_parameter_size_t(self, param: str) -> int:
        return {
            "PROPERTIES_MAX_DEVICE_PINNED_MEM_SIZE_KB": self.max_pinned >> 10,
            "PROPERTIES_PER_BUFFER_CACHE_SIZE_KB": 1024,
            "PROPERTIES_MAX_DIRECT_IO_SIZE_KB": 16384,
        }[param]

    def get_parameter_bool(self, param: str) -> bool:
        return param == "PROPERTIES_ALLOW_COMPAT_MODE"

    def buf_register(self, ptr: int, length: int, flags: int) -> None:
        if self.register_latency:
            time.sleep(self.register_latency)
        with self._lock:
            self.register_calls += 1
            if not self.opened:
                raise FakeCuFileError(5001, "DRIVER_NOT_INITIALIZED")
            if ptr in self.registered:
                raise FakeCuFileError(5023, "MEMORY_ALREADY_REGISTERED")
            try:
                r = self.memory.range_of(ptr)
            except NotGpuMemory:
                raise FakeCuFileError(5012, "CUDA_POINTER_INVALID") from None
            if ptr + length > r.base + r.size:
                raise FakeCuFileError(5014, "CUDA_POINTER_RANGE_ERROR")
            if length > self.max_pinned:
                raise FakeCuFileError(5016, "INVALID_MAPPING_SIZE")
            if self.bar_size and sum(self.registered.values()) + length > self.bar_size:
                raise FakeCuFileError(5036, "GPU_MEMORY_PINNING_FAILED")
            self.registered[ptr] = length

    def buf_deregister(self, ptr: int) -> None:
        with self._lock:
            self.deregister_calls += 1
            if self.deregister_status:
                st, self.deregister_status = self.deregister_status, 0
                raise FakeCuFileError(st, "INTERNAL_ERROR")
            if self.registered.pop(ptr, None) is None:
                raise FakeCuFileError(5024, "MEMORY_NOT_REGISTERED")

    # -- files: compat mode's POSIX path, into the provider's memory ----------------
    class Descr:
        def __init__(self) -> None:
            self.type: Any = None
            self.handle = type("H", (), {"fd": -1})()
            self.fs_ops = 0
            self.ptr = self

    class FileHandleType:
        OPAQUE_FD = 1

    def handle_register(self, descr: Any) -> int:
        if self.handle_register_status:
            raise FakeCuFileError(self.handle_register_status, "HANDLE_NOT_REGISTERED")
        return int(descr.handle.fd) + 1000

    def handle_deregister(self, fh: int) -> None:
        pass

    def read(self, fh: int, base: int, size: int, offset: int, buf_offset: int) -> int:
        with open(f"/proc/self/fd/{fh - 1000}", "rb") as f:  # the POSIX path, without O_DIRECT
            f.seek(offset)
            data = f.read(size)
        self.memory.write(base + buf_offset, data)
        return len(data)

    def write(self, fh: int, base: int, size: int, offset: int, buf_offset: int) -> int:
        with open(f"/proc/self/fd/{fh - 1000}", "r+b") as f:
            f.seek(offset)
            return f.write(self.memory.read(base + buf_offset, size))
