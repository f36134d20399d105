"""``gpupin selftest`` on the host: its table fits a 100-column terminal, --json says the
same, a failed check makes the exit status 1.  The module checks themselves run in the VM
(tests/vm/test_selftest.py); here no module is loaded (``--no-load``: this host's own kernel
never gets one)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gpupin import cli, selftest


def gpupin(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpupin", *args], capture_output=True, text=True, timeout=300)


def test_selftest_without_modules_says_why_and_passes_nothing() -> None:
    r = gpupin("selftest", "--sim", "--no-load")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert max(len(ln) for ln in lines) <= 100
    for fact in ("gpupin", "kernel", "GPU", "driver", "BAR1", "IOMMU", "provider", "peer device"):
        assert any(ln.startswith(fact + " ") for ln in lines), fact
    assert "selftest ran no check" in r.stdout
    j = gpupin("selftest", "--sim", "--no-load", "--json")
    report = json.loads(j.stdout)
    assert report["passed"] is True
    rows = {c["name"]: c for c in report["checks"]}
    for c in selftest.MODULE_CHECKS:
        assert rows[c.name]["status"] == "n/a" and "--no-load" in rows[c.name]["evidence"]


def test_a_failed_check_fails_the_command(monkeypatch: pytest.MonkeyPatch) -> None:
    out = selftest.Outcome({"GPU": "test"})
    out.results = [
        selftest.Result("pass", "pin", "fine"),
        selftest.Result("fail", "peer copy", "the peer read bytes that differ at offset 12 " * 5, "fix it"),
    ]
    monkeypatch.setattr(selftest, "run", lambda **kw: out)
    s = cli.Session()
    printed: list[str] = []
    s.out = printed.append
    assert cli.run_command(s, ["selftest"]) == 1
    text = "\n".join(printed)
    assert "selftest FAILED: 1 passed, 1 failed" in text and max(len(ln) for ln in text.splitlines()) <= 100
    printed.clear()
    assert cli.run_command(s, ["selftest", "--json"]) == 1
    assert json.loads(printed[0])["passed"] is False


def test_check_errors_become_results() -> None:
    def boom() -> str:
        raise OSError(5, "Input/output error")

    def skip() -> str:
        raise selftest.Skip("no peer")

    def wrong() -> str:
        raise AssertionError("3 != 4")

    got = [selftest.run_check(f, f.__name__) for f in (boom, skip, wrong, lambda: "seen")]
    assert [r.status for r in got] == ["fail", "skip", "fail", "pass"]
    assert got[0].evidence == "OSError: [Errno 5] Input/output error" and got[2].evidence == "3 != 4"


def test_modules_impossible_names_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    exists = selftest.os.path.exists
    monkeypatch.setattr(selftest.os.path, "exists", lambda p: p == "/proc/modules" or exists(p))
    monkeypatch.setattr(selftest.os, "geteuid", lambda: 1000)
    assert selftest.modules_impossible() == "loading modules needs root"
    monkeypatch.setattr(selftest.os, "geteuid", lambda: 0)
    why = selftest.modules_impossible()
    assert why is None or "modules_disabled" in why or "CAP_SYS_MODULE" in why
