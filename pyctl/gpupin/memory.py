"""Memory providers: where device memory comes from and what it is.

A provider answers, for a device pointer, the allocation that holds it (base
and size) and its buffer id, which changes whenever the allocation is freed
and another takes its place.  Providers that can also export an allocation as
a dma-buf have ``export_dmabuf(ptr) -> fd`` (the registration cache's dma-buf
backend uses it).  The registration cache and the tests use only
this interface; :class:`gpupin.sim.SimMemory` and
:class:`gpupin.cuda.CudaMemory` implement it.

A provider may also offer its buffer-id query in C, for the cache's hit path
to call without Python: ``direct_buffer_id_query`` True, ``c_buffer_id_query``
a cffi pointer to a ``gpc_buffer_id_query_t`` (``int (*)(void *ctx, uint64_t
ptr, uint64_t *out)``: 0 and the id, or non-zero for no allocation there) and
``c_buffer_id_ctx`` its first argument (``ffi.NULL`` if it needs none), both
alive as long as the provider.  The query runs under the cache core's mutex,
with the GIL held: it must not wait for either.  A provider without one has
its buffer ids checked in Python, through ``buffer_id``.  What the cache reads
of a provider beyond this interface, :class:`gpupin.cache.protocols.ProviderOffers`
names.

The providers gpupin ships (:class:`ProviderBase`) also keep *free holds*:
``hold_free(ptr, why)`` makes ``free`` of the allocation holding ``ptr`` raise
:class:`~gpupin.errors.InUse` (naming ``why``) until ``release_free_hold``.
:class:`gpupin.nixl.NixlEndpoint` holds every allocation it exposes to peers
this way, so that memory a peer may still write is never handed to a new
owner through the provider.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ._closable import Closable
from .errors import InUse, NotGpuMemory


@dataclass(frozen=True)
class AllocationRange:
    """The allocation holding a pointer: [base, base + size), with its buffer id."""

    base: int
    size: int
    buffer_id: int


@runtime_checkable
class MemoryProvider(Protocol):
    """What gpupin needs to know about device memory."""

    name: str

    def range_of(self, ptr: int) -> AllocationRange:
        """The allocation containing ``ptr``; NotGpuMemory if there is none."""
        ...

    def buffer_id(self, ptr: int) -> int:
        """The buffer id of the allocation containing ``ptr``; NotGpuMemory if none."""
        ...

    def is_device_memory(self, ptr: int) -> bool: ...

    def enable_sync_memops(self, ptr: int) -> None:
        """Make DMA through a pin coherent with the GPU's own writes (SYNC_MEMOPS)."""
        ...

    def alloc(self, size: int) -> int: ...

    def free(self, ptr: int) -> None: ...

    def write(self, ptr: int, data: bytes) -> None: ...

    def read(self, ptr: int, size: int) -> bytes: ...


class ProviderBase(Closable):
    """What the providers share: ``is_device_memory`` from ``range_of``, closing, and free
    holds (``hold_free``; each provider's ``free`` calls ``refuse_held_free`` first)."""

    _free_holds: dict[int, tuple[int, str]]  # hold -> (allocation base, why)
    _free_holds_lock = threading.Lock()  # guards every provider's _free_holds; held for no call out
    _free_hold_ids = itertools.count(1)

    def hold_free(self, ptr: int, why: str) -> int:
        """Refuse ``free`` of the allocation holding ``ptr`` (InUse naming ``why``) until
        ``release_free_hold`` of the returned hold.  Holds nest: one per holder."""
        base = self.range_of(ptr).base
        with self._free_holds_lock:
            holds = self.__dict__.setdefault("_free_holds", {})
            hold = next(self._free_hold_ids)
            holds[hold] = (base, why)
        return hold

    def release_free_hold(self, hold: int) -> None:
        with self._free_holds_lock:
            self.__dict__.get("_free_holds", {}).pop(hold, None)

    def refuse_held_free(self, ptr: int) -> None:
        """InUse if a holder keeps the allocation at ``ptr`` from being freed."""
        with self._free_holds_lock:
            why = [w for base, w in self.__dict__.get("_free_holds", {}).values() if base == ptr]
        if why:
            raise InUse(
                f"free({ptr:#x}): the allocation is held: {why[0]}"
                + (f" (and {len(why) - 1} more)" if len(why) > 1 else "")
            )

    def range_of(self, ptr: int) -> AllocationRange:
        raise NotImplementedError

    def is_device_memory(self, ptr: int) -> bool:
        try:
            self.range_of(ptr)
        except NotGpuMemory:
            return False
        return True
