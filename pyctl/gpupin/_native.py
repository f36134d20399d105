"""Access to the compiled cffi extension, with a clear error if it is missing."""

from __future__ import annotations

from typing import Any

from .errors import GpupinError

try:
    from . import _gpupin_cffi as _ext  # type: ignore[attr-defined]
except ImportError as exc:  # pragma: no cover - depends on the build
    raise GpupinError(
        f"the gpupin C extension is not built: run 'make pyext' (or pip install .) in the gpupin source tree ({exc})"
    ) from exc

ffi: Any = _ext.ffi
lib: Any = _ext.lib

# The CPython entry points of the hot paths (see gpc_install in _build.py);
# None where installing them failed, and callers fall back to the cffi calls.
_fast = lib.gpc_install() == 0
gpc_bind: Any = getattr(_ext, "gpc_bind", None) if _fast else None
cuda_buffer_id: Any = getattr(_ext, "cuda_buffer_id", None) if _fast else None
call_floor: Any = getattr(_ext, "call_floor", None) if _fast else None  # benchmarks: a call, no work

__all__ = ["call_floor", "cuda_buffer_id", "ffi", "gpc_bind", "lib"]
