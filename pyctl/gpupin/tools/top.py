"""``gpupin top``: a live view of pinned GPU memory, and the BAR1 it holds.

Read through ``gpupin.netlink``: GET_INFO and GET_STATS (the counters ``gpupin stats``
prints), the GET_PINS dump (``gpupin ls --all``) and, where the caller may receive them,
the INVALIDATED events (``gpupin watch --all``).  The pure part (``build_view``,
``render``, ``view_json``) turns one such reading into text or JSON and is tested on the
host; ``Source`` reads the module, ``run_once`` and ``run_live`` drive it.

BAR1 bytes are a pin's ``aligned_size``: the range widened to NVIDIA's 64 KiB GPU pages (a
dma-buf pin's to the CPU page), the figure gpupin.ko adds to its ``bytes_now`` counter and
to ``max_pinned_bytes``' tally.  A pin counts while it holds its pages: ``pinned``, or
``detached`` (released by its file, waiting for the GPU driver's free); an ``invalidated``
pin has given its pages back and counts 0 until its owner unpins it.
"""

from __future__ import annotations

import os
import select
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import EventsLost, PermissionDenied
from ..netlink import Netlink, NlPin
from ._budget import Budgets, human, read_budgets

# The JSON shape's version (Documentation/cli.md#top): a change that renames or removes a
# key, or changes a value's meaning, takes the next number; new keys keep it.
JSON_VERSION = 1

# States in which a pin holds its pages, and so its BAR1 space.
HOLDING = ("pinned", "detached")


def bar1_bytes(pin: NlPin) -> int:
    """The BAR1 bytes ``pin`` holds, as gpupin.ko accounts them: its aligned size while it
    holds its pages, 0 once they went."""
    return pin.aligned_size if pin.state in HOLDING else 0


@dataclass(frozen=True)
class Budget:
    """Which limit is in force over pinned GPU memory.  ``mechanism`` is "none" while no
    limit is; ``limit_bytes`` then is None."""

    mechanism: str
    limit_bytes: int | None
    used_bytes: int
    detail: str


def budget_of(info: Mapping[str, Any], stats: Mapping[str, int], shares: Budgets | None = None) -> Budget:
    """The budgets in force, from GET_INFO's answer, the counters and (``shares``, where read)
    the per-process ones: the module-wide ``max_pinned_bytes`` (0: unlimited; every process's
    pins together, ENOSPC past it) and a process's shares, EDQUOT past either: its cgroup's
    ``dmem.max`` where gpupin charges the dmem controller, and gpupin's
    ``max_file_pinned_bytes`` per open file.  ``limit_bytes`` is the module-wide limit."""
    used = int(stats.get("bytes_now", info.get("pinned_bytes", 0)))
    limit = int(info.get("max_pinned_bytes") or 0)
    names, details = [], []
    if limit:
        names.append("gpupin max_pinned_bytes")
        details.append(f"{human(used)} of {human(limit)} (all processes together)")
    if shares is not None and shares.dmem:
        names.append("dmem cgroup")
        details.append("each cgroup's dmem.max of gpupin/<pci device>/bar1")
    if shares is not None and shares.file_max:  # (both apply where both are set)
        names.append("gpupin max_file_pinned_bytes")
        details.append(f"{human(shares.file_max)} per open file")
    if not names:
        per = "no per-process limit" if shares is None or shares.dmem else "max_file_pinned_bytes=0, no dmem controller"
        return Budget("none", None, used, f"no limit in force (max_pinned_bytes=0; {per})")
    return Budget(" + ".join(names), limit or None, used, "; ".join(details))


@dataclass(frozen=True)
class Sample:
    """One reading of the module: GET_INFO, GET_STATS and the pin dump, at ``taken``
    (seconds since the epoch) and ``mono`` (CLOCK_MONOTONIC, for rates)."""

    taken: float
    mono: float
    info: dict[str, Any]
    stats: dict[str, int]
    pins: list[NlPin]
    shares: Budgets | None = None  # the per-process budgets, where read


@dataclass(frozen=True)
class Rates:
    """What changed between two samples ``interval_s`` apart (None: one sample only).

    ``invalidations_per_s`` comes from the kernel's ``inval_freed`` counter, exact whatever
    the events did; ``per_pid`` counts the INVALIDATED events by owner (None where no event
    was read: ``events`` says why)."""

    interval_s: float | None = None
    invalidations_per_s: float | None = None
    per_pid: dict[int, float] | None = None
    events: str = "unavailable"
    events_detail: str = "one sample: no rates yet"


@dataclass(frozen=True)
class ProcessRow:
    pid: int
    comm: str
    pins: int
    detached: int
    invalidated: int
    bar1_bytes: int
    requested_bytes: int
    gpus: int
    invalidations_per_s: float | None


@dataclass(frozen=True)
class GpuRow:
    gpu: str | None  # GPU-xxxxxxxx-...; None where the provider names no GPU (dma-buf pins)
    pins: int
    processes: int
    bar1_bytes: int


@dataclass(frozen=True)
class View:
    sample: Sample
    rates: Rates
    budget: Budget
    processes: list[ProcessRow]
    gpus: list[GpuRow]
    totals: dict[str, int] = field(default_factory=dict)


def proc_comm(pid: int) -> str:
    """A process's command name, "?" where it cannot be read (gone, another pid namespace)."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip() or "?"
    except OSError:
        return "?"


def build_view(sample: Sample, rates: Rates, comm: Callable[[int], str] = proc_comm) -> View:
    """Aggregate the dump by process and by GPU, biggest BAR1 holder first."""
    by_pid: dict[int, list[NlPin]] = {}
    by_gpu: dict[str, list[NlPin]] = {}
    for p in sample.pins:
        by_pid.setdefault(p.pid, []).append(p)
        by_gpu.setdefault(p.gpu_uuid, []).append(p)
    processes = [
        ProcessRow(
            pid=pid,
            comm=comm(pid),
            pins=len(pins),
            detached=sum(p.state == "detached" for p in pins),
            invalidated=sum(p.state == "invalidated" for p in pins),
            bar1_bytes=sum(bar1_bytes(p) for p in pins),
            requested_bytes=sum(p.size for p in pins),
            gpus=len({p.gpu_uuid for p in pins}),
            invalidations_per_s=None if rates.per_pid is None else rates.per_pid.get(pid, 0.0),
        )
        for pid, pins in by_pid.items()
    ]
    processes.sort(key=lambda r: (-r.bar1_bytes, r.pid))
    gpus = [
        GpuRow(
            gpu=uuid or None,
            pins=len(pins),
            processes=len({p.pid for p in pins}),
            bar1_bytes=sum(bar1_bytes(p) for p in pins),
        )
        for uuid, pins in by_gpu.items()
    ]
    gpus.sort(key=lambda r: (-r.bar1_bytes, r.gpu or ""))
    totals = {
        "pins": len(sample.pins),
        "bar1_bytes": sum(bar1_bytes(p) for p in sample.pins),
        "requested_bytes": sum(p.size for p in sample.pins),
        "processes": len(processes),
        "gpus": len(gpus),
        "detached": sum(r.detached for r in processes),
        "invalidated": sum(r.invalidated for r in processes),
    }
    return View(sample, rates, budget_of(sample.info, sample.stats, sample.shares), processes, gpus, totals)


def rates_between(
    a: Sample, b: Sample, events: Mapping[int, int] | None, events_state: str, events_detail: str
) -> Rates:
    """The rates from ``a`` to ``b``; ``events``: the INVALIDATED events read meanwhile, by pid."""
    dt = b.mono - a.mono
    if dt <= 0:
        return Rates(events=events_state, events_detail=events_detail)
    freed = b.stats.get("inval_freed", 0) - a.stats.get("inval_freed", 0)
    per_pid = None if events is None else {pid: n / dt for pid, n in events.items()}
    return Rates(dt, max(freed, 0) / dt, per_pid, events_state, events_detail)


# -- text --------------------------------------------------------------------
def _n(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}{'es' if word.endswith('s') else 's'}"


def _rate(r: float | None) -> str:
    return "-" if r is None else f"{r:.1f}"


PROC_HEADER = (
    f"{'PID':>8}  {'COMMAND':<16} {'PINS':>6} {'DETACHED':>8} {'INVALID':>7} "
    f"{'BAR1':>11} {'REQUESTED':>11} {'INVAL/S':>8}"
)
GPU_HEADER = f"{'GPU':<40} {'PINS':>6} {'PROCS':>6} {'BAR1':>11}"


def render(view: View, width: int = 100, height: int | None = None) -> list[str]:
    """The view as lines of at most ``width`` columns (cut, never wrapped); with ``height``,
    at most that many lines: the last says how many more there were (the GPU table goes
    first, then the processes with the least BAR1)."""
    s, r, b, t = view.sample.stats, view.rates, view.budget, view.totals
    info = view.sample.info
    when = time.strftime("%H:%M:%S", time.localtime(view.sample.taken))
    every = "" if r.interval_s is None else f"  rates over {r.interval_s:.1f} s"
    head = [
        f"gpupin top  {info.get('version', '?')} over {info.get('provider', '?')}  {when}{every}",
        f"budget: {b.mechanism}: {b.detail}",
        f"pinned: {_n(t['pins'], 'pin')}, {human(t['bar1_bytes'])} of BAR1, {_n(t['processes'], 'process')}, "
        f"{_n(t['gpus'], 'GPU')}  (peak {human(s.get('bytes_peak', 0))}; detached {s.get('detached', 0)}, "
        f"{human(s.get('detached_bytes', 0))})",
        f"invalidations: {_rate(r.invalidations_per_s)}/s  (freed {s.get('inval_freed', 0)}, "
        f"process exit {s.get('inval_process_exit', 0)})  events: {r.events}"
        + ("" if r.events == "subscribed" else f" ({r.events_detail})"),
        f"pins {s.get('pins', 0)} unpins {s.get('unpins', 0)} dma maps {s.get('dma_maps', 0)}  "
        f"failed: nomem {s.get('fail_enomem', 0)} nospc {s.get('fail_enospc', 0)} "
        f"inval {s.get('fail_einval', 0)} quota {s.get('fail_edquot', 0)} other {s.get('fail_other', 0)}  "
        f"callback max {s.get('callback_max_ns', 0) // 1000} us",
        "",
    ]
    gpu_lines = ["", GPU_HEADER]
    for g in view.gpus:
        gpu_lines.append(
            f"{(g.gpu or '(unnamed: dma-buf)'):<40} {g.pins:>6} {g.processes:>6} {human(g.bar1_bytes):>11}"
        )
    proc_rows = [
        f"{p.pid:>8}  {p.comm[:16]:<16} {p.pins:>6} {p.detached:>8} {p.invalidated:>7} "
        f"{human(p.bar1_bytes):>11} {human(p.requested_bytes):>11} {_rate(p.invalidations_per_s):>8}"
        for p in view.processes
    ]
    if not proc_rows:
        proc_rows = ["(no pins)"]
        gpu_lines = []
    lines = [*head, PROC_HEADER, *proc_rows, *gpu_lines]
    if height is not None and len(lines) > height:
        keep = max(height - 1, 0)
        lines = lines[:keep] + [f"... {len(lines) - keep} more lines: a taller terminal shows them"][: height - keep]
    return [line[:width] for line in lines]


# -- JSON --------------------------------------------------------------------
def view_json(view: View) -> dict[str, Any]:
    """The documented, stable shape (Documentation/cli.md#top), version ``JSON_VERSION``."""
    info, r = view.sample.info, view.rates
    return {
        "version": JSON_VERSION,
        "time": view.sample.taken,
        "interval_s": r.interval_s,
        "module": {
            "version": info.get("version"),
            "provider": info.get("provider"),
            "abi_version": info.get("abi_version"),
        },
        "budget": asdict(view.budget),
        "totals": dict(view.totals),
        "invalidations_per_s": r.invalidations_per_s,
        "events": r.events,
        "events_detail": r.events_detail,
        "stats": dict(view.sample.stats),
        "processes": [asdict(p) for p in view.processes],
        "gpus": [asdict(g) for g in view.gpus],
    }


# -- reading the module ------------------------------------------------------
class EventCounter:
    """INVALIDATED events by owner pid, on a socket of its own (requests on a subscribed
    socket may swallow events).  Without CAP_NET_ADMIN ``state`` says so and nothing is
    counted."""

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.lost = False
        self.reason = ""  # why there are no events, where there are none
        self.nl: Netlink | None = Netlink()
        try:
            self.nl.subscribe()
        except PermissionDenied:
            self.nl.close()
            self.nl = None
            # Short, for the invalidations line (the exception says more than a line holds).
            self.reason = "needs CAP_NET_ADMIN"

    def fileno(self) -> int | None:
        return None if self.nl is None else self.nl.sock.fileno()

    def drain(self) -> None:
        """Count what is pending, without waiting."""
        if self.nl is None:
            return
        while True:
            try:
                for ev in self.nl.events(timeout=0):
                    if ev["event"] == "invalidated":
                        self.counts[ev["pid"]] = self.counts.get(ev["pid"], 0) + 1
                return
            except EventsLost:
                self.lost = True  # those before the loss are still there: read on

    def take(self) -> tuple[dict[int, int] | None, str, str]:
        """The counts since the last take, with the events' state and why; counting restarts."""
        if self.nl is None:
            return None, "unavailable", self.reason
        counts, self.counts = self.counts, {}
        if self.lost:
            self.lost = False
            return counts, "lost", "some lost: INVAL/S undercounts"
        return counts, "subscribed", "INVALIDATED events counted by owner"

    def close(self) -> None:
        if self.nl is not None:
            self.nl.close()
            self.nl = None


class Source:
    """The module, read through netlink: samples, and the event counter between them.
    Opening it fails with DriverNotLoaded (which says what to run) where gpupin.ko is not
    loaded."""

    def __init__(self, comm: Callable[[int], str] = proc_comm) -> None:
        self.nl = Netlink()
        try:
            self.events = EventCounter()
        except BaseException:
            self.nl.close()
            raise
        self.comm = comm
        self.last: Sample | None = None

    def sample(self) -> Sample:
        stats = self.nl.stats()
        info = self.nl.info()
        pins = self.nl.list_pins()
        return Sample(time.time(), time.monotonic(), info, stats, pins, read_budgets())

    def view(self) -> View:
        """A new sample, with the rates since the previous one."""
        self.events.drain()
        now = self.sample()
        counts, state, detail = self.events.take()
        if self.last is None:
            rates = Rates(events=state, events_detail=detail)
        else:
            rates = rates_between(self.last, now, counts, state, detail)
        self.last = now
        return build_view(now, rates, self.comm)

    def wait(self, seconds: float, also: Sequence[int] = ()) -> list[int]:
        """Count events for up to ``seconds``; returns early with the fds of ``also`` that
        became readable."""
        deadline = time.monotonic() + seconds
        ev_fd = self.events.fileno()
        fds = [*also, *([] if ev_fd is None else [ev_fd])]
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select(fds, [], [], left)
            if ev_fd is not None and ev_fd in ready:
                self.events.drain()
            woke = [fd for fd in ready if fd in also]
            if woke:
                return woke
        return []

    def close(self) -> None:
        self.events.close()
        self.nl.close()

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_once(interval: float, comm: Callable[[int], str] = proc_comm) -> View:
    """One view; with ``interval`` > 0 two samples that far apart, for the rates."""
    with Source(comm) as src:
        view = src.view()
        if interval > 0:
            src.wait(interval)
            view = src.view()
        return view


def run_live(interval: float) -> None:
    """The full-screen view until ``q`` or Ctrl-C.  Ctrl-C is taken as a key while the view
    runs (a handler wakes the loop through a pipe), not as a KeyboardInterrupt: one raised
    at an arbitrary point (inside a netlink read, curses' restore) could leave a traceback
    behind instead of quitting."""
    import curses
    import signal

    with Source() as src:
        view = src.view()  # the first reading: errors come before the screen changes
        interrupted: list[int] = []
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)

        def on_int(signum: int, frame: Any) -> None:
            interrupted.append(signum)

        def keys(scr: Any) -> tuple[bool, bool]:
            """Read the keys typed: (quit, resized)."""
            quit_, resized = False, False
            while (key := scr.getch()) != -1:
                quit_ |= key in (ord("q"), ord("Q"))
                resized |= key == curses.KEY_RESIZE
            return quit_, resized

        def loop(scr: Any) -> None:
            nonlocal view
            try:
                curses.curs_set(0)
            except curses.error:
                pass  # a terminal without an invisible cursor
            scr.nodelay(True)
            while True:
                h, w = scr.getmaxyx()
                scr.erase()
                for y, line in enumerate(render(view, w, h)):
                    try:
                        scr.addstr(y, 0, line)
                    except curses.error:
                        pass  # the bottom-right cell: written, but the cursor cannot move on
                scr.refresh()
                deadline = time.monotonic() + interval
                resized = False
                while not resized and not interrupted and (left := deadline - time.monotonic()) > 0:
                    if not src.wait(left, (0, wake_r)):
                        break
                    quit_, resized = keys(scr)
                    if quit_:
                        return
                quit_, resized_now = keys(scr)  # a resize is a key curses makes on its next read
                if quit_ or interrupted:
                    return
                if not (resized or resized_now):
                    view = src.view()

        old_handler = signal.signal(signal.SIGINT, on_int)
        old_wakeup = signal.set_wakeup_fd(wake_w)
        try:
            curses.wrapper(loop)
        finally:
            signal.set_wakeup_fd(old_wakeup)
            signal.signal(signal.SIGINT, old_handler)
            os.close(wake_r)
            os.close(wake_w)


def width_of_terminal() -> int:
    """The columns ``--once`` lays out for: the terminal's ($COLUMNS first), else 100."""
    import shutil

    return shutil.get_terminal_size((100, 24)).columns
