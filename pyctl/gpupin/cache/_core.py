"""The C core (csrc/gpc.c) from Python: what keeps it and its validity map alive until the cache
closes (_Life, which the cache's finalizer holds), and the functions fast_lookup is bound to
(_HitPaths._choose_fast_path says which when)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._native import ffi, lib
from ..errors import GpupinError, InvalidArgument, UnknownHandle
from ._registration import _Entry
from .protocols import DeviceOffers

if TYPE_CHECKING:
    from ._hits import _HitPaths


class _Life:
    """What a cache's finalizer needs, kept apart from the cache (no reference back to it):
    the C core, the entries, the validity-map view, the device (with what it offers) and a
    device it owns."""

    __slots__ = ("core", "ents", "map_buf", "device", "offers", "owned", "closed")

    def __init__(self, core: Any, device: Any, offers: DeviceOffers, map_buf: Any) -> None:
        self.core = core
        self.ents: list[_Entry | None] = []
        self.map_buf = map_buf
        self.device = device
        self.offers = offers  # DeviceOffers.of(device): they change together
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
                    self.offers.unmap(m)
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


def _out_of_range(ptr: int, size: int) -> InvalidArgument:
    """What a lookup says of a negative or over-64-bit ptr or size (cffi's OverflowError)."""
    bad = [f"{n}={v}" for n, v in (("ptr", ptr), ("size", size)) if not 0 <= v < 1 << 64]
    return InvalidArgument(
        f"lookup(ptr={ptr}, size={size}): {' and '.join(bad) or 'the range'} out of range: ptr takes 0 to "
        "2**64 - 1, size 1 to 2**64 - 1"
    )


def _c_lookup(lookup: Any, core: Any, ptr: int, size: int) -> int:
    """The fast path through cffi: ``lookup`` (the core's gpc_lookup) finds the entry covering
    [ptr, ptr + size), checks it in C and takes a reference, without the cache's lock.  A token
    >= 0 is a hit; < 0 a code for the slow path.  A negative or over-64-bit argument is an
    InvalidArgument."""
    try:
        return int(lookup(core, ptr, size))
    except OverflowError:
        raise _out_of_range(ptr, size) from None


def _closed_lookup(ptr: int, size: int) -> int:
    """The fast path of a closed cache."""
    raise InvalidArgument("this RegistrationCache is closed")


def _call_cache(ref: weakref.ref[_HitPaths], method: Callable[..., Any], *args: Any, gone_ok: bool = False) -> Any:
    """A method of the cache bound as its fast path (buffer-id checks in Python), or as the
    stale-entry callback of the vectorcall one: the method, while the cache lives.
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
