"""What NIXL can do here: gpupin.nixl.probe, 'gpupin nixl status' (and in the shell).

The tests that need NIXL itself skip without it ('make setup' installs it); the paths for a
host without NIXL run everywhere, with its import made to fail.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpupin import nixl
from gpupin.nixl import INSTALL, PluginStatus, probe
from gpupin.tools import cli, doctor

have_nixl = pytest.mark.skipif(
    importlib.util.find_spec("nixl_cu13") is None, reason="NIXL is not installed: run 'make setup'"
)


def block_nixl(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every module load_nixl tries fails to import, as on a host without NIXL."""
    for name in ("nixl_cu13", "nixl_cu12", "nixl", "nixl._api"):
        monkeypatch.setitem(sys.modules, name, None)


def test_probe_without_nixl_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    block_nixl(monkeypatch)
    st = probe()
    assert not st.installed and not st.plugins and st.selftest is None
    assert "NIXL is not installed" in st.error and INSTALL in st.error


@have_nixl
@pytest.mark.timeout(120)
def test_probe_here_prints_nothing_and_runs_the_self_test(capfd: pytest.CaptureFixture[str]) -> None:
    capfd.readouterr()
    st = probe()
    assert capfd.readouterr() == ("", "")  # NIXL's, UCX's and the plugins' prints went to st.log
    assert st.installed and not st.error and st.version == nixl.nixl_version() and st.module == "nixl_cu13"
    assert Path(st.location, "__init__.py").exists()
    assert st.plugins[0].name == "UCX" and st.plugins[0].loads and "DRAM_SEG" in st.plugins[0].mem_types
    assert all(p.loads or p.error for p in st.plugins)  # each one that does not load says why
    assert st.selftest is True and "64 KiB" in st.selftest_detail and "read back equal" in st.selftest_detail
    assert st.vram_detail.startswith("UCX lists VRAM_SEG")  # nixl-cu13's UCX is built with CUDA
    if not Path("/sys/module/nvidia").is_dir():
        assert not st.vram


@have_nixl
@pytest.mark.timeout(60)
def test_selftest_moves_other_sizes() -> None:
    assert nixl.selftest(size=4096 + 17).startswith("4 KiB written")


def test_why_a_backend_does_not_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class nixlNotFoundError(Exception):  # noqa: N801 - NIXL's name
        pass

    log = (
        "E1127 17:42:18.517405   18942 backend_plugin.h:102] Failed to create engine: Missing config entry 'X'\n"
        "E1127 17:42:18.517450   18942 nixl_agent.cpp:342] createBackend: backend creation failed for 'AZ'\n"
    )
    api = SimpleNamespace(__name__="nixl_cu13", __file__=str(tmp_path / "site" / "nixl_cu13" / "__init__.py"))
    assert nixl._why_not(api, "AZ", RuntimeError("NIXL_ERR_BACKEND"), log) == "Missing config entry 'X'"
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "libplugin_BAD.so").write_bytes(b"not an ELF file")
    monkeypatch.setenv("NIXL_PLUGIN_DIR", str(plugins))
    why = nixl._why_not(api, "BAD", nixlNotFoundError("NIXL_ERR_NOT_FOUND"), "")
    assert why.startswith("its library does not load:") and "libplugin_BAD.so" in why
    if shutil.which("gcc"):  # a plugin whose own dependency is missing: dlerror names it
        (tmp_path / "dep.c").write_text("int dep(void) { return 1; }\n")
        (tmp_path / "plugin.c").write_text("int dep(void);\nint plugin(void) { return dep(); }\n")
        cc = ["gcc", "-shared", "-fPIC", "-o"]
        subprocess.run([*cc, str(tmp_path / "libgpupindep.so"), str(tmp_path / "dep.c")], check=True)
        subprocess.run(
            [*cc, str(plugins / "libplugin_DEP.so"), str(tmp_path / "plugin.c"), f"-L{tmp_path}", "-lgpupindep"],
            check=True,
        )
        (tmp_path / "libgpupindep.so").unlink()
        why = nixl._why_not(api, "DEP", nixlNotFoundError("NIXL_ERR_NOT_FOUND"), "")
        assert why == "needs libgpupindep.so, not found here"
    why = nixl._why_not(api, "GONE", nixlNotFoundError("NIXL_ERR_NOT_FOUND"), "E0000 x.cpp:1] unsupported backend")
    assert why == "nixlNotFoundError: NIXL_ERR_NOT_FOUND"
    why = nixl._why_not(api, "ODD", RuntimeError("NIXL_ERR_BACKEND"), "\x1b[32mW1127 1:2:3.4 5 a.cpp:9] no NIC\n")
    assert why == "RuntimeError: NIXL_ERR_BACKEND (no NIC)"
    assert len(nixl._why_not(api, "L", RuntimeError("x" * 500), "")) == 160


def test_plugin_status_lookup() -> None:
    st = nixl.NixlStatus(True, plugins=[PluginStatus("UCX", True, ["DRAM_SEG"]), PluginStatus("GDS", False, [], "e")])
    assert st.plugin("GDS") is st.plugins[1] and st.plugin("POSIX") is None


# -- 'gpupin nixl status' --------------------------------------------------------------------
def gpupin(*args: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GPUPIN_HISTORY": os.devnull}
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "gpupin", *args], capture_output=True, text=True, env=env, timeout=120)


@have_nixl
def test_nixl_status_json_here() -> None:
    r = gpupin("nixl", "status", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    st = json.loads(r.stdout)  # nothing NIXL printed got into it
    assert st["version"] == importlib.metadata.version("nixl-cu13") and st["module"] == "nixl_cu13"
    assert st["error"] is None and next(iter(st["plugins"])) == "UCX"
    assert st["plugins"]["UCX"]["loads"] and "DRAM_SEG" in st["plugins"]["UCX"]["mem_types"]
    assert all(p["loads"] or p["error"] for p in st["plugins"].values())
    assert st["selftest"]["ok"] is True and "64 KiB" in st["selftest"]["detail"]
    checks = {c["name"]: c for c in st["checks"]}
    assert [checks[n]["status"] for n in ("NIXL", "NIXL UCX", "NIXL self-test")] == ["pass"] * 3
    assert checks["NIXL VRAM"]["status"] == ("pass" if st["vram"]["usable"] else "warn")
    if not st["vram"]["usable"]:
        assert checks["NIXL VRAM"]["fix"] and st["vram"]["detail"] in checks["NIXL VRAM"]["detail"]
    assert "createBackend" not in r.stderr and "NIXL INFO" not in r.stderr


@have_nixl
def test_nixl_status_plain_here_and_its_log() -> None:
    r = gpupin("nixl", "status")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    version = importlib.metadata.version("nixl-cu13")
    assert lines[0].split()[:3] == ["NIXL", version, "(nixl_cu13"]
    assert lines[1].split()[:4] == ["backend", "UCX", "loads", "(DRAM_SEG,"]
    assert any(line.split()[:4] == ["NIXL", "self-test", "pass:", "64"] for line in lines)
    assert "NIXL backends" not in r.stdout  # the backend lines say it
    assert "createBackend" not in r.stdout + r.stderr and "GUSLIc" not in r.stdout
    logged = gpupin("nixl", "status", "--log")
    assert logged.returncode == 0 and len(logged.stdout.splitlines()) == len(lines)
    if "does not load" in r.stdout:  # NIXL logged why, and --log shows it
        assert logged.stderr.strip()


def test_nixl_status_without_nixl_is_a_clear_error(tmp_path: Path) -> None:
    for name in ("nixl_cu13", "nixl_cu12", "nixl"):  # shadows that fail to import, as if absent
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("raise ImportError('not installed (test)')\n")
    for args in (["nixl", "status"], ["nixl", "status", "--json"]):
        r = gpupin(*args, pythonpath=tmp_path)
        assert r.returncode == 1
        assert r.stdout.startswith("error: NIXL is not installed for this Python") and INSTALL in r.stdout
        assert "Traceback" not in r.stdout + r.stderr
    r = gpupin("doctor", "--json", pythonpath=tmp_path)
    assert r.returncode == 0
    (c,) = [c for c in json.loads(r.stdout) if c["name"].startswith("NIXL")]
    assert c["status"] == "warn" and c["fix"].startswith(INSTALL)


def test_nixl_status_in_process_without_nixl(monkeypatch: pytest.MonkeyPatch) -> None:
    block_nixl(monkeypatch)
    s = cli.Session()
    said: list[str] = []
    s.out = said.append
    assert cli.run_command(s, ["nixl", "status"]) == 1
    assert said == [said[0]] and said[0].startswith("error: NIXL is not installed") and INSTALL in said[0]
    (c,) = doctor.check_nixl()
    assert c.status == "warn" and "optional" in c.fix


def test_shell_knows_nixl_status() -> None:
    r = gpupin("shell", "-c", "help; help nixl; nixl status --json")
    assert "nixl" in r.stdout.splitlines()[0].split()  # "commands: ..."
    assert "usage: gpupin nixl" in r.stdout and "--log" in r.stdout
    if importlib.util.find_spec("nixl_cu13") is not None:
        assert r.returncode == 0 and '"selftest"' in r.stdout
    else:
        assert r.returncode == 1 and INSTALL in r.stdout
