"""Which budgets limit what a process may pin, read where the kernel shows them:
gpupin.ko's parameters (``max_pinned_bytes``, ``max_file_pinned_bytes``, ``dmem``) and,
where gpupin charges the dmem cgroup controller (Linux 6.14 on, CONFIG_CGROUP_DMEM), the
caller's cgroup's ``dmem.current``/``dmem.max`` for gpupin's regions (``gpupin/<pci
device>/bar1``) and the root's ``dmem.capacity``.  For `gpupin doctor`, `selftest`, `top`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ._sysfs import read_text


def human(n: int) -> str:
    """Bytes in binary units: 512 B, 64.0 KiB, 1.5 GiB."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:.1f} {unit}"


@dataclass(frozen=True)
class Region:
    """One of gpupin's dmem regions: its capacity and, for the caller's cgroup, what is
    charged (``current``) and its limit (``limit``, None for "max": none)."""

    name: str
    capacity: int
    current: int | None
    limit: int | None


@dataclass(frozen=True)
class Budgets:
    global_max: int  # max_pinned_bytes, 0 = unlimited (ENOSPC)
    file_max: int  # max_file_pinned_bytes, 0 = unlimited (EDQUOT)
    dmem: bool  # gpupin.ko charges the dmem controller
    cgroup: str | None  # the caller's cgroup v2 path, None outside cgroup v2
    regions: tuple[Region, ...]

    def describe(self) -> list[str]:
        """One line per limit, for people."""
        out = [
            f"module-wide: {human(self.global_max)} (max_pinned_bytes; ENOSPC past it)"
            if self.global_max
            else "module-wide: no limit (max_pinned_bytes=0)"
        ]
        share = (
            f"{human(self.file_max)} per open file (max_file_pinned_bytes; EDQUOT)"
            if self.file_max
            else "no per-file limit (max_file_pinned_bytes=0)"
        )
        if not self.dmem:
            out.append(f"per process: no dmem controller here (6.14+ with CONFIG_CGROUP_DMEM has one); {share}")
            return out
        where = f"cgroup {self.cgroup}" if self.cgroup else "no cgroup v2"
        out.append(f"per process: the dmem cgroup controller ({where}; EDQUOT past dmem.max)")
        for r in self.regions:
            limit = "max" if r.limit is None else human(r.limit)
            current = "-" if r.current is None else human(r.current)
            out.append(f"  {r.name}: capacity {human(r.capacity)}, charged here {current}, dmem.max {limit}")
        if not self.regions:
            out.append("  no gpupin region yet (a GPU's appears at load, another BAR's at its first pin)")
        out.append(f"per file: {share}")
        return out


def _int(path: Path) -> int:
    """A numeric parameter; 0 (unlimited) where it cannot be read."""
    text = read_text(path)
    return int(text) if text.isdigit() else 0


def _table(path: Path) -> dict[str, str]:
    """A dmem interface file: "region value" per line ({} where it cannot be read)."""
    return dict(line.split(None, 1) for line in read_text(path).splitlines() if " " in line)


def own_cgroup(proc: Path = Path("/proc/self/cgroup")) -> str | None:
    """The cgroup v2 path ("0::PATH") of the caller, or None."""
    for line in read_text(proc).splitlines():
        if line.startswith("0::"):
            return line[3:].strip() or "/"
    return None


def read_budgets(
    params: Path = Path("/sys/module/gpupin/parameters"),
    cgroot: Path = Path("/sys/fs/cgroup"),
    proc: Path = Path("/proc/self/cgroup"),
) -> Budgets:
    dmem = read_text(params / "dmem") == "Y"
    cg = own_cgroup(proc)
    regions: list[Region] = []
    if dmem:
        # The root cgroup has no dmem.current or dmem.max: nothing charged "here" there.
        here = cgroot / cg.lstrip("/") if cg and cg != "/" else None
        current = _table(here / "dmem.current") if here else {}
        limits = _table(here / "dmem.max") if here else {}
        for name, cap in sorted(_table(cgroot / "dmem.capacity").items()):
            if not name.startswith("gpupin/"):
                continue
            lim = limits.get(name, "max").strip()
            cur = current.get(name)
            regions.append(
                Region(name, int(cap), None if cur is None else int(cur), None if lim == "max" else int(lim))
            )
    return Budgets(_int(params / "max_pinned_bytes"), _int(params / "max_file_pinned_bytes"), dmem, cg, tuple(regions))


def summary(params: Path = Path("/sys/module/gpupin/parameters")) -> list[str]:
    """describe() of the budgets in force, or why there are none to read."""
    if not params.is_dir():
        return ["gpupin.ko is not loaded: its limits are its parameters once it is"]
    return read_budgets(params).describe()
