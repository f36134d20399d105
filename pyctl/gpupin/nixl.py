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
  notifications.  ``expose(ptr, size)`` gives a :class:`RemoteBuffer` (address, buffer id,
  epoch, and the agent's metadata) to send to a peer; the peer's ``write``/``read``,
  ``post_write``/``post_read`` (a :class:`Transfer`) and ``prepare`` (a :class:`Prepared`,
  NIXL's prepped lists) take it.  Prevention: an initiator transfers into an exposure only
  under a lease the target granted, and ``unexpose`` (which the provider's free waits for)
  revokes the leases and returns once every holder's transfers are over; a refused lease
  raises :class:`StaleRemote` before any byte moves.  Detection, the backstop: the target's
  watch finds an exposed buffer freed behind the provider's hold, and checks the exposure,
  epoch and buffer id of a transfer posted with ``confirm=True`` when its check message
  arrives (``wait(confirm=True)`` waits for that answer).  Documentation/gds-nixl.md says which
  guarantee is which and what the application promises.

- :func:`probe` says what NIXL can do on this host (``gpupin nixl status``, ``gpupin doctor``):
  its version, each backend plugin that loads or why not, VRAM, and :func:`selftest`, one
  DRAM write through two endpoints in this process.

NIXL is imported when a driver is made (``load_nixl``), never at ``import gpupin``.
"""

from __future__ import annotations

import atexit
import collections
import gc
import importlib
import itertools
import logging
import operator
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from ._closable import Closable
from ._dlopen import flush_c_stdio, load
from .cache import LibraryDriver, LibraryRegistration, Registration, RegistrationCache
from .errors import DriverNotLoaded, GpupinError, InUse, InvalidArgument, UnknownHandle
from .memory import MemoryProvider

MEM_TYPES = ("VRAM", "DRAM")
INSTALL = "pip install --no-deps nixl-cu13 numpy"

# The protocol on NIXL notifications, version 5: one prefix, a kind byte, a fixed layout per kind
# (HOLD, GRANT and XFER carry a count, then that many entries).  See NixlEndpoint.
_PREFIX = b"gpupin-nixl/5:"
_HOLD, _GRANT, _XFER, _ACK, _REVOKE, _DROP = b"H", b"G", b"X", b"A", b"R", b"D"
_MDASK, _MD = b"M", b"m"  # a target's current metadata, asked for and sent (its bytes follow the head)
_DROPPED = b"d"  # a target has a closing initiator's drop (DROP's third field asks for it)
_WHO, _IAM = b"W", b"w"  # which incarnation a target runs now, asked for and said
_HEAD = {
    _HOLD: "<QH", _GRANT: "<QH", _XFER: "<QH", _ACK: "<QBQ", _REVOKE: "<QB", _DROP: "<QQBQ", _MDASK: "<Q",
    _MD: "<QQQ", _DROPPED: "<Q", _WHO: "<Q", _IAM: "<QQ",
}  # fmt: skip
# HOLD (xid, epoch); GRANT (xid, status, dereg, ptr, size): the exposure's range, which a
# transfer's descriptor must name; XFER (xid, epoch).  MD's head: (request, dropped
# registrations, the answering endpoint's incarnation); the metadata follows.
_ENTRY = {_HOLD: "<QQ", _GRANT: "<QBQQQ", _XFER: "<QQ"}
_MAX_ENTRIES = 1024  # exposures one transfer (or one hold request) may name
# A target's verdicts: on a hold request (GRANT), and on a transfer's arrival (ACK).
OK, GONE, EPOCH, FREED, NOT_HELD = 0, 1, 2, 3, 4
_VERDICT = {
    GONE: "the target no longer exposes it (unexpose, or it never did)",
    EPOCH: "the target exposes it under another epoch (the block was reassigned)",
    FREED: "the target's allocation there was freed since it exposed it",
    NOT_HELD: "this initiator held no lease on it (a transfer outside the protocol)",
}
_LOADED_PER_PEER = 256  # metadata versions remembered as loaded, per peer (a bound, not a cache size)


def _pack(kind: bytes, head: tuple[int, ...], entries: Sequence[tuple[int, ...]] | None = None) -> bytes:
    out = _PREFIX + kind + struct.pack(_HEAD[kind], *head)
    for e in entries or ():
        out += struct.pack(_ENTRY[kind], *e)
    return out


def _parse(m: bytes) -> tuple[bytes, tuple[int, ...], list[tuple[int, ...]]] | None:
    """(kind, head, entries) of one of gpupin's messages; None when ``m`` does not have its
    layout exactly (a foreign or malformed message: never an exception)."""
    if len(m) <= len(_PREFIX) or not m.startswith(_PREFIX):
        return None
    kind = m[len(_PREFIX) : len(_PREFIX) + 1]
    fmt = _HEAD.get(kind)
    if fmt is None:
        return None
    at = len(_PREFIX) + 1
    n = struct.calcsize(fmt)
    if len(m) < at + n:
        return None
    head = struct.unpack_from(fmt, m, at)
    at += n
    entries: list[tuple[int, ...]] = []
    if kind == _MD:  # (request, dropped registrations, incarnation), then the metadata: as bytes
        return kind, head + (at,), entries
    efmt = _ENTRY.get(kind)
    if efmt is None:
        return (kind, head, entries) if len(m) == at else None
    count, size = head[1], struct.calcsize(efmt)
    if count > _MAX_ENTRIES or len(m) != at + count * size:
        return None
    entries = [struct.unpack_from(efmt, m, at + i * size) for i in range(count)]
    return kind, head, entries


_MD_AGENT = b"nixlSerDes|Agent"  # how NIXL's metadata begins (nixlAgent::getLocalMD, serdes.cpp)


def _agent_name(metadata: bytes) -> str | None:
    """The agent a NIXL metadata blob names, or None for a layout not known here.  nixlSerDes
    writes a tag, the value's length (a native size_t), the value and ``|``; getLocalMD's
    first value is the agent's name (NIXL 0.x to 1.5)."""
    at = len(_MD_AGENT)
    if not metadata.startswith(_MD_AGENT) or len(metadata) < at + 8:
        return None
    (size,) = struct.unpack_from("=Q", metadata, at)
    end = at + 8 + size
    if not 0 < size <= 4096 or metadata[end : end + 1] != b"|":
        return None
    try:
        return metadata[at + 8 : end].decode()
    except UnicodeDecodeError:
        return None


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
# A deque, taken by no lock: a finalizer may run on any thread at any allocation, also one made
# while that thread holds a lock, so nothing a finalizer reaches may take a lock (it would wait
# on its own thread).  append, appendleft and popleft are atomic.
_DEFERRED: collections.deque[Callable[[], None]] = collections.deque()
_AGENT_LOCKS: weakref.WeakKeyDictionary[Any, threading.RLock] = weakref.WeakKeyDictionary()
# Guards _AGENT_LOCKS, _ENDPOINT_OF and _PROGRESS_THREADS; held for no NIXL call, and never taken
# from a finalizer (see _DEFERRED).
_registry_lock = threading.Lock()
_UNRELEASABLE: list[Any] = []  # transfer handles NIXL refused to release: never finalized before exit
# (provider, free hold) of exposures an endpoint left to the garbage collector while peers held
# leases on them: no revocation can be sent from there and a peer may still write, so the
# provider keeps refusing to free that memory until the process exits.
_KEPT_HOLDS: list[tuple[Any, int]] = []
# Every transfer handle gpupin made and has not released, by id: reachable from here, a handle
# is never garbage, so its finalizer (a NIXL call) never runs in the garbage collector, also
# when the endpoint and its transfers are collected together (NixlEndpoint.close).
_LIVE_XFERS: dict[int, Any] = {}
# The same for NIXL's prepped descriptor lists (NixlEndpoint.prepare): released by gpupin, never
# by their finalizer.
_LIVE_DLISTS: dict[int, Any] = {}


def _release(h: Any, *, dlist: bool = False) -> None:
    """Release NIXL's handle object ``h`` (a transfer's: releaseXferReq; ``dlist``, a prepped
    list's: releasedDlistH), marked released before the call: NIXL's own release() marks it
    after, and an interrupt landing in between (Python raises it as the call returns) would
    leave its finalizer to release it a second time, a double free.  Nothing that can raise
    runs between the mark and the call (no call), so an interrupt leaves it released or, at
    worst, marked and leaked, never freed twice.  What NIXL raises is raised, the mark undone
    (it released nothing)."""
    if h._released:
        return
    h._released = True
    try:
        if dlist:
            h._agent.releasedDlistH(h._handle)
        else:
            h._agent.releaseXferReq(h._handle)
    except Exception:
        h._released = False
        raise


def _releases_as_nixl(agent: Any, handle: Any) -> bool:
    """Whether releasing ``handle`` on ``agent`` is NIXL's own release_xfer_handle (a subclass
    of NIXL's agent that keeps it, NIXL's handle object): then _release does it."""
    api = sys.modules.get(type(handle).__module__)
    base = getattr(api, "nixl_agent", None)
    return (
        base is not None
        and type(handle) is getattr(api, "nixl_xfer_handle", None)
        and "release_xfer_handle" not in getattr(agent, "__dict__", {})
        and getattr(type(agent), "release_xfer_handle", None) is getattr(base, "release_xfer_handle", None)
    )


class _Direct:
    """NIXL's binding calls behind ``nixl_agent``'s transfer methods (initialize_xfer,
    transfer, check_xfer_state and get_xfer_descs in NIXL's _api.py call nothing else), for
    a transfer's hot path: each wrapper is a Python frame or two, ~2 us of a ~20 us transfer
    in all.  Made only for an agent of NIXL's own class (checked when the driver is made);
    NixlDriver.direct() hands it out only while none of those methods is replaced on the
    agent itself (a test's double), so such a replacement takes every call."""

    __slots__ = ("inner", "dlist", "mems", "ops", "handle", "create", "post", "status", "in_prog", "ok")
    WRAPPERS = frozenset(("get_xfer_descs", "initialize_xfer", "transfer", "check_xfer_state", "release_xfer_handle"))

    def __init__(self, agent: Any, api: Any, bind: Any) -> None:
        self.inner = agent.agent
        self.dlist = bind.nixlXferDList
        self.mems: dict[str, Any] = dict(agent.nixl_mems)
        self.ops: dict[str, Any] = dict(agent.nixl_ops)
        self.handle = api.nixl_xfer_handle
        self.create = self.inner.createXferReq
        self.post = self.inner.postXferReq
        self.status = self.inner.getXferStatus
        self.in_prog, self.ok = int(bind.NIXL_IN_PROG), int(bind.NIXL_SUCCESS)

    def request(self, op: str, lmem: str, lspec: list[Any], rmem: str, rspec: list[Any], peer: str) -> Any:
        """initialize_xfer(op, local, remote, peer) with no notification: the handle."""
        ldesc, rdesc = self.dlist(self.mems[lmem], lspec), self.dlist(self.mems[rmem], rspec)
        return self.handle(self.inner, self.create(self.ops[op], ldesc, rdesc, peer, b"", []))

    def begin(self, op: str, lmem: str, lspec: list[Any], rmem: str, rspec: list[Any], peer: str) -> int:
        """request()'s NIXL handle itself (an int), with no object around it: for a transfer
        that may end in the frame that made it (NixlEndpoint._quick); ``wrap`` it before it
        leaves that frame."""
        ldesc, rdesc = self.dlist(self.mems[lmem], lspec), self.dlist(self.mems[rmem], rspec)
        return int(self.create(self.ops[op], ldesc, rdesc, peer, b"", []))

    def wrap(self, hid: int) -> Any:
        """The handle object ``request`` would have made of ``hid``, kept in _LIVE_XFERS (as a
        post keeps every handle it made) until released.  Made marked released, and marked
        live only once kept: an interrupt in between leaves an object whose finalizer releases
        nothing (NIXL's would cancel and free the running request under its poller)."""
        h = object.__new__(self.handle)
        h._released = True
        h._handle, h._agent = hid, self.inner
        _LIVE_XFERS[id(h)] = h
        h._released = False
        return h

    @staticmethod
    def wrapped(hid: int) -> Any:
        """The handle object kept for ``hid`` (an interrupt may have come as ``wrap`` returned
        it), or None."""
        return next(
            (
                h
                for h in list(_LIVE_XFERS.values())
                if getattr(h, "_handle", None) == hid and not getattr(h, "_released", False)
            ),
            None,
        )

    def start(self, h: Any) -> str:
        """transfer(h): "DONE", "PROC" or "ERR"."""
        return self._name(self.post(h._handle, b""))

    def state(self, h: Any) -> str:
        """check_xfer_state(h): "DONE", "PROC" or "ERR"."""
        return self._name(self.status(h._handle))

    def _name(self, st: int) -> str:
        return "PROC" if st == self.in_prog else "DONE" if st == self.ok else "ERR"

    @classmethod
    def of(cls, agent: Any) -> _Direct | None:
        """For an agent of NIXL's own class (not a subclass), else None."""
        api = sys.modules.get(type(agent).__module__)
        if api is None or type(agent) is not getattr(api, "nixl_agent", None):
            return None
        bind = sys.modules.get(type(getattr(agent, "agent", None)).__module__)
        handle = getattr(api, "nixl_xfer_handle", None)
        if not isinstance(handle, type) or "_handle" not in getattr(handle, "__slots__", ()):
            return None  # an older NIXL whose handles are the bindings' ints: its wrappers
        try:
            return cls(agent, api, bind)
        except (AttributeError, TypeError, ValueError):  # another NIXL than the one read
            return None


def _gc_phase(phase: str, info: dict[str, Any]) -> None:
    _gc_state.collecting = phase == "start"


gc.callbacks.append(_gc_phase)


def collecting() -> bool:
    """True while this thread runs the cyclic garbage collector (and the finalizers it calls)."""
    return bool(getattr(_gc_state, "collecting", False))


def _defer(work: Callable[[], None], *, first: bool = False) -> None:
    """Queue ``work`` for reap(); ``first``: ahead of what is queued (transfer handles go
    before the registrations they use are deregistered and before their agent retires)."""
    if first:
        _DEFERRED.appendleft(work)
    else:
        _DEFERRED.append(work)


def reap() -> int:
    """Run the NIXL work finalizers left for later (deregistrations, agents to retire) on this
    thread, now; the number of items run.  gpupin does this itself when an endpoint or driver is
    made, at each post, expose, cache acquire and notification pump (never under an endpoint's
    or a cache's lock), and at exit; call it to have it done at a time of your choosing.  Does
    nothing inside a finalizer."""
    done = 0
    while _DEFERRED and not collecting():  # the common case, nothing deferred: one test
        try:
            work = _DEFERRED.popleft()
        except IndexError:  # another thread took the last one
            break
        try:
            work()
        except Exception as exc:  # noqa: BLE001 - one failure must not keep the rest waiting
            what = f"{type(exc).__name__}: {exc}"
            warnings.warn(f"gpupin.nixl: deferred NIXL cleanup failed: {what}", RuntimeWarning, stacklevel=2)
        done += 1
    return done


atexit.register(reap)
_PROGRESS_THREADS: weakref.WeakKeyDictionary[threading.Thread, threading.Event] = weakref.WeakKeyDictionary()


@atexit.register
def _stop_progress_threads() -> None:
    """Stop and join every endpoint's progress thread before the interpreter goes (a NIXL call
    on a daemon thread at shutdown aborts the process: "terminate called ...")."""
    with _registry_lock:
        threads = list(_PROGRESS_THREADS.items())
    for _th, stop in threads:
        stop.set()
    for th, _ in threads:
        if th is not threading.current_thread():
            th.join(5)


_ENDPOINT_OF: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()  # agent -> endpoint name


def _claim_agent(agent: Any, name: str) -> None:
    """One NixlEndpoint per agent: an agent's notifications are taken by whoever reads first,
    and leases are granted per agent, so two endpoints would take each other's grants and
    revocations (and one's lease drop would end the other's)."""
    with _registry_lock:
        try:
            other = _ENDPOINT_OF.get(agent)
            if other is not None:
                raise InvalidArgument(
                    f"NixlEndpoint({name!r}): NIXL agent {getattr(agent, 'name', agent)!r} already serves endpoint "
                    f"{other!r}: one endpoint per agent (use that endpoint, or make a new agent)"
                )
            _ENDPOINT_OF[agent] = name
        except TypeError:  # an agent that takes no weak reference (a test double): unchecked
            pass


def _unclaim_agent(agent: Any) -> None:
    with _registry_lock:
        try:
            _ENDPOINT_OF.pop(agent, None)
        except TypeError:  # a test double
            pass


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
        self._direct = _Direct.of(agent)
        self._next = itertools.count(1)
        self._regs: dict[int, NixlRegistration] = {}
        # Registrations NIXL may hold that _regs does not: one being made or dropped when an
        # interrupt came (Python raises one as NIXL's call returns).  Deregistered before the
        # next registration (NIXL keeps two at one base side by side and finds the older one
        # first) and at close; each drop counted, so peers renew their view of this agent.
        self._unsure: dict[int, Any] = {}
        self.registrations = 0
        self.deregistrations = 0
        self.register_s = 0.0
        self.deregister_s = 0.0

    def direct(self) -> _Direct | None:
        """The agent's binding calls (_Direct) while none of its transfer methods is replaced
        on it; None, also once retired."""
        d, agent = self._direct, self._agent
        if d is None or agent is None:
            return None
        return d if agent.__dict__.keys().isdisjoint(_Direct.WRAPPERS) else None

    @property
    def agent(self) -> Any:
        """The ``nixl_agent``; NixlError once close() retired it."""
        agent = self._agent
        if agent is None:
            raise NixlError(f"NIXL agent {self.name!r}: closed (its driver retired it); make a new endpoint")
        return agent

    def linger(self, seconds: float) -> None:
        """Progress the agent at least ``seconds`` more before it is destroyed: messages just
        sent (send_notif returns before UCX sent them) leave instead of dying with it."""
        self._settle_until = max(self._settle_until, time.monotonic() + seconds)

    def peer_failed(self) -> None:
        """A transfer or notification with a peer failed: progress the agent for SETTLE_S before
        it is destroyed (UCX aborts the process when it destroys an unprogressed failure)."""
        self._settle_until = time.monotonic() + SETTLE_S

    def release_xfer(self, handle: Any) -> bool:
        """Release a transfer handle under the lock; one NIXL refuses (a transfer it cannot
        cancel) is kept and retried, never left to its finalizer.  False if it was kept."""
        with self.lock:
            try:
                agent = self.agent
                if self.direct() is not None or _releases_as_nixl(agent, handle):
                    try:
                        _release(handle)  # what release_xfer_handle does, marked first
                    finally:  # marked released (or refused, then kept in _stuck): not live
                        if getattr(handle, "_released", False):
                            _LIVE_XFERS.pop(id(handle), None)
                else:
                    agent.release_xfer_handle(handle)  # replaced or overridden: it decides
                _LIVE_XFERS.pop(id(handle), None)
                return True
            except Exception:  # noqa: BLE001 - NIXL's own classes; retried in _retry_stuck
                self._stuck.append(handle)
                self.peer_failed()
                return False

    def release_id(self, direct: _Direct, hid: int) -> None:
        """(under the lock) release_xfer of a handle kept as NIXL's int (_Direct.begin): one
        NIXL refuses is wrapped and kept for a retry, as release_xfer keeps it."""
        try:
            direct.inner.releaseXferReq(hid)
        except Exception:  # noqa: BLE001 - NIXL's own classes; retried in _retry_stuck
            self._stuck.append(direct.wrap(hid))
            self.peer_failed()

    def _retry_stuck(self) -> None:
        if self._agent is None:  # retired: _retire left what it could not release to the exit
            return
        with self.lock:
            stuck, self._stuck = self._stuck, []
            for h in stuck:
                self.release_xfer(h)

    # -- the device protocol of RegistrationCache ------------------------------
    def pin(self, va: int, size: int, *, persistent: bool = False, user_tag: int = 0) -> NixlRegistration:
        if size <= 0:
            raise InvalidArgument(f"register_memory({va:#x}, {size}): size must be > 0")
        what = f"register_memory({va:#x}, {size}, {self.mem_type})"
        # No reap() here: a miss pins under the cache's lock and the endpoint's, and a deferred
        # agent retirement spins that agent for up to SETTLE_S.  Its callers reap first.
        with self.lock:
            self._drop_unsure()
            agent = self.agent
            try:
                dlist = agent.get_reg_descs([(va, size, self.devid, "")], self.mem_type)
            except Exception as exc:  # noqa: BLE001
                raise _nixl_error(what, exc) from None
            for old in self._regs.values():
                if old.va < va + size and va < old.va + old.size:
                    # The cache registers whole allocations at their own bounds (granule 1): a
                    # live registration overlapping this one is of an allocation that is gone,
                    # held by a reference never let go (an interrupted call, a transfer past its
                    # timeout).  NIXL would keep both and resolve a block at their base to the
                    # older one (getCoveringIndex, lower_bound): a transfer through the old
                    # memory, reported done.  Refused, never registered beside it.
                    raise InUse(
                        f"{what}: NIXL still holds [{old.va:#x}, +{old.size}) of an earlier allocation there: "
                        "settle() the endpoint's transfers (one past its timeout holds it); if an interrupt "
                        "leaked its reference, nothing lets it go: use a new endpoint (this one's close() "
                        "refuses too)"
                    )
            h = next(self._next)
            reg = NixlRegistration(h, va, size, dlist)
            # Recorded before NIXL registers, kept in _regs with no check point in between:
            # an interrupt anywhere leaves it in one of the two, never in neither.
            self._unsure[h] = dlist
            t = time.perf_counter()
            try:
                agent.register_memory(dlist)
            except Exception as exc:  # noqa: BLE001 - NIXL refused: it holds none
                del self._unsure[h]
                raise _nixl_error(what, exc) from None
            finally:
                self.register_s += time.perf_counter() - t
            self._regs[h] = reg
            del self._unsure[h]
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
            # Counted and moved to _unsure before NIXL's call, undone only if NIXL refused: the
            # count makes peers renew their view of this agent, and an interrupt as the call
            # returns (or before NIXL ran it) must leave neither a registration NIXL dropped in
            # _regs nor one it still holds unrecorded (one more renewal is harmless).
            self.deregistrations += 1
            self._unsure[h] = reg.dlist
            del self._regs[h]
            try:
                self.agent.deregister_memory(reg.dlist)
            except Exception as exc:  # noqa: BLE001 - still registered: `live` keeps counting it
                self._regs[h] = reg
                del self._unsure[h]
                self.deregistrations -= 1
                raise _nixl_error(f"deregister_memory({reg.va:#x}, {reg.size})", exc) from None
            finally:
                self.deregister_s += time.perf_counter() - t
            del self._unsure[h]

    def _drop_unsure(self) -> None:
        """(under the lock) Deregister what an interrupt left in _unsure (NIXL may hold it or
        not: a refusal means it holds none), each counted as a drop."""
        while self._unsure:
            h = next(iter(self._unsure))
            self.deregistrations += 1
            try:  # off the record only once NIXL answered: an interrupt has it tried again
                self.agent.deregister_memory(self._unsure[h])
            except Exception:  # noqa: BLE001, S110 - NOT_FOUND: NIXL never made it, or dropped it
                pass
            del self._unsure[h]

    @property
    def live(self) -> int:
        """Registrations made through this driver and not deregistered."""
        return len(self._regs)

    def close(self) -> None:
        """Close the cache over this driver (deregistering everything; InUse while one is held),
        then retire the agent if this driver made it."""
        self.close_cache()
        if self._agent is not None and self._unsure:
            if collecting():  # a finalizer: no NIXL call from the collector (reap() makes it)
                _defer(self._drop_unsure_locked, first=True)
            else:
                self._drop_unsure_locked()
        self._retire()

    def _drop_unsure_locked(self) -> None:
        if self._agent is not None:
            with self.lock:
                self._drop_unsure()

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
            self._direct = None  # its bound calls hold NIXL's agent too
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

    def acquire(self, ptr: int, size: int) -> Registration:
        reap()  # before any lock is taken (NixlDriver.pin reaps not)
        return super().acquire(ptr, size)

    def acquire_unreaped(self, ptr: int, size: int) -> Registration:
        """acquire() without reap(): for a caller that holds an endpoint's lock (expose, which
        reaped before taking it).  Deferred work queued since waits for the next reap(): run
        here, it would run under that lock (another endpoint's cleanup takes that endpoint's
        lock, and an agent's retirement spins it for SETTLE_S)."""
        return super().acquire(ptr, size)


@dataclass(frozen=True)
class RemoteBuffer:
    """A buffer a target exposed: where it is, which allocation it was (buffer id), the exposure
    it belongs to (``xid``, never reused by that target, and the application's ``epoch``), the
    registration's generation, how many registrations the target had dropped by then
    (``dereg``), the target endpoint's ``incarnation`` (a restarted target under the same
    name has another), and the target agent's metadata (to connect and to see the registration).
    ``to_bytes``/``from_bytes`` carry it over any channel."""

    agent: str
    addr: int
    size: int
    devid: int
    mem_type: str
    buffer_id: int
    xid: int
    epoch: int
    generation: int
    dereg: int
    incarnation: int
    metadata: bytes

    _FMT = "<4sQQQQQQqQQH"
    _MAGIC = b"gpr5"  # the protocol's version: an older gpupin's descriptors are refused

    def to_bytes(self) -> bytes:
        name = self.agent.encode()
        head = struct.pack(
            self._FMT, self._MAGIC, self.addr, self.size, self.devid, self.buffer_id, self.xid, self.epoch,
            self.generation, self.dereg, self.incarnation, len(name),
        )  # fmt: skip
        return head + name + self.mem_type.encode().ljust(4) + self.metadata

    @classmethod
    def from_bytes(cls, data: bytes) -> RemoteBuffer:
        n = struct.calcsize(cls._FMT)
        if len(data) < n or data[:4] != cls._MAGIC:
            raise InvalidArgument(
                f"RemoteBuffer.from_bytes: {len(data)} bytes that are not a RemoteBuffer of this gpupin version "
                "(make it with the target's expose(...).to_bytes())"
            )
        _, addr, size, devid, bid, xid, epoch, gen, dereg, inc, alen = struct.unpack_from(cls._FMT, data)
        if len(data) < n + alen + 4:
            raise InvalidArgument(f"RemoteBuffer.from_bytes: truncated ({len(data)} bytes)")
        try:
            agent = bytes(data[n : n + alen]).decode()
            mem = data[n + alen : n + alen + 4].decode().strip()
        except UnicodeDecodeError:
            raise InvalidArgument(
                "RemoteBuffer.from_bytes: its agent name or memory type is not text (corrupted on the way?)"
            ) from None
        return cls(agent, addr, size, devid, mem, bid, xid, epoch, gen, dereg, inc, bytes(data[n + alen + 4 :]))


@dataclass
class _Exposure:
    """(target) One expose(): the registration and free hold it keeps, and its lease holders:
    peer -> [checks received, checks the peer says it sent under its lease (-1 until it
    dropped the lease)]."""

    xid: int
    ptr: int
    size: int
    epoch: int
    buffer_id: int
    reg: Any
    hold: int | None
    holders: dict[str, list[int]] = field(default_factory=dict)
    # peer -> the hold request its lease was granted on: a DROP names it, so that the drop of
    # a grant the peer gave up on (answered late) never ends a lease it holds from a later one.
    grants: dict[str, int] = field(default_factory=dict)
    revoked: bool = False
    done: bool = False

    def settled(self) -> bool:
        return all(dropped >= 0 and got >= dropped for got, dropped in self.holders.values())


class _AskAgain(Exception):
    """(_leases_for) A lease another thread asked for went before its answer: ask for it anew."""


def _count(todo: list[_Lease], by: int) -> None:
    """``lease.inflight += by`` for each lease of ``todo``, each taken off it with no check
    point before its count changes (Python raises an interrupt as a call returns and at a
    loop's back edge): what an interrupt leaves in ``todo`` is not done yet, and a second
    pass over it (a finally) does it without doing any twice."""
    while todo:
        lease = todo[-1]
        del todo[-1]
        lease.inflight += by


def _count_lost(todo: list[_Lease], by: int) -> None:
    """``lease.lost += by`` for each lease of ``todo``, resumable as _count is."""
    while todo:
        lease = todo[-1]
        del todo[-1]
        lease.lost += by


def _release_tokens(release: Callable[[int], object], toks: list[int]) -> None:
    """release(tok) for each of ``toks`` (the cache's C release_token: no check point before
    it runs), each taken off the list first: an interrupt leaves the rest in it, never one
    released twice."""
    while toks:
        tok = toks[-1]
        del toks[-1]
        release(tok)


@dataclass
class _Lease:
    """(initiator) The right to transfer into one exposure of one peer, granted by its target."""

    peer: str
    xid: int
    epoch: int
    # asking, granted (loading), held, revoked (REVOKE came; no new transfer), refused, dropped
    state: str = "asking"
    verdict: int = OK
    dereg: int = 0  # the target's dropped registrations when it granted the lease
    grant: int = 0  # the hold request that asked for it (its DROP names it)
    addr: int = 0  # the exposure's range, as its grant said: a descriptor must name this one
    size: int = 0
    inflight: int = 0  # transfers posted under it and not over
    lost: int = 0  # of those, ones whose state NIXL cannot tell (its view of the peer was erased)
    checks: int = 0  # check messages sent under it (wait(confirm=True))
    broken: str = ""  # a target's ACK found a transfer stale: detection, after the fact


class Transfer:
    """A posted transfer (``NixlEndpoint.post_write``/``post_read``): ``done()`` polls,
    ``wait()`` blocks (``await t.wait_async()`` in asyncio).  Its local registrations and
    its leases are held until NIXL says it is over, also past a timeout."""

    __slots__ = (
        "_ep",
        "_h",
        "_toks",
        "_leases",
        "seq",
        "op",
        "_blocks",
        "confirm",
        "state",
        "verdict",
        "lost",
        "__weakref__",
    )

    def __init__(
        self,
        ep: NixlEndpoint,
        handle: Any,
        toks: list[int],
        leases: list[_Lease],
        seq: int,
        op: str,
        blocks: list[tuple[int, int, RemoteBuffer, int]],
        confirm: bool,
    ) -> None:
        self._ep, self._h, self._toks, self._leases = ep, handle, toks, leases
        self.seq, self.op, self._blocks, self.confirm = seq, op, blocks, confirm
        self.state = "PROC"  # PROC, DONE, ERR
        self.verdict: tuple[int, int] | None = None  # the target's (status, xid), once its ACK came
        self.lost = False  # PROC, and NIXL can say no more (held until forget_peer)

    @property
    def what(self) -> str:
        """The transfer in words, for messages (made only when one is)."""
        return _what(self.op, self._blocks)

    def done(self) -> bool:
        """Whether NIXL finished it (DONE: the bytes are in place; or ERR); never blocks."""
        if self.state == "PROC":
            self._ep._check(self)
        return self.state != "PROC"

    def wait(self, timeout: float = 30.0, *, confirm: bool = False) -> None:
        """Return when the bytes are in place; NixlError if NIXL failed it, if NIXL lost track
        of it (status "lost", at once: held until ``forget_peer``), or if ``timeout`` passed
        (status "timeout": its buffers stay registered and leased until it ends:
        ``NixlEndpoint.settle``).
        ``confirm``: also wait for the target's check of its arrival (a round trip; StaleRemote
        if the target's memory changed behind the protocol's back).  Only for a transfer posted
        with ``confirm=True`` (``write(..., confirm=True)`` does both)."""
        self._wait(timeout, confirm, _SPIN_S)

    def _wait(self, timeout: float, confirm: bool, spin: float) -> None:
        """wait(), polled without a pause for ``spin`` s first (0: spun already, _quick_wait)."""
        ep = self._ep
        deadline = time.monotonic() + timeout
        spin_until = min(time.monotonic() + spin, deadline)
        nap = _NAP_MIN_S
        if self.state == "PROC" and spin > 0:
            ep._spin(self, spin_until)
        while not self.done():
            if self.lost:  # NIXL can say no more of it: waiting longer would tell nothing
                ep._orphan(self)
                raise NixlError(f"{self.what}: {_LOST}", "lost")
            now = time.monotonic()
            if now > deadline:
                ep._orphan(self)
                if self.lost:  # lost meanwhile (another thread's poll)
                    raise NixlError(f"{self.what}: {_LOST}", "lost")
                raise NixlError(
                    f"{self.what}: not done after {timeout} s (is the peer alive?). NIXL may still be moving its "
                    "bytes: each local buffer stays registered (and each lease held) until "
                    "settle() says the transfer ended: free or reuse none of them before",
                    "timeout",
                )
            if now > spin_until:  # past the spin, sleep instead of burning a core
                time.sleep(nap)
                nap = min(nap * 2, _NAP_MAX_S)
        if self.state != "DONE":
            ep.driver.peer_failed()
            raise NixlError(f"{self.what} failed (the peer went away, or its registration did)", "ERR")
        if confirm:
            if not self.confirm:
                raise InvalidArgument(f"{self.what}: wait(confirm=True) needs post(..., confirm=True)")
            ep._await_verdict(self, deadline)

    async def wait_async(self, timeout: float = 30.0, *, confirm: bool = False, poll: float = 0.0002) -> None:
        """``wait`` for asyncio: polls every ``poll`` s, yielding to the loop in between."""
        import asyncio

        ep = self._ep
        deadline = time.monotonic() + timeout
        while not self.done():
            if self.lost:
                ep._orphan(self)
                raise NixlError(f"{self.what}: {_LOST}", "lost")
            if time.monotonic() > deadline:
                ep._orphan(self)
                raise NixlError(f"{self.what}: not done after {timeout} s; settle() before freeing", "timeout")
            await asyncio.sleep(poll)
        if self.state != "DONE":
            ep.driver.peer_failed()
            raise NixlError(f"{self.what} failed (the peer went away, or its registration did)", "ERR")
        if confirm:
            if not self.confirm:
                raise InvalidArgument(f"{self.what}: wait_async(confirm=True) needs post(..., confirm=True)")
            while self.verdict is None:
                if time.monotonic() > deadline:
                    raise NixlError(f"{self.what}: {_NO_ANSWER}")
                ep._pump()
                await asyncio.sleep(poll)
            ep._judge(self)


class _Prep:
    """(NixlEndpoint.prepare) NIXL's prepped descriptor lists of one scatter list, each with
    what it was made against: ``serial``, NIXL's view of the peer (NixlEndpoint._serial_of),
    and ``toks``, the local registrations (a cache token names one registration, never
    another).  Made again, under the endpoint's lock and the agent's, when either changed: a
    prepped list keeps NIXL's pointers to the registrations' metadata as of its making, and
    NIXL checks no more than that the peer is still known (makeXferReq, nixl_agent.cpp)."""

    __slots__ = ("peer", "idx", "lspec", "rspec", "rmem", "local", "remote", "toks", "serial", "closed")

    def __init__(self, peer: str, lspec: list[tuple[int, int, int]], rspec: list[tuple[int, int, int]], rmem: str):
        self.peer, self.lspec, self.rspec, self.rmem = peer, lspec, rspec, rmem
        self.idx = list(range(len(lspec)))
        self.local: Any = None
        self.remote: Any = None
        self.toks: list[int] = []
        self.serial = -1
        self.closed = False

    def make(self, ep: NixlEndpoint, op: str, toks: list[int]) -> Any:
        """(under ep._lock and the agent's lock) A transfer handle of the lists, each made
        again first where what it names changed."""
        agent = ep.agent
        serial = ep._serial_of(self.peer)
        if self.remote is None or self.serial != serial:
            self.drop(remote=True)
            self.remote = agent.prep_xfer_dlist(self.peer, self.rspec, self.rmem)
            _LIVE_DLISTS[id(self.remote)] = self.remote
            self.serial = serial
            ep.lists_prepped += 1
        if self.local is None or self.toks != toks:
            self.drop(local=True)
            self.local = agent.prep_xfer_dlist("", self.lspec, ep.driver.mem_type)
            _LIVE_DLISTS[id(self.local)] = self.local
            self.toks = list(toks)
            ep.lists_prepped += 1
        return agent.make_prepped_xfer(op, self.local, self.idx, self.remote, self.idx, b"")

    def drop(self, *, local: bool = False, remote: bool = False) -> None:
        """(under the agent's lock) Release the lists named (made again at the next post)."""
        for which in ("local", "remote"):
            if (which == "local" and local) or (which == "remote" and remote):
                h = getattr(self, which)
                setattr(self, which, None)
                if h is not None:
                    _release(h, dlist=True)  # (one NIXL refuses stays kept: never its finalizer's)
                    _LIVE_DLISTS.pop(id(h), None)
        if local:
            self.toks = []


class Prepared:
    """A scatter list posted many times (``NixlEndpoint.prepare``): ``post()`` returns a
    :class:`Transfer`, ``run()`` waits for it.  ``close()`` (or the endpoint's) releases NIXL's
    lists; one dropped unclosed is released at gpupin's next NIXL call (reap)."""

    def __init__(self, ep: NixlEndpoint, op: str, blocks: list[tuple[int, int, RemoteBuffer, int]], prep: _Prep):
        self._ep, self.op, self.blocks, self._prep = ep, op, blocks, prep

    def post(self, *, timeout: float = 30.0, confirm: bool = False) -> Transfer:
        """Start the transfer; returns at once (as ``NixlEndpoint.post``)."""
        self._check_open()
        t = self._ep._post(self.op, self.blocks, timeout, confirm, tracked=True, prep=self._prep)
        if self._ep._notes:
            self._ep._flush_notes()
        return t

    def run(self, *, timeout: float = 30.0, confirm: bool = False) -> None:
        """Post it and return when its bytes are in place (as ``write_blocks``)."""
        self._check_open()
        self._ep._blocking(self.op, self.blocks, timeout=timeout, confirm=confirm, prep=self._prep)

    def _check_open(self) -> None:
        if self._prep.closed:
            raise InvalidArgument(f"{_what(self.op, self.blocks)}: this Prepared is closed; prepare() it again")

    def close(self) -> None:
        """Release NIXL's lists (a transfer made of them runs on: NIXL copied what it needs)."""
        self._ep._unprepare(self._prep)

    def __enter__(self) -> Prepared:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        prep, ep = getattr(self, "_prep", None), getattr(self, "_ep", None)
        if prep is not None and ep is not None and not prep.closed:
            # No NIXL call and no lock from here (the collector may run this): at the next reap().
            _defer(lambda: ep._unprepare(prep))


_LOCAL, _SIZE, _REMOTE, _OFFSET = (operator.itemgetter(i) for i in range(4))  # a block's columns
_DEREG = operator.attrgetter("dereg")
_NO_ANSWER = "no answer from the target (it must call progress() or serve(), and have loaded this endpoint's metadata)"
_LOST = (
    "NIXL lost its view of the peer while the transfer ran (NOT_FOUND: a refused metadata load or a "
    "disconnect erased it), so whether UCX still moves its bytes is unknown, and NIXL 1.5 ties the "
    "transfer to the view it lost (loading the peer again does not bring it back): its local buffers "
    "stay registered and its leases held until forget_peer(), once the peer can transfer no more"
)


def _check_blocks(op: str, blocks: list[tuple[int, int, RemoteBuffer, int]]) -> None:
    """InvalidArgument naming the first block that goes to another peer or memory type than
    the first, or that does not lie inside its remote buffer."""
    peer, mem_type = blocks[0][2].agent, blocks[0][2].mem_type
    for local, size, remote, offset in blocks:
        if remote.agent != peer or remote.mem_type != mem_type:
            raise InvalidArgument(
                f"post({op!r}): blocks for {remote.agent} ({remote.mem_type}) and {peer} "
                f"({mem_type}): one transfer goes to one peer and one memory type"
            )
        if size <= 0 or offset < 0 or offset + size > remote.size:
            raise InvalidArgument(
                f"{op.lower()}({local:#x}, {size}, offset={offset}): [offset, offset + size) must lie inside the "
                f"remote buffer of {remote.size} bytes"
            )


def _specs(
    blocks: list[tuple[int, int, RemoteBuffer, int]], devid: int
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """NIXL's (address, length, device) lists of the blocks: local, remote."""
    return [(b[0], b[1], devid) for b in blocks], [(r.addr + off, size, r.devid) for _, size, r, off in blocks]


def _bounded(loaded: dict[int, None]) -> dict[int, None]:
    """A view's record of metadata loaded, its oldest entries let go past _LOADED_PER_PEER
    (loading one again costs a reload, no more)."""
    while len(loaded) > _LOADED_PER_PEER:
        del loaded[next(iter(loaded))]
    return loaded


def _what(op: str, blocks: list[tuple[int, int, RemoteBuffer, int]]) -> str:
    return f"NIXL {op} of {sum(b[1] for b in blocks)} bytes in {len(blocks)} block(s) with {blocks[0][2].agent}"


_ASKED, _PENDING = ("asking",), ("asking", "granted")  # lease states a transfer waits out
_LINGER_S = 0.05  # a closing endpoint progresses its agent this long for its last messages to leave
_OTHER_MAX = 65536  # application messages kept for progress(); older ones go (counted)
_PUMP_EVERY_S = 0.001  # a post takes notifications itself at most this often
_DROP_TRIES = 64  # sendings of a lease drop before giving up (2 ms apart at first, then 1 s: about a minute)
_OVER = object()  # (NixlEndpoint._quick) the transfer ended within its post
_SPIN_S = 100e-6  # a transfer's wait polls without sleeping this long (a small one is done by then)
_NAP_MIN_S, _NAP_MAX_S = 20e-6, 1e-3
_T = TypeVar("_T")
_WHO_AGAIN_S = 0.005  # an unanswered incarnation question is sent again after this, then doubling to 1 s


class NixlEndpoint(Closable):
    """A NIXL agent with its registration cache, for either side of a transfer, and a protocol
    on NIXL's notifications that keeps every byte out of memory a new owner holds.

    Target: ``ep.metadata()`` to the peer, ``ep.expose(ptr, size, epoch=)`` for each buffer a
    peer may write or read (send ``.to_bytes()``), ``ep.unexpose(remote)`` before the buffer is
    freed or handed to another use (the provider refuses to free it before), and
    ``ep.progress()`` (or ``serve``, or ``auto_progress=True``) while peers transfer.
    Initiator: ``ep.connect(metadata)``, then ``ep.write(src_ptr, size, remote)`` /
    ``ep.read(dst_ptr, size, remote)`` (blocking), or ``post_write``/``post_read`` with many
    blocks in one transfer, returning a :class:`Transfer`.

    Prevention: before its first transfer into an exposure an initiator asks the target for a
    *lease* (one round trip per exposure, not per transfer).  ``unexpose`` revokes the leases
    and returns only when every holder has said that its transfers under the lease are over
    (NIXL reported each DONE or failed) and the target has received the check messages the
    holder says it sent; only then is the registration let go and the free hold dropped.  A
    lease refused raises StaleRemote before any byte moves.  Detection, the backstop: the
    target's watch in ``progress()`` (every ``watch_interval``) finds an exposed buffer freed
    behind the provider's hold and revokes its leases; and a transfer posted with
    ``confirm=True`` sends the target a check once NIXL finished it, which the target answers
    after comparing the exposure, epoch and buffer id: a bad answer is counted
    (``stale_transfers``, ``stale_answers``), raised by ``wait(confirm=True)``, and breaks the lease (the
    next transfer into that exposure raises StaleRemote).  See Documentation/gds-nixl.md for
    what the application must promise.
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
        auto_progress: bool = False,
    ) -> None:
        dev = int(getattr(memory, "device", 0)) if devid is None else devid
        reap()  # an endpoint the collector took lets go of its agent's claim here
        if agent is not None:
            _claim_agent(agent, name)
        try:
            self.driver = NixlDriver(agent, name=name, mem_type=mem_type, devid=dev, nixl=nixl)
        except BaseException:
            if agent is not None:  # the application's agent serves no endpoint after all
                _unclaim_agent(agent)
            raise
        if agent is None:
            _claim_agent(self.driver.agent, name)
        self.memory = memory
        try:
            self.cache = NixlCache(self.driver, memory, max_bytes=max_bytes)
        except BaseException:
            # Refused (max_bytes, the provider): no endpoint serves the agent; one made here retires.
            _unclaim_agent(self.driver.agent)
            self.driver.close()
            raise
        # Ids start anywhere: two endpoints (or an application) reading one agent's notifications
        # cannot take each other's answers for their own, and a restarted target's exposures
        # are not its old ones.
        start = secrets.randbits(62)
        self._seq = itertools.count(start)
        self._xids = itertools.count(secrets.randbits(62) | 1)
        self.incarnation = secrets.randbits(63)  # this endpoint among others of its name (restarts)
        self._incarnations: dict[str, int] = {}  # (initiator) peer -> the incarnation it talks to
        self._inc_md: dict[str, bytes] = {}  # (initiator) peer -> that incarnation's metadata (to reach it)
        self._retired: dict[str, set[int]] = {}  # (initiator) peer -> its incarnations met and gone
        # _lock guards the protocol's state below; taken before the agent's lock (driver.lock),
        # never after.  _plock: one thread at a time takes NIXL's notifications.
        self._lock = threading.RLock()
        self._plock = threading.RLock()  # (an RLock for _is_owned(): _pump never nests)
        # Batches of notifications NIXL handed over and not yet handled (_pump), in order.
        self._batches: list[dict[Any, list[bytes]]] = []
        self._exposures: dict[int, _Exposure] = {}  # xid -> exposure (target)
        self._letgo: list[_Exposure] = []  # taken back, their hold and reference not let go of yet
        self._by_range: dict[tuple[int, int], int] = {}  # (ptr, size) -> xid (target)
        self._connected: set[str] = set()  # peers whose metadata this endpoint loaded (answered)
        self._forgotten: set[str] = set()  # (initiator) peers forget_peer() dropped, not loaded since
        self._forgetting: set[str] = set()  # peers a forget_peer() runs for: no lease is asked for meanwhile
        # Peers (None: every peer) a thread waits in _while_idle to load: no transfer with them
        # starts meanwhile, so that a stream of them cannot keep the load waiting for ever.
        self._draining: dict[str | None, int] = {}
        self._leases: dict[tuple[str, int], _Lease] = {}  # (peer, xid) -> lease (initiator)
        self._holds: dict[int, list[_Lease]] = {}  # hold request -> leases asked for
        # (peer, seq) -> a posted confirm=True transfer whose verdict has not come: weak, so one
        # the application drops unwaited (or whose answer never comes) leaves nothing behind.
        self._waiting: weakref.WeakValueDictionary[tuple[str, int], Transfer] = weakref.WeakValueDictionary()
        self._views: dict[str, tuple[int, dict[int, None]]] = {}  # peer -> (dereg, metadata keys loaded)
        # Changes to NIXL's view of a peer (a load, a removal, an erasure), counted per peer, and
        # of an unknown one (a load of metadata not yet named: any peer's) in _view_serial;
        # _serial_of(peer) is their sum.  A prepped list made before a change names what NIXL
        # held then, and is made again (_Prep); a refused question counts against a peer only
        # over a connection no change of that peer's view came after (_ask_incarnation): another
        # peer's loads say nothing of it.
        self._view_serial = 0
        self._peer_serials: dict[str, int] = {}
        self._preps: set[_Prep] = set()  # the prepped lists of this endpoint's open Prepareds
        self._other: list[tuple[str, bytes]] = []
        self._notes: list[str] = []  # warnings to raise once the state change at hand is done (_note)
        # Past their wait()'s timeout, not over (a dict for its order: ``del`` takes one off
        # with no call, so no check point).
        self._inflight: dict[Transfer, None] = {}
        self._lost: set[Transfer] = set()  # not over, NIXL's view of their peer erased (Transfer.lost)
        self._running: set[Transfer] = set()  # every posted transfer NIXL has not ended (polled here)
        # Lease drops whose sending failed: (peer, message, when to try again, tries so far).
        self._drops: list[tuple[str, bytes, float, int]] = []
        # Leases revoked and not yet dropped (their transfers still run, or an interrupt
        # stopped the drop): progress() drops each once idle.
        self._revoked: dict[tuple[str, int], _Lease] = {}
        self._unacked: set[tuple[str, int]] = set()  # (closing initiator) (peer, xid) drops not yet acknowledged
        # request -> (peer, dereg, incarnation, metadata)
        self._md_asked: dict[int, tuple[str, int, int, bytes] | None] = {}
        self._who_asked: dict[int, tuple[str, int] | None] = {}  # request -> (peer, its incarnation)
        self.dropped_notifications = 0  # application messages let go: progress() was not called
        self.unanswered = 0  # (target) messages it could not answer (peer not connected, send failed)
        self.stale_transfers = 0  # (target) transfers whose arrival found their exposure changed
        self.stale_answers = 0  # (initiator) bad verdicts received
        self.malformed_notifications = 0  # with gpupin's prefix but not its layout (progress() returns them)
        self.stale_exposures = 0  # (target) exposures whose allocation changed under a lease (detected)
        self.lost_transfers = 0  # (initiator) transfers whose state NIXL could not tell (Transfer.lost)
        self.view_reloads_asked = 0  # (initiator) views of a peer connect() made untrusted
        self.watch_interval = 0.005  # (target) how often progress() checks leased exposures' buffer ids
        self._last_pump = self._next_watch = 0.0
        self._last_post = 0.0  # (initiator) when a transfer was last posted
        self.transfers = 0
        self.leases_asked = 0
        self.renewals = 0  # (initiator) peers' views forgotten because they dropped a registration
        self.lists_prepped = 0  # (initiator) NIXL descriptor lists prepped for Prepared transfers
        self.confirm_s = 0.0
        self._progress_stop: threading.Event | None = None
        if auto_progress:
            self._start_progress()

    @property
    def name(self) -> str:
        return self.driver.name

    @property
    def agent(self) -> Any:
        return self.driver.agent

    def metadata(self) -> bytes:
        with self.driver.lock:
            return bytes(self.agent.get_agent_metadata())

    def connect(self, metadata: bytes, timeout: float = 30.0) -> str:
        """Load a peer agent's metadata (again after it registered more); returns its name.
        A target answers only peers it connected.

        A load NIXL refuses erases its whole view of the peer (loadRemoteSections in
        nixl_agent.cpp), and a transfer still running with the peer is then reported NOT_FOUND
        while UCX may still move its bytes.  So a peer's metadata is loaded only while no
        transfer of this endpoint with it runs: this waits up to ``timeout`` s for them to end
        (InUse after that: ``settle()`` first).  Metadata whose agent name cannot be read waits
        for every transfer of this endpoint."""
        peer = _agent_name(metadata)
        return self._while_idle(peer, lambda: self._connect(metadata, peer), time.monotonic() + timeout, "connect()")

    def _connect(self, metadata: bytes, peer: str | None) -> str:
        """(under _lock, no transfer with the peer running) The application's load: metadata of
        unknown age, which may name registrations the peer has dropped since (NIXL adds every
        descriptor it lacks, beside the live ones).  The endpoint trusts its view of the peer no
        more: the next transfer with it loads the peer's current metadata first.  Distrusted
        before NIXL's load as well as after it: an interrupt (Python raises one as a call
        returns) must not leave a view of unknown age trusted."""
        named = peer or _agent_name(metadata)
        before = named is not None and self._views.pop(named, None) is not None
        got = self._add(metadata, peer)
        if got in self._views or (before and got == named):
            self._views.pop(got, None)
            self.view_reloads_asked += 1
        return got

    def forget_peer(self, peer: str, timeout: float = 1.0) -> None:
        """Drop everything known of ``peer``: its leases on this target's exposures (call it
        only once that peer can transfer no more, e.g. its process is dead: unexpose then
        completes without its word), this initiator's leases with it (each given back to the
        peer where it can still hear: up to ``timeout`` s for it to say so), and NIXL's view of it.
        InUse while a transfer of this endpoint with the peer runs (NIXL would report it over
        while UCX may still move its bytes): ``settle()`` first.  Transfers NIXL lost track of
        (their wait() says so) are let go here, with their buffers and leases."""
        marked = False
        try:
            with self._lock:
                if peer in self._forgetting:
                    raise InUse(f"forget_peer({peer!r}): another thread forgets {peer} now")
                self._refuse_if_busy(peer)
                self._forgetting |= {peer}  # (an operator, no call: no check point before the flag)
                marked = True
            self._forget_peer(peer, timeout)
        finally:
            if marked:  # taken back whatever came since
                with self._lock:
                    self._forgetting.discard(peer)

    def _forget_peer(self, peer: str, timeout: float) -> None:
        """(forget_peer, the peer marked as being forgotten: no transfer with it starts)"""
        with self._lock:
            self._refuse_if_busy(peer)  # (one that started before the mark)
            for t in [t for t in self._lost if t._leases[0].peer == peer]:
                self._complete(t, "ERR")  # lost with the peer: the caller says it transfers no more
            for ex in list(self._exposures.values()):
                ex.holders.pop(peer, None)
                ex.grants.pop(peer, None)
                self._finish_if_settled(ex)
            # Given back before NIXL's view of the peer goes: a notification still inside UCX
            # when the connection closes is lost (as at close()).
            for key in [k for k in self._leases if k[0] == peer]:
                lease = self._leases.pop(key)
                self._holds.pop(lease.grant, None)  # one still asked for: its grant, if any, comes after this
                if lease.inflight == 0 and lease.state in ("asking", "granted", "held", "revoked"):
                    if self._send(peer, _pack(_DROP, (lease.xid, lease.checks, 1, lease.grant))):
                        self._unacked.add((peer, lease.xid))
        deadline = time.monotonic() + timeout
        while any(p == peer for p, _ in self._unacked) and time.monotonic() < deadline:
            self._pump()
            time.sleep(_NAP_MIN_S)
        with self._lock:
            self._unacked = {u for u in self._unacked if u[0] != peer}
            self._refuse_if_busy(peer)  # none can have started: its leases are gone, new ones refused
            self._forget_view(peer)
            # Its drops went out above and NIXL can send it nothing more: a late grant or
            # revocation from it gets no drop (until it is loaded again).  Its incarnation is
            # kept: a descriptor of it, once a later one was met, is refused.  Its metadata goes:
            # the application says it can transfer no more, so a descriptor of another
            # incarnation is its restart (no connection to the forgotten one is tried again).
            self._forgotten.add(peer)
            self._inc_md.pop(peer, None)

    def _refuse_if_busy(self, peer: str) -> None:
        if self._busy_with(peer):
            raise InUse(
                f"forget_peer({peer!r}): a transfer with {peer} still runs; settle() first (its buffers "
                "stay registered and its leases held until NIXL says it ended)"
            )

    def _busy_with(self, peer: str | None) -> bool:
        """Whether a transfer with ``peer`` (None: with any peer) runs (its leases count it).
        A lost one does not count: NIXL can say no more of it, and a load of the peer (which
        waits for this) harms it no further."""
        return any(lease.inflight > lease.lost for (p, _), lease in self._leases.items() if peer is None or p == peer)

    def _while_idle(self, peer: str | None, work: Callable[[], _T], deadline: float, what: str) -> _T:
        """``work()`` under _lock once no transfer with ``peer`` (None: any) runs.  post() holds
        _lock while it posts, so none starts before ``work`` returns.  The lock is let go between
        polls: the threads whose transfers are waited for take it to end them.  Meanwhile no new
        transfer with ``peer`` starts (post() waits): a stream of them would never leave a gap."""
        counted = False
        try:
            with self._lock:
                if not self._busy_with(peer):
                    return work()
                self._draining[peer] = self._draining.get(peer, 0) + 1
                counted = True  # (no check point since the count: undone below whatever comes)
            while True:
                if time.monotonic() > deadline:
                    raise InUse(
                        f"{what}: a transfer with {peer or 'a peer'} still runs, and NIXL's view of a peer may change "
                        "only while none does (a refused load erases it under the transfer): settle() first"
                    )
                self._poll_inflight()
                time.sleep(_NAP_MIN_S)
                with self._lock:
                    if not self._busy_with(peer):
                        return work()
        finally:
            if counted:
                with self._lock:
                    if self._draining[peer] == 1:
                        del self._draining[peer]
                    else:
                        self._draining[peer] -= 1

    def _add(self, metadata: bytes, peer: str | None) -> str:
        """(under _lock, no transfer with ``peer`` running) add_remote_agent.  A refused load
        erased NIXL's view of the peer (its sections and connection): it is loaded whole next
        time (first contact)."""
        with self.driver.lock:
            self._view_changed(peer)  # a refused load changes the view too (it erases the peer)
            try:
                name = self.agent.add_remote_agent(metadata)
            except Exception as exc:  # noqa: BLE001
                if peer is not None:
                    self._views.pop(peer, None)
                    self._connected.discard(peer)
                raise _nixl_error("add_remote_agent", exc) from None
        got = name.decode() if isinstance(name, bytes) else str(name)
        if peer is not None and got != peer:
            self._view_changed(got)
        self._connected.add(got)
        self._forgotten.discard(got)
        return got

    def _forget_view(self, peer: str) -> None:
        """(under _lock) Forget this initiator's leases with ``peer``, the drops owed to it and
        NIXL's view of it."""
        for key in [k for k in self._leases if k[0] == peer]:
            del self._leases[key]
        # Requests still asked for: their grants, if any come, are late ones (given back, or for a
        # forgotten peer nothing), not answers to a lease that is gone.
        self._holds = {req: asked for req, asked in self._holds.items() if asked[0].peer != peer}
        self._drops = [d for d in self._drops if d[0] != peer]
        self._revoked = {k: lease for k, lease in self._revoked.items() if k[0] != peer}
        self._remove_view(peer)
        self._connected.discard(peer)

    def _remove_view(self, peer: str) -> None:
        """(under _lock, no transfer with ``peer`` running) NIXL's view of ``peer`` goes.
        remove_remote_agent returns nothing: invalidateRemoteMD fails only for a name NIXL does
        not know (nothing to forget) or its own (refused at construction)."""
        self._views.pop(peer, None)  # (before NIXL's call: an interrupt leaves it untrusted)
        self._connected.discard(peer)  # (loaded again, whole, by the next _add)
        with self.driver.lock:
            self._view_changed(peer)
            self.agent.remove_remote_agent(peer)

    # -- target side -----------------------------------------------------------
    def expose(self, ptr: int, size: int, *, epoch: int = 0) -> RemoteBuffer:
        """The descriptor of [ptr, ptr + size) for peers: its allocation is registered (through
        the cache, so again only if it was freed and reallocated), named by buffer id, held in
        the cache and held from ``free`` in the provider, until ``unexpose``.  ``epoch``: the
        application's version of this block (for allocator-level reuse without a free:
        ``unexpose``, then ``expose`` again with a new epoch).  Exposing an exposed range with
        the same epoch returns its descriptor again; with another epoch it is InUse."""
        if not 0 <= epoch < 1 << 64:
            raise InvalidArgument(f"expose(epoch={epoch}): an epoch is an integer in [0, 2^64)")
        reap()  # before this endpoint's lock: never under it (the cache's acquire_unreaped below)
        with self._lock:
            xid = self._by_range.get((ptr, size))
            if xid is not None and self._buffer_changed(self._exposures[xid]):
                # Freed behind the provider's hold since: that exposure names memory gone; it is
                # taken back (from its holders too) and the range exposed anew below.
                self._take_back_stale(self._exposures[xid])
                xid = None
            if xid is not None:
                ex = self._exposures[xid]
                if ex.epoch != epoch:
                    raise InUse(
                        f"expose({ptr:#x}, {size}, epoch={epoch}): exposed under epoch {ex.epoch}; unexpose() it "
                        "first (that waits until no peer can still write into it)"
                    )
                return self._descriptor(ex)
            for old in self._exposures.values():
                # Taken back, but a holder has not said its transfers are over (unexpose timed
                # out): its writes may still land there.
                if old.revoked and not old.done and old.ptr < ptr + size and ptr < old.ptr + old.size:
                    late = sorted(p for p, (_, d) in old.holders.items() if d < 0)
                    raise InUse(
                        f"expose({ptr:#x}, {size}): overlaps [{old.ptr:#x}, +{old.size}), still being taken back "
                        f"from {', '.join(late) or 'its holders'} (their transfers may still land there): call "
                        "unexpose() on it again, or forget_peer() a peer that can transfer no more"
                    )
            reg = self.cache.acquire_unreaped(ptr, size)
            hold = None
            holder = getattr(self.memory, "hold_free", None)
            try:
                if holder is not None:
                    hold = holder(ptr, f"exposed to NIXL peers by endpoint {self.name!r}: unexpose() it first")
            except BaseException:
                reg.release()
                raise
            ex = _Exposure(next(self._xids), ptr, size, epoch, reg.buffer_id, reg, hold)
            self._exposures[ex.xid] = ex
            self._by_range[(ptr, size)] = ex.xid
            return self._descriptor(ex)

    def _descriptor(self, ex: _Exposure) -> RemoteBuffer:
        return RemoteBuffer(
            self.name, ex.ptr, ex.size, self.driver.devid, self.driver.mem_type, ex.buffer_id, ex.xid, ex.epoch,
            ex.reg.token, self.driver.deregistrations, self.incarnation, self.metadata(),
        )  # fmt: skip

    def unexpose(self, remote: RemoteBuffer, timeout: float = 30.0) -> None:
        """Take an exposed range back: no new lease on it from now on, every holder is told
        (REVOKE), and this returns once each has said its transfers are over and their
        notifications arrived; then the registration may be evicted and the allocation freed.
        InUse after ``timeout`` naming the holders that did not answer (the range stays taken
        back but held: call unexpose again, or ``forget_peer`` a peer that is dead)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            if self._letgo:  # (one an interrupt left half let go of: finished first)
                self._let_go_of_exposures()
            ex = self._exposures.get(remote.xid)
            if ex is None or ex.done:
                return
            again = ex.revoked
            if not ex.revoked:
                ex.revoked = True
                self._by_range.pop((ex.ptr, ex.size), None)
            for peer, (got, dropped) in ex.holders.items():  # again on a later call: one may have been lost
                # On a later call also where the drop came and a check it counts never will (an
                # interrupt took it off its batch unhandled): the holder, which knows the lease
                # no more, answers with a drop of no check (no transfer of it runs: it dropped).
                if dropped < 0 or (again and got < dropped):
                    self._send(peer, _pack(_REVOKE, (ex.xid, OK)))
            self._finish_if_settled(ex)
        while not ex.done:
            if time.monotonic() > deadline:
                with self._lock:
                    late = sorted(
                        f"{p} ({'no drop yet' if d < 0 else f'{got} of its {d} checks arrived'})"
                        for p, (got, d) in ex.holders.items()
                        if d < 0 or got < d
                    )
                raise InUse(
                    f"unexpose({ex.ptr:#x}, {ex.size}): peer(s) {', '.join(late)} still hold a lease after {timeout} s "
                    "(they must call progress(), or run with auto_progress=True); the range stays held: call "
                    "unexpose() again, or forget_peer() a peer that can transfer no more"
                )
            self._pump()
            if not ex.done:
                time.sleep(0.0002)

    def _finish_if_settled(self, ex: _Exposure) -> None:
        if ex.revoked and not ex.done and ex.settled():
            # Journaled before it is marked done (an operator, no call: no check point between
            # the three stores), let go of after: an interrupt in a release leaves the rest to
            # the next pump or unexpose.
            self._letgo += [ex]
            ex.done = True
            del self._exposures[ex.xid]
            self._let_go_of_exposures()

    def _let_go_of_exposures(self) -> None:
        """(under _lock) Release the free hold and the cache reference of each exposure taken
        back and not yet let go of; each is off the journal only once both releases returned
        (the hold's release is idempotent, the reference's is once)."""
        while self._letgo:
            ex = self._letgo[0]
            try:
                if ex.hold is not None:
                    self.memory.release_free_hold(ex.hold)  # type: ignore[attr-defined]
            finally:  # (the reference goes also if an interrupt came as the hold went)
                ex.reg.release()
            del self._letgo[0]

    def progress(self) -> list[tuple[str, bytes]]:
        """Take NIXL's new notifications: answer lease requests and transfers (target), file
        grants, verdicts and revocations (initiator); return the others, the application's own,
        as (peer, message), also those that came while a transfer waited."""
        self._pump()
        with self._lock:
            out, self._other = self._other, []
        return out

    def _pump(self, *, flush: bool = True) -> None:
        """Take NIXL's notifications and handle them; then raise the warnings noted meanwhile
        (``flush=False``: left for the caller, who is in the middle of something)."""
        reap()
        plock = self._plock
        if plock._is_owned():  # type: ignore[attr-defined]  # (this thread pumps: never nested)
            return
        # Taken inside the try and let go if held: an interrupt as the acquire returns (a
        # check point before any store) must not leave it taken, every later pump a no-op.
        try:
            if not plock.acquire(blocking=False):
                return  # another thread takes them right now
            with self.driver.lock:
                try:
                    # Into the backlog as it comes (a C call's return, no check point before
                    # the store): an interrupt while a batch is handled leaves the rest of it
                    # for the next pump.
                    self._batches.append(self.agent.get_new_notifs())
                except Exception as exc:  # noqa: BLE001
                    self.driver.peer_failed()
                    raise _nixl_error("get_new_notifs", exc) from None
            with self._lock:
                self._last_pump = time.monotonic()
                self._handle_batches()
                if len(self._other) > _OTHER_MAX:  # the application never takes its messages
                    self.dropped_notifications += len(self._other) - _OTHER_MAX
                    del self._other[: len(self._other) - _OTHER_MAX]
                if self._last_pump >= self._next_watch:
                    self._watch()
                if self._drops:
                    self._retry_drops()
                if self._revoked:
                    self._drop_revoked()
                if self._letgo:
                    self._let_go_of_exposures()
            if self._running:
                self._poll_inflight()
        finally:
            try:  # (no question first: its return would be a check point with the lock held)
                plock.release()
            except RuntimeError:  # not this thread's: its acquire failed, or never ran
                pass
        if flush and self._notes:  # the batch is handled whole: now its warnings
            self._flush_notes()

    def _handle_batches(self) -> None:
        """(under _lock, _plock held) Handle the messages of the batches NIXL handed over, in
        order, each taken off its batch before it is handled: an interrupt loses at most the
        one it came in (handling one twice could answer a lease request twice), and the next
        pump goes on with the rest."""
        batches = self._batches
        while batches:
            batch = batches[0]
            if not batch:
                del batches[0]
                continue
            key = next(iter(batch))
            msgs = batch[key]
            if type(msgs) is not list:  # (NIXL's bindings give lists; anything else is made one)
                msgs = batch[key] = list(msgs)
            if not msgs:
                del batch[key]
                continue
            m = msgs[0]
            del msgs[0]
            peer = key.decode(errors="replace") if isinstance(key, bytes) else str(key)
            try:
                self._on_message(peer, bytes(m))
            except Exception as exc:  # noqa: BLE001 - the batch's other messages still count
                self._unanswered(f"a message from {peer} failed ({type(exc).__name__}: {exc})")

    def _watch(self) -> None:
        """(target) Detection: an exposure whose allocation changed while peers hold leases on it
        (freed without unexpose, behind the provider's hold) is taken back from them with the
        reason; their transfers since the change may have landed in the new owner's memory."""
        self._next_watch = self._last_pump + self.watch_interval
        for ex in list(self._exposures.values()):
            if not ex.revoked and ex.holders and self._buffer_changed(ex):
                self._take_back_stale(ex)

    def _take_back_stale(self, ex: _Exposure) -> None:
        """(under _lock) ``ex``'s allocation changed behind the provider's hold: taken back from
        its holders with the reason (revoked as FREED), and let go once they answered."""
        self.stale_exposures += 1
        if self.stale_exposures == 1:
            self._note(
                f"endpoint {self.name!r}: the allocation at {ex.ptr:#x} changed while exposed "
                "(freed without unexpose()): peers' writes since then may be in its new owner's memory; "
                "their leases are revoked (counted in stale_exposures)"
            )
        ex.revoked = True
        self._by_range.pop((ex.ptr, ex.size), None)
        for peer, (_, dropped) in ex.holders.items():
            if dropped < 0:
                self._send(peer, _pack(_REVOKE, (ex.xid, FREED)))
        self._finish_if_settled(ex)

    def _on_message(self, peer: str, m: bytes) -> None:
        parsed = _parse(m)
        if parsed is None:
            if m.startswith(b"gpupin-nixl"):  # our prefix, not our layout: the app's to see
                self._malformed(peer, m)
            self._other.append((peer, m))
            return
        kind, head, entries = parsed
        if kind == _HOLD:
            self._on_hold(peer, head[0], entries)
        elif kind == _MDASK:
            if peer in self._connected:  # as grants: to connected peers only
                md = _pack(_MD, (head[0], self.driver.deregistrations, self.incarnation))
                with self.driver.lock:
                    md += bytes(self.agent.get_agent_metadata())
                self._send(peer, md)
            else:
                self._not_connected(peer)
        elif kind == _MD:
            if head[0] in self._md_asked:
                self._md_asked[head[0]] = (peer, head[1], head[2], m[head[3] :])
        elif kind == _WHO:
            if peer in self._connected:  # as grants: to connected peers only
                self._send(peer, _pack(_IAM, (head[0], self.incarnation)))
            else:
                self._not_connected(peer)
        elif kind == _IAM:
            if head[0] in self._who_asked:
                self._who_asked[head[0]] = (peer, head[1])
        elif kind == _XFER:
            self._on_xfer(peer, head[0], entries)
        elif kind == _DROP:
            ex = self._exposures.get(head[0])
            # The drop of the lease the peer holds (its grant named; 0: a peer that knows of
            # no lease answering a revocation), not of a grant it gave up on while it asked again.
            if ex is not None and peer in ex.holders and head[3] in (ex.grants.get(peer), 0 if ex.revoked else None):
                ex.holders[peer][1] = head[1]
                self._finish_if_settled(ex)
            if head[2] and peer in self._connected:  # a closing initiator waits for this
                self._send(peer, _pack(_DROPPED, (head[0],)))
        elif kind == _DROPPED:
            self._unacked.discard((peer, head[0]))
        elif kind == _GRANT:
            asked = self._holds.get(head[0])
            if asked is None:  # late (given up on): the target holds leases nobody uses
                if peer in self._forgotten or not self._knows(peer):  # (forget_peer dropped them)
                    return
                for xid, status, *_ in entries:
                    if status == OK:
                        self._send_drop(peer, _pack(_DROP, (xid, 0, 0, head[0])))
            elif asked[0].peer == peer:  # else not ours
                del self._holds[head[0]]
                verdicts = {x: (st, d, lo, n) for x, st, d, lo, n in entries}
                for one in asked:
                    status, dereg, lo, n = verdicts.get(one.xid, (GONE, 0, 0, 0))
                    if self._leases.get((peer, one.xid)) is not one or one.state != "asking" or one.grant != head[0]:
                        if status == OK:  # its lease went meanwhile: given back, as a late grant is
                            self._send_drop(peer, _pack(_DROP, (one.xid, 0, 0, head[0])))
                        continue
                    one.dereg, one.addr, one.size = dereg, lo, n
                    # granted: usable once the asking thread loaded its registration ("held")
                    one.state, one.verdict = ("granted", OK) if status == OK else ("refused", status)
        elif kind == _ACK:
            seq, status, xid = head
            if status != OK:
                self.stale_answers += 1
                broken = self._leases.get((peer, xid))
                if broken is not None and not broken.broken:
                    broken.broken = _VERDICT.get(status, f"verdict {status}")
            waiter = self._waiting.pop((peer, seq), None)
            if waiter is not None:
                waiter.verdict = (status, xid)
        elif kind == _REVOKE:
            revoked = self._leases.get((peer, head[0]))
            if revoked is None:
                if peer not in self._forgotten and self._knows(peer):  # a lease it forgot (given up on
                    # while asked): the target waits
                    self._send_drop(peer, _pack(_DROP, (head[0], 0, 0, 0)))
            else:
                revoked.state = "revoked"
                self._revoked[(peer, head[0])] = revoked
                if head[1] != OK and not revoked.broken:
                    revoked.broken = _VERDICT.get(head[1], f"verdict {head[1]}")
                self._drop_if_idle(revoked)

    def _knows(self, peer: str) -> bool:
        """Whether this endpoint ever loaded ``peer`` or asked it for a lease: a revocation or a
        grant from another name is foreign (or for an endpoint gone), and not answered."""
        if peer in self._connected or peer in self._views or peer in self._incarnations:
            return True
        self._unanswered(f"a lease message from {peer}, which this endpoint never connected")
        return False

    def _malformed(self, peer: str, m: bytes) -> None:
        self.malformed_notifications += 1
        if self.malformed_notifications == 1:
            self._note(
                f"a notification from {peer} starts with gpupin's prefix but is {len(m)} bytes, "
                "not one of gpupin's messages: handed to the application as its own (counted in "
                "malformed_notifications); is another gpupin version, or the application, using the prefix?"
            )

    def _note(self, text: str) -> None:
        """A warning for later: none is raised in the middle of handling a message or a state
        change (under ``-W error`` one would lose the rest of the batch, or a transfer's end);
        _flush_notes() raises them once that is done, outside the locks."""
        self._notes.append(text)

    def _flush_notes(self) -> None:
        while True:
            try:
                text = self._notes.pop(0)
            except IndexError:  # another thread raised the last one
                return
            warnings.warn(f"gpupin.nixl: {text}", RuntimeWarning, stacklevel=3)

    def _send(self, peer: str, msg: bytes) -> bool:
        with self.driver.lock:
            try:
                self.agent.send_notif(peer, msg)
                return True
            except Exception as exc:  # noqa: BLE001 - the other answers still go
                self.driver.peer_failed()
                self._unanswered(
                    f"cannot send to {peer} ({type(exc).__name__} {exc}): load its metadata here first "
                    f"(connect() with {peer}'s metadata()); it waits in vain"
                )
                return False

    def _not_connected(self, peer: str) -> None:
        self._unanswered(
            f"endpoint {self.name!r} does not answer {peer}: it answers only peers it connected (connect() with "
            f"its metadata()); {peer} waits in vain"
        )

    def _unanswered(self, why: str) -> None:
        """Count a message this endpoint could not answer; warn about the first."""
        self.unanswered += 1
        if self.unanswered == 1:
            self._note(why)

    def _verdict_of(self, peer: str, xid: int, epoch: int) -> tuple[int, _Exposure | None]:
        ex = self._exposures.get(xid)
        if ex is None or ex.revoked:
            return GONE, ex
        if ex.epoch != epoch:
            return EPOCH, ex
        try:
            now = self.memory.buffer_id(ex.ptr)
        except GpupinError:
            now = 0
        return (OK if now == ex.buffer_id else FREED), ex

    def _on_hold(self, peer: str, req: int, entries: list[tuple[int, ...]]) -> None:
        if peer not in self._connected:  # answers go to connected peers only
            self._not_connected(peer)
            return
        out = []
        for xid, epoch in entries:
            status, ex = self._verdict_of(peer, xid, epoch)
            if status == OK and ex is not None:
                got, dropped = ex.holders.get(peer, (0, -1))
                # A new lease of a peer that dropped one (a new endpoint on its agent): waited
                # for again; the checks its old lease still has on the way count against that.
                ex.holders[peer] = [got - dropped, -1] if dropped >= 0 else [got, dropped]
                ex.grants[peer] = req
            rng = (ex.ptr, ex.size) if status == OK and ex is not None else (0, 0)
            out.append((xid, status, self.driver.deregistrations, *rng))
        self._send(peer, _pack(_GRANT, (req, len(out)), out))

    def _on_xfer(self, peer: str, seq: int, entries: list[tuple[int, ...]]) -> None:
        worst, worst_xid = OK, 0
        for xid, epoch in entries:
            ex = self._exposures.get(xid)
            holder = ex.holders.get(peer) if ex is not None else None
            if holder is not None:
                holder[0] += 1  # its data is in: counts toward the holder's drop
            if holder is None:
                status = NOT_HELD if ex is not None else GONE
            else:
                status = FREED if ex is not None and self._buffer_changed(ex) else OK
                if ex is not None and ex.epoch != epoch:
                    status = EPOCH
            if status != OK and worst == OK:
                worst, worst_xid = status, xid
            if ex is not None:
                self._finish_if_settled(ex)
        if worst != OK:
            self.stale_transfers += 1
        if peer not in self._connected:
            self._not_connected(peer)
            return
        self._send(peer, _pack(_ACK, (seq, worst, worst_xid)))

    def _buffer_changed(self, ex: _Exposure) -> bool:
        try:
            return self.memory.buffer_id(ex.ptr) != ex.buffer_id
        except GpupinError:
            return True

    def serve(self, seconds: float, until: Callable[[], bool] | None = None) -> list[tuple[str, bytes]]:
        """Run ``progress()`` for up to ``seconds`` (or until ``until()``); the app's notifications."""
        got: list[tuple[str, bytes]] = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not (until and until()):
            got += self.progress()
            time.sleep(0.0002)
        return got

    def _start_progress(self) -> None:
        """A thread that takes notifications every 0.5 ms (holding the endpoint only weakly: a
        dropped endpoint stops it; close() and interpreter exit stop and join it, so that no
        NIXL call runs while the interpreter goes); the application's own wait in progress()."""
        stop = self._progress_stop = threading.Event()
        ref = weakref.ref(self)

        def run() -> None:
            while not stop.wait(0.0005):
                ep = ref()
                if ep is None:
                    return
                if time.monotonic() - ep._last_post < _PUMP_EVERY_S:
                    # A thread posts transfers now and takes notifications itself (at most a
                    # millisecond apart): taking them here too only contends for the locks.
                    del ep
                    continue
                try:
                    ep._pump()
                except Exception:  # noqa: BLE001 - a failing peer: the next transfer says so
                    time.sleep(0.01)
                del ep

        th = self._progress_thread = threading.Thread(target=run, name=f"gpupin-nixl-{self.name}", daemon=True)
        with _registry_lock:
            _PROGRESS_THREADS[th] = stop
        th.start()

    def _stop_progress(self) -> None:
        stop, th = self._progress_stop, getattr(self, "_progress_thread", None)
        if stop is None or th is None:
            return
        stop.set()
        if th is not threading.current_thread():
            th.join()

    # -- initiator side ----------------------------------------------------------
    def write(
        self,
        src: int,
        size: int,
        remote: RemoteBuffer,
        offset: int = 0,
        *,
        timeout: float = 30.0,
        confirm: bool = False,
    ) -> None:
        """Copy [src, src + size) into ``remote`` at ``offset``; returns when it is in place.
        ``timeout`` (s): for the whole call (leases, loads, the transfer); ``confirm``: also
        wait for the target's check."""
        self._blocking("WRITE", [(src, size, remote, offset)], timeout=timeout, confirm=confirm)

    def read(
        self,
        dst: int,
        size: int,
        remote: RemoteBuffer,
        offset: int = 0,
        *,
        timeout: float = 30.0,
        confirm: bool = False,
    ) -> None:
        """Copy ``size`` bytes of ``remote`` at ``offset`` into [dst, dst + size)."""
        self._blocking("READ", [(dst, size, remote, offset)], timeout=timeout, confirm=confirm)

    def write_blocks(self, blocks: list[tuple[int, int, RemoteBuffer, int]], **kw: Any) -> None:
        """Many (local, size, remote, offset) blocks, all to one peer, in one transfer."""
        self._blocking("WRITE", blocks, **kw)

    def read_blocks(self, blocks: list[tuple[int, int, RemoteBuffer, int]], **kw: Any) -> None:
        self._blocking("READ", blocks, **kw)

    def _blocking(
        self,
        op: str,
        blocks: list[tuple[int, int, RemoteBuffer, int]],
        *,
        timeout: float = 30.0,
        confirm: bool = False,
        prep: _Prep | None = None,
    ) -> None:
        deadline = time.monotonic() + timeout  # one timeout for the whole call: leases, loads, the wait
        q = self._quick(op, blocks[0], deadline) if len(blocks) == 1 and prep is None and not confirm else None
        if q is _OVER:
            if self._notes:
                self._flush_notes()
            return
        # A Transfer from _quick was polled for _SPIN_S already (_quick_wait): not spun again.
        # (A class test, not isinstance: no call, so no check point where q is held by this
        # frame alone.)  _post puts its untracked Transfer in ``made`` as it makes it: one an
        # interrupt caught on its way here is polled to its end.
        made: list[Transfer] = []
        try:
            t = q if q.__class__ is Transfer else self._post(op, blocks, timeout, confirm, False, prep, made)
        except BaseException:
            if made and made[0].state == "PROC":
                self._orphan(made[0])
            raise
        try:
            t._wait(max(0.0, deadline - time.monotonic()), confirm, 0.0 if t is q else _SPIN_S)
        except BaseException:
            if t.state == "PROC":  # interrupted (its timeout does this itself): polled from now on
                self._orphan(t)
            raise
        finally:
            if confirm:
                with self._lock:
                    self._waiting.pop((t._leases[0].peer, t.seq), None)
        if self._notes:
            self._flush_notes()

    def post_write(self, blocks: list[tuple[int, int, RemoteBuffer, int]], *, timeout: float = 30.0) -> Transfer:
        """Start a WRITE of (local, size, remote, offset) blocks to one peer; returns at once."""
        return self.post("WRITE", blocks, timeout=timeout)

    def post_read(self, blocks: list[tuple[int, int, RemoteBuffer, int]], *, timeout: float = 30.0) -> Transfer:
        return self.post("READ", blocks, timeout=timeout)

    def post(
        self,
        op: str,
        blocks: list[tuple[int, int, RemoteBuffer, int]],
        *,
        timeout: float = 30.0,
        confirm: bool = False,
    ) -> Transfer:
        """One NIXL transfer of ``blocks``: leases asked for where this endpoint holds none (one
        round trip for all of them), local buffers registered through the cache and held, the
        transfer posted.  ``timeout`` bounds the lease request.  Polled by the endpoint (its
        progress thread, its next post) until NIXL ends it, also if never waited for."""
        t = self._post(op, blocks, timeout, confirm, tracked=True)
        if self._notes:
            self._flush_notes()
        return t

    def prepare(self, op: str, blocks: list[tuple[int, int, RemoteBuffer, int]]) -> Prepared:
        """The same ``blocks`` to transfer many times (a KV-cache layer's blocks, a ring of
        staging buffers), with NIXL's prepped descriptor lists (``prep_xfer_dlist``,
        ``make_prepped_xfer``: NIXL resolves the descriptors once, not at every transfer).
        Each ``post()``/``run()`` of the :class:`Prepared` takes the leases and registrations a
        ``post`` takes and keeps the same promises; NIXL's lists are made at the first post and
        again whenever what they name changed since (any load or removal of a peer's metadata,
        a local buffer registered anew).  Nothing is sent here; ``close()`` it when done."""
        if op not in ("WRITE", "READ"):
            raise InvalidArgument(f"prepare({op!r}): 'WRITE' or 'READ'")
        if not blocks:
            raise InvalidArgument(f"prepare({op!r}, []): no blocks")
        blocks = list(blocks)
        _check_blocks(op, blocks)
        r0 = blocks[0][2]
        if r0.agent == self.driver.name:
            raise InvalidArgument(f"prepare({op!r}): into this endpoint's own exposure ({r0.agent})")
        lspec, rspec = _specs(blocks, self.driver.devid)
        prep = _Prep(r0.agent, lspec, rspec, r0.mem_type)
        with self._lock:
            if self.driver._agent is None:
                raise NixlError(f"prepare(): endpoint {self.name!r} is closed")
            self._preps.add(prep)
        return Prepared(self, op, blocks, prep)

    def _unprepare(self, prep: _Prep) -> None:
        with self._lock:
            if prep.closed:
                return
            prep.closed = True
            self._preps.discard(prep)
            with self.driver.lock:
                prep.drop(local=True, remote=True)

    def _post(
        self,
        op: str,
        blocks: list[tuple[int, int, RemoteBuffer, int]],
        timeout: float,
        confirm: bool,
        tracked: bool,
        prep: _Prep | None = None,
        made: list[Transfer] | None = None,
    ) -> Transfer:
        """post(); ``tracked=False`` for a transfer its caller waits for at once (write/read):
        not polled by other threads meanwhile (the progress thread would take the endpoint's
        locks from the waiter at every poll), and tracked once its wait gives up (_orphan).
        ``prep``: the blocks' prepped lists (Prepared), used where still what they name.
        ``made``: the Transfer is appended to it as it is made (its caller's hold on it)."""
        if _DEFERRED:
            reap()  # before this endpoint's locks and the cache's (a miss pins under them)
        if op not in ("WRITE", "READ"):
            raise InvalidArgument(f"post({op!r}): 'WRITE' or 'READ'")
        if not blocks:
            raise InvalidArgument(f"post({op!r}, []): no blocks")
        r0 = blocks[0][2]
        peer = r0.agent
        if peer == self.driver.name:
            raise InvalidArgument(
                f"post({op!r}): into this endpoint's own exposure ({peer}): NIXL loads no metadata of its own "
                "agent; copy locally, or transfer from another endpoint"
            )
        # One block (a write or a read): taken apart once, no list built for it but NIXL's.
        # A scatter list into one exposure (the same RemoteBuffer in every block): its columns,
        # checked and turned into descriptors by builtins, not a Python loop per block.
        single = len(blocks) == 1
        one = not single and all(map(operator.is_, map(_REMOTE, blocks), itertools.repeat(r0)))
        if single:
            l0, s0, _, o0 = blocks[0]
            if s0 <= 0 or o0 < 0 or o0 + s0 > r0.size:
                _check_blocks(op, blocks)  # raises, saying what is wrong
        elif one:
            locs, sizes, offs = list(map(_LOCAL, blocks)), list(map(_SIZE, blocks)), list(map(_OFFSET, blocks))
            if min(sizes) <= 0 or min(offs) < 0 or max(map(operator.add, offs, sizes)) > r0.size:
                _check_blocks(op, blocks)  # raises, naming the first bad block
        else:
            _check_blocks(op, blocks)
            if len(blocks) > _MAX_ENTRIES and len({r.xid for _, _, r, _ in blocks}) > _MAX_ENTRIES:
                raise InvalidArgument(f"post({op!r}): more than {_MAX_ENTRIES} exposures in one transfer")
        now = time.monotonic()
        deadline = now + timeout
        self._last_post = now
        if self._running:
            self._poll_inflight()
        if now - self._last_pump > _PUMP_EVERY_S:  # revocations reach a busy initiator too
            self._pump()
        while True:
            leases = self._leases_for(peer, blocks[:1] if one else blocks, deadline)
            if self._draining and (peer in self._draining or None in self._draining):
                # A load of the peer's metadata waits for its transfers to end: this one waits
                # for the load (read without the lock: one transfer may still slip in, not a stream).
                if time.monotonic() > deadline:
                    raise NixlError(
                        f"{_what(op, blocks)}: a load of {peer}'s metadata by another thread waited for "
                        "its transfers to end until this one's timeout; nothing was sent: try again"
                    )
                self._poll_inflight()
                time.sleep(_NAP_MIN_S)
                continue
            toks: list[int] = []
            h = None
            posting = False
            counted = 0  # of the leases, those counting it
            seq = -1  # (taken before anything is posted)
            with self._lock:
                why = self._unsendable(peer, leases)
                if why == "view":
                    # NIXL's view of the peer went since the lease check (the application's
                    # connect(), a lost transfer), or is not clean up to a lease's grant: loaded
                    # again before anything is posted.
                    if time.monotonic() > deadline:
                        raise NixlError(f"{_what(op, blocks)}: {peer}'s metadata kept changing under it; try again")
                    continue
                if why == "forgetting":  # (the one-block path takes a held lease without the lock)
                    raise NixlError(f"{_what(op, blocks)}: forget_peer({peer!r}) runs; nothing was sent")
                if isinstance(why, _Lease):  # gone, revoked or found stale since the grant: send nothing
                    reason = (
                        f"an earlier transfer was found stale on arrival ({why.broken})"
                        if why.broken
                        else f"forget_peer({peer!r}) dropped it"
                        if peer in self._forgetting
                        else "the target took it back (unexpose)"
                    )
                    raise StaleRemote(
                        f"NIXL {op} into {peer}'s exposure {why.xid}: {reason} before the transfer was posted; "
                        "nothing was sent. Ask it to expose the buffer again"
                    )
                try:
                    fast, miss = self.cache.fast_lookup, self.cache.miss
                    spans: list[tuple[int, int]] | None = None
                    if single:
                        tok = fast(l0, s0)
                        toks.append(tok if tok >= 0 else miss(l0, s0, tok))
                        spans = []
                    else:  # blocks of one allocation (a scatter list): one lookup for all
                        if one:
                            lo, hi = min(locs), max(map(operator.add, locs, sizes))
                        else:
                            lo, hi = min(b[0] for b in blocks), max(b[0] + b[1] for b in blocks)
                        # A registration held already that covers them all (the steady state):
                        # one C call.  Else the provider says whether one allocation does (blocks
                        # of several allocations: that lookup is not counted in stats()).
                        tok = fast(lo, hi - lo)
                        if tok < 0:
                            try:
                                r = self.memory.range_of(lo)
                                inside = hi <= r.base + r.size
                            except GpupinError:
                                inside = False  # each block on its own below says what is wrong
                            if inside:
                                tok = miss(lo, hi - lo, tok)
                            else:
                                self.cache.unfinished()  # each block is looked up on its own below
                        if tok >= 0:
                            toks.append(tok)
                            spans = []
                    if spans is None:
                        spans = [(b[0], b[1]) for b in blocks]
                    for local, size in spans:  # held (a token each) until the transfer is over
                        tok = fast(local, size)
                        toks.append(tok if tok >= 0 else miss(local, size, tok))
                    seq = next(self._seq)
                    if prep is None:  # NIXL's lists, made here (a Prepared's are made once)
                        if single:
                            lspec = [(l0, s0, self.driver.devid)]
                            rspec = [(r0.addr + o0, s0, r0.devid)]
                        elif one:
                            lspec = list(zip(locs, sizes, itertools.repeat(self.driver.devid)))
                            rspec = list(
                                zip(
                                    map(operator.add, itertools.repeat(r0.addr), offs),
                                    sizes,
                                    itertools.repeat(r0.devid),
                                )
                            )
                        else:
                            lspec, rspec = _specs(blocks, self.driver.devid)
                    agent = self.driver.agent
                    direct = self.driver.direct()
                    with self.driver.lock:
                        # No notification rides on the transfer: one makes DONE wait for its delivery,
                        # which needs the peer's progress (~0.5 ms here for 4 KiB, against ~20 us).
                        # DONE means the data arrived without one too: NIXL's UCX backend ends every
                        # transfer with an endpoint flush after its puts (sendXferRange, ucx_backend.cpp).
                        if prep is not None:
                            if prep.closed:
                                raise InvalidArgument(f"{_what(op, blocks)}: its Prepared was closed")
                            h = prep.make(self, op, toks)
                        elif direct is not None:  # initialize_xfer's calls, without its frames
                            h = direct.request(op, self.driver.mem_type, lspec, r0.mem_type, rspec, peer)
                        else:
                            ldesc = agent.get_xfer_descs(lspec, self.driver.mem_type)
                            rdesc = agent.get_xfer_descs(rspec, r0.mem_type)
                            h = agent.initialize_xfer(op, ldesc, rdesc, peer, b"")
                        _LIVE_XFERS[id(h)] = h
                        # Its leases count it before NIXL posts a byte (a revocation waits for
                        # it), each pass counted: an interrupt between two (Python raises one
                        # at a loop's back edge) leaves no lease behind a running transfer.
                        for lease in leases:
                            lease.inflight += 1
                            counted += 1
                        posting = True  # from here NIXL may have posted puts: the handle is kept
                        state = direct.start(h) if direct is not None else agent.transfer(h)
                except BaseException as exc:
                    self._post_failed(exc, op, blocks, prep, h, toks, leases, seq, posting, counted)
                t = None
                try:
                    t = Transfer(self, h, toks, leases, seq, op, blocks, confirm)
                    if made is not None:
                        made.append(t)
                    if confirm:
                        self._waiting[(peer, seq)] = t
                    if tracked:
                        self._running.add(t)
                    self.transfers += 1
                    if state != "PROC":  # (interrupted at its entry: still PROC, polled from now on)
                        self._complete(t, "DONE" if state == "DONE" else "ERR")
                except BaseException:  # interrupted: polled from now on, as an interrupted wait is
                    self._orphan(t if t is not None else Transfer(self, h, toks, leases, seq, op, blocks, confirm))
                    raise
                return t

    def _unsendable(self, peer: str, leases: list[_Lease]) -> _Lease | str | None:
        """(under _lock) Why nothing may be posted to ``peer`` under ``leases`` now: "view"
        (NIXL's view of the peer went, or is not clean up to a lease's grant: load it again
        first), "forgetting" (forget_peer runs), the first lease no longer held (a REVOKE
        another thread took, a drop, an earlier transfer found stale: checked under the lock
        the revocation takes, up to the count that keeps it), or None: post.  _post and _quick
        ask the same question here."""
        view = self._views.get(peer)
        if view is None or (leases[0].dereg if len(leases) == 1 else max(map(_DEREG, leases))) > view[0]:
            return "view"
        if peer in self._forgetting:
            return "forgetting"
        for lease in leases:
            if self._leases.get((peer, lease.xid)) is not lease or lease.state != "held" or lease.broken:
                return lease
        return None

    def _held_lease(self, peer: str, r: RemoteBuffer) -> _Lease | None:
        """This endpoint's lease on ``r``'s exposure where it is held, sound and for the range
        and use ``r`` names (read without the lock: a post checks it again under it)."""
        lease = self._leases.get((peer, r.xid))
        if (
            lease is not None
            and lease.state == "held"
            and not lease.broken
            and lease.epoch == r.epoch
            and lease.addr == r.addr
            and lease.size == r.size
        ):
            return lease
        return None

    def _quick(self, op: str, block: tuple[int, int, RemoteBuffer, int], deadline: float) -> object:
        """write()/read() of one block in the steady state, in one frame: a lease held and
        sound, NIXL's view of the peer clean up to it (_unsendable, as _post asks), no transfer
        of this endpoint left to poll (``_running``: tracked, or past its wait), nothing to
        reap or to pump, NIXL's bindings at hand (NixlDriver.direct).  The checks, the locks
        and what they guard are _post's; the transfer is _post's untracked one.  None where any
        of it does not hold, with nothing posted or held (_post then runs, and says what is
        wrong); _OVER where NIXL ended the transfer within the post, or within _SPIN_S of
        polling in this frame (_quick_wait, until ``deadline`` at the latest; no Transfer
        made); else the running Transfer."""
        local, size, r, offset = block
        if _DEFERRED or self._running or self._draining or op not in ("WRITE", "READ"):
            return None
        if size <= 0 or offset < 0 or offset + size > r.size:
            return None
        drv, peer = self.driver, r.agent
        direct = drv.direct()
        now = time.monotonic()
        if direct is None or now - self._last_pump > _PUMP_EVERY_S or peer == drv.name:
            return None
        lease = self._held_lease(peer, r)
        if lease is None:
            return None
        self._last_post = now
        until = min(now + _SPIN_S, deadline)
        handed = [False]  # (_quick_wait's try owns the running transfer once it set this)
        running = False  # posted and counted: this frame owns it until handed
        hid = -1  # NIXL's own handle (an int): wrapped (_Direct.wrap) only where it outlives this frame
        toks: list[int] = []
        seq = -1
        try:
            with self._lock:
                if self._unsendable(peer, [lease]) is not None:
                    return None  # _post says why, or loads the view again
                posting = False
                counted = 0
                try:
                    tok = self.cache.fast_lookup(local, size)
                    toks.append(tok if tok >= 0 else self.cache.miss(local, size, tok))
                    seq = next(self._seq)
                    with drv.lock:  # as _post's, without a frame of NIXL's wrappers
                        lspec, rspec = [(local, size, drv.devid)], [(r.addr + offset, size, r.devid)]
                        hid = direct.begin(op, drv.mem_type, lspec, r.mem_type, rspec, peer)
                        # Its lease counts it before NIXL posts a byte, as _post counts (no
                        # check point between the two stores): a revocation waits for it, and
                        # _post_failed keeps a post that raised under a lease that counts it.
                        lease.inflight += 1
                        counted = 1
                        posting = True  # from here NIXL may have posted puts: the handle is kept
                        st = direct.post(hid, b"")
                except BaseException as exc:
                    h = direct.wrap(hid) if hid >= 0 else None
                    self._post_failed(exc, op, [block], None, h, toks, [lease], seq, posting, counted)
                running = True
                self.transfers += 1
                if st == direct.ok:
                    # Over within the post (the lock was held throughout, so no revocation came
                    # in between): what _complete does for it, here; the lease and the token
                    # let go of it also if an interrupt lands as the handle is released.
                    running = False
                    try:
                        with drv.lock:
                            drv.release_id(direct, hid)
                    finally:
                        lease.inflight -= 1
                        self.cache.release_token(toks[0])
                    return _OVER
            # Running, or failed (_quick_wait's first poll says so and acts on it).
            return self._quick_wait(direct, hid, toks[0], lease, seq, op, block, until, handed)
        except BaseException:
            if running and not handed[0]:  # interrupted before _quick_wait took it: polled from now on
                self._orphan(
                    Transfer(self, direct.wrapped(hid) or direct.wrap(hid), toks, [lease], seq, op, [block], False)
                )
            raise

    def _quick_wait(
        self,
        direct: _Direct,
        hid: int,
        tok: int,
        lease: _Lease,
        seq: int,
        op: str,
        block: tuple[int, int, RemoteBuffer, int],
        until: float,
        handed: list[bool],
    ) -> object:
        """_quick's transfer, running (``lease`` counts it), polled as _spin polls it until
        ``until`` (monotonic): _OVER once NIXL says DONE, with what _complete does for a DONE
        transfer done here (no Transfer made: nothing but this frame knows of it).  On any
        other answer, past ``until``, or once the driver retired, the Transfer it would have
        been all along, NIXL's answer acted on as _spin acts on it; if interrupted, that
        Transfer is polled from then on (_orphan), as _blocking does for an interrupted wait."""
        drv = self.driver
        agent = drv._agent
        lock, dlock = self._lock, drv.lock
        state = "PROC"
        # Ending it, each step marked before it is taken: an interrupt (Python raises one as a
        # call returns) finishes the steps not taken and never repeats one; the handle, once
        # NIXL said DONE, is never released again (at worst, an interrupt before its release
        # leaks it: never a double free).
        ending = tok_done = counted = False
        exc: Exception | None = None
        t: Transfer | None = None
        try:
            handed[0] = True  # (no check point since this frame's entry: it owns the transfer now)
            if agent is not None:
                status, in_prog, ok = direct.status, direct.in_prog, direct.ok
                while True:
                    with lock:
                        with dlock:
                            if drv._agent is not agent:
                                break  # retired meanwhile: the Transfer's wait says so
                            try:
                                st = status(hid)
                            except Exception as e:  # noqa: BLE001 - NIXL's own classes
                                state, exc = "QUERY", e
                                break
                            if st == ok:
                                ending = True
                                drv.release_id(direct, hid)
                        if ending:
                            tok_done = True
                            self.cache.release_token(tok)
                            counted = True
                            lease.inflight -= 1
                            if lease.state == "revoked":
                                self._drop_if_idle(lease)
                            return _OVER
                        if st != in_prog:
                            state = "ERR"
                            break
                    if time.monotonic() > until:
                        break
            h = direct.wrap(hid)
            t = Transfer(self, h, [tok], [lease], seq, op, [block], False)
            if state != "PROC":
                with lock:
                    if state == "QUERY":
                        with dlock:
                            state = self._failed_query(t, exc) if exc is not None else "ERR"
                    self._settle(t, state)
            return t
        except BaseException:
            if ending:
                with lock:
                    if not tok_done:
                        tok_done = True
                        self.cache.release_token(tok)
                    if not counted:
                        counted = True
                        lease.inflight -= 1
                        if lease.state == "revoked":
                            self._drop_if_idle(lease)
            elif t is None:  # the Transfer it is from now on, polled (as _blocking does for a wait)
                h = direct.wrapped(hid) or direct.wrap(hid)  # (never a second object for it)
                self._orphan(Transfer(self, h, [tok], [lease], seq, op, [block], False))
            elif t.state == "PROC":
                self._orphan(t)
            raise

    def _post_failed(
        self,
        exc: BaseException,
        op: str,
        blocks: list[tuple[int, int, RemoteBuffer, int]],
        prep: _Prep | None,
        h: Any,
        toks: list[int],
        leases: list[_Lease],
        seq: int,
        posting: bool,
        counted: int = 0,
    ) -> NoReturn:
        """(under _lock) A post that raised ``exc``: what it holds is let go, or, where NIXL
        may have posted puts already (``posting``), kept as a running transfer; then raises.
        ``counted``: how many of ``leases`` (the first ones) count it already."""
        peer = leases[0].peer
        if not posting:
            todo = leases[:counted]
            try:
                _count(todo, -1)
            finally:  # what an interrupt left of it
                _count(todo, -1)
        if prep is not None and not posting:  # made again from scratch next time
            with self.driver.lock:
                prep.drop(local=True, remote=True)
        if posting:  # polled until NIXL says it is over, like any running transfer
            # (_post and _quick count every lease before they set ``posting``; any not counted
            # would let a revocation go while the transfer runs)
            todo = leases[counted:]
            try:
                _count(todo, 1)
            finally:
                _count(todo, 1)
            t = None
            try:
                t = Transfer(self, h, toks, leases, seq, op, blocks, False)
                self._running.add(t)
                self._inflight[t] = None
            except BaseException:  # interrupted: polled from now on all the same
                self._orphan(t if t is not None else Transfer(self, h, toks, leases, seq, op, blocks, False))
                raise
            self.driver.peer_failed()
            disconnected = type(exc).__name__ == "nixlRemoteDisconnectError"
            if disconnected:  # NIXL erased the peer (the endpoint failed: its puts with it)
                self._view_erased(peer)
            if len(blocks) > 1 and not disconnected and isinstance(exc, Exception):
                # NIXL's UCX backend stops at the put that failed; those before it are
                # under way with no flush after them (sendXferRange, ucx_backend.cpp),
                # and nothing NIXL offers says when they end.
                self._lose(t, erased=False)
                raise NixlError(
                    f"{_what(op, blocks)} failed after NIXL posted part of it ({type(exc).__name__} "
                    f"{exc}): the blocks posted before the failure may still move, so every local buffer "
                    f"of it stays registered and its leases held until forget_peer({peer!r})",
                    type(exc).__name__,
                ) from None
            self._check(t)  # over already (NIXL refused it whole): let go of it now
            if isinstance(exc, Exception):
                raise _nixl_error(_what(op, blocks), exc) from None
            raise exc
        release = self.cache.release_token
        try:
            self._let_go(h, toks)
        finally:  # what an interrupt left of them
            _release_tokens(release, toks)
        if isinstance(exc, GpupinError):
            raise exc
        if isinstance(exc, Exception):
            self.driver.peer_failed()
            raise _nixl_error(_what(op, blocks), exc) from None
        raise exc

    def _leases_for(self, peer: str, blocks: list[tuple[int, int, RemoteBuffer, int]], deadline: float) -> list[_Lease]:
        """This endpoint's held leases on the blocks' exposures, asked for where missing."""
        while True:
            try:
                return self._leases_once(peer, blocks, deadline)
            except _AskAgain:  # another thread's request for one of them gave up: ask ourselves
                if time.monotonic() > deadline:
                    raise NixlError(
                        f"NIXL transfer into {peer}'s buffer: what this endpoint knows of {peer} (its leases, "
                        "its incarnation) kept changing under other threads until the timeout; nothing was sent: "
                        "try again"
                    ) from None
                continue

    def _leases_once(
        self, peer: str, blocks: list[tuple[int, int, RemoteBuffer, int]], deadline: float
    ) -> list[_Lease]:
        if len(blocks) == 1:  # the common case: one lease, held and sound
            lease = self._held_lease(peer, blocks[0][2])
            if lease is not None and (view := self._views.get(peer)) is not None and view[0] >= lease.dereg:
                return [lease]  # post() checks it again under the lock
        remotes = {r.xid: r for _, _, r, _ in blocks}
        if len(remotes) < len(blocks):  # several blocks per exposure: one range for each
            for _, _, r, _ in blocks:
                k = remotes[r.xid]
                if r is not k and (r.addr, r.size, r.epoch, r.incarnation) != (k.addr, k.size, k.epoch, k.incarnation):
                    raise InvalidArgument(
                        f"post(): two descriptors of {peer}'s exposure {r.xid} name different ranges or uses "
                        f"([{r.addr:#x}, +{r.size}) and [{k.addr:#x}, +{k.size})); nothing was sent (a descriptor "
                        "is used as expose() made it)"
                    )
        inc = blocks[0][2].incarnation
        if any(r.incarnation != inc for r in remotes.values()):
            raise InvalidArgument(f"post(): blocks for two incarnations of {peer} (it restarted): one transfer, one")
        with self._lock:
            if peer in self._forgetting:
                raise NixlError(f"NIXL transfer into {peer}'s buffer: forget_peer({peer!r}) runs; nothing was sent")
            current = self._incarnations.get(peer)
            if inc in self._retired.get(peer, ()):
                raise StaleRemote(
                    f"NIXL transfer into {peer}'s buffer at {blocks[0][2].addr:#x}: the descriptor is of an "
                    f"incarnation of {peer} that is not the one it runs (it restarted since, or this one is older); "
                    "nothing was sent. Ask it to expose the buffer again"
                )
            if current is None:
                self._incarnations[peer] = inc
                self._inc_md[peer] = blocks[0][2].metadata
            elif current == inc and peer not in self._inc_md and peer not in self._forgotten:
                # Reached again after forget_peer() (a load took its mark off): the metadata to
                # connect to it afresh with, should another incarnation's descriptor come.
                self._inc_md[peer] = blocks[0][2].metadata
        if current is not None and current != inc:
            self._meet_incarnation(peer, current, blocks[0][2], deadline)
        with self._lock:
            for r in remotes.values():
                lease = self._leases.get((peer, r.xid))
                if lease is not None and lease.broken:
                    raise StaleRemote(
                        f"NIXL transfer into {peer}'s buffer at {r.addr:#x} (exposure {r.xid}): an earlier transfer "
                        f"was found stale on arrival ({lease.broken}): the target changed the memory without "
                        "unexpose(); ask it to expose the buffer again"
                    )
                if lease is not None and lease.epoch != r.epoch:
                    raise StaleRemote(
                        f"NIXL transfer into {peer}'s buffer at {r.addr:#x} under epoch {r.epoch}: "
                        f"{_VERDICT[EPOCH]}, {lease.epoch}; nothing was sent"
                    )
                if lease is not None and lease.state == "revoked":
                    raise StaleRemote(
                        f"NIXL transfer into {peer}'s buffer at {r.addr:#x}: the target took the exposure back "
                        "(unexpose); nothing was sent. Ask it to expose the buffer again"
                    )
            ask = [r for r in remotes.values() if (peer, r.xid) not in self._leases]
            first_contact = peer not in self._connected and peer not in self._views
            # Leases held while NIXL's view of the peer is gone (a refused load, a lost transfer):
            # no transfer goes out until the peer's current metadata is loaded again (not an
            # old descriptor's: it may name registrations the target has dropped since).
            # So do held leases granted after the last drop the view is clean of (a renewal that
            # lost a race with another thread's would leave such a view; the loads never do).
            view = self._views.get(peer)
            held = [lease for x in remotes if (lease := self._leases.get((peer, x))) and lease.state == "held"]
            regained = bool(held) and (view is None or any(lease.dereg > view[0] for lease in held))
            # No view while leases of other exposures are held (NIXL erased it): the view loaded
            # next must hold their registrations too, which only the peer's current metadata
            # does (this descriptor's may predate them).
            regained = regained or (
                view is None and any(k[0] == peer and lease.state == "held" for k, lease in self._leases.items())
            )
        if regained:
            if peer not in self._connected:  # NIXL erased the peer: its connection, to ask for the metadata

                def still() -> None:  # a restart met meanwhile: this descriptor's is not the peer's
                    if self._incarnations.get(peer) != inc:
                        raise _AskAgain

                self._reconnect(peer, next(iter(remotes.values())).metadata, deadline, check=still)
            self._refresh(peer, deadline, inc)
        elif first_contact:  # nothing of the peer loaded: no descriptor of it to go stale
            self._load(peer, ask[0] if ask else next(iter(remotes.values())), deadline)
        asked: list[_Lease] = []
        try:
            return self._wait_and_load(peer, remotes, ask, asked, deadline)
        except BaseException:
            # Leases of this request not yet held go: asked ones are given back when their
            # grant comes (late), granted ones now; none is left "granted" for ever (later
            # transfers into it would wait for a load nobody does).
            with self._lock:
                if asked:
                    self._holds.pop(asked[0].grant, None)
                for lease in asked:  # made by this request alone; none posted under yet (not held)
                    if self._leases.get((peer, lease.xid)) is lease and lease.state != "held" and not lease.inflight:
                        del self._leases[(peer, lease.xid)]
                        if lease.state == "granted":
                            self._send_drop(peer, _pack(_DROP, (lease.xid, 0, 0, lease.grant)))
            raise

    def _wait_and_load(
        self, peer: str, remotes: dict[int, RemoteBuffer], ask: list[RemoteBuffer], asked: list[_Lease], deadline: float
    ) -> list[_Lease]:
        """(_leases_for) Ask for the leases in ``ask`` (filling ``asked``), wait for them and for
        those other threads asked for, load each granted one's registration."""
        if ask:
            sent = True
            with self._lock:
                # forget_peer() marks the peer under this lock and then drops every lease it
                # finds: one made after the mark would be deleted with no drop sent (its target
                # holding the exposure for ever), so none is.  The request goes out in the same
                # hold, so that it cannot follow a forget's drops either.
                if peer in self._forgetting:
                    raise NixlError(f"NIXL transfer with {peer}: forget_peer({peer!r}) runs; nothing was sent")
                req = next(self._seq)
                for r in ask:
                    # A lease another thread made since (it asks for it, or holds it now) is
                    # that thread's: waited for, never asked for twice (one request, one grant).
                    if (peer, r.xid) not in self._leases:
                        lease = self._leases[(peer, r.xid)] = _Lease(peer, r.xid, r.epoch, grant=req)
                        asked.append(lease)
                if asked:
                    self._holds[req] = list(asked)
                    self.leases_asked += len(asked)
                    msg = _pack(_HOLD, (req, len(asked)), [(lease.xid, lease.epoch) for lease in asked])
                    sent = self._send(peer, msg)
            if not sent:
                raise NixlError(f"cannot ask {peer} for a lease: load its metadata (connect) and let it load ours")
        # Wait for every lease still asked for: by this thread, or by another one right now
        # (whose registration that thread loads before the lease is held).
        mine = {lease.xid for lease in asked}
        late = time.monotonic() > deadline  # the timeout was spent before any wait
        while True:
            with self._lock:
                waiting = {
                    x: st for x in remotes if (st := self._lease_state(peer, x)) in (_ASKED if x in mine else _PENDING)
                }
            if not waiting:
                break
            if time.monotonic() > deadline:
                raise self._no_lease(peer, waiting, late)
            self._pump()
            time.sleep(_NAP_MIN_S)
        with self._lock:
            leases = []
            for x, r in remotes.items():
                got = self._leases.get((peer, x))
                if got is None and x not in mine:  # another thread's request gave up: not a verdict
                    raise _AskAgain
                if got is None or got.state == "refused":  # refused, or forgotten meanwhile
                    verdict = got.verdict if got is not None else GONE
                    for y in remotes:
                        other = self._leases.get((peer, y))
                        if other is not None and other.state == "refused":
                            del self._leases[(peer, y)]
                    raise StaleRemote(
                        f"NIXL transfer into {peer}'s buffer at {r.addr:#x} (buffer id {r.buffer_id}): refused before "
                        f"any byte moved: {_VERDICT.get(verdict, verdict)}; ask the target to expose the buffer again"
                    )
                if got.state in ("granted", "held") and (got.addr, got.size) != (r.addr, r.size):
                    raise InvalidArgument(
                        f"NIXL transfer into {peer}'s exposure {x}: the descriptor names [{r.addr:#x}, +{r.size}) but "
                        f"the target exposed [{got.addr:#x}, +{got.size}) under it; nothing was sent (a descriptor "
                        "is used as expose() made it)"
                    )
                leases.append(got)
        for lease in asked:  # granted: now its registration is loaded, with no dropped one
            self._load_granted(peer, remotes[lease.xid], lease, deadline)  # failing: the caller gives the rest back
            with self._lock:
                if lease.state == "granted":
                    lease.state = "held"
        return leases

    @staticmethod
    def _no_lease(peer: str, waiting: dict[int, str], late: bool) -> NixlError:
        """(_wait_and_load) The error of a lease wait that timed out, saying what it waited for:
        the target's answer, or another thread's load of a granted lease's registration."""
        if late:
            return NixlError(
                f"NIXL transfer with {peer}: its timeout ran out before a lease request could be answered (the "
                "steps before it took the whole timeout); nothing was sent: try again, or give a longer timeout"
            )
        if any(st == "asking" for st in waiting.values()):
            return NixlError(
                f"no answer from {peer} to a lease request (it must call progress() or serve(), and have "
                "loaded this endpoint's metadata)"
            )
        return NixlError(
            f"NIXL transfer with {peer}: {peer} granted the lease on exposure(s) {sorted(waiting)}, and another "
            f"thread of this endpoint is still loading the registration (NIXL loads a peer's metadata only while "
            f"no transfer with it runs: it waits for those to end); nothing was sent: try again, or give a "
            "longer timeout"
        )

    def _meet_incarnation(self, peer: str, current: int, r: RemoteBuffer, deadline: float) -> None:
        """A descriptor of another incarnation of ``peer`` than the one this endpoint talks to:
        the peer restarted, or the descriptor is of an incarnation that does not run (made before
        a restart, used after the restarted one was met).  Incarnations have no order: the peer
        says which one it runs (a round trip, only here).  One that cannot be reached even over a
        connection made afresh from its own metadata (its process gone) restarted; one that does
        not answer in time is neither (NixlError, nothing changed).  Decided under the lock, once: a thread that finds
        the decision made by another meanwhile asks again (_AskAgain)."""
        inc = r.incarnation
        live = self._ask_incarnation(peer, current, deadline)
        with self._lock:
            if self._incarnations.get(peer) != current:
                raise _AskAgain
            if live is not None and live != inc:
                # The live one is another: this descriptor's is refused now, not retired (it may be
                # a warm spare that takes the name over later; asked again then, one round trip).
                raise StaleRemote(
                    f"NIXL transfer into {peer}'s buffer at {r.addr:#x}: the descriptor is of an incarnation of "
                    f"{peer} that is not the one it runs (it restarted since, or this one is older); nothing was sent. "
                    "Ask it to expose the buffer again"
                )
            self._new_incarnation(peer)  # (takes _lock again: it is reentrant)
            self._retired.setdefault(peer, set()).add(current)
            self._incarnations[peer] = inc
            self._inc_md[peer] = r.metadata
            # forget_peer() forgot the incarnation it saw, not the name: the one adopted here may be
            # connected to (and asked which one runs) whether or not its own load succeeds.
            self._forgotten.discard(peer)

    def _ask_incarnation(self, peer: str, current: int, deadline: float) -> int | None:
        """The incarnation ``peer`` runs now, asked over NIXL's connection to the incarnation this
        endpoint talks to; None if that incarnation cannot be reached even over a connection
        made afresh from its own metadata (its process is gone), or was forgotten (forget_peer:
        the application says it can transfer no more).  A send NIXL refuses proves nothing by
        itself: NIXL may hold no connection to a live peer (another thread's restart between its
        forgetting and its load) or a broken one; a refusal after a fresh connection does.

        Between hosts, UCX makes a connection without reaching the peer, and a send to a dead
        one is taken (queued) and fails later: the question is sent again while no answer came
        (every _WHO_AGAIN_S, doubling), so that the failure shows as a refused send."""
        with self._lock:
            req = next(self._seq)
            self._who_asked[req] = None
            md = self._inc_md.get(peer)
        try:
            fresh: int | None = None  # _serial_of(peer) just after this thread connected afresh
            again = _WHO_AGAIN_S
            while True:
                if fresh is None and peer not in self._connected and md is not None:
                    fresh = self._reconnect_to_ask(peer, current, md, deadline)
                    if fresh < 0:
                        return None
                # Sent under _lock, where every change of NIXL's view is made: a refusal is of the
                # view this thread saw (another thread's reload between its remove and its load
                # would refuse a send to a live peer).
                with self._lock, self.driver.lock:
                    try:
                        self.agent.send_notif(peer, _pack(_WHO, (req,)))
                        sent = True
                    except Exception:  # noqa: BLE001 - NIXL's classes: no (working) connection
                        self.driver.peer_failed()
                        sent = False
                    mine = fresh is not None and fresh == self._serial_of(peer)
                if not sent:
                    if md is None or mine:  # forgotten, or refused over this thread's own connection
                        return None
                    if time.monotonic() > deadline:
                        raise NixlError(
                            f"a descriptor names another incarnation of {peer} than the one this endpoint talks "
                            "to, and NIXL's view of it kept changing while this endpoint asked which one runs; "
                            "nothing changed: try again"
                        )
                    fresh = self._reconnect_to_ask(peer, current, md, deadline)
                    if fresh < 0:
                        return None
                    continue
                until = min(deadline, time.monotonic() + again)
                again = min(again * 2, 1.0)
                while True:
                    with self._lock:
                        got = self._who_asked.get(req)
                    if got is not None and got[0] == peer:
                        return got[1]
                    now = time.monotonic()
                    if now > deadline:
                        raise NixlError(
                            f"a descriptor names another incarnation of {peer} than the one this endpoint talks to, "
                            "and that one does not say which it runs within the timeout (alive, but not calling "
                            "progress()?); nothing changed: try again once it answers"
                        )
                    if now > until:
                        break  # asked again
                    self._pump()
                    time.sleep(_NAP_MIN_S)
        finally:
            with self._lock:
                self._who_asked.pop(req, None)

    def _reconnect_to_ask(self, peer: str, current: int, md: bytes, deadline: float) -> int:
        """(_ask_incarnation) A connection made afresh from the metadata of ``current``, the
        incarnation this endpoint talks to; the serial of NIXL's view of ``peer`` after it
        (_serial_of), or -1 where NIXL cannot
        make one (its backend: UCX finds the process gone).  NIXL refusing the metadata itself
        (NOT_ALLOWED, INVALID_PARAM: a live peer on VRAM after forgetting it) says nothing of the
        process: raised.  Made only while ``current`` is still the one, with that metadata, and
        the peer is not being forgotten (else _AskAgain)."""

        def still() -> None:
            if (
                self._incarnations.get(peer) != current
                or self._inc_md.get(peer) is not md
                or peer in self._forgetting
                or peer in self._forgotten
            ):
                raise _AskAgain

        try:
            return self._reconnect(peer, md, deadline, fresh=True, check=still)
        except InUse as exc:
            raise NixlError(
                f"a descriptor names another incarnation of {peer} than the one this endpoint talks to, and asking "
                f"which one runs needs a new connection while transfers with it run ({exc}); nothing changed"
            ) from None
        except NixlError as exc:
            if exc.status == "nixlBackendError":
                return -1
            raise

    def _new_incarnation(self, peer: str) -> None:
        """``peer`` restarted under its name: forget the old one (its leases, NIXL's view of it)
        once no transfer with it runs; the next load is a first contact."""
        with self._lock:
            if self._busy_with(peer):
                raise NixlError(f"{peer} restarted and a transfer with its old incarnation still runs: settle() first")
            self._forget_view(peer)

    def _lease_state(self, peer: str, xid: int) -> str:
        lease = self._leases.get((peer, xid))
        return lease.state if lease is not None else ""

    def _load_granted(self, peer: str, r: RemoteBuffer, lease: _Lease, deadline: float) -> None:
        """Make this endpoint's view of ``peer`` hold a granted exposure's registration, and no
        registration the target dropped.  The grant says how many registrations the target has
        dropped: a view loaded before the last of them may hold a dropped one's descriptor,
        where NIXL may route a transfer; so may the descriptor's own metadata (as of its
        expose()) if it is older than that.  Then the peer is forgotten and its current
        metadata, asked for, loaded instead (``renewals``).

        The view's record (dereg, metadata loaded) says that NIXL's view holds no registration
        the target had dropped when its count was ``dereg``; a held lease needs a record at or
        above its grant's count (post() checks).  Each load decides again in the hold of _lock
        that loads and records (_reload): another thread may have changed the view since."""
        with self._lock:
            view = self._views.get(peer)
            if view is not None and view[0] >= lease.dereg and (view[0] > r.dereg or hash(r.metadata) in view[1]):
                # Fresh enough for the grant, and holding the exposure's registration: its own
                # metadata, or metadata taken after a drop that came after its expose().
                return
            # A view this endpoint did not load itself (connect() with metadata of unknown age)
            # counts as stale once the target has dropped anything.
            stale_view = view[0] < lease.dereg if view is not None else lease.dereg > 0
        if r.dereg >= lease.dereg and not stale_view:
            self._load(peer, r, deadline)  # current: only registrations added since the view
            return
        self._refresh(peer, deadline, r.incarnation, also=r)

    def _refresh(self, peer: str, deadline: float, inc: int, also: RemoteBuffer | None = None) -> None:
        """Replace NIXL's view of ``peer`` with its current metadata, asked for (a round trip):
        every registration it holds now (each exposure's), none it dropped.  ``inc``: the
        incarnation the caller's descriptors are of; the answer says which incarnation the name
        reaches now, and metadata of another is never loaded for them (the leases they hold
        were granted by one process, the view would route into another's memory).  ``also``: a
        descriptor whose own metadata then counts as loaded, if it holds nothing dropped.  A
        view recorded meanwhile from newer metadata (another thread's) stays: it is current
        too, and holds every exposure leased before it."""
        answering, dereg, md = self._current_metadata(peer, deadline)
        key = hash(md)

        def plan(view: tuple[int, dict[int, None]] | None) -> tuple[str, tuple[int, dict[int, None]] | None]:
            self._check_answering(peer, inc, answering, md)
            keys = {key: None}
            if also is not None and also.dereg >= dereg:  # its own metadata holds nothing dropped either
                keys[hash(also.metadata)] = None
            if view is not None and view[0] > dereg:
                return "none", view
            if view is not None and view[0] == dereg:  # nothing dropped between them: the union is clean
                return "add", (dereg, _bounded({**view[1], **keys}))
            self.renewals += 1
            return "renew", (dereg, keys)

        self._reload(peer, md, deadline, plan, current=True)

    def _check_answering(self, peer: str, inc: int, answering: int, md: bytes) -> None:
        """(under _lock) A metadata answer came from incarnation ``answering`` for descriptors
        of ``inc``.  Another one answering under the name: the peer restarted (or the
        application connected another process under it), and the one this endpoint talked to is
        not reached any more: its leases and NIXL's view go (no drop: the answering one never
        granted them), and the descriptors are refused.  This endpoint changed its incarnation
        since the caller looked: ask again (_AskAgain)."""
        current = self._incarnations.get(peer)
        if answering == inc:
            if current != inc:
                raise _AskAgain
            return
        if current == inc:
            self._new_incarnation(peer)  # (no transfer with it runs: the caller loads in _while_idle)
            self._retired.setdefault(peer, set()).add(inc)
            self._incarnations[peer] = answering
            self._inc_md[peer] = md
        raise StaleRemote(
            f"NIXL transfer into {peer}'s buffer: the descriptor is of an incarnation of {peer} that no longer "
            "answers under its name (it restarted, or another process was connected under it); nothing was sent. "
            "Ask it to expose the buffer again"
        )

    def _current_metadata(self, peer: str, deadline: float) -> tuple[int, int, bytes]:
        """``peer``'s metadata now, how many registrations it had dropped and the incarnation
        that answered (a round trip): (incarnation, dropped, metadata)."""
        with self._lock:
            req = next(self._seq)
            self._md_asked[req] = None
        try:
            if not self._send(peer, _pack(_MDASK, (req,))):
                raise NixlError(f"cannot ask {peer} for its metadata: it went away, or never loaded ours")
            while True:
                with self._lock:
                    got = self._md_asked.get(req)
                if got is not None and got[0] == peer:
                    return got[2], got[1], got[3]
                if time.monotonic() > deadline:
                    raise NixlError(f"no answer from {peer} to a metadata request (it must call progress())")
                self._pump()
                time.sleep(_NAP_MIN_S)
        finally:
            with self._lock:
                self._md_asked.pop(req, None)

    def _load(self, peer: str, remote: RemoteBuffer, deadline: float) -> None:
        """Load ``remote``'s metadata where this endpoint's view of ``peer`` lacks it.  When
        the target dropped a registration since the view was loaded, NIXL would keep that
        registration's descriptor beside the new ones (and may route a transfer through it:
        bytes into memory that is no longer the registration): the peer is forgotten first.
        Metadata older than the view is never loaded on top of it (it may name registrations
        dropped since); the view holds the descriptor's registration already (it was taken
        after a drop that came after the descriptor's expose())."""
        mdkey, dereg = hash(remote.metadata), remote.dereg
        with self._lock:
            view = self._views.get(peer)
            if view is not None and (mdkey in view[1] or view[0] > dereg):
                return

        def plan(view: tuple[int, dict[int, None]] | None) -> tuple[str, tuple[int, dict[int, None]] | None]:
            if self._incarnations.get(peer) != remote.incarnation:  # a restart met meanwhile
                raise _AskAgain
            if view is not None and (mdkey in view[1] or view[0] > dereg):
                return "none", view
            if view is not None and view[0] == dereg:  # nothing dropped between them: the union is clean
                return "add", (dereg, _bounded({**view[1], mdkey: None}))
            if view is not None or (peer in self._connected and dereg > 0):
                # Older than the descriptor, or no record of what NIXL holds (the application's
                # connect()) while the target has dropped registrations: NIXL's view goes first.
                self.renewals += 1
                return "renew", (dereg, {mdkey: None})
            # NIXL holds nothing of the peer, or what the application loaded while the target
            # had dropped nothing (a registration dropped later was live beside this one: the
            # two never overlap).
            return "add", (dereg, {mdkey: None})

        self._reload(peer, remote.metadata, deadline, plan)

    def _reconnect(
        self,
        peer: str,
        metadata: bytes,
        deadline: float,
        *,
        fresh: bool = False,
        check: Callable[[], None] | None = None,
    ) -> int:
        """(a held lease, NIXL's view of the peer erased) Load metadata of unknown age, for the
        connection a metadata request needs: no record (the next load replaces it).  ``fresh``:
        NIXL's view of the peer is forgotten first, whatever it holds (a broken connection).
        ``check()``: raises in the hold that loads if the load is no longer wanted.  Returns
        the serial of NIXL's view of the peer after the load."""

        def plan(view: tuple[int, dict[int, None]] | None) -> tuple[str, tuple[int, dict[int, None]] | None]:
            if check is not None:
                check()
            if fresh:
                return "renew", None
            if peer in self._connected:  # another thread connected it meanwhile
                return "none", view
            return "add", None

        return self._reload(peer, metadata, deadline, plan)

    def _reload(
        self,
        peer: str,
        metadata: bytes,
        deadline: float,
        plan: Callable[[tuple[int, dict[int, None]] | None], tuple[str, tuple[int, dict[int, None]] | None]],
        *,
        current: bool = False,
    ) -> int:
        """Load ``peer``'s metadata once no transfer with it runs, with none posted in between
        (post() waits for _lock).  ``plan(view)`` decides in the hold of _lock that loads, from
        the record of the view then (another thread may have changed it since its caller
        looked), and returns how ("none": nothing to load; "add": on top of NIXL's view;
        "renew": NIXL's view of the peer forgotten first) and the record after the load (None:
        none, so that the next post loads the peer's current metadata first).  A load and its
        record are one step: no connect() of the application comes between them.

        NIXL refuses to load metadata of an agent name it knows from another incarnation (a
        restarted peer: NIXL_ERR_NOT_ALLOWED for the UCX connection info, seen here) and, on an
        H200 over VRAM, a registration at an address it knew from an earlier registration of the
        peer.  Then the peer is forgotten (remove_remote_agent) and its metadata loaded afresh,
        once; unless it is ``current`` metadata, the view is then not recorded (it lacks what
        newer exposures registered).  What NIXL still refuses after that is raised, and tried
        again at the next transfer.  Returns the serial of NIXL's view of ``peer`` after the load
        (in its hold: _serial_of).
        """

        def load() -> int:
            how, record = plan(self._views.get(peer))
            if how == "none":
                return self._serial_of(peer)
            if how == "renew":
                self._remove_view(peer)
            try:
                self._add(metadata, peer)
            except NixlError as exc:
                if exc.status not in ("nixlNotAllowedError", "nixlInvalidParamError"):
                    raise
                first = exc
            else:
                if record is None:
                    self._views.pop(peer, None)
                else:
                    self._views[peer] = record
                return self._serial_of(peer)
            # NIXL keeps refusing what it knew of the peer (on VRAM, a registration at an address
            # an earlier one had): it forgets the peer, this endpoint's leases stay (the same
            # incarnation holds them: a restart is met in _leases_for, before any load).
            self._remove_view(peer)
            self._connected.discard(peer)
            try:
                self._add(metadata, peer)
            except NixlError as exc:
                raise NixlError(
                    f"NIXL will not load {peer}'s metadata ({first.status}), nor after forgetting the peer "
                    f"({exc.status}); on VRAM NIXL 1.5.1 then loads no more of that peer: reach it from a new "
                    "NixlEndpoint (a new agent)",
                    exc.status,
                ) from None
            if current and record is not None:  # NIXL's view is this metadata alone now
                self._views[peer] = (record[0], {hash(metadata): None})
            # else not recorded: held leases load the peer's current metadata first (regained)
            return self._serial_of(peer)

        return self._while_idle(peer, load, deadline, f"loading {peer}'s new metadata")

    def _check(self, t: Transfer) -> None:
        with self._lock:
            if t.state != "PROC" or t.lost:
                return
            with self.driver.lock:
                try:
                    state = self.agent.check_xfer_state(t._h)
                except Exception as exc:  # noqa: BLE001 - NIXL's own classes
                    state = self._failed_query(t, exc)
            self._settle(t, state)

    def _failed_query(self, t: Transfer, exc: Exception) -> str:
        """(under _lock and the agent's) What NIXL's refusal to say ``t``'s state means.
        NOT_FOUND: NIXL erased its view of the peer and cannot say (getXferStatus asks the
        backend no more; the handle stays IN_PROG): LOST.  Else over, failed: ERR."""
        if type(exc).__name__ == "nixlRemoteDisconnectError":
            self._view_erased(t._leases[0].peer)
        return "LOST" if type(exc).__name__ == "nixlNotFoundError" else "ERR"

    def _settle(self, t: Transfer, state: str) -> None:
        """(under _lock) Act on NIXL's answer on a running ``t``."""
        if state == "LOST":
            self._lose(t)
        elif state != "PROC":
            self._complete(t, "DONE" if state == "DONE" else "ERR")

    def _spin(self, t: Transfer, until: float) -> None:
        """``_check`` in a tight loop until NIXL ends ``t`` or ``until`` (monotonic) passes.
        Each poll is a progress call of NIXL's UCX backend (getXferStatus progresses the
        worker), and a transfer needs several: the fewer steps between two, the sooner it
        ends (raw NIXL polls as tight).  The locks, and what an answer does, are _check's."""
        drv = self.driver
        agent = drv._agent
        if agent is None:
            return  # retired: _check says so
        direct = drv.direct()
        query = agent.check_xfer_state
        lock, dlock = self._lock, drv.lock
        while True:
            with lock:
                h = t._h
                if t.state != "PROC" or t.lost or h is None:
                    return  # over
                with dlock:
                    if drv._agent is not agent:
                        return  # retired meanwhile: for _check to say
                    try:
                        state = direct.state(h) if direct is not None else query(h)
                    except Exception as exc:  # noqa: BLE001 - NIXL's own classes
                        state = self._failed_query(t, exc)
                if state != "PROC":
                    self._settle(t, state)
                    return
            if time.monotonic() > until:
                return

    def _lose(self, t: Transfer, *, erased: bool = True) -> None:
        """(under _lock) NIXL cannot tell ``t``'s state: it stays running (buffers registered,
        leases counting it) until the peer is forgotten.  In NIXL 1.5.1 a handle keeps a weak
        reference to the view it was made with (getXferStatus: NOT_FOUND once it expired), and
        a view loaded again is another one: polling it would never say more.  Our view of the
        peer is gone too: the next transfer with it loads the peer afresh."""
        todo = t._leases[:]  # (a slice: no check point, unlike a call)
        try:
            t.lost = True
            self._lost.add(t)
            _count_lost(todo, 1)
        finally:  # what an interrupt left of it
            _count_lost(todo, 1)
        if erased:
            self._view_erased(t._leases[0].peer)
        else:  # a post NIXL failed part-way erased nothing: its view stays, untrusted (as connect())
            self._views.pop(t._leases[0].peer, None)
            self._view_changed(t._leases[0].peer)
        self.lost_transfers += 1

    def _view_erased(self, peer: str) -> None:
        """(under _lock) NIXL erased its view of ``peer`` (a disconnect seen by a transfer:
        invalidateRemoteData in nixl_agent.cpp; or NOT_FOUND): the next transfer with it loads
        the peer's current metadata first."""
        self._views.pop(peer, None)
        self._connected.discard(peer)
        self._view_changed(peer)

    def _view_changed(self, peer: str | None) -> None:
        """(under _lock) NIXL's view of ``peer`` changed, or of a peer not known by name (None:
        counted for every peer)."""
        if peer is None:
            self._view_serial += 1
        else:
            self._peer_serials[peer] = self._peer_serials.get(peer, 0) + 1

    def _serial_of(self, peer: str) -> int:
        """(under _lock) How often NIXL's view of ``peer`` changed: equal at two moments, it
        did not change in between."""
        return self._view_serial + self._peer_serials.get(peer, 0)

    def _complete(self, t: Transfer, state: str) -> None:
        """NIXL says ``t`` is over: it leaves the books, its leases stop counting it, then its
        handle and local registrations go (a lease revoked meanwhile is dropped once idle)."""
        # The books first, in this frame and with no call until the counts: Python raises an
        # interrupt at a call's entry and return, and at a loop's back edge, so every step
        # before them is whole, and the counts are finished in a finally whatever comes.
        # The Transfer may outlive its endpoint (the application keeps it): it must not keep
        # NIXL's handle, which keeps the agent, to be destroyed wherever the Transfer goes.
        t.state = state
        h, t._h = t._h, None
        toks, t._toks = t._toks, []
        todo = t._leases[:]
        found = t._leases[:] if t.lost else []
        t.lost = False
        self._running -= {t}  # over before its leases' drops go (a target may act on them at once)
        self._lost -= {t}
        if t in self._inflight:
            del self._inflight[t]
        try:
            try:
                _count(todo, -1)
                _count_lost(found, -1)  # (lost and found: forget_peer)
            finally:  # what an interrupt left of them (one at a call's entry included)
                _count(todo, -1)
                _count_lost(found, -1)
        finally:  # then its messages, its handle and its references, whatever came before
            release = self.cache.release_token
            try:
                try:
                    if state != "DONE":
                        self.driver.peer_failed()
                finally:
                    self._account(t, state)
            finally:
                try:
                    self._let_go(h, toks)
                finally:  # what an interrupt left of them
                    _release_tokens(release, toks)

    def _let_go(self, h: Any, toks: list[int]) -> None:
        """NIXL's handle ``h`` of a transfer that is over (None: none) released, then each of
        its cache references ``toks`` (emptied as it goes: the caller finishes what an
        interrupt left of it)."""
        try:
            if h is not None:
                self.driver.release_xfer(h)
        finally:
            _release_tokens(self.cache.release_token, toks)

    def _account(self, t: Transfer, state: str) -> None:
        """(_complete) The messages of ``t``'s end, once it left the books (no message sent
        before, so an interrupt as a send returns cannot leave it counted): the target's check
        asked for, then each revoked lease now idle dropped, every one of them whatever an
        earlier drop raised (after the check: the target counts the checks before it lets a
        revoked exposure go).  A drop an interrupt stopped goes at the next progress()."""
        try:
            if t.confirm:
                self._ask_check(t, state)
        finally:
            first: BaseException | None = None
            for lease in t._leases:
                if lease.state == "revoked":
                    try:
                        self._drop_if_idle(lease)
                    except BaseException as exc:  # the others' drops still go; raised after them
                        first = first or exc
            if first is not None:
                raise first

    def _ask_check(self, t: Transfer, state: str) -> None:
        """(_account) The target's check of the exposures a DONE ``t`` went to, asked for (a
        round trip).  Sent after DONE, on the channel the DROP takes later: the target counts
        these before it lets a revoked exposure go.  Not sent for every transfer: any
        notification makes NIXL's next transfer on that peer wait for the peer's progress
        (~0.5 ms here).  Counted once sent (an interrupt as the send returns undercounts, which
        the target's count of what arrived tolerates: the check arrives before the drop).  That
        order holds on one UCX worker (gpupin's own agents; NIXL binds a worker per thread on
        an agent made with several): there a drop sent later from another thread may overtake
        the check, and the target answers it GONE (a false stale_answers count, never an
        exposure let go while a transfer into it runs: a drop goes only once none does)."""
        peer = t._leases[0].peer
        if state == "DONE" and self._send(
            peer, _pack(_XFER, (t.seq, len(t._leases)), [(x.xid, x.epoch) for x in t._leases])
        ):
            for lease in t._leases:
                lease.checks += 1
        else:
            self._waiting.pop((peer, t.seq), None)  # no answer will come: wait(confirm) times out

    def _drop_if_idle(self, lease: _Lease) -> None:
        """(under _lock) A revoked ``lease`` no transfer counts any more is dropped: off this
        endpoint's books, then its DROP sent, then marked "dropped".  An interrupt before the
        mark leaves it "revoked" in _revoked, and the next progress() sends its drop (again: a
        second drop of one grant finds no holder at the target and changes nothing)."""
        if lease.state == "revoked" and lease.inflight == 0:
            key = (lease.peer, lease.xid)
            if self._leases.get(key) is lease:
                del self._leases[key]
            self._send_drop(lease.peer, _pack(_DROP, (lease.xid, lease.checks, 0, lease.grant)))
            lease.state = "dropped"

    def _drop_revoked(self) -> None:
        """(under _lock) Drop the revoked leases now idle whose drop an interrupt stopped (an
        ending's loop stops at any pass); forget the others once dropped."""
        for key, lease in list(self._revoked.items()):
            if lease.state == "revoked" and lease.inflight == 0:
                self._drop_if_idle(lease)
            if lease.state != "revoked":
                del self._revoked[key]

    def _send_drop(self, peer: str, msg: bytes, tries: int = 0) -> None:
        """A lease drop: the target waits for it, so one that could not be sent is sent again,
        at growing intervals, ``_DROP_TRIES`` times in all (until ``forget_peer``)."""
        if self._send(peer, msg):
            return
        tries += 1
        if tries < _DROP_TRIES:
            self._drops.append((peer, msg, time.monotonic() + min(_NAP_MAX_S * 2**tries, 1.0), tries))
        else:
            self._note(
                f"endpoint {self.name!r} gave up sending a lease drop to {peer} after {tries} tries: "
                f"an unexpose() there waits for this endpoint until it times out; call forget_peer({self.name!r}) "
                "there"
            )

    def _retry_drops(self) -> None:
        """(under _lock) Send again the lease drops whose time has come."""
        now = time.monotonic()
        due = [d for d in self._drops if d[2] <= now]
        if due:
            self._drops = [d for d in self._drops if d[2] > now]
            for peer, msg, _, tries in due:
                self._send_drop(peer, msg, tries)

    def _orphan(self, t: Transfer) -> None:
        with self._lock:
            if t.state == "PROC" and t not in self._inflight:
                self._inflight[t] = None
                self._running.add(t)
            self._waiting.pop((t._leases[0].peer, t.seq), None)

    def _await_verdict(self, t: Transfer, deadline: float) -> None:
        start = time.perf_counter()
        while True:
            got = t.verdict  # set by the thread that takes the target's answer
            if got is not None:
                break
            if time.monotonic() > deadline:
                raise NixlError(f"{t.what}: {_NO_ANSWER}")
            self._pump()
            time.sleep(_NAP_MIN_S)
        self.confirm_s += time.perf_counter() - start
        self._judge(t)

    def _judge(self, t: Transfer) -> None:
        """StaleRemote if the target's answer on ``t`` (come) says its exposure changed."""
        if t.verdict is None:
            raise NixlError(f"{t.what}: {_NO_ANSWER}")
        status, xid = t.verdict
        if status != OK:
            raise StaleRemote(
                f"{t.what}: the target found exposure {xid} changed when the data arrived "
                f"({_VERDICT.get(status, status)}): the bytes may be in memory that is no longer the buffer "
                "(detected after the fact: the target changed it without unexpose()); ask it to expose the "
                "buffer again"
            )

    def pending_transfers(self) -> int:
        """Transfers that outlived their wait() (a timeout) and NIXL has not ended yet: their
        local buffers stay registered (and leased) and must not be freed."""
        self._poll_inflight()
        return len(self._inflight)

    def settle(self, timeout: float = 30.0) -> int:
        """Wait up to ``timeout`` s for the transfers that outlived their call to end; each that
        ended lets go of its handle, its local registrations and its leases.  How many still run."""
        deadline = time.monotonic() + timeout
        while self.pending_transfers() and time.monotonic() < deadline:
            time.sleep(0.001)
        return len(self._inflight)

    def _poll_inflight(self) -> None:
        """Poll every transfer NIXL has not ended (also those posted and never waited for)."""
        for t in list(self._running):
            self._check(t)

    def close(self, timeout: float = 5.0) -> None:
        """Take every exposed range back (``unexpose``, ``timeout`` s each), tell each target
        that this endpoint's leases are dropped and wait up to ``timeout`` s for each to say it
        heard (a warning names those that did not), deregister everything (InUse while a
        transfer holds a registration) and retire the agent if the endpoint made it.  A transfer
        that outlived its call is waited for up to ``timeout`` s (``settle``), then close()
        raises InUse naming it.  An endpoint dropped without close() makes no NIXL call from
        the garbage collector: see reap()."""
        progressed = self._progress_stop is not None and not self._progress_stop.is_set()
        try:
            self._stop_progress()  # (its join may be interrupted too)
            self._close(timeout)
        except BaseException:  # refused (InUse) or interrupted: the endpoint is still open
            if progressed and not collecting() and self.driver._agent is not None:
                self._start_progress()  # peers are still answered
            raise
        if self._notes and not collecting():  # once closed whole (warnings may be errors)
            self._flush_notes()

    def _close(self, timeout: float) -> None:
        if self._running and collecting():
            # The transfers NIXL has not ended are garbage with this endpoint (it polls them,
            # they name it); their handles are not (_LIVE_XFERS).  reap() releases them first
            # of all: before the registrations they use are deregistered and the agent
            # retires, whatever the collector finalized first.  Those NIXL refuses stay with
            # the driver, whose retirement keeps them to the exit.
            for t in self._running:
                h, t._h = t._h, None
                self.driver._stuck.append(h)
            self._running.clear()
            self._inflight.clear()
            _defer(self.driver._retry_stuck, first=True)
        if self._running and not collecting():
            # Every transfer NIXL has not ended: past its wait's timeout, or posted and never
            # waited for.  Its leases and registrations stay until it ends.
            deadline = time.monotonic() + timeout
            while self._running and time.monotonic() < deadline:
                self._poll_inflight()
                time.sleep(0.001)
            if self._running:
                t = next(iter(self._running))
                lost = f", {len(self._lost)} of them lost ({_LOST})" if self._lost else ""
                raise InUse(
                    f"NixlEndpoint {self.name!r}: {len(self._running)} transfer(s) NIXL has not ended ({t.what}); "
                    f"their buffers stay registered and their leases held: settle() (or wait() them) and close() "
                    f"again{lost}"
                )
        if not collecting():
            for ex in list(self._exposures.values()):
                self.unexpose(self._bare(ex), timeout=timeout)
        holds = []
        leased = 0
        for ex in list(self._exposures.values()):  # from the collector: no peer can be asked
            if not ex.settled() and ex.hold is not None:
                # A peer holds a lease, and nothing stops its writes: not the agent's end (an
                # agent passed in lives on; a same-host peer writes through the kernel, cma),
                # not a revocation (none can be sent from here).  The memory stays held.
                _KEPT_HOLDS.append((self.memory, ex.hold))
                leased += 1
            else:
                # No lease on it: the free hold is let go by reap(), after the agent's retirement.
                holds.append(ex.hold)
            ex.revoked, ex.holders, ex.hold, ex.done = True, {}, None, True
            del self._exposures[ex.xid]
            try:
                ex.reg.release()
            except GpupinError:  # the cache went first (collected with it): its registrations too
                pass
        if self._letgo:  # taken back, and an interrupt stopped their releases: finished here
            if collecting():  # (no lock from a finalizer: the holds go with the others, later)
                letgo, self._letgo = self._letgo, []
                for ex in letgo:
                    holds.append(ex.hold)
                    try:
                        ex.reg.release()
                    except GpupinError:
                        pass
            else:
                with self._lock:
                    self._let_go_of_exposures()
        self._by_range.clear()
        if self._preps:  # NIXL's prepped lists go before the agent (from the collector: first in reap)
            preps, self._preps = list(self._preps), set()
            driver = self.driver

            def unprepare() -> None:
                with driver.lock:
                    for prep in preps:
                        prep.closed = True
                        prep.drop(local=True, remote=True)

            if collecting():
                _defer(unprepare, first=True)
            else:
                unprepare()
        if not collecting():
            self._drop_leases(timeout)
        try:
            agent = self.driver.agent
        except NixlError:  # retired already
            agent = None
        if agent is not None and collecting():  # no lock from a finalizer: let go of the claim later
            _defer(lambda: _unclaim_agent(agent))
        elif agent is not None:
            _unclaim_agent(agent)
        if leased:
            name = self.name
            _defer(
                lambda: warnings.warn(
                    f"gpupin.nixl: endpoint {name!r} was dropped without close() while peers held leases on "
                    f"{leased} exposed range(s): their memory stays held (its free is refused) until the "
                    "process exits, since a peer may still write there; close() endpoints",
                    RuntimeWarning,
                    stacklevel=2,
                )
            )
        release = getattr(self.memory, "release_free_hold", None)
        kept = [h for h in holds if h is not None]
        try:
            self.driver.close()  # InUse while the application holds a registration of the cache
        finally:
            # Exposures no peer leased: no transfer may go there, whether or not the agent
            # retires now (queued after its retirement when it does).
            if release is not None and kept:

                def let_go() -> None:
                    for h in kept:
                        release(h)

                _defer(let_go)

    def _drop_leases(self, timeout: float) -> None:
        """(initiator, closing) Tell each target that this endpoint holds its leases no more, and
        wait up to ``timeout`` s for each target to say it has the drop.  A notification NIXL
        accepted may still wait inside UCX (for the peer's side of a new connection, say), and
        dies with the agent: a target that never gets the drop would wait for this endpoint in
        its unexpose() until that times out."""
        failed = 0
        with self._lock:
            # A lease asked for may be granted still (a HOLD the target answers after close):
            # dropped too, after it on the same connection.  One a transfer still uses stays
            # (close() refuses before this while one runs).
            leases = [
                lease
                for lease in self._leases.values()
                if lease.state in ("asking", "granted", "held", "revoked") and lease.inflight == 0
            ]
            # (and revoked ones whose drop an interrupt stopped: off _leases already)
            stopped = [x for x in self._revoked.values() if x.state == "revoked" and x.inflight == 0]
            leases += [x for x in stopped if not any(x is y for y in leases)]
            self._revoked.clear()
            for lease in leases:
                self._leases.pop((lease.peer, lease.xid), None)
                lease.state = "dropped"
                if self._send(lease.peer, _pack(_DROP, (lease.xid, lease.checks, 1, lease.grant))):
                    self._unacked.add((lease.peer, lease.xid))
                else:
                    failed += 1
        deadline = time.monotonic() + timeout
        while self._unacked and time.monotonic() < deadline:
            try:
                self._pump(flush=False)  # close() raises them once done
            except NixlError:  # the agent cannot progress: no answer can come
                break
            time.sleep(_NAP_MIN_S)
        if failed:
            self._note(
                f"endpoint {self.name!r} closed and could not send {failed} lease drop(s): "
                "the targets' unexpose() waits for this endpoint until it times out (forget_peer there)"
            )
        if self._unacked:
            peers = sorted({p for p, _ in self._unacked})
            self._note(
                f"endpoint {self.name!r} closed without word from {', '.join(peers)} that it has "
                f"{len(self._unacked)} lease drop(s) (no progress() there within {timeout} s?): an unexpose() "
                f"there waits for this endpoint until it times out; call forget_peer({self.name!r}) there"
            )
            self._unacked.clear()
        if leases:
            self.driver.linger(_LINGER_S)

    def _bare(self, ex: _Exposure) -> RemoteBuffer:
        return RemoteBuffer(self.name, ex.ptr, ex.size, 0, "", ex.buffer_id, ex.xid, ex.epoch, 0, 0, 0, b"")


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
        ini.write(src, size, remote, timeout=timeout, confirm=True)
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
        try:
            for ep in endpoints[1:]:  # the initiator, while the target serves: it hears the lease drop
                ep.close()
        finally:
            stop.set()
            if pump is not None:
                pump.join()
            if endpoints:
                endpoints[0].close()
            mi.close()
            mt.close()
