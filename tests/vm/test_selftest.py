"""The integration suite of ``gpupin selftest`` (gpupin.tools.selftest), run by pytest.

The same check functions a user's ``gpupin selftest`` runs on a GPU host, here
over the provider-neutral fixtures: SimMemory and the simulator in the VM
(make test-vm), CudaMemory and nvidia.ko with GPUPIN_NATIVE=1 (make
test-native; the peer device named by GPUPIN_PEER_PCI).  In the VM every check
must run: a skip there fails.  Then the command itself, end to end.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from conftest import SLOW
from gpupin import Device, kmod
from gpupin.memory import MemoryProvider
from gpupin.peer import Peer, load_peer
from gpupin.testing import NATIVE
from gpupin.tools import selftest

pytestmark = pytest.mark.vm


@pytest.fixture
def target(device: Device, memory: MemoryProvider) -> Iterator[selftest.Target]:
    """What the checks run against: the provider-neutral Device and memory, and the example
    peer driver for the PCI device it maps for (GPUPIN_PEER_PCI; natively it must be set)."""
    t = selftest.Target(device, memory, "nvidia" if NATIVE else "nvp2p_sim")
    pci = os.environ.get("GPUPIN_PEER_PCI") or None
    if NATIVE and not pci:
        t.peer_why = "set GPUPIN_PEER_PCI to a NIC's PCI address to test a peer device"
        t.pci = selftest.default_peer_pci()
        yield t
        return
    load_peer(pci)
    t.pci = kmod.parameters("gpupin_peer")["pci"]
    with Peer() as t.peer:
        yield t


@pytest.mark.parametrize(
    "check", selftest.MODULE_CHECKS, ids=[c.name.replace(" ", "_") for c in selftest.MODULE_CHECKS]
)
def test_module_check(target: selftest.Target, check: selftest.Check) -> None:
    try:
        evidence = check.fn(target)
    except selftest.Skip as exc:
        if not NATIVE:
            pytest.fail(f"{check.name} skipped in the VM, where everything it needs is present: {exc}")
        pytest.skip(str(exc))
    assert evidence, f"{check.name} passed without saying what it saw"


def _selftest(*args: str) -> subprocess.CompletedProcess[str]:
    t0 = time.monotonic()
    try:
        return subprocess.run(
            [sys.executable, "-m", "gpupin", "selftest", *args], capture_output=True, text=True, timeout=120 * SLOW
        )
    finally:
        print(f"gpupin selftest {' '.join(args)}: {time.monotonic() - t0:.1f} s")


@pytest.mark.simonly(reason="runs the command with --sim; natively make test-native runs it with --native")
def test_the_command_passes_over_the_simulator(leakcheck: None) -> None:
    """``gpupin selftest --sim`` with the modules loaded: every module check passes and says
    what it saw, the CUDA row says why it did not run.  (The text layout is tested on the
    host, tests/host/test_selftest_cli.py: each run here costs a minute of emulated CPU.)"""
    load_peer()
    pci = kmod.parameters("gpupin_peer")["pci"]
    out = _selftest("--sim", "--pci", pci, "--json", "--require-modules")
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    rows = {r["name"]: r for r in report["checks"]}
    assert report["passed"] and report["facts"]["provider"] == "nvp2p_sim", report
    assert pci in report["facts"]["peer device"]
    for c in selftest.MODULE_CHECKS:
        assert rows[c.name]["status"] == "pass" and rows[c.name]["evidence"], rows[c.name]
    assert re.search(
        r"\(0 page copies through write-combined BAR mappings, [1-9]\d* through RAM\)", rows["peer copy"]["evidence"]
    ), rows["peer copy"]
    assert report["counts"] == {"pass": len(selftest.MODULE_CHECKS), "fail": 0, "skip": 0, "n/a": 1}
    assert rows["CUDA"]["status"] == "n/a"


@pytest.mark.simonly(reason="runs the command with --sim, against a PCI address that does not exist")
def test_the_command_fails_when_a_check_fails(leakcheck: None) -> None:
    """A PCI address that does not exist: the DMA mapping fails, the example peer is loaded
    for another device, and the command says so and exits 1."""
    load_peer()
    out = _selftest("--sim", "--pci", "00fe:ff:1f.7", "--json")
    assert out.returncode == 1, out.stdout + out.stderr
    rows = {r["name"]: r for r in json.loads(out.stdout)["checks"]}
    assert rows["dma map"]["status"] == "fail" and "no such PCI device" in rows["dma map"]["evidence"], rows["dma map"]
    assert "gpupin doctor" in rows["dma map"]["fix"]
    assert rows["peer copy"]["status"] == "skip" and "not 00fe:ff:1f.7" in rows["peer copy"]["evidence"]
    assert rows["pin"]["status"] == "pass"


def test_a_failing_check_leaves_nothing_behind(target: selftest.Target) -> None:
    """A check that fails after pinning unpins and frees what it made, so the checks after
    it start clean (a left pin would be invalidated by its free and fail the next ones)."""
    if target.peer is None:
        pytest.skip(target.peer_why)

    class ZeroReadingPeer:  # reads zeros where the memory holds the pattern
        def __getattr__(self, name: str) -> object:
            return getattr(target.peer, name)

        def read(self, device: Device, pin: object, offset: int, size: int) -> bytes:
            return bytes(size)

    lying = dataclasses.replace(target, peer=ZeroReadingPeer())
    with pytest.raises(selftest.CheckFailed, match="the peer read bytes that differ from offset 0"):
        selftest.check_peer_copy(lying)
    assert target.device.info().file_pins == 0 and target.device.read_events() == []
    assert selftest.check_invalidation(target)
