"""What the registration cache asks of what it is given: the device it pins on, the memory
provider it asks about allocations, the pins the device makes and the records it queues.

Each has a part that all of them offer (DeviceLike, :class:`gpupin.memory.MemoryProvider`,
PinLike) and capabilities that only some do.  Those are read here, once per object:
DeviceOffers.of when a cache takes a device (at its making, and in a fork child when it opens
its own), ProviderOffers.of when it is made, PinFacts.of for each pin it makes.  The rest of the
cache calls what these say and probes for nothing itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

GPU_PAGE = 1 << 16  # what nv-p2p pins in, and the granule of a device that names none


class DeviceLike(Protocol):
    """What every device offers the cache: Device, FakeDevice and the library drivers."""

    def pin(self, va: int, size: int, *, persistent: bool = False, user_tag: int = 0) -> Any: ...

    def unpin(self, handle: Any) -> None: ...

    def read_events(self) -> list[Any]: ...

    def dma_map(self, handle: Any, pci: str) -> Any: ...

    def validity_map(self) -> Any: ...


class PinLike(Protocol):
    """What the cache reads of every pin a device makes: the handle it unpins it by, the range
    pinned (what a Registration reports) and whether the pin is still valid."""

    handle: int
    aligned_va: int
    aligned_size: int
    entries: int

    def is_valid(self) -> bool: ...


@dataclass(frozen=True)
class DeviceOffers:
    """What a device may offer the cache beyond DeviceLike; None where it offers nothing."""

    granule: int
    """What pins are made in: whole 64 KiB GPU pages for nv-p2p (GPU_PAGE, where the device names
    none); 1 for a library that registers an allocation at its own bounds (LibraryDriver)."""
    register_child: Callable[[Any], None] | None
    """Takes the cache when it starts to pin on the device, which closes it when it closes."""
    unregister_child: Callable[[Any], None] | None
    """Lets the cache go when it leaves the device for one of its own (in a fork child)."""
    reopen: Callable[[], Any] | None
    """A device of the calling process over the same memory, which a fork child's cache pins
    through; without it the child's first pin raises ForkedDevice."""
    opener_pid: int | None
    """The process that opened the device (said by that ForkedDevice)."""
    pin_dmabuf: Callable[..., Any] | None
    """Pins a dma-buf: ``pin_dmabuf(fd, user_tag=, pci=)``, the dma-buf backend's pin."""
    dma_unmap: Callable[[Any], None] | None
    """Undoes what ``dma_map`` gave."""

    @classmethod
    def of(cls, device: Any) -> DeviceOffers:
        return cls(
            granule=int(getattr(device, "granule", GPU_PAGE)),
            register_child=getattr(device, "register_child", None),
            unregister_child=getattr(device, "unregister_child", None),
            reopen=getattr(device, "reopen", None),
            opener_pid=getattr(device, "opener_pid", None),
            pin_dmabuf=getattr(device, "pin_dmabuf", None),
            dma_unmap=getattr(device, "dma_unmap", None),
        )

    def pins_dmabuf(self, device: Any) -> bool:
        """Whether ``device`` (the one these were read of) pins dma-bufs: it has ``pin_dmabuf``,
        and its ``info()`` says its kernel module does."""
        return self.pin_dmabuf is not None and bool(getattr(device.info(), "dmabuf", False))

    def unmap(self, mapping: Any) -> None:
        """``dma_unmap(mapping)``: a device that gave a mapping takes it back."""
        if self.dma_unmap is None:
            raise AttributeError(f"the device made the DMA mapping {mapping!r} and has no dma_unmap")
        self.dma_unmap(mapping)


@dataclass(frozen=True)
class ProviderOffers:
    """What a memory provider may offer the cache beyond MemoryProvider; None where nothing."""

    c_query: tuple[Any, Any] | None
    """Its buffer-id query in C and that query's context (``c_buffer_id_query`` and
    ``c_buffer_id_ctx``, either None for NULL), where it says ``direct_buffer_id_query``:
    the hit path then checks buffer ids without Python (:mod:`gpupin.memory` says more)."""
    export_dmabuf: Callable[[int], int] | None
    """The allocation at an address as a dma-buf fd, for the dma-buf backend."""

    @classmethod
    def of(cls, memory: Any) -> ProviderOffers:
        c_query = None
        if getattr(memory, "direct_buffer_id_query", False):
            c_query = (getattr(memory, "c_buffer_id_query", None), getattr(memory, "c_buffer_id_ctx", None))
        export = getattr(memory, "export_dmabuf", None)
        return cls(c_query=c_query, export_dmabuf=export if callable(export) else None)


@dataclass(frozen=True)
class PinFacts:
    """What a pin may say of itself beyond PinLike; a pin that says nothing (a library's
    registration) is none of them, with slot and word 0."""

    slot: int
    """Its word in the device's validity map."""
    valid_word: int
    """What that word holds while the pin is valid."""
    revocable: bool
    """The kernel invalidates the pin when its memory goes."""
    dmabuf: bool
    persistent: bool

    @classmethod
    def of(cls, pin: PinLike) -> PinFacts:
        return cls(
            slot=getattr(pin, "slot", 0),
            valid_word=getattr(pin, "valid_word", 0),
            revocable=bool(getattr(pin, "revocable", False)),
            dmabuf=bool(getattr(pin, "dmabuf", False)),
            persistent=bool(getattr(pin, "persistent", False)),
        )


def is_overflow(record: Any) -> bool:
    """Whether a device's invalidation record says that records were lost (reason "overflow"):
    every cache over the device then checks all of its pins.  A record without a reason is not."""
    return bool(getattr(record, "reason", "") == "overflow")
