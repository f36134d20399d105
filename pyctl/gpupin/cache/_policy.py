"""The cache's policy: what a miss pins (the whole allocation, in the device's granule), what
goes to make room (least recently used first, never an entry in use), and what is invalidated
(the kernel's records, a buffer id that changed, an overlap), with the accounting stats() reads."""

from __future__ import annotations

import os
from typing import Any

from .._native import ffi, lib
from ..errors import (
    BarExhausted,
    BudgetExceeded,
    CacheExhausted,
    GpupinError,
    InvalidArgument,
    NotGpuMemory,
    NotRevocable,
    QuotaExceeded,
    UnknownHandle,
)
from ._registration import _Entry
from ._state import CacheStats, _State
from .protocols import PinFacts, is_overflow


class CacheFull(BudgetExceeded):
    """Nothing can be evicted to make room: every cached region is in use."""


class _Policy(_State):
    """Insertion, eviction and invalidation, and the accounting they keep.  Their callers hold the
    cache's lock, but for drain, stats, purge and _dma_map, which take it, and the buffer-id
    checks, which need none."""

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
        facts = PinFacts.of(pin)
        if self.validate == "kernel" and not facts.revocable:
            self._refuse_unrevocable(pin, facts, r.base, r.size)
        e = _Entry(self._new_id(), start, stop, r.buffer_id, pin)
        # Staged: indexed, but every lookup misses it until it is published below, once the
        # token resolves (_entry_of).  A hit through C takes its reference without this lock:
        # one that found the entry before it was stored could not resolve its token, and
        # its reference would never be released (close() refusing forever).
        e.token = int(lib.gpc_stage(self._c, e.id, lo, hi, r.buffer_id, facts.slot, facts.valid_word))
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

    def _refuse_unrevocable(self, pin: Any, facts: PinFacts, base: int, size: int) -> None:
        """validate='kernel' and a pin the kernel never invalidates: unpin it and say so."""
        try:
            self.device.unpin(pin.handle)
        except GpupinError:
            pass  # gone already: nothing of it is left either way
        if facts.dmabuf:
            kind = "a dma-buf pin whose exporter holds the memory and never revokes it (NVIDIA's exporter)"
        elif facts.persistent:
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
        export, pin_dmabuf = self._provider.export_dmabuf, self._life.offers.pin_dmabuf
        assert export is not None and pin_dmabuf is not None  # the backend is chosen only then
        fd = export(base)
        try:
            if self.dmabuf_pci is None:
                return pin_dmabuf(fd, user_tag=base)
            return pin_dmabuf(fd, user_tag=base, pci=self.dmabuf_pci)
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
                    kind = (
                        "BAR space"
                        if isinstance(exc, BarExhausted)
                        else "this process's BAR1 share: its cgroup's dmem.max or max_file_pinned_bytes"
                        if isinstance(exc, QuotaExceeded)
                        else "gpupin's max_pinned_bytes or max_pins_per_file"
                    )
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
                self._life.offers.unmap(m)
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
            elif is_overflow(ev):
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
