"""Shared libraries opened from Python, through cffi's ABI mode (no compiled code).

A private module that gds and nixl share on purpose: the one place gpupin dlopens a library
(to make a wheel's libcufile findable, to learn why a NIXL plugin does not load) and flushes
the C library's stdio buffers.
"""

from __future__ import annotations

from typing import Any

import cffi

_ffi = cffi.FFI()
_ffi.cdef("int fflush(void *stream);")
_libc: Any = None


def load(path: str, *, global_symbols: bool = False) -> Any:
    """dlopen ``path`` (a soname or a file) now; OSError says why it does not load.

    ``global_symbols``: RTLD_GLOBAL, so that what is loaded later finds its symbols and its
    soname, and RTLD_NODELETE, so that it stays loaded when the returned object goes.
    """
    flags = _ffi.RTLD_NOW
    if global_symbols:
        flags |= _ffi.RTLD_GLOBAL | _ffi.RTLD_NODELETE
    try:
        return _ffi.dlopen(path, flags)
    except OSError as exc:  # dlerror's text says why; cffi adds its find_library fallback's failure
        raise OSError(str(exc).split(".  Additionally, ")[0]) from None


def flush_c_stdio() -> None:
    """fflush(NULL): write out what C libraries printed into their stdio buffers."""
    global _libc
    if _libc is None:
        _libc = _ffi.dlopen(None)
    _libc.fflush(_ffi.NULL)
