"""gpupin.ko over either provider (the simulator in the VM, nvidia.ko with GPUPIN_NATIVE=1):
pinning, rounding, invalidation, DMA, persistence.  Allocations that are pinned from their start
are 2 MiB: cuMemAlloc aligns those to 2 MiB, smaller ones only to 256 bytes.  Simulator counters
are checked in the VM only (`if not NATIVE`)."""

from __future__ import annotations

import errno
import mmap
import os
from collections import Counter

import pytest

import gpupin
from conftest import GPU_PAGE, KiB, MiB
from gpupin import Device, MemoryProvider, sim_stats
from gpupin.testing import NATIVE

pytestmark = pytest.mark.vm


def test_info(device: Device) -> None:
    info = device.info()
    assert info.abi_version == gpupin.ABI_VERSION
    assert info.provider == ("nvidia" if NATIVE else "nvp2p_sim") and info.simulator == (not NATIVE)
    assert info.persistent and info.dma_map
    assert info.gpu_page_size == GPU_PAGE
    assert info.file_pins == 0
    assert info.map_size >= info.max_pins_per_file * 8


def test_pin_unpin_and_query(device: Device, memory: MemoryProvider) -> None:
    va = memory.alloc(2 * MiB)
    pin = device.pin(va, 1 * MiB, user_tag=77)
    assert (pin.aligned_va, pin.aligned_size, pin.entries) == (va, 1 * MiB, 16)
    assert pin.page_size == GPU_PAGE and pin.handle > 0 and pin.is_valid()
    assert len(pin.gpu_uuid) == 16 and any(pin.gpu_uuid)
    st = device.query(pin)
    assert st.state == "pinned" and st.user_tag == 77 and st.entries == 16 and not st.persistent
    if not NATIVE:
        s = sim_stats()
        assert s.pinned_pages == 16 and s.bar_bytes == 1 * MiB and s.live_callbacks == 1
    assert device.info().file_pins == 1 and device.info().pinned_bytes >= 1 * MiB
    pin.unpin()
    assert not pin.is_valid()
    with pytest.raises(gpupin.UnknownHandle):
        device.query(pin)
    with pytest.raises(gpupin.UnknownHandle):
        device.unpin(pin)
    if not NATIVE:
        assert sim_stats().pinned_pages == 0
    memory.free(va)


def test_rounding_to_gpu_pages(device: Device, memory: MemoryProvider) -> None:
    va = memory.alloc(2 * MiB)
    pin = device.pin(va + GPU_PAGE + 100, GPU_PAGE)  # straddles two GPU pages
    assert pin.aligned_va == va + GPU_PAGE and pin.aligned_size == 2 * GPU_PAGE and pin.entries == 2
    one = device.pin(va + 3 * GPU_PAGE + GPU_PAGE - 1, 1)  # last byte
    assert one.aligned_va == va + 3 * GPU_PAGE and one.aligned_size == GPU_PAGE
    device.unpin(pin)
    device.unpin(one)
    memory.free(va)


def test_two_buffers_in_one_gpu_page(device: Device, memory: MemoryProvider) -> None:
    va = memory.alloc(2 * MiB)
    a = device.pin(va, 4 * KiB, user_tag=1)
    b = device.pin(va + 8 * KiB, 4 * KiB, user_tag=2)
    assert a.handle != b.handle and a.slot != b.slot
    assert a.aligned_va == b.aligned_va == va
    if not NATIVE:
        assert sim_stats().page_tables == 2
    device.unpin(a)
    assert b.is_valid() and device.query(b).state == "pinned"
    assert device.get_pages(b) == device.get_pages(b.handle, 0, 1)
    with pytest.raises(gpupin.UnknownHandle):
        device.query(a)
    device.unpin(b)
    if not NATIVE:
        assert sim_stats().page_tables == 0
    memory.free(va)


def test_handles_are_never_reused(device: Device, memory: MemoryProvider) -> None:
    va = memory.alloc(2 * MiB)
    seen = set()
    for _ in range(50):
        p = device.pin(va, GPU_PAGE)
        assert p.handle not in seen
        seen.add(p.handle)
        device.unpin(p)
    memory.free(va)


def test_free_invalidates(device: Device, memory: MemoryProvider) -> None:
    va = memory.alloc(2 * MiB)
    memory.write(va, b"x" * 100)
    pin = device.pin(va, 256 * KiB, user_tag=0xABC)
    other = memory.alloc(2 * MiB)
    keep = device.pin(other, GPU_PAGE, user_tag=5)
    assert device.wait_invalidations(0) == []
    memory.free(va)  # runs the free callback synchronously (cuMemFree too)
    assert not pin.is_valid() and keep.is_valid()
    events = device.wait_invalidations(5)
    assert [(e.handle, e.user_tag, e.reason) for e in events] == [(pin.handle, 0xABC, "freed")]
    assert device.query(pin).state == "invalidated"
    with pytest.raises(gpupin.PinInvalidated):
        device.get_pages(pin)
    if not NATIVE:
        s = sim_stats()
        assert s.pinned_pages == 1 and s.tables_not_freed == 0 and s.callbacks_run >= 1
    device.unpin(pin)
    device.unpin(keep)
    memory.free(other)


def test_persistent_pin_survives_free(device: Device, memory: MemoryProvider) -> None:
    va = memory.alloc(2 * MiB)
    memory.write(va, b"persist")
    pin = device.pin(va, 128 * KiB, persistent=True)
    assert pin.persistent and device.query(pin).persistent
    if not NATIVE:
        assert sim_stats().live_callbacks == 0
    memory.free(va)  # cuMemFree does not invalidate persistent pins either
    assert pin.is_valid() and device.query(pin).state == "pinned"
    assert device.wait_invalidations(0) == []
    if not NATIVE:
        assert sim_stats().pinned_pages == 2  # pages stay until unpin
    device.unpin(pin)
    if not NATIVE:
        assert sim_stats().alloc_bytes == 0


@pytest.mark.parametrize("persistent", [False, True])
def test_dma_map_unmap(device: Device, memory: MemoryProvider, pci: str, persistent: bool) -> None:
    """Persistent pins are mapped by NVIDIA's dma_map_pages, the others by gpupin itself."""
    nvidia = int(persistent)
    va = memory.alloc(2 * MiB)
    pin = device.pin(va, 512 * KiB, persistent=persistent)
    m = device.dma_map(pin, pci)
    assert m.entries == 8 and m.mapping_id > 0
    addrs = device.dma_addrs(m)
    assert len(addrs) == 8 and all(a % GPU_PAGE == 0 for a in addrs)
    assert device.query(pin).dma_mappings == 1
    if not NATIVE:
        assert sim_stats().dma_mappings == nvidia
    m2 = device.dma_map(pin, pci)
    device.dma_unmap(m)
    with pytest.raises(gpupin.UnknownHandle):
        device.dma_unmap(m)
    assert device.query(pin).dma_mappings == 1
    device.unpin(pin)  # m2 goes with the pin
    if not NATIVE:
        assert sim_stats().dma_mappings == 0 and sim_stats().mappings_not_freed == 0
    with pytest.raises(gpupin.UnknownHandle):
        device.dma_unmap(m2)
    memory.free(va)


def test_dma_mappings_go_on_invalidation(device: Device, memory: MemoryProvider, pci: str) -> None:
    va = memory.alloc(2 * MiB)
    pin = device.pin(va, GPU_PAGE)
    m = device.dma_map(pin, pci)
    memory.free(va)
    if not NATIVE:
        s = sim_stats()
        assert s.dma_mappings == 0 and s.mappings_not_freed == 0
    with pytest.raises(gpupin.PinInvalidated):
        device.dma_unmap(m)
    with pytest.raises(gpupin.PinInvalidated):
        device.dma_map(pin, pci)
    device.unpin(pin)


def test_dma_map_unknown_pci_device(device: Device, memory: MemoryProvider) -> None:
    va = memory.alloc(2 * MiB)
    pin = device.pin(va, GPU_PAGE)
    with pytest.raises(gpupin.GpupinError) as ei:
        device.dma_map(pin, "00fe:ff:1f.7")
    assert ei.value.errno == errno.ENODEV
    device.unpin(pin)
    memory.free(va)


def test_get_pages_are_the_gpu_pages(device: Device, memory: MemoryProvider) -> None:
    va = memory.alloc(2 * MiB)
    pin = device.pin(va, 3 * GPU_PAGE)
    pages = device.get_pages(pin)
    assert len(pages) == 3 and len(set(pages)) == 3 and all(p % GPU_PAGE == 0 for p in pages)
    assert device.get_pages(pin, 1, 2) == pages[1:]
    device.unpin(pin)
    memory.free(va)


def test_close_releases_everything(memory: MemoryProvider) -> None:
    """1000 pins of one file, counted by netlink (and the simulator's page tables), all gone
    when the file closes; over either provider."""
    from gpupin.netlink import Netlink

    va = memory.alloc(8 * MiB)
    with Device() as other, Netlink() as nl:
        dev = Device()
        other.pin(va, GPU_PAGE)  # another file's pin stays
        for i in range(1000):
            dev.pin(va + (i % 128) * GPU_PAGE, GPU_PAGE, user_tag=i)
        per_file = Counter(p.file_id for p in nl.list_pins() if p.pid == os.getpid())
        assert sorted(per_file.values()) == [1, 1000], per_file
        if not NATIVE:
            assert sim_stats().page_tables == 1001
        dev.close()
        assert [p.user_tag for p in nl.list_pins() if p.pid == os.getpid()] == [0]
        if not NATIVE:
            assert sim_stats().page_tables == 1 and sim_stats().bar_bytes == GPU_PAGE
    memory.free(va)


def test_pin_foreign_or_host_memory(device: Device, memory: MemoryProvider) -> None:
    buf = mmap.mmap(-1, GPU_PAGE)
    import ctypes

    host = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    with pytest.raises(gpupin.NotGpuMemory):
        device.pin(host, 4096)
    del host
    buf.close()
    va = memory.alloc(2 * MiB)
    try:  # CUDA packs 2 MiB allocations: the next one may start where this one ends
        memory.range_of(va + 2 * MiB)
        neighbour = True
    except gpupin.NotGpuMemory:
        neighbour = False
    if not neighbour or not NATIVE:
        with pytest.raises(gpupin.NotGpuMemory):  # runs past the allocation
            device.pin(va, 2 * MiB + GPU_PAGE)
    memory.free(va)
    with pytest.raises(gpupin.NotGpuMemory):  # freed
        device.pin(va, GPU_PAGE)


def test_validity_map_is_read_only(device: Device) -> None:
    size = device.info().map_size
    with pytest.raises(PermissionError):
        mmap.mmap(device.fileno(), size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    with pytest.raises(OSError):
        mmap.mmap(device.fileno(), size + 4096, mmap.MAP_SHARED, mmap.PROT_READ)
    m = mmap.mmap(device.fileno(), size, mmap.MAP_SHARED, mmap.PROT_READ)
    assert m[:8] == b"\0" * 8
    m.close()


def test_read_needs_a_whole_record(device: Device) -> None:
    with pytest.raises(OSError) as ei:
        os.read(device.fileno(), 8)
    assert ei.value.errno == errno.EINVAL


def test_the_file_is_non_blocking(device: Device, memory: MemoryProvider) -> None:
    """A Device opens /dev/gpupin O_NONBLOCK, and the kernel honours it: read() of an empty
    queue says EAGAIN at once; records are read as they come; reading leaves the flags alone."""
    import fcntl
    import select

    from gpupin._native import ffi, lib

    fd = device.fileno()
    assert not os.get_blocking(fd) and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_NONBLOCK
    size = ffi.sizeof("struct gpupin_event")
    with pytest.raises(BlockingIOError) as ei:
        os.read(fd, size)
    assert ei.value.errno == errno.EAGAIN
    va = memory.alloc(2 * MiB)
    pin = device.pin(va, GPU_PAGE, user_tag=3)
    memory.free(va)
    assert select.select([fd], [], [], 5)[0] == [fd], "poll does not say a record is queued"
    data = os.read(fd, 2 * size)
    assert len(data) == size
    ev = ffi.from_buffer("struct gpupin_event[]", data)[0]
    assert (ev.handle, ev.user_tag, ev.reason) == (pin.handle, 3, lib.GPUPIN_INVAL_FREED)
    with pytest.raises(BlockingIOError):
        os.read(fd, size)
    assert device.read_events() == [] and device.wait_invalidations(0) == []
    assert not os.get_blocking(fd), "reading records changed the file's flags"
    device.unpin(pin)


def test_debug_log_says_what_happened_and_is_rate_limited(device: Device, memory: MemoryProvider, sim_params) -> None:  # type: ignore[no-untyped-def]
    """debug=1 logs pins, releases and invalidations, at most a burst (10) per 5 s per message.
    ``debug`` is gpupin's own parameter: this runs over either provider."""
    import time

    sim_params("gpupin", debug=True)
    time.sleep(5.5)  # a fresh window for every message (earlier tests may have used theirs)
    mark = f"gpupin-debug-log-test-{os.getpid()}-{time.monotonic_ns()}"
    with open("/dev/kmsg", "w") as kmsg:
        kmsg.write(mark + "\n")
    va = memory.alloc(2 * MiB)
    for _ in range(40):
        device.unpin(device.pin(va, GPU_PAGE))
    pin = device.pin(va, GPU_PAGE)
    memory.free(va)  # invalidated by the provider
    device.unpin(pin)
    # Unbuffered: /dev/kmsg returns one record per read, and refuses a read shorter than it.
    with open("/dev/kmsg", "rb", buffering=0) as kmsg:  # the whole ring from the start
        os.set_blocking(kmsg.fileno(), False)
        lines: list[str] = []
        while True:
            try:
                rec = kmsg.read(8192)
            except BlockingIOError:
                break
            except BrokenPipeError:  # the ring overwrote records before we read them: go on
                continue
            if not rec:
                break
            lines.append(rec.decode(errors="replace").split(";", 1)[-1].strip())
    after = lines[max(i for i, ln in enumerate(lines) if ln == mark) + 1 :]
    pinned = [ln for ln in after if ln.startswith("gpupin: pin ") and ln.endswith(f": {GPU_PAGE} bytes")]
    released = [ln for ln in after if ln.startswith("gpupin: pin ") and ln.endswith(" released")]
    assert 1 <= len(pinned) <= 10 and 1 <= len(released) <= 10, (pinned, released)
    assert f"gpupin: pin {pin.handle} invalidated by the provider" in after, after[-20:]
    # Handles and sizes only: no kernel pointer or physical address in the log.
    assert not any("0xffff" in ln for ln in after if ln.startswith("gpupin:"))


def test_blocking_read_waits_for_the_event_and_a_signal_interrupts_it(memory: MemoryProvider) -> None:
    """read() on /dev/gpupin without O_NONBLOCK sleeps until a record is queued; a signal wakes it.

    A Device's file is non-blocking and shared by its users: the blocking file is one of this
    test's own, a Device that nothing else uses, made blocking."""
    import signal
    import threading
    import time

    from conftest import SLOW
    from gpupin._native import ffi, lib

    size = ffi.sizeof("struct gpupin_event")
    with Device() as own:
        fd = own.fileno()
        os.set_blocking(fd, True)
        va = memory.alloc(2 * MiB)
        pin = own.pin(va, GPU_PAGE, user_tag=7)
        got: list[bytes | BaseException] = []

        def reader() -> None:
            try:
                got.append(os.read(fd, size))
            except BaseException as exc:  # reported below
                got.append(exc)

        t = threading.Thread(target=reader)
        t.start()
        time.sleep(0.3 * SLOW)
        assert not got, f"read returned with nothing queued: {got}"
        memory.free(va)
        t.join(10 * SLOW)
        assert not t.is_alive() and len(got) == 1 and isinstance(got[0], bytes), got
        ev = ffi.from_buffer("struct gpupin_event[]", got[0])[0]
        assert (ev.handle, ev.user_tag, ev.reason) == (pin.handle, 7, lib.GPUPIN_INVAL_FREED)
        own.unpin(pin)

        class Interrupted(Exception):
            pass

        def on_alarm(signum: int, frame: object) -> None:
            raise Interrupted

        old = signal.signal(signal.SIGALRM, on_alarm)
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.3 * SLOW)
            with pytest.raises(Interrupted):
                os.read(fd, size)  # nothing queued: sleeps until the signal
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        os.set_blocking(fd, False)  # read_events reads until EAGAIN: on a blocking file it would sleep
        assert own.read_events() == []  # the file still works, nothing was lost or invented
