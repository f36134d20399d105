"""gpupin's kernel API through the example peer driver (examples/peer/peer.c).

The peer maps the pin for its PCI device and copies between a user buffer and
the pinned GPU memory through the pages' physical addresses: RAM through the
kernel's mapping (the simulator's host pages), MMIO (a GPU's BAR1, the
simulator's ``bar_device``) through a write-combined mapping.  The simulator
poisons freed memory and counts writes after the free (``poison_errors``,
checked by the leakcheck fixture after each test).  The tests that take ``sim``
need the simulator and skip natively; the ``memory`` ones run in both modes
(natively with GPUPIN_PEER_PCI naming the peer's device, a NIC).
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import gpupin
from conftest import EINVAL, GPU_PAGE, SLOW, MiB, first_pci_device, pattern, raw
from gpupin import Device, SimMemory, kmod, sim_stats
from gpupin._native import lib
from gpupin.memory import MemoryProvider
from gpupin.peer import Peer
from gpupin.testing import NATIVE, ensure_loaded, load_peer

# Not simonly as a whole: the sim fixture skips natively, the memory tests run in both modes.
pytestmark = [pytest.mark.vm]

POISON_RUN = b"\x6b" * 64


SIZES = [1, 4096, GPU_PAGE - 1, GPU_PAGE, GPU_PAGE + 1, MiB, 64 * MiB]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("offset", [0, 4095])
def test_read_through_peer_is_byte_exact(device: Device, sim: SimMemory, peer: Peer, size: int, offset: int) -> None:
    lead = 300  # the pin starts 300 bytes into the allocation: unaligned va
    total = lead + offset + size
    va = sim.alloc(total)
    data = pattern(total, size)
    sim.write(va, data)
    pin = device.pin(va + lead, offset + size)
    got = peer.read(device, pin, offset, size)
    assert got == data[lead + offset : lead + offset + size]
    # Host pages: copied through the kernel's mapping of RAM, one count per GPU page touched.
    first, last = (lead + offset) // GPU_PAGE, (lead + offset + size - 1) // GPU_PAGE
    st = peer.status()
    assert (st.ram_pages, st.bar_pages) == (last - first + 1, 0)
    device.unpin(pin)
    sim.free(va)


@pytest.mark.parametrize("size", [1, GPU_PAGE + 1, 3 * MiB + 17])
def test_write_through_peer_reads_back_in_sim(device: Device, sim: SimMemory, peer: Peer, size: int) -> None:
    va = sim.alloc(size + 2 * GPU_PAGE)
    before = pattern(size + 2 * GPU_PAGE, 1)
    sim.write(va, before)
    pin = device.pin(va, size + 2 * GPU_PAGE)
    new = pattern(size, 2)[::-1]
    peer.write(device, pin, 12345, new)
    after = sim.read(va, size + 2 * GPU_PAGE)
    assert after[12345 : 12345 + size] == new
    # Nothing around the target was touched.
    assert after[:12345] == before[:12345]
    assert after[12345 + size :] == before[12345 + size :]
    st = peer.status()
    assert st.transfers == 1
    assert (st.ram_pages, st.bar_pages) == ((12345 + size - 1) // GPU_PAGE - 12345 // GPU_PAGE + 1, 0)


def test_peer_and_provider_copies_agree(device: Device, memory: MemoryProvider, peer: Peer) -> None:
    """Both modes: what the provider writes (natively a CUDA copy) the peer reads byte for byte,
    and what the peer writes the provider reads back; natively through the GPU's BAR1."""
    size = 5 * GPU_PAGE
    va = memory.alloc(size)
    memory.enable_sync_memops(va)
    data = pattern(size, 9)
    memory.write(va, data)
    pin = device.pin(va, size)
    assert peer.read(device, pin, 0, size) == data
    assert peer.read(device, pin, GPU_PAGE - 7, 3000) == data[GPU_PAGE - 7 : GPU_PAGE + 2993]
    new = pattern(2 * GPU_PAGE + 99, 10)[::-1]
    peer.write(device, pin, 777, new)
    assert memory.read(va, size) == data[:777] + new + data[777 + len(new) :]
    st = peer.status()
    copied = 5 + 2 + 3  # GPU pages touched by the three transfers
    assert st.transfers == 3 and st.ram_pages + st.bar_pages == copied, st
    if not NATIVE:
        assert st.bar_pages == 0, "the simulator's default pages are host RAM"
    device.unpin(pin)
    memory.free(va)


def _largest_mem_bar(pci: str) -> tuple[int, int, int]:
    """(index, start, end) of the largest memory BAR of ``pci``, as the simulator picks it."""
    best = (-1, 0, -1)
    with open(f"/sys/bus/pci/devices/{pci}/resource") as f:
        for i, line in enumerate(f.read().splitlines()[:6]):  # the six standard BARs
            start, end, flags = (int(x, 16) for x in line.split())
            if flags & 0x200 and end - start > best[2] - best[1]:  # IORESOURCE_MEM
                best = (i, start, end)
    return best


@pytest.fixture
def peer_for(leakcheck: None) -> Iterator[Callable[[str], Peer]]:
    """``peer_for(pci)``: a peer reloaded as the DMA engine of ``pci``; the default one after."""
    opened: list[Peer] = []

    def open_for(pci: str) -> Peer:
        load_peer(pci)
        opened.append(Peer())
        return opened[-1]

    yield open_for
    for p in opened:
        p.close()
    load_peer(first_pci_device())


def test_bar_pages_copied_through_mmio(
    device: Device, sim: SimMemory, sim_params: Any, bar_device: str, virtio_pci: str, peer_for: Any
) -> None:
    """With the simulator's bar_device the page table holds addresses inside the ivshmem BAR
    (wrapped modulo its size), with no struct page behind them, as a GPU's BAR1 addresses: the
    peer copies through a write-combined mapping of them.  The memory behind that BAR is the
    ivshmem device's, not the simulator's pages, so what the peer writes it reads back through
    the BAR, user space sees it through the BAR's sysfs mapping, and the simulated memory keeps
    its old bytes."""
    sim_params(bar_device=bar_device)
    peer = peer_for(virtio_pci)  # a 64-bit DMA mask: the BAR lies above 4 GiB
    bar, start, end = _largest_mem_bar(bar_device)
    n = 6
    va = sim.alloc(n * GPU_PAGE)
    orig = pattern(n * GPU_PAGE, 11)
    sim.write(va, orig)
    pin = device.pin(va, n * GPU_PAGE)
    phys = device.get_pages(pin)
    assert all(start <= a and a + GPU_PAGE - 1 <= end for a in phys)
    data = pattern(n * GPU_PAGE, 12)[::-1]
    peer.write(device, pin, 0, data)
    # Pages whose addresses wrapped onto one BAR slot share its bytes: the last write wins.
    slot = {a: data[i * GPU_PAGE : (i + 1) * GPU_PAGE] for i, a in enumerate(phys)}
    want = b"".join(slot[a] for a in phys)
    assert peer.read(device, pin, 0, n * GPU_PAGE) == want
    assert peer.read(device, pin, GPU_PAGE - 5, GPU_PAGE + 10) == want[GPU_PAGE - 5 : 2 * GPU_PAGE + 5]
    st = peer.status()
    assert (st.ram_pages, st.bar_pages) == (0, n + n + 3), st
    assert sim.read(va, n * GPU_PAGE) == orig, "the simulator's pages are not behind the BAR"
    # The same bytes through user space's own mapping of the BAR, and back.
    mark = pattern(4096, 13)
    with open(f"/sys/bus/pci/devices/{bar_device}/resource{bar}", "r+b") as f:
        with mmap.mmap(f.fileno(), end - start + 1) as bar_map:
            for i, a in enumerate(phys):
                assert bar_map[a - start : a - start + GPU_PAGE] == want[i * GPU_PAGE : (i + 1) * GPU_PAGE]
            bar_map[phys[2] - start + 100 : phys[2] - start + 4196] = mark
    assert peer.read(device, pin, 2 * GPU_PAGE + 100, 4096) == mark
    device.unpin(pin)
    sim.free(va)


def test_free_while_held_notifies_and_fails_cleanly(device: Device, sim: SimMemory, peer: Peer) -> None:
    va = sim.alloc(4 * GPU_PAGE)
    sim.write(va, pattern(4 * GPU_PAGE))
    pin = device.pin(va, 4 * GPU_PAGE)
    hold = peer.hold(device, pin)
    assert peer.status().holds == 1 and peer.status().notified == 0
    assert device.query(pin).dma_mappings == 1
    sim.free(va)
    assert peer.status().notified == 1
    assert not pin.is_valid()
    with pytest.raises(gpupin.TransferAborted) as ei:
        peer.read(device, pin, 0, 100)
    assert ei.value.errno == errno.ENODEV and ei.value.done == 0
    with pytest.raises(gpupin.PinInvalidated, match="freed"):
        peer.hold(device, pin)
    peer.release(hold)
    s = sim_stats()
    assert s.pinned_pages == 0 and s.dma_mappings == 0 and s.poison_errors == 0
    device.unpin(pin)


def _race_free(sim: SimMemory, va: int, delay: float) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(delay), sim.free(va)))
    t.start()
    return t


@pytest.mark.parametrize("direction", ["read", "write"])
def test_free_during_transfer_stops_it(
    device: Device, sim: SimMemory, peer: Peer, sim_params: object, direction: str
) -> None:
    size = 32 * GPU_PAGE
    # ~0.7 s for the transfer (7 s under the debug kernel); the free comes about a third in.
    sim_params("gpupin_peer", chunk_delay_us=20000 * SLOW)
    va = sim.alloc(size)
    data = pattern(size, 3)
    new = pattern(size, 4)  # made before the race starts: it takes a while under KASAN
    sim.write(va, data)
    pin = device.pin(va, size)
    t = _race_free(sim, va, 0.25 * SLOW)
    with pytest.raises(gpupin.TransferAborted) as ei:
        if direction == "read":
            peer.read(device, pin, 0, size)
        else:
            peer.write(device, pin, 0, new)
    t.join()
    exc = ei.value
    assert exc.errno in (errno.EIO, errno.ENODEV)
    assert 0 < exc.done < size, exc.done
    if direction == "read":
        # What arrived is the data, never the poison of freed memory.
        assert exc.partial == data[: exc.done]
        assert POISON_RUN not in exc.partial
    st = peer.status()
    assert st.aborted == 1 and st.transfers == 0
    device.unpin(pin)
    # Writes after the free would show as poison_errors (checked by leakcheck too).
    assert sim_stats().poison_errors == 0


def test_unpin_while_held_defers_the_release(device: Device, sim: SimMemory, peer: Peer) -> None:
    va = sim.alloc(2 * GPU_PAGE)
    sim.write(va, pattern(2 * GPU_PAGE, 5))
    pin = device.pin(va, 2 * GPU_PAGE, persistent=True)  # mapped by NVIDIA: the sim counts it
    hold = peer.hold(device, pin)
    device.unpin(pin)
    assert not pin.is_valid()
    with pytest.raises(gpupin.UnknownHandle):
        device.query(pin)
    # The driver still holds the pages: pinned, mapped, and counted.
    s = sim_stats()
    assert s.pinned_pages == 2 and s.dma_mappings == 1
    peer.release(hold)
    s = sim_stats()
    assert s.pinned_pages == 0 and s.dma_mappings == 0
    sim.free(va)


def test_close_while_held_defers_the_release(sim: SimMemory, peer: Peer) -> None:
    dev = Device()
    va = sim.alloc(GPU_PAGE)
    pin = dev.pin(va, GPU_PAGE)
    hold = peer.hold(dev, pin)
    dev.close()
    assert sim_stats().pinned_pages == 1, "the peer's reference keeps the pin"
    # The memory can still go: the callback is never delayed by a driver.
    sim.free(va)
    assert peer.status().notified == 1
    assert sim_stats().pinned_pages == 0
    peer.release(hold)


def test_mapping_shared_with_user_dma_map(device: Device, sim: SimMemory, peer: Peer) -> None:
    va = sim.alloc(2 * GPU_PAGE)
    data = pattern(2 * GPU_PAGE, 6)
    sim.write(va, data)
    pin = device.pin(va, 2 * GPU_PAGE)
    m = device.dma_map(pin, first_pci_device())
    hold = peer.hold(device, pin)
    assert device.query(pin).dma_mappings == 1, "the peer reuses the mapping for its device"
    device.dma_unmap(m)
    assert device.query(pin).dma_mappings == 1, "still the driver's"
    assert peer.read(device, pin, 100, 1000) == data[100:1100]
    with pytest.raises(gpupin.UnknownHandle):
        device.dma_unmap(m)
    peer.release(hold)
    assert device.query(pin).dma_mappings == 0
    assert sim_stats().dma_mappings == 0


def test_bad_requests(device: Device, sim: SimMemory, peer: Peer) -> None:
    va = sim.alloc(GPU_PAGE)
    pin = device.pin(va, 1000)
    fd = peer._fd
    buf = bytearray(16)
    addr = int(gpupin._native.ffi.cast("uintptr_t", gpupin._native.ffi.from_buffer(buf)))
    ok = dict(gpupin_fd=device.fileno(), handle=pin.handle, length=16, buf=addr)
    assert raw(fd, lib.GPUPIN_PEER_IOC_XFER, "struct gpupin_peer_xfer", **ok)[0] == 0
    xfer = "struct gpupin_peer_xfer"
    cmd = lib.GPUPIN_PEER_IOC_XFER
    assert raw(fd, cmd, xfer, **{**ok, "flags": 2})[0] == EINVAL
    assert raw(fd, cmd, xfer, **{**ok, "reserved": [0, 1]})[0] == EINVAL
    assert raw(fd, cmd, xfer, **{**ok, "done": 1})[0] == EINVAL
    assert raw(fd, cmd, xfer, **{**ok, "length": 0})[0] == EINVAL
    # Past the pinned size (1000 bytes), and offset overflow.
    assert raw(fd, cmd, xfer, **{**ok, "offset": 990})[0] == EINVAL
    assert raw(fd, cmd, xfer, **{**ok, "offset": 2**64 - 8})[0] == EINVAL
    assert raw(fd, cmd, xfer, **{**ok, "handle": pin.handle + 100})[0] == -errno.ENOENT
    with open("/dev/null", "rb") as null:
        assert raw(fd, cmd, xfer, **{**ok, "gpupin_fd": null.fileno()})[0] == EINVAL
    assert raw(fd, cmd, xfer, **{**ok, "gpupin_fd": 9999})[0] == -errno.EBADF
    assert raw(fd, cmd, xfer, **{**ok, "gpupin_fd": -1})[0] == -errno.EBADF
    hold = "struct gpupin_peer_hold"
    assert raw(fd, lib.GPUPIN_PEER_IOC_HOLD, hold, gpupin_fd=device.fileno(), handle=pin.handle, pad=1)[0] == EINVAL
    assert raw(fd, lib.GPUPIN_PEER_IOC_RELEASE, "struct gpupin_peer_release", hold_id=77)[0] == -errno.ENOENT
    assert raw(fd, lib.GPUPIN_PEER_IOC_RELEASE, "struct gpupin_peer_release", hold_id=1, flags=2)[0] == EINVAL
    info = gpupin._native.ffi.new("struct gpupin_info *")
    assert lib.gpupin_call(fd, lib.GPUPIN_IOC_INFO, info) == -errno.ENOTTY
    with pytest.raises(gpupin.InvalidArgument, match="size must be > 0"):
        peer.read(device, pin, 0, 0)
    assert peer.status().holds == 0


def test_foreign_process_cannot_use_the_fd(device: Device, sim: SimMemory, peer: Peer) -> None:
    va = sim.alloc(GPU_PAGE)
    pin = device.pin(va, GPU_PAGE)
    pid = os.fork()
    if pid == 0:  # the child inherited the gpupin fd, but did not open it
        code = 1
        try:
            with Peer() as p:
                p.read(device, pin, 0, 16)
        except gpupin.PermissionDenied:
            code = 0
        except BaseException:
            code = 2
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_unload_ordering(sim: SimMemory) -> None:
    load_peer()
    dev = Device()
    va = sim.alloc(GPU_PAGE)
    pin = dev.pin(va, GPU_PAGE)
    p = Peer()
    p.hold(dev, pin)
    dev.close()
    try:
        with pytest.raises(gpupin.ModuleError, match="in use"):
            kmod.unload("gpupin")
        with pytest.raises(gpupin.ModuleError, match="in use"):
            kmod.unload("gpupin_peer")
        p.close()  # drops the hold, then the gpupin file
        assert sim_stats().pinned_pages == 0
        kmod.unload("gpupin_peer")
        kmod.unload("gpupin")
    finally:
        p.close()
        ensure_loaded()
        load_peer()
    sim.free(va)
