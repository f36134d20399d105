"""The generic-netlink family "gpupin", read with pyroute2.

``info()``, ``stats()``, ``list_pins()``, ``get_pin()`` and ``events()``.  Listing
another process's pins and receiving events need CAP_NET_ADMIN (or
CAP_SYS_ADMIN for listing); without them a process sees only its own pins.
"""

from __future__ import annotations

import errno
import os
import select
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from pyroute2.netlink import NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, genlmsg, nla
from pyroute2.netlink.exceptions import NetlinkError
from pyroute2.netlink.generic import GenericNetlinkSocket

from ._closable import Closable
from ._native import lib
from .errors import DriverNotLoaded, EventsLost, GpupinError, InvalidArgument, PermissionDenied, UnknownHandle

FAMILY = "gpupin"


def _enum(prefix: str) -> dict[int, str]:
    """The header's enumerators whose names start with PREFIX (PREFIX + MAX aside), by value:
    {value: the rest of the name}.

    Names and numbers come from include/uapi/gpupin_netlink.h (generated from the YNL spec)
    through the cffi extension, which the C compiler checks; none is written here.
    """
    names = [n for n in dir(lib) if n.startswith(prefix) and n != prefix + "MAX"]
    return dict(sorted((getattr(lib, n), n.removeprefix(prefix)) for n in names))


_COMMANDS = _enum("GPUPIN_NL_CMD_")
EVENT_NAMES = {
    cmd: _COMMANDS[cmd].lower()
    for cmd in (
        lib.GPUPIN_NL_CMD_PINNED,
        lib.GPUPIN_NL_CMD_UNPINNED,
        lib.GPUPIN_NL_CMD_INVALIDATED,
        lib.GPUPIN_NL_CMD_BUDGET_EXHAUSTED,
    )
}
REASON_NAMES = {value: name.lower() for value, name in _enum("GPUPIN_NL_REASON_").items()}
# detached: released elsewhere, holding its pages until the GPU frees them
STATE_NAMES = {value: name.lower() for value, name in _enum("GPUPIN_NL_STATE_").items()}


def _nla_map(prefix: str, types: dict[int, str]) -> tuple[tuple[int, str, str], ...]:
    """An nla_map of the header's PREFIX* attributes: (number, C name, pyroute2 type).  TYPES,
    by attribute number, is what the header cannot say (tests/host/test_ynl_spec.py checks it
    against the spec); the rest (UNSPEC, PAD) decode as none."""
    return tuple((value, prefix + name, types.get(value, "none")) for value, name in _enum(prefix).items())


class gpupinmsg(genlmsg):  # type: ignore[misc]  # noqa: N801 - pyroute2 naming
    """Messages of the family: top-level GPUPIN_NL_A_* attributes."""

    class pin(nla):  # type: ignore[misc]  # noqa: N801
        nla_map = _nla_map(
            "GPUPIN_NL_PIN_A_",
            {
                lib.GPUPIN_NL_PIN_A_PID: "uint32",
                lib.GPUPIN_NL_PIN_A_FILE_ID: "uint64",
                lib.GPUPIN_NL_PIN_A_HANDLE: "uint64",
                lib.GPUPIN_NL_PIN_A_VA: "uint64",
                lib.GPUPIN_NL_PIN_A_SIZE: "uint64",
                lib.GPUPIN_NL_PIN_A_ALIGNED_VA: "uint64",
                lib.GPUPIN_NL_PIN_A_ALIGNED_SIZE: "uint64",
                lib.GPUPIN_NL_PIN_A_ENTRIES: "uint32",
                lib.GPUPIN_NL_PIN_A_PAGE_SIZE: "uint32",
                lib.GPUPIN_NL_PIN_A_STATE: "uint32",
                lib.GPUPIN_NL_PIN_A_PERSISTENT: "flag",
                lib.GPUPIN_NL_PIN_A_CREATED_NS: "uint64",
                lib.GPUPIN_NL_PIN_A_USER_TAG: "uint64",
                lib.GPUPIN_NL_PIN_A_DMA_PEER: "asciiz",
                lib.GPUPIN_NL_PIN_A_REASON: "uint32",
                lib.GPUPIN_NL_PIN_A_GPU_UUID: "cdata",
            },
        )

    class stats(nla):  # type: ignore[misc]  # noqa: N801
        # Every counter is a u64 (the spec says so of the set).
        nla_map = _nla_map(
            "GPUPIN_NL_STAT_A_",
            {
                v: "uint64"
                for v in _enum("GPUPIN_NL_STAT_A_")
                if v not in (lib.GPUPIN_NL_STAT_A_UNSPEC, lib.GPUPIN_NL_STAT_A_PAD)
            },
        )

    nla_map = _nla_map(
        "GPUPIN_NL_A_",
        {
            lib.GPUPIN_NL_A_PID: "uint32",
            lib.GPUPIN_NL_A_HANDLE: "uint64",
            lib.GPUPIN_NL_A_PIN: "pin",
            lib.GPUPIN_NL_A_ABI_VERSION: "uint32",
            lib.GPUPIN_NL_A_VERSION: "asciiz",
            lib.GPUPIN_NL_A_PROVIDER: "asciiz",
            lib.GPUPIN_NL_A_CAPS: "uint32",
            lib.GPUPIN_NL_A_MAX_PINNED_BYTES: "uint64",
            lib.GPUPIN_NL_A_PINNED_BYTES: "uint64",
            lib.GPUPIN_NL_A_MAX_PINS_PER_FILE: "uint32",
            lib.GPUPIN_NL_A_STATS: "stats",
            lib.GPUPIN_NL_A_SIZE: "uint64",
        },
    )


@dataclass(frozen=True)
class NlPin:
    pid: int
    file_id: int
    handle: int
    va: int
    size: int
    aligned_va: int
    aligned_size: int
    entries: int
    page_size: int
    state: str
    persistent: bool
    created_ns: int
    user_tag: int
    dma_peers: list[str] = field(default_factory=list)
    reason: str | None = None
    # The GPU as nvidia-smi names it (GPU-xxxxxxxx-...); "" where the provider names none
    # (dma-buf pins) or the module predates the attribute.
    gpu_uuid: str = ""


def gpu_uuid_text(raw: bytes | None) -> str:
    """A GPU's 16-byte UUID as nvidia-smi prints it; "" for none (absent or all zeros)."""
    if not raw or not any(raw):
        return ""
    h = bytes(raw).hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _pin_of(msg: Any) -> NlPin:
    p = msg.get_attr("GPUPIN_NL_A_PIN")
    if p is None:
        raise GpupinError("netlink: message without a pin")

    def g(name: str, default: Any = 0) -> Any:
        v = p.get_attr("GPUPIN_NL_PIN_A_" + name)
        return default if v is None else v

    peers = [v for k, v in p["attrs"] if k == "GPUPIN_NL_PIN_A_DMA_PEER"]
    reason = p.get_attr("GPUPIN_NL_PIN_A_REASON")
    return NlPin(
        pid=g("PID"),
        file_id=g("FILE_ID"),
        handle=g("HANDLE"),
        va=g("VA"),
        size=g("SIZE"),
        aligned_va=g("ALIGNED_VA"),
        aligned_size=g("ALIGNED_SIZE"),
        entries=g("ENTRIES"),
        page_size=g("PAGE_SIZE"),
        state=STATE_NAMES.get(g("STATE"), str(g("STATE"))),
        persistent=any(k == "GPUPIN_NL_PIN_A_PERSISTENT" for k, _ in p["attrs"]),
        created_ns=g("CREATED_NS"),
        user_tag=g("USER_TAG"),
        dma_peers=peers,
        reason=None if reason is None else REASON_NAMES.get(reason, str(reason)),
        gpu_uuid=gpu_uuid_text(p.get_attr("GPUPIN_NL_PIN_A_GPU_UUID")),
    )


def _error(exc: NetlinkError, what: str) -> GpupinError:
    msg = getattr(exc, "args", (None, None))
    detail = msg[1] if len(msg) > 1 and msg[1] else ""
    text = f"netlink {what} failed: {errno.errorcode.get(exc.code, exc.code)}"
    if detail:
        text += f": {detail}"
    cls: type[GpupinError] = {
        errno.EINVAL: InvalidArgument,
        errno.ENOENT: UnknownHandle,
        errno.EPERM: PermissionDenied,
        errno.EACCES: PermissionDenied,
    }.get(exc.code, GpupinError)
    return cls(text, exc.code)


class Netlink(Closable):
    """A socket bound to the family.  Close it, or use it as a context manager."""

    def __init__(self, msg_class: type = gpupinmsg) -> None:
        self.sock = GenericNetlinkSocket(ext_ack=True)
        try:
            self.sock.bind(FAMILY, msg_class)
        except NetlinkError as exc:
            self.sock.close()
            if exc.code == errno.ENOENT:
                raise DriverNotLoaded(
                    "gpupin module not loaded (no generic netlink family 'gpupin'): "
                    "run 'gpupin load' (add --sim without a GPU)"
                ) from None
            raise _error(exc, "bind") from None
        self.msg_class = msg_class
        self._subscribed = False

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Netlink:
        return self

    def request(self, cmd: int, attrs: list[tuple[str, Any]] | None = None, dump: bool = False) -> list[Any]:
        msg = self.msg_class()
        msg["cmd"] = cmd
        msg["version"] = lib.GPUPIN_NL_VERSION
        msg["attrs"] = list(attrs or [])
        flags = NLM_F_REQUEST | (NLM_F_DUMP if dump else NLM_F_ACK)
        try:
            return [
                m for m in self.sock.nlm_request(msg, msg_type=self.sock.prid, msg_flags=flags) if m.get("cmd") == cmd
            ]
        except NetlinkError as exc:
            raise _error(exc, f"command {cmd}") from None

    def info(self) -> dict[str, Any]:
        (m,) = self.request(lib.GPUPIN_NL_CMD_GET_INFO)
        return {k.removeprefix("GPUPIN_NL_A_").lower(): v for k, v in m["attrs"]}

    def stats(self) -> dict[str, int]:
        (m,) = self.request(lib.GPUPIN_NL_CMD_GET_STATS)
        s = m.get_attr("GPUPIN_NL_A_STATS")
        return {k.removeprefix("GPUPIN_NL_STAT_A_").lower(): v for k, v in s["attrs"] if not k.endswith("_PAD")}

    def list_pins(self) -> list[NlPin]:
        return [_pin_of(m) for m in self.request(lib.GPUPIN_NL_CMD_GET_PINS, dump=True)]

    def get_pin(self, pid: int, handle: int) -> NlPin:
        (m,) = self.request(lib.GPUPIN_NL_CMD_GET_PIN, [("GPUPIN_NL_A_PID", pid), ("GPUPIN_NL_A_HANDLE", handle)])
        return _pin_of(m)

    def subscribe(self) -> None:
        """Receive events on this socket: join the "events" group, or SUBSCRIBE where the
        module registers no group (kernels that cannot restrict one to CAP_NET_ADMIN)."""
        if self._subscribed:
            return
        if "events" not in self.sock.mcast_groups:
            try:
                self.request(lib.GPUPIN_NL_CMD_SUBSCRIBE)
            except PermissionDenied:
                raise PermissionDenied(
                    "subscribing to gpupin events needs CAP_NET_ADMIN (events name other processes' addresses)",
                    errno.EPERM,
                ) from None
            self._subscribed = True
            return
        try:
            self.sock.add_membership("events")
        except PermissionError:
            raise PermissionDenied(
                "joining the gpupin 'events' group needs CAP_NET_ADMIN (events name other processes' addresses)",
                errno.EPERM,
            ) from None
        except OSError as exc:
            if exc.errno in (errno.EPERM, errno.EACCES):
                raise PermissionDenied("joining the gpupin 'events' group needs CAP_NET_ADMIN", exc.errno) from None
            raise
        self._subscribed = True

    def events(self, timeout: float | None = None, count: int | None = None) -> Iterator[dict[str, Any]]:
        """Yield events as dicts until ``count`` arrived or ``timeout`` seconds passed.

        Subscribe first (``subscribe()``) to see events of what you do before iterating;
        requests on this socket while subscribed may swallow events (use another socket).
        """
        self.subscribe()
        deadline = None if timeout is None else time.monotonic() + timeout
        seen = 0
        while count is None or seen < count:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            fd = self.sock.fileno()
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                return
            # One datagram per read, parsed here: pyroute2's get() would buffer
            # later events where select() cannot see them.
            try:
                data = os.read(fd, 1 << 16)
            except OSError as exc:
                if exc.errno != errno.ENOBUFS:
                    raise
                raise EventsLost(
                    "netlink events: some were lost (ENOBUFS: this socket's receive buffer "
                    "overflowed, or the kernel could not allocate an event); read on until "
                    "none is pending (those came before the loss), then read the state "
                    "again (list_pins(), the validity map)",
                    exc.errno,
                ) from None
            for m in self.sock.marshal.parse(data):
                name = EVENT_NAMES.get(m.get("cmd"))
                if name is None:
                    continue
                ev: dict[str, Any] = {"event": name}
                if name == "budget_exhausted":
                    ev.update(
                        pid=m.get_attr("GPUPIN_NL_A_PID"),
                        size=m.get_attr("GPUPIN_NL_A_SIZE"),
                        pinned_bytes=m.get_attr("GPUPIN_NL_A_PINNED_BYTES"),
                        max_pinned_bytes=m.get_attr("GPUPIN_NL_A_MAX_PINNED_BYTES"),
                    )
                else:
                    pin = _pin_of(m)
                    ev.update(pin.__dict__)
                seen += 1
                yield ev
                if count is not None and seen >= count:
                    return


def info() -> dict[str, Any]:
    with Netlink() as nl:
        return nl.info()


def stats() -> dict[str, int]:
    with Netlink() as nl:
        return nl.stats()


def list_pins() -> list[NlPin]:
    with Netlink() as nl:
        return nl.list_pins()


def events(timeout: float | None = None, count: int | None = None) -> Iterator[dict[str, Any]]:
    with Netlink() as nl:
        yield from nl.events(timeout, count)
