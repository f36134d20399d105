"""Allocation failures inside gpupin (the fail_alloc_nth parameter) leave no partial state.

Provider failures (-ENOMEM/-EIO/-EINVAL from get_pages) are in test_limits.py.
"""

from __future__ import annotations

import errno

import pytest

from conftest import GPU_PAGE, first_pci_device
from gpupin import Device, GpupinError, SimMemory, sim_stats
from gpupin.peer import Peer

pytestmark = [pytest.mark.vm, pytest.mark.simonly]

PARAM = "/sys/module/gpupin/parameters/fail_alloc_nth"


def scenario(peer: Peer, pci: str, log: list[str]) -> None:
    """Every gpupin call that allocates, in order; ``log`` gets the steps that completed."""
    with SimMemory() as sim:
        va = sim.alloc(4 * GPU_PAGE)
        sim.write(va, b"x" * 100)
        dev = Device()  # file + validity map
        log.append("open")
        try:
            pin = dev.pin(va, 4 * GPU_PAGE)  # pin + its invalidation record
            log.append("pin")
            m = dev.dma_map(pin, pci)  # mapping
            log.append("dma_map")
            assert len(dev.get_pages(pin)) == 4  # address buffer
            log.append("get_pages")
            assert len(dev.dma_addrs(m)) == 4  # address buffer
            log.append("dma_addrs")
            hold = peer.hold(dev, pin)  # driver reference (shares the mapping)
            log.append("hold")
            try:
                assert peer.read(dev, pin, 0, 100) == b"x" * 100  # another reference
                log.append("peer_read")
            finally:
                peer.release(hold)
            dev.dma_unmap(m)
            dev.unpin(pin)
            log.append("unpin")
        finally:
            dev.close()
        sim.free(va)


def read_param() -> int:
    with open(PARAM) as f:
        return int(f.read())


def write_param(n: int) -> None:
    with open(PARAM, "w") as f:
        f.write(str(n))


def test_every_own_allocation_failure_is_clean(peer: Peer) -> None:
    pci = first_pci_device()
    full: list[str] = []
    scenario(peer, pci, full)
    assert full[-1] == "unpin"
    failed_at = []
    try:
        for n in range(1, 20):
            write_param(n)
            log: list[str] = []
            try:
                scenario(peer, pci, log)
            except (GpupinError, OSError) as exc:
                assert exc.errno == errno.ENOMEM, f"allocation {n}: {exc!r}"
                failed_at.append(full[len(log)])
            left = read_param()
            if left:  # more allocations asked for than the scenario makes: done
                assert log == full
                break
            assert log != full, f"allocation {n} failed but every step succeeded"
            # Nothing left behind: no pin, no pages, no mapping, no reference.
            s = sim_stats()
            assert not s.leaks() and s.allocations == 0, (n, s)
            with Device() as dev:
                assert dev.info().pinned_bytes == 0
            assert peer.status().holds == 0
        else:
            pytest.fail("the scenario never ran out of allocations to fail")
    finally:
        write_param(0)
    print(f"own-allocation failures injected at: {failed_at}")
    # Every step that allocates was hit at least once.
    assert {"open", "pin", "dma_map", "get_pages", "dma_addrs", "hold", "peer_read"} <= set(failed_at)
    log = []
    scenario(peer, pci, log)
    assert log == full
