"""The dma-buf backend: PIN_DMABUF of buffers exported by the simulator (by default static, as
NVIDIA's exporter is; revocable=True: a dynamic exporter that revokes on free) and by vgem (a
static one), read and written through the peer driver.

All but the capability check import those exporters: simulator-only, each saying which."""

from __future__ import annotations

import errno
import os
import threading
import time
from typing import Any

import pytest

import gpupin
from conftest import EINVAL, GPU_PAGE, SLOW, KiB, MiB, first_pci_device, pattern
from gpupin import Device, SimMemory, kmod, sim_stats
from gpupin._native import ffi, lib
from gpupin.cache import RegistrationCache
from gpupin.netlink import Netlink
from gpupin.peer import Peer
from gpupin.sim import get_sim_param, set_sim_param

pytestmark = pytest.mark.vm
SIM_EXPORT = pytest.mark.simonly(reason="pins dma-bufs of the simulator's (static) exporter")
REVOKES = pytest.mark.simonly(reason="needs the simulator's revocable dma-buf export: NVIDIA's exporter never revokes")
FAILS = pytest.mark.simonly(reason="makes the simulator's exporter fail (fail_attach_nth, fail_dmabuf_map_nth)")
PAGE = os.sysconf("SC_PAGE_SIZE")


def test_capability(device: Device) -> None:
    assert device.info().dmabuf


@REVOKES
def test_a_dmabuf_pin_and_map_wait_for_the_exporters_move(device: Device, sim: SimMemory, sim_params) -> None:  # type: ignore[no-untyped-def]
    """An exporter that migrates the buffer to pin or map it (amdgpu) returns with the copy still
    running behind a KERNEL fence, and the dma-buf core waits for those only for static
    importers: gpupin's are dynamic.  PIN_DMABUF and DMA_MAP give the addresses only once the
    move ended (the simulator's move_fences: a move ends when the test says so)."""
    sim_params(move_fences=1)
    pci = first_pci_device()
    va = sim.alloc(GPU_PAGE)
    fd = sim.export_dmabuf(va, revocable=True)
    got: list[Any] = []

    def pending() -> int:
        return int(get_sim_param("move_fences_pending"))

    def call_then_end_moves(call: Any, what: str) -> None:
        before = len(got)
        t = threading.Thread(target=lambda: got.append(call()))
        t.start()
        time.sleep(0.3)
        assert len(got) == before, f"{what} returned while the exporter's move was running"
        assert pending() >= 1, f"{what}: the exporter started no move"
        set_sim_param("move_fences_signal", 1)
        t.join(10)
        assert len(got) == before + 1 and pending() == 0, f"{what} did not return once the move ended"

    try:
        call_then_end_moves(lambda: device.pin_dmabuf(fd, pci=pci), "PIN_DMABUF")
        pin = got[0]
        call_then_end_moves(lambda: device.dma_map(pin, pci), "DMA_MAP")
        device.dma_unmap(got[1])
        device.unpin(pin)
    finally:
        set_sim_param("move_fences_signal", 1)  # never leave a move running
        os.close(fd)
    sim.free(va)


@REVOKES
def test_sim_export_pinned_and_read_exactly(device: Device, sim: SimMemory, peer: Peer) -> None:
    size = 3 * GPU_PAGE + 100
    va = sim.alloc(size)
    data = pattern(4 * GPU_PAGE, 1)
    sim.write(va, data)
    fd = sim.export_dmabuf(va + 5000, revocable=True)  # any address exports the whole allocation
    assert os.lseek(fd, 0, os.SEEK_END) == 4 * GPU_PAGE
    pin = device.pin_dmabuf(fd, user_tag=7, pci=first_pci_device())
    os.close(fd)  # the pin holds the buffer
    assert pin.dmabuf and pin.page_size == PAGE and pin.entries == 4 * GPU_PAGE // PAGE
    q = device.query(pin)
    assert q.dmabuf and q.state == "pinned" and q.va == 0 and q.size == 4 * GPU_PAGE
    assert pin.is_valid()
    for off, n in ((0, 1), (12345, 100_000), (4 * GPU_PAGE - 7, 7), (PAGE - 1, 2)):
        assert peer.read(device, pin, off, n) == data[off : off + n]
    new = pattern(70_000, 2)
    peer.write(device, pin, 3333, new)
    assert sim.read(va + 3333, len(new)) == new
    assert sim.read(va, 3333) == data[:3333]
    s = sim_stats()
    assert s.dmabuf_exports == 1 and s.dmabuf_mappings == 1  # gpupin's import
    # gpupin's attachment (the peer's XFERs left) and its pin; without CONFIG_DMABUF_MOVE_NOTIFY
    # the dma-buf core pins each mapping once more
    assert s.dmabuf_attachments == 1 and s.dmabuf_pins in (1, 2)
    device.unpin(pin)
    s = sim_stats()
    assert s.dmabuf_exports == 0 and s.dmabuf_mappings == 0
    assert s.dmabuf_attachments == 0 and s.dmabuf_pins == 0
    sim.free(va)


@SIM_EXPORT
def test_offset_and_size(device: Device, sim: SimMemory, peer: Peer) -> None:
    va = sim.alloc(4 * GPU_PAGE)
    data = pattern(4 * GPU_PAGE, 3)
    sim.write(va, data)
    fd = sim.export_dmabuf(va)
    try:
        pin = device.pin_dmabuf(fd, 5000, offset=GPU_PAGE, pci=first_pci_device())
    finally:
        os.close(fd)
    assert pin.va == GPU_PAGE and pin.aligned_size == 2 * PAGE and pin.entries == 2
    assert peer.read(device, pin, 0, 5000) == data[GPU_PAGE : GPU_PAGE + 5000]
    with pytest.raises(gpupin.InvalidArgument):
        peer.read(device, pin, 4000, 1001)  # past the pinned 5000 bytes
    device.unpin(pin)
    sim.free(va)


@SIM_EXPORT
def test_dma_map_is_a_second_attachment(device: Device, sim: SimMemory) -> None:
    va = sim.alloc(2 * GPU_PAGE)
    fd = sim.export_dmabuf(va)
    pin = device.pin_dmabuf(fd, pci=first_pci_device())
    os.close(fd)
    m = device.dma_map(pin, first_pci_device())
    assert m.entries == pin.entries
    assert sim_stats().dmabuf_mappings == 2
    # Without an IOMMU both attachments see the pages at their physical addresses.
    assert device.dma_addrs(m) == device.get_pages(pin)
    device.dma_unmap(m)
    assert sim_stats().dmabuf_mappings == 1
    device.unpin(pin)
    sim.free(va)


@REVOKES
def test_revoke_while_pinned(device: Device, sim: SimMemory, peer: Peer) -> None:
    va = sim.alloc(2 * GPU_PAGE)
    sim.write(va, pattern(2 * GPU_PAGE))
    fd = sim.export_dmabuf(va, revocable=True)
    pin = device.pin_dmabuf(fd, user_tag=99, pci=first_pci_device())
    os.close(fd)
    m = device.dma_map(pin, first_pci_device())
    hold = peer.hold(device, pin)  # shares the user's mapping
    with Netlink() as nl:
        sim.free(va)  # the exporter revokes: move_notify
        assert not pin.is_valid()
        assert [(e.handle, e.user_tag, e.reason) for e in device.read_events()] == [(pin.handle, 99, "freed")]
        assert peer.status().notified == 1
        (p,) = [p for p in nl.list_pins() if p.handle == pin.handle and p.pid == os.getpid()]
        assert p.state == "invalidated"
    s = sim_stats()
    assert s.dmabuf_mappings == 0, "every attachment unmapped at the revocation"
    assert s.dmabuf_exports == 1, "gpupin still holds the buffer until unpin"
    with pytest.raises(gpupin.TransferAborted):
        peer.read(device, pin, 0, 10)
    with pytest.raises(gpupin.PinInvalidated):
        device.dma_map(pin, first_pci_device())
    assert device.query(pin).state == "invalidated"
    peer.release(hold)
    with pytest.raises(gpupin.PinInvalidated):
        device.dma_unmap(m)
    device.unpin(pin)
    s = sim_stats()
    assert s.dmabuf_exports == 0 and s.allocations == 0 and s.poison_errors == 0


@REVOKES
def test_revoke_during_transfer(device: Device, sim: SimMemory, peer: Peer, sim_params) -> None:  # type: ignore[no-untyped-def]
    import threading
    import time

    sim_params("gpupin_peer", chunk_delay_us=10000 * SLOW)  # >= 0.64 s for the transfer (x10 under KASAN)
    size = 64 * PAGE
    va = sim.alloc(size)
    data = pattern(size, 4)
    sim.write(va, data)
    fd = sim.export_dmabuf(va, revocable=True)
    pin = device.pin_dmabuf(fd, size, pci=first_pci_device())
    os.close(fd)
    t = threading.Thread(target=lambda: (time.sleep(0.2 * SLOW), sim.free(va)))
    t.start()
    with pytest.raises(gpupin.TransferAborted) as ei:
        peer.read(device, pin, 0, size)
    t.join()
    assert 0 < ei.value.done < size and ei.value.partial == data[: ei.value.done]
    device.unpin(pin)


@SIM_EXPORT
def test_user_closes_fd_while_pinned(device: Device, sim: SimMemory, peer: Peer) -> None:
    va = sim.alloc(GPU_PAGE)
    sim.write(va, b"kept")
    fd = sim.export_dmabuf(va)
    pin = device.pin_dmabuf(fd)
    os.close(fd)
    assert sim_stats().dmabuf_exports == 1
    assert peer.read(device, pin, 0, 4) == b"kept"
    device.close()  # release on close works as for nv-p2p pins
    assert sim_stats().dmabuf_exports == 0
    sim.free(va)


@SIM_EXPORT
def test_bad_fds_and_ranges(device: Device, sim: SimMemory) -> None:
    va = sim.alloc(GPU_PAGE)
    fd = sim.export_dmabuf(va)
    try:
        with open("/dev/null", "rb") as null:
            with pytest.raises(gpupin.InvalidArgument, match="dma-buf"):
                device.pin_dmabuf(null.fileno(), 4096)
        with pytest.raises(gpupin.InvalidArgument, match="not an open file"):
            device.pin_dmabuf(999, 4096)
        with pytest.raises(gpupin.InvalidArgument, match="page aligned"):
            device.pin_dmabuf(fd, 4096, offset=100)
        with pytest.raises(gpupin.InvalidArgument, match="inside it"):
            device.pin_dmabuf(fd, GPU_PAGE + 1)
        with pytest.raises(gpupin.InvalidArgument, match="inside it"):
            device.pin_dmabuf(fd, 4096, offset=GPU_PAGE)
        with pytest.raises(gpupin.InvalidArgument, match="size must be > 0"):
            device.pin_dmabuf(fd, 0)

        def call(**fields: object) -> int:
            c = ffi.new("struct gpupin_pin_dmabuf *")
            c.fd, c.size = fd, 4096
            for k, v in fields.items():
                setattr(c, k, v)
            return int(lib.gpupin_call(device.fileno(), lib.GPUPIN_IOC_PIN_DMABUF, c))

        assert call() == 0
        assert call(flags=2) == EINVAL
        assert call(reserved=1) == EINVAL
        assert call(pad=1) == EINVAL
        for field in ("pci_domain", "pci_bus", "pci_devfn"):  # a device without the flag
            assert call(**{field: 1}) == EINVAL
        assert call(flags=1, pci_domain=0x10000) == EINVAL
        assert call(flags=1, pci_bus=0x100) == EINVAL
        assert call(flags=1, pci_devfn=0x100) == EINVAL
        assert call(flags=1, pci_domain=0xFFFF, pci_bus=0xFF, pci_devfn=0xFF) == -errno.ENODEV
        assert call(offset=2**64 - PAGE) == EINVAL
        assert call(size=2**64 - 1) == EINVAL
        assert call(fd=-1) == -errno.EBADF
    finally:
        os.close(fd)
    assert device.info().file_pins == 1  # only the good one
    device.close()
    sim.free(va)


@pytest.mark.simonly(reason="loads vgem, built for the VM's kernel, as a second dma-buf exporter")
def test_vgem_buffer_through_the_peer(device: Device, peer: Peer) -> None:
    from gpupin.testing.vgem import VgemBuffer

    if not kmod.is_loaded("vgem"):
        # Debian's module by name; a kernel tree's build under make test-debug.
        kmod.load(os.environ.get("GPUPIN_VGEM_KO") or "vgem")
    buf = VgemBuffer(256 * KiB)
    data = pattern(buf.size, 5)
    buf.write(0, data)
    pin = device.pin_dmabuf(buf.fd)
    assert pin.entries == buf.size // PAGE
    assert peer.read(device, pin, 1000, 200 * KiB) == data[1000 : 1000 + 200 * KiB]
    new = pattern(5000, 6)
    peer.write(device, pin, PAGE - 10, new)
    buf.close()  # the pin keeps the object
    assert peer.read(device, pin, PAGE - 10, 5000) == new
    device.unpin(pin)


@SIM_EXPORT
def test_cache_dmabuf_backend(device: Device, sim: SimMemory) -> None:
    with RegistrationCache(device, sim, backend="auto", validate="both") as cache:
        assert cache.backend == "dmabuf"
        va = sim.alloc(MiB)
        with cache.acquire(va + 100, 1000) as reg:
            assert device.query(reg.handle).dmabuf
        with cache.acquire(va, MiB) as reg:
            pass
        assert cache.stats().pins == 1 and cache.stats().hits == 1
        sim.free(va)
        va2 = sim.alloc(MiB)
        assert va2 == va
        with cache.acquire(va2, 10) as reg:
            assert reg.valid
        st = cache.stats()
        assert st.pins == 2 and st.misses == 2
        cache.purge()
        sim.free(va2)
    assert sim_stats().dmabuf_exports == 0


# NVIDIA's exporter refuses an attach for a PCI topology without peer-to-peer (-ENOTSUPP,
# which user space cannot name: EOPNOTSUPP) and fails a mapping it cannot make (NULL: ENOMEM).
EXPORTER_FAILURES = [("fail_attach_nth", 524, errno.EOPNOTSUPP), ("fail_dmabuf_map_nth", errno.ENOMEM, errno.ENOMEM)]


@FAILS
@pytest.mark.parametrize("knob,err,seen", EXPORTER_FAILURES)
def test_exporter_refuses_import(device: Device, sim: SimMemory, sim_params, knob: str, err: int, seen: int) -> None:  # type: ignore[no-untyped-def]
    """PIN_DMABUF says what the exporter said and leaves nothing: no pin, no attachment
    or mapping, the buffer's reference dropped (the export goes with the user's fd)."""
    va = sim.alloc(2 * GPU_PAGE)
    fd = sim.export_dmabuf(va)
    sim_params(fail_errno=err, **{knob: 1})
    with pytest.raises(gpupin.GpupinError) as ei:
        device.pin_dmabuf(fd, pci=first_pci_device())
    assert ei.value.errno == seen and "PIN_DMABUF" in str(ei.value)
    s = sim_stats()
    assert s.dmabuf_mappings == 0 and s.dmabuf_exports == 1
    assert s.dmabuf_attachments == 0 and s.dmabuf_pins == 0  # detached, unpinned
    assert device.info().file_pins == 0 and device.info().pinned_bytes == 0
    pin = device.pin_dmabuf(fd, pci=first_pci_device())  # one failure only
    os.close(fd)
    s = sim_stats()
    # NVIDIA's exporter is static: nothing to pin, its memory stays as long as the buffer.
    assert s.dmabuf_mappings == 1 and s.dmabuf_attachments == 1 and s.dmabuf_pins == 0
    device.unpin(pin)
    assert sim_stats().dmabuf_exports == 0  # gpupin held no reference after the failure
    sim.free(va)


@FAILS
@pytest.mark.parametrize("knob,err,seen", EXPORTER_FAILURES)
def test_exporter_refuses_peer_map(device: Device, sim: SimMemory, sim_params, knob: str, err: int, seen: int) -> None:  # type: ignore[no-untyped-def]
    """DMA_MAP of a dma-buf pin for a peer the exporter refuses: the error, no mapping
    listed, the pin still pinned and mappable."""
    va = sim.alloc(2 * GPU_PAGE)
    fd = sim.export_dmabuf(va)
    pin = device.pin_dmabuf(fd, pci=first_pci_device())
    os.close(fd)
    sim_params(fail_errno=err, **{knob: 1})
    with pytest.raises(gpupin.GpupinError) as ei:
        device.dma_map(pin, first_pci_device())
    assert ei.value.errno == seen and "DMA_MAP" in str(ei.value)
    s = sim_stats()
    assert s.dmabuf_mappings == 1 and s.dmabuf_attachments == 1  # gpupin's import only
    assert device.query(pin).dma_mappings == 0 and pin.is_valid()
    m = device.dma_map(pin, first_pci_device())
    s = sim_stats()
    assert m.entries == pin.entries and s.dmabuf_mappings == 2 and s.dmabuf_attachments == 2
    device.unpin(pin)
    s = sim_stats()
    assert s.dmabuf_mappings == 0 and s.dmabuf_attachments == 0 and s.dmabuf_exports == 0
    sim.free(va)


@SIM_EXPORT
def test_budget_applies_to_dmabuf_pins(device: Device, sim: SimMemory, sim_params) -> None:  # type: ignore[no-untyped-def]
    """max_pinned_bytes counts dma-buf pins as it counts nv-p2p ones: beyond it PIN_DMABUF
    is BudgetExceeded before anything is attached, and the buffer's reference is dropped."""
    sim_params("gpupin", max_pinned_bytes=GPU_PAGE)
    va = sim.alloc(2 * GPU_PAGE)
    fd = sim.export_dmabuf(va)
    with pytest.raises(gpupin.BudgetExceeded) as ei:
        device.pin_dmabuf(fd)
    assert ei.value.errno == errno.ENOSPC and "PIN_DMABUF" in str(ei.value)
    s = sim_stats()
    assert s.dmabuf_attachments == 0 and s.dmabuf_mappings == 0 and device.info().file_pins == 0
    pin = device.pin_dmabuf(fd, GPU_PAGE)  # within the budget
    os.close(fd)
    assert device.info().pinned_bytes == GPU_PAGE
    device.unpin(pin)
    assert sim_stats().dmabuf_exports == 0  # no reference left behind by the refusal
    sim.free(va)


class _RevocableSim(SimMemory):
    """Simulated memory whose exports revoke on free (as amdgpu's do), for the cache."""

    def export_dmabuf(self, ptr: int, revocable: bool = True) -> int:
        return super().export_dmabuf(ptr, revocable=revocable)


@REVOKES
def test_cache_over_a_revoking_exporter(device: Device, leakcheck: None) -> None:
    """The cache imports for ``dmabuf_pci``; the kernel then invalidates its pins, so it may
    trust the validity word alone.  Without a device such buffers cannot be pinned."""
    with _RevocableSim() as mem:
        va = mem.alloc(MiB)
        with RegistrationCache(device, mem, backend="dmabuf", validate="both") as cache:
            with pytest.raises(gpupin.InvalidArgument, match="importing device"):
                cache.acquire(va, 100)
        with RegistrationCache(
            device, mem, backend="dmabuf", validate="kernel", dmabuf_pci=first_pci_device()
        ) as cache:
            with cache.acquire(va, 100) as reg:
                assert device.query(reg.handle).revocable
            mem.free(va)  # revoked: the cache sees it in the validity word
            va2 = mem.alloc(MiB)
            with cache.acquire(va2, 100) as reg:
                assert reg.valid
            assert cache.stats().pins == 2
            cache.purge()
            mem.free(va2)
    assert sim_stats().dmabuf_exports == 0


@SIM_EXPORT
def test_cache_refuses_kernel_validation_of_nvidia_buffers(device: Device, sim: SimMemory) -> None:
    """NVIDIA's exporter never revokes: validate="kernel" cannot tell a freed buffer."""
    va = sim.alloc(MiB)
    with RegistrationCache(device, sim, backend="dmabuf", validate="kernel") as cache:
        with pytest.raises(gpupin.NotRevocable, match="validate='buffer_id'"):
            cache.acquire(va, 100)
        assert device.info().file_pins == 0
    sim.free(va)
    assert sim_stats().dmabuf_exports == 0
