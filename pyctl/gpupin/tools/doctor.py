"""``gpupin doctor``: what the GPUDirect RDMA, Storage and Async documents say matters, and NIXL.

Read from /proc, /sys, the modprobe configuration and cufile.json; NIXL's check
makes agents and one transfer over host memory inside this process.

Each check gives pass/warn/fail/info, what was seen, and a fix.  Nothing here
changes the system.
"""

from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ._sysfs import read_text

if TYPE_CHECKING:
    from ..nixl import NixlStatus

SYS_PCI = Path("/sys/bus/pci/devices")
ACS_CAP_ID = 0x000D
ACS_P2P_BITS = {
    0x04: "P2P request redirect",
    0x08: "P2P completion redirect",
    0x10: "upstream forwarding",
    0x20: "P2P egress control",
}


@dataclass(frozen=True)
class Check:
    status: str  # pass | warn | fail | info
    name: str
    detail: str
    fix: str = ""


def _class(dev: Path) -> int:
    try:
        return int(read_text(dev / "class"), 16)
    except ValueError:
        return 0


def gpus(root: Path = SYS_PCI) -> list[Path]:
    return sorted(d for d in root.glob("*") if read_text(d / "vendor") == "0x10de" and _class(d) >> 16 == 0x03)


def nics(root: Path = SYS_PCI) -> list[Path]:
    out = {d for d in root.glob("*") if _class(d) >> 16 == 0x02}
    for ib in glob.glob("/sys/class/infiniband/*/device"):
        out.add(Path(os.path.realpath(ib)))
    return sorted(out)


def check_iommu(cmdline: str | None = None, iommu_dir: str = "/sys/class/iommu") -> Check:
    cmdline = read_text("/proc/cmdline") if cmdline is None else cmdline
    args = cmdline.split()
    units = os.listdir(iommu_dir) if os.path.isdir(iommu_dir) else []
    if "iommu=pt" in args or "iommu.passthrough=1" in args:
        return Check("pass", "IOMMU", "pass-through (iommu=pt)")
    if not units:
        return Check("pass", "IOMMU", "no IOMMU active")
    if "intel_iommu=off" in args or "amd_iommu=off" in args:
        return Check("pass", "IOMMU", "disabled on the command line")
    return Check(
        "warn",
        "IOMMU",
        f"IOMMU translation active ({', '.join(units)})",
        "boot with iommu=pt (or intel_iommu=off / amd_iommu=off): GPUDirect RDMA peer "
        "traffic is not supported through IOMMU translation",
    )


def acs_control(config: bytes) -> int | None:
    """ACS control register from a device's config space, None if it has no ACS capability."""
    off = 0x100
    seen = 0
    while 0x100 <= off and off + 8 <= len(config) and seen < 64:
        header = int.from_bytes(config[off : off + 4], "little")
        if header == 0 or header == 0xFFFFFFFF:
            return None
        if header & 0xFFFF == ACS_CAP_ID:
            return int.from_bytes(config[off + 6 : off + 8], "little")
        off = header >> 20
        seen += 1
    return None


def check_acs(root: Path = SYS_PCI) -> Check:
    bridges = [d for d in root.glob("*") if _class(d) >> 8 == 0x0604]
    if not bridges:
        return Check("info", "ACS", "no PCIe bridges")
    flagged, unreadable = [], 0
    for b in sorted(bridges):
        try:
            config = (b / "config").read_bytes()
        except OSError:
            unreadable += 1
            continue
        if len(config) <= 256:
            unreadable += 1
            continue
        ctrl = acs_control(config)
        if ctrl:
            bits = [name for bit, name in ACS_P2P_BITS.items() if ctrl & bit]
            if bits:
                flagged.append(f"{b.name} ({', '.join(bits)})")
    if flagged:
        return Check(
            "warn",
            "ACS",
            "ACS redirects peer traffic on " + "; ".join(flagged),
            "disable ACS on the bridges between GPU and NIC (BIOS, or setpci ECAP_ACS+6.w=0)",
        )
    if unreadable:
        return Check("info", "ACS", f"{unreadable} bridge(s) unreadable: run as root to see extended config space")
    return Check("pass", "ACS", f"no P2P redirection on {len(bridges)} bridge(s)")


def pci_path(dev: Path) -> list[str]:
    """Ancestors of a PCI device from the host bridge down (sysfs names)."""
    return [p for p in Path(os.path.realpath(dev)).parts if p.startswith("pci") or ":" in p]


def topology(gpu: Path, nic: Path) -> str:
    a, b = pci_path(gpu), pci_path(nic)
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    if common == 0:
        return "across root complexes (different host bridges: possibly across sockets)"
    if common == 1:
        return "same root complex, through the host bridge"
    return f"same PCIe switch ({a[common - 1]})"


def check_topology(root: Path = SYS_PCI) -> list[Check]:
    g, n = gpus(root), nics(root)
    if not g or not n:
        return [Check("info", "PCIe path", f"{len(g)} NVIDIA GPU(s), {len(n)} NIC/RDMA device(s): nothing to pair")]
    out = []
    for gpu in g:
        for nic in n:
            where = topology(gpu, nic)
            status = "pass" if where.startswith("same PCIe switch") else "warn"
            fix = "" if status == "pass" else "place GPU and NIC under one PCIe switch for full P2P bandwidth"
            out.append(Check(status, "PCIe path", f"GPU {gpu.name} <-> NIC {nic.name}: {where}", fix))
    return out


def check_modules(modules: str = "/sys/module") -> list[Check]:
    def loaded(m: str) -> bool:
        return os.path.isdir(os.path.join(modules, m))

    out = []
    if loaded("nvidia"):
        lic = read_text(os.path.join(modules, "nvidia", "version"))
        out.append(Check("pass", "nvidia", f"loaded {lic}".strip()))
    else:
        out.append(
            Check(
                "info",
                "nvidia",
                "not loaded (no NVIDIA GPU driver): gpupin needs nvp2p_sim here",
                "load the open kernel modules for real GPUs, or 'gpupin load --sim'",
            )
        )
    if loaded("nvidia_peermem"):
        out.append(Check("pass", "nvidia-peermem", "loaded"))
    else:
        out.append(Check("info", "nvidia-peermem", "not loaded (only RDMA verbs users need it)"))
    if loaded("nv_peer_mem") and loaded("nvidia_peermem"):
        out.append(
            Check(
                "fail",
                "nv_peer_mem",
                "both nv_peer_mem and nvidia_peermem are loaded",
                "unload the legacy nv_peer_mem: the two conflict",
            )
        )
    elif loaded("nv_peer_mem"):
        out.append(
            Check(
                "warn",
                "nv_peer_mem",
                "the legacy nv_peer_mem is loaded",
                "replace it with nvidia-peermem (shipped with the driver)",
            )
        )
    for m, fix in (("gpupin", "gpupin load"), ("nvp2p_sim", "gpupin load --sim (hosts without a GPU)")):
        if loaded(m):
            out.append(Check("pass", m, "loaded"))
        else:
            out.append(Check("info" if m == "nvp2p_sim" else "warn", m, "not loaded", fix))
    neighbours = check_nv_p2p_neighbours(modules)
    if neighbours is not None:
        out.append(neighbours)
    return out


# Modules that may pin GPU memory for a process through nv-p2p's non-persistent API too.
NV_P2P_NEIGHBOURS = {
    "nvidia_peermem": "RDMA verbs registrations of GPU memory",
    "nvidia_fs": "GPUDirect Storage",
    "gdrdrv": "GDRCopy",
}


def check_nv_p2p_neighbours(modules: str = "/sys/module") -> Check | None:
    """NVIDIA finds a non-persistent put's mapping by the page table's address among the
    process's, and frees a table right after its free callback: a gpupin unpin waiting for
    NVIDIA's lock while a cuMemFree runs can release the pin another module made for the
    same process at that reused address (and theirs ours).  gpupin orders its own gets and
    puts, not theirs; persistent pins have no such put.  None when no such module is loaded."""
    present = [m for m in NV_P2P_NEIGHBOURS if os.path.isdir(os.path.join(modules, m))]
    if not present:
        return None
    who = ", ".join(f"{m} ({NV_P2P_NEIGHBOURS[m]})" for m in present)
    param = read_text(os.path.join(modules, "gpupin", "parameters", "default_persistent"))
    if param == "Y":
        return Check("pass", "nv-p2p neighbours", f"{who} loaded; gpupin pins persistently (default_persistent=Y)")
    return Check(
        "warn",
        "nv-p2p neighbours",
        f"{who} loaded: in a process that also pins GPU memory through them, a gpupin unpin racing a "
        "cuMemFree can release their pin (and theirs gpupin's): NVIDIA finds non-persistent pins by "
        "their table's address, which it reuses at once",
        "pin persistently in such processes: 'echo Y > /sys/module/gpupin/parameters/default_persistent' "
        "(or modprobe gpupin default_persistent=1), or Device.pin(..., persistent=True)",
    )


def check_bar1() -> list[Check]:
    """BAR1 use of each GPU, read through NVIDIA's NVML bindings (nvidia-ml-py, an optional
    extra imported only here)."""
    try:
        import pynvml
    except ImportError:
        return [
            Check(
                "info",
                "BAR1",
                "nvidia-ml-py (NVIDIA's NVML bindings) is not installed: BAR1 usage not read",
                "pip install 'gpupin[nvml]' (the cuda extra includes it)",
            )
        ]
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        if exc.value == pynvml.NVML_ERROR_LIBRARY_NOT_FOUND:
            return [Check("info", "BAR1", "NVML not present: cannot read BAR1 usage")]
        return [Check("warn", "BAR1", f"NVML present but nvmlInit failed ({exc})", "is the nvidia driver loaded?")]
    out = []
    try:
        try:
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError:
            count = 0
        for i in range(count):
            try:
                bar = pynvml.nvmlDeviceGetBAR1MemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i))
            except pynvml.NVMLError:
                out.append(Check("warn", "BAR1", f"GPU {i}: BAR1 info unavailable"))
                continue
            total, used = int(bar.bar1Total), int(bar.bar1Used)
            pct = 100 * used / total if total else 0
            status = "warn" if pct > 90 else "pass"
            out.append(
                Check(
                    status,
                    "BAR1",
                    f"GPU {i}: {used >> 20} MiB used of {total >> 20} MiB",
                    "unpin unused regions (BAR1 space limits how much can be pinned)" if pct > 90 else "",
                )
            )
    finally:
        pynvml.nvmlShutdown()
    return out


# -- GPUDirect Storage and GPUDirect Async -------------------------------------
def check_nvidia_fs(modules: str = "/sys/module") -> Check:
    if os.path.isdir(os.path.join(modules, "nvidia_fs")):
        ver = read_text(os.path.join(modules, "nvidia_fs", "version"))
        return Check("pass", "GDS nvidia-fs", f"loaded {ver}".strip() + ": cuFile can DMA between storage and GPU")
    return Check(
        "info",
        "GDS nvidia-fs",
        "not loaded: cuFile runs in compatibility mode (POSIX reads through "
        "host bounce buffers); buffer registration still works and still costs",
        "install NVIDIA's nvidia-fs (the nvidia-gds package) for the direct path, or use "
        "use_pci_p2pdma with a P2PDMA kernel",
    )


def strip_json_comments(text: str) -> str:
    """cufile.json allows // comments; drop them (outside strings) so json can read it."""
    out = []
    for line in text.splitlines():
        in_str = False
        for i, ch in enumerate(line):
            if ch == '"' and (i == 0 or line[i - 1] != "\\"):
                in_str = not in_str
            elif ch == "/" and not in_str and line[i : i + 2] == "//":
                line = line[:i]
                break
        out.append(line)
    return re.sub(r",(\s*[}\]])", r"\1", "\n".join(out))


def check_cufile_json(path: str | None = None) -> list[Check]:
    path = path or os.environ.get("CUFILE_ENV_PATH_JSON") or "/etc/cufile.json"
    if not os.path.exists(path):
        return [
            Check(
                "info",
                "cufile.json",
                f"{path} not found: cuFile uses its built-in defaults",
                "copy the cufile.json from NVIDIA's GDS package to /etc, or set CUFILE_ENV_PATH_JSON",
            )
        ]
    try:
        cfg = json.loads(strip_json_comments(Path(path).read_text()))
    except (OSError, ValueError) as exc:
        return [
            Check(
                "fail",
                "cufile.json",
                f"{path} cannot be read: {exc}",
                "fix the file: cuFile refuses to start with a broken configuration",
            )
        ]
    props = cfg.get("properties", {})
    keys = (
        "allow_compat_mode",
        "max_device_pinned_mem_size_kb",
        "per_buffer_cache_size_kb",
        "use_pci_p2pdma",
        "max_direct_io_size_kb",
    )
    seen = ", ".join(f"{k}={props[k]}" for k in keys if k in props)
    out = [Check("pass", "cufile.json", f"{path}: {seen or 'no properties set'}")]
    if props.get("allow_compat_mode") is False and not os.path.isdir("/sys/module/nvidia_fs"):
        out.append(
            Check(
                "fail",
                "cufile.json",
                "allow_compat_mode is false and nvidia-fs is not loaded: every cuFile IO will fail",
                "load nvidia-fs, or set allow_compat_mode to true",
            )
        )
    return out


def kernel_config(option: str, release: str | None = None) -> str | None:
    """The value of a kernel config option from /boot/config-<release>, None if unknown."""
    release = release or os.uname().release
    text = read_text(f"/boot/config-{release}")
    if not text:
        return None
    m = re.search(rf"^{option}=(\S+)", text, re.M)
    return m.group(1) if m else "n"


def check_p2pdma(config: str | None = None) -> Check:
    value = kernel_config("CONFIG_PCI_P2PDMA") if config is None else config
    if value is None:
        return Check("info", "P2PDMA", "kernel configuration not readable (/boot/config-*)")
    if value == "y":
        return Check(
            "pass",
            "P2PDMA",
            "CONFIG_PCI_P2PDMA=y: cuFile's use_pci_p2pdma (no nvidia-fs) is possible "
            "with NVIDIA's open modules (R570+) and an NVMe driver that supports it",
        )
    return Check("info", "P2PDMA", "CONFIG_PCI_P2PDMA is not set: GDS needs nvidia-fs on this kernel")


def nvreg_params(
    params: str = "/proc/driver/nvidia/params", modprobe_dir: str = "/etc/modprobe.d"
) -> tuple[dict[str, str], str]:
    """NVreg_* settings from the loaded driver (params), else from the modprobe configuration."""
    text = read_text(params)
    if text:
        out = {}
        for line in text.splitlines():
            k, _, v = line.partition(":")
            out[k.strip()] = v.strip().strip('"')
        return out, params
    out = {}
    for conf in sorted(glob.glob(os.path.join(modprobe_dir, "*.conf"))):
        for line in read_text(conf).splitlines():
            words = line.split()
            if len(words) >= 3 and words[0] == "options" and words[1] in ("nvidia", "nvidia-current"):
                for w in words[2:]:
                    k, _, v = w.partition("=")
                    if k.startswith("NVreg_"):
                        out[k[len("NVreg_") :]] = v.strip('"')
    return out, modprobe_dir if out else ""


def check_nvreg(params: str = "/proc/driver/nvidia/params", modprobe_dir: str = "/etc/modprobe.d") -> list[Check]:
    vals, where = nvreg_params(params, modprobe_dir)
    if not where:
        return [Check("info", "NVreg", "no NVIDIA driver parameters found (driver not loaded, no modprobe options)")]
    dwords = vals.get("RegistryDwords", "")
    peer = re.search(r"PeerMappingOverride\s*=\s*(\w+)", dwords)
    peer_on = bool(peer and peer.group(1) not in ("0", "0x0"))
    memops = vals.get("EnableStreamMemOPs")
    return [
        Check("pass", "PeerMappingOverride", f"RegistryDwords={dwords!r} ({where})")
        if peer_on
        else Check(
            "info",
            "PeerMappingOverride",
            f"not set ({where}): GPUDirect Async from a NIC (e.g. NVSHMEM's "
            "IBGDA) cannot map GPU memory for the NIC's doorbells",
            'options nvidia NVreg_RegistryDwords="PeerMappingOverride=1;" in /etc/modprobe.d, then reload the driver',
        ),
        Check("pass", "EnableStreamMemOPs", f"1 ({where})")
        if memops == "1"
        else Check(
            "info",
            "EnableStreamMemOPs",
            f"{memops or 'not set'} ({where}); recent drivers enable stream "
            "memory operations anyway: the device attribute below says",
            "options nvidia NVreg_EnableStreamMemOPs=1 (GPUDirect Async: cuStreamWaitValue/WriteValue on "
            "older drivers)",
        ),
    ]


def check_stream_memops() -> list[Check]:
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        return [Check("info", "stream memops", "cuda-python not installed: device attribute not read")]
    try:
        usable = cu.cuInit(0)[0] == cu.CUresult.CUDA_SUCCESS
    except RuntimeError:  # libcuda.so missing
        usable = False
    if not usable:
        return [Check("info", "stream memops", "the CUDA driver is not usable here")]
    A = cu.CUdevice_attribute
    names = [
        n
        for n in (
            "CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS",
            "CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1",
            "CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS",
        )
        if hasattr(A, n)
    ]
    out = []
    count = cu.cuDeviceGetCount()[1]
    for i in range(count):
        err, dev = cu.cuDeviceGet(i)
        vals = {n.removeprefix("CU_DEVICE_ATTRIBUTE_"): cu.cuDeviceGetAttribute(getattr(A, n), dev)[1] for n in names}
        ok = any(v == 1 for k, v in vals.items() if not k.endswith("_V1")) or vals.get("CAN_USE_STREAM_MEM_OPS_V1") == 1
        out.append(
            Check(
                "pass" if ok else "warn",
                "stream memops",
                f"GPU {i}: " + ", ".join(f"{k}={v}" for k, v in vals.items()),
                "" if ok else "set NVreg_EnableStreamMemOPs=1 and reload the driver",
            )
        )
    return out


# File systems cuFile reads through their own GDS support, without a local block device.
NETWORK_FS = {"nfs", "nfs4", "lustre", "gpfs", "wekafs", "beegfs", "cifs", "smb3"}


def fs_type(path: str, mountinfo: str = "/proc/self/mountinfo") -> str:
    """The type of the file system holding ``path`` (longest mount point that prefixes it)."""
    path = os.path.realpath(path)
    best, kind = "", ""
    for line in read_text(mountinfo).splitlines():
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) < 5 or not right:
            continue
        mnt = fields[4].replace("\\040", " ")
        if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
            best, kind = mnt, right.split()[0]
    return kind


def check_udev_for_gds(
    path: str = ".", udev_dir: str = "/run/udev/data", mountinfo: str = "/proc/self/mountinfo"
) -> Check:
    """Whether cuFile can register files under ``path``: it reads udev's ID_FS_USAGE of the block device."""
    st = os.stat(path)
    maj, mnr = os.major(st.st_dev), os.minor(st.st_dev)
    where = os.path.abspath(path)
    kind = fs_type(path, mountinfo)
    if kind in NETWORK_FS:
        return Check("info", "GDS files", f"{where} is on {kind}: cuFile uses that file system's own GDS support")
    if maj == 0:
        return Check(
            "info",
            "GDS files",
            f"{where} is on {kind or 'a virtual file system'} (dev 0:{mnr}): cuFile cannot register files there",
            "keep GDS data on a block-device or GDS-enabled network file system",
        )
    entry = os.path.join(udev_dir, f"b{maj}:{mnr}")
    if "E:ID_FS_USAGE=" in read_text(entry):
        return Check("pass", "GDS files", f"udev knows block device {maj}:{mnr} of {where} ({entry})")
    return Check(
        "warn",
        "GDS files",
        f"udev has no ID_FS_USAGE for block device {maj}:{mnr} of {where} ({entry} missing): "
        "cuFileHandleRegister refuses every file there (HANDLE_NOT_REGISTERED, 5027)",
        "run udevd (in a container: bind-mount the host's /run/udev); measured on a lent machine: with "
        "that entry present, registration and reads work",
    )


def check_gds(path: str = ".") -> list[Check]:
    files = check_udev_for_gds(path)
    if files.status == "warn" and not os.path.isdir("/sys/module/nvidia"):
        files = Check("info", files.name, files.detail, files.fix)  # no GPU here: not a problem yet
    return [check_nvidia_fs(), *check_cufile_json(), check_p2pdma(), files]


def check_async() -> list[Check]:
    return [*check_nvreg(), *check_stream_memops()]


# -- NIXL (gpupin.nixl's optional engine) ---------------------------------------
def check_nixl(status: NixlStatus | None = None) -> list[Check]:
    """NIXL installed, its UCX backend, VRAM, and one DRAM transfer through gpupin.nixl.

    ``status``: a :class:`gpupin.nixl.NixlStatus` already probed (``gpupin nixl status``
    passes its own), else :func:`gpupin.nixl.probe` runs (under a second).
    """
    if status is None:
        from ..nixl import probe

        status = probe()
    from ..nixl import INSTALL

    if not status.installed:
        detail = status.error.partition(f": {INSTALL}")[0]  # the command goes in the fix
        return [Check("warn", "NIXL", detail, f"{INSTALL} (optional: only gpupin.nixl needs it)")]
    where = f"{status.module} {status.version or '(version unknown)'} in {status.location}"
    if status.error:
        return [
            Check("fail", "NIXL", f"{where}: {status.error}", "reinstall NIXL: " + INSTALL),
        ]
    others = [p for p in status.plugins if p.name != "UCX"]
    out = [Check("pass", "NIXL", f"{where}; {len(status.plugins)} backend plugins")]
    ucx = status.plugin("UCX")
    if ucx is None or not ucx.loads:
        why = ucx.error if ucx else "NIXL found no UCX plugin"
        return [
            *out,
            Check(
                "fail",
                "NIXL UCX",
                f"the UCX backend does not load: {why}",
                "gpupin.nixl transfers through UCX: reinstall NIXL (its wheel carries UCX: " + INSTALL + "); "
                "'gpupin nixl status --log' shows what NIXL said",
            ),
        ]
    out.append(Check("pass", "NIXL UCX", "the UCX backend loads (" + ", ".join(ucx.mem_types) + ")"))
    if status.vram:
        out.append(Check("pass", "NIXL VRAM", f"usable: {status.vram_detail}"))
    else:
        if "VRAM_SEG" not in ucx.mem_types:
            fix = "install a NIXL built with CUDA (nixl-cu13 is)"
        elif "cuda-python" in status.vram_detail:
            fix = "pip install 'gpupin[cuda]' (gpupin's CudaMemory, the VRAM memory of gpupin.nixl)"
        else:
            fix = "VRAM transfers need an NVIDIA GPU and its driver; DRAM ones work without"
        out.append(Check("warn", "NIXL VRAM", f"not usable: {status.vram_detail}", fix))
    if status.selftest is True:
        out.append(Check("pass", "NIXL self-test", status.selftest_detail))
    elif status.selftest is False:
        out.append(
            Check(
                "fail",
                "NIXL self-test",
                f"one DRAM write through gpupin.nixl failed: {status.selftest_detail}",
                "'gpupin nixl status --log' shows what NIXL and UCX said; tests/host/test_nixl.py runs more",
            )
        )
    loading = [p.name for p in others if p.loads]
    out.append(
        Check(
            "info",
            "NIXL backends",
            f"others that load: {', '.join(loading) or 'none'}; "
            f"{len(others) - len(loading)} do not ('gpupin nixl status' says why)",
        )
    )
    return out


def check_budget(params: Path = Path("/sys/module/gpupin/parameters")) -> list[Check]:
    """The limits on what may be pinned, and what the caller's cgroup has charged."""
    from ._budget import summary

    return [Check("info", "budget", line.strip()) for line in summary(params)]


def run_all(*, quick: bool = False) -> list[Check]:
    """Every check; ``quick``: NIXL's left out (importing it and its one-transfer selftest take
    about a second on a workstation, much longer in an emulated VM)."""
    nixl = [Check("info", "NIXL", "not checked (--quick)", "")] if quick else check_nixl()
    return [
        check_iommu(),
        check_acs(),
        *check_topology(),
        *check_modules(),
        *check_bar1(),
        *check_budget(),
        *check_gds(),
        *check_async(),
        *nixl,
    ]
