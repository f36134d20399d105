"""A cache's lifetime: close (now, or after its holders let go), and fork (a child starts empty
and opens a device of its own at its first pin).  A cache dropped unclosed is _Life's (_core.py)."""

from __future__ import annotations

import os
import threading
import time
import weakref

from .._native import ffi, lib
from ..errors import ForkedDevice, InUse, InvalidArgument
from . import _records
from ._core import _closed_lookup
from ._policy import _Policy
from ._records import _Records, _records_of
from ._state import CacheStats
from .protocols import DeviceOffers

# Every live cache, for the one at-fork hook (hooks cannot be unregistered: one per cache
# would pile up in a long-lived process).
_LIVE: weakref.WeakSet[_Lifetime] = weakref.WeakSet()


def _forget_all_in_child() -> None:
    _records.reset_in_child()  # a parent thread may have held its lock at the fork
    for cache in list(_LIVE):
        cache._forget()  # this module's own hook, calling its own class's private method


os.register_at_fork(after_in_child=_forget_all_in_child)


class _Lifetime(_Policy):
    @property
    def closed(self) -> bool:
        """True once ``close()`` (or a close by the device) has run."""
        return self._closed

    def quiesce(self, on: bool) -> None:
        """Stop (``True``) or resume (``False``) handing out references: lookups say "closing"
        meanwhile.  For a close that counts the holders first: this cache's ``close(timeout=)``
        and ``Device.close()`` of the device it is registered with."""
        lib.gpc_quiesce(self._c, int(on))

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
        old, offers = self.device, self._life.offers
        if offers.reopen is None:
            raise ForkedDevice(
                f"this RegistrationCache was made in process {self._parent} and is used in its fork child "
                f"{os.getpid()}, and its device ({type(old).__name__}) cannot be reopened here: make the "
                "cache (and its device) in the child"
            )
        dev = offers.reopen()
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
        if offers.unregister_child is not None:
            offers.unregister_child(self)
        self._life.device, self._life.offers = dev, DeviceOffers.of(dev)
        self._life.owned = dev
        self._records = _records_of(dev)
        self._inbox = self._records.attach()
        self._reopen = False
        if self._life.offers.register_child is not None:
            self._life.offers.register_child(self)

    @property
    def _parent(self) -> str:
        pid = self._life.offers.opener_pid  # devices other than Device may lack it
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
            self.fast_lookup = _closed_lookup  # see _choose_fast_path; a saved one raises too (the core is closed)
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
