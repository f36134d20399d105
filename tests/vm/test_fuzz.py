"""Stateful fuzzing of gpupin's interfaces from 4 processes at once.

Each process runs a seeded random walk over open/pin/pin_dmabuf/unpin/query/get_pages/dma_map/dma_addrs/
dma_unmap/mmap/poll/read/close/fork, simulator alloc/free, peer-driver transfers and netlink
requests, with boundary and random values in every field (flags, padding, reserved words, sizes
near 0, 64 KiB and 2^64, stale and foreign handles).  It keeps a model of what it owns and checks
every return code against the set documented for that call (and exactly, where the model says
what the answer must be).  Afterwards the simulator must be back to zero and the module must
unload (vm-guest.sh unloads it; vm-run.sh fails on any kernel warning or taint).

It runs twice: once in the orders a test expects, once in orders NVIDIA's driver also permits
(a put_pages held before the driver's lock while frees and other pins run, freed page-table
addresses handed straight back, an MPS client's teardown dropping a process's
registration, after which puts release nothing and frees call back for pins gpupin let go, and
spells of late frees, whose callbacks land while PIN takes the table and publishes the pin).

GPUPIN_FUZZ_CALLS sets the total (default 10,000, scaled by GPUPIN_STRESS_SCALE; 100,000 with GPUPIN_LONG=1);
GPUPIN_FUZZ_SEED replays one run: a failure prints the seed of the process that failed.
"""

from __future__ import annotations

import errno
import mmap
import multiprocessing
import os
import random
import select
import traceback
from pathlib import Path
from typing import Any

import pytest

from conftest import GPU_PAGE, first_pci_device, raw, scaled
from gpupin import Device, SimMemory, sim_stats
from gpupin._native import ffi, lib
from gpupin.testing import load_peer

pytestmark = [
    pytest.mark.vm,
    pytest.mark.simonly(
        reason="fuzzes the simulator's allocator and the example peer driver alongside gpupin from forked processes"
    ),
]
LONG = os.environ.get("GPUPIN_LONG") == "1"
# vm-run.sh passes "" if unset
CALLS = int(os.environ.get("GPUPIN_FUZZ_CALLS") or (100_000 if LONG else scaled(10_000)))
PROCS = 4
LATE_FREES = "/sys/module/nvp2p_sim/parameters/race_get_pages_late_us"

E = errno
OK = 0
# The documented return codes of each call (0 or -errno).
ALLOWED = {
    "pin": {OK, -E.EINVAL, -E.ENOMEM, -E.ENOSPC, -E.ENXIO, -E.EOPNOTSUPP, -E.EACCES},
    "unpin": {OK, -E.EINVAL, -E.ENOENT, -E.EACCES},
    "query": {OK, -E.EINVAL, -E.ENOENT},
    # EOPNOTSUPP: a dma-buf pin imported for no device has no addresses to give
    "get_pages": {OK, -E.EINVAL, -E.ENOENT, -E.ENXIO, -E.ENOMEM, -E.EFAULT, -E.EOPNOTSUPP},
    "dma_map": {OK, -E.EINVAL, -E.ENOENT, -E.ENXIO, -E.ENODEV, -E.ENOSPC, -E.EACCES},
    "dma_addrs": {OK, -E.EINVAL, -E.ENOENT, -E.ENXIO, -E.ENOMEM, -E.EFAULT},
    "dma_unmap": {OK, -E.EINVAL, -E.ENOENT, -E.ENXIO, -E.EACCES},
    "info": {OK},
    "pin_dmabuf": {OK, -E.EINVAL, -E.EBADF, -E.ENOSPC, -E.ENOMEM, -E.ENXIO, -E.ENODEV, -E.EACCES},
    "bad_cmd": {-E.ENOTTY},
    "peer": {OK, -E.EINVAL, -E.ENOENT, -E.ENODEV, -E.EIO, -E.EBADF, -E.EFAULT, -E.ENOSPC},
}


REAL_CMDS = {getattr(lib, n) for n in dir(lib) if n.startswith("GPUPIN_IOC_") and n != "GPUPIN_IOC_MAGIC"}


class Walk:
    """One process's random walk; ``calls`` counts kernel calls made."""

    def __init__(self, seed: int, budget: int, pci: str, adversarial: bool) -> None:
        self.rng = random.Random(seed)
        self.adversarial = adversarial
        self.budget = budget
        self.calls = 0
        self.pci = pci
        bus, rest = pci.split(":")[1:]
        dev, fn = rest.split(".")
        self.pci_fields = (int(pci.split(":")[0], 16), int(bus, 16), int(dev, 16) << 3 | int(fn, 16))
        self.sim = SimMemory()
        self.dev = Device()
        self.peer_fd = os.open("/dev/gpupin_peer", os.O_RDWR | os.O_CLOEXEC)
        self.allocs: dict[int, int] = {}  # va -> size
        self.pins: dict[int, tuple[int, int]] = {}  # handle -> (alloc va, pinned size)
        self.stale: list[int] = []  # handles unpinned (never reused)
        self.maps: dict[int, list[int]] = {}  # handle -> mapping ids
        self.buf = ffi.new("uint64_t[]", 64)
        self.buf_addr = int(ffi.cast("uintptr_t", self.buf))

    # -- values ---------------------------------------------------------------
    def u64(self) -> int:
        r = self.rng.random()
        if r < 0.5:
            return self.rng.choice(
                [
                    0,
                    1,
                    4095,
                    4096,
                    GPU_PAGE - 1,
                    GPU_PAGE,
                    GPU_PAGE + 1,
                    2**32 - 1,
                    2**32,
                    2**63,
                    2**64 - GPU_PAGE,
                    2**64 - 1,
                ]
            )
        return self.rng.getrandbits(64)

    def u32(self) -> int:
        return self.rng.choice([0, 1, 2, 0x80000000, 2**32 - 1, self.rng.getrandbits(32)])

    def maybe(self, p: float = 0.9) -> bool:
        return self.rng.random() < p

    def small_or(self, good: int) -> int:
        """``good`` most of the time, else a boundary or random value."""
        return good if self.maybe() else self.u64()

    def handle(self) -> int:
        r = self.rng.random()
        if self.pins and r < 0.7:
            return self.rng.choice(list(self.pins))
        if self.stale and r < 0.85:
            return self.rng.choice(self.stale)
        return self.u64()

    # -- calls ---------------------------------------------------------------
    def check(self, call: str, rc: int, exact: int | None = None) -> None:
        self.calls += 1
        assert rc in ALLOWED[call], f"{call} returned {rc} ({os.strerror(-rc) if rc < 0 else 'ok'})"
        if exact is not None:
            assert rc == exact, f"{call} returned {rc}, the model expected {exact}"

    def op_alloc(self) -> None:
        if len(self.allocs) >= 12:
            return self.op_free()
        size = self.rng.choice([1, GPU_PAGE - 1, GPU_PAGE, 3 * GPU_PAGE + 5, 8 * GPU_PAGE])
        self.allocs[self.sim.alloc(size)] = size
        self.calls += 1

    def op_free(self) -> None:
        if not self.allocs:
            return
        va = self.rng.choice(list(self.allocs))
        self.sim.free(va)
        del self.allocs[va]
        self.calls += 1

    def op_forget(self) -> None:
        """An MPS client's teardown: this process's registration of one allocation's pins (or
        of all) goes; their unpins then release nothing and the free calls back for them."""
        if not self.adversarial:
            return
        va = self.rng.choice(list(self.allocs)) if self.allocs and self.maybe(0.8) else 0
        self.sim.forget_owner(va)
        self.calls += 1

    def op_late_frees(self) -> None:
        """Switch the simulator's late frees on or off (for every process): each non-persistent
        get_pages' memory is then freed on another CPU as it returns, so the callback lands
        anywhere in PIN or after it."""
        if not self.adversarial:
            return
        Path(LATE_FREES).write_text("60" if self.maybe(0.5) else "0")
        self.calls += 1

    def invalidated(self, handle: int) -> bool:
        """QUERY says the pin is invalidated: a free came (a late one, op_late_frees) since it was read."""
        _, c = raw(self.dev.fileno(), lib.GPUPIN_IOC_QUERY, "struct gpupin_query", handle=handle)
        return bool(c.state == lib.GPUPIN_STATE_INVALIDATED)

    def op_pin(self) -> None:
        flags = 0 if self.maybe() else self.u32()
        pad = 0 if self.maybe() else self.u32()
        reserved = [0, 0] if self.maybe() else [self.u64(), self.u64()]
        if self.allocs and self.maybe(0.8):
            base = self.rng.choice(list(self.allocs))
            span = (self.allocs[base] + GPU_PAGE - 1) // GPU_PAGE * GPU_PAGE
            off = self.rng.randrange(span)
            va, size = base + off, self.small_or(self.rng.randint(1, span - off))
        else:
            base, va, size = 0, self.u64(), self.u64()
        rc, c = raw(
            self.dev.fileno(),
            lib.GPUPIN_IOC_PIN,
            "struct gpupin_pin",
            va=va,
            size=size,
            flags=flags,
            pad=pad,
            reserved=reserved,
            user_tag=self.u64(),
        )
        bad_fields = (flags & ~lib.GPUPIN_PIN_FLAGS_ALL) or pad or any(reserved)
        self.check("pin", rc, -E.EINVAL if bad_fields or size == 0 else None)
        if rc == 0:
            assert c.handle not in self.pins and c.handle not in self.stale, "handle reused"
            # Valid, unless a late free (op_late_frees) invalidated it already.
            assert self.dev.read_word(c.slot) == c.handle or self.invalidated(int(c.handle))
            self.pins[int(c.handle)] = (base, int(size))

    def op_pin_dmabuf(self) -> None:
        fd = -1
        if self.allocs and self.maybe(0.8):
            base = self.rng.choice(list(self.allocs))
            fd = self.sim.export_dmabuf(base)
            self.calls += 1
            span = (self.allocs[base] + GPU_PAGE - 1) // GPU_PAGE * GPU_PAGE
            off = self.rng.randrange(0, span, 4096) if self.maybe() else self.u64()
            size = self.rng.randint(1, max(1, span - off)) if self.maybe() else self.u64()
        else:
            base, off, size = 0, self.u64(), self.u64()
        c = ffi.new("struct gpupin_pin_dmabuf *")
        c.fd = fd if self.maybe() else self.rng.choice([-1, 9999, self.dev.fileno(), self.peer_fd])
        c.offset, c.size, c.user_tag = off, size, self.u64()
        c.flags = 0 if self.maybe() else self.u32()
        rc = int(lib.gpupin_call(self.dev.fileno(), lib.GPUPIN_IOC_PIN_DMABUF, c))
        if fd >= 0:
            os.close(fd)
        self.check("pin_dmabuf", rc, -E.EINVAL if (c.flags & ~lib.GPUPIN_PIN_DMABUF_PCI_DEV) or size == 0 else None)
        if rc == 0:
            assert c.handle not in self.pins and c.handle not in self.stale, "handle reused"
            self.pins[int(c.handle)] = (base, int(size))

    def op_unpin(self) -> None:
        h = self.handle()
        flags = 0 if self.maybe() else self.u32()
        rc, _ = raw(self.dev.fileno(), lib.GPUPIN_IOC_UNPIN, "struct gpupin_unpin", handle=h, flags=flags)
        exact = -E.EINVAL if flags else (0 if h in self.pins else -E.ENOENT)
        self.check("unpin", rc, exact)
        if rc == 0:
            del self.pins[h]
            self.maps.pop(h, None)
            self.stale.append(h)

    def op_query(self) -> None:
        h = self.handle()
        flags = 0 if self.maybe() else self.u32()
        rc, c = raw(self.dev.fileno(), lib.GPUPIN_IOC_QUERY, "struct gpupin_query", handle=h, flags=flags)
        self.check("query", rc, -E.EINVAL if flags else (0 if h in self.pins else -E.ENOENT))
        if rc == 0:
            word = self.dev.read_word(c.slot)
            pinned = c.state == lib.GPUPIN_STATE_PINNED
            # The validity word follows the state (an invalidation may land in between: recheck).
            assert word == (h if pinned else 0) or self.invalidated(h)

    def op_get_pages(self) -> None:
        first, count = (0, 1) if self.maybe(0.6) else (self.u32(), self.u32())
        count = min(count, 64) if self.maybe() else count
        rc, _ = raw(
            self.dev.fileno(),
            lib.GPUPIN_IOC_GET_PAGES,
            "struct gpupin_get_pages",
            handle=self.handle(),
            addrs=self.buf_addr if count <= 64 else self.u64(),
            first=first,
            count=count,
            flags=0 if self.maybe() else self.u32(),
        )
        self.check("get_pages", rc)

    def op_dma_map(self) -> None:
        dom, bus, devfn = self.pci_fields if self.maybe(0.8) else (self.u32(), self.u32(), self.u32())
        h = self.handle()
        rc, c = raw(
            self.dev.fileno(),
            lib.GPUPIN_IOC_DMA_MAP,
            "struct gpupin_dma_map",
            handle=h,
            pci_domain=dom,
            pci_bus=bus,
            pci_devfn=devfn,
            flags=0 if self.maybe() else self.u32(),
        )
        self.check("dma_map", rc)
        if rc == 0:
            self.maps.setdefault(h, []).append(int(c.mapping_id))

    def mapping(self) -> tuple[int, int]:
        if self.maps and self.maybe(0.8):
            h = self.rng.choice(list(self.maps))
            if self.maps[h]:
                return h, self.rng.choice(self.maps[h])
        return self.handle(), self.u32()

    def op_dma_addrs(self) -> None:
        h, mid = self.mapping()
        count = 1 if self.maybe() else self.u32()
        rc, _ = raw(
            self.dev.fileno(),
            lib.GPUPIN_IOC_DMA_ADDRS,
            "struct gpupin_dma_addrs",
            handle=h,
            mapping_id=mid,
            addrs=self.buf_addr if count <= 64 else self.u64(),
            first=0,
            count=count,
        )
        self.check("dma_addrs", rc)

    def op_dma_unmap(self) -> None:
        h, mid = self.mapping()
        rc, _ = raw(
            self.dev.fileno(),
            lib.GPUPIN_IOC_DMA_UNMAP,
            "struct gpupin_dma_unmap",
            handle=h,
            mapping_id=mid,
            reserved=[0, 0] if self.maybe() else [self.u64(), 0],
        )
        self.check("dma_unmap", rc)
        if rc == 0:
            self.maps[h].remove(mid)

    def op_bad_cmd(self) -> None:
        while True:  # any command number of gpupin's magic that is not one of its ioctls
            nr = self.rng.randrange(256)
            size = ffi.sizeof("struct gpupin_pin") if self.maybe() else self.rng.randrange(1 << 14)
            cmd = (self.rng.randrange(4) << 30) | (size << 16) | (lib.GPUPIN_IOC_MAGIC << 8) | nr
            if cmd not in REAL_CMDS:
                break
        self.check("bad_cmd", lib.gpupin_call(self.dev.fileno(), cmd, self.buf))

    def op_events(self) -> None:
        ready, _, _ = select.select([self.dev.fileno()], [], [], 0)
        self.calls += 1
        if ready:
            for ev in self.dev.read_events():
                assert ev.handle in self.pins or ev.handle in self.stale or ev.reason == "overflow"

    def op_mmap(self) -> None:
        length = self.rng.choice([4096, 8192, self.dev.info().map_size, 1 << 30])
        prot = self.rng.choice([mmap.PROT_READ, mmap.PROT_READ | mmap.PROT_WRITE])
        offset = 0 if self.maybe() else 4096
        self.calls += 1
        try:
            m = mmap.mmap(self.dev.fileno(), length, mmap.MAP_SHARED, prot, offset=offset)
        except OSError as exc:
            assert exc.errno in (E.EINVAL, E.EPERM, E.EACCES), exc
            assert length > self.dev.info().map_size or offset or prot & mmap.PROT_WRITE
            return
        assert prot == mmap.PROT_READ and offset == 0 and length <= self.dev.info().map_size
        m.close()

    def op_peer(self) -> None:
        if self.pins and self.maybe(0.8):
            h = self.rng.choice(list(self.pins))
            size = self.pins[h][1]
            off = self.rng.randrange(min(size, 1 << 20))
            length = self.rng.randint(1, min(size - off, 64 * 8))
        else:
            h, off, length = self.handle(), self.u64(), self.rng.choice([0, 1, 2**64 - 1])
        fd = self.dev.fileno() if self.maybe() else self.rng.choice([-1, 9999, self.sim._fd])
        rc, _ = raw(
            self.peer_fd,
            lib.GPUPIN_PEER_IOC_XFER,
            "struct gpupin_peer_xfer",
            gpupin_fd=fd,
            handle=h,
            offset=off,
            length=length,
            buf=self.buf_addr,
            flags=self.rng.choice([0, 1, 0, 1, self.u32()]),
        )
        self.check("peer", rc)

    def op_netlink(self) -> None:
        from gpupin.netlink import Netlink

        with Netlink() as nl:
            self.calls += 1
            pins = [p for p in nl.list_pins() if p.pid == os.getpid()]
            mine = {p.handle for p in pins}
            assert mine <= set(self.pins) | set(self.stale), "netlink lists a pin this process never made"
            h = self.handle()
            self.calls += 1
            try:
                nl.get_pin(os.getpid() if self.maybe() else self.rng.getrandbits(22), h)
            except Exception as exc:  # a GpupinError naming the errno
                assert getattr(exc, "errno", None) == E.ENOENT, exc

    def op_reopen(self) -> None:
        self.dev.close()
        self.calls += 1
        self.dev = Device()
        # Handles belong to a file: the new one starts counting again.
        self.stale.clear()
        self.pins.clear()
        self.maps.clear()

    def op_fork(self) -> None:
        pid = os.fork()
        if pid == 0:
            code = 0
            try:  # the inherited file belongs to the parent
                rc, _ = raw(
                    self.dev.fileno(),
                    lib.GPUPIN_IOC_PIN,
                    "struct gpupin_pin",
                    va=next(iter(self.allocs), 0),
                    size=GPU_PAGE,
                )
                code = 0 if rc == -E.EACCES else 3
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        self.calls += 1
        assert os.waitstatus_to_exitcode(status) == 0, "a forked child could use the parent's file"

    def run(self) -> None:
        ops = [
            (self.op_alloc, 10),
            (self.op_free, 5),
            (self.op_pin, 20),
            (self.op_pin_dmabuf, 5),
            (self.op_unpin, 8),
            (self.op_query, 8),
            (self.op_get_pages, 6),
            (self.op_dma_map, 5),
            (self.op_dma_addrs, 4),
            (self.op_dma_unmap, 4),
            (self.op_bad_cmd, 2),
            (self.op_events, 4),
            (self.op_mmap, 2),
            (self.op_peer, 5),
            (self.op_netlink, 1),
            (self.op_reopen, 1),
            (self.op_fork, 0.3),
            (self.op_forget, 0.5),
            (self.op_late_frees, 0.3),
        ]
        funcs = [f for f, _ in ops]
        weights = [w for _, w in ops]
        while self.calls < self.budget:
            self.rng.choices(funcs, weights)[0]()
        self.dev.close()
        self.sim.close()
        os.close(self.peer_fd)


def worker(seed: int, budget: int, pci: str, adversarial: bool, out: Any) -> None:
    try:
        w = Walk(seed, budget, pci, adversarial)
        w.run()
        out.send(("ok", w.calls))
    except BaseException:  # noqa: B036 - reported to the parent with the seed
        out.send(("fail", f"seed {seed}:\n{traceback.format_exc()}"))


@pytest.mark.parametrize("orders", ["expected", "permitted"])
def test_stateful_fuzz_four_processes(gpupin_loaded: None, leakcheck: None, sim_params, orders: str) -> None:  # type: ignore[no-untyped-def]
    adversarial = orders == "permitted"
    if adversarial:
        sim_params(reuse_freed_tables=1, put_latency_us=200, race_get_pages_late_us=0)  # op_late_frees sets it
    load_peer()
    pci = first_pci_device()
    fixed = os.environ.get("GPUPIN_FUZZ_SEED")
    seeds = [int(fixed)] * PROCS if fixed else [random.SystemRandom().getrandbits(32) for _ in range(PROCS)]
    print(f"fuzz ({orders} orders): {CALLS} calls over {PROCS} processes, seeds {seeds} (replay: GPUPIN_FUZZ_SEED=...)")
    ctx = multiprocessing.get_context("fork")
    procs, pipes = [], []
    for s in seeds:
        rd, wr = ctx.Pipe(duplex=False)
        p = ctx.Process(target=worker, args=(s, CALLS // PROCS, pci, adversarial, wr))
        p.start()
        procs.append(p)
        pipes.append(rd)
    results = [rd.recv() for rd in pipes]
    for p in procs:
        p.join()
    failures = [msg for kind, msg in results if kind == "fail"]
    assert not failures, "\n".join(failures)
    total = sum(n for _, n in results)
    assert total >= CALLS - PROCS
    s = sim_stats()
    assert not s.leaks() and s.allocations == 0 and s.bar_bytes == 0, s
    print(f"fuzz: {total} calls, simulator back to zero")
