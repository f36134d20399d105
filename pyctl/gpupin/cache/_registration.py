"""What a use of the cache holds: the entry a pin is kept under, and a Registration over it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .protocols import PinLike

if TYPE_CHECKING:
    from ._cache import RegistrationCache


class _Entry:
    __slots__ = ("id", "token", "start", "end", "buffer_id", "pin", "stale", "done", "maps")

    def __init__(self, eid: int, start: int, end: int, buffer_id: int, pin: PinLike) -> None:
        self.id = eid  # the slot in RegistrationCache._ents
        self.token = -1  # the C core's token (slot and generation), set when indexed
        self.start = start
        self.end = end
        self.buffer_id = buffer_id
        self.pin = pin
        self.stale = False  # out of the index; unpinned at the last release
        self.done = False  # unpinned
        self.maps: dict[str, Any] = {}

    @property
    def size(self) -> int:
        return self.end - self.start


class Registration:
    """A use of a cached pin covering [ptr, ptr + size).  Release it when the transfer is done."""

    # The cache's own handle: it calls RegistrationCache's private _entry_of, _dma_map and
    # _buffer_id_current, the one pair of classes in this package that share their private names.
    __slots__ = ("_cache", "_entry", "ptr", "size", "_released")

    def __init__(self, cache: RegistrationCache, entry: _Entry, ptr: int, size: int) -> None:
        self._cache = cache
        self._entry = entry
        self.ptr = ptr
        self.size = size
        self._released = False

    @property
    def token(self) -> int:
        return self._entry.token

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
    def buffer_id(self) -> int:
        """The provider's buffer id of the allocation pinned for this registration (what the
        cache checks a later use against)."""
        return int(self._entry.buffer_id)

    @property
    def offset(self) -> int:
        """Offset of ptr inside the pinned range."""
        return self.ptr - self.aligned_va

    @property
    def valid(self) -> bool:
        """What the cache's check of a lookup at ``ptr`` would say now (it is made on each read):
        False once the pin was invalidated (the kernel's validity word, with ``validate="kernel"``
        or ``"both"``), or once the memory at ``ptr`` is another allocation (its buffer id, queried
        now, with ``"buffer_id"`` or ``"both"``: GDS, NIXL, dma-buf pins the exporter never
        revokes, whose word stays valid after a free).  A read may raise what the provider's
        buffer-id query raises other than NotGpuMemory (which reads as False)."""
        e = self._entry
        if e.stale or not e.pin.is_valid():
            return False
        return self._cache._buffer_id_current(e, self.ptr)

    def dma_map(self, pci: str) -> Any:
        """A DMA mapping of the whole pinned range for PCI device ``pci`` (made once per entry)."""
        return self._cache._dma_map(self._entry, pci)

    def release(self) -> None:
        """Drop this registration's reference (once; later calls do nothing)."""
        if not self._released:
            self._released = True
            e = self._entry
            if self._cache._entry_of(e.token) is e:  # else the parent's, in a fork child
                self._cache.release_token(e.token)

    def __enter__(self) -> Registration:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"Registration(ptr={self.ptr:#x}, size={self.size}, handle={self.handle})"
