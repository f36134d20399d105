"""The hit paths: the fast path, a lock-free lookup in C (fast_lookup), and the slow path under
the cache's lock (miss), with the release of the reference a hit takes."""

from __future__ import annotations

import functools
import operator
import os
import weakref
from typing import Any

from .._native import ffi, lib
from ..errors import InvalidArgument
from ._core import _c_lookup, _call_cache, _closed_lookup
from ._life import _Lifetime
from ._registration import _Entry


class _HitPaths(_Lifetime):
    """The hit paths, one fast and one slow.

    The fast path is the C core's lookup, without the cache's lock: it finds the entry covering
    a range, checks it (the validity word, the buffer id through the provider's query in C) and
    takes a reference.  A token >= 0 is a hit and the end of it; a code < 0 goes to the slow
    path, ``miss``, which runs under the lock: it looks again, checks buffer ids in Python where
    the provider has no query in C, invalidates what went stale and pins.  ``lookup`` is the one
    then the other, ``acquire`` the same wrapped in a Registration, ``_peek`` the fast path for
    a caller that decides before it pins.  ``fast_lookup`` is the fast path as callers bind it,
    chosen once per cache by _choose_fast_path.
    """

    def _choose_fast_path(self) -> None:
        """Bind ``fast_lookup`` and ``release_token``: the same fast path, called one of three ways.

        - C: the vectorcall entry points (``gpc_bind``), one call into C each, with no cffi
          argument conversion or GIL release.  The usual one.
        - cffi: the cffi calls, where the vectorcall entry points are missing (the package's
          ``gpc_bind`` None: the extension could not install them, or a test set it so).
        - Python: ``lookup`` itself, where the provider has no buffer-id query in C: a C hit is
          no hit until the slow path has checked its buffer id, so every call takes both.

        ``close()`` binds a fourth, ``_closed_lookup``, which raises.  None is a bound method of
        the cache: that would be a reference cycle, keeping the cache (and its hold on the
        validity map) alive until a GC pass.  They reach it through a weak reference or a proxy,
        calling this class's methods, named unbound below.
        """
        from . import gpc_bind  # the package's: a test sets it to None to run the cffi calls

        if self._py_buffer_id:
            ref = weakref.ref(self)
            self.fast_lookup = functools.partial(_call_cache, ref, _HitPaths.lookup)
            self.release_token = functools.partial(_call_cache, ref, _HitPaths._release_token)
        elif gpc_bind is not None:
            # They hold self._c, so the core outlives any copy.
            addr = int(ffi.cast("uintptr_t", self._c))
            on_stale = functools.partial(_call_cache, weakref.ref(self), _HitPaths._release_stale, gone_ok=True)
            self.fast_lookup, self.release_token = gpc_bind((addr, self._c, InvalidArgument, on_stale))
        else:
            proxy: Any = weakref.proxy(self)
            self.fast_lookup = functools.partial(_c_lookup, lib.gpc_lookup, self._c)
            self.release_token = functools.partial(_HitPaths._release_token, proxy)

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
            r = _c_lookup(self._lookup, self._c, ptr, size)
        except TypeError:  # numpy integers and other __index__ types (fast_lookup takes them too)
            ptr, size = operator.index(ptr), operator.index(size)
            r = _c_lookup(self._lookup, self._c, ptr, size)
        if r >= 0 and not self._py_buffer_id:
            return r
        return self.miss(ptr, size, r)

    def miss(self, ptr: int, size: int, code: int) -> int:
        """The slow path: finish a ``fast_lookup`` that returned ``code`` < 0 (validate, pin)
        and return a referenced token.  Takes the cache's lock."""
        r = code
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
                r = _c_lookup(self._lookup, self._c, ptr, size)
                self._relookups += 1
            if r == lib.GPC_CLOSED:
                raise InvalidArgument("this RegistrationCache is closed (or closing)")
            if r == lib.GPC_TOO_MANY_REFS:
                return self.miss(ptr, size, r)  # raises
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

    def unfinished(self) -> None:
        """A ``fast_lookup`` that missed and whose caller does not ``miss()`` it (it looks up
        the range's parts instead): not an acquire of its own in ``stats()``."""
        with self._lock:
            self._relookups += 1

    def _peek(self, ptr: int, size: int) -> tuple[int, _Entry | None]:
        """A lookup that does not pin, for a subclass that decides before it pins (GdsCache.use):
        a held token for a hit whose buffer id still matches; else a code < 0 and the stale entry
        that covered ``ptr`` (None where none did).  Counts as one acquire."""
        tok = _c_lookup(self._lookup, self._c, ptr, size)
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
