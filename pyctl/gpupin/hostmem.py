"""Host memory handed out like device memory, and the first-fit allocator beneath it.

:class:`HostMemory` is a memory provider over real host memory: allocations carved
first-fit from one anonymous mapping, so a freed address comes back (as with
``cuMemAlloc``) under a new buffer id.  NIXL's DRAM transfers run over it
(:func:`gpupin.nixl.selftest`, ``gpupin bench``, the tests), where another agent
reads and writes the bytes.  :class:`FirstFit` is its address allocator, shared
with the test support's ``FakeMemory``.
"""

from __future__ import annotations

import bisect
import itertools
import mmap
import threading
from typing import Any

from ._native import ffi
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
    transfers, where another process or agent reads and writes the bytes."""

    name = "host"

    def __init__(self, size: int = 256 << 20, *, granule: int = 4096) -> None:
        self._arena = mmap.mmap(-1, size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._view: Any = ffi.from_buffer(self._arena)  # holds the arena's address for others to use
        self.BASE = int(ffi.cast("uintptr_t", self._view))
        self.arena_size = size
        self.granule = granule
        self._fit = FirstFit(self.BASE, granule=granule, end=self.BASE + size)

    def alloc(self, size: int, *, at: int | None = None) -> int:
        return self._fit.alloc(size, at=at).base

    def free(self, ptr: int) -> None:
        self.refuse_held_free(ptr)
        self._fit.free(ptr)

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
        if getattr(self, "_view", None) is not None:
            ffi.release(self._view)
            self._view = None
            self._arena.close()
