"""The small text files of /proc, /sys, /boot and /etc that doctor and selftest report on.

A private module that the two tools share on purpose: a file that is missing or cannot be
read reads as "" (a fact not known here), never as an error.
"""

from __future__ import annotations

import os
from pathlib import Path


def read_text(path: str | os.PathLike[str]) -> str:
    """The file's text without the white space around it; "" where it cannot be read."""
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""
