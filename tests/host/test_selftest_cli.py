"""``gpupin selftest`` on the host: its table fits a 100-column terminal, --json says the
same, a failed check makes the exit status 1.  The module checks themselves run in the VM
(tests/vm/test_selftest.py); here no module is loaded (``--no-load``: this host's own kernel
never gets one)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpupin.tools import cli, selftest


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


def test_modules_impossible_names_the_reason(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    exists = selftest.os.path.exists
    monkeypatch.setattr(selftest.os.path, "exists", lambda p: p == "/proc/modules" or exists(p))
    monkeypatch.setattr(selftest.os, "geteuid", lambda: 1000)
    assert selftest.modules_impossible() == "loading modules needs root"
    monkeypatch.setattr(selftest.os, "geteuid", lambda: 0)
    status, disabled = tmp_path / "status", tmp_path / "disabled"
    status.write_text("Name:\tpython\nCapEff:\t000001ffffffffff\n")
    disabled.write_text("0\n")
    assert selftest.modules_impossible(str(status), str(disabled)) is None
    disabled.write_text("1\n")
    assert "modules_disabled=1" in str(selftest.modules_impossible(str(status), str(disabled)))
    disabled.write_text("0\n")
    status.write_text("CapEff:\t000001fffffeffff\n")  # every capability but CAP_SYS_MODULE (16)
    assert "CAP_SYS_MODULE" in str(selftest.modules_impossible(str(status), str(disabled)))


def test_require_modules_fails_where_the_module_checks_could_not_run() -> None:
    r = gpupin("selftest", "--sim", "--no-load", "--require-modules", "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert report["passed"] is False and report["counts"]["n/a"] == len(selftest.MODULE_CHECKS) + 1


def test_checks_fail_under_python_O_too() -> None:
    """A check's assertions are not ``assert`` statements: -O does not make them pass."""
    code = (
        "from gpupin.tools import selftest\n"
        "r = selftest.run_check(lambda: selftest.expect(1 == 2, 'one is not two') or 'seen', 'x')\n"
        "print(r.status, r.evidence)\n"
    )
    r = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "fail one is not two", r.stdout + r.stderr


def test_pci_addresses_get_their_domain() -> None:
    assert selftest.normalize_pci("41:00.1") == "0000:41:00.1"
    assert selftest.normalize_pci("0001:c1:1f.7") == "0001:c1:1f.7"


def test_default_peer_prefers_an_rdma_device(tmp_path: Path) -> None:
    dev = tmp_path / "pci" / "0000:41:00.0"
    dev.mkdir(parents=True)
    (dev / "vendor").write_text("0x15b3\n")
    (tmp_path / "ib" / "mlx5_0").mkdir(parents=True)
    (tmp_path / "ib" / "mlx5_0" / "device").symlink_to(dev)
    assert selftest.default_peer_pci(str(tmp_path / "ib")) == "0000:41:00.0"
