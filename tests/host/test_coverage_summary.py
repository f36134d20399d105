"""make coverage's gate: coverage-summary.py fails under a goal; coverage.sh --summary says when
the summary it prints was measured at another commit than HEAD, and never fails for it.

The reports are made up here, in the shapes gcovr's --json-summary and coverage.py's json write.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUMMARY = ROOT / "scripts" / "ci" / "coverage-summary.py"


def reports(out: Path, *, ko_lines: int, ko_branches: int, sim_lines: int, py_lines: int) -> None:
    """Reports with these percentages (of 100 lines or branches each)."""
    out.mkdir(parents=True, exist_ok=True)

    def kfile(name: str, lines: int, branches: int) -> dict[str, object]:
        return {
            "filename": name,
            "line_covered": lines,
            "line_total": 100,
            "branch_covered": branches,
            "branch_total": 100,
        }

    kernel = {"files": [kfile("kernel/pin.c", ko_lines, ko_branches), kfile("kernel/sim/nvp2p_sim.c", sim_lines, 0)]}
    (out / "kernel.json").write_text(json.dumps(kernel))
    python = {"files": {"pyctl/gpupin/cache.py": {"summary": {"covered_lines": py_lines, "num_statements": 100}}}}
    (out / "python.json").write_text(json.dumps(python))


def summarize(out: Path, commit: str = "abc1234") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SUMMARY), str(out), commit, "125"], capture_output=True, text=True, timeout=60
    )


def test_every_goal_met_exits_0(tmp_path: Path) -> None:
    reports(tmp_path, ko_lines=90, ko_branches=80, sim_lines=85, py_lines=95)
    r = summarize(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "coverage: every goal met" in r.stdout and " NO" not in r.stdout, r.stdout
    assert "commit: abc1234\ntree: clean" in r.stdout, r.stdout


def test_a_goal_missed_exits_1(tmp_path: Path) -> None:
    reports(tmp_path, ko_lines=95, ko_branches=79, sim_lines=90, py_lines=95)
    r = summarize(tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert re.search(r"gpupin.ko branches \(kernel/\*\.c\)\s+79\.0%\s+80%\s+NO", r.stdout), r.stdout
    assert "coverage: 1 goal missed: gpupin.ko branches (kernel/*.c)" in r.stdout, r.stdout


def test_python_under_its_goal_exits_1(tmp_path: Path) -> None:
    reports(tmp_path, ko_lines=95, ko_branches=85, sim_lines=90, py_lines=89)
    r = summarize(tmp_path, "abc1234+changes")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "coverage: 1 goal missed: pyctl/gpupin lines" in r.stdout, r.stdout
    assert "tree: abc1234 with uncommitted changes" in r.stdout, r.stdout


def test_a_missing_report_misses_its_goals(tmp_path: Path) -> None:
    reports(tmp_path, ko_lines=95, ko_branches=85, sim_lines=90, py_lines=95)
    os.unlink(tmp_path / "kernel.json")
    r = summarize(tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "coverage: 3 goals missed" in r.stdout and "NO (no report)" in r.stdout, r.stdout


def summary_mode(out: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, COVERAGE_OUT=str(out))
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "ci" / "coverage.sh"), "--summary"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_summary_mode_says_stale_and_never_fails(tmp_path: Path) -> None:
    r = summary_mode(tmp_path)
    assert r.returncode == 0 and "coverage: never measured here" in r.stdout, r.stdout + r.stderr
    reports(tmp_path, ko_lines=50, ko_branches=50, sim_lines=50, py_lines=50)
    summary = summarize(tmp_path, "0000000").stdout
    (tmp_path / "summary.txt").write_text(summary)
    r = summary_mode(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr  # stale and under every goal: said, not failed
    m = re.match(r"coverage: STALE: measured at 0000000; HEAD is (\S+): run make coverage\n", r.stdout)
    assert m, r.stdout
    assert summary in r.stdout
    # Measured at HEAD (as coverage.sh names it): the summary alone.
    (tmp_path / "summary.txt").write_text(summary.replace("commit: 0000000", f"commit: {m.group(1)}"))
    r = summary_mode(tmp_path)
    assert (
        r.returncode == 0
        and "STALE" not in r.stdout
        and r.stdout.startswith("coverage: measured with ") == (m.group(1).endswith("+changes"))
    ), r.stdout
