"""Budgets, BAR exhaustion, page-table version checks and injected provider faults.  gpupin's
own budgets and parameters are tested over either provider; the rest sets simulator knobs."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

import gpupin
from conftest import GPU_PAGE, MiB, first_pci_device, gets_per_pin
from gpupin import Device, MemoryProvider, SimMemory, netlink, sim_stats
from gpupin.sim import BAR1_RESERVE
from gpupin.testing import NATIVE

pytestmark = pytest.mark.vm
BAR_KNOB = pytest.mark.simonly(reason="sets the simulator's BAR size (bar_size)")
FAULT = pytest.mark.simonly(reason="injects a provider failure through the simulator (fail_errno, fail_nth)")
LAYOUT = pytest.mark.simonly(reason="makes the simulator hand out another page-table or mapping layout")


@BAR_KNOB
def test_bar_exhaustion_is_enomem(device: Device, sim: SimMemory, sim_params) -> None:  # type: ignore[no-untyped-def]
    # NVIDIA keeps 36 MiB of BAR1 free (p2p.c _isSpaceAvailableForBar1P2PMapping).
    sim_params(bar_size=BAR1_RESERVE)
    va = sim.alloc(8 * MiB)
    with pytest.raises(gpupin.BarExhausted):
        device.pin(va, GPU_PAGE)
    sim_params(bar_size=BAR1_RESERVE + 4 * MiB)
    a = device.pin(va, 3 * MiB)
    with pytest.raises(gpupin.BarExhausted) as ei:
        device.pin(va + 3 * MiB, 2 * MiB)
    assert ei.value.errno == errno.ENOMEM and "BAR" in str(ei.value)
    assert device.info().file_pins == 1 and sim_stats().bar_bytes == 3 * MiB
    b = device.pin(va + 3 * MiB, 1 * MiB)  # exactly the reserve is left free: allowed
    device.unpin(a)
    device.unpin(b)
    sim.free(va)


def test_byte_budget_is_enospc(device: Device, memory: MemoryProvider, sim_params) -> None:  # type: ignore[no-untyped-def]
    sim_params("gpupin", max_pinned_bytes=2 * MiB)
    va = memory.alloc(4 * MiB)
    a = device.pin(va, 2 * MiB)
    before = device.info().pinned_bytes
    with pytest.raises(gpupin.BudgetExceeded) as ei:
        device.pin(va + 2 * MiB, GPU_PAGE)
    assert ei.value.errno == errno.ENOSPC
    assert device.info().pinned_bytes == before and (NATIVE or sim_stats().page_tables == 1)
    device.unpin(a)
    b = device.pin(va + 2 * MiB, GPU_PAGE)
    device.unpin(b)
    memory.free(va)
    assert device.info().pinned_bytes == 0


def test_pins_per_file_is_enospc(memory: MemoryProvider, sim_params) -> None:  # type: ignore[no-untyped-def]
    sim_params("gpupin", max_pins_per_file=4)
    with Device() as dev:
        assert dev.info().max_pins_per_file == 4
        va = memory.alloc(2 * MiB)
        pins = [dev.pin(va, GPU_PAGE) for _ in range(4)]
        with pytest.raises(gpupin.BudgetExceeded):
            dev.pin(va, GPU_PAGE)
        dev.unpin(pins.pop())
        pins.append(dev.pin(va, GPU_PAGE))
        assert len({p.slot for p in pins}) == 4
    memory.free(va)


def test_budget_released_by_invalidation(device: Device, memory: MemoryProvider, sim_params) -> None:  # type: ignore[no-untyped-def]
    sim_params("gpupin", max_pinned_bytes=1 * MiB)
    va = memory.alloc(2 * MiB)
    pin = device.pin(va, 1 * MiB)
    memory.free(va)
    assert device.info().pinned_bytes == 0
    vb = memory.alloc(2 * MiB)
    pin2 = device.pin(vb, 1 * MiB)
    device.unpin(pin)
    assert device.info().pinned_bytes == 1 * MiB
    device.unpin(pin2)
    memory.free(vb)


def test_file_budget_is_edquot(memory: MemoryProvider, sim_params) -> None:  # type: ignore[no-untyped-def]
    """max_file_pinned_bytes, the per-process budget where the kernel has no dmem controller:
    each open file's own share, EDQUOT (QuotaExceeded) past it, counted in the statistics as
    such (fail_edquot, not fail_other), another file unaffected, and given back by unpin, by
    the free callback and by close."""
    sim_params("gpupin", max_file_pinned_bytes=2 * MiB)
    va = memory.alloc(8 * MiB)
    with Device() as a, Device() as b:
        p1 = a.pin(va, 2 * MiB)
        before = netlink.stats()
        with pytest.raises(gpupin.QuotaExceeded) as ei:
            a.pin(va + 2 * MiB, GPU_PAGE)
        assert ei.value.errno == errno.EDQUOT and "dmem.max" in str(ei.value)
        after = netlink.stats()
        assert after["fail_edquot"] == before["fail_edquot"] + 1 and after["fail_other"] == before["fail_other"]
        assert a.info().pinned_bytes == 2 * MiB and a.info().file_pins == 1
        q = b.pin(va + 2 * MiB, 2 * MiB)  # another file: a share of its own
        a.unpin(p1)
        p2 = a.pin(va + 4 * MiB, 2 * MiB)  # the unpin gave the share back
        assert a.info().pinned_bytes == 4 * MiB
        b.close()  # close gives q's bytes back (b's share goes with the file)
        assert a.info().pinned_bytes == 2 * MiB
        a.unpin(p2)
        del q
    vb = memory.alloc(2 * MiB)
    with Device() as c:
        c.pin(vb, 2 * MiB)
        memory.free(vb)  # the free callback gives the share back
        assert c.info().pinned_bytes == 0
        vc = memory.alloc(2 * MiB)
        c.unpin(c.pin(vc, 2 * MiB))
        memory.free(vc)
    memory.free(va)
    assert Device().info().pinned_bytes == 0


def test_global_budget_stays_enospc_under_a_file_budget(memory: MemoryProvider, sim_params) -> None:  # type: ignore[no-untyped-def]
    """The module-wide max_pinned_bytes is checked first and keeps its ENOSPC: a pin past both
    says the global one; a failed pin holds nothing of either."""
    sim_params("gpupin", max_pinned_bytes=2 * MiB, max_file_pinned_bytes=1 * MiB)
    va = memory.alloc(4 * MiB)
    with Device() as a, Device() as b:
        pa = a.pin(va, 1 * MiB)
        pb = b.pin(va + 1 * MiB, 1 * MiB)
        with pytest.raises(gpupin.BudgetExceeded) as ei:
            a.pin(va + 2 * MiB, GPU_PAGE)
        assert ei.value.errno == errno.ENOSPC and not isinstance(ei.value, gpupin.QuotaExceeded)
        b.unpin(pb)
        with pytest.raises(gpupin.QuotaExceeded):  # room globally, none in a's share
            a.pin(va + 2 * MiB, GPU_PAGE)
        assert a.info().pinned_bytes == 1 * MiB
        a.unpin(pa)
    memory.free(va)


def test_the_dmem_parameter_says_what_the_build_does(gpupin_loaded: None) -> None:
    """gpupin.ko's dmem parameter says whether pins are charged to the dmem controller: Y
    exactly where the kernel has one (its dmem.capacity file), and no write changes it."""
    param = Path("/sys/module/gpupin/parameters/dmem")
    before = param.read_text()
    assert before.strip() == ("Y" if Path("/sys/fs/cgroup/dmem.capacity").exists() else "N")
    with pytest.raises(PermissionError):
        param.write_text("N" if before.strip() == "Y" else "Y")
    assert param.read_text() == before


ENOTSUPP = 524  # kernel-internal: NVIDIA's answer for NV_ERR_NOT_SUPPORTED


@FAULT
@pytest.mark.parametrize(
    "err,exc,seen",
    [
        (errno.ENOMEM, gpupin.BarExhausted, errno.ENOMEM),
        (errno.EIO, gpupin.GpupinError, errno.EIO),
        (errno.EINVAL, gpupin.NotGpuMemory, errno.EINVAL),
        (errno.EBUSY, gpupin.GpupinError, errno.EBUSY),
        (ENOTSUPP, gpupin.GpupinError, errno.EOPNOTSUPP),  # user space has no name for 524
    ],
)
def test_injected_provider_failure(device: Device, sim: SimMemory, sim_params, err: int, exc: type, seen: int) -> None:  # type: ignore[no-untyped-def]
    va = sim.alloc(4 * GPU_PAGE)
    sim_params(fail_errno=err, fail_nth=3 * gets_per_pin())  # the third pin's own get_pages
    a = device.pin(va, GPU_PAGE)
    b = device.pin(va, GPU_PAGE)
    with pytest.raises(exc) as ei:
        device.pin(va, GPU_PAGE)
    assert ei.value.errno == seen
    c = device.pin(va, GPU_PAGE)  # one failure only
    assert device.info().file_pins == 3 and device.info().pinned_bytes == 3 * GPU_PAGE
    for p in (a, b, c):
        device.unpin(p)
    sim.free(va)


@LAYOUT
def test_incompatible_page_table_version(device: Device, sim: SimMemory, sim_params) -> None:  # type: ignore[no-untyped-def]
    """Refused: tables gpupin cannot read.  1.1 has no gpu_uuid; 3.0 is a
    future major; 0.x never existed."""
    va = sim.alloc(GPU_PAGE)
    for version in (0x00010001, 0x00030000, 0x00000002):
        sim_params(page_table_version=version)
        with pytest.raises(gpupin.GpupinError) as ei:
            device.pin(va, GPU_PAGE)
        assert ei.value.errno == errno.EPROTO
        assert sim_stats().page_tables == 0 and device.info().pinned_bytes == 0
    sim.free(va)


@LAYOUT
@pytest.mark.parametrize("version", [0x00010002, 0x00010005, 0x00020000, 0x00020001])
def test_compatible_page_table_versions(device: Device, sim: SimMemory, sim_params, version: int) -> None:  # type: ignore[no-untyped-def]
    """Accepted: 1.2+ (R535..R575, the simulator hands out the 32-byte layout
    without `flags`, so a read of it is out of bounds under KASAN) and 2.x
    (R580 on).  Pin, map, read back, free the memory under the pin."""
    sim_params(page_table_version=version)
    va = sim.alloc(2 * GPU_PAGE)
    sim.write(va, b"layout")
    pin = device.pin(va, 2 * GPU_PAGE)
    assert pin.is_valid() and device.info().pinned_bytes == 2 * GPU_PAGE
    assert len(device.get_pages(pin)) == 2
    sim.free(va)  # the callback path with this layout
    assert not pin.is_valid()
    device.unpin(pin)
    assert sim_stats().page_tables == 0 and sim_stats().use_after_free_calls == 0


def test_default_persistent_parameter(device: Device, memory: MemoryProvider, sim_params) -> None:  # type: ignore[no-untyped-def]
    sim_params("gpupin", default_persistent=True)
    va = memory.alloc(2 * MiB)
    pin = device.pin(va, GPU_PAGE)
    assert pin.persistent
    memory.free(va)
    assert pin.is_valid()
    device.unpin(pin)


@pytest.mark.simonly(reason="sets the simulator's pin latency (pin_latency_us)")
def test_pin_latency_parameter(device: Device, sim: SimMemory, sim_params) -> None:  # type: ignore[no-untyped-def]
    import time

    sim_params(pin_latency_us=20000)
    va = sim.alloc(GPU_PAGE)
    t = time.monotonic()
    pin = device.pin(va, GPU_PAGE)
    assert time.monotonic() - t >= 0.02
    device.unpin(pin)
    sim.free(va)


@LAYOUT
@pytest.mark.parametrize("page_size_type", [0, 2, 7])  # 4 KiB, 128 KiB, no such type
def test_page_size_other_than_64k_is_refused(device: Device, sim: SimMemory, sim_params, page_size_type: int) -> None:  # type: ignore[no-untyped-def]
    """gpupin's pages, offsets and dma addresses are 64 KiB ones: a table of other
    pages is given back (put_pages) and the pin refused, with nothing left."""
    va = sim.alloc(2 * GPU_PAGE)
    sim_params(page_size_type=page_size_type)
    calls = sim_stats().get_pages_calls
    with pytest.raises(gpupin.GpupinError) as ei:
        device.pin(va, 2 * GPU_PAGE)
    assert ei.value.errno == errno.EOPNOTSUPP and "does not support" in str(ei.value)
    s = sim_stats()
    assert s.page_tables == 0 and s.pinned_pages == 0 and s.get_pages_calls == calls + gets_per_pin()
    assert device.info().pinned_bytes == 0 and device.info().file_pins == 0
    sim_params(page_size_type=1)
    pin = device.pin(va, 2 * GPU_PAGE)  # the same range pins once the tables are right
    device.unpin(pin)
    sim.free(va)


@LAYOUT
@pytest.mark.parametrize("version", [0x00010003, 0x00030003, 0x00020002])
def test_incompatible_dma_mapping_is_refused(device: Device, sim: SimMemory, sim_params, version: int) -> None:  # type: ignore[no-untyped-def]
    """A DMA mapping gpupin cannot read (another major, or a 2.x older than the
    header's minor) goes back to the driver (dma_unmap_pages) and DMA_MAP says
    EPROTO; the pin stays pinned and maps once the driver answers right.  Persistent: only
    such pins are mapped by NVIDIA's dma_map_pages."""
    va = sim.alloc(2 * GPU_PAGE)
    pin = device.pin(va, 2 * GPU_PAGE, persistent=True)
    sim_params(dma_mapping_version=version)
    with pytest.raises(gpupin.GpupinError) as ei:
        device.dma_map(pin, first_pci_device())
    assert ei.value.errno == errno.EPROTO and "unsupported version" in str(ei.value)
    assert sim_stats().dma_mappings == 0 and device.query(pin).dma_mappings == 0
    assert pin.is_valid()
    sim_params(dma_mapping_version=0x00020003)
    m = device.dma_map(pin, first_pci_device())
    assert m.entries == 2 and sim_stats().dma_mappings == 1
    device.unpin(pin)  # takes the mapping with it
    assert sim_stats().dma_mappings == 0
    sim.free(va)


@FAULT
@pytest.mark.parametrize("persistent", [False, True])
def test_provider_enotsupp_is_eopnotsupp(device: Device, sim: SimMemory, sim_params, persistent: bool) -> None:  # type: ignore[no-untyped-def]
    """NVIDIA answers NV_ERR_NOT_SUPPORTED with -ENOTSUPP (524), which user space cannot
    name: PIN (either API) and DMA_MAP pass it on as EOPNOTSUPP, leaving nothing."""
    va = sim.alloc(2 * GPU_PAGE)
    sim_params(fail_errno=ENOTSUPP, fail_nth=gets_per_pin())  # the pin's own get_pages
    with pytest.raises(gpupin.GpupinError) as ei:
        device.pin(va, 2 * GPU_PAGE, persistent=persistent)
    assert ei.value.errno == errno.EOPNOTSUPP and "does not support" in str(ei.value)
    assert sim_stats().page_tables == 0 and device.info().file_pins == 0
    pin = device.pin(va, 2 * GPU_PAGE, persistent=persistent)
    if persistent:  # NVIDIA maps persistent pins only (gpupin maps the others itself)
        sim_params(fail_dma_map_nth=1)
        with pytest.raises(gpupin.GpupinError) as ei:
            device.dma_map(pin, first_pci_device())
        assert ei.value.errno == errno.EOPNOTSUPP and "DMA_MAP" in str(ei.value)
        assert sim_stats().dma_mappings == 0 and device.query(pin).dma_mappings == 0 and pin.is_valid()
    m = device.dma_map(pin, first_pci_device())  # one failure only
    assert m.entries == 2
    device.unpin(pin)
    sim.free(va)
