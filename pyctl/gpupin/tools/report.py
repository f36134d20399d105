"""Check tables for a terminal: ``gpupin doctor`` and ``gpupin selftest``.

A row is a status, a name, what was seen (detail or evidence) and, where
something is wrong, the fix.  The text form fits ``width`` columns (100 by
default, pasteable into a bug report): the detail wraps under its own column,
the fix goes on its own indented line.  The JSON form is the rows as they are.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

WIDTH = 100
NAME_MAX = 18  # a longer name gets a line of its own


@dataclass
class Report:
    """A command's result whose text form is laid out already.

    ``data`` is what ``--json`` prints; ``text`` what a terminal gets; ``status`` the
    command's exit status (non-zero when a check failed)."""

    data: Any
    text: str
    status: int = 0


def _wrap(text: str, width: int) -> list[str]:
    return textwrap.wrap(text, width, break_long_words=True, break_on_hyphens=False) or [""]


def format_rows(rows: Sequence[Mapping[str, Any]], width: int = WIDTH, detail_key: str = "detail") -> str:
    """``rows`` (dicts with status, name, ``detail_key`` and optionally fix) as lines of at most
    ``width`` columns."""
    if not rows:
        return "(none)"
    status_w = max(6, *(len(str(r["status"])) for r in rows))
    name_w = min(NAME_MAX, max(4, *(len(str(r["name"])) for r in rows)))
    indent = status_w + 2 + name_w + 2
    room = max(20, width - indent)
    pad = " " * indent
    out = [f"{'status':<{status_w}}  {'name':<{name_w}}  {detail_key}", "-" * min(width, indent + room)]
    for r in rows:
        status, name = str(r["status"]), str(r["name"])
        detail = _wrap(str(r.get(detail_key, "")), room)
        if len(name) > name_w:  # the name alone, the detail under its column
            out.append(f"{status:<{status_w}}  {name}")
            out.extend(pad + d for d in detail)
        else:
            out.append(f"{status:<{status_w}}  {name:<{name_w}}  {detail[0]}".rstrip())
            out.extend(pad + d for d in detail[1:])
        fix = str(r.get("fix") or "")
        if fix:
            lines = _wrap(fix, room - 5)
            out.append(f"{pad}fix: {lines[0]}")
            out.extend(f"{pad}     {ln}" for ln in lines[1:])
    return "\n".join(out)


def format_facts(facts: Mapping[str, Any], width: int = WIDTH) -> str:
    """``name: value`` lines, values wrapped under themselves."""
    key_w = max((len(k) for k in facts), default=0)
    room = max(20, width - key_w - 2)
    out = []
    for k, v in facts.items():
        lines = _wrap(str(v), room)
        out.append(f"{k:<{key_w}}  {lines[0]}".rstrip())
        out.extend(" " * (key_w + 2) + ln for ln in lines[1:])
    return "\n".join(out)
