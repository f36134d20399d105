"""Where the modules are loaded from: the source tree's build, else the installed ones by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpupin import kmod

TREE = Path(__file__).resolve().parents[2]


def test_in_the_source_tree_the_built_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUPIN_KO_DIR", raising=False)
    assert kmod.ko_dir() == TREE


def test_installed_a_stray_ko_beside_site_packages_is_not_loaded(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("GPUPIN_KO_DIR", raising=False)
    pkg = tmp_path / "lib" / "python3.11" / "site-packages" / "gpupin"
    pkg.mkdir(parents=True)
    (tmp_path / "lib" / "python3.11" / "gpupin.ko").write_bytes(b"")
    monkeypatch.setattr(kmod, "__file__", str(pkg / "kmod.py"))
    assert kmod.ko_dir() is None
    assert kmod.module_file("gpupin") == "gpupin"


def test_gpupin_ko_dir_wins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "gpupin.ko").write_bytes(b"")
    monkeypatch.setenv("GPUPIN_KO_DIR", str(tmp_path))
    assert kmod.module_file("gpupin") == str(tmp_path / "gpupin.ko")
    assert kmod.module_file("nvp2p_sim") == "nvp2p_sim"  # not built there: by name


def test_gpupin_ko_by_path_brings_gpupin_cb_from_beside_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """insmod resolves no dependency: gpupin.ko imports the free callback's entry point from
    gpupin_cb.ko, which load() puts in first (from the same build), once."""
    for m in ("gpupin", "gpupin_cb", "nvp2p_sim"):
        (tmp_path / f"{m}.ko").write_bytes(b"")
    loaded: set[str] = set()
    calls: list[str] = []
    monkeypatch.setattr(kmod, "is_loaded", lambda name: name in loaded)
    monkeypatch.setattr(kmod, "load", lambda what, params=None: calls.append(what))
    kmod._load_dependencies(str(tmp_path / "gpupin.ko"))
    assert calls == [str(tmp_path / "gpupin_cb.ko")]
    loaded.add("gpupin_cb")
    kmod._load_dependencies(str(tmp_path / "gpupin.ko"))
    kmod._load_dependencies(str(tmp_path / "nvp2p_sim.ko"))
    assert calls == [str(tmp_path / "gpupin_cb.ko")], "loaded already, or nothing needed"
