"""A base for objects that own a kernel resource and release it in ``close()``."""

from __future__ import annotations

import os
from typing import Any

from .errors import DriverNotLoaded


class Closable:
    """Context manager and finalizer around ``close()``, which subclasses define."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: S110 - best effort at interpreter teardown
            pass


def open_node(path: str, hint: str) -> int:
    """Open a device node read-write; a missing node raises DriverNotLoaded with ``hint``."""
    try:
        return os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        raise DriverNotLoaded(f"{path} does not exist: {hint}") from None
