"""How gpupin.ko's costs grow with the work (``gpupin bench --vm``, ``make bench``'s VM part).

Needs the modules loaded over the simulator (the VM).  Each figure is measured in one run,
with N = 100,000 (``--quick``: 10,000; ``vm_scale_pins`` says which):
- pin + unpin and query at 100 live pins against N in one file (``..._many_...``), and
  with the N spread over 64 files;
- the validity map's size at 100,000 pins, and what the per-file limit says when reached;
- a GET_PINS netlink dump of 100,000 pins (time per pin, through a raw socket: the
  kernel's cost, not pyroute2's parsing), and a dump racing unpins: no pin twice, every
  pin that stayed pinned reported;
- kernel memory per pin (Slab in /proc/meminfo, the simulator's page tables included,
  as NVIDIA's would be) for 1-page and 1 GiB pins, and the peak of a burst;
- the event queue: 100,000 invalidations nobody reads: memory bounded by the file's
  slots (the records are allocated with the pins), the overflow record first, every
  validity word right;
- the free callback's time with a 1 GiB pin that gpupin mapped itself 16 times (the per-pin
  limit), less the same free without mappings: the callback unmaps every page of every
  mapping while NVIDIA holds its RM lock, so that time per unmapped page, times the pages
  of the largest GPU (80 GiB: 1,310,720 of 64 KiB) and 16 mappings, is the longest gpupin
  can hold that lock (no IOMMU in the VM: with one, each unmap costs more).
Times are µs of the emulated VM: only their ratios mean something.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import socket
import statistics
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from .._native import lib
from ..device import Device
from ..errors import GpupinError
from ..sim import SimMemory, module_param

GPU_PAGE = 1 << 16
NLMSG_ERROR, NLMSG_DONE = 2, 3
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NETLINK_GENERIC = 16  # not in every Python's socket module


def _progress(msg: str) -> None:
    print(f"bench-vm: {msg}", file=sys.stderr, flush=True)


def max_pins_per_file(n: int) -> contextlib.AbstractContextManager[None]:
    """Files opened inside get n slots (the parameter is read at open)."""
    return module_param("gpupin", "max_pins_per_file", n)


def meminfo_kb(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _op_samples(
    dev: Device, va: int, handles: list[int], reps: int, rng: random.Random
) -> tuple[list[float], list[float]]:
    """µs of pin + unpin and of query on dev, which already holds ``handles``."""
    pin_unpin: list[float] = []
    query: list[float] = []
    for _ in range(reps):
        t = time.perf_counter_ns()
        dev.unpin(dev.pin(va, GPU_PAGE))
        t1 = time.perf_counter_ns()
        dev.query(rng.choice(handles))
        t2 = time.perf_counter_ns()
        pin_unpin.append((t1 - t) / 1000)
        query.append((t2 - t1) / 1000)
    return pin_unpin, query


def _op_costs(dev: Device, va: int, handles: list[int], reps: int, rng: random.Random) -> tuple[float, float]:
    """Median µs of pin + unpin and of query (see _op_samples)."""
    a, b = _op_samples(dev, va, handles, reps, rng)
    return statistics.median(a), statistics.median(b)


def _pin_many(dev: Device, va: int, n: int, out: list[int]) -> None:
    step = max(1, n // 10)
    for i in range(n):
        out.append(dev.pin(va, GPU_PAGE).handle)
        if (i + 1) % step == 0 and n >= 10_000:
            _progress(f"  {i + 1}/{n} pins")


def scale_pins(total: int, reps: int) -> dict[str, Any]:
    rng = random.Random(5)
    out: dict[str, Any] = {"vm_scale_pins": total}
    with max_pins_per_file(total + 1024), SimMemory() as sim:
        va = sim.alloc(GPU_PAGE)
        with Device() as dev:
            handles: list[int] = []
            _pin_many(dev, va, 100, handles)
            # Warm (the emulator translates code on first use), then at 100 pins before and
            # after the big run, so that drifts of the machine fall on both sides.
            _op_samples(dev, va, handles, reps, rng)
            small_pu, small_q = _op_samples(dev, va, handles, reps, rng)
            slab0 = meminfo_kb("Slab")
            _pin_many(dev, va, total - 100, handles)
            slab1 = meminfo_kb("Slab")
            big = _op_costs(dev, va, handles, 2 * reps, rng)
            out["vm_validity_map_bytes"] = len(dev.validity_map())
            out["vm_slab_bytes_per_1page_pin"] = (slab1 - slab0) * 1024 / (total - 100)
            _progress(f"dump of {len(handles)} pins")
            out.update(dump_figures(handles))
            _progress("unpinning")
            t = time.perf_counter()
            for h in handles[100:]:
                dev.unpin(h)
            out["vm_unpin_all_us_per_pin"] = (time.perf_counter() - t) * 1e6 / (len(handles) - 100)
            del handles[100:]
            pu, q = _op_samples(dev, va, handles, reps, rng)
            small = statistics.median(small_pu + pu), statistics.median(small_q + q)
        out["vm_pin_unpin_100_us"], out["vm_query_100_us"] = small
        out["vm_pin_unpin_many_us"], out["vm_query_many_us"] = big
        out["vm_pin_unpin_many_over_100"] = big[0] / small[0]
        out["vm_query_many_over_100"] = big[1] / small[1]
        # The same number of pins over 64 files.
        _progress("64 files")
        devs = [Device() for _ in range(64)]
        try:
            per = total // 64
            held: list[list[int]] = []
            for d in devs:
                hs: list[int] = []
                _pin_many(d, va, per, hs)
                held.append(hs)
            pin_unpin, query = _op_costs(devs[0], va, held[0], reps, rng)
            out["vm_pin_unpin_64files_us"], out["vm_query_64files_us"] = pin_unpin, query
            out["vm_pin_unpin_64files_over_100"] = pin_unpin / small[0]
        finally:
            for d in devs:
                d.close()
        sim.free(va)
    return out


def per_file_limit(limit: int = 1000) -> dict[str, Any]:
    """What a program meets at the per-file limit (and that the file still works after)."""
    with max_pins_per_file(limit), SimMemory() as sim, Device() as dev:
        va = sim.alloc(GPU_PAGE)
        handles = [dev.pin(va, GPU_PAGE).handle for _ in range(limit)]
        try:
            dev.pin(va, GPU_PAGE)
            said = "no error"
        except GpupinError as exc:
            said = f"{type(exc).__name__} ({errno.errorcode.get(exc.errno or 0, exc.errno)}): {exc}"
        dev.unpin(handles.pop())
        dev.unpin(dev.pin(va, GPU_PAGE))  # a freed slot is usable again
        for h in handles:
            dev.unpin(h)
        sim.free(va)
    return {"vm_per_file_limit": limit, "vm_per_file_limit_error": said}


# -- GET_PINS through a raw generic netlink socket -------------------------------------------


def _family_id() -> int:
    from ..netlink import Netlink

    with Netlink() as nl:
        return int(nl.sock.prid)


def _attrs(buf: bytes, off: int, end: int) -> Iterator[tuple[int, int, int]]:
    """(type, payload offset, payload length) of the netlink attributes in buf[off:end]."""
    while off + 4 <= end:
        alen, atype = struct.unpack_from("=HH", buf, off)
        if alen < 4:
            break
        yield atype & 0x3FFF, off + 4, alen - 4
        off += (alen + 3) & ~3


def dump_pins(family: int) -> list[tuple[int, int, int]]:
    """(pid, file id, handle) of every pin, from one GET_PINS dump."""
    s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_GENERIC)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        req = struct.pack("=IHHII", 20, family, NLM_F_REQUEST | NLM_F_DUMP, 1, 0)
        req += struct.pack("=BBH", lib.GPUPIN_NL_CMD_GET_PINS, lib.GPUPIN_NL_VERSION, 0)
        s.send(req)
        out: list[tuple[int, int, int]] = []
        while True:
            buf = s.recv(1 << 16)
            off = 0
            while off + 16 <= len(buf):
                mlen, mtype = struct.unpack_from("=IH", buf, off)
                if mtype == NLMSG_DONE:
                    return out
                if mtype == NLMSG_ERROR:
                    (err,) = struct.unpack_from("=i", buf, off + 16)
                    raise OSError(-err, f"GET_PINS dump: {os.strerror(-err)}")
                for atype, p, n in _attrs(buf, off + 20, off + mlen):
                    if atype != lib.GPUPIN_NL_A_PIN:
                        continue
                    pid = fid = handle = -1
                    for t, q, _ in _attrs(buf, p, p + n):
                        if t == lib.GPUPIN_NL_PIN_A_PID:
                            (pid,) = struct.unpack_from("=I", buf, q)
                        elif t == lib.GPUPIN_NL_PIN_A_FILE_ID:
                            (fid,) = struct.unpack_from("=Q", buf, q)
                        elif t == lib.GPUPIN_NL_PIN_A_HANDLE:
                            (handle,) = struct.unpack_from("=Q", buf, q)
                    out.append((pid, fid, handle))
                off += (mlen + 3) & ~3
    finally:
        s.close()


def dump_figures(handles: list[int]) -> dict[str, Any]:
    family = _family_id()
    me = os.getpid()
    t = time.perf_counter()
    rows = dump_pins(family)
    dt = time.perf_counter() - t
    mine = [h for pid, _, h in rows if pid == me]
    out: dict[str, Any] = {
        "vm_dump_pins": len(mine),
        "vm_dump_us_per_pin": dt * 1e6 / max(1, len(rows)),
        "vm_dump_complete": sorted(mine) == sorted(handles),
    }
    return out


def dump_racing_unpins(n: int) -> dict[str, Any]:
    """A dump while another thread unpins half of the pins: consistent, not a snapshot."""
    family = _family_id()
    me = os.getpid()
    with max_pins_per_file(n + 1024), SimMemory() as sim, Device() as dev:
        va = sim.alloc(GPU_PAGE)
        handles: list[int] = []
        _pin_many(dev, va, n, handles)
        rng = random.Random(9)
        going = set(rng.sample(handles, n // 2))
        staying = set(handles) - going
        started = threading.Event()

        def unpinner() -> None:
            started.set()
            for h in going:
                dev.unpin(h)

        th = threading.Thread(target=unpinner)
        th.start()
        started.wait()
        rows = [h for pid, _, h in dump_pins(family) if pid == me]
        th.join()
        seen = set(rows)
        out = {
            "vm_dump_race_pins": n,
            "vm_dump_race_duplicates": len(rows) - len(seen),
            "vm_dump_race_missing_live": len(staying - seen),
            "vm_dump_race_unknown": len(seen - set(handles)),
            "vm_dump_race_unpinned_seen": len(seen & going),
        }
        for h in staying:
            dev.unpin(h)
        sim.free(va)
    return out


def huge_pins(count: int) -> dict[str, Any]:
    """Kernel memory per 1 GiB pin (page table of 16,384 GPU pages); the simulated BAR must
    hold ``count`` GiB (``run()`` makes it 64 GiB)."""
    with SimMemory() as sim, Device() as dev:
        try:
            va = sim.alloc(1 << 30)
        except GpupinError as exc:  # the VM may lack the memory
            return {"vm_slab_bytes_per_1g_pin": f"not measured: {exc}"}
        slab0 = meminfo_kb("Slab")
        pins = [dev.pin(va, 1 << 30) for _ in range(count)]
        slab1 = meminfo_kb("Slab")
        for p in pins:
            dev.unpin(p)
        sim.free(va)
    return {"vm_1g_pins": count, "vm_slab_bytes_per_1g_pin": (slab1 - slab0) * 1024 / count}


def burst_peak(n: int) -> dict[str, Any]:
    """Slab at its peak during a burst of n pins from 8 threads, and after they are gone."""
    with max_pins_per_file(n + 1024), SimMemory() as sim, Device() as dev:
        va = sim.alloc(GPU_PAGE)
        base = meminfo_kb("Slab")
        peak = [base]
        done = threading.Event()

        def sampler() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], meminfo_kb("Slab"))
                time.sleep(0.01)

        s = threading.Thread(target=sampler)
        s.start()
        lists: list[list[int]] = [[] for _ in range(8)]
        workers = [threading.Thread(target=_pin_many, args=(dev, va, n // 8, lists[i])) for i in range(8)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        peak[0] = max(peak[0], meminfo_kb("Slab"))
        for hs in lists:
            for h in hs:
                dev.unpin(h)
        done.set()
        s.join()
        after = meminfo_kb("Slab")
        sim.free(va)
    return {
        "vm_burst_pins": n,
        "vm_burst_peak_slab_kb_over_base": peak[0] - base,
        "vm_burst_slab_kb_left_after": after - base,
    }


def event_flood(n: int, slots: int) -> dict[str, Any]:
    """n invalidations (pin, free the memory, unpin; again) with nobody reading the queue."""
    with max_pins_per_file(slots), SimMemory() as sim, Device() as dev:
        slab0 = peak = meminfo_kb("Slab")
        words_right = 0
        step = max(1, n // 10)
        for i in range(n):
            va = sim.alloc(GPU_PAGE)
            p = dev.pin(va, GPU_PAGE)
            sim.free(va)  # invalidates: an event queued, the word changed
            words_right += not p.is_valid()
            dev.unpin(p)
            if i % 1000 == 0:
                peak = max(peak, meminfo_kb("Slab"))
            if (i + 1) % step == 0:
                _progress(f"  {i + 1}/{n} invalidations")
        peak = max(peak, meminfo_kb("Slab"))
        events = dev.read_events()
    reasons = [e.reason for e in events]
    return {
        "vm_flood_invalidations": n,
        "vm_flood_slots": slots,
        "vm_flood_peak_slab_kb_over_base": peak - slab0,
        "vm_flood_events_read": len(events),
        "vm_flood_overflow_first": bool(reasons) and reasons[0] == "overflow",
        "vm_flood_words_right": words_right,
    }


LARGEST_GPU_PAGES = (80 << 30) // GPU_PAGE  # an 80 GiB GPU's memory in 64 KiB pages
MAPS_PER_PIN = 16  # gpupin's limit (GPUPIN_MAX_MAPS_PER_PIN, kernel/dma.c)


def _free_ns(sim: SimMemory, dev: Device, size: int, maps: int, pci: str) -> int:
    """ns of a FREE of an allocation of ``size`` pinned once and mapped ``maps`` times for
    ``pci`` by gpupin itself: the free runs the pin's callback, which unmaps them all."""
    va = sim.alloc(size)
    pin = dev.pin(va, size)
    for _ in range(maps):
        dev.dma_map(pin, pci)
    t0 = time.perf_counter_ns()
    sim.free(va)
    took = time.perf_counter_ns() - t0
    dev.unpin(pin)
    return took


def callback_bound(size: int = 1 << 30, reps: int = 2) -> dict[str, Any]:
    """The free callback of a pin of ``size`` bytes mapped MAPS_PER_PIN times for the VM's
    last PCI device, against the same free with no mapping (best of ``reps`` each): the
    difference per unmapped page, and that times the largest GPU's pages."""
    devs = sorted(os.listdir("/sys/bus/pci/devices"))
    if not devs:
        return {"vm_callback_ns_per_unmapped_page": "not measured: no PCI device to map for"}
    with SimMemory() as sim, Device() as dev:
        try:
            bare = min(_free_ns(sim, dev, size, 0, devs[-1]) for _ in range(reps))
            mapped = min(_free_ns(sim, dev, size, MAPS_PER_PIN, devs[-1]) for _ in range(reps))
        except GpupinError as exc:  # the VM may lack the memory
            return {"vm_callback_ns_per_unmapped_page": f"not measured: {exc}"}
    pages = size // GPU_PAGE * MAPS_PER_PIN
    per_page = (mapped - bare) / pages
    return {
        "vm_callback_unmapped_pages": pages,
        "vm_callback_free_ms": bare / 1e6,
        "vm_callback_free_mapped_ms": mapped / 1e6,
        "vm_callback_ns_per_unmapped_page": per_page,
        "vm_callback_bound_80gib_16_maps_s": per_page * LARGEST_GPU_PAGES * MAPS_PER_PIN / 1e9,
    }


def run(
    total: int = 100_000, reps: int = 50, flood_slots: int = 4096, huge: int = 4, callback_bytes: int = 1 << 30
) -> dict[str, Any]:
    """Every figure above; ``flood_slots``, ``huge`` and ``callback_bytes`` let a test run it
    small (the flood overflows only when ``total`` exceeds ``flood_slots``).  The simulated BAR is
    made large enough for every pin (each 64 KiB pin takes 64 KiB of it, as on a GPU:
    100,000 of them take 6.1 GiB, the default BAR 256 MiB) and restored after."""
    with module_param("nvp2p_sim", "pin_latency_us", 0), module_param("nvp2p_sim", "bar_size", 64 << 30):
        return _run(total, reps, flood_slots, huge, callback_bytes)


def _run(total: int, reps: int, flood_slots: int, huge: int, callback_bytes: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    steps: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        (f"{total} pins in one file, then over 64 files", lambda: scale_pins(total, reps)),
        ("per-file limit", per_file_limit),
        ("dump racing unpins", lambda: dump_racing_unpins(min(total, 20_000))),
        (f"1 GiB pins ({huge})", lambda: huge_pins(huge)),
        ("burst peak", lambda: burst_peak(min(total, 20_000))),
        ("event flood", lambda: event_flood(total, flood_slots)),
        (
            f"free callback, {callback_bytes >> 20} MiB pin mapped {MAPS_PER_PIN} times",
            lambda: callback_bound(callback_bytes),
        ),
    ]
    t0 = time.monotonic()
    for i, (name, step) in enumerate(steps, 1):
        _progress(f"{i}/{len(steps)} {name} ({time.monotonic() - t0:.0f} s so far)")
        out.update(step())
    _progress(f"done in {time.monotonic() - t0:.0f} s")
    return out
