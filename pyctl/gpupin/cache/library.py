"""The base of the cache's devices that register memory with another library (cuFile, NIXL)."""

from __future__ import annotations

import weakref
from typing import Any

from .._closable import Closable
from ..errors import InvalidArgument
from ._cache import RegistrationCache


class LibraryRegistration:
    """One registration of an allocation with another library, at its own bounds: what the
    cache holds as its pin over a LibraryDriver."""

    __slots__ = ("handle", "va", "size", "aligned_va", "aligned_size", "entries", "slot", "valid_word")

    def __init__(self, handle: int, va: int, size: int) -> None:
        self.handle = handle
        self.va = va
        self.size = size
        self.aligned_va = va
        self.aligned_size = size
        self.entries = 1
        self.slot = 0
        self.valid_word = 0

    def is_valid(self) -> bool:
        return True  # no invalidation callback: the buffer-id check is the validity


class LibraryDriver(Closable):
    """Base of the cache's devices that register memory with another library (cuFile, NIXL):
    no invalidation records and no validity map (the cache runs with ``validate="buffer_id"``),
    allocations registered at their own bounds, and one cache per driver."""

    granule = 1  # register allocations at their own bounds (DeviceOffers reads this)
    library = "the library"
    cache_name = "cache"
    _cache: weakref.ref[RegistrationCache] | None = None

    def read_events(self) -> list[Any]:
        return []  # no invalidation callback: the buffer-id check is the validity

    def validity_map(self) -> Any:
        raise InvalidArgument(
            f"{self.library} has no validity map: use the registration cache with validate='buffer_id'"
        )

    def dma_map(self, handle: Any, pci: str) -> Any:
        raise InvalidArgument(f"{self.library} registrations are not DMA-mapped by gpupin: {self.library} maps them")

    def register_child(self, cache: Any) -> None:
        """RegistrationCache calls this: one cache per driver (the driver's records are its
        registrations, which a second cache would register again or deregister)."""
        old = self._cache() if self._cache is not None else None
        if old is not None and not old.closed:
            raise InvalidArgument(
                f"this {type(self).__name__} already has a {self.cache_name}: {self.library} keys registrations "
                "by address, so two caches over it would register the same memory twice and deregister each "
                "other's buffers; share the cache (it is thread safe)"
            )
        self._cache = weakref.ref(cache)

    def close_cache(self) -> None:
        """Close the cache over this driver (deregistering everything; InUse while one is held)."""
        cache = self._cache() if self._cache is not None else None
        if cache is not None:
            cache.close()
