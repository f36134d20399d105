"""Access to the compiled cffi extension, with a clear error if it is missing."""

from __future__ import annotations

from typing import Any

from .errors import GpupinError

try:
    from . import _gpupin_cffi as _ext  # type: ignore[attr-defined]
except ImportError as exc:  # pragma: no cover - depends on the build
    raise GpupinError(
        "the gpupin C extension is not built: run 'make pyext' (or pip install .) "
        f"in the gpupin source tree ({exc})"
    ) from exc

ffi: Any = _ext.ffi
lib: Any = _ext.lib

__all__ = ["ffi", "lib"]
