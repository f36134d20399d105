"""``SimMemory``: simulated GPU memory from ``/dev/nvp2p_sim`` (the nvp2p_sim module)."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

from ._closable import open_node
from ._native import ffi, lib
from .errors import DriverNotLoaded, InvalidArgument, NotGpuMemory, from_errno
from .memory import AllocationRange, ProviderBase

SIM_PATH = "/dev/nvp2p_sim"

# BAR1 that pins may never take, on NVIDIA's driver and the simulator: a pin fits only while
# bar_size less the bytes pinned is at least this much more than its length.
BAR1_RESERVE = 36 << 20


# The counters of strict misuse: each a report of what would crash or hang NVIDIA's driver.
MISUSE = (
    "use_after_free_calls",
    "puts_not_found",
    "lock_timeouts",
    "callback_overruns",
    "dma_map_races",
    "dmabuf_nonpci_attaches",
    "stale_table_puts",
    "unmap_peer_mismatches",
    "put_kind_mismatches",
)


@dataclass(frozen=True)
class SimStats:
    """The simulator's counters: all zero when nothing is pinned or allocated."""

    pinned_pages: int
    bar_bytes: int
    live_callbacks: int
    page_tables: int
    dma_mappings: int
    allocations: int
    alloc_bytes: int
    get_pages_calls: int
    callbacks_run: int
    tables_not_freed: int
    mappings_not_freed: int
    quarantine_bytes: int
    poison_errors: int
    dmabuf_exports: int
    dmabuf_mappings: int
    use_after_free_calls: int
    puts_not_found: int
    lock_timeouts: int
    callback_overruns: int
    dma_map_races: int
    dmabuf_attachments: int
    dmabuf_pins: int
    dmabuf_nonpci_attaches: int
    stale_table_puts: int
    unmap_peer_mismatches: int
    put_kind_mismatches: int

    def leaks(self) -> dict[str, int]:
        """Counters that must be 0 once everything is released, and are not.

        Besides leaks, these are the strict simulator's reports of what would
        crash or hang NVIDIA's real driver (``MISUSE``): calls with freed tables or
        mappings, dma_map_pages on a table freed while it waited for the API lock
        (``dma_map_races``: heap corruption inside NVIDIA's driver), put_pages from a
        process that did not pin (released nothing), a stale put_pages that released
        a newer pin (``stale_table_puts``), a dma-buf attach by a non-PCI device
        (``dmabuf_nonpci_attaches``), a dma_unmap_pages for another peer than the
        mapping's (``unmap_peer_mismatches``: NVIDIA WARNs), a put of the other kind than
        the table's get (``put_kind_mismatches``: an oops or a leak), API-lock waits given up
        (deadlock) and callbacks that overran.
        """
        keys = (
            "pinned_pages",
            "bar_bytes",
            "live_callbacks",
            "page_tables",
            "dma_mappings",
            "tables_not_freed",
            "mappings_not_freed",
            "poison_errors",
            "dmabuf_exports",
            "dmabuf_mappings",
            "dmabuf_attachments",
            "dmabuf_pins",
            *MISUSE,
        )
        return {k: getattr(self, k) for k in keys if getattr(self, k)}


class SimMemory(ProviderBase):
    """A simulated CUDA context: allocate, read, write, query and free device memory.

    Each instance is one open of /dev/nvp2p_sim; closing it frees its memory and
    runs the free callbacks of every pin on it, as a CUDA context teardown does.

    Its buffer-id query is in C (``gp_sim_query``: one ioctl on this fd), offered to the
    registration cache's hit path as CudaMemory offers libcuda's: a validated hit runs no
    Python, only that ioctl.
    """

    name = "nvp2p_sim"
    direct_buffer_id_query = True

    def __init__(self, path: str = SIM_PATH) -> None:
        self._fd = open_node(path, "load the simulator with 'gpupin load --sim'")
        self.sync_memops_calls = 0
        # The query's context: the fd, -1 once closed (the C query then answers -EBADF).
        self.c_buffer_id_ctx: Any = ffi.new("int *", self._fd)
        self.c_buffer_id_query: Any = ffi.addressof(lib, "gp_sim_query")

    def close(self) -> None:
        if self._fd >= 0:
            self.c_buffer_id_ctx[0] = -1  # before the close: no query uses a reused fd number
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> SimMemory:
        return self

    def _call(self, cmd: int, arg: Any, name: str, desc: str) -> None:
        if self._fd < 0:
            raise InvalidArgument(f"{name}: the simulator context is closed")
        ret = lib.gpupin_call(self._fd, cmd, arg)
        if ret < 0:
            raise from_errno(-ret, name, desc)

    def alloc(self, size: int) -> int:
        """Allocate ``size`` bytes (rounded up to 64 KiB); returns the device address."""
        if size <= 0:
            raise InvalidArgument(f"sim alloc(size={size}): size must be > 0")
        c = ffi.new("struct nvp2p_sim_alloc *")
        c.size = size
        self._call(lib.NVP2P_SIM_IOC_ALLOC, c, "sim alloc", f"size={size}")
        return int(c.va)

    def free(self, ptr: int) -> None:
        """Free the allocation starting at ``ptr``; runs the free callbacks of its pins."""
        self.refuse_held_free(ptr)
        c = ffi.new("struct nvp2p_sim_free *")
        c.va = ptr
        try:
            self._call(lib.NVP2P_SIM_IOC_FREE, c, "sim free", f"{ptr:#x}")
        except InvalidArgument:
            raise NotGpuMemory(f"sim free({ptr:#x}): not the start of a live allocation", errno.EINVAL) from None

    def range_of(self, ptr: int) -> AllocationRange:
        c = ffi.new("struct nvp2p_sim_query *")
        c.va = ptr
        ret = lib.gpupin_call(self._fd, lib.NVP2P_SIM_IOC_QUERY, c)
        if ret == -errno.ENOENT:
            raise _not_sim_memory(ptr)
        if ret < 0:
            raise from_errno(-ret, "sim query", f"{ptr:#x}")
        return AllocationRange(int(c.base), int(c.size), int(c.buffer_id))

    def buffer_id(self, ptr: int) -> int:
        """The buffer id of the allocation holding ``ptr``, through the hit path's C query."""
        out = ffi.new("uint64_t *")
        ret = lib.gp_sim_query(self.c_buffer_id_ctx, ptr, out)
        if ret == -errno.ENOENT:
            raise _not_sim_memory(ptr)
        if ret == -errno.EBADF and self._fd < 0:
            raise InvalidArgument(f"sim buffer_id({ptr:#x}): the simulator context is closed")
        if ret < 0:
            raise from_errno(-ret, "sim query", f"{ptr:#x}")
        return int(out[0])

    def enable_sync_memops(self, ptr: int) -> None:
        """Nothing to do for simulated memory (host pages are coherent); counted."""
        self.range_of(ptr)
        self.sync_memops_calls += 1

    def write(self, ptr: int, data: bytes) -> None:
        if not data:
            return
        buf = ffi.from_buffer(data)
        c = ffi.new("struct nvp2p_sim_rw *")
        c.va, c.len, c.buf = ptr, len(data), int(ffi.cast("uintptr_t", buf))
        c.flags = lib.NVP2P_SIM_RW_WRITE
        self._call(lib.NVP2P_SIM_IOC_RW, c, "sim write", f"{ptr:#x}, {len(data)} bytes")

    def read(self, ptr: int, size: int) -> bytes:
        out = bytearray(size)
        if not size:
            return bytes(out)
        buf = ffi.from_buffer(out)
        c = ffi.new("struct nvp2p_sim_rw *")
        c.va, c.len, c.buf = ptr, size, int(ffi.cast("uintptr_t", buf))
        self._call(lib.NVP2P_SIM_IOC_RW, c, "sim read", f"{ptr:#x}, {size} bytes")
        return bytes(out)

    def export_dmabuf(self, ptr: int, revocable: bool = False) -> int:
        """Export the allocation holding ``ptr`` as a dma-buf; returns the fd (caller closes it).

        The buffer covers the whole allocation (``range_of(ptr)``).  By default the exporter
        is NVIDIA's kind: static (never revokes), only PCI devices may attach, and the
        buffer holds the memory: freeing the allocation frees nothing until the last
        reference to the buffer goes.  ``revocable=True`` gives a dynamic exporter that
        revokes the buffer (move_notify) when the allocation is freed, as amdgpu does.
        """
        c = ffi.new("struct nvp2p_sim_export *")
        c.va = ptr
        c.flags = lib.NVP2P_SIM_EXPORT_REVOCABLE if revocable else 0
        ret = lib.gpupin_call(self._fd, lib.NVP2P_SIM_IOC_EXPORT, c)
        if ret == -errno.ENOENT:
            raise NotGpuMemory(f"sim export({ptr:#x}): not simulated device memory of this context", errno.ENOENT)
        if ret < 0:
            raise from_errno(-ret, "sim export", f"{ptr:#x}")
        return int(c.fd)

    def forget_owner(self, ptr: int = 0) -> None:
        """Drop this process's registration of its pins, as NVIDIA's driver does when an MPS
        client is destroyed (``CliUnregisterFromThirdPartyP2P``): the pins on the allocation
        holding ``ptr``, or every pin of this process (``ptr`` 0).

        The memory and the armed free callbacks stay (with the MPS server, on a GPU): a later
        put_pages from this process finds nothing, returns 0 and releases nothing, and freeing
        the memory runs the callbacks with the data the client passed.  Through the simulator's
        ``forget_owner`` parameter, written from this process; needs root.
        """
        if self._fd < 0:
            raise InvalidArgument("sim forget_owner: the simulator context is closed")
        set_sim_param("forget_owner", ptr)

    def stats(self) -> SimStats:
        return sim_stats(self._fd)


def _not_sim_memory(ptr: int) -> NotGpuMemory:
    return NotGpuMemory(
        f"{ptr:#x} is not simulated device memory of this context (freed, or never allocated)", errno.ENOENT
    )


def sim_stats(fd: int | None = None) -> SimStats:
    """The simulator's global counters (opens /dev/nvp2p_sim if no fd is given)."""
    own = fd is None
    if fd is None:
        try:
            fd = os.open(SIM_PATH, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            raise DriverNotLoaded(f"{SIM_PATH} does not exist: the simulator is not loaded") from None
    try:
        c = ffi.new("struct nvp2p_sim_stats *")
        ret = lib.gpupin_call(fd, lib.NVP2P_SIM_IOC_STATS, c)
        if ret < 0:
            raise from_errno(-ret, "sim stats")
        return SimStats(**{f.name: int(getattr(c, f.name)) for f in fields(SimStats)})
    finally:
        if own:
            os.close(fd)


def reset_misuse() -> None:
    """Zero the simulator's counters of strict misuse (``MISUSE``), for a test that
    provoked them on purpose and checked them; needs root."""
    fd = os.open(SIM_PATH, os.O_RDWR | os.O_CLOEXEC)
    try:
        ret = lib.gpupin_call(fd, lib.NVP2P_SIM_IOC_RESET_MISUSE, ffi.NULL)
        if ret < 0:
            raise from_errno(-ret, "sim reset_misuse")
    finally:
        os.close(fd)


def _param_path(module: str, name: str) -> str:
    path = f"/sys/module/{module}/parameters/{name}"
    if not os.path.exists(path):
        raise DriverNotLoaded(f"{path} does not exist: is {module} loaded, and is '{name}' a parameter?")
    return path


def set_module_param(module: str, name: str, value: object) -> None:
    """Set a loaded module's parameter at run time (a bool as Y/N)."""
    text = ("Y" if value else "N") if isinstance(value, bool) else str(value)
    with open(_param_path(module, name), "w") as f:
        # An empty value is a newline: writing "" makes no write(2), so the module would never
        # hear it (a string parameter would keep its old value).
        f.write(text or "\n")


def get_module_param(module: str, name: str) -> str:
    with open(_param_path(module, name)) as f:
        return f.read().strip()


@contextlib.contextmanager
def module_param(module: str, name: str, value: object) -> Iterator[None]:
    """The module's parameter ``name`` is ``value`` inside, its old value after."""
    old = get_module_param(module, name)
    set_module_param(module, name, value)
    try:
        yield
    finally:
        set_module_param(module, name, old)


def set_sim_param(name: str, value: object) -> None:
    """Set a simulator parameter at run time (bar_size, pin_latency_us, fail_nth, ...)."""
    set_module_param("nvp2p_sim", name, value)


def get_sim_param(name: str) -> str:
    return get_module_param("nvp2p_sim", name)
