"""Every simulator-only VM test says why it cannot run over the real nvidia.ko."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Collects tests/vm (no module needed) and prints, per test, the reasons of its simonly marks.
COLLECT = """
import json, sys, pytest
from gpupin.testing import simonly_reason
found = {}
class Grab:
    def pytest_collection_finish(self, session):
        for it in session.items:
            found[it.nodeid] = [simonly_reason(m) for m in it.iter_markers("simonly")]
rc = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "tests/vm"], plugins=[Grab()])
print("SIMONLY " + json.dumps(found))
sys.exit(rc)
"""


def _collect() -> dict[str, list[str | None]]:
    out = subprocess.run(
        [sys.executable, "-c", COLLECT], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("SIMONLY ")]
    assert out.returncode == 0 and lines, out.stdout[-3000:] + out.stderr[-3000:]
    found: dict[str, list[str | None]] = json.loads(lines[-1][len("SIMONLY ") :])
    return found


def test_every_simonly_mark_says_why() -> None:
    found = _collect()
    assert len(found) > 100, f"collected only {len(found)} VM tests"
    missing = sorted(n for n, reasons in found.items() if None in reasons)
    assert not missing, f"simonly without a reason: {missing}"


def test_simonly_reason_reads_both_spellings() -> None:
    import pytest

    from gpupin.testing import simonly_reason

    assert simonly_reason(pytest.mark.simonly(reason="knob").mark) == "knob"
    assert simonly_reason(pytest.mark.simonly("counter").mark) == "counter"
    assert simonly_reason(pytest.mark.simonly.mark) is None
    assert simonly_reason(pytest.mark.simonly(reason=" ").mark) is None
