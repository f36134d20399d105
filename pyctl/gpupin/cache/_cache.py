"""RegistrationCache: how one is set up, and acquire, its front door.  What it does is in the
parts it is built on, each one class on the one before: _hits.py, _life.py, _policy.py, _state.py."""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

from .._native import ffi, lib
from ..errors import InvalidArgument
from ..memory import MemoryProvider
from ._core import _Life
from ._hits import _HitPaths
from ._life import _LIVE
from ._records import _records_of
from ._registration import Registration
from ._state import Backend, CacheStats, Validate
from .protocols import DeviceLike, DeviceOffers, ProviderOffers


class RegistrationCache(_HitPaths):
    """Pin-down cache.  Thread safe.

    ``close()`` unpins everything, and refuses (InUse) while any registration or token is
    held: release them first.  A cache dropped without ``close()`` unpins what nobody holds.
    In a forked child the cache starts empty (the parent's pins stay the parent's: nothing is
    unpinned) and opens its own device at its first pin (``device.reopen()``), which it then
    owns and closes.  With ``validate="kernel"`` every pin must be revocable (the kernel
    invalidates it when the memory goes); any other pin raises NotRevocable at its insertion.
    """

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
        backend: Backend = "nvp2p",
        dmabuf_pci: str | None = None,
    ) -> None:
        """``dmabuf_pci``: with the dma-buf backend, the PCI device each buffer is imported for
        (``Device.pin_dmabuf(pci=)``); an exporter that can revoke its buffers needs one."""
        if validate not in ("both", "kernel", "buffer_id"):
            raise InvalidArgument(f"validate={validate!r}: use 'both', 'kernel' or 'buffer_id'")
        offers, provider = DeviceOffers.of(device), ProviderOffers.of(memory)
        self.backend = _pick_backend(backend, device, offers, memory, provider)
        if dmabuf_pci is not None and self.backend != "dmabuf":
            raise InvalidArgument(f"dmabuf_pci={dmabuf_pci!r}: only for the dma-buf backend (backend={self.backend!r})")
        self.dmabuf_pci = dmabuf_pci
        if max_bytes < 0 or max_regions < 0:
            raise InvalidArgument("max_bytes and max_regions must be >= 0 (0 = unlimited)")
        self.memory = memory
        self._provider = provider
        self.max_bytes = max_bytes
        self.max_regions = max_regions
        self.validate = validate
        self.whole_allocation = whole_allocation
        self.sync_memops = sync_memops
        self._granule = offers.granule
        check_kernel = validate in ("both", "kernel")
        check_buffer_id = validate in ("both", "buffer_id")
        # The buffer-id check runs in C when the provider offers a query in C (ProviderOffers):
        # CudaMemory's libcuda call, SimMemory's ioctl, FakeMemory(direct_query=True).
        c_query = provider.c_query if check_buffer_id else None
        c_buffer_id = c_query is not None
        self._py_buffer_id = check_buffer_id and not c_buffer_id
        map_buf: Any = None
        words, nwords = ffi.NULL, 0
        if check_kernel:
            map_buf = ffi.from_buffer("uint64_t[]", device.validity_map())
            words, nwords = map_buf, len(map_buf)
        self._c = ffi.gc(lib.gpc_new(words, nwords, int(check_kernel), int(c_buffer_id)), lib.gpc_free)
        if self._c == ffi.NULL:
            raise MemoryError("gpupin cache: out of memory")
        # Kept as long as the cache: the core calls them until it is closed.
        self._c_query = (ffi.NULL, ffi.NULL)
        if c_query is not None:
            query, ctx = c_query
            self._c_query = (query or ffi.NULL, ctx or ffi.NULL)  # a NULL query: libcuda's
            lib.gpc_set_buffer_id_query(self._c, *self._c_query)
        self._life = _Life(self._c, device, offers, map_buf)
        self._ents = self._life.ents  # the same list: changed in place only
        # Not at interpreter exit: a cache still alive then may be in use by another atexit
        # hook (a library's teardown); the process's exit releases everything anyway.
        weakref.finalize(self, _Life.finalize, self._life).atexit = False
        self._lookup = lib.gpc_lookup
        self._choose_fast_path()
        self._lock = threading.RLock()
        self._free_ids = []
        self._by_handle = {}
        self._records = _records_of(device)  # shared by the caches over the device
        self._inbox = self._records.attach()
        self._indexed = {}
        self._st = CacheStats()
        self._py_buffer_id_stale = 0
        self._relookups = 0  # lookups repeated under the lock: not acquires of their own
        self._pid = os.getpid()
        self._reopen = False  # a fork child: open a device of its own before the next pin
        self._closed = False
        _LIVE.add(self)
        if offers.register_child is not None:
            offers.register_child(self)  # the device closes its caches when it closes

    def acquire(self, ptr: int, size: int) -> Registration:
        """A registration covering [ptr, ptr + size), pinning the allocation on first use."""
        tok = self.lookup(ptr, size)
        e = self._entry_of(tok)
        assert e is not None  # referenced: its slot cannot be reused
        return Registration(self, e, ptr, size)

    @property
    def core(self) -> Any:
        """The C core (a cffi ``struct gpc *``), for what calls ``lib.gpc_*`` itself: the
        benchmark timing the bare call, tests driving the core.  Applications use the methods."""
        return self._c

    def __enter__(self) -> RegistrationCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self._indexed)


def _pick_backend(backend: str, device: Any, offers: DeviceOffers, memory: Any, provider: ProviderOffers) -> str:
    """nvp2p, dmabuf, or for auto the dma-buf path where device and memory both offer it."""
    if backend not in ("nvp2p", "dmabuf", "auto"):
        raise InvalidArgument(f"backend={backend!r}: use 'nvp2p', 'dmabuf' or 'auto'")
    if backend == "nvp2p":
        return backend
    dev_ok = offers.pins_dmabuf(device)
    mem_ok = provider.export_dmabuf is not None
    if dev_ok and mem_ok:
        return "dmabuf"
    if backend == "auto":
        return "nvp2p"
    raise InvalidArgument(
        "backend='dmabuf': "
        + (
            "the device has no PIN_DMABUF (update gpupin.ko)"
            if not dev_ok
            else f"{type(memory).__name__} cannot export dma-bufs"
        )
        + "; use backend='nvp2p' or 'auto'"
    )
