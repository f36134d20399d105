"""The simulator's own behaviour where it models NVIDIA's driver (kernel/sim/FIDELITY.md):
its dma-buf exporters, the root-only device node, freed-table address reuse.

The dma-buf tests import the simulator's buffers with vgem (DRM PRIME import), the kernel's
virtual GEM driver: a static importer that attaches with a platform device, not a PCI one.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
from collections.abc import Callable, Iterator

import pytest

import gpupin
from conftest import GPU_PAGE, MiB, in_child, raw
from gpupin import Device, SimMemory, kmod, sim_stats
from gpupin._native import lib
from gpupin.sim import BAR1_RESERVE

pytestmark = [
    pytest.mark.vm,
    pytest.mark.simonly(
        reason="tests the simulator's own model of NVIDIA's driver (its exporters, device node, table reuse)"
    ),
]

# <drm/drm.h>: DRM_IOWR(0x2e, struct drm_prime_handle), DRM_IOW(0x09, struct drm_gem_close)
DRM_IOCTL_PRIME_FD_TO_HANDLE = 0xC00C642E
DRM_IOCTL_GEM_CLOSE = 0x40086409


@pytest.fixture
def vgem() -> Iterator[int]:
    """An open vgem DRM node."""
    from gpupin.testing.vgem import vgem_node

    if not kmod.is_loaded("vgem"):
        kmod.load(os.environ.get("GPUPIN_VGEM_KO") or "vgem")
    fd = os.open(vgem_node(), os.O_RDWR | os.O_CLOEXEC)
    yield fd
    os.close(fd)


def vgem_import(card: int, dmabuf: int) -> int:
    """Import the dma-buf into vgem; returns the GEM handle (OSError on failure)."""
    buf = bytearray(struct.pack("IIi", 0, 0, dmabuf))
    fcntl.ioctl(card, DRM_IOCTL_PRIME_FD_TO_HANDLE, buf)
    return int(struct.unpack("IIi", buf)[0])


def vgem_close(card: int, handle: int) -> None:
    fcntl.ioctl(card, DRM_IOCTL_GEM_CLOSE, struct.pack("II", handle, 0))


# -- the export ioctl --------------------------------------------------------------------------


def test_export_flags(sim: SimMemory) -> None:
    va = sim.alloc(GPU_PAGE)
    for flags in (0x2, 0x80000000):
        rc, _ = raw(sim._fd, lib.NVP2P_SIM_IOC_EXPORT, "struct nvp2p_sim_export", va=va, flags=flags)
        assert rc == -errno.EINVAL, flags
    for flags in (0, lib.NVP2P_SIM_EXPORT_REVOCABLE):
        rc, c = raw(sim._fd, lib.NVP2P_SIM_IOC_EXPORT, "struct nvp2p_sim_export", va=va, flags=flags)
        assert rc == 0 and c.base == va and c.size == GPU_PAGE
        os.close(c.fd)
    assert sim_stats().dmabuf_exports == 0
    sim.free(va)


# -- NVIDIA's exporter (the default): the export holds the memory --------------------------------


@pytest.mark.parametrize("revocable", [False, True])
def test_export_holds_the_memory(sim: SimMemory, sim_params: Callable[..., None], revocable: bool) -> None:
    """cuMemFree of an exported allocation frees nothing while the dma-buf lives (measured on
    driver 580): the address goes back to the context (a new allocation gets it, with
    a new buffer id), the memory stays counted against mem_limit until the last close."""
    sim_params(mem_limit=8 * MiB)
    va = sim.alloc(4 * MiB)
    first_id = sim.buffer_id(va)
    fd = sim.export_dmabuf(va, revocable=revocable)
    sim.free(va)
    s = sim_stats()
    assert s.allocations == 1 and s.alloc_bytes == 4 * MiB and s.dmabuf_exports == 1, s
    with pytest.raises(gpupin.NotGpuMemory):
        sim.range_of(va)
    va2 = sim.alloc(4 * MiB)
    assert va2 == va and sim.buffer_id(va2) != first_id
    with pytest.raises(gpupin.GpupinError) as ei:  # the held 4 MiB still count
        sim.alloc(GPU_PAGE)
    assert ei.value.errno == errno.ENOMEM
    os.close(fd)  # the last reference: now the memory goes
    s = sim_stats()
    assert s.allocations == 1 and s.alloc_bytes == 4 * MiB and s.dmabuf_exports == 0, s
    sim.free(sim.alloc(GPU_PAGE))
    sim.free(va2)
    assert sim_stats().alloc_bytes == 0


def test_nonpci_attach_is_refused_as_misuse(sim: SimMemory, vgem: int, sim_misuse: Callable[..., None]) -> None:
    """nv_dma_buf_attach reads the importing device as a pci_dev: vgem's platform device
    would be read out of bounds there.  The simulator refuses it and counts it."""
    va = sim.alloc(2 * GPU_PAGE)
    fd = sim.export_dmabuf(va)
    sim_misuse(dmabuf_nonpci_attaches=1)
    with pytest.raises(OSError) as ei:
        vgem_import(vgem, fd)
    assert ei.value.errno == errno.EINVAL
    s = sim_stats()
    assert s.dmabuf_nonpci_attaches == 1 and s.dmabuf_attachments == 0 and s.dmabuf_mappings == 0, s
    os.close(fd)
    sim.free(va)


def test_failed_pins_leave_no_dangling_table_in_use(
    device: Device, sim: SimMemory, sim_params: Callable[..., None]
) -> None:
    """A get_pages that RM refuses leaves *page_table pointing to a freed table on NVIDIA
    (nv_p2p_get_pages sets it before calling RM and frees the table on failure); the
    simulator hands out a poisoned one from its graveyard.  gpupin forgets the pointer:
    no call with it (no use after free), and later pins work, also one that gets that
    table's address again (reuse_freed_tables)."""
    sim_params(bar_size=BAR1_RESERVE + 2 * MiB, reuse_freed_tables=1)
    va = sim.alloc(4 * MiB)
    for persistent in (False, True):
        with pytest.raises(gpupin.BarExhausted):
            device.pin(va, 4 * MiB, persistent=persistent)
        sim_params(fail_errno=errno.EIO, fail_nth=1)
        with pytest.raises(gpupin.GpupinError):
            device.pin(va, GPU_PAGE, persistent=persistent)
    pins = [device.pin(va + i * GPU_PAGE, GPU_PAGE) for i in range(4)]
    for pin in pins:
        device.unpin(pin)
    s = sim_stats()
    assert s.use_after_free_calls == 0 and s.stale_table_puts == 0 and s.page_tables == 0, s
    sim.free(va)


def test_unmap_with_another_peer_is_counted(
    device: Device,
    sim: SimMemory,
    sim_params: Callable[..., None],
    sim_misuse: Callable[..., None],
    pci: str,
) -> None:
    """nvidia_p2p_dma_unmap_pages WARNs when the peer is not the mapping's (nv-p2p.c:
    WARN_ON(peer != dma_mapping->pci_dev)), then unmaps it anyway and returns 0.  gpupin's
    test knob unmap_other_peer names another PCI device once; the simulator counts it."""
    va = sim.alloc(2 * GPU_PAGE)
    pin = device.pin(va, 2 * GPU_PAGE, persistent=True)  # only these use NVIDIA's dma_map_pages
    m = device.dma_map(pin, pci)
    assert sim_stats().dma_mappings == 1
    sim_misuse(unmap_peer_mismatches=1)
    sim_params("gpupin", unmap_other_peer=1)
    device.dma_unmap(m)  # 0 from NVIDIA: unmapped all the same
    s = sim_stats()
    assert s.unmap_peer_mismatches == 1 and s.dma_mappings == 0, s
    assert device.query(pin.handle).dma_mappings == 0
    device.unpin(pin)
    sim.free(va)


def test_injected_attach_failure_comes_first(sim: SimMemory, vgem: int, sim_params: Callable[..., None]) -> None:
    """fail_attach_nth works on NVIDIA's exporter too: the injected error, nothing else."""
    va = sim.alloc(GPU_PAGE)
    fd = sim.export_dmabuf(va)
    sim_params(fail_errno=errno.EBUSY, fail_attach_nth=1)
    with pytest.raises(OSError) as ei:
        vgem_import(vgem, fd)
    assert ei.value.errno == errno.EBUSY
    s = sim_stats()
    assert s.dmabuf_attachments == 0 and s.dmabuf_nonpci_attaches == 0, s
    os.close(fd)
    sim.free(va)


# -- the revoking exporter -------------------------------------------------------------------------


def test_revocable_export_imported_by_a_static_importer(sim: SimMemory, vgem: int) -> None:
    """A revoking (dynamic) exporter takes any device, and the dma-buf core pins and maps the
    buffer at attach for a static importer; freeing the allocation revokes it, the pinned
    mapping stays until the importer lets go, then everything is given back."""
    va = sim.alloc(2 * GPU_PAGE)
    fd = sim.export_dmabuf(va, revocable=True)
    handle = vgem_import(vgem, fd)
    s = sim_stats()
    assert s.dmabuf_attachments == 1 and s.dmabuf_mappings == 1 and s.dmabuf_pins == 1, s
    sim.free(va)
    s = sim_stats()
    assert s.dmabuf_attachments == 1 and s.alloc_bytes == 2 * GPU_PAGE, s
    vgem_close(vgem, handle)
    os.close(fd)
    s = sim_stats()
    assert s.dmabuf_attachments == 0 and s.dmabuf_mappings == 0 and s.dmabuf_pins == 0, s
    assert s.dmabuf_exports == 0 and s.alloc_bytes == 0, s


@pytest.mark.parametrize("knob", ["fail_attach_nth", "fail_dmabuf_map_nth"])
def test_revocable_export_fault_knobs(sim: SimMemory, vgem: int, sim_params: Callable[..., None], knob: str) -> None:
    va = sim.alloc(GPU_PAGE)
    fd = sim.export_dmabuf(va, revocable=True)
    sim_params(fail_errno=errno.EBUSY, **{knob: 1})
    with pytest.raises(OSError) as ei:
        vgem_import(vgem, fd)
    assert ei.value.errno == errno.EBUSY
    s = sim_stats()
    assert s.dmabuf_attachments == 0 and s.dmabuf_mappings == 0 and s.dmabuf_pins == 0, s
    vgem_close(vgem, vgem_import(vgem, fd))  # one failure only
    os.close(fd)
    sim.free(va)


# -- the device node ---------------------------------------------------------------------------------


def test_device_is_root_only(gpupin_loaded: None) -> None:
    assert os.stat("/dev/nvp2p_sim").st_mode & 0o777 == 0o600

    def child() -> int:
        os.setgid(65534)
        os.setuid(65534)
        try:
            SimMemory().close()
        except gpupin.GpupinError as exc:
            return 0 if exc.errno == errno.EACCES else 2
        except PermissionError:
            return 0
        return 1

    assert in_child(child) == 0


# -- freed page tables: address reuse ----------------------------------------------------------


def test_reused_table_addresses_release_the_right_pins(
    device: Device, sim: SimMemory, sim_params: Callable[..., None]
) -> None:
    """With reuse_freed_tables, a new pin of the same process may get a freed table's address
    (as NVIDIA's allocator may hand it out); a client that never passes a stale table puts
    each pin once, and nothing counts as a stale put."""
    sim_params(reuse_freed_tables=True)
    vas = [sim.alloc(GPU_PAGE) for _ in range(4)]
    first = device.pin(vas[0], GPU_PAGE)
    device.unpin(first)  # its table is freed
    pins = [device.pin(v, GPU_PAGE) for v in vas[1:]]
    sim.free(vas[1])  # a callback frees another
    pins.append(device.pin(vas[0], GPU_PAGE))
    for p in pins[1:]:
        device.unpin(p)
    device.unpin(pins[0])  # invalidated: its table is gone
    s = sim_stats()
    assert s.stale_table_puts == 0 and s.page_tables == 0 and s.live_callbacks == 0, s
    for v in (vas[0], vas[2], vas[3]):
        sim.free(v)


def test_persistent_put_of_a_non_persistent_table_is_counted(
    device: Device,
    sim: SimMemory,
    sim_params: Callable[..., None],
    sim_misuse: Callable[..., None],
) -> None:
    """nvidia_p2p_put_pages_persistent of a table from nvidia_p2p_get_pages reaches
    RmP2PPutPagesPersistent with the table's private data NULL, and NVIDIA dereferences it
    under its API lock.  gpupin's test knob put_other_kind makes one such put; the simulator
    counts it and refuses, so the pin waits for its callback (put_pages failed)."""
    va = sim.alloc(GPU_PAGE)
    pin = device.pin(va, GPU_PAGE)
    sim_misuse(put_kind_mismatches=1)
    sim_params("gpupin", put_other_kind=1)
    device.unpin(pin)  # the put fails: the pin is detached, kept for its callback
    s = sim_stats()
    assert s.put_kind_mismatches == 1 and s.page_tables == 1 and s.live_callbacks == 1, s
    sim.free(va)  # the callback lets the detached pin go
    s = sim_stats()
    assert s.page_tables == 0 and s.live_callbacks == 0 and s.use_after_free_calls == 0, s
