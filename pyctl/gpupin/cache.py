"""A lazy-unpinning registration cache (pin-down cache) over a gpupin Device.

The GPUDirect RDMA recipe, made cheap: on first use pin the whole allocation
that holds a buffer and remember its buffer id; on every use validate the
entry (the kernel's validity word, the provider's buffer id, or both) and pin
again if it went stale; unpin lazily, least recently used first, when a limit
is reached or the GPU runs out of BAR space.  Entries in use are never
evicted.  One entry per allocation: buffer ids are per allocation, so entries
never merge across allocations.
"""

from __future__ import annotations

import bisect
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, Literal, Protocol

from .errors import BarExhausted, BudgetExceeded, GpupinError, InvalidArgument, NotGpuMemory, UnknownHandle
from .memory import MemoryProvider

GPU_PAGE = 1 << 16
Validate = Literal["both", "kernel", "tag"]


class PinLike(Protocol):
    handle: int
    aligned_va: int
    aligned_size: int
    entries: int

    def is_valid(self) -> bool: ...


class DeviceLike(Protocol):
    def pin(self, va: int, size: int, *, persistent: bool = False, user_tag: int = 0) -> Any: ...

    def unpin(self, handle: Any) -> None: ...

    def read_events(self) -> list[Any]: ...

    def dma_map(self, handle: Any, pci: str) -> Any: ...


class CacheFull(BudgetExceeded):
    """Nothing can be evicted to make room: every cached region is in use."""


@dataclass
class CacheStats:
    acquires: int = 0
    hits: int = 0
    misses: int = 0
    invalidations_kernel: int = 0
    invalidations_tag: int = 0
    evictions_limit: int = 0
    evictions_pressure: int = 0
    pins: int = 0
    unpins: int = 0
    pin_failures: int = 0
    bytes_pinned: int = 0
    peak_bytes: int = 0
    regions: int = 0
    in_use: int = 0


class _Entry:
    __slots__ = ("start", "end", "buffer_id", "pin", "refs", "stale", "maps", "alloc_base")

    def __init__(self, start: int, end: int, buffer_id: int, pin: Any, alloc_base: int) -> None:
        self.start = start
        self.end = end
        self.buffer_id = buffer_id
        self.pin = pin
        self.refs = 0
        self.stale = False      # out of the index; unpinned at the last release
        self.maps: dict[str, Any] = {}
        self.alloc_base = alloc_base

    @property
    def size(self) -> int:
        return self.end - self.start


class Registration:
    """A use of a cached pin covering [ptr, ptr + size).  Release it when the transfer is done."""

    __slots__ = ("_cache", "_entry", "ptr", "size", "_released")

    def __init__(self, cache: RegistrationCache, entry: _Entry, ptr: int, size: int) -> None:
        self._cache = cache
        self._entry = entry
        self.ptr = ptr
        self.size = size
        self._released = False

    @property
    def handle(self) -> int:
        return int(self._entry.pin.handle)

    @property
    def aligned_va(self) -> int:
        return int(self._entry.pin.aligned_va)

    @property
    def aligned_size(self) -> int:
        return int(self._entry.pin.aligned_size)

    @property
    def entries(self) -> int:
        return int(self._entry.pin.entries)

    @property
    def offset(self) -> int:
        """Offset of ptr inside the pinned range."""
        return self.ptr - self.aligned_va

    @property
    def valid(self) -> bool:
        """False once the memory was freed (the pin was invalidated) while in use."""
        return not self._entry.stale and bool(self._entry.pin.is_valid())

    def dma_map(self, pci: str) -> Any:
        """A DMA mapping of the whole pinned range for PCI device ``pci`` (made once per entry)."""
        return self._cache._dma_map(self._entry, pci)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._cache._release(self._entry)

    def __enter__(self) -> Registration:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"Registration(ptr={self.ptr:#x}, size={self.size}, handle={self.handle})"


def _forget_in_child(ref: weakref.ref[RegistrationCache]) -> Callable[[], None]:
    def hook() -> None:
        cache = ref()
        if cache is not None:
            cache._forget()
    return hook


class RegistrationCache:
    """Pin-down cache.  Thread safe; empty in a forked child (pins belong to the parent's file)."""

    def __init__(
        self,
        device: DeviceLike,
        memory: MemoryProvider,
        *,
        max_bytes: int = 0,
        max_regions: int = 0,
        validate: Validate = "both",
        whole_allocation: bool = True,
        sync_memops: bool = True,
    ) -> None:
        if validate not in ("both", "kernel", "tag"):
            raise InvalidArgument(f"validate={validate!r}: use 'both', 'kernel' or 'tag'")
        if max_bytes < 0 or max_regions < 0:
            raise InvalidArgument("max_bytes and max_regions must be >= 0 (0 = unlimited)")
        self.device = device
        self.memory = memory
        self.max_bytes = max_bytes
        self.max_regions = max_regions
        self.validate = validate
        self.whole_allocation = whole_allocation
        self.sync_memops = sync_memops
        self._check_kernel = validate in ("both", "kernel")
        self._check_tag = validate in ("both", "tag")
        self._lock = threading.RLock()
        self._starts: list[int] = []          # sorted starts of indexed entries
        self._entries: list[_Entry] = []       # parallel to _starts
        self._by_handle: dict[int, _Entry] = {}
        self._lru: OrderedDict[int, _Entry] = OrderedDict()   # unused entries, oldest first
        self._stats = CacheStats()
        self._pid = os.getpid()
        os.register_at_fork(after_in_child=_forget_in_child(weakref.ref(self)))

    # -- lookup ----------------------------------------------------------------
    def _find(self, ptr: int, end: int) -> _Entry | None:
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i >= 0:
            e = self._entries[i]
            if end <= e.end:
                return e
        return None

    def acquire(self, ptr: int, size: int) -> Registration:
        """A registration covering [ptr, ptr + size), pinning the allocation on first use."""
        if size <= 0:
            raise InvalidArgument(f"acquire(ptr={ptr:#x}, size={size}): size must be > 0")
        end = ptr + size
        with self._lock:
            if self._pid != os.getpid():
                self._forget()
            st = self._stats
            st.acquires += 1
            e = self._find(ptr, end)
            if e is not None:
                reason = self._stale_reason(e, ptr)
                if reason is None:
                    st.hits += 1
                    self._use(e)
                    return Registration(self, e, ptr, size)
                self._invalidate(e, reason)
            st.misses += 1
            e = self._insert(ptr, end)
            self._use(e)
            return Registration(self, e, ptr, size)

    def _stale_reason(self, e: _Entry, ptr: int) -> str | None:
        if self._check_kernel and not e.pin.is_valid():
            return "kernel"
        if self._check_tag:
            try:
                if self.memory.buffer_id(ptr) != e.buffer_id:
                    return "tag"
            except NotGpuMemory:
                return "tag"
        return None

    def _use(self, e: _Entry) -> None:
        if e.refs == 0:
            self._lru.pop(id(e), None)
            self._stats.in_use += 1
        e.refs += 1

    # -- insert / evict ----------------------------------------------------------
    def _insert(self, ptr: int, end: int) -> _Entry:
        self._drain_locked()
        r = self.memory.range_of(ptr)   # raises NotGpuMemory for freed/host memory
        if end > r.base + r.size:
            raise InvalidArgument(
                f"acquire(ptr={ptr:#x}, size={end - ptr}): the range runs past its allocation "
                f"[{r.base:#x}, {r.base + r.size:#x}); register each allocation separately")
        if self.whole_allocation:
            start = r.base & ~(GPU_PAGE - 1)
            stop = -(-(r.base + r.size) // GPU_PAGE) * GPU_PAGE
        else:
            start = ptr & ~(GPU_PAGE - 1)
            stop = -(-end // GPU_PAGE) * GPU_PAGE
        need = stop - start
        if self.max_bytes and need > self.max_bytes:
            raise CacheFull(f"acquire: the allocation needs {need} bytes, more than max_bytes={self.max_bytes}")
        if self.sync_memops:
            self.memory.enable_sync_memops(ptr)
        # Anything indexed over this range is stale: live allocations do not overlap.
        for old in self._overlapping(start, stop):
            self._invalidate(old, "tag")
        self._make_room(need)
        pin = self._pin(start, need, r.base)
        e = _Entry(start, stop, r.buffer_id, pin, r.base)
        i = bisect.bisect_left(self._starts, start)
        self._starts.insert(i, start)
        self._entries.insert(i, e)
        self._by_handle[int(pin.handle)] = e
        st = self._stats
        st.pins += 1
        st.regions += 1
        st.bytes_pinned += need
        st.peak_bytes = max(st.peak_bytes, st.bytes_pinned)
        return e

    def _overlapping(self, start: int, stop: int) -> list[_Entry]:
        i = bisect.bisect_left(self._starts, stop)
        out = []
        while i > 0:
            i -= 1
            e = self._entries[i]
            if e.end <= start:
                # Entries do not overlap each other, so none further left reaches start.
                break
            out.append(e)
        return out

    def _make_room(self, need: int) -> None:
        st = self._stats
        while (self.max_regions and st.regions + 1 > self.max_regions) or \
                (self.max_bytes and st.bytes_pinned + need > self.max_bytes):
            if not self._lru:
                raise CacheFull(
                    f"acquire: needs {need} bytes but {st.bytes_pinned} bytes in {st.regions} regions "
                    f"are cached and all {st.in_use} in use (max_bytes={self.max_bytes}, "
                    f"max_regions={self.max_regions}): release registrations first")
            self._evict_lru()
            st.evictions_limit += 1

    def _pin(self, start: int, size: int, tag: int) -> Any:
        st = self._stats
        while True:
            try:
                return self.device.pin(start, size, user_tag=tag)
            except (BarExhausted, BudgetExceeded) as exc:
                st.pin_failures += 1
                self._drain_locked()
                if not self._lru:
                    kind = "BAR space" if isinstance(exc, BarExhausted) else "gpupin budget"
                    raise type(exc)(
                        f"pin of {size} bytes at {start:#x} failed ({kind} exhausted) and nothing is "
                        f"evictable: {st.bytes_pinned} bytes pinned in {st.regions} regions, "
                        f"{st.in_use} in use; release registrations or raise the limit", exc.errno) from exc
                self._evict_lru()
                st.evictions_pressure += 1
            except GpupinError:
                st.pin_failures += 1
                raise

    def _evict_lru(self) -> None:
        _, e = self._lru.popitem(last=False)
        self._remove(e)
        self._unpin(e)

    def _remove(self, e: _Entry) -> None:
        """Take e out of the index and the accounting (not the LRU)."""
        i = bisect.bisect_left(self._starts, e.start)
        while i < len(self._entries) and self._entries[i] is not e:
            i += 1
        if i < len(self._entries):
            del self._starts[i]
            del self._entries[i]
        self._by_handle.pop(int(e.pin.handle), None)
        st = self._stats
        st.regions -= 1
        st.bytes_pinned -= e.size

    def _unpin(self, e: _Entry) -> None:
        for m in e.maps.values():
            try:
                self.device.dma_unmap(m)  # type: ignore[attr-defined]
            except GpupinError:
                pass  # the mapping went with an invalidated pin
        e.maps.clear()
        try:
            self.device.unpin(e.pin.handle)
        except UnknownHandle:
            pass
        self._stats.unpins += 1

    def _invalidate(self, e: _Entry, reason: str) -> None:
        if e.stale:
            return
        st = self._stats
        if reason == "kernel":
            st.invalidations_kernel += 1
        else:
            st.invalidations_tag += 1
        self._remove(e)
        e.stale = True
        if e.refs == 0:
            self._lru.pop(id(e), None)
            self._unpin(e)

    def _release(self, e: _Entry) -> None:
        with self._lock:
            if self._pid != os.getpid():
                return
            e.refs -= 1
            if e.refs:
                return
            self._stats.in_use -= 1
            if e.stale:
                self._unpin(e)
            else:
                self._lru[id(e)] = e

    def _dma_map(self, e: _Entry, pci: str) -> Any:
        with self._lock:
            m = e.maps.get(pci)
            if m is None:
                m = self.device.dma_map(e.pin.handle, pci)
                e.maps[pci] = m
            return m

    # -- invalidation records ------------------------------------------------------
    def _drain_locked(self) -> int:
        n = 0
        for ev in self.device.read_events():
            e = self._by_handle.get(int(ev.handle))
            if e is not None:
                self._invalidate(e, "kernel")
                n += 1
            elif getattr(ev, "reason", "") == "overflow":
                for e in list(self._entries):
                    if not e.pin.is_valid():
                        self._invalidate(e, "kernel")
                        n += 1
        return n

    def drain(self) -> int:
        """Apply queued invalidation records now; returns how many entries went."""
        with self._lock:
            return self._drain_locked()

    # -- housekeeping ----------------------------------------------------------------
    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(**{f.name: getattr(self._stats, f.name) for f in fields(CacheStats)})

    def purge(self) -> int:
        """Unpin every unused entry; returns how many."""
        with self._lock:
            n = 0
            while self._lru:
                self._evict_lru()
                n += 1
            return n

    def _forget(self) -> None:
        """In a forked child: the pins belong to the parent's file; start empty."""
        self._pid = os.getpid()
        self._lock = threading.RLock()
        self._starts, self._entries = [], []
        self._by_handle.clear()
        self._lru.clear()
        self._stats = CacheStats()

    def __len__(self) -> int:
        return len(self._entries)
