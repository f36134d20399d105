"""NIXL: the registration cache in front of a ``nixl_agent``, and transfers that never land in freed memory.

NVIDIA's NIXL (``pip install nixl-cu13``; UCX inside) moves GPU memory between processes and
nodes.  Its ``register_memory`` is explicit and costly (an MR registration per buffer with an
RDMA NIC), and a registration outlives ``cuMemFree``: after a free and a new allocation at the
same address, a transfer through the old registration reports DONE and the data goes to the
freed allocation.  Here:

- :class:`NixlCache` is the registration cache over a :class:`NixlDriver` (the agent behind the
  cache's device protocol: ``pin`` registers the whole allocation, ``unpin`` deregisters it).
  Every hit is checked against the allocation's buffer id (the direct CUDA query of
  ``validate="buffer_id"``), a freed and reallocated buffer is registered again, idle registrations
  go least recently used first under ``max_bytes``, and one in use is never deregistered.
- :class:`NixlEndpoint` is an agent with its cache and a small protocol on NIXL's
  notifications.  ``expose(ptr, size)`` gives a :class:`RemoteBuffer` (address, buffer id and
  registration generation, and the agent's metadata) to send to a peer; the peer's
  ``write``/``read`` take it.  Each transfer carries the buffer id it was meant for, the target
  checks it when the transfer's notification arrives (``progress()``), and the initiator waits
  for that answer: a transfer into a buffer the target freed since raises :class:`StaleRemote`
  instead of reporting success.

- :func:`probe` says what NIXL can do on this host (``gpupin nixl status``, ``gpupin doctor``):
  its version, each backend plugin that loads or why not, VRAM, and :func:`selftest`, one
  DRAM write through two endpoints in this process.

NIXL is imported when a driver is made (``load_nixl``), never at ``import gpupin``.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import itertools
import logging
import os
import re
import secrets
import struct
import sys
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._closable import Closable
from ._dlopen import flush_c_stdio, load
from .cache import LibraryDriver, LibraryRegistration, RegistrationCache
from .errors import DriverNotLoaded, GpupinError, InUse, InvalidArgument, UnknownHandle
from .memory import MemoryProvider

MEM_TYPES = ("VRAM", "DRAM")
INSTALL = "pip install --no-deps nixl-cu13 numpy"

# The protocol on NIXL notifications: a transfer's own notification, and the target's answer.
_XFER = b"gpupin-nixl-xfer/1:"
_ACK = b"gpupin-nixl-ack/1:"
_XFER_FMT = "<QQQQq"  # sequence, address, size, buffer id, generation
_ACK_FMT = "<QBQ"  # sequence, status (0: delivered, 1: stale), the buffer id found there
_ACK_OK, _ACK_STALE = 0, 1
_XFER_LEN, _ACK_LEN = struct.calcsize(_XFER_FMT), struct.calcsize(_ACK_FMT)
_LOADED_PER_PEER = 256  # generations remembered as loaded, per peer (a bound, not a cache size)


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
        f"NIXL is not installed for this Python ({'; '.join(errors)}): {INSTALL} (numpy is all it "
        "needs besides; its declared torch dependency is optional)"
    )


def nixl_version() -> str | None:
    from importlib import metadata

    for dist in ("nixl-cu13", "nixl-cu12", "nixl"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


# -- NIXL and the garbage collector ---------------------------------------------------------------
# NIXL's default thread mode locks nothing, and UCX aborts the process (an assertion in its
# arbiter) when an agent is destroyed before it progressed the failure of a peer that went away
# (seen here: 2 aborts in ~120 destructions right after a killed peer's failed transfer, none in 80
# after 0.3 s of progress).  The cyclic garbage collector runs finalizers on whichever thread allocates,
# at any moment, also in the middle of that thread's own NIXL call.  So gpupin:
# - calls an agent only under that agent's lock, one lock for every driver of the agent;
# - makes no NIXL call while this thread collects garbage: a deregistration or an agent's retirement
#   asked for by a finalizer waits in _DEFERRED and runs at gpupin's next NIXL call outside the
#   collector, in reap(), or at exit;
# - releases every transfer handle itself (a handle NIXL would not release is kept and retried,
#   never left to its finalizer), and retires an agent it made in close(): after a peer failed,
#   it progresses the agent for SETTLE_S first, then drops the last reference right there.
SETTLE_S = 0.3

_gc_state = threading.local()
_DEFERRED: list[Callable[[], None]] = []
_AGENT_LOCKS: weakref.WeakKeyDictionary[Any, threading.RLock] = weakref.WeakKeyDictionary()
_registry_lock = threading.Lock()  # guards _DEFERRED and _AGENT_LOCKS; held for no NIXL call
_UNRELEASABLE: list[Any] = []  # transfer handles NIXL refused to release: never finalized before exit


def _gc_phase(phase: str, info: dict[str, Any]) -> None:
    _gc_state.collecting = phase == "start"


gc.callbacks.append(_gc_phase)


def collecting() -> bool:
    """True while this thread runs the cyclic garbage collector (and the finalizers it calls)."""
    return bool(getattr(_gc_state, "collecting", False))


def _defer(work: Callable[[], None]) -> None:
    with _registry_lock:
        _DEFERRED.append(work)


def reap() -> int:
    """Run the NIXL work finalizers left for later (deregistrations, agents to retire) on this
    thread, now; the number of items run.  gpupin does this itself before each NIXL call and at
    exit; call it to have it done at a time of your choosing.  Does nothing inside a finalizer."""
    done = 0
    while _DEFERRED and not collecting():  # the common case, nothing deferred: no lock taken
        with _registry_lock:
            if not _DEFERRED:
                break
            work = _DEFERRED.pop(0)
        try:
            work()
        except Exception as exc:  # noqa: BLE001 - one failure must not keep the rest waiting
            what = f"{type(exc).__name__}: {exc}"
            warnings.warn(f"gpupin.nixl: deferred NIXL cleanup failed: {what}", RuntimeWarning, stacklevel=2)
        done += 1
    return done


atexit.register(reap)


def _lock_of(agent: Any) -> threading.RLock:
    """The one lock of ``agent``, shared by every driver over it."""
    with _registry_lock:
        try:
            lock = _AGENT_LOCKS.get(agent)
            if lock is None:
                lock = _AGENT_LOCKS[agent] = threading.RLock()
        except TypeError:  # an agent that takes no weak reference (a test double): its own lock
            lock = threading.RLock()
        return lock


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
    is made under the agent's lock (``lock``, one for all drivers of an agent): NIXL's default
    thread mode locks nothing.  ``close()`` retires an agent the driver made (see SETTLE_S);
    an agent passed in stays the caller's to drop.
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
        reap()
        made_here = agent is None
        if agent is None:
            api: Any = nixl if nixl is not None else load_nixl()
            cfg = api.nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
            try:
                agent = api.nixl_agent(name, cfg)
            except Exception as exc:  # noqa: BLE001 - NIXL raises plain Exceptions of its own
                raise _nixl_error(f"nixl_agent({name!r})", exc) from None
            if "UCX" not in agent.backends:
                raise NixlError(f"nixl_agent({name!r}): the UCX backend did not load; 'gpupin nixl status' says why")
        self._agent: Any = agent
        self._owns_agent = made_here
        self._settle_until = 0.0  # progress the agent until then before it is destroyed
        self._stuck: list[Any] = []  # transfer handles NIXL did not release yet
        self.name = str(getattr(agent, "name", name))
        self.mem_type = mem_type
        self.devid = devid
        self.lock = _lock_of(agent)
        self._next = itertools.count(1)
        self._regs: dict[int, NixlRegistration] = {}
        self.registrations = 0
        self.deregistrations = 0
        self.register_s = 0.0
        self.deregister_s = 0.0

    @property
    def agent(self) -> Any:
        """The ``nixl_agent``; NixlError once close() retired it."""
        agent = self._agent
        if agent is None:
            raise NixlError(f"NIXL agent {self.name!r}: closed (its driver retired it); make a new endpoint")
        return agent

    def peer_failed(self) -> None:
        """A transfer or notification with a peer failed: progress the agent for SETTLE_S before
        it is destroyed (UCX aborts the process when it destroys an unprogressed failure)."""
        self._settle_until = time.monotonic() + SETTLE_S

    def release_xfer(self, handle: Any) -> bool:
        """Release a transfer handle under the lock; one NIXL refuses (a transfer it cannot
        cancel) is kept and retried, never left to its finalizer.  False if it was kept."""
        with self.lock:
            try:
                self.agent.release_xfer_handle(handle)
                return True
            except Exception:  # noqa: BLE001 - NIXL's own classes; retried in _retry_stuck
                self._stuck.append(handle)
                self.peer_failed()
                return False

    def _retry_stuck(self) -> None:
        with self.lock:
            stuck, self._stuck = self._stuck, []
            for h in stuck:
                self.release_xfer(h)

    # -- the device protocol of RegistrationCache ------------------------------
    def pin(self, va: int, size: int, *, persistent: bool = False, user_tag: int = 0) -> NixlRegistration:
        if size <= 0:
            raise InvalidArgument(f"register_memory({va:#x}, {size}): size must be > 0")
        what = f"register_memory({va:#x}, {size}, {self.mem_type})"
        reap()
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
        if collecting():  # a finalizer: deregistered at the next NIXL call outside the collector
            _defer(lambda: self.unpin(h))
            return
        with self.lock:
            reg = self._regs.get(h)
            if reg is None:
                raise UnknownHandle(f"NIXL registration {h}: not a registration of this driver")
            t = time.perf_counter()
            try:
                self.agent.deregister_memory(reg.dlist)
            except Exception as exc:  # noqa: BLE001 - still registered: `live` keeps counting it
                raise _nixl_error(f"deregister_memory({reg.va:#x}, {reg.size})", exc) from None
            finally:
                self.deregister_s += time.perf_counter() - t
            del self._regs[h]
            self.deregistrations += 1

    @property
    def live(self) -> int:
        """Registrations made through this driver and not deregistered."""
        return len(self._regs)

    def close(self) -> None:
        """Close the cache over this driver (deregistering everything; InUse while one is held),
        then retire the agent if this driver made it."""
        self.close_cache()
        self._retire()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001, S110 - InUse: a registration held by garbage too
            pass
        if getattr(self, "_agent", None) is not None and self._owns_agent:
            self._retire()  # from the collector: deferred to reap(), never done in it

    def _retire(self) -> None:
        if self._agent is None or not self._owns_agent:
            return
        if collecting():  # a finalizer: the agent lives until the next NIXL call outside it
            _defer(self._retire)
            return
        self._owns_agent = False
        with self.lock:
            agent = self._agent
            self._retry_stuck()
            while time.monotonic() < self._settle_until:
                try:
                    agent.get_new_notifs()  # progresses UCX: the failed peer's requests end
                except Exception:  # noqa: BLE001, S110 - progress only
                    pass
                time.sleep(0.001)
            if self._stuck:
                warnings.warn(
                    f"gpupin.nixl: agent {self.name!r} keeps {len(self._stuck)} transfer(s) NIXL would not "
                    "release; they and the agent stay until the process exits",
                    RuntimeWarning,
                    stacklevel=3,
                )
                _UNRELEASABLE.extend(self._stuck)
                self._stuck = []
            self._agent = None
        del agent  # the last reference the driver had: destroyed here, on this thread


class NixlCache(RegistrationCache):
    """The registration cache over NIXL: whole allocations, buffer-id checked, LRU, limits.

    ``acquire(ptr, size)`` registers the allocation holding ``ptr`` on first use; hold the
    :class:`~gpupin.cache.Registration` while a transfer uses it (NIXL finds the registration
    by address: describe the transfer with ``agent.get_xfer_descs`` as usual).
    """

    def __init__(self, driver: NixlDriver, memory: MemoryProvider, *, max_bytes: int = 0, max_regions: int = 0) -> None:
        super().__init__(
            driver,
            memory,
            max_bytes=max_bytes,
            max_regions=max_regions,
            validate="buffer_id",
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
        name = self.agent.encode()
        head = struct.pack("<QQQQqH", self.addr, self.size, self.devid, self.buffer_id, self.generation, len(name))
        return head + name + self.mem_type.encode().ljust(4) + self.metadata

    @classmethod
    def from_bytes(cls, data: bytes) -> RemoteBuffer:
        n = struct.calcsize("<QQQQqH")
        addr, size, devid, bid, gen, alen = struct.unpack_from("<QQQQqH", data)
        agent = bytes(data[n : n + alen]).decode()
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
        # Sequence numbers start anywhere, and an answer counts only from the peer asked: two
        # endpoints (or an application) reading one agent's notifications cannot take each
        # other's answers for their own.
        self._seq = itertools.count(secrets.randbits(62))
        self._acks: dict[tuple[str, int], tuple[int, int]] = {}
        self._waiting: set[tuple[str, int]] = set()
        self._other: list[tuple[str, bytes]] = []
        self._loaded: dict[str, dict[int, None]] = {}  # peer -> (generation, metadata) keys loaded, oldest first
        self._exposed: dict[tuple[int, int], Any] = {}  # (addr, size) -> the Registration held
        self.unanswered = 0  # (target) transfers it could not answer: see progress()
        self._plock = threading.Lock()  # notifications are taken by one thread at a time
        self.stale_transfers = 0  # (target) transfers that arrived for a buffer freed since
        self._inflight: list[tuple[Any, Any, str, str]] = []  # (handle, registration, what, peer): past their timeout
        self.malformed_notifications = 0  # with gpupin's prefix but not its layout (progress() returns them)
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

    def _reload(self, peer: str, metadata: bytes) -> None:
        """Load ``peer``'s metadata as of an expose().

        NIXL refuses to load metadata of an agent name it knows from another incarnation (a
        restarted peer: NIXL_ERR_NOT_ALLOWED for the UCX connection info, seen here) and, on an
        H200 over VRAM, a registration at an address it knew from an earlier registration of the
        peer.  Then the peer is forgotten (remove_remote_agent) and its metadata loaded afresh,
        once; unless a transfer with it still runs (settle() first).  What NIXL still refuses
        after that is raised, and tried again at the next transfer.
        """
        try:
            self.connect(metadata)
            return
        except NixlError as exc:
            if exc.status not in ("nixlNotAllowedError", "nixlInvalidParamError"):
                raise
            first = exc
        if any(p == peer for _, _, _, p in self._inflight):
            raise NixlError(
                f"NIXL will not load {peer}'s new metadata ({first.status}) and a transfer with {peer} still runs "
                "past its timeout: settle() first, then try again",
                first.status,
            )
        with self.driver.lock:
            try:
                self.agent.remove_remote_agent(peer)
            except Exception as exc:  # noqa: BLE001 - NIXL's own classes
                raise _nixl_error(f"remove_remote_agent({peer!r})", exc) from None
        self._loaded.pop(peer, None)
        try:
            self.connect(metadata)
        except NixlError as exc:
            raise NixlError(
                f"NIXL will not load {peer}'s metadata ({first.status}), nor after forgetting the peer "
                f"({exc.status}); on VRAM NIXL 1.5.1 then loads no more of that peer: reach it from a new "
                "NixlEndpoint (a new agent)",
                exc.status,
            ) from None

    # -- target side -----------------------------------------------------------
    def expose(self, ptr: int, size: int) -> RemoteBuffer:
        """The descriptor of [ptr, ptr + size) for a peer: its allocation is registered (through
        the cache, so again only if it was freed and reallocated) and named by buffer id.  The
        registration is held (never evicted) until ``unexpose`` or ``close``; exposing the same
        range again replaces it.  Peers must be connected both ways (``connect`` with each
        other's ``metadata()``): the target answers each transfer through NIXL."""
        reg = self.cache.acquire(ptr, size)
        old = self._exposed.pop((ptr, size), None)
        self._exposed[(ptr, size)] = reg
        if old is not None:
            old.release()
        return RemoteBuffer(
            self.name, ptr, size, self.driver.devid, self.driver.mem_type, reg.buffer_id, reg.token, self.metadata()
        )

    def unexpose(self, remote: RemoteBuffer) -> None:
        """Let the registration of an exposed range go (the cache may evict it from now on)."""
        reg = self._exposed.pop((remote.addr, remote.size), None)
        if reg is not None:
            reg.release()

    def progress(self) -> list[tuple[str, bytes]]:
        """Take NIXL's new notifications: answer transfers (target), file answers (initiator);
        return the others, the application's own, as (peer, message), also those that came
        while a write or read waited for its answer."""
        self._pump()
        with self._plock:
            out, self._other = self._other, []
        return out

    def _pump(self) -> None:
        reap()
        with self._plock:
            with self.driver.lock:
                try:
                    new = self.agent.get_new_notifs()
                except Exception as exc:  # noqa: BLE001
                    self.driver.peer_failed()
                    raise _nixl_error("get_new_notifs", exc) from None
            for peer, msgs in new.items():
                peer = peer.decode() if isinstance(peer, bytes) else str(peer)
                for m in msgs:
                    m = bytes(m)
                    if m.startswith(_XFER) and len(m) == len(_XFER) + _XFER_LEN:
                        self._answer(peer, m[len(_XFER) :])
                    elif m.startswith(_ACK) and len(m) == len(_ACK) + _ACK_LEN:
                        seq, status, bid = struct.unpack(_ACK_FMT, m[len(_ACK) :])
                        if (peer, seq) in self._waiting:  # else late (timed out) or not ours
                            self._acks[(peer, seq)] = (status, bid)
                    else:
                        if m.startswith((_XFER, _ACK)):  # our prefix, not our layout: the app's to see
                            self._malformed(peer, m)
                        self._other.append((peer, m))

    def _malformed(self, peer: str, m: bytes) -> None:
        self.malformed_notifications += 1
        if self.malformed_notifications == 1:
            warnings.warn(
                f"gpupin.nixl: a notification from {peer} starts with gpupin's prefix but is {len(m)} bytes, "
                "not one of gpupin's messages: handed to the application as its own (counted in "
                "malformed_notifications); is another gpupin version, or the application, using the prefix?",
                RuntimeWarning,
                stacklevel=4,
            )

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
            try:
                self.agent.send_notif(peer, _ACK + struct.pack(_ACK_FMT, seq, status, now))
            except Exception as exc:  # noqa: BLE001 - the other answers still go
                self.driver.peer_failed()
                self.unanswered += 1
                if self.unanswered == 1:
                    warnings.warn(
                        f"gpupin.nixl: cannot answer a transfer of {peer} ({type(exc).__name__} {exc}): "
                        f"load its metadata here first (connect() with {peer}'s metadata()); it waits in vain",
                        RuntimeWarning,
                        stacklevel=3,
                    )

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
        reap()
        if self._inflight:
            self._poll_inflight()
        peer = remote.agent
        # A generation names a registration within one incarnation of the peer; with the
        # metadata it is unique across restarts (a restarted peer counts generations anew).
        mdkey = hash((remote.generation, remote.metadata))
        loaded = self._loaded.get(peer)
        if loaded is None or mdkey not in loaded:
            self._reload(peer, remote.metadata)  # the target's registrations as of expose()
            loaded = self._loaded.setdefault(peer, {})
            loaded[mdkey] = None
            while len(loaded) > _LOADED_PER_PEER:
                del loaded[next(iter(loaded))]  # the oldest: loading it again costs a reload, no more
        seq = next(self._seq)
        note = _XFER + struct.pack(_XFER_FMT, seq, remote.addr, remote.size, remote.buffer_id, remote.generation)
        what = f"NIXL {op} of {size} bytes with {peer}"
        key = (peer, seq)
        if confirm:
            self._waiting.add(key)
        try:
            # Held until NIXL says the transfer ended (past a timeout too: see _post).
            # confirm=False: no check asked for (the target neither answers nor counts it).
            self._post(op, self.cache.acquire(local, size), remote, offset, note if confirm else b"", what, timeout)
            self.transfers += 1
            if confirm:
                self._confirm(key, op, what, remote, time.monotonic() + timeout)
        finally:
            self._waiting.discard(key)
            self._acks.pop(key, None)

    def _post(
        self, op: str, reg: Any, remote: RemoteBuffer, offset: int, note: bytes, what: str, timeout: float
    ) -> None:
        """One NIXL transfer from the held registration ``reg``, polled to its end; its handle
        released on every path (by the driver, never by NIXL's finalizer: no frame of an
        exception keeps it), and ``reg`` with it.  A transfer still running at ``timeout`` is
        neither released (that would cancel only UCX's requests, not bytes on their way) nor
        lets go of ``reg``: both wait in ``_inflight`` until NIXL says it ended (``settle``)."""
        local, size = reg.ptr, reg.size
        h = None
        state = "ERR"
        handed = False
        try:
            with self.driver.lock:
                ldesc = self.agent.get_xfer_descs([(local, size, self.driver.devid)], self.driver.mem_type)
                rdesc = self.agent.get_xfer_descs([(remote.addr + offset, size, remote.devid)], remote.mem_type)
                h = self.agent.initialize_xfer(op, ldesc, rdesc, remote.agent, note)
                state = self.agent.transfer(h)
            deadline = time.monotonic() + timeout
            while state == "PROC":
                if time.monotonic() > deadline:
                    self._inflight.append((h, reg, what, remote.agent))
                    h, handed = None, True
                    raise NixlError(
                        f"{what}: not done after {timeout} s (is the peer alive?). NIXL may still be moving its "
                        f"bytes: the local buffer at {local:#x} stays registered, and must be neither freed nor "
                        "reused, until settle() says the transfer ended",
                        "timeout",
                    )
                with self.driver.lock:
                    state = self.agent.check_xfer_state(h)
        except NixlError:
            self.driver.peer_failed()
            raise
        except Exception as exc:  # noqa: BLE001 - NIXL's own classes (a peer gone: REMOTE_DISCONNECT)
            self.driver.peer_failed()
            raise _nixl_error(what, exc) from None
        finally:
            if h is not None:
                self.driver.release_xfer(h)  # the transfer's own error, if any, says more
                h = None
            if not handed:
                reg.release()
        if state != "DONE":
            self.driver.peer_failed()
            raise NixlError(f"{what} failed: {state} (the peer went away, or its registration did)", str(state))

    def _confirm(self, key: tuple[str, int], op: str, what: str, remote: RemoteBuffer, deadline: float) -> None:
        t = time.perf_counter()
        while key not in self._acks:
            if time.monotonic() > deadline:
                raise NixlError(
                    f"{what}: no answer from the target (it must call progress() or serve(), and have "
                    "loaded this endpoint's metadata)"
                )
            self._pump()
        self.confirm_s += time.perf_counter() - t
        status, now = self._acks.pop(key)
        if status != _ACK_OK:
            lost = (
                "the data did not reach it"
                if op == "WRITE"
                else "the bytes read are not that buffer's (the local buffer was overwritten)"
            )
            raise StaleRemote(
                f"{what}: the target's buffer at {remote.addr:#x} is no longer the allocation it exposed "
                f"(buffer id {remote.buffer_id}, now {now or 'freed'}): {lost}; ask the target to expose the "
                "buffer again"
            )

    def pending_transfers(self) -> int:
        """Transfers that outlived their write()/read() (a timeout) and NIXL has not ended yet:
        their local buffers stay registered and must not be freed."""
        self._poll_inflight()
        return len(self._inflight)

    def settle(self, timeout: float = 30.0) -> int:
        """Wait up to ``timeout`` s for the transfers that outlived their call to end; each that
        ended lets go of its handle and its local registration.  Returns how many still run."""
        deadline = time.monotonic() + timeout
        while self.pending_transfers() and time.monotonic() < deadline:
            time.sleep(0.001)
        return len(self._inflight)

    def _poll_inflight(self) -> None:
        with self.driver.lock:
            still = []
            for h, reg, what, peer in self._inflight:
                try:
                    state = self.agent.check_xfer_state(h)
                except Exception:  # noqa: BLE001 - NIXL's own classes: the transfer is over, failed
                    state = "ERR"
                if state == "PROC":
                    still.append((h, reg, what, peer))
                    continue
                self.driver.release_xfer(h)
                reg.release()
            self._inflight = still

    def close(self) -> None:
        """Let go of the exposed ranges, deregister everything (InUse while a transfer holds a
        registration) and retire the agent if the endpoint made it.  A transfer that outlived
        its call is waited for up to 5 s (``settle``), then close() raises InUse naming it.  An
        endpoint dropped without close() makes no NIXL call from the garbage collector: see reap()."""
        if self._inflight and not collecting() and self.settle(5.0):
            raise InUse(
                f"NixlEndpoint {self.name!r}: {len(self._inflight)} transfer(s) still running past their timeout "
                f"({self._inflight[0][2]}); their buffers stay registered: settle() and close() again"
            )
        for reg in self._exposed.values():
            reg.release()
        self._exposed.clear()
        self.driver.close()


# -- what works here: 'gpupin nixl status' and 'gpupin doctor' ----------------------------------
@dataclass
class PluginStatus:
    """A NIXL backend plugin on this host: whether its backend is created, its memory types
    (the backend's when it loads, else what the plugin declares), and why it does not load."""

    name: str
    loads: bool
    mem_types: list[str]
    error: str = ""


@dataclass
class NixlStatus:
    """What :func:`probe` found.  ``error``: why NIXL is not usable at all (not installed, or
    no agent could be made); ``selftest`` is None when it did not run; ``log`` is what NIXL,
    UCX and the plugins printed meanwhile."""

    installed: bool
    version: str | None = None
    module: str = ""
    location: str = ""
    error: str = ""
    plugins: list[PluginStatus] = field(default_factory=list)
    vram: bool = False
    vram_detail: str = ""
    selftest: bool | None = None
    selftest_detail: str = ""
    log: str = ""

    def plugin(self, name: str) -> PluginStatus | None:
        return next((p for p in self.plugins if p.name == name), None)


class _Captured:
    """File descriptors 1 and 2 into a temporary file while NIXL runs: its C++ log, UCX's and
    the plugins' own prints (GUSLI's go to stdout) would otherwise land in a command's output.
    ``mark()`` and ``since(mark)`` read what came in between.  NIXL's Python logger is quieted
    meanwhile (its warnings carry tracebacks of no use here)."""

    def __enter__(self) -> _Captured:
        _flush_all()
        self._file = tempfile.TemporaryFile()
        self._saved = (os.dup(1), os.dup(2))
        os.dup2(self._file.fileno(), 1)
        os.dup2(self._file.fileno(), 2)
        self._logger = logging.getLogger("nixl")
        self._level = self._logger.level
        return self

    def quiet_python_log(self) -> None:
        """Call after NIXL's import, which sets its logger's level."""
        self._level = self._logger.level
        self._logger.setLevel(logging.CRITICAL)

    def mark(self) -> int:
        _flush_all()
        return os.lseek(self._file.fileno(), 0, os.SEEK_CUR)

    def since(self, mark: int) -> str:
        end = self.mark()
        return os.pread(self._file.fileno(), end - mark, mark).decode(errors="replace")

    def __exit__(self, *exc: object) -> None:
        self.text = self.since(0)
        for fd, saved in zip((1, 2), self._saved, strict=True):
            os.dup2(saved, fd)
            os.close(saved)
        self._file.close()
        self._logger.setLevel(self._level)


def _flush_all() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    flush_c_stdio()  # the C libraries' buffered stdout


_GLOG_PREFIX = re.compile(r"^[IWEF]\d{4} [\d:.]+\s+\d+ [^\]]*\] ")
_ANSI = re.compile(r"\x1b\[[\d;]*m")


def _log_lines(text: str) -> list[str]:
    return [_GLOG_PREFIX.sub("", _ANSI.sub("", line)).strip() for line in text.splitlines() if line.strip()]


def _short(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _plugin_dirs(api: Any) -> list[Path]:
    dirs = [Path(d) for d in os.environ.get("NIXL_PLUGIN_DIR", "").split(":") if d]
    site = Path(api.__file__).resolve().parent.parent
    return [*dirs, *sorted(site.glob(f".{api.__name__.split('.')[0]}*.libs/plugins"))]


def _why_not(api: Any, name: str, exc: BaseException, log: str) -> str:
    """The short reason a backend was not created, from NIXL's log, else from loading the
    plugin's library ourselves (NIXL logs that only at INFO), else the exception."""
    lines = _log_lines(log)
    for line in lines:
        m = re.search(r"Failed to create engine: (.*)", line)
        if m:
            return _short(m.group(1))
    if "NotFound" in type(exc).__name__:
        for d in _plugin_dirs(api):
            lib = d / f"libplugin_{name}.so"
            if lib.exists():
                try:
                    load(str(lib))
                except OSError as err:  # cffi says "cannot load library 'lib': <dlerror>"
                    m = re.search(r"(\S+): cannot open shared object file", str(err))
                    return _short(f"needs {m.group(1)}, not found here" if m else f"its library does not load: {err}")
                break
    errors = [line for line in lines if "unsupported backend" not in line]
    return _short(f"{type(exc).__name__}: {exc}" + (f" ({errors[-1]})" if errors else ""))


def probe(*, selftest: bool = True, timeout: float = 10.0) -> NixlStatus:
    """What NIXL can do on this host (``gpupin nixl status``, ``gpupin doctor``); never raises.

    Imports NIXL (:func:`load_nixl`), makes an agent with UCX as :class:`NixlDriver` does and
    a throwaway one on which every other plugin's backend is created, checks VRAM (UCX's
    memory types and the CUDA driver, :func:`gpupin.cuda.driver_status`) and, with
    ``selftest``, runs :func:`selftest` on the UCX agent.  Output that NIXL and its libraries
    print meanwhile is captured (``NixlStatus.log``): the reasons are read from it.
    """
    from .cuda import driver_status

    with _Captured() as cap:
        st = _probe(cap, selftest, timeout)
        gc.collect()  # the agents go now, while their goodbyes are still captured
    st.log = cap.text
    ucx = st.plugin("UCX")
    if ucx is None or not ucx.loads:
        st.vram_detail = "NIXL's UCX backend does not load"
    elif "VRAM_SEG" not in ucx.mem_types:
        st.vram_detail = f"NIXL's UCX backend has no VRAM_SEG ({', '.join(ucx.mem_types)}): built without CUDA"
    else:
        st.vram, seen = driver_status()
        st.vram_detail = f"UCX lists VRAM_SEG; {seen}"
    return st


def _probe(cap: _Captured, selftest_too: bool, timeout: float) -> NixlStatus:
    try:
        api = load_nixl()
    except DriverNotLoaded as exc:
        return NixlStatus(False, error=str(exc))
    cap.quiet_python_log()
    st = NixlStatus(True, nixl_version(), api.__name__, str(Path(api.__file__).resolve().parent))
    tag = f"{os.getpid()}-{next(_probes)}"
    agent = None
    mark = cap.mark()
    try:
        agent = api.nixl_agent(f"gpupin-probe-{tag}", api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    except Exception as exc:  # noqa: BLE001 - NIXL raises plain Exceptions of its own
        st.plugins.append(PluginStatus("UCX", False, [], _why_not(api, "UCX", exc, cap.since(mark))))
    else:
        if "UCX" in agent.backends:
            st.plugins.append(PluginStatus("UCX", True, list(agent.get_backend_mem_types("UCX"))))
        else:
            st.plugins.append(PluginStatus("UCX", False, [], "the agent was made without it (not in its plugin list?)"))
    try:
        spare = api.nixl_agent(
            f"gpupin-probe-spare-{tag}", api.nixl_agent_config(enable_prog_thread=False, backends=[])
        )
        names = list(spare.get_plugin_list())
    except Exception as exc:  # noqa: BLE001
        st.error = _short(f"no NIXL agent could be made: {type(exc).__name__}: {exc}")
        return st
    if "UCX" not in names:
        st.plugins[0] = PluginStatus("UCX", False, [], "NIXL found no UCX plugin")
    for name in sorted(n for n in names if n != "UCX"):
        mark = cap.mark()
        try:
            spare.create_backend(name, initParams={})
        except Exception as exc:  # noqa: BLE001
            declared = list(spare.get_plugin_mem_types(name))
            st.plugins.append(PluginStatus(name, False, declared, _why_not(api, name, exc, cap.since(mark))))
        else:
            st.plugins.append(PluginStatus(name, True, list(spare.get_backend_mem_types(name))))
    del spare
    if selftest_too and agent is not None and st.plugins[0].loads:
        try:
            st.selftest_detail = selftest(agent=agent, timeout=timeout)
            st.selftest = True
        except Exception as exc:  # noqa: BLE001 - whatever failed is the answer
            st.selftest, st.selftest_detail = False, _short(f"{type(exc).__name__}: {exc}", 300)
    return st


_probes = itertools.count(1)


def selftest(*, size: int = 64 << 10, agent: Any = None, timeout: float = 10.0) -> str:
    """gpupin.nixl end to end in this process: two endpoints over host memory (DRAM), one
    write of ``size`` bytes through the caches, confirmed by the target and read back.  The
    target's agent is ``agent`` (one with UCX) or a new one.  Returns what it did; raises
    (NixlError, GpupinError or NIXL's own) when something did not work."""
    from .hostmem import HostMemory

    mt, mi = HostMemory(max(size, 1 << 20)), HostMemory(max(size, 1 << 20))
    tag = f"{os.getpid()}-{next(_probes)}"
    endpoints: list[NixlEndpoint] = []
    stop = threading.Event()
    pump: threading.Thread | None = None
    try:
        tgt = NixlEndpoint(f"gpupin-selftest-target-{tag}", mt, mem_type="DRAM", agent=agent)
        endpoints.append(tgt)
        ini = NixlEndpoint(f"gpupin-selftest-initiator-{tag}", mi, mem_type="DRAM")
        endpoints.append(ini)
        ini.connect(tgt.metadata())
        tgt.connect(ini.metadata())
        dst, src = mt.alloc(size), mi.alloc(size)
        data = bytes(range(256)) * (size // 256) + bytes(size % 256)
        mi.write(src, data)
        remote = tgt.expose(dst, size)
        pump = threading.Thread(target=tgt.serve, args=(timeout, stop.is_set), daemon=True, name="gpupin-selftest")
        pump.start()
        t = time.perf_counter()
        ini.write(src, size, remote, timeout=timeout)
        took = time.perf_counter() - t
        got = mt.read(dst, size)
        if got != data:
            bad = sum(a != b for a, b in zip(got, data, strict=True))
            raise NixlError(f"the write of {size} bytes was confirmed, but {bad} bytes differ at the target")
        return (
            f"{size >> 10} KiB written over UCX between two agents in this process (DRAM), "
            f"confirmed by the target and read back equal in {took * 1e3:.1f} ms"
        )
    finally:
        stop.set()
        if pump is not None:
            pump.join()
        for ep in reversed(endpoints):
            ep.close()
        mi.close()
        mt.close()
