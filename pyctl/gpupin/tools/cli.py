"""The ``gpupin`` command and its debugging shell.

Every subcommand works once from the command line (``gpupin query 3``) and
inside ``gpupin shell``, where the open device, simulator context, pins and
mappings persist between commands.  Every subcommand takes ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, is_dataclass
from typing import Any

from ..device import Device, DmaMapping, Pin, PinState
from ..errors import EventsLost, GpupinError, InvalidArgument, ModuleError
from ..sim import SimMemory, set_sim_param, sim_stats
from . import doctor as doctor_mod
from .report import Report, format_facts, format_rows

Result = Any


class UsageError(GpupinError):
    """Bad command-line arguments."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # never exit: the shell keeps going
        raise UsageError(f"{self.prog}: {message}")

    def exit(self, status: int = 0, message: str | None = None) -> Any:
        if message:
            print(message, file=sys.stderr, end="")
        raise HelpShown(status)


class HelpShown(Exception):
    """What the parser raises instead of exiting (``--help`` printed, or argparse's own exit):
    ``status`` is the exit status.  ``run_command`` returns it; the entry point (tools/main.py),
    which parses ``gpupin shell``'s arguments itself, catches it there."""

    def __init__(self, status: int) -> None:
        self.status = status


def parse_size(text: str) -> int:
    """'4096', '64K', '1M', '2G', '0x10000' -> bytes."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = 1
    for suffix, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        if t.endswith(suffix):
            t, mult = t[:-1], m
            break
    try:
        value = int(t, 0) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 4096, 64K, 1M, 0x10000)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: size must not be negative")
    return value


def parse_int(text: str) -> int:
    try:
        return int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


class Session:
    """What a shell keeps between commands: device, simulator context, pins, mappings."""

    def __init__(self) -> None:
        self._device: Device | None = None
        self._sim: SimMemory | None = None
        self.pins: dict[int, Pin] = {}
        self.maps: dict[tuple[int, int], DmaMapping] = {}
        self.allocs: dict[int, int] = {}
        self.vars: dict[str, str] = {}  # $va, $handle, $mapping: the last of each, for scripts
        self.watcher: threading.Thread | None = None
        self.stop_watch = threading.Event()
        self.out: Callable[[str], None] = print

    @property
    def device(self) -> Device:
        if self._device is None or self._device.closed:
            self._device = Device()
        return self._device

    @property
    def sim(self) -> SimMemory:
        if self._sim is None:
            self._sim = SimMemory()
        return self._sim

    def close(self) -> None:
        self.stop_watch.set()
        if self.watcher is not None:
            self.watcher.join()
            self.watcher = None
        if self._device is not None:
            self._device.close()
        if self._sim is not None:
            self._sim.close()
        self._device = self._sim = None
        self.pins.clear()
        self.maps.clear()
        self.allocs.clear()

    def pin_of(self, handle: int) -> Pin:
        pin = self.pins.get(handle)
        if pin is None:
            raise InvalidArgument(f"no pin with handle {handle} in this session (see 'ls')")
        return pin


# -- commands ----------------------------------------------------------------
def cmd_status(s: Session, a: argparse.Namespace) -> Result:
    from .. import kmod

    out: dict[str, Any] = {}
    for m in ("gpupin", "gpupin_cb", "nvp2p_sim", "nvidia"):
        out[m] = kmod.info(m).state if os.path.isdir(f"/sys/module/{m}") else "absent"
    if os.path.exists("/dev/gpupin"):
        info = s.device.info()
        out.update(
            abi=info.abi_version,
            version=info.version,
            provider=info.provider,
            persistent=info.persistent,
            dma_map=info.dma_map,
            simulator=info.simulator,
            max_pins_per_file=info.max_pins_per_file,
            pins_here=info.file_pins,
            pinned_bytes=info.pinned_bytes,
            max_pinned_bytes=info.max_pinned_bytes or "unlimited",
        )
    else:
        out["device"] = "/dev/gpupin missing: run 'gpupin load' (add --sim without a GPU)"
    return out


def cmd_load(s: Session, a: argparse.Namespace) -> Result:
    from .. import kmod

    params: dict[str, str] = {}
    sim_params: dict[str, str] = {}
    for p in a.params:
        key, sep, value = p.partition("=")
        if not sep or not key:
            raise UsageError(f"parameter {p!r} is not name=value")
        if key.startswith("sim."):
            sim_params[key[4:]] = value
        else:
            params[key] = value
    use_sim = a.sim or not os.path.isdir("/sys/module/nvidia")
    loaded = []
    if use_sim and not kmod.is_loaded("nvp2p_sim"):
        kmod.load(kmod.module_file("nvp2p_sim"), sim_params)
        loaded.append("nvp2p_sim")
    elif sim_params:
        for k, v in sim_params.items():
            set_sim_param(k, v)
    if not kmod.is_loaded("gpupin"):
        cb = kmod.is_loaded("gpupin_cb")
        kmod.load(kmod.module_file("gpupin"), params)  # gpupin_cb first (it stays loaded)
        loaded += ["gpupin"] if cb else ["gpupin_cb", "gpupin"]
    if a.peer and not kmod.is_loaded("gpupin_peer"):
        kmod.load(kmod.module_file("gpupin_peer"), {})
        loaded.append("gpupin_peer")
    return {"loaded": loaded, "provider": "nvp2p_sim" if use_sim else "nvidia"}


def cmd_unload(s: Session, a: argparse.Namespace) -> Result:
    from .. import kmod

    s.close()
    done = []
    for m in ("gpupin_peer", "gpupin", "nvp2p_sim"):
        if kmod.is_loaded(m):
            kmod.unload(m)
            done.append(m)
    if not done:
        raise ModuleError("neither gpupin nor nvp2p_sim is loaded")
    return {"unloaded": done}


def _pin_row(p: Pin) -> dict[str, Any]:
    return {
        "handle": p.handle,
        "va": hex(p.va),
        "size": p.size,
        "aligned_va": hex(p.aligned_va),
        "aligned_size": p.aligned_size,
        "entries": p.entries,
        "valid": p.is_valid(),
        "persistent": p.persistent,
        "dmabuf": p.dmabuf,
        "tag": p.user_tag,
    }


def cmd_pin(s: Session, a: argparse.Namespace) -> Result:
    va = a.va
    if a.sim_alloc:
        va = s.sim.alloc(a.sim_alloc)
        s.allocs[va] = a.sim_alloc
        s.vars["va"] = hex(va)
    if va is None:
        raise UsageError("pin: give VA and SIZE, or --sim-alloc SIZE")
    size = a.size if a.size is not None else (a.sim_alloc or 0)
    if a.dmabuf:
        # Through the dma-buf path: export the simulated allocation, import the range.
        base = s.sim.range_of(va).base
        fd = s.sim.export_dmabuf(va)
        try:
            p = s.device.pin_dmabuf(fd, size, offset=va - base, user_tag=a.tag)
        finally:
            os.close(fd)
    else:
        p = s.device.pin(va, size, persistent=a.persistent, user_tag=a.tag)
    s.pins[p.handle] = p
    s.vars["handle"] = str(p.handle)
    return _pin_row(p)


def cmd_unpin(s: Session, a: argparse.Namespace) -> Result:
    s.device.unpin(a.handle)
    s.pins.pop(a.handle, None)
    for key in [k for k in s.maps if k[0] == a.handle]:
        del s.maps[key]
    return {"unpinned": a.handle}


def cmd_ls(s: Session, a: argparse.Namespace) -> Result:
    if a.all:
        from .. import netlink

        return [_nl_row(p) for p in netlink.list_pins()]
    return [_pin_row(p) for p in s.pins.values()]


def _nl_row(p: Any) -> dict[str, Any]:
    return {
        "pid": p.pid,
        "file": p.file_id,
        "handle": p.handle,
        "va": hex(p.va),
        "size": p.size,
        "aligned_size": p.aligned_size,
        "state": p.state,
        "persistent": p.persistent,
        "dma": ",".join(p.dma_peers) or "-",
        "tag": p.user_tag,
    }


def _state_row(st: PinState) -> dict[str, Any]:
    """A pin's state with its addresses in hex, as ls and pin print them."""
    row = asdict(st)
    row["va"], row["aligned_va"] = hex(st.va), hex(st.aligned_va)
    return row


def cmd_query(s: Session, a: argparse.Namespace) -> Result:
    return _state_row(s.device.query(a.handle))


def cmd_pages(s: Session, a: argparse.Namespace) -> Result:
    pages = s.device.get_pages(a.handle, a.first, a.count)
    return [{"index": a.first + i, "physical_address": hex(x)} for i, x in enumerate(pages)]


def cmd_dma_map(s: Session, a: argparse.Namespace) -> Result:
    m = s.device.dma_map(a.handle, a.pci)
    s.maps[(m.handle, m.mapping_id)] = m
    s.vars["mapping"] = str(m.mapping_id)
    return asdict(m)


def cmd_dma_unmap(s: Session, a: argparse.Namespace) -> Result:
    m = s.maps.pop((a.handle, a.mapping), None) or DmaMapping(a.handle, a.mapping, 0, "")
    s.device.dma_unmap(m)
    return {"unmapped": [a.handle, a.mapping]}


def cmd_watch(s: Session, a: argparse.Namespace) -> Result:
    if a.all:
        from ..netlink import Netlink

        events: list[dict[str, Any]] = []
        deadline = None if a.timeout is None else time.monotonic() + a.timeout
        seen = 0
        with Netlink() as nl:
            nl.subscribe()
            print("watching the events of every gpupin file (Ctrl-C to stop)", file=sys.stderr, flush=True)
            while a.count is None or seen < a.count:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    for ev in nl.events(timeout=left, count=None if a.count is None else a.count - seen):
                        seen += 1
                        if a.json:
                            events.append(ev)
                        else:
                            s.out(f"{ev['event']}: {ev}")
                    break  # the time or the count ran out
                except EventsLost as exc:  # say so, and go on watching
                    if a.json:
                        events.append({"event": "lost", "error": str(exc)})
                    else:
                        s.out(f"lost: {exc}")
        return events if a.json else None
    if a.background:
        if s.watcher is not None:
            return {"watching": "already, in the background"}
        dev = s.device

        def loop() -> None:
            while not s.stop_watch.is_set():
                try:
                    events = dev.wait_invalidations(0.2)
                except (GpupinError, OSError, ValueError):
                    return  # the device was closed under us
                for ev in events:
                    s.out(f"[watch] pin {ev.handle} (tag {ev.user_tag}) invalidated: {ev.reason}")

        s.stop_watch.clear()
        s.watcher = threading.Thread(target=loop, daemon=True, name="gpupin-watch")
        s.watcher.start()
        return {"watching": "in the background"}
    evs = s.device.wait_invalidations(a.timeout)
    return [asdict(e) for e in evs]


def cmd_stats(s: Session, a: argparse.Namespace) -> Result:
    from .. import netlink

    return netlink.stats()


def cmd_top(s: Session, a: argparse.Namespace) -> Result:
    from . import top

    once = a.once or a.json  # JSON is one snapshot: the live view is for a terminal
    if not (a.interval >= 0 if once else a.interval > 0) or a.interval != a.interval or a.interval > 3600:
        raise UsageError(
            f"top: --interval {a.interval} is out of range: give seconds between "
            f"{'0 (no rates)' if once else '0.1'} and 3600"
        )
    try:
        if once:
            view = top.run_once(a.interval)
            return Report(top.view_json(view), "\n".join(top.render(view, top.width_of_terminal())))
        if not (sys.stdin.isatty() and sys.stdout.isatty()):
            raise UsageError("top: the live view needs a terminal; use --once for text, --once --json for scripts")
        top.run_live(max(a.interval, 0.1))
    except KeyboardInterrupt:  # Ctrl-C quits; curses has restored the terminal
        pass
    return None


def cmd_doctor(s: Session, a: argparse.Namespace) -> Result:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs at INFO on stdout by default
    rows = [asdict(c) for c in doctor_mod.run_all(quick=a.quick)]
    return Report(rows, format_rows(rows))


def cmd_selftest(s: Session, a: argparse.Namespace) -> Result:
    from . import selftest

    sim = True if a.sim else False if a.native else None
    out = selftest.run(sim=sim, pci=a.pci, load=not a.no_load, keep=a.keep, require_modules=a.require_modules)
    rows = [asdict(r) for r in out.results]
    text = "\n\n".join([format_facts(out.facts), format_rows(rows, detail_key="evidence"), out.summary()])
    return Report(out.as_dict(), text, 1 if out.failed else 0)


def cmd_sim(s: Session, a: argparse.Namespace) -> Result:
    sim = s.sim
    if a.op == "alloc":
        va = sim.alloc(a.size)
        s.allocs[va] = a.size
        s.vars["va"] = hex(va)
        return {"va": hex(va), "size": a.size, "buffer_id": sim.buffer_id(va)}
    if a.op == "free":
        sim.free(a.va)
        s.allocs.pop(a.va, None)
        return {"freed": hex(a.va)}
    if a.op == "write":
        data = bytes.fromhex(a.data) if a.hex else a.data.encode()
        sim.write(a.va, data)
        return {"written": len(data)}
    if a.op == "read":
        data = sim.read(a.va, a.size)
        return {"hex": data.hex(), "text": data.decode(errors="replace")}
    if a.op == "query":
        row = asdict(sim.range_of(a.va))
        row["base"] = hex(row["base"])  # in hex, as every command prints addresses
        return row
    if a.op == "stats":
        return asdict(sim_stats())
    if a.op == "set":
        set_sim_param(a.name, a.value)
        return {a.name: a.value}
    raise UsageError(f"sim: unknown operation {a.op}")


def cmd_gds(s: Session, a: argparse.Namespace) -> Result:
    from .. import gds

    if a.op == "bench":
        from . import bench

        a.gds = True
        a.cuda = a.vm = a.only_cuda = a.only_vm = False
        a.out = a.out or None
        return bench.main_args(a)
    out: dict[str, Any] = {}
    try:
        drv = gds.CuFileDriver()
    except GpupinError as exc:
        out["cufile"] = f"not usable: {exc}"
    else:
        try:
            out.update(drv.properties().as_dict())
        finally:
            drv.close()
    for c in doctor_mod.check_gds(a.path) + doctor_mod.check_async():
        out[c.name] = f"{c.status}: {c.detail}" + (f" (fix: {c.fix})" if c.fix else "")
    return out


def cmd_nixl(s: Session, a: argparse.Namespace) -> Result:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    from ..errors import DriverNotLoaded
    from ..nixl import probe

    st = probe()
    if a.log and st.log:
        print(st.log, file=sys.stderr, end="" if st.log.endswith("\n") else "\n", flush=True)
    if not st.installed:
        raise DriverNotLoaded(st.error)
    checks = doctor_mod.check_nixl(st)
    ordered = sorted(st.plugins, key=lambda p: (p.name != "UCX", p.name))
    if a.json:
        return {
            "version": st.version,
            "module": st.module,
            "location": st.location,
            "error": st.error or None,
            "plugins": {p.name: {"loads": p.loads, "mem_types": p.mem_types, "error": p.error} for p in ordered},
            "vram": {"usable": st.vram, "detail": st.vram_detail},
            "selftest": {"ok": st.selftest, "detail": st.selftest_detail},
            "checks": [asdict(c) for c in checks],
        }
    out: dict[str, Any] = {"NIXL": f"{st.version or 'version unknown'} ({st.module} in {st.location})"}
    for p in ordered:
        mem = ", ".join(p.mem_types) or "no memory types"
        out[f"backend {p.name}"] = f"loads ({mem})" if p.loads else f"does not load: {p.error}"
    for c in checks:
        if c.name != "NIXL backends" and (c.name, c.status) != ("NIXL", "pass"):  # not said above yet
            out[c.name] = f"{c.status}: {c.detail}" + (f" (fix: {c.fix})" if c.fix else "")
    return out


def cmd_bench(s: Session, a: argparse.Namespace) -> Result:
    from . import bench

    return bench.main_args(a)


def build_parser() -> _Parser:
    p = _Parser(prog="gpupin", description="Pin NVIDIA GPU memory for third-party devices.")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", parser_class=_Parser)

    def add(name: str, fn: Callable[[Session, argparse.Namespace], Result], help: str) -> _Parser:
        sp: _Parser = sub.add_parser(name, help=help, description=help)
        sp.add_argument("--json", action="store_true", help="print JSON")
        sp.set_defaults(fn=fn)
        return sp

    add("status", cmd_status, "module state, ABI, provider, capabilities and limits")
    sp = add("load", cmd_load, "load nvp2p_sim (with --sim, or when nvidia is absent) and gpupin")
    sp.add_argument("--sim", action="store_true", help="use the simulator even if nvidia is loaded")
    sp.add_argument("--peer", action="store_true", help="also load the example peer driver gpupin_peer (tests, demo)")
    sp.add_argument("params", nargs="*", help="gpupin parameters name=value; sim.name=value for the simulator")
    add("unload", cmd_unload, "unload the peer example, gpupin and the simulator")
    sp = add("pin", cmd_pin, "pin [VA, VA+SIZE) (released when this process exits)")
    sp.add_argument("va", nargs="?", type=parse_int)
    sp.add_argument("size", nargs="?", type=parse_size)
    sp.add_argument("--persistent", action="store_true")
    sp.add_argument(
        "--dmabuf",
        action="store_true",
        help="simulator: export the allocation as a dma-buf and pin by import "
        "(VA - allocation base must be page aligned)",
    )
    sp.add_argument("--tag", type=parse_int, default=0, help="user tag reported with invalidations")
    sp.add_argument("--sim-alloc", type=parse_size, metavar="SIZE", help="allocate simulated memory and pin it")
    sp = add("unpin", cmd_unpin, "unpin a handle")
    sp.add_argument("handle", type=parse_int)
    sp = add(
        "ls",
        cmd_ls,
        "list this session's pins (--all: every process's through netlink, detached ones included)",
    )
    sp.add_argument("--all", action="store_true")
    sp = add("query", cmd_query, "state of a pin")
    sp.add_argument("handle", type=parse_int)
    sp = add("pages", cmd_pages, "physical addresses of a pin's pages (CAP_SYS_ADMIN)")
    sp.add_argument("handle", type=parse_int)
    sp.add_argument("--first", type=parse_int, default=0)
    sp.add_argument("--count", type=parse_int, default=None)
    sp = add("dma-map", cmd_dma_map, "map a pin for DMA by a PCI device ([domain:]bus:dev.fn)")
    sp.add_argument("handle", type=parse_int)
    sp.add_argument("pci")
    sp = add("dma-unmap", cmd_dma_unmap, "remove a DMA mapping")
    sp.add_argument("handle", type=parse_int)
    sp.add_argument("mapping", type=parse_int)
    sp = add("watch", cmd_watch, "show invalidations (this session's; --all: every process's, via netlink)")
    sp.add_argument("--timeout", type=float, default=None, help="seconds to wait")
    sp.add_argument("--count", type=int, default=None, help="stop after this many events (--all)")
    sp.add_argument("--all", action="store_true")
    sp.add_argument("--background", action="store_true", help="shell: keep watching while you type")
    add("stats", cmd_stats, "global counters of gpupin.ko (through netlink; detached pins and their bytes too)")
    sp = add(
        "top",
        cmd_top,
        "live view of pinned GPU memory: BAR1 bytes per process and GPU, the budget in force, counters, "
        "invalidations/s (q or Ctrl-C quits)",
    )
    sp.add_argument(
        "--interval",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="between refreshes (default 1); with --once the window the rates are measured over (0: no rates)",
    )
    sp.add_argument("--once", action="store_true", help="print one snapshot and exit (--json implies it)")
    sp = add("doctor", cmd_doctor, "check IOMMU, ACS, PCIe topology, drivers and BAR1 for GPUDirect RDMA")
    sp.add_argument("--quick", action="store_true", help="leave NIXL out (its import and one-transfer selftest)")
    sp = add(
        "selftest",
        cmd_selftest,
        "is GPUDirect through gpupin working here? pins GPU memory through gpupin.ko and a peer "
        "device, and checks CUDA; a table for bug reports (exit 1 if a check failed)",
    )
    mode = sp.add_mutually_exclusive_group()
    mode.add_argument("--sim", action="store_true", help="through the simulator (default where no NVIDIA GPU is)")
    mode.add_argument("--native", action="store_true", help="through nvidia.ko (default where an NVIDIA GPU is)")
    sp.add_argument(
        "--pci", help="PCI device the DMA mappings and the example peer are for (default: an RDMA device, else a NIC)"
    )
    sp.add_argument("--no-load", action="store_true", help="load no module: run what the loaded ones allow")
    sp.add_argument("--keep", action="store_true", help="leave the modules it loaded loaded")
    sp.add_argument(
        "--require-modules",
        action="store_true",
        help="fail unless every module check ran (not skipped, not impossible here)",
    )
    sp = add(
        "sim",
        cmd_sim,
        "simulated GPU memory: alloc SIZE | free VA | write VA DATA | read VA SIZE | query VA | stats | set NAME VALUE",
    )
    sp.add_argument("op", choices=["alloc", "free", "write", "read", "query", "stats", "set"])
    sp.add_argument("rest", nargs="*")
    sp.add_argument("--hex", action="store_true", help="write: DATA is hex")
    sp = add("bench", cmd_bench, "benchmarks: registration cache hit cost, reuse trace, scale, pressure")
    from . import bench

    bench.add_arguments(sp)
    sp = add(
        "gds",
        cmd_gds,
        "GPUDirect Storage: status (cuFile properties, GDS/Async readiness) | bench (register per IO vs the cache)",
    )
    sp.add_argument("op", choices=["status", "bench"])
    sp.add_argument("--quick", action="store_true", help="bench: fewer timing batches")
    sp.add_argument("--path", default=".", help="status: where the GDS files live (default: here)")
    sp.add_argument("--seed", type=int, default=1)
    sp.add_argument("--out", metavar="FILE", help="bench: write the JSON here as well")
    sp = add(
        "nixl",
        cmd_nixl,
        "NIXL: status (version, backends that load here, VRAM, a DRAM transfer through gpupin.nixl)",
    )
    sp.add_argument("op", choices=["status"])
    sp.add_argument("--log", action="store_true", help="also print what NIXL logged meanwhile (on stderr)")
    sub.add_parser(
        "shell",
        help="interactive debugging shell (also -c 'cmd; cmd' or a script on stdin)",
        description="interactive debugging shell",
    ).add_argument("-c", dest="commands", help="run these ';'-separated commands and exit")
    return p


def _fix_sim_args(a: argparse.Namespace) -> None:
    rest = list(a.rest)
    need = {
        "alloc": ["size"],
        "free": ["va"],
        "write": ["va", "data"],
        "read": ["va", "size"],
        "query": ["va"],
        "stats": [],
        "set": ["name", "value"],
    }[a.op]
    if len(rest) != len(need):
        raise UsageError(f"sim {a.op} takes {' '.join(n.upper() for n in need) or 'no arguments'}")
    for name, text in zip(need, rest, strict=True):
        try:
            value: Any = {"size": parse_size, "va": parse_int}.get(name, str)(text)
        except argparse.ArgumentTypeError as exc:
            raise UsageError(f"sim {a.op}: {exc}") from None
        setattr(a, name, value)


# -- output ------------------------------------------------------------------
def _plain(v: Any) -> Any:
    if is_dataclass(v) and not isinstance(v, type):
        return asdict(v)
    if isinstance(v, bytes):
        return v.hex()
    return v


def render(result: Result, as_json: bool, out: Callable[[str], None] = print) -> None:
    if result is None:
        return
    if isinstance(result, Report):
        out(json.dumps(result.data, default=_plain, indent=2) if as_json else result.text)
        return
    if as_json:
        out(json.dumps(result, default=_plain, indent=2, sort_keys=False))
        return
    if isinstance(result, dict):
        width = max((len(str(k)) for k in result), default=0)
        for k, v in result.items():
            out(f"{str(k):<{width}}  {v}")
    elif isinstance(result, list):
        if not result:
            out("(none)")
        elif isinstance(result[0], dict):
            out(table(result))
        else:
            for r in result:
                out(str(r))
    else:
        out(str(result))


def table(rows: Sequence[dict[str, Any]]) -> str:
    cols = list(rows[0])
    cells = [[str(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]

    def line(vals: list[str]) -> str:
        return "  ".join(v.ljust(w) for v, w in zip(vals, widths, strict=True)).rstrip()

    return "\n".join([line(cols), line(["-" * w for w in widths]), *(line(r) for r in cells)])


def run_command(s: Session, argv: list[str], parser: _Parser | None = None) -> int:
    """Run one command; print its result or its error.  Returns an exit status."""
    parser = parser or build_parser()
    try:
        argv = [_expand(s, w) for w in argv]
        a = parser.parse_args(argv)
        if a.cmd is None or a.cmd == "shell":
            raise UsageError("give a command (see 'help')")
        if a.cmd == "sim":
            _fix_sim_args(a)
        result = a.fn(s, a)
        render(result, getattr(a, "json", False), s.out)
        return result.status if isinstance(result, Report) else 0
    except HelpShown as h:
        return h.status
    except GpupinError as exc:
        s.out(f"error: {exc}")
        return 1
    except OSError as exc:
        s.out(f"error: {exc}")
        return 1


def _expand(s: Session, word: str) -> str:
    if word.startswith("$"):
        if word[1:] not in s.vars:
            raise UsageError(f"{word} is not set yet (set by sim alloc / pin / dma-map: $va, $handle, $mapping)")
        return s.vars[word[1:]]
    return word
