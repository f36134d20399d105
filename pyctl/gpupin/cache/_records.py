"""Invalidation records: a device's records, routed to the cache over it that owns each pin."""

from __future__ import annotations

import threading
import weakref
from typing import Any

from .protocols import is_overflow


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
                elif is_overflow(ev):
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


def reset_in_child() -> None:
    """In a fork child, from the cache's at-fork hook: a parent thread may have held the lock."""
    global _RECORDS_LOCK
    _RECORDS_LOCK = threading.Lock()
