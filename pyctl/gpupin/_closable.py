"""A base for objects that own a kernel resource and release it in ``close()``."""

from __future__ import annotations

from typing import Any


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
