"""gpupin's own mappings of BAR pages for a peer whose DMA ops cannot map a resource (no
``map_resource``: Xen's swiotlb-xen on older kernels): the BAR's bus addresses, as NVIDIA's
``nv_dma_map_peer`` falls back to (``pci_bus_address``), instead of failing with ENOMEM.
gpupin's testing parameter ``own_map_no_map_resource`` plays such a peer."""

from __future__ import annotations

from typing import Any

import pytest

from conftest import GPU_PAGE
from gpupin import Device, SimMemory, sim_stats

pytestmark = [pytest.mark.vm, pytest.mark.simonly(reason="gpupin's testing parameter and the simulator's bar_device")]


def _bar_bus_range(dev: str) -> tuple[int, int]:
    """The largest memory BAR of ``dev``: on x86 its bus addresses are its CPU addresses."""
    best = (0, -1)
    with open(f"/sys/bus/pci/devices/{dev}/resource") as f:
        for line in f.readlines()[:6]:
            start, end, flags = (int(x, 16) for x in line.split())
            if flags & 0x200 and end - start > best[1] - best[0]:
                best = (start, end)
    return best


def test_bar_pages_mapped_at_bus_addresses(
    device: Device, sim: SimMemory, sim_params: Any, bar_device: str, virtio_pci: str
) -> None:
    sim_params(bar_device=bar_device)
    sim_params("gpupin", own_map_no_map_resource=1)
    n = 4
    va = sim.alloc(n * GPU_PAGE)
    pin = device.pin(va, n * GPU_PAGE)
    phys = device.get_pages(pin)
    start, end = _bar_bus_range(bar_device)
    assert all(start <= a and a + GPU_PAGE - 1 <= end for a in phys)
    m = device.dma_map(pin, virtio_pci)
    assert device.dma_addrs(m) == phys  # pci_bus_address: on x86 the CPU address
    m2 = device.dma_map(pin, virtio_pci)  # a second one, left for the unpin to undo
    device.dma_unmap(m)
    assert device.query(pin).dma_mappings == 1 and device.dma_addrs(m2) == phys
    device.unpin(pin)
    assert sim_stats().pinned_pages == 0
    sim.free(va)


def test_host_pages_unaffected(device: Device, sim: SimMemory, sim_params: Any, virtio_pci: str) -> None:
    """Memory pages are mapped with dma_map_page, which every DMA ops have: the parameter
    changes nothing there."""
    sim_params("gpupin", own_map_no_map_resource=1)
    va = sim.alloc(2 * GPU_PAGE)
    pin = device.pin(va, 2 * GPU_PAGE)
    m = device.dma_map(pin, virtio_pci)
    assert m.entries == 2 and len(device.dma_addrs(m)) == 2
    device.unpin(pin)
    sim.free(va)
