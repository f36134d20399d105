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
import os
import platform
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

from . import __version__
from .device import Device
from .errors import GpupinError, NotGpuMemory, PinInvalidated, UnknownHandle
from .memory import MemoryProvider

KiB, MiB = 1 << 10, 1 << 20
GPU_PAGE = 64 * KiB
ALLOC = 2 * MiB  # CUDA aligns allocations of 2 MiB and more to 2 MiB: whole GPU pages
CAP_SYS_MODULE = 16


class Skip(Exception):
    """The check cannot run here; the message says why."""


@dataclass
class Target:
    """What the module checks run against."""

    device: Device
    memory: MemoryProvider
    provider: str  # what gpupin.ko must report: "nvidia" or "nvp2p_sim"
    pci: str | None = None  # the PCI device DMA mappings are made for
    peer: Any = None  # an open gpupin.peer.Peer, or None
    peer_why: str = ""  # why there is no peer

    def alloc(self, size: int = ALLOC) -> int:
        va = self.memory.alloc(size)
        if va % GPU_PAGE:
            self.memory.free(va)
            raise AssertionError(f"{self.memory.name} gave {va:#x} for {size} bytes: not 64 KiB aligned")
        return va


@dataclass(frozen=True)
class Check:
    name: str
    fn: Callable[..., str]
    what: str  # one line: what passing shows


@dataclass
class Result:
    status: str  # pass | fail | skip | n/a
    name: str
    evidence: str
    fix: str = ""
    seconds: float = 0.0


def pattern(n: int, seed: int) -> bytes:
    block = bytes((i * 131 + seed * 7 + 1) % 251 for i in range(4093))
    return (block * (n // len(block) + 1))[:n]


# -- module checks: gpupin.ko over the provider ----------------------------------------
def check_provider(t: Target) -> str:
    from . import ABI_VERSION

    info = t.device.info()
    assert info.abi_version == ABI_VERSION, f"gpupin.ko speaks ABI {info.abi_version}, this package {ABI_VERSION}"
    assert info.provider == t.provider, f"gpupin.ko pins through {info.provider!r}, expected {t.provider!r}"
    assert info.simulator == (t.provider == "nvp2p_sim"), "the simulator capability does not match the provider"
    assert info.gpu_page_size == GPU_PAGE, f"GPU page size {info.gpu_page_size}, expected {GPU_PAGE}"
    caps = [c for c in ("persistent", "dma_map", "dmabuf") if getattr(info, c)]
    return f"gpupin {info.version}, ABI {info.abi_version}, provider {info.provider}, caps {'+'.join(caps)}"


def check_pin(t: Target) -> str:
    va = t.alloc()
    try:
        pin = t.device.pin(va + GPU_PAGE + 100, GPU_PAGE, user_tag=1)  # straddles two GPU pages
        assert (pin.aligned_va, pin.aligned_size, pin.entries) == (va + GPU_PAGE, 2 * GPU_PAGE, 2), (
            f"rounded to {pin.aligned_va - va:#x}+{pin.aligned_size:#x} in {pin.entries} pages"
        )
        assert pin.page_size == GPU_PAGE and pin.is_valid(), "the pin is not valid at once"
        state = t.device.query(pin)
        assert state.state == "pinned" and state.entries == 2, f"query says {state}"
        pages = t.device.get_pages(pin)
        assert len(pages) == 2 and len(set(pages)) == 2, f"page table {pages}"
        assert all(p and p % GPU_PAGE == 0 for p in pages), "page addresses not 64 KiB aligned"
        t.device.unpin(pin)
        try:
            t.device.query(pin)
            raise AssertionError("the pin is still there after unpin")
        except UnknownHandle:
            pass
        try:
            t.device.pin(va, ALLOC + GPU_PAGE)
            raise AssertionError("a pin running past the allocation was accepted")
        except NotGpuMemory:
            pass
    finally:
        t.memory.free(va)
    return "unaligned 64 KiB rounded to 2 GPU pages of 64 KiB; query, page table, unpin; overrun refused"


def _iommu(pci: str) -> bool:
    return os.path.exists(f"/sys/bus/pci/devices/{pci}/iommu_group")


def check_dma_map(t: Target) -> str:
    if not t.pci:
        raise Skip("no PCI device to map for: name one with --pci (a NIC)")
    va = t.alloc()
    try:
        pin = t.device.pin(va, 8 * GPU_PAGE)
        m = t.device.dma_map(pin, t.pci)
        addrs = t.device.dma_addrs(m)
        phys = t.device.get_pages(pin)
        assert len(addrs) == 8 and all(addrs), f"{len(addrs)} bus addresses, some zero: {addrs}"
        assert t.device.query(pin).dma_mappings == 1, "query does not count the mapping"
        same = sum(a == p for a, p in zip(addrs, phys, strict=True))
        t.device.dma_unmap(m)
        t.device.unpin(pin)
    finally:
        t.memory.free(va)
    iommu = "IOMMU group" if _iommu(t.pci) else "no IOMMU"
    return f"8 pages mapped for {t.pci} ({iommu}); {same} of 8 bus addresses equal the physical ones"


def check_peer_copy(t: Target) -> str:
    if t.peer is None:
        raise Skip(t.peer_why or "no example peer driver")
    size = 4 * GPU_PAGE + 3000
    va = t.alloc()
    try:
        t.memory.enable_sync_memops(va)  # the peer's accesses and CUDA's copies are ordered
        pin = t.device.pin(va, ALLOC)
        before = t.peer.status()
        data = pattern(size, 1)
        t.memory.write(va + 500, data)
        got = t.peer.read(t.device, pin, 500, size)
        assert got == data, f"the peer read {_first_diff(got, data)} from what CUDA wrote"
        data = pattern(size, 2)
        t.peer.write(t.device, pin, GPU_PAGE + 7, data)
        got = t.memory.read(va + GPU_PAGE + 7, size)
        assert got == data, f"CUDA read {_first_diff(got, data)} from what the peer wrote"
        after = t.peer.status()
        t.device.unpin(pin)
    finally:
        t.memory.free(va)
    paths = [
        f"{getattr(after, k) - getattr(before, k)} page copies through {name}"
        for k, name in (("bar_pages", "BAR mappings"), ("ram_pages", "RAM"))
        if hasattr(after, k) and getattr(after, k) != getattr(before, k)
    ]
    how = "; ".join(paths) if paths else "copied"
    return f"{size} bytes each way between the peer and {t.memory.name} match byte for byte ({how})"


def _first_diff(a: bytes, b: bytes) -> str:
    if len(a) != len(b):
        return f"{len(a)} bytes instead of {len(b)}"
    i = next(i for i in range(len(a)) if a[i] != b[i])
    return f"bytes that differ at offset {i}"


def check_invalidation(t: Target) -> str:
    from .netlink import Netlink

    va = t.alloc()
    freed = False
    with Netlink() as nl:
        nl.subscribe()
        try:
            pin = t.device.pin(va, 4 * GPU_PAGE, user_tag=0x5E1F)
            assert t.device.wait_invalidations(0) == [], "records queued before the free"
            t0 = time.monotonic()
            t.memory.free(va)
            freed = True
            assert not pin.is_valid(), "the validity word still says valid after the free"
            events = t.device.wait_invalidations(5)
            took = time.monotonic() - t0
            assert [(e.handle, e.user_tag, e.reason) for e in events] == [(pin.handle, 0x5E1F, "freed")], (
                f"invalidation records {events}"
            )
            seen = next(
                (
                    e
                    for e in nl.events(timeout=5)
                    if e["event"] == "invalidated" and e.get("handle") == pin.handle and e.get("pid") == os.getpid()
                ),
                None,
            )
            assert seen, "no netlink 'invalidated' event for the pin within 5 s"
            assert t.device.query(pin).state == "invalidated", "query does not say invalidated"
            try:
                t.device.get_pages(pin)
                raise AssertionError("get_pages of an invalidated pin succeeded")
            except PinInvalidated:
                pass
            t.device.unpin(pin)
        finally:
            if not freed:
                t.memory.free(va)
    return f"free -> validity word, record (reason freed) and netlink event, in {took * 1000:.1f} ms"


def check_persistent(t: Target) -> str:
    if not t.device.info().persistent:
        raise Skip("gpupin.ko reports no persistent pins here")
    va = t.alloc()
    try:
        pin = t.device.pin(va, 2 * GPU_PAGE, persistent=True)
        assert pin.persistent and t.device.query(pin).persistent, "the pin is not persistent"
        assert t.device.wait_invalidations(0) == [], "a persistent pin queued a record"
        t.device.unpin(pin)
    finally:
        t.memory.free(va)
    return "pinned without a free callback, queried, unpinned"


def check_bad_input(t: Target) -> str:
    import fcntl

    from ._native import ffi, lib

    fd = t.device.fileno()
    got = []
    try:
        fcntl.ioctl(fd, 0xC008C7FF, bytearray(8))  # gpupin's magic, a number it does not have
        got.append(("unknown command", 0, -errno.ENOTTY))
    except OSError as exc:
        got.append(("unknown command", -(exc.errno or 0), -errno.ENOTTY))
    va = t.alloc()
    try:
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
    finally:
        t.memory.free(va)
    wrong = [f"{w}: {r} (expected {e})" for w, r, e in got if r != e]
    assert not wrong, "; ".join(wrong)
    assert t.device.info().file_pins == 0, "a refused request left a pin behind"
    return f"{len(got)} malformed requests refused (ENOTTY, EINVAL x{len(got) - 1}); nothing pinned"


def check_close(t: Target) -> str:
    from .netlink import Netlink

    pid = os.getpid()
    va = t.alloc()
    dev = Device()
    try:
        with Netlink() as nl:
            before = {p.file_id for p in nl.list_pins() if p.pid == pid}
            for i in range(64):
                dev.pin(va + (i % 32) * GPU_PAGE, GPU_PAGE, user_tag=i)
            files = {p.file_id for p in nl.list_pins() if p.pid == pid} - before
            listed = [p for p in nl.list_pins() if p.file_id in files]
            assert len(listed) == 64, f"netlink lists {len(listed)} of the 64 pins"
            dev.close()
            left = [p for p in nl.list_pins() if p.file_id in files]
        assert not left, f"{len(left)} pins left after their file closed"
    finally:
        dev.close()
        t.memory.free(va)
    return "64 pins listed over netlink, all gone when their file closed"


MODULE_CHECKS = (
    Check("provider", check_provider, "gpupin.ko runs over the expected driver with this ABI"),
    Check("pin", check_pin, "pin, round to 64 KiB GPU pages, query, page table, unpin"),
    Check("dma map", check_dma_map, "a pin mapped for the named PCI device"),
    Check("peer copy", check_peer_copy, "a peer device reads and writes the pinned memory"),
    Check("invalidation", check_invalidation, "a free reaches the validity word, records, netlink"),
    Check("persistent pin", check_persistent, "a pin without a free callback"),
    Check("bad input", check_bad_input, "malformed requests are refused"),
    Check("close", check_close, "closing the file releases every pin"),
)


# -- CUDA checks: no kernel module needed ----------------------------------------------
def _cuda() -> Any:
    from .cuda import CudaMemory

    return CudaMemory()


def cuda_checks(mem: Any) -> list[tuple[str, Callable[[], str]]]:
    cu = mem._cu

    def alloc_ids() -> str:
        a = mem.alloc(ALLOC)
        ida = mem.buffer_id(a)
        r = mem.range_of(a + 4096)
        mem.free(a)
        b = mem.alloc(ALLOC)
        idb = mem.buffer_id(b)
        mem.free(b)
        assert (r.base, r.size) == (a, ALLOC), f"range_of gives {r.base:#x}+{r.size:#x}"
        assert ida != idb and ida and idb, f"buffer ids {ida} and {idb}: a new allocation kept its id"
        return f"2 MiB allocations; range found; buffer ids {ida} -> {idb}" + (" (same address)" if a == b else "")

    def copies() -> str:
        a = mem.alloc(ALLOC)
        try:
            data = pattern(ALLOC, 3)
            mem.write(a, data)
            assert mem.read(a, ALLOC) == data, "what was written is not what is read back"
        finally:
            mem.free(a)
        return "2 MiB written and read back equal"

    def sync_memops() -> str:
        a = mem.alloc(ALLOC)
        try:
            mem.enable_sync_memops(a)
            err, value = cu.cuPointerGetAttribute(mem._sync_attr, a)
            assert err == mem._ok, f"cuPointerGetAttribute(SYNC_MEMOPS) failed: {getattr(err, 'name', err)}"
            assert int(value) == 1, f"SYNC_MEMOPS reads back {value} after it was set"
        finally:
            mem.free(a)
        return "set on a cuMemAlloc allocation and read back as 1"

    def dmabuf() -> str:
        a = mem.alloc(ALLOC)
        try:
            try:
                fd = mem.export_dmabuf(a)
            except GpupinError as exc:
                raise Skip(f"this driver does not export dma-bufs: {exc}") from None
            size = os.lseek(fd, 0, os.SEEK_END)
            os.close(fd)
        finally:
            mem.free(a)
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
    except AssertionError as exc:
        r = Result("fail", name, str(exc) or "assertion failed")
    except Exception as exc:  # a check's error is its result, not the command's
        r = Result("fail", name, f"{type(exc).__name__}: {exc}")
    r.seconds = round(time.monotonic() - t0, 3)
    return r


def modules_impossible() -> str | None:
    """Why kernel modules cannot be loaded by this process, or None."""
    if not os.path.exists("/proc/modules"):
        return "this kernel has no module support"
    if os.geteuid() != 0:
        return "loading modules needs root"
    try:
        with open("/proc/sys/kernel/modules_disabled") as f:
            if f.read().strip() == "1":
                return "module loading is disabled on this host (kernel.modules_disabled=1)"
    except OSError:
        pass
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:") and not int(line.split()[1], 16) >> CAP_SYS_MODULE & 1:
                return "this process lacks CAP_SYS_MODULE (a container, or a lent machine without module loading)"
    return None


def _sysfs(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def pci_name(pci: str) -> str:
    base = f"/sys/bus/pci/devices/{pci}"
    if not os.path.isdir(base):
        return f"{pci} (not present)"
    drv = os.path.basename(os.path.realpath(f"{base}/driver")) if os.path.exists(f"{base}/driver") else "no driver"
    ids = f"{_sysfs(base + '/vendor')[2:]}:{_sysfs(base + '/device')[2:]}"
    return f"{pci} [{ids}] class {_sysfs(base + '/class')}, {drv}"


def default_peer_pci() -> str | None:
    """A NIC if there is one, else the last PCI device (what the example peer maps for)."""
    from . import doctor

    nics = doctor.nics()
    if nics:
        return nics[0].name
    root = "/sys/bus/pci/devices"
    devs = sorted(os.listdir(root)) if os.path.isdir(root) else []
    return devs[-1] if devs else None


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
    bar1 = _nvidia_smi("--query-gpu=memory.total", "--format=csv,noheader").replace("\n", ", ")
    q = _nvidia_smi("-q", "-d", "MEMORY")
    if "BAR1" in q:
        tail = q.split("BAR1", 1)[1].split("\n")
        total = next((ln.split(":", 1)[1].strip() for ln in tail if ln.strip().startswith("Total")), "")
        bar1 = f"{total} (GPU memory {bar1})" if total else bar1
    version = _sysfs("/proc/driver/nvidia/version").split("\n")[0]
    return {
        "gpupin": __version__,
        "kernel": platform.release(),
        "GPU": gpu.replace("\n", "; ") or "none seen by nvidia-smi",
        "driver": version or "nvidia.ko not loaded",
        "BAR1": bar1 or "unknown (no nvidia-smi)",
        "IOMMU": doctor.check_iommu().detail,
        "provider": provider,
        "peer device": pci_name(pci) if pci else "none",
    }


class _NotPossible(Exception):
    pass


def _open_target(
    provider: str, pci: str | None, load: bool, cuda_mem: Any, loaded: list[str], stack: ExitStack
) -> Target:
    """Load what is missing (recorded in ``loaded``), open the Device, the memory and the peer
    (closed by ``stack``)."""
    if not os.path.exists("/dev/gpupin"):
        why = modules_impossible() if load else "gpupin is not loaded and --no-load was given"
        if why:
            raise _NotPossible(why)
    try:
        from . import kmod
    except ImportError as exc:  # a build without the libkmod bindings (_build.py --no-kmod)
        raise _NotPossible(f"gpupin was built without its libkmod bindings ({exc})") from None
    if not os.path.exists("/dev/gpupin"):
        if provider == "nvp2p_sim" and not kmod.is_loaded("nvp2p_sim"):
            kmod.load(kmod.module_file("nvp2p_sim"))
            loaded.append("nvp2p_sim")
        if provider == "nvidia" and not kmod.is_loaded("nvidia"):
            kmod.load("nvidia")  # stays loaded: CUDA uses it
        kmod.load(kmod.module_file("gpupin"))
        loaded.append("gpupin")
    device = stack.enter_context(Device())
    memory: Any
    if provider == "nvidia":
        if cuda_mem is None:
            raise _NotPossible("CUDA is not usable (see the CUDA row)")
        memory = cuda_mem
    else:
        from .sim import SimMemory

        memory = stack.enter_context(SimMemory())
    t = Target(device, memory, provider, pci)
    if not pci:
        t.peer_why = "no PCI device for the example peer: name one with --pci"
        return t
    if not kmod.is_loaded("gpupin_peer"):
        why = modules_impossible() if load else "gpupin_peer is not loaded and --no-load was given"
        if why:
            t.peer_why = f"gpupin_peer cannot be loaded: {why}"
            return t
        kmod.load(kmod.module_file("gpupin_peer"), {"pci": pci})
        loaded.append("gpupin_peer")
    mapped = kmod.parameters("gpupin_peer").get("pci", "")
    if mapped and mapped != pci:
        t.peer_why = f"gpupin_peer is loaded for {mapped}, not {pci}: unload it, or pass --pci {mapped}"
        return t
    from .peer import Peer

    t.peer = stack.enter_context(Peer())
    return t


@contextmanager
def _module_target(
    provider: str, pci: str | None, load: bool, keep: bool, cuda_mem: Any
) -> Iterator[tuple[Target | None, str, str]]:
    """(target, "", "") or (None, why not, "n/a" or "fail"): a load or open that was tried
    and failed is a failure; unloads afterwards what it loaded, unless ``keep``."""
    from .errors import DriverNotLoaded, ModuleError

    loaded: list[str] = []
    with ExitStack() as stack:
        try:
            target: Target | None = _open_target(provider, pci, load, cuda_mem, loaded, stack)
            why, status = "", ""
        except _NotPossible as exc:
            target, why, status = None, str(exc), "n/a"
        except (ModuleError, DriverNotLoaded, GpupinError, OSError) as exc:
            target, why, status = None, f"{type(exc).__name__}: {exc}", "fail"
        try:
            yield target, why, status
        finally:
            stack.close()
            for name in [] if keep else reversed(loaded):
                _unload(name)


def _unload(name: str) -> None:
    from . import kmod

    try:
        kmod.unload(name)
    except GpupinError:
        pass


@dataclass
class Outcome:
    facts: dict[str, str]
    results: list[Result] = field(default_factory=list)
    facts_seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return any(r.status == "fail" for r in self.results)

    def counts(self) -> dict[str, int]:
        n = {"pass": 0, "fail": 0, "skip": 0, "n/a": 0}
        for r in self.results:
            n[r.status] += 1
        return n

    def summary(self) -> str:
        n = self.counts()
        verdict = "FAILED" if self.failed else "passed" if n["pass"] else "ran no check"
        return (
            f"selftest {verdict}: {n['pass']} passed, {n['fail']} failed, {n['skip']} skipped, "
            f"{n['n/a']} not possible here"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "facts": self.facts,
            "checks": [asdict(r) for r in self.results],
            "passed": not self.failed,
            "facts_seconds": self.facts_seconds,
        }


def run(*, sim: bool | None = None, pci: str | None = None, load: bool = True, keep: bool = False) -> Outcome:
    """Run every check that can run here.  ``sim``: pin through the simulator (default: when
    no NVIDIA GPU is on the PCI bus); ``pci``: the device to map for (default: a NIC, else
    the last PCI device); ``load``: load the modules that are missing; ``keep``: leave them
    loaded afterwards."""
    from . import doctor

    t0 = time.monotonic()
    if sim is None:
        from .cuda import visible_gpus

        sim = not doctor.gpus() and not visible_gpus().gpus
    provider = "nvp2p_sim" if sim else "nvidia"
    pci = pci or default_peer_pci()
    out = Outcome(facts(pci, provider))
    out.facts_seconds = round(time.monotonic() - t0, 3)
    cuda_mem, cuda_why = None, ""
    if not sim:
        try:
            cuda_mem = _cuda()
        except GpupinError as exc:
            cuda_why = str(exc)
    with _module_target(provider, pci, load, keep, cuda_mem) as (target, why, status):
        if target is None:
            what = "not possible here" if status == "n/a" else "could not set up"
            out.results += [Result(status, c.name, f"{what}: {why}") for c in MODULE_CHECKS]
        else:
            for c in MODULE_CHECKS:
                out.results.append(run_check(lambda c=c: c.fn(target), c.name))  # type: ignore[misc]
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
            for name, fn in cuda_checks(cuda_mem):
                out.results.append(run_check(fn, name))
        finally:
            cuda_mem.close()
    return out
