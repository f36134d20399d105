"""``gpupin doctor``'s table fits a 100-column terminal (gpupin.tools.report)."""

from __future__ import annotations

import subprocess
import sys

from gpupin.tools.report import format_rows


def gpupin(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpupin", *args], capture_output=True, text=True, timeout=300)


def test_doctor_fits_100_columns() -> None:
    r = gpupin("doctor")
    assert r.returncode == 0, r.stderr
    long = [ln for ln in r.stdout.splitlines() if len(ln) > 100]
    assert not long, long
    assert "\n                        fix: " in r.stdout or "fix:" not in r.stdout


def test_rows_wrap_detail_and_put_the_fix_on_its_own_line() -> None:
    rows = [
        {"status": "warn", "name": "x", "detail": "word " * 60, "fix": "do this " * 30},
        {"status": "pass", "name": "a name longer than the column", "detail": "short"},
    ]
    lines = format_rows(rows).splitlines()
    assert max(len(ln) for ln in lines) <= 100
    assert lines[2].startswith("warn    x ")
    fix = [i for i, ln in enumerate(lines) if ln.lstrip().startswith("fix: ")]
    assert len(fix) == 1 and lines[fix[0] + 1].startswith(" " * 20), lines
    name = lines.index("pass    a name longer than the column")
    assert lines[name + 1].strip() == "short"
    joined = " ".join(ln.strip() for ln in lines[2 : fix[0]])
    assert joined.split() == ["warn", "x", *(["word"] * 60)]  # nothing lost in the wrapping
