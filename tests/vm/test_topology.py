"""NVIDIA's topology verdict (``nv_grdma_pci_topology_supported``): a peer it refuses gets
no mapping by any path, gpupin's own mappings of non-persistent pins included, and says
EOPNOTSUPP; other peers still map.  The simulator refuses the peers in ``deny_peers``
(``nvidia_p2p_dma_map_pages`` and its static dma-buf exporter's attach, -ENOTSUPP as
NVIDIA)."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from typing import Any

import pytest

import gpupin
from conftest import GPU_PAGE, _pci_devices, first_pci_device
from gpupin import Device, SimMemory, sim_stats
from gpupin.peer import Peer
from gpupin.testing import load_peer

pytestmark = [pytest.mark.vm, pytest.mark.simonly(reason="the simulator's deny_peers plays NVIDIA's verdict")]

FORGET = "/sys/module/gpupin/parameters/forget_topology"


def _forget() -> None:
    with open(FORGET, "w") as f:
        f.write("1")


@pytest.fixture
def peers(sim_params: Any) -> Iterator[tuple[str, str]]:
    """(denied, allowed): two virtio PCI devices (64-bit DMA masks, so BAR pages above 4 GiB
    map too); the first in deny_peers.  gpupin forgets its verdicts before and after."""
    devs = [d for d in _pci_devices(0x1AF4) if int(open(f"/sys/bus/pci/devices/{d}/device").read(), 16) < 0x1100]
    if len(devs) < 2:
        pytest.skip("needs two virtio PCI devices")
    _forget()
    sim_params(deny_peers=devs[0])
    yield devs[0], devs[1]
    _forget()


@pytest.fixture(params=["host-pages", "bar"])
def mode(request: Any, sim_params: Any, bar_device: str) -> str:
    if request.param == "bar":
        sim_params(bar_device=bar_device)
    return str(request.param)


def _refused(ei: pytest.ExceptionInfo[gpupin.GpupinError], call: str) -> None:
    assert ei.value.errno == errno.EOPNOTSUPP and call in str(ei.value), ei.value


def test_own_mapping_of_denied_peer_refused(device: Device, sim: SimMemory, peers: tuple[str, str], mode: str) -> None:
    denied, allowed = peers
    va = sim.alloc(4 * GPU_PAGE)
    pin = device.pin(va, 4 * GPU_PAGE)
    for _ in range(2):  # asked once, then the kept verdict: refused both times
        with pytest.raises(gpupin.GpupinError) as ei:
            device.dma_map(pin, denied)
        _refused(ei, "DMA_MAP")
        assert device.query(pin).dma_mappings == 0 and pin.is_valid()
    m = device.dma_map(pin, allowed)
    assert m.entries == pin.entries and device.query(pin).dma_mappings == 1
    assert sim_stats().pinned_pages == 4  # the verdict's probe left nothing pinned
    device.dma_unmap(m)
    device.unpin(pin)
    sim.free(va)


def test_kernel_api_mapping_of_denied_peer_refused(
    device: Device, sim: SimMemory, peers: tuple[str, str], mode: str
) -> None:
    """A driver's mapping through the kernel API (the example peer) is an own mapping too."""
    denied, allowed = peers
    va = sim.alloc(2 * GPU_PAGE)
    pin = device.pin(va, 2 * GPU_PAGE)
    try:
        load_peer(denied)
        with Peer() as peer, pytest.raises(gpupin.GpupinError) as ei:
            peer.hold(device, pin)
        assert ei.value.errno == errno.EOPNOTSUPP, ei.value
        assert device.query(pin).dma_mappings == 0
        load_peer(allowed)
        with Peer() as peer:
            peer.release(peer.hold(device, pin))
    finally:
        load_peer(first_pci_device())
    device.unpin(pin)
    sim.free(va)


def test_persistent_pin_of_denied_peer_refused(
    device: Device, sim: SimMemory, peers: tuple[str, str], mode: str
) -> None:
    denied, allowed = peers
    va = sim.alloc(2 * GPU_PAGE)
    pin = device.pin(va, 2 * GPU_PAGE, persistent=True)
    with pytest.raises(gpupin.GpupinError) as ei:
        device.dma_map(pin, denied)
    _refused(ei, "DMA_MAP")
    assert device.query(pin).dma_mappings == 0 and sim_stats().dma_mappings == 0
    m = device.dma_map(pin, allowed)
    assert m.entries == pin.entries and sim_stats().dma_mappings == 1
    device.dma_unmap(m)
    device.unpin(pin)
    sim.free(va)


def test_dmabuf_attach_of_denied_peer_refused(device: Device, sim: SimMemory, peers: tuple[str, str]) -> None:
    denied, allowed = peers
    va = sim.alloc(2 * GPU_PAGE)
    fd = sim.export_dmabuf(va)
    with pytest.raises(gpupin.GpupinError) as ei:
        device.pin_dmabuf(fd, pci=denied)
    _refused(ei, "PIN_DMABUF")
    assert sim_stats().dmabuf_attachments == 0
    pin = device.pin_dmabuf(fd, pci=allowed)
    with pytest.raises(gpupin.GpupinError) as ei:
        device.dma_map(pin, denied)  # a second attachment, for the denied peer
    _refused(ei, "DMA_MAP")
    assert sim_stats().dmabuf_attachments == 1 and device.query(pin).dma_mappings == 0
    device.unpin(pin)
    os.close(fd)
    sim.free(va)
