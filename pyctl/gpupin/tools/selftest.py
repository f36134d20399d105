"""``gpupin selftest``: does GPUDirect through gpupin work on this host?

One integration suite, two providers.  The *module checks* pin memory through
gpupin.ko and follow it to a peer device: over NVIDIA's driver with CUDA
memory on a GPU host, over the simulator (nvp2p_sim) with simulated memory in
the VM.  They take everything from a :class:`Target` (the open Device, the
memory provider, the provider gpupin.ko must report, the example peer driver
and the PCI device it maps for), so the VM suite (tests/vm/test_selftest.py)
runs the very functions a user's ``gpupin selftest`` runs.  The *CUDA checks*
need no kernel module: the driver, buffer ids, SYNC_MEMOPS, dma-buf export.

A check returns its evidence, raises :class:`Skip` (with the reason) when it
cannot run here, and raises anything else when it fails.  ``run()`` makes the
table a user pastes into a bug report.
"""

from __future__ import annotations

import errno
import functools
import os
import platform
import random
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

from .. import __version__
from ..device import Device, Pin
from ..errors import GpupinError, ModuleError, NotGpuMemory, PinInvalidated, UnknownHandle
from ..memory import MemoryProvider
from ._sysfs import read_text

if TYPE_CHECKING:
    from ..cuda import CudaMemory
    from ..peer import Peer

KiB, MiB = 1 << 10, 1 << 20
GPU_PAGE = 64 * KiB
ALLOC = 2 * MiB  # CUDA aligns allocations of 2 MiB and more to 2 MiB: whole GPU pages
CAP_SYS_MODULE, CAP_SYS_ADMIN = 16, 21
EKEYREJECTED = getattr(errno, "EKEYREJECTED", 129)
Status = Literal["pass", "fail", "skip", "n/a"]


class Skip(Exception):
    """The check cannot run here; the message says why."""


class CheckFailed(Exception):
    """The check ran and what it saw is wrong; the message says what."""


def expect(cond: object, msg: str) -> None:
    """A check's assertion (``assert`` would vanish under ``python -O``)."""
    if not cond:
        raise CheckFailed(msg)


def capabilities(status: str = "/proc/self/status") -> int:
    """This process's effective capability bits (0 where they cannot be read)."""
    try:
        with open(status) as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


def has_cap(bit: int) -> bool:
    return bool(capabilities() >> bit & 1)


@dataclass
class Target:
    """What the module checks run against."""

    device: Device
    memory: MemoryProvider
    provider: str  # what gpupin.ko must report: "nvidia" or "nvp2p_sim"
    pci: str | None = None  # the PCI device DMA mappings are made for
    peer: Peer | None = None  # the example peer driver, open
    peer_why: str = ""  # why there is no peer: the peer check skips with it
    peer_error: str = ""  # the peer was wanted and failed to load: the peer check fails with it
    tag: int = field(default_factory=lambda: random.getrandbits(40) << 16)  # this run's user tags


class _Scope:
    """A check's allocations and pins: whatever a failing check leaves is unpinned, then
    freed, and the records that produced drained, so the next check starts clean."""

    def __init__(self, t: Target) -> None:
        self.t = t
        self.pins: list[Pin] = []
        self.allocs: list[int] = []

    def __enter__(self) -> _Scope:
        return self

    def alloc(self, size: int = ALLOC) -> int:
        va = self.t.memory.alloc(size)
        self.allocs.append(va)
        expect(va % GPU_PAGE == 0, f"{self.t.memory.name} gave {va:#x} for {size} bytes: not 64 KiB aligned")
        return va

    def free(self, va: int) -> None:
        self.allocs.remove(va)
        self.t.memory.free(va)

    def pin(self, va: int, size: int, **kw: Any) -> Pin:
        p = self.t.device.pin(va, size, **kw)
        self.pins.append(p)
        return p

    def unpin(self, p: Pin) -> None:
        self.pins.remove(p)
        self.t.device.unpin(p)

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        for p in self.pins:
            try:
                self.t.device.unpin(p)
            except GpupinError:
                pass  # gone already, or invalidated and refused: the failure is reported
        for va in self.allocs:
            try:
                self.t.memory.free(va)
            except GpupinError:
                pass
        if self.pins or self.allocs:
            try:
                self.t.device.read_events()
            except GpupinError:
                pass


@dataclass(frozen=True)
class Check:
    name: str
    fn: Callable[[Target], str]
    what: str  # one line: what passing shows
    fix: str  # what to look at when it fails


@dataclass
class Result:
    status: Status
    name: str
    evidence: str
    fix: str = ""
    seconds: float = 0.0


def pattern(n: int, seed: int) -> bytes:
    block = bytes((i * 131 + seed * 7 + 1) % 251 for i in range(4093))
    return (block * (n // len(block) + 1))[:n]


def _first_diff(a: bytes, b: bytes) -> str:
    if len(a) != len(b):
        return f"{len(a)} bytes instead of {len(b)}"
    i = next((i for i in range(len(a)) if a[i] != b[i]), None)
    return "the same bytes" if i is None else f"bytes that differ from offset {i} on"


# -- module checks: gpupin.ko over the provider ----------------------------------------
def check_provider(t: Target) -> str:
    from .. import ABI_VERSION

    info = t.device.info()
    expect(info.abi_version == ABI_VERSION, f"gpupin.ko speaks ABI {info.abi_version}, this package {ABI_VERSION}")
    expect(info.provider == t.provider, f"gpupin.ko pins through {info.provider!r}, expected {t.provider!r}")
    expect(info.simulator == (t.provider == "nvp2p_sim"), "the simulator capability does not match the provider")
    expect(info.gpu_page_size == GPU_PAGE, f"GPU page size {info.gpu_page_size}, expected {GPU_PAGE}")
    caps = [c for c in ("persistent", "dma_map", "dmabuf") if getattr(info, c)]
    return f"gpupin {info.version}, ABI {info.abi_version}, provider {info.provider}, caps {'+'.join(caps)}"


def check_pin(t: Target) -> str:
    with _Scope(t) as s:
        va = s.alloc()
        pin = s.pin(va + GPU_PAGE + 100, GPU_PAGE, user_tag=t.tag)  # straddles two GPU pages
        expect(
            (pin.aligned_va, pin.aligned_size, pin.entries) == (va + GPU_PAGE, 2 * GPU_PAGE, 2),
            f"rounded to +{pin.aligned_va - va:#x}, {pin.aligned_size:#x} bytes in {pin.entries} pages",
        )
        expect(pin.page_size == GPU_PAGE and pin.is_valid(), "the pin is not valid at once")
        state = t.device.query(pin)
        expect(state.state == "pinned" and state.entries == 2, f"query says {state}")
        table = "page table not read (needs CAP_SYS_ADMIN)"
        if has_cap(CAP_SYS_ADMIN):
            pages = t.device.get_pages(pin)
            expect(len(pages) == 2 and len(set(pages)) == 2, f"page table of {len(pages)} entries")
            expect(all(p and p % GPU_PAGE == 0 for p in pages), "page addresses not 64 KiB aligned")
            table = "2 distinct 64 KiB-aligned page addresses"
        s.unpin(pin)
        try:
            t.device.query(pin)
            raise CheckFailed("the pin is still there after unpin")
        except UnknownHandle:
            pass
        try:  # CUDA packs 2 MiB allocations: past this one may lie the next
            t.memory.range_of(va + ALLOC)
            overrun = "an overrun not tried (the next allocation starts where this one ends)"
        except NotGpuMemory:
            try:
                s.pin(va, ALLOC + GPU_PAGE)
                raise CheckFailed("a pin running past the allocation was accepted")
            except NotGpuMemory:
                overrun = "an overrun refused"
    return f"unaligned 64 KiB rounded to 2 GPU pages; {table}; unpinned; {overrun}"


def iommu_type(pci: str) -> str:
    """What translates the device's DMA: 'none', or the IOMMU group's type (identity, DMA,
    DMA-FQ...)."""
    path = f"/sys/bus/pci/devices/{pci}/iommu_group"
    if not os.path.exists(path):
        return "none"
    return read_text(f"{path}/type") or "unknown"


def check_dma_map(t: Target) -> str:
    if not t.pci:
        raise Skip("no PCI device to map for: name one with --pci (the NIC or device that will DMA)")
    if not has_cap(CAP_SYS_ADMIN):
        raise Skip("DMA mappings need CAP_SYS_ADMIN: run as root")
    with _Scope(t) as s:
        va = s.alloc()
        pin = s.pin(va, 8 * GPU_PAGE, user_tag=t.tag)
        m = t.device.dma_map(pin, t.pci)
        addrs = t.device.dma_addrs(m)
        phys = t.device.get_pages(pin)
        expect(len(addrs) == 8 and all(addrs), f"{len(addrs)} bus addresses, some zero: {addrs}")
        expect(t.device.query(pin).dma_mappings == 1, "query does not count the mapping")
        same = sum(a == p for a, p in zip(addrs, phys, strict=True))
        kind = iommu_type(t.pci)
        if kind.startswith("DMA"):
            expect(same < 8, f"the IOMMU ({kind}) translates for {t.pci}, yet every bus address is physical")
        t.device.dma_unmap(m)
    # Counts only: the table is meant for public bug reports, physical addresses stay out of it.
    return f"8 pages mapped for {t.pci} (IOMMU: {kind}); {same} of 8 bus addresses are the physical ones"


def check_peer_copy(t: Target) -> str:
    if t.peer_error:
        raise CheckFailed(t.peer_error)
    if t.peer is None:
        raise Skip(t.peer_why or "no example peer driver")
    size = 4 * GPU_PAGE + 3000
    with _Scope(t) as s:
        va = s.alloc()
        t.memory.enable_sync_memops(va)  # the peer's accesses and CUDA's copies are ordered
        pin = s.pin(va, ALLOC, user_tag=t.tag)
        before = t.peer.status()
        data = pattern(size, 1)
        t.memory.write(va + 500, data)
        got = t.peer.read(t.device, pin, 500, size)
        if got != data:
            raise CheckFailed(f"the peer read {_first_diff(got, data)} of what {t.memory.name} wrote")
        data = pattern(size, 2)
        t.peer.write(t.device, pin, GPU_PAGE + 7, data)
        got = t.memory.read(va + GPU_PAGE + 7, size)
        if got != data:
            raise CheckFailed(f"{t.memory.name} read {_first_diff(got, data)} of what the peer wrote")
        after = t.peer.status()
    bar, ram = after.bar_pages - before.bar_pages, after.ram_pages - before.ram_pages
    expect(bar + ram >= 10, f"the peer counted {bar + ram} page copies for at least 10 pages' worth")
    if t.provider == "nvidia":
        expect(bar and not ram, f"{ram} page copies went through RAM mappings: a GPU's BAR1 pages are MMIO")
    how = f"{bar} page copies through write-combined BAR mappings, {ram} through RAM"
    return f"{size} bytes each way between the peer and {t.memory.name} match byte for byte ({how})"


def check_invalidation(t: Target) -> str:
    from ..netlink import Netlink

    tag = t.tag | 1
    with _Scope(t) as s, Netlink() as nl:
        nl.subscribe()
        va = s.alloc()
        r = t.memory.range_of(va)
        if (r.base, r.size) != (va, ALLOC):
            raise Skip(f"{t.memory.name} placed 2 MiB inside a larger allocation: its free would not free it")
        pin = s.pin(va, 4 * GPU_PAGE, user_tag=tag)
        expect(t.device.wait_invalidations(0) == [], "records were queued before the free")
        t0 = time.monotonic()
        s.free(va)
        deadline = t0 + 1.0
        while pin.is_valid() and time.monotonic() < deadline:
            time.sleep(0.001)
        expect(not pin.is_valid(), "the validity word still says valid 1 s after the free: the free callback never ran")
        events = t.device.wait_invalidations(5)
        took = time.monotonic() - t0
        expect(
            [(e.handle, e.user_tag, e.reason) for e in events] == [(pin.handle, tag, "freed")],
            f"invalidation records {events}",
        )
        # Matched by handle and tag: the pid in events is the initial namespace's.
        seen = next(
            (
                e
                for e in nl.events(timeout=5)
                if e["event"] == "invalidated" and e.get("handle") == pin.handle and e.get("user_tag") == tag
            ),
            None,
        )
        expect(seen, "no netlink 'invalidated' event for the pin within 5 s")
        expect(t.device.query(pin).state == "invalidated", "query does not say invalidated")
        if has_cap(CAP_SYS_ADMIN):
            try:
                t.device.get_pages(pin)
                raise CheckFailed("get_pages of an invalidated pin succeeded")
            except PinInvalidated:
                pass
        s.unpin(pin)
    return f"free -> validity word, record (reason freed) and netlink event, in {took * 1000:.1f} ms"


def check_persistent(t: Target) -> str:
    if not t.device.info().persistent:
        raise CheckFailed("gpupin.ko reports no persistent pins over this driver")
    with _Scope(t) as s:
        va = s.alloc()
        pin = s.pin(va, 2 * GPU_PAGE, persistent=True, user_tag=t.tag)
        expect(pin.persistent and t.device.query(pin).persistent, "the pin is not persistent")
        s.free(va)  # NVIDIA keeps the pages of a persistent pin until it is put: no callback
        expect(pin.is_valid(), "the free invalidated a persistent pin")
        expect(t.device.query(pin).state == "pinned", "a persistent pin changed state at the free")
        expect(t.device.wait_invalidations(0) == [], "the free of a persistently pinned buffer queued a record")
        s.unpin(pin)
    return "pinned without a free callback; the buffer's free left it valid; unpinned"


def check_bad_input(t: Target) -> str:
    import fcntl

    from .._native import ffi, lib

    fd = t.device.fileno()
    pins_before = t.device.info().file_pins
    got = []
    try:
        fcntl.ioctl(fd, 0xC008C7FF, bytearray(8))  # gpupin's magic, a number it does not have
        got.append(("unknown command", 0, -errno.ENOTTY))
    except OSError as exc:
        got.append(("unknown command", -(exc.errno or 0), -errno.ENOTTY))
    with _Scope(t) as s:
        va = s.alloc()
        for what, fields in (
            ("unknown flag", {"flags": 1 << 31}),
            ("non-zero pad", {"pad": 1}),
            ("zero size", {"size": 0}),
            ("wrapping range", {"va": (1 << 64) - 10, "size": 100}),
        ):
            c = ffi.new("struct gpupin_pin *")
            for k, v in {"va": va, "size": GPU_PAGE, **fields}.items():
                setattr(c, k, v)
            got.append((what, lib.gpupin_call(fd, lib.GPUPIN_IOC_PIN, c), -errno.EINVAL))
    wrong = [f"{w}: {r} (expected {e})" for w, r, e in got if r != e]
    expect(not wrong, "; ".join(wrong))
    expect(t.device.info().file_pins == pins_before, "a refused request left a pin behind")
    return f"{len(got)} malformed requests refused (ENOTTY, EINVAL x{len(got) - 1}); nothing pinned"


def check_close(t: Target) -> str:
    from ..netlink import Netlink

    tag = t.tag | 2
    with _Scope(t) as s, Netlink() as nl:
        va = s.alloc()
        with Device() as dev:
            for i in range(64):
                dev.pin(va + (i % 32) * GPU_PAGE, GPU_PAGE, user_tag=tag)
            # This run's tag finds them (pids in dumps are the initial namespace's).
            listed = [p for p in nl.list_pins() if p.user_tag == tag]
            expect(len(listed) == 64, f"netlink lists {len(listed)} of the 64 pins")
            expect(len({p.file_id for p in listed}) == 1, "the 64 pins are listed under several files")
        left = [p for p in nl.list_pins() if p.user_tag == tag]
        expect(not left, f"{len(left)} pins left after their file closed")
    return "64 pins listed over netlink, all gone when their file closed"


MODULE_CHECKS = (
    Check(
        "provider",
        check_provider,
        "gpupin.ko runs over the expected driver with this ABI",
        "load gpupin.ko built for this package and driver (make modules; gpupin status)",
    ),
    Check(
        "pin",
        check_pin,
        "pin, round to 64 KiB GPU pages, query, page table, unpin",
        "see dmesg; 'gpupin doctor' checks BAR1 and the driver",
    ),
    Check(
        "dma map",
        check_dma_map,
        "a pin mapped for the named PCI device",
        "see dmesg and 'gpupin doctor' (IOMMU, ACS, the PCIe path between the GPU and the device)",
    ),
    Check(
        "peer copy",
        check_peer_copy,
        "a peer device reads and writes the pinned memory",
        "build the example peer (make modules) and name its device with --pci; see dmesg",
    ),
    Check(
        "invalidation",
        check_invalidation,
        "a free reaches the validity word, records, netlink",
        "see dmesg: the driver's free callback, gpupin's event queue and netlink family",
    ),
    Check(
        "persistent pin",
        check_persistent,
        "a pin without a free callback outlives the buffer's free",
        "persistent pins need the nv-p2p persistent API (not on vGPU/MIG guests): see dmesg",
    ),
    Check(
        "bad input",
        check_bad_input,
        "malformed requests are refused",
        "a gpupin.ko that accepts malformed requests: report it with this table",
    ),
    Check(
        "close",
        check_close,
        "closing the file releases every pin",
        "report it with this table and dmesg",
    ),
)


# -- CUDA checks: no kernel module needed ----------------------------------------------
def _cuda() -> CudaMemory:
    from ..cuda import CudaMemory

    return CudaMemory()


def cuda_checks(mem: CudaMemory) -> list[tuple[str, Callable[[], str]]]:
    def alloc_ids() -> str:
        a = mem.alloc(ALLOC)
        try:
            ida, r = mem.buffer_id(a), mem.range_of(a + 4096)
        finally:
            mem.free(a)
        b = mem.alloc(ALLOC)
        try:
            idb = mem.buffer_id(b)
        finally:
            mem.free(b)
        expect((r.base, r.size) == (a, ALLOC), f"range_of gives {r.base:#x}+{r.size:#x}")
        expect(ida != idb and ida and idb, f"buffer ids {ida} and {idb}: a new allocation kept its id")
        return f"2 MiB allocations; range found; buffer ids {ida} -> {idb}" + (" (same address)" if a == b else "")

    def copies() -> str:
        a = mem.alloc(ALLOC)
        try:
            data = pattern(ALLOC, 3)
            mem.write(a, data)
            expect(mem.read(a, ALLOC) == data, "what was written is not what is read back")
        finally:
            mem.free(a)
        return "2 MiB written and read back equal"

    def sync_memops() -> str:
        a = mem.alloc(ALLOC)
        try:
            expect(not mem.sync_memops(a), "a new cuMemAlloc allocation has SYNC_MEMOPS set already")
            mem.enable_sync_memops(a)
            expect(mem.sync_memops(a), "SYNC_MEMOPS reads back 0 after it was set")
        finally:
            mem.free(a)
        return "off on a new cuMemAlloc allocation; set, and read back as 1"

    def dmabuf() -> str:
        if not mem.dmabuf_supported():
            raise Skip("the device says it cannot export dma-bufs (DMA_BUF_SUPPORTED 0)")
        a = mem.alloc(ALLOC)
        try:
            fd = mem.export_dmabuf(a)
            size = os.lseek(fd, 0, os.SEEK_END)
            os.close(fd)
        finally:
            mem.free(a)
        expect(size == ALLOC, f"the dma-buf is {size} bytes for a {ALLOC}-byte allocation")
        return f"a 2 MiB allocation exported as a dma-buf of {size} bytes"

    return [
        ("CUDA memory", alloc_ids),
        ("CUDA copies", copies),
        ("SYNC_MEMOPS", sync_memops),
        ("dma-buf export", dmabuf),
    ]


# -- running ---------------------------------------------------------------------------
def run_check(fn: Callable[[], str], name: str) -> Result:
    t0 = time.monotonic()
    try:
        r = Result("pass", name, fn())
    except Skip as exc:
        r = Result("skip", name, str(exc))
    except (CheckFailed, AssertionError) as exc:
        r = Result("fail", name, str(exc) or "assertion failed")
    except Exception as exc:  # a check's error is its result, not the command's
        r = Result("fail", name, f"{type(exc).__name__}: {exc}")
    r.seconds = round(time.monotonic() - t0, 3)
    return r


def modules_impossible(
    status: str = "/proc/self/status", disabled: str = "/proc/sys/kernel/modules_disabled"
) -> str | None:
    """Why kernel modules cannot be loaded by this process, or None."""
    if not os.path.exists("/proc/modules"):
        return "this kernel has no module support"
    if os.geteuid() != 0:
        return "loading modules needs root"
    if read_text(disabled) == "1":
        return "module loading is disabled on this host (kernel.modules_disabled=1)"
    if not capabilities(status) >> CAP_SYS_MODULE & 1:
        return "this process lacks CAP_SYS_MODULE (a container, or a lent machine without module loading)"
    return None


def _loaded(module: str) -> bool:
    return os.path.isdir(f"/sys/module/{module}")


def normalize_pci(pci: str) -> str:
    """``DDDD:BB:DD.F`` (sysfs's spelling) for a PCI address given with or without its domain."""
    from ..device import parse_pci

    domain, bus, devfn = parse_pci(pci)
    return f"{domain:04x}:{bus:02x}:{devfn >> 3:02x}.{devfn & 7}"


def pci_name(pci: str) -> str:
    base = f"/sys/bus/pci/devices/{pci}"
    if not os.path.isdir(base):
        return f"{pci} (not present)"
    drv = os.path.basename(os.path.realpath(f"{base}/driver")) if os.path.exists(f"{base}/driver") else "no driver"
    ids = f"{read_text(base + '/vendor')[2:]}:{read_text(base + '/device')[2:]}"
    return f"{pci} [{ids}] class {read_text(base + '/class')}, {drv}"


def default_peer_pci(ib: str = "/sys/class/infiniband") -> str | None:
    """The device to map for when none is named: an RDMA device's PCI function, else the
    first NIC, else None (the PCI checks then skip and say to name one)."""
    from . import doctor

    for name in sorted(os.listdir(ib)) if os.path.isdir(ib) else []:
        dev = os.path.realpath(f"{ib}/{name}/device")
        if os.path.exists(f"{dev}/vendor"):
            return os.path.basename(dev)
    nics = doctor.nics()
    return nics[0].name if nics else None


def _nvidia_smi(*args: str) -> str:
    if not shutil.which("nvidia-smi"):
        return ""
    try:
        return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def facts(pci: str | None, provider: str) -> dict[str, str]:
    from . import doctor

    gpu = _nvidia_smi("--query-gpu=name,pci.bus_id,driver_version", "--format=csv,noheader")
    version = read_text("/proc/driver/nvidia/version").split("\n")[0]
    kind = f"{iommu_type(pci)} for {pci}" if pci else "no device named"
    return {
        "gpupin": __version__,
        "kernel": platform.release(),
        "GPU": gpu.replace("\n", "; ") or "none seen by nvidia-smi",
        "driver": version or "nvidia.ko not loaded",
        "BAR1": "; ".join(c.detail for c in doctor.check_bar1()),  # NVML, every GPU
        "budget": "; ".join(c.detail for c in doctor.check_budget()),
        "IOMMU": f"{doctor.check_iommu().detail}; group type {kind}",
        "provider": provider,
        "peer device": pci_name(pci) if pci else "none: name one with --pci",
    }


class _NotPossible(Exception):
    pass


def _kmod() -> Any:
    try:
        from .. import kmod
    except ModuleError as exc:  # a build without the libkmod bindings (_build.py --no-kmod)
        raise _NotPossible(f"gpupin was built without its libkmod bindings ({exc})") from None
    return kmod


def _load(kmod: Any, what: str, params: dict[str, str] | None = None) -> None:
    """Load a module; a kernel that refuses unsigned modules makes the checks not possible."""
    try:
        kmod.load(what, params)
    except ModuleError as exc:
        if exc.errno == EKEYREJECTED or "Key was rejected" in str(exc):
            raise _NotPossible(
                f"this kernel refuses {what}: it only loads signed modules (Secure Boot or lockdown); "
                "install gpupin through its DKMS package with an enrolled MOK key"
            ) from None
        raise


def load_nvidia(load: bool) -> str:
    """Load nvidia.ko where it is missing and loading is possible (before CUDA starts and the
    facts are read); what happened, for the JSON."""
    if _loaded("nvidia"):
        return "loaded already"
    why = modules_impossible() if load else "--no-load"
    if why:
        return f"not loaded: {why}"
    try:
        _load(_kmod(), "nvidia")  # stays loaded: CUDA uses it
    except (_NotPossible, ModuleError) as exc:
        return f"failed to load: {exc}"
    return "loaded by selftest"


def _open_target(
    provider: str, pci: str | None, load: bool, cuda_mem: CudaMemory | None, loaded: list[str], stack: ExitStack
) -> Target:
    """Load what is missing (recorded in ``loaded``), open the Device, the memory and the peer
    (closed by ``stack``)."""
    if not os.path.exists("/dev/gpupin"):
        why = modules_impossible() if load else "gpupin is not loaded and --no-load was given"
        if why:
            raise _NotPossible(why)
        kmod = _kmod()
        if provider == "nvp2p_sim" and not _loaded("nvp2p_sim"):
            _load(kmod, kmod.module_file("nvp2p_sim"))
            loaded.append("nvp2p_sim")
        if provider == "nvidia" and not _loaded("nvidia"):
            raise ModuleError("nvidia is not loaded and could not be loaded (see the driver fact)")
        _load(kmod, kmod.module_file("gpupin"))
        loaded.append("gpupin")
    device = stack.enter_context(Device())
    memory: Any
    if provider == "nvidia":
        if cuda_mem is None:
            raise _NotPossible("CUDA is not usable (see the CUDA row)")
        memory = cuda_mem
    else:
        from ..sim import SimMemory

        memory = stack.enter_context(SimMemory())
    t = Target(device, memory, provider, pci)
    if not pci:
        t.peer_why = "no PCI device for the example peer: name one with --pci"
        return t
    if not _loaded("gpupin_peer"):
        why = modules_impossible() if load else "gpupin_peer is not loaded and --no-load was given"
        if why:
            t.peer_why = f"gpupin_peer cannot be loaded: {why}"
            return t
        try:
            kmod = _kmod()
            _load(kmod, kmod.module_file("gpupin_peer"), {"pci": pci})
        except (_NotPossible, ModuleError) as exc:
            t.peer_error = f"gpupin_peer failed to load for {pci}: {exc}"
            return t
        loaded.append("gpupin_peer")
    mapped = read_text("/sys/module/gpupin_peer/parameters/pci")
    if mapped and mapped != pci:
        t.peer_why = f"gpupin_peer is loaded for {mapped}, not {pci}: unload it, or pass --pci {mapped}"
        return t
    from ..peer import Peer

    t.peer = stack.enter_context(Peer())
    return t


@dataclass
class _Setup:
    target: Target | None
    why: str = ""  # why there is no target
    status: Status = "n/a"  # n/a: not possible here; fail: tried and failed


@contextmanager
def _module_target(
    provider: str, pci: str | None, load: bool, keep: bool, cuda_mem: CudaMemory | None, out: Outcome
) -> Iterator[_Setup]:
    """The target, or why not; unloads afterwards what it loaded (unless ``keep``), and
    records in ``out`` what it loaded and any unload that failed."""
    from ..errors import DriverNotLoaded

    loaded: list[str] = []
    with ExitStack() as stack:
        try:
            setup = _Setup(_open_target(provider, pci, load, cuda_mem, loaded, stack))
        except _NotPossible as exc:
            setup = _Setup(None, str(exc), "n/a")
        except (ModuleError, DriverNotLoaded, GpupinError, OSError) as exc:
            setup = _Setup(None, f"{type(exc).__name__}: {exc}", "fail")
        out.loaded = list(loaded)
        try:
            yield setup
        finally:
            stack.close()
            for name in [] if keep else reversed(loaded):
                try:
                    _kmod().unload(name)
                except (_NotPossible, GpupinError) as exc:
                    out.unload_errors.append(f"{name}: {exc}")


@dataclass
class Outcome:
    facts: dict[str, str]
    provider: str = ""
    results: list[Result] = field(default_factory=list)
    facts_seconds: float = 0.0
    require_modules: bool = False
    nvidia: str = ""  # what happened to nvidia.ko
    loaded: list[str] = field(default_factory=list)  # modules this run loaded
    unload_errors: list[str] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        n = {"pass": 0, "fail": 0, "skip": 0, "n/a": 0}
        for r in self.results:
            n[r.status] += 1
        return n

    @property
    def module_checks_ran(self) -> bool:
        names = {c.name for c in MODULE_CHECKS}
        return all(r.status in ("pass", "fail") for r in self.results if r.name in names)

    @property
    def failed(self) -> bool:
        if any(r.status == "fail" for r in self.results) or self.unload_errors:
            return True
        return self.require_modules and not self.module_checks_ran

    def summary(self) -> str:
        n = self.counts()
        if self.failed:
            verdict = "FAILED"
            if self.require_modules and not self.module_checks_ran and not n["fail"]:
                verdict += " (--require-modules: some module checks did not run)"
        elif not n["pass"]:
            verdict = "ran no check"
        elif self.module_checks_ran:
            verdict = "passed"
        else:
            verdict = "passed what it could run"
        text = (
            f"selftest {verdict}: {n['pass']} passed, {n['fail']} failed, {n['skip']} skipped, "
            f"{n['n/a']} not possible here"
        )
        if self.unload_errors:
            text += "\nmodules it loaded and could not unload: " + "; ".join(self.unload_errors)
        return text

    def as_dict(self) -> dict[str, Any]:
        return {
            "facts": self.facts,
            "provider": self.provider,
            "checks": [asdict(r) for r in self.results],
            "counts": self.counts(),
            "passed": not self.failed,
            "nvidia": self.nvidia,
            "loaded": self.loaded,
            "unload_errors": self.unload_errors,
            "facts_seconds": self.facts_seconds,
        }


def _run_module_check(c: Check, target: Target) -> Result:
    r = run_check(functools.partial(c.fn, target), c.name)
    if r.status == "fail":
        r.fix = c.fix
    return r


def run(
    *,
    sim: bool | None = None,
    pci: str | None = None,
    load: bool = True,
    keep: bool = False,
    require_modules: bool = False,
) -> Outcome:
    """Run every check that can run here.  ``sim``: pin through the simulator (default: when
    no NVIDIA GPU is seen); ``pci``: the device to map for (default: an RDMA device, else a
    NIC); ``load``: load the modules that are missing; ``keep``: leave them loaded afterwards;
    ``require_modules``: a module check that could not run fails the outcome."""
    from . import doctor

    t0 = time.monotonic()
    if sim is None:
        from ..cuda import visible_gpus

        sim = not doctor.gpus() and not visible_gpus().gpus
    provider = "nvp2p_sim" if sim else "nvidia"
    pci = normalize_pci(pci) if pci else default_peer_pci()
    nvidia = "" if sim else load_nvidia(load)  # first: CUDA and the facts need it
    out = Outcome(facts(pci, provider), provider, require_modules=require_modules, nvidia=nvidia)
    out.facts_seconds = round(time.monotonic() - t0, 3)
    cuda_mem, cuda_why = None, ""
    if not sim:
        try:
            cuda_mem = _cuda()
        except GpupinError as exc:
            cuda_why = str(exc)
    with _module_target(provider, pci, load, keep, cuda_mem, out) as setup:
        if setup.target is None:
            what = "not possible here" if setup.status == "n/a" else "could not set up"
            out.results += [Result(setup.status, c.name, f"{what}: {setup.why}") for c in MODULE_CHECKS]
        else:
            out.results += [_run_module_check(c, setup.target) for c in MODULE_CHECKS]
    if sim:
        out.results.append(Result("n/a", "CUDA", "the simulator run: no CUDA checks"))
    elif cuda_mem is None:
        fix = (
            "install the cuda extra: pip install 'gpupin[cuda]'"
            if "cuda-python" in cuda_why
            else "nvidia-smi sees the GPU but CUDA does not start: check dmesg and that libcuda matches nvidia.ko"
        )
        out.results.append(Result("fail", "CUDA", cuda_why, fix))
    else:
        try:
            out.results += [run_check(fn, name) for name, fn in cuda_checks(cuda_mem)]
        finally:
            cuda_mem.close()
    return out
