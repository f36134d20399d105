"""Module loading through gpupin.kmod: errors, refcounts, and load/unload cycles."""

from __future__ import annotations

import os

import pytest

import gpupin
from conftest import GPU_PAGE
from gpupin import Device, SimMemory, kmod, sim_stats
from gpupin.kmod import ko_dir
from gpupin.testing import ensure_loaded

pytestmark = [
    pytest.mark.vm,
    pytest.mark.simonly(
        reason="loads and unloads nvp2p_sim and gpupin.ko from the build tree, made against the simulator"
    ),
]


def unload_all() -> None:
    for m in ("gpupin_peer", "gpupin", "nvp2p_sim"):
        if kmod.is_loaded(m):
            kmod.unload(m)


def test_unload_refused_while_open(gpupin_loaded: None) -> None:
    with Device():
        with pytest.raises(gpupin.ModuleError, match="in use"):
            kmod.unload("gpupin")
    with pytest.raises(gpupin.ModuleError, match="in use.*gpupin"):
        kmod.unload("nvp2p_sim")
    info = kmod.info("nvp2p_sim")
    assert info.state == "live" and "gpupin" in info.holders and info.refcount >= 1
    assert "bar_size" in info.parameters


def test_gpupin_without_provider_says_what_to_load(gpupin_loaded: None) -> None:
    unload_all()
    try:
        with pytest.raises(gpupin.ModuleError, match="nvidia_p2p_.*load nvidia .*or nvp2p_sim first"):
            kmod.load(str(ko_dir() / "gpupin.ko"))
        assert not kmod.is_loaded("gpupin")
        with pytest.raises(gpupin.DriverNotLoaded, match="gpupin load"):
            Device()
        with pytest.raises(gpupin.ModuleError, match="does not exist"):
            kmod.load("/nonexistent/gpupin.ko")
        with pytest.raises(gpupin.ModuleError, match="not loaded"):
            kmod.unload("gpupin")
    finally:
        ensure_loaded()


def test_bad_parameter_is_reported(gpupin_loaded: None) -> None:
    unload_all()
    try:
        with pytest.raises(gpupin.ModuleError, match="parameter"):
            kmod.load(str(ko_dir() / "nvp2p_sim.ko"), {"bar_size": "lots"})
    finally:
        ensure_loaded()


def test_load_unload_cycles(gpupin_loaded: None) -> None:
    cycles = int(os.environ.get("GPUPIN_CYCLES", "20"))
    for i in range(cycles):
        unload_all()
        assert not kmod.is_loaded("gpupin") and not kmod.is_loaded("nvp2p_sim")
        ensure_loaded()
        with SimMemory() as sim, Device() as dev:
            va = sim.alloc(4 * GPU_PAGE)
            pin = dev.pin(va, 4 * GPU_PAGE, user_tag=i)
            if i % 2:
                sim.free(va)
                assert not pin.is_valid()
            dev.unpin(pin)
        s = sim_stats()
        assert not s.leaks() and s.allocations == 0, s
    assert kmod.info("gpupin").state == "live"
