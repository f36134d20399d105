"""A NIXL target process for the tests: an endpoint under remote control.

Run as ``python tests/nixl_target.py MEMORY RFD WFD`` (MEMORY: ``host`` or ``cuda``); commands
come as pickled tuples on RFD, answers go back on WFD (NIXL logs on stdout and stderr, so the
protocol has pipes of its own).  A thread answers transfers (``NixlEndpoint.progress``) all
the while.  :class:`Target` in the tests drives it.
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
import threading
import time
from typing import Any


def send(fd: int, obj: Any) -> None:
    data = pickle.dumps(obj)
    os.write(fd, struct.pack("<I", len(data)) + data)


def recv(fd: int) -> Any:
    def exactly(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = os.read(fd, n - len(buf))
            if not chunk:
                raise EOFError("the peer closed its pipe")
            buf += chunk
        return buf

    (n,) = struct.unpack("<I", exactly(4))
    return pickle.loads(exactly(n))


class Target:
    """The test's handle on a target process: ``call(cmd, *args)`` and what it answered."""

    def __init__(self, memory: str) -> None:
        import subprocess

        r1, w1 = os.pipe()  # test -> target
        r2, w2 = os.pipe()  # target -> test
        self.proc = subprocess.Popen(
            [sys.executable, __file__, memory, str(r1), str(w2)],
            pass_fds=(r1, w2),
            stdout=subprocess.DEVNULL,
            env={**os.environ, "NIXL_LOG_LEVEL": "WARN"},
        )
        os.close(r1)
        os.close(w2)
        self.w, self.r = w1, r2
        status, self.metadata = recv(self.r)
        assert status == "ready", self.metadata

    def call(self, cmd: str, *args: Any) -> Any:
        send(self.w, (cmd, *args))
        status, out = recv(self.r)
        if status != "ok":
            raise RuntimeError(f"target: {cmd}{args!r}: {out}")
        return out

    def close(self) -> int:
        """Close the endpoint (deregistering everything); the registrations it had left."""
        live = self.call("close")
        self._close_pipes()
        self.proc.wait(30)
        return int(live)

    def kill(self) -> None:
        """Kill the target process; again, nothing (its pipes are closed once)."""
        self.proc.kill()
        self.proc.wait(30)
        self._close_pipes()

    def _close_pipes(self) -> None:
        # Once: a second close of a descriptor number would close whatever reused it since
        # (a UCX socket of this process, which then aborts in its event loop).
        for fd in (self.w, self.r):
            if fd >= 0:
                os.close(fd)
        self.w = self.r = -1


def main() -> int:
    kind, rfd, wfd = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    from gpupin.nixl import NixlEndpoint

    if kind == "cuda":
        from gpupin.cuda import CudaMemory

        mem: Any = CudaMemory()
        mem_type = "VRAM"
    else:
        from gpupin.hostmem import HostMemory

        mem = HostMemory(256 << 20)
        mem_type = "DRAM"
    ep = NixlEndpoint("target", mem, mem_type=mem_type)
    stop = threading.Event()
    notes: list[tuple[str, bytes]] = []

    def pump() -> None:
        while not stop.is_set():
            notes.extend(ep.progress())
            time.sleep(0.0002)

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    send(wfd, ("ready", ep.metadata()))
    while True:
        try:
            cmd, *args = recv(rfd)
        except EOFError:
            break
        try:
            if cmd == "connect":
                out: Any = ep.connect(args[0])
            elif cmd == "alloc":
                out = mem.alloc(args[0])
            elif cmd == "free":
                mem.free(args[0])  # the provider refuses while the buffer is exposed
                out = None
            elif cmd == "free_behind":  # a free gpupin cannot see (another allocator's, cudaFree)
                if kind == "cuda":
                    mem._current()
                    mem._check(mem._cu.cuMemFree(args[0]), "cuMemFree")
                else:
                    mem._fit.free(args[0])
                out = None
            elif cmd == "unexpose":
                from gpupin.nixl import RemoteBuffer

                ep.unexpose(RemoteBuffer.from_bytes(args[0]), *args[1:])
                out = None
            elif cmd == "fill":
                ptr, size, byte = args
                mem.write(ptr, bytes([byte]) * size)
                out = None
            elif cmd == "read":
                out = mem.read(args[0], args[1])
            elif cmd == "expose":
                out = ep.expose(*args[:2], epoch=args[2] if len(args) > 2 else 0).to_bytes()
            elif cmd == "stats":
                st = ep.cache.stats()
                out = {
                    "registrations": ep.driver.registrations,
                    "deregistrations": ep.driver.deregistrations,
                    "live": ep.driver.live,
                    "stale_transfers": ep.stale_transfers,
                    "stale_exposures": ep.stale_exposures,
                    "exposures": len(ep._exposures),
                    "pins": st.pins,
                    "unpins": st.unpins,
                    "notes": list(notes),
                }
            elif cmd == "close":
                stop.set()
                t.join()
                ep.close()
                out = ep.driver.live
            else:
                raise ValueError(f"unknown command {cmd!r}")
            send(wfd, ("ok", out))
        except BaseException as exc:  # answered, the test decides
            send(wfd, ("error", f"{type(exc).__name__}: {exc}"))
        if cmd == "close":
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())


# -- scenarios the host (DRAM) and GPU (VRAM) suites both run ---------------------------------
MiB = 1 << 20


def pattern(seed: int, n: int) -> bytes:
    return bytes((seed * 131 + i * 7) & 0xFF for i in range(256)) * (n // 256) + bytes(n % 256)


def scenario_churn(
    ep: Any, mem: Any, target: Target, *, rounds: int = 60, seed: int = 5, target_churn: bool = True
) -> dict[str, int]:
    """Sub-buffers carved from a few segments on both sides (a small caching allocator), WRITE
    and READ, with segments freed and allocated again (mostly at the same address) between
    transfers.  Every byte lands where the caller named, on both sides; the initiator registers
    again exactly when a segment's buffer id changed.  ``target_churn``: the target recycles
    its segments too (NIXL 1.5.1 cannot take that over VRAM: see NixlEndpoint._reload)."""
    import random

    rng = random.Random(seed)
    seg = 4 * MiB
    local = [mem.alloc(seg) for _ in range(3)]
    remote = [target.call("alloc", seg) for _ in range(3)]
    exposed = [RemoteBufferOf(target, p, seg) for p in remote]
    versions: set[tuple[int, int]] = set()  # (segment address, buffer id) the initiator used
    back = mem.alloc(MiB)
    target_churns = 0
    for n in range(rounds):
        i, j = rng.randrange(3), rng.randrange(3)
        size = rng.choice([4096, 65536, 300_000, MiB])
        lo = rng.randrange(0, seg - size) & ~63
        ro = rng.randrange(0, seg - size) & ~63
        data = pattern(n, size)
        mem.write(local[i] + lo, data)
        versions.add((local[i], mem.buffer_id(local[i])))
        ep.write(local[i] + lo, size, exposed[j], ro)
        got = target.call("read", remote[j] + ro, size)
        assert got == data, f"round {n}: the target's buffer does not hold what was written"
        versions.add((back, mem.buffer_id(back)))
        ep.read(back, size, exposed[j], ro)
        assert mem.read(back, size) == data, f"round {n}: READ brought other bytes"
        if rng.random() < 0.2:  # the initiator's allocator recycles a segment (mostly same address)
            k = rng.randrange(3)
            mem.free(local[k])
            local[k] = mem.alloc(seg)
        if target_churn and rng.random() < 0.2:  # so does the target's; it exposes the new segment
            k = rng.randrange(3)
            target.call("unexpose", exposed[k].to_bytes())  # peers' leases end first
            target.call("free", remote[k])
            remote[k] = target.call("alloc", seg)
            exposed[k] = RemoteBufferOf(target, remote[k], seg)
            target_churns += 1
    st = ep.cache.stats()
    assert ep.driver.registrations == len(versions) == st.pins, (ep.driver.registrations, len(versions))
    t = target.call("stats")
    assert t["registrations"] == 3 + target_churns and t["stale_transfers"] == t["stale_exposures"] == 0, t
    for p in [*local, back]:
        mem.free(p)
    return {"registrations": ep.driver.registrations, "versions": len(versions), "rounds": rounds}


def scenario_prepared(ep: Any, mem: Any, target: Target) -> dict[str, int]:
    """A Prepared scatter write (8 blocks of 4 KiB, reversed into a 1 MiB exposure) run again
    and again while what its NIXL lists name changes: the target drops a registration (the
    initiator's next grant renews its view of the peer), the initiator's buffer is freed and
    allocated again (registered anew, where the allocator gives the same address back).  The
    bytes land where the blocks say every time, and each list is made again exactly when what
    it names changed."""
    seg = target.call("alloc", MiB)
    region = RemoteBufferOf(target, seg, MiB)
    local = mem.alloc(MiB)
    blocks = [(local + i * 8192, 4096, region, (7 - i) * 65536) for i in range(8)]
    prep = ep.prepare("WRITE", blocks)
    made = ep.lists_prepped

    def run(fill: int) -> None:
        for i in range(8):
            mem.write(local + i * 8192, bytes([fill + i]) * 4096)
        prep.run()
        for i in range(8):
            got = target.call("read", seg + (7 - i) * 65536, 4096)
            assert got == bytes([fill + i]) * 4096, f"block {i} of the prepared write (fill {fill}) did not land"

    run(1)
    run(11)
    assert ep.lists_prepped == made + 2, "the lists were not made once and used again"
    renewals = ep.renewals
    x = target.call("alloc", MiB)
    rx = RemoteBufferOf(target, x, MiB)
    ep.write(local, 4096, rx)
    target.call("unexpose", rx.to_bytes())
    target.call("free", x)  # a registration the initiator's view of the target holds, dropped
    y = target.call("alloc", MiB // 2)
    ep.write(local, 4096, RemoteBufferOf(target, y, MiB // 2))
    assert ep.renewals == renewals + 1, "the dropped registration did not renew the view"
    run(21)
    assert ep.lists_prepped == made + 3, "the remote list was not made again (alone) after the renewal"
    mem.free(local)
    again = mem.alloc(MiB) == local
    if again:  # registered anew at the same address: the local list is made again
        run(31)
        assert ep.lists_prepped == made + 4, "the local list was not made again for the new registration"
    prep.close()
    mem.free(local)
    target.call("unexpose", region.to_bytes())
    target.call("free", seg)
    return {"lists_prepped": ep.lists_prepped - made, "local_again": int(again)}


def deregistered_through_nixl(ep: Any, ptr: int, size: int, remote: Any, agent: Any = None) -> bool:
    """Whether NIXL itself no longer knows [ptr, ptr + size) as registered: a transfer from it
    is refused with NIXL's NOT_FOUND (not our bookkeeping's word for it).  ``agent``: the
    endpoint's agent, taken before close() retired it from the endpoint."""
    agent = agent if agent is not None else ep.agent
    local = agent.get_xfer_descs([(ptr, size, ep.driver.devid)], ep.driver.mem_type)
    rdesc = agent.get_xfer_descs([(remote.addr, size, remote.devid)], remote.mem_type)
    try:
        h = agent.initialize_xfer("WRITE", local, rdesc, remote.agent, b"")
    except Exception as exc:  # noqa: BLE001 - NIXL's classes, matched by name
        return "NotFound" in type(exc).__name__
    agent.release_xfer_handle(h)
    return False


def RemoteBufferOf(target: Target, ptr: int, size: int) -> Any:  # noqa: N802 - a constructor
    from gpupin.nixl import RemoteBuffer

    return RemoteBuffer.from_bytes(target.call("expose", ptr, size))


def scenario_freed_target(ep: Any, mem: Any, target: Target) -> str:
    """The measured silent loss, now prevented: the target would free its exposed 1 MiB buffer
    and allocate again at the same address while the initiator writes 0xA5 through what it
    has.  The provider refuses the free while the buffer is exposed; after unexpose (which
    waits for the initiator's lease) the free goes, and a write through the old descriptor is
    refused before any byte moves: the new owner's buffer keeps all its zeros."""
    from gpupin.nixl import StaleRemote

    dst = target.call("alloc", MiB)
    target.call("fill", dst, MiB, 0)
    rb = RemoteBufferOf(target, dst, MiB)
    src = mem.alloc(MiB)
    mem.write(src, b"\x5a" * MiB)
    ep.write(src, MiB, rb)  # a good write first: connected, registered and leased on both sides
    assert target.call("read", dst, MiB) == b"\x5a" * MiB
    try:
        target.call("free", dst)
        raise AssertionError("the provider freed a buffer exposed to a peer")
    except RuntimeError as exc:
        assert "InUse" in str(exc) and "unexpose" in str(exc), exc
    target.call("unexpose", rb.to_bytes())
    for _ in range(8):  # the allocator hands the freed address back (cuMemAlloc: mostly at once)
        target.call("free", dst)
        again = target.call("alloc", MiB)
        if again == dst:
            break
        dst = again
    else:
        raise AssertionError("the target's allocator never handed the freed address back")
    target.call("fill", dst, MiB, 0)  # the new owner's bytes
    mem.write(src, b"\xa5" * MiB)
    try:
        ep.write(src, MiB, rb)
        outcome = "delivered"
    except StaleRemote:
        outcome = "refused"
    assert outcome == "refused", "a write through a taken-back exposure was reported done"
    assert target.call("read", dst, MiB) == bytes(MiB), "a stale write's bytes are in the new owner's memory"
    # Exposed again, the new buffer takes the write.
    ep.write(src, MiB, RemoteBufferOf(target, dst, MiB))
    assert target.call("read", dst, MiB) == b"\xa5" * MiB
    stats = target.call("stats")
    assert stats["stale_transfers"] == stats["stale_exposures"] == 0, stats
    target.call("unexpose", RemoteBufferOf(target, dst, MiB).to_bytes())
    target.call("free", dst)
    mem.free(src)
    return outcome
