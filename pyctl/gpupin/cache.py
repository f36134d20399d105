"""A lazy-unpinning registration cache (pin-down cache) over a gpupin Device.

The GPUDirect RDMA recipe, made cheap: on first use pin the whole allocation
that holds a buffer and remember its buffer id; on every use validate the
entry (the kernel's validity word, the provider's buffer id, or both) and pin
again if it went stale; unpin lazily, least recently used first, when a limit
is reached or the GPU runs out of BAR space.  Entries in use are never
evicted.  One entry per allocation: buffer ids are per allocation, so entries
never merge across allocations.

The hit path is one call into C (``lookup``): find the entry, read its
validity word (and query the buffer id through the provider's query in C:
libcuda's for CudaMemory, an ioctl for SimMemory), take a reference.
Misses, eviction and invalidation run in Python under the cache's lock.

Lifetimes (Documentation/python.md's "Lifetime rules" says the same for users):

- A token (what ``lookup``/``fast_lookup`` return) names one entry: the C core
  gives every entry a new generation, checked on every use, so a late or
  doubled ``release_token`` after its slot was reused is refused, never
  applied to another entry.  A slot is reused only once nobody holds it.
  Generations never wrap: after 2**30 - 1 entries a cache raises
  CacheExhausted at its next insert (a hard error, not a wrap; make a new cache).
- ``close()`` refuses (InUse) while a registration is held; ``Device.close()``
  too for the caches over it.  Released first, everything is unpinned.
- A cache dropped without ``close()`` is closed by its finalizer: its core
  stops reading the validity map (bound fast paths then raise), and every pin
  nobody holds is unpinned.  Pins still held through bare tokens stay until
  the device closes.
- In a fork child the cache starts empty and opens a device of its own at its
  first pin; the parent's registrations are the parent's (releasing a parent's
  Registration in the child does nothing, a parent's token is refused).  A
  closed cache stays closed.
"""

from __future__ import annotations

import functools
import operator
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from ._closable import Closable
from ._native import ffi, gpc_bind, lib
from .errors import (
    BarExhausted,
    BudgetExceeded,
    CacheExhausted,
    ForkedDevice,
    GpupinError,
    InUse,
    InvalidArgument,
    NotGpuMemory,
    NotRevocable,
    UnknownHandle,
)
from .memory import MemoryProvider

GPU_PAGE = 1 << 16
_ID_MASK = 0xFFFFFFFF  # a token's slot; the generation is above it (csrc/gpc.c)
Validate = Literal["both", "kernel", "buffer_id"]
Backend = Literal["nvp2p", "dmabuf", "auto"]


class DeviceLike(Protocol):
    def pin(self, va: int, size: int, *, persistent: bool = False, user_tag: int = 0) -> Any: ...

    def unpin(self, handle: Any) -> None: ...

    def read_events(self) -> list[Any]: ...

    def dma_map(self, handle: Any, pci: str) -> Any: ...

    def validity_map(self) -> Any: ...


class CacheFull(BudgetExceeded):
    """Nothing can be evicted to make room: every cached region is in use."""


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


class _Entry:
    __slots__ = ("id", "token", "start", "end", "buffer_id", "pin", "stale", "done", "maps")

    def __init__(self, eid: int, start: int, end: int, buffer_id: int, pin: Any) -> None:
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
    # _buffer_id_current, the one pair of classes in this module that share their private names.
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


class _Inbox:
    """One cache's invalidation records, as its device's _Records routed them."""

    __slots__ = ("records", "__weakref__")

    def __init__(self) -> None:
        self.records: list[Any] = []


class _Records:
    """A device's invalidation records, routed to the cache that owns each handle.

    The device hands each record to one reader only, so every cache over a device reads
    through its one _Records: a record for another cache's pin is kept for that cache, an
    overflow record (records were lost) goes to every cache, and one for a pin nobody owns
    yet (read between a pin and the cache taking its handle) waits, with those of the last
    ``ORPHANS`` handles, for its owner.  Holds no reference to the device (it is the key it is kept
    under) nor to the caches: their inboxes are weak here, held by the caches.
    """

    ORPHANS = 1024

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: dict[int, weakref.ref[_Inbox]] = {}
        self._inboxes: weakref.WeakSet[_Inbox] = weakref.WeakSet()
        self._orphans: dict[int, list[Any]] = {}  # by handle, oldest first

    def attach(self) -> _Inbox:
        inbox = _Inbox()
        with self._lock:
            self._inboxes.add(inbox)
        return inbox

    def own(self, handle: int, inbox: _Inbox) -> None:
        """Records for ``handle`` go to ``inbox`` from now on (and any that came already)."""
        with self._lock:
            self._owner[handle] = weakref.ref(inbox)
            inbox.records += self._orphans.pop(handle, [])

    def disown(self, handle: int) -> None:
        with self._lock:
            self._owner.pop(handle, None)

    def take(self, device: Any, inbox: _Inbox) -> list[Any]:
        """Read the device's queued records, route them, and return (and empty) ``inbox``'s."""
        with self._lock:
            for ev in device.read_events():
                ref = self._owner.get(int(ev.handle))
                owner = ref() if ref is not None else None
                if owner is not None:
                    owner.records.append(ev)
                elif getattr(ev, "reason", "") == "overflow":
                    for other in self._inboxes:
                        other.records.append(ev)
                else:
                    if ref is not None:  # its cache went without unpinning it
                        del self._owner[int(ev.handle)]
                    self._orphans.setdefault(int(ev.handle), []).append(ev)
                    if len(self._orphans) > self.ORPHANS:
                        del self._orphans[next(iter(self._orphans))]
            out, inbox.records = inbox.records, []
        return out


# A _Records per device (weakly keyed: it goes with its device), made under _RECORDS_LOCK.
_RECORDS: weakref.WeakKeyDictionary[Any, _Records] = weakref.WeakKeyDictionary()
_RECORDS_LOCK = threading.Lock()


def _records_of(device: Any) -> _Records:
    """The _Records of ``device``; a private one for a device that cannot be weakly keyed."""
    with _RECORDS_LOCK:
        try:
            rec = _RECORDS.get(device)
            if rec is None:
                rec = _RECORDS[device] = _Records()
        except TypeError:  # not weakly referenceable or not hashable: it is this cache's alone
            rec = _Records()
        return rec


# Every live cache, for the one at-fork hook (hooks cannot be unregistered: one per cache
# would pile up in a long-lived process).
_LIVE: weakref.WeakSet[RegistrationCache] = weakref.WeakSet()


def _forget_all_in_child() -> None:
    global _RECORDS_LOCK
    _RECORDS_LOCK = threading.Lock()  # a parent thread may have held it at the fork
    for cache in list(_LIVE):
        cache._forget()  # this module's own hook, calling its own class's private method


os.register_at_fork(after_in_child=_forget_all_in_child)


class _Life:
    """What a cache's finalizer needs, kept apart from the cache (no reference back to it):
    the C core, the entries, the validity-map view, the device and a device it owns."""

    __slots__ = ("core", "ents", "map_buf", "device", "owned", "closed")

    def __init__(self, core: Any, device: Any, map_buf: Any) -> None:
        self.core = core
        self.ents: list[_Entry | None] = []
        self.map_buf = map_buf
        self.device = device
        self.owned: Any = None
        self.closed = False

    def release_map(self) -> None:
        if self.map_buf is not None:
            ffi.release(self.map_buf)
            self.map_buf = None

    def unpin_unheld(self) -> tuple[int, int]:
        """After gpc_close: unpin every entry its holders let go of; (entries still held, unpins
        the device refused)."""
        held = failed = 0
        for e in self.ents:
            if e is None or e.done:
                continue
            if lib.gpc_refs(self.core, e.token) > 0:
                held += 1
                continue
            e.done = True
            for m in e.maps.values():
                try:
                    self.device.dma_unmap(m)
                except GpupinError:
                    pass  # went with the pin
            e.maps.clear()
            try:
                self.device.unpin(e.pin.handle)
            except UnknownHandle:
                pass  # gone with the device already
            except GpupinError:
                failed += 1  # the device refused: nothing more to do for it here
        return held, failed

    def finalize(self) -> None:
        """The cache went without close(): close its core, unpin what nobody holds."""
        if self.closed:
            return
        self.closed = True
        lib.gpc_close(self.core, 1)  # bound fast paths raise from now on; no map reads
        held, _ = self.unpin_unheld()
        self.release_map()
        owned, self.owned = self.owned, None
        if owned is not None and not held:
            owned.close()


class RegistrationCache:
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
        self.backend = _pick_backend(backend, device, memory)
        if dmabuf_pci is not None and self.backend != "dmabuf":
            raise InvalidArgument(f"dmabuf_pci={dmabuf_pci!r}: only for the dma-buf backend (backend={self.backend!r})")
        self.dmabuf_pci = dmabuf_pci
        if max_bytes < 0 or max_regions < 0:
            raise InvalidArgument("max_bytes and max_regions must be >= 0 (0 = unlimited)")
        self.memory = memory
        self.max_bytes = max_bytes
        self.max_regions = max_regions
        self.validate = validate
        self.whole_allocation = whole_allocation
        self.sync_memops = sync_memops
        self._granule = int(getattr(device, "granule", GPU_PAGE))
        check_kernel = validate in ("both", "kernel")
        check_buffer_id = validate in ("both", "buffer_id")
        # The buffer-id check runs in C when the provider offers a query in C (see
        # MemoryProvider): CudaMemory's libcuda call, SimMemory's ioctl, FakeMemory(direct_query=True).
        c_buffer_id = check_buffer_id and bool(getattr(memory, "direct_buffer_id_query", False))
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
        self._c_query: tuple[Any, Any] = (ffi.NULL, ffi.NULL)
        if c_buffer_id:
            query = getattr(memory, "c_buffer_id_query", None) or ffi.NULL  # NULL: libcuda's
            self._c_query = (query, getattr(memory, "c_buffer_id_ctx", None) or ffi.NULL)
            lib.gpc_set_buffer_id_query(self._c, *self._c_query)
        self._life = _Life(self._c, device, map_buf)
        self._ents = self._life.ents  # the same list: changed in place only
        # Not at interpreter exit: a cache still alive then may be in use by another atexit
        # hook (a library's teardown); the process's exit releases everything anyway.
        weakref.finalize(self, _Life.finalize, self._life).atexit = False
        self._lookup = lib.gpc_lookup
        self._set_fast_path()
        self._lock = threading.RLock()
        self._free_ids: list[int] = []
        self._by_handle: dict[int, _Entry] = {}
        self._records = _records_of(device)  # shared by the caches over the device
        self._inbox = self._records.attach()
        self._indexed: dict[int, _Entry] = {}
        self._st = CacheStats()
        self._py_buffer_id_stale = 0
        self._relookups = 0  # lookups repeated under the lock: not acquires of their own
        self._pid = os.getpid()
        self._reopen = False  # a fork child: open a device of its own before the next pin
        self._closed = False
        _LIVE.add(self)
        register = getattr(device, "register_child", None)
        if register is not None:
            register(self)  # the device closes its caches when it closes

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

    @property
    def core(self) -> Any:
        """The C core (a cffi ``struct gpc *``), for what calls ``lib.gpc_*`` itself: the
        benchmark timing the bare call, tests driving the core.  Applications use the methods."""
        return self._c

    @property
    def closed(self) -> bool:
        """True once ``close()`` (or a close by the device) has run."""
        return self._closed

    def quiesce(self, on: bool) -> None:
        """Stop (``True``) or resume (``False``) handing out references: lookups say "closing"
        meanwhile.  For a close that counts the holders first: this cache's ``close(timeout=)``
        and ``Device.close()`` of the device it is registered with."""
        lib.gpc_quiesce(self._c, int(on))

    # -- the hot path ------------------------------------------------------------
    def _set_fast_path(self) -> None:
        self.fast_lookup: Callable[[int, int], int]
        self.release_token: Callable[[int], None]
        """Drop the reference a ``lookup``/``fast_lookup`` token holds (unpinning a stale entry)."""
        # Through a proxy: a bound method stored on self would be a reference cycle,
        # keeping the cache (and its hold on the validity map) alive until a GC pass.  Hence
        # this class's own methods named unbound below (RegistrationCache._release_token).
        proxy: Any = weakref.proxy(self)
        if self._py_buffer_id:
            ref = weakref.ref(self)
            self.fast_lookup = functools.partial(_call_cache, ref, RegistrationCache.lookup)
            self.release_token = functools.partial(_call_cache, ref, RegistrationCache._release_token)
        elif gpc_bind is not None:
            # One vectorcall into C each; they hold self._c, so the core outlives any copy.
            addr = int(ffi.cast("uintptr_t", self._c))
            on_stale = functools.partial(_call_cache, weakref.ref(self), RegistrationCache._release_stale, gone_ok=True)
            self.fast_lookup, self.release_token = gpc_bind((addr, self._c, InvalidArgument, on_stale))
        else:
            self.fast_lookup = functools.partial(_core_fast_lookup, self._c)
            self.release_token = functools.partial(RegistrationCache._release_token, proxy)

    def miss(self, ptr: int, size: int, code: int) -> int:
        """Finish a ``fast_lookup`` that returned ``code`` < 0: validate, pin, return a token."""
        return self._slow(ptr, size, code)

    def unfinished(self) -> None:
        """A ``fast_lookup`` that missed and whose caller does not ``miss()`` it (it looks up
        the range's parts instead): not an acquire of its own in ``stats()``."""
        with self._lock:
            self._relookups += 1

    def lookup(self, ptr: int, size: int) -> int:
        """A referenced token for [ptr, ptr + size), pinning on a miss; pair with ``release_token``.

        The allocation-free form of ``acquire``.  Code that counts nanoseconds calls
        ``fast_lookup`` (a bare call into C) and ``miss`` only when it returns < 0::

            tok = cache.fast_lookup(ptr, size)
            if tok < 0:
                tok = cache.miss(ptr, size, tok)
            ...
            cache.release_token(tok)
        """
        if self._closed:
            return _closed_lookup(ptr, size)
        try:
            r = self._lookup(self._c, ptr, size)
        except TypeError:  # numpy integers and other __index__ types (fast_lookup takes them too)
            ptr, size = operator.index(ptr), operator.index(size)
            r = self._core_lookup(ptr, size)
        except OverflowError:
            raise _out_of_range(ptr, size) from None
        if r >= 0 and not self._py_buffer_id:
            return int(r)
        return self._slow(ptr, size, int(r))

    def _core_lookup(self, ptr: int, size: int) -> int:
        """The C core's lookup, with a negative or over-64-bit argument an InvalidArgument."""
        try:
            return int(self._lookup(self._c, ptr, size))
        except OverflowError:
            raise _out_of_range(ptr, size) from None

    def _release_token(self, token: int) -> None:
        """release_token where the C entry point is missing (or for buffer-id checks in Python)."""
        try:
            refs = lib.gpc_release(self._c, token)
        except OverflowError:
            raise InvalidArgument(
                f"release_token({token}): not a token (tokens are 0 to 2**62 - 1, as lookup or "
                "fast_lookup returned them)"
            ) from None
        if refs == 0:
            self._release_stale(token)
        elif refs == lib.GPC_CLOSED:
            raise InvalidArgument(f"release_token({token}): this RegistrationCache is closed (or was dropped)")
        elif refs < 0:
            raise InvalidArgument(
                f"release_token({token}): not a held token (released already, or of another cache or process)"
            )

    def _release_stale(self, token: int) -> None:
        """The last reference to ``token`` went: unpin it if it left the index meanwhile."""
        e = self._entry_of(token)
        if e is not None and e.stale:
            with self._lock:
                self._finish(e)

    def acquire(self, ptr: int, size: int) -> Registration:
        """A registration covering [ptr, ptr + size), pinning the allocation on first use."""
        tok = self.lookup(ptr, size)
        e = self._entry_of(tok)
        assert e is not None  # referenced: its slot cannot be reused
        return Registration(self, e, ptr, size)

    def _peek(self, ptr: int, size: int) -> tuple[int, _Entry | None]:
        """A lookup that does not pin, for a subclass that decides before it pins (GdsCache.use):
        a held token for a hit whose buffer id still matches; else a code < 0 and the stale entry
        that covered ``ptr`` (None where none did).  Counts as one acquire."""
        tok = self._core_lookup(ptr, size)
        if tok == lib.GPC_CLOSED:
            raise InvalidArgument(f"this {type(self).__name__} is closed")
        if tok == lib.GPC_BAD_ARG:
            self.miss(ptr, size, tok)  # raises the argument error
        if tok >= 0 and self._py_buffer_id:  # the buffer id is checked here, not in C
            e = self._entry_of(tok)
            assert e is not None  # referenced: its slot cannot be reused
            try:
                ok = self._buffer_id_ok(e, ptr)
            except BaseException:
                self.release_token(tok)
                raise
            if not ok:
                self._py_buffer_id_stale += 1
                self.release_token(tok)
                return int(lib.GPC_MISS), e
        elif tok <= -lib.GPC_STALE_BASE:
            # Unreferenced: by now the entry may be gone and its slot another's.  _entry_of
            # checks the generation; the caller checks under the lock that it is still cached.
            return tok, self._entry_of(-tok - lib.GPC_STALE_BASE)
        return tok, None

    # -- the slow path -------------------------------------------------------------
    def _slow(self, ptr: int, size: int, r: int) -> int:
        if r == lib.GPC_BAD_ARG:
            raise InvalidArgument(f"acquire(ptr={ptr:#x}, size={size}): size must be > 0 and the range in 64 bits")
        if r == lib.GPC_TOO_MANY_REFS:
            raise InvalidArgument(
                f"acquire(ptr={ptr:#x}, size={size}): the registration covering it is held {2**31 - 1} times "
                "already; release some (a loop that never releases?)"
            )
        if r == lib.GPC_CLOSED:  # closed, or closing: said without waiting for the lock
            raise InvalidArgument("this RegistrationCache is closed (or closing)")
        with self._lock:
            if self._pid != os.getpid():
                self._forget()
                r = int(lib.GPC_MISS)  # r came from the parent's core
            if self._reopen:
                self._reopen_device()
                r = int(lib.GPC_MISS)
            # Look again under the lock: another thread may have pinned this allocation
            # since the lock-free lookup missed (inserts happen only under the lock).  Without
            # this, _insert would take that thread's live entry for a stale one.
            if r < 0:
                r = self._core_lookup(ptr, size)
                self._relookups += 1
            if r == lib.GPC_CLOSED:
                raise InvalidArgument("this RegistrationCache is closed (or closing)")
            if r == lib.GPC_TOO_MANY_REFS:
                return self._slow(ptr, size, r)  # raises
            if r >= 0:  # a C hit; the buffer id is checked here
                e = self._entry_of(r)
                assert e is not None  # referenced: its slot cannot be reused
                try:
                    ok = self._buffer_id_ok(e, ptr)
                except BaseException:
                    lib.gpc_release(self._c, r)  # the query failed: do not keep the reference
                    raise
                if ok:
                    return r
                self._py_buffer_id_stale += 1
                lib.gpc_release(self._c, r)
                self._invalidate(e, "buffer_id")
                self._finish(e)  # if another thread made it stale first
            elif r != lib.GPC_MISS:  # an entry covers it but its word changed
                # Another thread may have dealt with it meanwhile (its slot may hold a new
                # entry: _entry_of checks the generation).
                e = self._entry_of(-r - lib.GPC_STALE_BASE)
                if e is not None and not e.pin.is_valid():
                    self._invalidate(e, "kernel")
            e = self._insert(ptr, ptr + size)
            if lib.gpc_use(self._c, e.token) < 0:  # a close began: the entry stays for it to unpin
                raise InvalidArgument("this RegistrationCache is closed (or closing)")
            return e.token

    def _buffer_id_current(self, e: _Entry, ptr: int) -> bool:
        """Registration.valid's buffer-id half: the check a lookup makes (none for "kernel")."""
        return self.validate == "kernel" or self._buffer_id_ok(e, ptr)

    def _buffer_id_ok(self, e: _Entry, ptr: int) -> bool:
        try:
            return bool(self.memory.buffer_id(ptr) == e.buffer_id)
        except NotGpuMemory:
            return False

    def _new_id(self) -> int:
        if self._free_ids:
            return self._free_ids.pop()
        self._ents.append(None)
        return len(self._ents) - 1

    def _insert(self, ptr: int, end: int) -> _Entry:
        self._drain_locked()
        r = self.memory.range_of(ptr)  # raises NotGpuMemory for freed/host memory
        if end > r.base + r.size:
            raise InvalidArgument(
                f"acquire(ptr={ptr:#x}, size={end - ptr}): the range runs past its allocation "
                f"[{r.base:#x}, {r.base + r.size:#x}); register each allocation separately"
            )
        # What the device registers in: nv-p2p pins 64 KiB GPU pages; cuFile takes the
        # allocation's own bounds (granule 1), and rounding them would leave the allocation.
        g = self._granule
        if self.whole_allocation:
            start = r.base & ~(g - 1)
            stop = -(-(r.base + r.size) // g) * g
        else:
            start = ptr & ~(g - 1)
            stop = -(-end // g) * g
        need = stop - start
        # What a hit may cover: the pinned range, but never past the allocation.  Pinning
        # rounds to whole GPU pages, and two allocations (pool blocks) can share one: indexed
        # by the rounded range, each would take the other for stale and re-pin, in turn.
        lo, hi = max(start, r.base), min(stop, r.base + r.size)
        if self.max_bytes and need > self.max_bytes:
            raise CacheFull(f"acquire: the allocation needs {need} bytes, more than max_bytes={self.max_bytes}")
        if self.sync_memops:
            self.memory.enable_sync_memops(ptr)
        # Anything indexed over this range is stale: live allocations do not overlap.
        while (old_tok := int(lib.gpc_overlap(self._c, lo, hi))) >= 0:
            old = self._entry_of(old_tok)
            assert old is not None
            self._invalidate(old, "buffer_id")
        self._make_room(need)
        pin = self._pin(start, need, r.base)
        if self.validate == "kernel" and not getattr(pin, "revocable", False):
            self._refuse_unrevocable(pin, r.base, r.size)
        e = _Entry(self._new_id(), start, stop, r.buffer_id, pin)
        # Staged: indexed, but every lookup misses it until it is published below, once the
        # token resolves (_entry_of).  A hit through C takes its reference without this lock:
        # one that found the entry before it was stored could not resolve its token, and
        # its reference would never be released (close() refusing forever).
        e.token = int(
            lib.gpc_stage(self._c, e.id, lo, hi, r.buffer_id, getattr(pin, "slot", 0), getattr(pin, "valid_word", 0))
        )
        if e.token < 0:
            self._free_ids.append(e.id)
            self.device.unpin(pin.handle)
            if e.token == lib.GPC_NO_GENERATION:
                raise CacheExhausted(
                    f"acquire(ptr={ptr:#x}): this RegistrationCache has made 2**30 - 1 entries, every token "
                    "generation it has, and makes no more (a wrap would hand out tokens again); close it "
                    "and make a new cache"
                )
            raise MemoryError("gpupin cache: out of memory for the index")
        self._ents[e.id] = e
        self._indexed[e.id] = e
        self._by_handle[int(pin.handle)] = e
        self._records.own(int(pin.handle), self._inbox)
        st = self._st
        st.pins += 1
        st.regions += 1
        st.bytes_pinned += need
        st.peak_bytes = max(st.peak_bytes, st.bytes_pinned)
        lib.gpc_publish(self._c, e.token)
        return e

    def _refuse_unrevocable(self, pin: Any, base: int, size: int) -> None:
        """validate='kernel' and a pin the kernel never invalidates: unpin it and say so."""
        try:
            self.device.unpin(pin.handle)
        except GpupinError:
            pass  # gone already: nothing of it is left either way
        if getattr(pin, "dmabuf", False):
            kind = "a dma-buf pin whose exporter holds the memory and never revokes it (NVIDIA's exporter)"
        elif getattr(pin, "persistent", False):
            kind = "a persistent pin"
        else:
            kind = "a pin the kernel did not mark revocable (is gpupin.ko older than this package?)"
        raise NotRevocable(
            f"acquire: the allocation [{base:#x}, {base + size:#x}) got {kind}: its validity word never "
            "changes, so validate='kernel' would hand out a pin of the old memory after a free and a "
            "new allocation at the same address; use buffer-id validation, validate='buffer_id' or 'both'"
        )

    def _make_room(self, need: int) -> None:
        st = self._st
        while (self.max_regions and st.regions + 1 > self.max_regions) or (
            self.max_bytes and st.bytes_pinned + need > self.max_bytes
        ):
            if not self._evict_lru():
                raise CacheFull(
                    f"acquire: needs {need} bytes but {st.bytes_pinned} bytes in {st.regions} regions "
                    f"are cached and all {self.held()} in use (max_bytes={self.max_bytes}, "
                    f"max_regions={self.max_regions}): release registrations first"
                )
            st.evictions_limit += 1

    def _pin_once(self, start: int, size: int, base: int) -> Any:
        if self.backend == "nvp2p":
            return self.device.pin(start, size, user_tag=base)
        # dma-buf: the whole allocation's buffer; the pin keeps it, so the fd can go.
        fd = self.memory.export_dmabuf(base)  # type: ignore[attr-defined]
        try:
            if self.dmabuf_pci is None:
                return self.device.pin_dmabuf(fd, user_tag=base)  # type: ignore[attr-defined]
            return self.device.pin_dmabuf(fd, user_tag=base, pci=self.dmabuf_pci)  # type: ignore[attr-defined]
        finally:
            os.close(fd)

    def _pin(self, start: int, size: int, base: int) -> Any:
        st = self._st
        while True:
            try:
                return self._pin_once(start, size, base)
            except (BarExhausted, BudgetExceeded) as exc:
                st.pin_failures += 1
                self._drain_locked()
                if not self._evict_lru():
                    kind = "BAR space" if isinstance(exc, BarExhausted) else "gpupin budget"
                    raise type(exc)(
                        f"pin of {size} bytes at {start:#x} failed ({kind} exhausted) and nothing is "
                        f"evictable: {st.bytes_pinned} bytes pinned in {st.regions} regions, "
                        f"{self.held()} in use; release registrations or raise the limit",
                        exc.errno,
                    ) from exc
                st.evictions_pressure += 1
            except GpupinError:
                st.pin_failures += 1
                raise

    def _evict_lru(self) -> bool:
        tok = int(lib.gpc_evict_lru(self._c))
        if tok < 0:
            return False
        e = self._entry_of(tok)
        assert e is not None
        self._unindex(e)
        self._finish(e)
        return True

    def _unindex(self, e: _Entry) -> None:
        """Take e out of the Python view and the accounting (the C index already dropped it)."""
        if self._indexed.pop(e.id, None) is None:
            return
        self._by_handle.pop(int(e.pin.handle), None)
        self._records.disown(int(e.pin.handle))
        self._st.regions -= 1
        self._st.bytes_pinned -= e.size
        e.stale = True

    def _finish(self, e: _Entry) -> None:
        """Unpin a stale entry nobody holds; idempotent.  Caller holds the lock.

        The entry leaves the cache even if the device refuses the unpin; the failure is
        counted (``stats().unpin_failures``) and raised.
        """
        if e.done or lib.gpc_refs(self._c, e.token) != 0:
            return
        e.done = True
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
        except GpupinError:
            self._st.unpin_failures += 1
            raise
        finally:  # the entry is gone from the cache even if the device refused
            self._st.unpins += 1
            if lib.gpc_retire(self._c, e.token) == 0:  # nobody holds it: the slot is free
                self._ents[e.id] = None
                self._free_ids.append(e.id)

    def _invalidate(self, e: _Entry, reason: str) -> None:
        if e.stale:
            return
        if reason == "kernel":
            self._st.invalidations_kernel += 1
        else:
            self._st.invalidations_buffer_id += 1
        lib.gpc_remove(self._c, e.token)
        self._unindex(e)
        self._finish(e)

    def _dma_map(self, e: _Entry, pci: str) -> Any:
        with self._lock:
            m = e.maps.get(pci)
            if m is None:
                m = self.device.dma_map(e.pin.handle, pci)
                e.maps[pci] = m
            return m

    # -- invalidation records ------------------------------------------------------
    def _drain_locked(self) -> int:
        if self._reopen:
            return 0  # a fork child that has not pinned yet: nothing of its own to drain
        n = 0
        for ev in self._records.take(self.device, self._inbox):
            e = self._by_handle.get(int(ev.handle))
            if e is not None:
                self._invalidate(e, "kernel")
                n += 1
            elif getattr(ev, "reason", "") == "overflow":
                for e in list(self._indexed.values()):
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
            acq = ffi.new("uint64_t *")
            hits = ffi.new("uint64_t *")
            lib.gpc_counts(self._c, acq, hits)
            st = CacheStats(**self._st.__dict__)
            st.acquires = int(acq[0]) - self._relookups
            st.hits = int(hits[0]) - self._py_buffer_id_stale
            st.misses = st.acquires - st.hits
            st.in_use = self.held()
            return st

    def purge(self) -> int:
        """Unpin every unused entry; returns how many."""
        with self._lock:
            n = 0
            err: GpupinError | None = None
            out = ffi.new("int64_t[]", 256)
            while got := int(lib.gpc_evict_unused(self._c, out, len(out))):
                for tok in out[0:got]:
                    e = self._entry_of(int(tok))
                    assert e is not None
                    self._unindex(e)
                    try:
                        self._finish(e)
                    except GpupinError as exc:  # the others still go; the first failure is raised
                        err = err or exc
                n += got
            if err is not None:
                raise err
            return n

    def _forget(self) -> None:
        """In a forked child: the pins belong to the parent's file; start empty, unpinning nothing.

        Runs from the fork hook, before the child has other threads.  The C core is reset in
        place, so fast paths bound before the fork see an empty cache, never the parent's pins.
        """
        self._pid = os.getpid()
        self._lock = threading.RLock()
        lib.gpc_reset_in_child(self._c)  # its generations go on: parent tokens name nothing here
        self._life.release_map()  # the parent's validity map (zeros in the child)
        self._ents.clear()  # the parent's Registrations then release nothing here
        self._free_ids = []
        self._by_handle.clear()
        self._records = _Records()  # the parent's device's are the parent's (its lock too)
        self._inbox = self._records.attach()
        self._indexed.clear()
        self._st = CacheStats()
        self._py_buffer_id_stale = 0
        self._relookups = 0
        self._life.owned = None  # a device the parent opened in its own fork child: not this one's
        self._reopen = not self._closed

    def _reopen_device(self) -> None:
        """In a fork child, at the first pin: a device (and validity map) of this process."""
        old = self.device
        reopen = getattr(old, "reopen", None)
        if reopen is None:
            raise ForkedDevice(
                f"this RegistrationCache was made in process {self._parent} and is used in its fork child "
                f"{os.getpid()}, and its device ({type(old).__name__}) cannot be reopened here: make the "
                "cache (and its device) in the child"
            )
        dev = reopen()
        try:
            if self.validate in ("both", "kernel"):
                buf = ffi.from_buffer("uint64_t[]", dev.validity_map())
                if lib.gpc_set_words(self._c, buf, len(buf)) != 0:
                    ffi.release(buf)
                    raise InvalidArgument("this RegistrationCache is closed")
                self._life.map_buf = buf
        except BaseException:
            dev.close()
            raise
        unregister = getattr(old, "unregister_child", None)
        if unregister is not None:
            unregister(self)
        self._life.device = dev
        self._life.owned = dev
        self._records = _records_of(dev)
        self._inbox = self._records.attach()
        self._reopen = False
        register = getattr(dev, "register_child", None)
        if register is not None:
            register(self)

    @property
    def _parent(self) -> str:
        pid = getattr(self.device, "opener_pid", None)  # devices other than Device may lack it
        return str(pid) if pid is not None else "the parent"

    def close(self, timeout: float = 0.0) -> None:
        """Unpin everything and let go of the device's validity map; the cache is unusable after.

        Refuses with InUse while a registration (or a token from ``lookup`` or ``fast_lookup``)
        is held: a NIC or cuFile may still be moving data through its pin.  With ``timeout``
        (seconds) it first stops handing out references (lookups say "closing") and waits that
        long for the holders to release; if they do not, it resumes and raises InUse, changing
        nothing.  Closing a closed cache does nothing.
        """
        if self._pid != os.getpid():
            self._forget()  # a fork child without the hook: drop the parent's pins unreleased
        if timeout > 0 and not self._closed:
            # Waited for without the lock: a holder may need it to finish (a hit whose buffer id
            # is checked in Python holds its reference while it waits for the lock).
            self.quiesce(True)
            deadline = time.monotonic() + timeout
            while lib.gpc_held(self._c) and time.monotonic() < deadline:
                time.sleep(0.001)
        with self._lock:
            if self._closed:
                return
            held = int(lib.gpc_close(self._c, 0))  # atomic with the check: no hit gets in between
            if held:
                self.quiesce(False)
                waited = f" after waiting {timeout} s" if timeout > 0 else ""
                raise InUse(
                    f"close: {held} registration(s) of this cache are still held{waited}; release them "
                    "(end their with-blocks, call release() or release_token()) and close again, or "
                    "close(timeout=) to wait for them: their pins stay until then"
                )
            self._closed = True
            self._life.closed = True
            self._reopen = False
            self.fast_lookup = _closed_lookup  # a saved fast_lookup raises too (the core is closed)
            for e in list(self._indexed.values()):
                self._unindex(e)
            self._st.unpins += sum(1 for ent in self._ents if ent is not None and not ent.done)
            _, failed = self._life.unpin_unheld()
            self._st.unpin_failures += failed
            self._ents.clear()
            self._free_ids = []
            self._life.release_map()
            owned, self._life.owned = self._life.owned, None
            _LIVE.discard(self)
        if owned is not None:
            owned.close()  # the device this cache opened in a fork child

    def __enter__(self) -> RegistrationCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self._indexed)


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

    granule = 1  # register allocations at their own bounds (RegistrationCache reads this)
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


def _pick_backend(backend: str, device: Any, memory: Any) -> str:
    """nvp2p, dmabuf, or for auto the dma-buf path where device and memory both offer it."""
    if backend not in ("nvp2p", "dmabuf", "auto"):
        raise InvalidArgument(f"backend={backend!r}: use 'nvp2p', 'dmabuf' or 'auto'")
    if backend == "nvp2p":
        return backend
    dev_ok = hasattr(device, "pin_dmabuf") and bool(getattr(device.info(), "dmabuf", False))
    mem_ok = callable(getattr(memory, "export_dmabuf", None))
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


def _out_of_range(ptr: int, size: int) -> InvalidArgument:
    """What a lookup says of a negative or over-64-bit ptr or size (cffi's OverflowError)."""
    bad = [f"{n}={v}" for n, v in (("ptr", ptr), ("size", size)) if not 0 <= v < 1 << 64]
    return InvalidArgument(
        f"lookup(ptr={ptr}, size={size}): {' and '.join(bad) or 'the range'} out of range: ptr takes 0 to "
        "2**64 - 1, size 1 to 2**64 - 1"
    )


def _core_fast_lookup(core: Any, ptr: int, size: int) -> int:
    """fast_lookup where the C entry point is missing: the cffi call."""
    try:
        return int(lib.gpc_lookup(core, ptr, size))
    except OverflowError:
        raise _out_of_range(ptr, size) from None


def _closed_lookup(ptr: int, size: int) -> int:
    raise InvalidArgument("this RegistrationCache is closed")


def _call_cache(
    ref: weakref.ref[RegistrationCache], method: Callable[..., Any], *args: Any, gone_ok: bool = False
) -> Any:
    """A saved fast path in Python (buffer-id checks in Python): the method, while the cache lives.
    ``gone_ok``: a dead cache is no error (a stale entry's last release: its finalizer unpins)."""
    cache = ref()
    if cache is None:
        if gone_ok:
            return None
        raise InvalidArgument(
            f"{method.__name__.lstrip('_')}: this RegistrationCache is closed (or was dropped: keep a "
            "reference to the cache as long as its fast_lookup/release_token)"
        )
    return method(cache, *args)
