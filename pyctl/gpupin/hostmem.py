"""Host memory handed out like device memory, and the first-fit allocator beneath it.

:class:`HostMemory` is a memory provider over real host memory: allocations carved
first-fit from one anonymous mapping, so a freed address comes back (as with
``cuMemAlloc``) under a new buffer id.  NIXL's DRAM transfers run over it
(:func:`gpupin.nixl.selftest`, ``gpupin bench``, the tests), where another agent
reads and writes the bytes.  :class:`FirstFit` is its address allocator, shared
with the test support's ``FakeMemory``.
"""

from __future__ import annotations

import array
import bisect
import itertools
import mmap
import threading
from typing import Any

from ._native import ffi, lib
from .errors import InvalidArgument, NotGpuMemory
from .memory import AllocationRange, ProviderBase


class FirstFit:
    """First-fit allocations from ``base`` up (below ``end`` if given), sizes rounded up to
    ``granule``, a new buffer id per allocation.  Allocating stays linear while nothing has
    been freed below the top (benchmarks hold 100,000 allocations)."""

    def __init__(self, base: int, *, granule: int, end: int | None = None) -> None:
        self.base = base
        self.granule = granule
        self.end = end
        self._bases: list[int] = []
        self._allocs: dict[int, AllocationRange] = {}
        self._ids = itertools.count(1)
        self._top = base  # end of the highest allocation
        self._holes = False  # a free() may have left a gap below _top
        self._lock = threading.Lock()

    def alloc(self, size: int, *, at: int | None = None) -> AllocationRange:
        """A new allocation of ``size`` bytes (rounded up), first fit or at ``at``."""
        if size <= 0:
            raise InvalidArgument(f"alloc(size={size}): size must be > 0")
        size = -(-size // self.granule) * self.granule
        with self._lock:
            va = self.base if at is None else at
            if at is None and not self._holes:
                va = self._top  # no gaps: first fit is the top
            elif at is None:
                gaps = False
                for b in self._bases:
                    if b - va >= size:
                        break
                    gaps = gaps or b > va
                    va = self._allocs[b].base + self._allocs[b].size
                else:
                    self._holes = gaps  # every gap was seen: none left means none at all
            elif self._find(at) is not None:
                raise InvalidArgument(f"alloc(at={at:#x}): address in use")
            if self.end is not None and va + size > self.end:
                used = f"the {self.end - self.base} bytes from {self.base:#x} are used up"
                raise InvalidArgument(f"alloc({size}): {used}")
            r = AllocationRange(va, size, next(self._ids))
            bisect.insort(self._bases, va)
            self._allocs[va] = r
            if va + size > self._top:
                self._holes = self._holes or va > self._top  # alloc(at=) past the top leaves a gap
                self._top = va + size
            return r

    def free(self, ptr: int) -> AllocationRange:
        """Forget the allocation starting at ``ptr`` and return it; NotGpuMemory if there is none."""
        with self._lock:
            r = self._allocs.pop(ptr, None)
            if r is None:
                raise NotGpuMemory(f"free({ptr:#x}): not the start of an allocation")
            self._bases.remove(ptr)
            if r.base + r.size != self._top:
                self._holes = True
            elif self._bases:
                last = self._allocs[self._bases[-1]]
                self._top = last.base + last.size
            else:
                self._top = self.base
            return r

    def find(self, ptr: int) -> AllocationRange | None:
        """The allocation containing ``ptr``, or None.  Under the lock: a free in another
        thread drops the allocation and its base in two steps."""
        with self._lock:
            return self._find(ptr)

    def _find(self, ptr: int) -> AllocationRange | None:
        i = bisect.bisect_right(self._bases, ptr) - 1
        if i < 0:
            return None
        r = self._allocs[self._bases[i]]
        return r if ptr < r.base + r.size else None

    def holding(self, ptr: int, what: str) -> AllocationRange:
        """The allocation containing ``ptr``; NotGpuMemory saying it is not ``what`` if none."""
        r = self.find(ptr)
        if r is None:
            raise NotGpuMemory(f"{ptr:#x} is not {what} (freed, or never allocated)")
        return r

    def for_write(self, ptr: int, n: int, what: str) -> AllocationRange:
        """:meth:`holding`, and [ptr, ptr + n) inside it (InvalidArgument past its end)."""
        r = self.holding(ptr, what)
        if ptr + n > r.base + r.size:
            raise InvalidArgument(f"write({ptr:#x}, {n} bytes): past the allocation")
        return r


class HostMemory(ProviderBase):
    """Real host memory handed out like device memory: first-fit allocations inside one
    anonymous mapping of ``size`` bytes, a new buffer id per allocation.  For NIXL's DRAM
    transfers, where another process or agent reads and writes the bytes.

    The buffer-id query is offered in C (``direct_buffer_id_query``): a table of the buffer
    id per granule, written by ``alloc`` and ``free``, read by ``gp_host_query`` (csrc/host.c),
    so a cache's validated hit runs no Python, as on CUDA memory.  ``granule`` must be a
    power of two."""

    name = "host"
    direct_buffer_id_query = True

    def __init__(self, size: int = 256 << 20, *, granule: int = 4096) -> None:
        if granule <= 0 or granule & (granule - 1):
            raise InvalidArgument(f"HostMemory(granule={granule}): a power of two, e.g. 4096")
        self._arena = mmap.mmap(-1, size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._view: Any = ffi.from_buffer(self._arena)  # holds the arena's address for others to use
        self.BASE = int(ffi.cast("uintptr_t", self._view))
        self.arena_size = size
        self.granule = granule
        self._fit = FirstFit(self.BASE, granule=granule, end=self.BASE + size)
        # The C query's table (host.c): one object, which the caches using it keep alive.
        self._shift = granule.bit_length() - 1
        ids = ffi.new("uint64_t[]", lib.GP_HOST_IDS + -(-size // granule))
        ids[lib.GP_HOST_BASE], ids[lib.GP_HOST_SIZE], ids[lib.GP_HOST_SHIFT] = self.BASE, size, self._shift
        self.c_buffer_id_ctx: Any = ids
        self.c_buffer_id_query: Any = ffi.addressof(lib, "gp_host_query")
        self._ids = memoryview(ffi.buffer(ids)).cast("Q")
        self._ids_lock = threading.Lock()  # an allocation and its ids change together

    def _mark(self, r: AllocationRange, buffer_id: int) -> None:
        first = lib.GP_HOST_IDS + ((r.base - self.BASE) >> self._shift)
        n = r.size >> self._shift
        self._ids[first : first + n] = array.array("Q", [buffer_id]) * n

    def alloc(self, size: int, *, at: int | None = None) -> int:
        with self._ids_lock:
            r = self._fit.alloc(size, at=at)
            self._mark(r, r.buffer_id)
        return r.base

    def free(self, ptr: int) -> None:
        self.refuse_held_free(ptr)
        with self._ids_lock:
            self._mark(self._fit.free(ptr), 0)

    def range_of(self, ptr: int) -> AllocationRange:
        return self._fit.holding(ptr, "HostMemory")

    def buffer_id(self, ptr: int) -> int:
        return self.range_of(ptr).buffer_id

    def enable_sync_memops(self, ptr: int) -> None:
        self.range_of(ptr)  # host memory is coherent: only check that it is ours

    def write(self, ptr: int, data: bytes) -> None:
        self._fit.for_write(ptr, len(data), "HostMemory")
        at = ptr - self.BASE
        self._arena[at : at + len(data)] = data

    def read(self, ptr: int, size: int) -> bytes:
        r = self.range_of(ptr)
        at = ptr - self.BASE
        return self._arena[at : at + min(size, r.base + r.size - ptr)]

    def fill(self, ptr: int, size: int, byte: int) -> None:
        """Set [ptr, ptr + size) to ``byte`` (allocation bounds unchecked: for tests)."""
        at = ptr - self.BASE
        self._arena[at : at + size] = bytes([byte]) * size

    def close(self) -> None:
        ctx = getattr(self, "c_buffer_id_ctx", None)
        if ctx is not None:
            ctx[lib.GP_HOST_SIZE] = 0  # a cache's later query finds nothing: its entries are stale
        if getattr(self, "_view", None) is not None:
            ffi.release(self._view)
            self._view = None
            self._arena.close()
