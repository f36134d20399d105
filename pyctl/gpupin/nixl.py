"""NIXL: the registration cache in front of a ``nixl_agent``, and transfers that never land in freed memory.

NVIDIA's NIXL (``pip install nixl-cu13``; UCX inside) moves GPU memory between processes and
nodes.  Its ``register_memory`` is explicit and costly (an MR registration per buffer with an
RDMA NIC), and a registration outlives ``cuMemFree``: after a free and a new allocation at the
same address, a transfer through the old registration reports DONE and the data goes to the
freed allocation.  Here:

- :class:`NixlCache` is the registration cache over a :class:`NixlDriver` (the agent behind the
  cache's device protocol: ``pin`` registers the whole allocation, ``unpin`` deregisters it).
  Every hit is checked against the allocation's buffer id (the direct CUDA query of
  ``validate="tag"``), a freed and reallocated buffer is registered again, idle registrations
  go least recently used first under ``max_bytes``, and one in use is never deregistered.
- :class:`NixlEndpoint` is an agent with its cache and a small protocol on NIXL's
  notifications.  ``expose(ptr, size)`` gives a :class:`RemoteBuffer` (address, buffer id and
  registration generation, and the agent's metadata) to send to a peer; the peer's
  ``write``/``read`` take it.  Each transfer carries the buffer id it was meant for, the target
  checks it when the transfer's notification arrives (``progress()``), and the initiator waits
  for that answer: a transfer into a buffer the target freed since raises :class:`StaleRemote`
  instead of reporting success.

NIXL is imported when a driver is made (``load_nixl``), never at ``import gpupin``.
"""

from __future__ import annotations

import importlib
import itertools
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._closable import Closable
from .cache import LibraryDriver, LibraryRegistration, RegistrationCache
from .errors import DriverNotLoaded, GpupinError, InvalidArgument, UnknownHandle
from .memory import MemoryProvider

MEM_TYPES = ("VRAM", "DRAM")

# The protocol on NIXL notifications: a transfer's own notification, and the target's answer.
_XFER = b"gpupin-nixl-xfer/1:"
_ACK = b"gpupin-nixl-ack/1:"
_XFER_FMT = "<QQQQq"  # sequence, address, size, buffer id, generation
_ACK_FMT = "<QBQ"  # sequence, status (0: delivered, 1: stale), the buffer id found there
_ACK_OK, _ACK_STALE = 0, 1


class NixlError(GpupinError):
    """NIXL refused a call or a transfer failed; ``status`` is NIXL's error name when it gave one."""

    def __init__(self, message: str, status: str | None = None) -> None:
        super().__init__(message)
        self.status = status


class StaleRemote(NixlError):
    """The target freed the buffer a transfer was meant for (its buffer id changed): the data
    did not reach that buffer.  Ask the target to ``expose`` the buffer again."""


def load_nixl() -> Any:
    """The NIXL Python API module (``nixl_cu13``, else ``nixl_cu12``, else ``nixl._api``)."""
    errors = []
    for name in ("nixl_cu13", "nixl_cu12", "nixl._api"):
        try:
            mod = importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
            continue
        if hasattr(mod, "nixl_agent"):
            return mod
    raise DriverNotLoaded(
        "NIXL is not installed for this Python (" + "; ".join(errors) + "): pip install nixl-cu13 "
        "(with --no-deps it needs only numpy besides; torch is optional)"
    )


def nixl_version() -> str | None:
    from importlib import metadata

    for dist in ("nixl-cu13", "nixl-cu12", "nixl"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def _nixl_error(what: str, exc: BaseException) -> NixlError:
    status = type(exc).__name__
    return NixlError(f"{what} failed: {status} {exc} (NIXL's details are in its log on stderr)", status)


class NixlRegistration(LibraryRegistration):
    """One ``register_memory`` of a whole allocation (``dlist`` deregisters it)."""

    __slots__ = ("dlist",)

    def __init__(self, handle: int, va: int, size: int, dlist: Any) -> None:
        super().__init__(handle, va, size)
        self.dlist = dlist


class NixlDriver(LibraryDriver):
    """A ``nixl_agent`` behind the registration cache's device protocol.

    ``agent``: an agent of your own (else one named ``name`` is made with the UCX backend and
    no progress thread: NIXL's busy-spins a core, and the endpoint drives progress itself).
    ``mem_type``: "VRAM" (GPU memory, ``devid`` its CUDA device) or "DRAM".  Every agent call
    is made under one lock: NIXL's default thread mode locks nothing.
    """

    library = "NIXL"
    cache_name = "NixlCache"

    def __init__(
        self,
        agent: Any = None,
        *,
        name: str = "gpupin",
        mem_type: str = "VRAM",
        devid: int = 0,
        nixl: Any = None,
        progress_thread: bool = False,
    ) -> None:
        if mem_type not in MEM_TYPES:
            raise InvalidArgument(f"mem_type={mem_type!r}: use 'VRAM' (GPU memory) or 'DRAM'")
        if agent is None:
            api: Any = nixl if nixl is not None else load_nixl()
            cfg = api.nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
            try:
                agent = api.nixl_agent(name, cfg)
            except Exception as exc:  # noqa: BLE001 - NIXL raises plain Exceptions of its own
                raise _nixl_error(f"nixl_agent({name!r})", exc) from None
            if "UCX" not in agent.backends:
                raise NixlError(f"nixl_agent({name!r}): the UCX backend did not load; 'gpupin nixl status' says why")
        self.agent = agent
        self.name = str(getattr(agent, "name", name))
        self.mem_type = mem_type
        self.devid = devid
        self.lock = threading.RLock()
        self._next = itertools.count(1)
        self._regs: dict[int, NixlRegistration] = {}
        self.registrations = 0
        self.deregistrations = 0
        self.register_s = 0.0
        self.deregister_s = 0.0

    # -- the device protocol of RegistrationCache ------------------------------
    def pin(self, va: int, size: int, *, persistent: bool = False, user_tag: int = 0) -> NixlRegistration:
        if size <= 0:
            raise InvalidArgument(f"register_memory({va:#x}, {size}): size must be > 0")
        what = f"register_memory({va:#x}, {size}, {self.mem_type})"
        with self.lock:
            t = time.perf_counter()
            try:
                dlist = self.agent.register_memory([(va, size, self.devid, "")], self.mem_type)
            except Exception as exc:  # noqa: BLE001
                raise _nixl_error(what, exc) from None
            finally:
                self.register_s += time.perf_counter() - t
            if dlist is None:
                raise NixlError(f"{what} failed (NIXL returned no descriptor list; its log says why)")
            h = next(self._next)
            reg = NixlRegistration(h, va, size, dlist)
            self._regs[h] = reg
            self.registrations += 1
            return reg

    def unpin(self, handle: Any) -> None:
        h = int(getattr(handle, "handle", handle))
        with self.lock:
            reg = self._regs.pop(h, None)
            if reg is None:
                raise UnknownHandle(f"NIXL registration {h}: not a registration of this driver")
            t = time.perf_counter()
            try:
                self.agent.deregister_memory(reg.dlist)
            except Exception as exc:  # noqa: BLE001
                raise _nixl_error(f"deregister_memory({reg.va:#x}, {reg.size})", exc) from None
            finally:
                self.deregister_s += time.perf_counter() - t
            self.deregistrations += 1

    @property
    def live(self) -> int:
        """Registrations made through this driver and not deregistered."""
        return len(self._regs)

    def close(self) -> None:
        """Close the cache over this driver (deregistering everything; InUse while one is held)."""
        self.close_cache()


class NixlCache(RegistrationCache):
    """The registration cache over NIXL: whole allocations, buffer-id checked, LRU, limits.

    ``acquire(ptr, size)`` registers the allocation holding ``ptr`` on first use; hold the
    :class:`~gpupin.cache.Registration` while a transfer uses it.  ``desc(reg)`` is the NIXL
    transfer descriptor of the registration's range.
    """

    def __init__(self, driver: NixlDriver, memory: MemoryProvider, *, max_bytes: int = 0, max_regions: int = 0) -> None:
        super().__init__(
            driver,
            memory,
            max_bytes=max_bytes,
            max_regions=max_regions,
            validate="tag",
            whole_allocation=True,
            sync_memops=driver.mem_type == "VRAM",  # RDMA reads the GPU's writes in order
        )
        self.driver = driver


@dataclass(frozen=True)
class RemoteBuffer:
    """A buffer a target exposed: where it is, which allocation it was (buffer id), the
    registration's generation, and the target agent's metadata (to connect and to see the
    registration).  ``to_bytes``/``from_bytes`` carry it over any channel."""

    agent: str
    addr: int
    size: int
    devid: int
    mem_type: str
    buffer_id: int
    generation: int
    metadata: bytes

    def to_bytes(self) -> bytes:
        head = struct.pack(
            "<QQQQqH", self.addr, self.size, self.devid, self.buffer_id, self.generation, len(self.agent)
        )
        return head + self.agent.encode() + self.mem_type.encode().ljust(4) + self.metadata

    @classmethod
    def from_bytes(cls, data: bytes) -> RemoteBuffer:
        n = struct.calcsize("<QQQQqH")
        addr, size, devid, bid, gen, alen = struct.unpack_from("<QQQQqH", data)
        agent = data[n : n + alen].decode()
        mem = data[n + alen : n + alen + 4].decode().strip()
        return cls(agent, addr, size, devid, mem, bid, gen, bytes(data[n + alen + 4 :]))


class NixlEndpoint(Closable):
    """A NIXL agent with its registration cache, for either side of a transfer.

    Target: ``ep.metadata()`` to the peer, ``ep.expose(ptr, size)`` for each buffer a peer may
    write or read (send ``.to_bytes()``), and ``ep.progress()`` (or ``serve``) while transfers
    come: it answers each one, after checking that the buffer is still the allocation it was.
    Initiator: ``ep.connect(metadata)``, then ``ep.write(src_ptr, size, remote)`` or
    ``ep.read(dst_ptr, size, remote)``: the local buffer is registered through the cache, the
    call returns when the data is in place and the target confirmed it, and raises StaleRemote
    if the target freed the buffer since it exposed it.
    """

    def __init__(
        self,
        name: str,
        memory: MemoryProvider,
        *,
        mem_type: str = "VRAM",
        devid: int | None = None,
        max_bytes: int = 0,
        agent: Any = None,
        nixl: Any = None,
    ) -> None:
        dev = int(getattr(memory, "device", 0)) if devid is None else devid
        self.driver = NixlDriver(agent, name=name, mem_type=mem_type, devid=dev, nixl=nixl)
        self.memory = memory
        self.cache = NixlCache(self.driver, memory, max_bytes=max_bytes)
        self._seq = itertools.count(1)
        self._acks: dict[int, tuple[int, int]] = {}
        self._other: list[tuple[str, bytes]] = []
        self._loaded: dict[str, set[int]] = {}  # peer -> the generations whose metadata was loaded
        self._plock = threading.Lock()  # notifications are taken by one thread at a time
        self.stale_transfers = 0  # (target) transfers that arrived for a buffer freed since
        self.transfers = 0
        self.confirm_s = 0.0

    @property
    def name(self) -> str:
        return self.driver.name

    @property
    def agent(self) -> Any:
        return self.driver.agent

    def metadata(self) -> bytes:
        with self.driver.lock:
            return bytes(self.agent.get_agent_metadata())

    def connect(self, metadata: bytes) -> str:
        """Load a peer agent's metadata (again after it registered more); returns its name."""
        with self.driver.lock:
            try:
                name = self.agent.add_remote_agent(metadata)
            except Exception as exc:  # noqa: BLE001
                raise _nixl_error("add_remote_agent", exc) from None
        return name.decode() if isinstance(name, bytes) else str(name)

    # -- target side -----------------------------------------------------------
    def expose(self, ptr: int, size: int) -> RemoteBuffer:
        """The descriptor of [ptr, ptr + size) for a peer: its allocation is registered (through
        the cache, so again only if it was freed and reallocated) and named by buffer id."""
        with self.cache.acquire(ptr, size) as reg:
            bid = self.cache._entry_of(reg.token).buffer_id  # type: ignore[union-attr]
            return RemoteBuffer(
                self.name, ptr, size, self.driver.devid, self.driver.mem_type, bid, reg.token, self.metadata()
            )

    def progress(self) -> list[tuple[str, bytes]]:
        """Take NIXL's new notifications: answer transfers (target), file answers (initiator);
        return the others, the application's own, as (peer, message)."""
        with self._plock:
            with self.driver.lock:
                new = self.agent.get_new_notifs()
            for peer, msgs in new.items():
                peer = peer.decode() if isinstance(peer, bytes) else str(peer)
                for m in msgs:
                    m = bytes(m)
                    if m.startswith(_XFER):
                        self._answer(peer, m[len(_XFER) :])
                    elif m.startswith(_ACK):
                        seq, status, bid = struct.unpack(_ACK_FMT, m[len(_ACK) :])
                        self._acks[seq] = (status, bid)
                    else:
                        self._other.append((peer, m))
            out, self._other = self._other, []
            return out

    def _answer(self, peer: str, body: bytes) -> None:
        seq, addr, size, bid, gen = struct.unpack(_XFER_FMT, body)
        try:
            now = self.memory.buffer_id(addr)
        except GpupinError:
            now = 0
        status = _ACK_OK if now == bid else _ACK_STALE
        if status == _ACK_STALE:
            self.stale_transfers += 1
        with self.driver.lock:
            self.agent.send_notif(peer, _ACK + struct.pack(_ACK_FMT, seq, status, now))

    def serve(self, seconds: float, until: Callable[[], bool] | None = None) -> list[tuple[str, bytes]]:
        """Run ``progress()`` for up to ``seconds`` (or until ``until()``); the app's notifications."""
        got: list[tuple[str, bytes]] = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not (until and until()):
            got += self.progress()
            time.sleep(0.0002)
        return got

    # -- initiator side ----------------------------------------------------------
    def write(self, src: int, size: int, remote: RemoteBuffer, offset: int = 0, **kw: Any) -> None:
        """Copy [src, src + size) into ``remote`` at ``offset``."""
        self._xfer("WRITE", src, size, remote, offset, **kw)

    def read(self, dst: int, size: int, remote: RemoteBuffer, offset: int = 0, **kw: Any) -> None:
        """Copy ``size`` bytes of ``remote`` at ``offset`` into [dst, dst + size)."""
        self._xfer("READ", dst, size, remote, offset, **kw)

    def _xfer(
        self,
        op: str,
        local: int,
        size: int,
        remote: RemoteBuffer,
        offset: int,
        *,
        timeout: float = 30.0,
        confirm: bool = True,
    ) -> None:
        if size <= 0 or offset < 0 or offset + size > remote.size:
            raise InvalidArgument(
                f"{op.lower()}({local:#x}, {size}, offset={offset}): [offset, offset + size) must lie inside the "
                f"remote buffer of {remote.size} bytes"
            )
        peer = remote.agent
        if remote.generation not in self._loaded.get(peer, set()):
            self.connect(remote.metadata)  # the target's registrations as of expose()
            self._loaded.setdefault(peer, set()).add(remote.generation)
        seq = next(self._seq)
        note = _XFER + struct.pack(_XFER_FMT, seq, remote.addr, remote.size, remote.buffer_id, remote.generation)
        what = f"NIXL {op} of {size} bytes with {peer}"
        with self.cache.acquire(local, size):  # held until the transfer is over
            with self.driver.lock:
                try:
                    ldesc = self.agent.get_xfer_descs([(local, size, self.driver.devid)], self.driver.mem_type)
                    rdesc = self.agent.get_xfer_descs([(remote.addr + offset, size, remote.devid)], remote.mem_type)
                    h = self.agent.initialize_xfer(op, ldesc, rdesc, peer, note)
                    state = self.agent.transfer(h)
                except Exception as exc:  # noqa: BLE001
                    raise _nixl_error(what, exc) from None
            deadline = time.monotonic() + timeout
            try:
                while state == "PROC":
                    if time.monotonic() > deadline:
                        raise NixlError(f"{what}: not done after {timeout} s (is the peer alive?)")
                    with self.driver.lock:
                        state = self.agent.check_xfer_state(h)
            finally:
                with self.driver.lock:
                    self.agent.release_xfer_handle(h)
            if state != "DONE":
                raise NixlError(f"{what} failed: {state} (the peer went away, or its registration did)", str(state))
        self.transfers += 1
        if confirm:
            self._confirm(seq, what, remote, deadline)

    def _confirm(self, seq: int, what: str, remote: RemoteBuffer, deadline: float) -> None:
        t = time.perf_counter()
        while seq not in self._acks:
            if time.monotonic() > deadline:
                raise NixlError(f"{what}: no answer from the target (it must call progress() or serve())")
            self.progress()
        self.confirm_s += time.perf_counter() - t
        status, now = self._acks.pop(seq)
        if status != _ACK_OK:
            raise StaleRemote(
                f"{what}: the target's buffer at {remote.addr:#x} is no longer the allocation it exposed "
                f"(buffer id {remote.buffer_id}, now {now or 'freed'}): the data did not reach it; ask the "
                "target to expose the buffer again"
            )

    def close(self) -> None:
        """Deregister everything (InUse while a transfer holds a registration)."""
        self.cache.close()
