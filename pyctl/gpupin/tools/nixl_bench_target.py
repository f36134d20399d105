"""The target process of ``gpupin bench --nixl``'s endpoint figures.

The bench (the initiator) starts ``python -m gpupin.tools.nixl_bench_target MEM_TYPE RFD WFD``
through :class:`TargetProcess`: MEM_TYPE is ``DRAM`` (HostMemory) or ``VRAM`` (CudaMemory);
commands come as pickled tuples on RFD and answers go back on WFD (NIXL logs on stdout, so
the commands have pipes of their own).  The endpoint runs with ``auto_progress=True``: it
answers lease requests, checks and drops while the process waits for the next command.
"""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

# How often a churn tries for the freed address again (cuMemAlloc hands it back mostly at once).
REALLOC_TRIES = 8


def send(fd: int, obj: Any) -> None:
    data = pickle.dumps(obj)
    view = memoryview(struct.pack("<I", len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


def recv(fd: int) -> Any:
    (n,) = struct.unpack("<I", _exactly(fd, 4))
    return pickle.loads(_exactly(fd, n))  # noqa: S301 - our own child process, over our own pipe


def _exactly(fd: int, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        chunk = os.read(fd, n - got)
        if not chunk:
            raise EOFError("the other process closed its pipe")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


class TargetProcess:
    """The bench's handle on a target process: ``call(cmd, *args)`` returns its answer (and
    raises RuntimeError with the target's error); ``ask`` and ``answer`` split a call so that
    the initiator can work while the target does."""

    def __init__(self, mem_type: str, arena: int) -> None:
        r1, w1 = os.pipe()  # bench -> target
        r2, w2 = os.pipe()  # target -> bench
        package_root = str(Path(__file__).resolve().parent.parent.parent)
        path = os.environ.get("PYTHONPATH")
        env = {
            **os.environ,
            "PYTHONPATH": package_root + (os.pathsep + path if path else ""),
            "NIXL_LOG_LEVEL": os.environ.get("NIXL_LOG_LEVEL", "WARN"),
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpupin.tools.nixl_bench_target", mem_type, str(arena), str(r1), str(w2)],
            pass_fds=(r1, w2),
            stdout=subprocess.DEVNULL,
            env=env,
        )
        os.close(r1)
        os.close(w2)
        self.w, self.r = w1, r2
        try:
            self.metadata: bytes = self.answer("ready")
        except BaseException:
            self.kill()
            raise

    def ask(self, cmd: str, *args: Any) -> None:
        send(self.w, (cmd, *args))

    def answer(self, cmd: str = "") -> Any:
        try:
            status, out = recv(self.r)
        except EOFError:
            rc = self.proc.wait(30)
            raise RuntimeError(f"the NIXL bench target exited ({rc}) during {cmd!r}; its stderr says why") from None
        if status not in ("ok", "ready"):
            raise RuntimeError(f"the NIXL bench target: {cmd}: {out}")
        return out

    def call(self, cmd: str, *args: Any) -> Any:
        self.ask(cmd, *args)
        return self.answer(cmd)

    def close(self) -> dict[str, int]:
        """Close the target's endpoint (unexposing everything) and wait for the process to end;
        its counters as they were then."""
        stats = self.call("close")
        self._close_fds()
        self.proc.wait(60)
        return dict(stats)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self._close_fds()

    def _close_fds(self) -> None:
        for fd in (self.w, self.r):
            try:
                os.close(fd)
            except OSError:
                pass
        self.w = self.r = -1


def _memory(mem_type: str, arena: int) -> Any:
    if mem_type == "VRAM":
        from ..cuda import CudaMemory

        return CudaMemory()
    from ..hostmem import HostMemory

    return HostMemory(arena)


def _churn(ep: Any, mem: Any, raw: bytes, check: tuple[int, int] | None) -> tuple[int, bytes, bytes | None, bool]:
    """Take an exposed buffer back and hand its memory to a new owner: unexpose (waits until
    no peer can write into it), read [offset, offset + size) of it if ``check`` asks (what a
    write that returned meanwhile left there), free, allocate the same size (again, up to
    REALLOC_TRIES more times, until the allocator gives the freed address back), zero it and
    expose it.  (new address, its RemoteBuffer bytes, what was read, same address or not)."""
    from ..nixl import RemoteBuffer

    old = RemoteBuffer.from_bytes(raw)
    ep.unexpose(old)
    seen = mem.read(old.addr + check[0], check[1]) if check else None
    mem.free(old.addr)
    spare: list[int] = []
    ptr = mem.alloc(old.size)
    while ptr != old.addr and len(spare) < REALLOC_TRIES:
        spare.append(ptr)  # kept meanwhile, so that the allocator offers another address
        ptr = mem.alloc(old.size)
    for p in spare:
        mem.free(p)
    mem.write(ptr, bytes(old.size))
    return ptr, ep.expose(ptr, old.size).to_bytes(), seen, ptr == old.addr


def serve(rfd: int, wfd: int, handlers: dict[str, Callable[..., Any]], last: str = "close") -> None:
    """Answer commands read from ``rfd`` on ``wfd`` with ``handlers[cmd](*args)``: ("ok",
    what it returned) or ("error", what it raised); until the pipe closes or ``last`` ran."""
    while True:
        try:
            cmd, *args = recv(rfd)
        except EOFError:
            return
        try:
            handler = handlers.get(cmd)
            if handler is None:
                raise ValueError(f"unknown command {cmd!r}")
            reply: tuple[str, Any] = ("ok", handler(*args))
        except Exception as exc:  # noqa: BLE001 - answered: the bench decides
            reply = ("error", f"{type(exc).__name__}: {exc}")
        send(wfd, reply)
        if cmd == last:
            return


def main() -> int:
    mem_type, arena, rfd, wfd = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    from ..nixl import NixlEndpoint

    mem = _memory(mem_type, arena)
    ep = NixlEndpoint(f"gpupin-bench-target-{os.getpid()}", mem, mem_type=mem_type, auto_progress=True)

    def close() -> dict[str, int]:
        ep.close()
        return {
            "stale_transfers": ep.stale_transfers,
            "stale_exposures": ep.stale_exposures,
            "unanswered": ep.unanswered,
            "malformed_notifications": ep.malformed_notifications,
            "registrations": ep.driver.registrations,
            "live": ep.driver.live,
        }

    send(wfd, ("ready", ep.metadata()))
    serve(
        rfd,
        wfd,
        {
            "connect": ep.connect,
            "alloc": mem.alloc,
            "fill": lambda ptr, size, byte: mem.write(ptr, bytes([byte]) * size),
            "expose": lambda ptr, size: ep.expose(ptr, size).to_bytes(),
            "read": mem.read,
            "churn": lambda raw, check: _churn(ep, mem, raw, check),
            "close": close,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
