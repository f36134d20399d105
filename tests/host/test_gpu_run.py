"""scripts/gpu/gpu-run.sh exits with the first failing step's status, every step through tee.

The script runs in a copy of its tree with ``python3`` and ``nvidia-smi`` stubbed on PATH: the
stub fails (status 3) when its arguments contain $FAIL_ON, and succeeds otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STUB = """#!/bin/sh
echo "$(basename "$0") $*" >>"$CALLS"
case "$*" in
*"$FAIL_ON"*) [ -n "$FAIL_ON" ] && { echo "stub: failing"; exit 3; } ;;
esac
exit 0
"""


def run_gpu_run(tmp_path: Path, fail_on: str) -> tuple[int, str, list[str]]:
    tree = tmp_path / "tree"
    (tree / "scripts" / "gpu").mkdir(parents=True)
    (tree / "pyctl").mkdir()
    shutil.copy(ROOT / "scripts" / "lib.sh", tree / "scripts" / "lib.sh")
    shutil.copy(ROOT / "scripts" / "gpu" / "gpu-run.sh", tree / "scripts" / "gpu" / "gpu-run.sh")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name in ("python3", "nvidia-smi"):
        (bindir / name).write_text(STUB)
        (bindir / name).chmod(0o755)
    calls = tmp_path / "calls.txt"
    env = dict(os.environ)
    env.update(
        PATH=f"{bindir}{os.pathsep}/usr/bin{os.pathsep}/bin",
        OUT=str(tmp_path / "out"),
        CALLS=str(calls),
        FAIL_ON=fail_on,
        GPUDIRECT_NO_UDEV_FIX="1",
        GPUPIN_GPU_BENCH="all",
    )
    r = subprocess.run(
        ["bash", str(tree / "scripts" / "gpu" / "gpu-run.sh")], env=env, capture_output=True, text=True, timeout=60
    )
    return r.returncode, r.stdout + r.stderr, calls.read_text().splitlines()


@pytest.mark.parametrize(
    "fail_on",
    [
        "--query-gpu",
        "import cuda.bindings",
        "-m pytest",
        "gpupin selftest",
        "gpupin gds status",
        "bench --gds",
        "bench --only-cuda",
    ],
)
def test_a_failing_step_fails_the_run(tmp_path: Path, fail_on: str) -> None:
    rc, out, calls = run_gpu_run(tmp_path, fail_on)
    assert rc == 3, out
    assert "failed with status 3" in out, out
    # The steps after the failing one still ran: the last is the CUDA benchmark.
    assert any("bench --only-cuda" in c for c in calls), calls


def test_all_steps_passing_pass(tmp_path: Path) -> None:
    rc, out, calls = run_gpu_run(tmp_path, "")
    assert rc == 0, out
    assert any("-m pytest" in c for c in calls) and any("bench --only-cuda" in c for c in calls), calls
