"""gpupin's kernel API through the example peer driver (tests/kmod/peer.c).

The peer copies between a user buffer and pinned simulated GPU memory via the
pin's DMA mapping; the simulator poisons freed memory and counts writes after
the free (``poison_errors``, checked by the leakcheck fixture after each test).
"""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest

import gpupin
from conftest import EINVAL, GPU_PAGE, SLOW, MiB, first_pci_device, pattern, raw
from gpupin import Device, SimMemory, kmod, sim_stats
from gpupin._native import lib
from gpupin.peer import Peer
from gpupin.testing import ensure_loaded, load_peer

pytestmark = [pytest.mark.vm, pytest.mark.simonly]

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
    assert peer.status().transfers == 1


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
