"""``gpupin doctor``: what the GPUDirect RDMA documents say matters, read from /proc and /sys.

Each check gives pass/warn/fail/info, what was seen, and a fix.  Nothing here
changes the system.
"""

from __future__ import annotations

import ctypes
import glob
import os
from dataclasses import dataclass
from pathlib import Path

SYS_PCI = Path("/sys/bus/pci/devices")
ACS_CAP_ID = 0x000D
ACS_P2P_BITS = {0x04: "P2P request redirect", 0x08: "P2P completion redirect", 0x10: "upstream forwarding",
                0x20: "P2P egress control"}


@dataclass(frozen=True)
class Check:
    status: str   # pass | warn | fail | info
    name: str
    detail: str
    fix: str = ""


def _read(path: str | Path) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def _class(dev: Path) -> int:
    try:
        return int(_read(dev / "class"), 16)
    except ValueError:
        return 0


def gpus(root: Path = SYS_PCI) -> list[Path]:
    return sorted(d for d in root.glob("*") if _read(d / "vendor") == "0x10de" and _class(d) >> 16 == 0x03)


def nics(root: Path = SYS_PCI) -> list[Path]:
    out = {d for d in root.glob("*") if _class(d) >> 16 == 0x02}
    for ib in glob.glob("/sys/class/infiniband/*/device"):
        out.add(Path(os.path.realpath(ib)))
    return sorted(out)


def check_iommu(cmdline: str | None = None, iommu_dir: str = "/sys/class/iommu") -> Check:
    cmdline = _read("/proc/cmdline") if cmdline is None else cmdline
    args = cmdline.split()
    units = os.listdir(iommu_dir) if os.path.isdir(iommu_dir) else []
    if "iommu=pt" in args or "iommu.passthrough=1" in args:
        return Check("pass", "IOMMU", "pass-through (iommu=pt)")
    if not units:
        return Check("pass", "IOMMU", "no IOMMU active")
    if "intel_iommu=off" in args or "amd_iommu=off" in args:
        return Check("pass", "IOMMU", "disabled on the command line")
    return Check("warn", "IOMMU", f"IOMMU translation active ({', '.join(units)})",
                 "boot with iommu=pt (or intel_iommu=off / amd_iommu=off): GPUDirect RDMA peer "
                 "traffic is not supported through IOMMU translation")


def acs_control(config: bytes) -> int | None:
    """ACS control register from a device's config space, None if it has no ACS capability."""
    off = 0x100
    seen = 0
    while 0x100 <= off and off + 8 <= len(config) and seen < 64:
        header = int.from_bytes(config[off:off + 4], "little")
        if header == 0 or header == 0xFFFFFFFF:
            return None
        if header & 0xFFFF == ACS_CAP_ID:
            return int.from_bytes(config[off + 6:off + 8], "little")
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
        return Check("warn", "ACS", "ACS redirects peer traffic on " + "; ".join(flagged),
                     "disable ACS on the bridges between GPU and NIC (BIOS, or setpci ECAP_ACS+6.w=0)")
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
        lic = _read(os.path.join(modules, "nvidia", "version"))
        out.append(Check("pass", "nvidia", f"loaded {lic}".strip()))
    else:
        out.append(Check("info", "nvidia", "not loaded (no NVIDIA GPU driver): gpupin needs nvp2p_sim here",
                         "load the open kernel modules for real GPUs, or 'gpupin load --sim'"))
    if loaded("nvidia_peermem"):
        out.append(Check("pass", "nvidia-peermem", "loaded"))
    else:
        out.append(Check("info", "nvidia-peermem", "not loaded (only RDMA verbs users need it)"))
    if loaded("nv_peer_mem") and loaded("nvidia_peermem"):
        out.append(Check("fail", "nv_peer_mem", "both nv_peer_mem and nvidia_peermem are loaded",
                         "unload the legacy nv_peer_mem: the two conflict"))
    elif loaded("nv_peer_mem"):
        out.append(Check("warn", "nv_peer_mem", "the legacy nv_peer_mem is loaded",
                         "replace it with nvidia-peermem (shipped with the driver)"))
    for m, fix in (("gpupin", "gpupin load"), ("nvp2p_sim", "gpupin load --sim (hosts without a GPU)")):
        if loaded(m):
            out.append(Check("pass", m, "loaded"))
        else:
            out.append(Check("info" if m == "nvp2p_sim" else "warn", m, "not loaded", fix))
    return out


class _Bar1(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def check_bar1() -> list[Check]:
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return [Check("info", "BAR1", "NVML not present: cannot read BAR1 usage")]
    if nvml.nvmlInit_v2() != 0:
        return [Check("warn", "BAR1", "NVML present but nvmlInit failed", "is the nvidia driver loaded?")]
    out = []
    try:
        count = ctypes.c_uint()
        nvml.nvmlDeviceGetCount_v2(ctypes.byref(count))
        for i in range(count.value):
            h = ctypes.c_void_p()
            bar = _Bar1()
            if nvml.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(h)) or \
                    nvml.nvmlDeviceGetBAR1MemoryInfo(h, ctypes.byref(bar)):
                out.append(Check("warn", "BAR1", f"GPU {i}: BAR1 info unavailable"))
                continue
            pct = 100 * bar.used / bar.total if bar.total else 0
            status = "warn" if pct > 90 else "pass"
            out.append(Check(status, "BAR1", f"GPU {i}: {bar.used >> 20} MiB used of {bar.total >> 20} MiB",
                             "unpin unused regions (BAR1 space limits how much can be pinned)" if pct > 90 else ""))
    finally:
        nvml.nvmlShutdown()
    return out


def run_all() -> list[Check]:
    return [check_iommu(), check_acs(), *check_topology(), *check_modules(), *check_bar1()]
