"""Every ioctl rejects bad input with the documented errno and leaves nothing behind; over
either provider (allocations are 2 MiB, which cuMemAlloc aligns to 2 MiB), except the
simulator's own ioctls."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from typing import Any

import pytest

from conftest import GPU_PAGE, MiB, can_export_dmabuf, libc, need_dmabuf_export, raw
from gpupin import Device, MemoryProvider, SimMemory, sim_stats
from gpupin._native import ffi, lib
from gpupin.device import DmaMapping, Pin
from gpupin.testing import NATIVE

pytestmark = pytest.mark.vm

U64 = (1 << 64) - 1
EINVAL, ENOENT, ENOTTY = -errno.EINVAL, -errno.ENOENT, -errno.ENOTTY


@pytest.fixture
def pinned(device: Device, memory: MemoryProvider):  # type: ignore[no-untyped-def]
    va = memory.alloc(2 * MiB)
    pin = device.pin(va, 2 * GPU_PAGE)
    yield device, pin
    device.unpin(pin)
    memory.free(va)


def test_unknown_command(device: Device) -> None:
    with pytest.raises(OSError) as ei:
        fcntl.ioctl(device.fileno(), 0xC008C7FF, bytearray(8))
    assert ei.value.errno == errno.ENOTTY
    with pytest.raises(OSError) as ei:  # right number, wrong size encoded
        fcntl.ioctl(device.fileno(), lib.GPUPIN_IOC_PIN ^ (1 << 16), bytearray(128))
    assert ei.value.errno == errno.ENOTTY


@pytest.mark.parametrize("field,value", [("flags", 1), ("reserved", [0, 0, 0, 1])])
def test_info_rejects(device: Device, field: str, value: object) -> None:
    rc, _ = raw(device.fileno(), lib.GPUPIN_IOC_INFO, "struct gpupin_info", **{field: value})
    assert rc == EINVAL


@pytest.mark.parametrize(
    "fields",
    [
        {"size": 0},
        {"flags": 0x2},
        {"flags": 0x80000000},
        {"pad": 1},
        {"reserved": [1, 0]},
        {"reserved": [0, 1]},
        {"va": U64 - 10, "size": 100},  # wraps
        {"va": U64 - GPU_PAGE + 2, "size": 1},  # rounding up wraps
        {"va": 0, "size": U64},
    ],
    ids=["size0", "flag2", "flaghigh", "pad", "res0", "res1", "wrap", "roundwrap", "huge"],
)
def test_pin_rejects(device: Device, memory: MemoryProvider, fields: dict[str, int]) -> None:
    va = memory.alloc(2 * MiB)
    args = {"va": va, "size": GPU_PAGE, **fields}
    rc, _ = raw(device.fileno(), lib.GPUPIN_IOC_PIN, "struct gpupin_pin", **args)
    assert rc == EINVAL
    assert device.info().file_pins == 0
    if not NATIVE:
        assert sim_stats().page_tables == 0
    memory.free(va)


def test_unpin_rejects(pinned) -> None:  # type: ignore[no-untyped-def]
    dev, pin = pinned
    fd = dev.fileno()
    assert raw(fd, lib.GPUPIN_IOC_UNPIN, "struct gpupin_unpin", handle=pin.handle, flags=1)[0] == EINVAL
    assert raw(fd, lib.GPUPIN_IOC_UNPIN, "struct gpupin_unpin", handle=pin.handle, pad=1)[0] == EINVAL
    for h in (0, pin.handle + 1, U64, 1 << 40):
        assert raw(fd, lib.GPUPIN_IOC_UNPIN, "struct gpupin_unpin", handle=h)[0] == ENOENT
    assert dev.query(pin).state == "pinned"


def test_query_rejects(pinned) -> None:  # type: ignore[no-untyped-def]
    dev, pin = pinned
    fd = dev.fileno()
    for f in ({"flags": 1}, {"pad": 1}, {"reserved": [0, 1]}):
        assert raw(fd, lib.GPUPIN_IOC_QUERY, "struct gpupin_query", handle=pin.handle, **f)[0] == EINVAL
    assert raw(fd, lib.GPUPIN_IOC_QUERY, "struct gpupin_query", handle=0)[0] == ENOENT


def test_get_pages_rejects(pinned) -> None:  # type: ignore[no-untyped-def]
    dev, pin = pinned
    fd = dev.fileno()
    from gpupin._native import ffi

    out = ffi.new("__u64[4]")
    addr = int(ffi.cast("uintptr_t", out))
    base = {"handle": pin.handle, "addrs": addr}
    cases = [
        ({"count": 0}, EINVAL),
        ({"count": 1, "flags": 1}, EINVAL),
        ({"count": 1, "pad": 1}, EINVAL),
        ({"count": 1, "reserved": [1, 0]}, EINVAL),
        ({"count": 3}, EINVAL),
        ({"first": 2, "count": 1}, EINVAL),
        ({"first": 1, "count": 0xFFFFFFFF}, EINVAL),
        ({"count": 1, "handle": 9999}, ENOENT),
        ({"count": 2, "addrs": 8}, -errno.EFAULT),
    ]
    for f, want in cases:
        rc, _ = raw(fd, lib.GPUPIN_IOC_GET_PAGES, "struct gpupin_get_pages", **{**base, **f})
        assert rc == want, f
    assert raw(fd, lib.GPUPIN_IOC_GET_PAGES, "struct gpupin_get_pages", **base, count=2)[0] == 0
    assert out[0] and out[1] and not out[2]


def test_dma_rejects(pinned, pci: str) -> None:  # type: ignore[no-untyped-def]
    dev, pin = pinned
    fd = dev.fileno()
    m = dev.dma_map(pin, pci)
    base = {"handle": pin.handle}
    for f, want in [
        ({"flags": 1}, EINVAL),
        ({"reserved": [0, 1]}, EINVAL),
        ({"pci_bus": 256}, EINVAL),
        ({"pci_devfn": 256}, EINVAL),
        ({"pci_domain": 0x10000}, EINVAL),
        ({"handle": 12345}, ENOENT),
        ({"pci_bus": 0xFE, "pci_devfn": 0xF8}, -errno.ENODEV),
    ]:
        rc, _ = raw(fd, lib.GPUPIN_IOC_DMA_MAP, "struct gpupin_dma_map", **{**base, **f})
        assert rc == want, f
    for f, want in [
        ({"mapping_id": m.mapping_id, "flags": 1}, EINVAL),
        ({"mapping_id": m.mapping_id, "reserved": [1, 0]}, EINVAL),
        ({"mapping_id": m.mapping_id + 1}, ENOENT),
        ({"mapping_id": m.mapping_id, "handle": 777}, ENOENT),
    ]:
        rc, _ = raw(fd, lib.GPUPIN_IOC_DMA_UNMAP, "struct gpupin_dma_unmap", **{**base, **f})
        assert rc == want, f
    from gpupin._native import ffi

    out = ffi.new("__u64[2]")
    addr = int(ffi.cast("uintptr_t", out))
    for f, want in [
        ({"count": 0}, EINVAL),
        ({"count": 1, "flags": 1}, EINVAL),
        ({"count": 3}, EINVAL),
        ({"count": 1, "mapping_id": m.mapping_id + 5}, ENOENT),
    ]:
        args = {**base, "addrs": addr, "mapping_id": m.mapping_id, **f}
        rc, _ = raw(fd, lib.GPUPIN_IOC_DMA_ADDRS, "struct gpupin_dma_addrs", **args)
        assert rc == want, f
    assert dev.query(pin).dma_mappings == 1
    dev.dma_unmap(m)


def test_dma_map_limit_per_pin(pinned, pci: str) -> None:  # type: ignore[no-untyped-def]
    dev, pin = pinned
    maps = [dev.dma_map(pin, pci) for _ in range(16)]
    with pytest.raises(Exception) as ei:
        dev.dma_map(pin, pci)
    assert getattr(ei.value, "errno", None) == errno.ENOSPC
    for m in maps:
        dev.dma_unmap(m)


@pytest.mark.simonly(reason="checks the simulator's own /dev/nvp2p_sim ioctls")
def test_sim_rejects(sim: SimMemory) -> None:
    fd = sim._fd
    assert raw(fd, lib.NVP2P_SIM_IOC_ALLOC, "struct nvp2p_sim_alloc", size=0)[0] == EINVAL
    assert raw(fd, lib.NVP2P_SIM_IOC_ALLOC, "struct nvp2p_sim_alloc", size=1, flags=1)[0] == EINVAL
    assert raw(fd, lib.NVP2P_SIM_IOC_ALLOC, "struct nvp2p_sim_alloc", size=1 << 40)[0] == EINVAL
    assert raw(fd, lib.NVP2P_SIM_IOC_FREE, "struct nvp2p_sim_free", va=12345)[0] == EINVAL
    assert raw(fd, lib.NVP2P_SIM_IOC_QUERY, "struct nvp2p_sim_query", va=12345)[0] == ENOENT
    with pytest.raises(OSError) as ei:
        fcntl.ioctl(fd, 0xC008C8FF, bytearray(8))
    assert ei.value.errno == errno.ENOTTY


# -- every field of every command, one at a time; arguments the kernel cannot read or write ----

# (command, struct, fields that must be zero) for each command that takes input.
ZERO_FIELDS = [
    (lib.GPUPIN_IOC_INFO, "struct gpupin_info"),
    (lib.GPUPIN_IOC_PIN, "struct gpupin_pin"),
    (lib.GPUPIN_IOC_UNPIN, "struct gpupin_unpin"),
    (lib.GPUPIN_IOC_QUERY, "struct gpupin_query"),
    (lib.GPUPIN_IOC_GET_PAGES, "struct gpupin_get_pages"),
    (lib.GPUPIN_IOC_DMA_MAP, "struct gpupin_dma_map"),
    (lib.GPUPIN_IOC_DMA_ADDRS, "struct gpupin_dma_addrs"),
    (lib.GPUPIN_IOC_DMA_UNMAP, "struct gpupin_dma_unmap"),
    (lib.GPUPIN_IOC_PIN_DMABUF, "struct gpupin_pin_dmabuf"),
]


def _must_be_zero(ctype: str) -> list[tuple[str, int | None]]:
    """(field, index or None) of flags, pad and every reserved element of ctype."""
    out: list[tuple[str, int | None]] = []
    for name, f in ffi.typeof(ctype).fields:
        if name in ("flags", "pad"):
            out.append((name, None))
        elif name.startswith("reserved") and f.type.kind == "array":
            out.extend((name, i) for i in range(f.type.length))
        elif name.startswith("reserved"):
            out.append((name, None))
    return out


def _valid_args(ctype: str, pin: Pin, mapping: DmaMapping, pci: str, fd: int, va: int, out: Any) -> dict[str, Any]:
    from gpupin.device import parse_pci

    domain, bus, devfn = parse_pci(pci)
    addrs = int(ffi.cast("uintptr_t", out))
    return {
        "struct gpupin_info": {},
        "struct gpupin_pin": {"va": va, "size": GPU_PAGE},
        "struct gpupin_unpin": {"handle": pin.handle},
        "struct gpupin_query": {"handle": pin.handle},
        "struct gpupin_get_pages": {"handle": pin.handle, "count": 1, "addrs": addrs},
        "struct gpupin_dma_map": {"handle": pin.handle, "pci_domain": domain, "pci_bus": bus, "pci_devfn": devfn},
        "struct gpupin_dma_addrs": {"handle": pin.handle, "mapping_id": mapping.mapping_id, "count": 1, "addrs": addrs},
        "struct gpupin_dma_unmap": {"handle": pin.handle, "mapping_id": mapping.mapping_id},
        "struct gpupin_pin_dmabuf": {"fd": fd, "size": GPU_PAGE},
    }[ctype]


@pytest.mark.parametrize("cmd,ctype", ZERO_FIELDS, ids=[c.split()[1] for _, c in ZERO_FIELDS])
def test_each_flag_pad_and_reserved_word_alone_is_rejected(
    device: Device, memory: MemoryProvider, pci: str, cmd: int, ctype: str
) -> None:
    if ctype == "struct gpupin_pin_dmabuf":
        need_dmabuf_export(memory)
    va = memory.alloc(2 * MiB)
    pin = device.pin(va, 2 * GPU_PAGE)
    mapping = device.dma_map(pin, pci)
    # Only PIN_DMABUF reads the fd; the other commands run where the GPU cannot export one.
    fd = memory.export_dmabuf(va) if can_export_dmabuf(memory) else os.open("/dev/null", os.O_RDONLY)  # type: ignore[attr-defined]
    out = ffi.new("__u64[2]")
    base = _valid_args(ctype, pin, mapping, pci, fd, va, out)
    fields = _must_be_zero(ctype)
    assert fields, ctype
    try:
        for name, idx in fields:
            # The highest bit: no flag is defined there.
            value: Any = 0x80000000 if idx is None else [1 if i == idx else 0 for i in range(idx + 1)]
            rc, _ = raw(device.fileno(), cmd, ctype, **base, **{name: value})
            assert rc == EINVAL, (ctype, name, idx, rc)
        # Nothing happened: the one pin and mapping are as they were.
        assert device.info().file_pins == 1
        q = device.query(pin)
        assert q.state == "pinned" and q.dma_mappings == 1
    finally:
        os.close(fd)
        device.dma_unmap(mapping)
        device.unpin(pin)
        memory.free(va)


def _read_only(ctype: str, **fields: Any) -> tuple[mmap.mmap, Any]:
    """ctype in a page the kernel can read but not write."""
    page = mmap.mmap(-1, mmap.PAGESIZE)
    arg = ffi.from_buffer(f"{ctype} *", page)
    for k, v in fields.items():
        setattr(arg, k, v)
    assert libc.mprotect(int(ffi.cast("uintptr_t", arg)), mmap.PAGESIZE, mmap.PROT_READ) == 0
    return page, arg


def test_unreadable_argument_is_efault_for_every_command(device: Device) -> None:
    for cmd, ctype in ZERO_FIELDS:
        for addr in (8, (1 << 47) - 8):  # unmapped; straddling the end of user space
            assert lib.gpupin_call(device.fileno(), cmd, ffi.cast("void *", addr)) == -errno.EFAULT, ctype
    assert device.info().file_pins == 0


def test_results_that_cannot_be_written_back_are_efault(device: Device, memory: MemoryProvider, pci: str) -> None:
    from gpupin.device import parse_pci

    fd_ = device.fileno()
    va = memory.alloc(2 * MiB)
    pin = device.pin(va, 2 * GPU_PAGE)
    pages: list[tuple[mmap.mmap, Any]] = []
    try:
        page, arg = _read_only("struct gpupin_info")
        pages.append((page, arg))
        assert lib.gpupin_call(fd_, lib.GPUPIN_IOC_INFO, arg) == -errno.EFAULT
        page, arg = _read_only("struct gpupin_query", handle=pin.handle)
        pages.append((page, arg))
        assert lib.gpupin_call(fd_, lib.GPUPIN_IOC_QUERY, arg) == -errno.EFAULT
        # PIN_DMABUF whose result cannot be copied out: the pin is never published, and the
        # failure is counted.
        from gpupin import netlink

        if not can_export_dmabuf(memory):
            return  # the PIN_DMABUF case needs an exported buffer; the rest ran above
        other = netlink.stats()["fail_other"]
        dfd = memory.export_dmabuf(va)  # type: ignore[attr-defined]
        page, arg = _read_only("struct gpupin_pin_dmabuf", fd=dfd, size=GPU_PAGE)
        pages.append((page, arg))
        assert lib.gpupin_call(fd_, lib.GPUPIN_IOC_PIN_DMABUF, arg) == -errno.EFAULT
        os.close(dfd)
        assert device.info().file_pins == 1
        assert netlink.stats()["fail_other"] == other + 1
        # Page addresses into a read-only array.
        page, arg = _read_only("__u64")
        pages.append((page, arg))
        addrs = int(ffi.cast("uintptr_t", arg))
        rc, _ = raw(fd_, lib.GPUPIN_IOC_GET_PAGES, "struct gpupin_get_pages", handle=pin.handle, count=2, addrs=addrs)
        assert rc == -errno.EFAULT
        m = device.dma_map(pin, pci)
        rc, _ = raw(
            fd_,
            lib.GPUPIN_IOC_DMA_ADDRS,
            "struct gpupin_dma_addrs",
            handle=pin.handle,
            mapping_id=m.mapping_id,
            count=2,
            addrs=addrs,
        )
        assert rc == -errno.EFAULT
        device.dma_unmap(m)
        # DMA_MAP whose result cannot be copied out: the mapping stays (documented), and goes
        # with the pin.
        domain, bus, devfn = parse_pci(pci)
        page, arg = _read_only(
            "struct gpupin_dma_map", handle=pin.handle, pci_domain=domain, pci_bus=bus, pci_devfn=devfn
        )
        pages.append((page, arg))
        assert lib.gpupin_call(fd_, lib.GPUPIN_IOC_DMA_MAP, arg) == -errno.EFAULT
        assert device.query(pin).dma_mappings == 1
    finally:
        device.unpin(pin)
        memory.free(va)
        for p, a in pages:
            ffi.release(a)  # the cdata holds the page's buffer until released
            p.close()
    assert device.info().file_pins == 0
