#!/usr/bin/env python3
"""One line per file and the totals against the coverage goals (gpupin.ko: 90 % of lines and 80 %
of branches; the simulator with the example peer: 85 % of lines; the Python package: 90 % of
lines), from the reports of scripts/ci/coverage.sh (gcovr's JSON summary and coverage.py's JSON).

usage: coverage-summary.py OUT COMMIT SECONDS

COMMIT is what was measured: a short hash, with "+changes" where the tree had uncommitted
changes.  Exits 1 when a goal is missed (a missing report misses its goals), else 0.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def pct(n: int, d: int) -> str:
    return f"{100.0 * n / d:5.1f}%" if d else "    -"


def group(files: list[dict[str, Any]], pred: Any) -> tuple[int, int, int, int]:
    sel = [f for f in files if pred(f["filename"])]
    return (
        sum(f["line_covered"] for f in sel),
        sum(f["line_total"] for f in sel),
        sum(f["branch_covered"] for f in sel),
        sum(f["branch_total"] for f in sel),
    )


def main() -> int:
    out, commit, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3])
    print(f"commit: {commit}")
    if commit.endswith("+changes"):
        print(f"tree: {commit[: -len('+changes')]} with uncommitted changes (kernel, include, tests, pyctl, Kbuild)")
    else:
        print("tree: clean (no uncommitted changes in kernel, include, tests, pyctl, Kbuild)")
    print(f"measured in {seconds // 60} min {seconds % 60} s (make coverage)")
    goals: list[tuple[str, float | None, int]] = []  # None: not measured (no report)
    kpath = os.path.join(out, "kernel.json")
    if os.path.exists(kpath):
        with open(kpath) as f:
            files = json.load(f)["files"]
        print("\nkernel (gcov, VM suite)                    lines          branches")
        for f in sorted(files, key=lambda f: f["filename"]):
            print(
                f"  {f['filename']:<36} {pct(f['line_covered'], f['line_total'])} "
                f"{f['line_covered']:>4}/{f['line_total']:<4}  "
                f"{pct(f['branch_covered'], f['branch_total'])} {f['branch_covered']:>4}/{f['branch_total']}"
            )

        def gpupin_ko(name: str) -> bool:
            return name.startswith("kernel/") and "/" not in name[len("kernel/") :]

        lc, lt, bc, bt = group(files, gpupin_ko)
        goals.append(("gpupin.ko lines (kernel/*.c)", 100.0 * lc / lt if lt else 0, 90))
        goals.append(("gpupin.ko branches (kernel/*.c)", 100.0 * bc / bt if bt else 0, 80))
        lc, lt, _, _ = group(files, lambda n: n.startswith("kernel/sim/") or n == "examples/peer/peer.c")
        goals.append(("nvp2p_sim.ko + peer lines", 100.0 * lc / lt if lt else 0, 85))
    else:
        print("\nkernel: no report (see make coverage's output)")
        goals += [
            ("gpupin.ko lines (kernel/*.c)", None, 90),
            ("gpupin.ko branches (kernel/*.c)", None, 80),
            ("nvp2p_sim.ko + peer lines", None, 85),
        ]
    ppath = os.path.join(out, "python.json")
    if os.path.exists(ppath):
        with open(ppath) as f:
            data = json.load(f)
        suites = "host + VM + GPU suites" if os.path.isdir(os.path.join(out, "gpu")) else "host + VM suites"
        print(f"\npython (coverage.py, {suites})".ljust(44) + "lines")
        cov = tot = 0
        for name, info in sorted(data["files"].items()):
            s = info["summary"]
            rel = name[name.index("gpupin/") :] if "gpupin/" in name else name
            print(
                f"  {rel:<36} {pct(s['covered_lines'], s['num_statements'])} "
                f"{s['covered_lines']:>4}/{s['num_statements']}"
            )
            cov += s["covered_lines"]
            tot += s["num_statements"]
        goals.append(("pyctl/gpupin lines", 100.0 * cov / tot if tot else 0, 90))
    else:
        print("\npython: no report (see make coverage's output)")
        goals.append(("pyctl/gpupin lines", None, 90))
    print("\ngoal                                   measured  goal  met")
    missed = []
    for name, got, want in goals:
        if got is None:
            print(f"  {name:<36} {'-':>7}  {want:3d}%  NO (no report)")
        else:
            print(f"  {name:<36} {got:6.1f}%  {want:3d}%  {'yes' if got >= want else 'NO'}")
        if got is None or got < want:
            missed.append(name)
    if missed:
        print(f"\ncoverage: {len(missed)} goal{'s' if len(missed) > 1 else ''} missed: {', '.join(missed)}")
        return 1
    print("\ncoverage: every goal met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
