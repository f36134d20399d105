"""What every part of a RegistrationCache shares: its state, named once, and the small reads of it.

RegistrationCache.__init__ (_cache.py) sets each attribute declared here, and the parts built on
_State (_policy.py, _life.py, _hits.py) share them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from .._native import lib
from ..memory import MemoryProvider
from ._core import _Life
from ._records import _Inbox, _Records
from ._registration import _Entry
from .protocols import DeviceLike, ProviderOffers

_ID_MASK = 0xFFFFFFFF  # a token's slot; the generation is above it (csrc/gpc.c)
Validate = Literal["both", "kernel", "buffer_id"]
Backend = Literal["nvp2p", "dmabuf", "auto"]


@dataclass
class CacheStats:
    acquires: int = 0
    hits: int = 0
    misses: int = 0
    invalidations_kernel: int = 0
    invalidations_buffer_id: int = 0
    evictions_limit: int = 0
    evictions_pressure: int = 0
    pins: int = 0
    unpins: int = 0
    pin_failures: int = 0
    bytes_pinned: int = 0
    peak_bytes: int = 0
    regions: int = 0
    in_use: int = 0
    unpin_failures: int = 0


class _State:
    # What the cache was asked for.
    memory: MemoryProvider
    _provider: ProviderOffers  # what the memory offers beyond MemoryProvider
    max_bytes: int
    max_regions: int
    validate: Validate
    whole_allocation: bool
    sync_memops: bool
    backend: str
    dmabuf_pci: str | None
    _granule: int  # what the device registers in (GPU pages, or 1: an allocation's own bounds)
    _py_buffer_id: bool  # buffer ids are checked in Python (the provider has no query in C)

    # The C core and what lives as long as it (_Life: what the finalizer needs, with the device
    # and what it offers).
    _c: Any
    _c_query: tuple[Any, Any]
    _life: _Life
    _ents: list[_Entry | None]  # by slot: _life.ents, the same list
    _lookup: Any  # the core's lookup (lib.gpc_lookup), an attribute so that a test can stand in

    # The hit paths (chosen in _hits.py): fast_lookup is bound once by callers.
    fast_lookup: Callable[[int, int], int]
    release_token: Callable[[int], None]
    """Drop the reference a ``lookup``/``fast_lookup`` token holds (unpinning a stale entry)."""

    # Under _lock: the Python view of the index, the accounting, invalidation records.
    _lock: threading.RLock
    _free_ids: list[int]
    _by_handle: dict[int, _Entry]
    _records: _Records  # shared by the caches over the device
    _inbox: _Inbox
    _indexed: dict[int, _Entry]
    _st: CacheStats
    _py_buffer_id_stale: int
    _relookups: int  # lookups repeated under the lock: not acquires of their own

    # The process and the cache's own lifetime (_life.py).
    _pid: int
    _reopen: bool  # a fork child: open a device of its own before the next pin
    _closed: bool

    @property
    def device(self) -> DeviceLike:
        """The device pins are made on (in a fork child, after its first pin, one of its own)."""
        dev: DeviceLike = self._life.device
        return dev

    def _entry_of(self, token: int) -> _Entry | None:
        """The entry ``token`` names, if it is still that entry (not a reused slot)."""
        i = token & _ID_MASK
        e = self._ents[i] if 0 <= token and i < len(self._ents) else None
        return e if e is not None and e.token == token else None

    def held(self) -> int:
        """How many entries are referenced now (by registrations or tokens not yet released)."""
        return int(lib.gpc_held(self._c))
