"""What NIXL can do here: gpupin.nixl.probe, the doctor's check_nixl, 'gpupin nixl status'.

The tests that need NIXL itself skip without it ('make setup' installs it); the paths for a
host without NIXL run everywhere, with its import made to fail.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpupin import nixl
from gpupin.nixl import INSTALL, PluginStatus, probe

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
    why = nixl._why_not(api, "GONE", nixlNotFoundError("NIXL_ERR_NOT_FOUND"), "E0000 x.cpp:1] unsupported backend")
    assert why == "nixlNotFoundError: NIXL_ERR_NOT_FOUND"
    why = nixl._why_not(api, "ODD", RuntimeError("NIXL_ERR_BACKEND"), "\x1b[32mW1127 1:2:3.4 5 a.cpp:9] no NIC\n")
    assert why == "RuntimeError: NIXL_ERR_BACKEND (no NIC)"
    assert len(nixl._why_not(api, "L", RuntimeError("x" * 500), "")) == 160


def test_plugin_status_lookup() -> None:
    st = nixl.NixlStatus(True, plugins=[PluginStatus("UCX", True, ["DRAM_SEG"]), PluginStatus("GDS", False, [], "e")])
    assert st.plugin("GDS") is st.plugins[1] and st.plugin("POSIX") is None
