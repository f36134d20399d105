"""``/dev/gpupin``: one open file, its pins, its validity map and its events."""

from __future__ import annotations

import errno
import math
import mmap
import os
import select
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

from ._closable import Closable
from ._native import ffi, lib
from .errors import (
    AbiMismatch,
    DriverNotLoaded,
    ForkedDevice,
    GpupinError,
    InUse,
    InvalidArgument,
    NotGpuMemory,
    PermissionDenied,
    from_errno,
)

DEFAULT_PATH = "/dev/gpupin"
ABI_VERSION: int = lib.GPUPIN_ABI_VERSION
GPU_PAGE_SIZE: int = lib.GPUPIN_GPU_PAGE_SIZE
U64_MAX = (1 << 64) - 1

STATE_NAMES = {lib.GPUPIN_STATE_PINNED: "pinned", lib.GPUPIN_STATE_INVALIDATED: "invalidated"}
REASON_NAMES = {lib.GPUPIN_INVAL_FREED: "freed", lib.GPUPIN_INVAL_OVERFLOW: "overflow"}


def _cstr(buf: Any) -> str:
    return str(ffi.string(buf).decode(errors="replace"))


def parse_pci(address: str) -> tuple[int, int, int]:
    """``[domain:]bus:dev.fn`` (hex, as lspci prints) -> (domain, bus, devfn)."""
    parts = address.strip().split(":")
    try:
        if len(parts) == 2:
            parts = ["0", *parts]
        if len(parts) != 3:
            raise ValueError
        dev, fn = parts[2].split(".")
        domain, bus, d, f = int(parts[0], 16), int(parts[1], 16), int(dev, 16), int(fn, 16)
    except ValueError:
        raise InvalidArgument(
            f"PCI address {address!r} is not [domain:]bus:device.function, e.g. 0000:00:03.0"
        ) from None
    if domain > 0xFFFF or bus > 0xFF or d > 0x1F or f > 7:
        raise InvalidArgument(f"PCI address {address!r} is out of range")
    return domain, bus, (d << 3) | f


@dataclass(frozen=True)
class Info:
    abi_version: int
    version: str
    provider: str
    caps: int
    gpu_page_size: int
    max_pinned_bytes: int
    pinned_bytes: int
    max_pins_per_file: int
    file_pins: int
    map_size: int

    @property
    def persistent(self) -> bool:
        return bool(self.caps & lib.GPUPIN_CAP_PERSISTENT)

    @property
    def dma_map(self) -> bool:
        return bool(self.caps & lib.GPUPIN_CAP_DMA_MAP)

    @property
    def simulator(self) -> bool:
        return bool(self.caps & lib.GPUPIN_CAP_SIMULATOR)

    @property
    def dmabuf(self) -> bool:
        return bool(self.caps & lib.GPUPIN_CAP_DMABUF)


@dataclass(frozen=True)
class PinState:
    handle: int
    state: str
    va: int
    size: int
    aligned_va: int
    aligned_size: int
    user_tag: int
    entries: int
    dma_mappings: int
    persistent: bool
    slot: int
    dmabuf: bool = False
    revocable: bool = False


@dataclass(frozen=True)
class DmaMapping:
    handle: int
    mapping_id: int
    entries: int
    pci: str


@dataclass(frozen=True)
class Event:
    """An invalidation record: the pin's memory was freed (or records were lost)."""

    handle: int
    user_tag: int
    reason: str
    slot: int


class Pin:
    """One pin of a :class:`Device`.  ``is_valid()`` is a single memory read."""

    __slots__ = (
        "device",
        "handle",
        "va",
        "size",
        "aligned_va",
        "aligned_size",
        "page_size",
        "entries",
        "gpu_uuid",
        "slot",
        "valid_word",
        "persistent",
        "user_tag",
        "dmabuf",
        "revocable",
    )

    def __init__(self, device: Device, c: Any, va: int, size: int, user_tag: int) -> None:
        self.device = device
        self.handle: int = c.handle
        self.va = va
        self.size = size
        self.user_tag = user_tag
        self.aligned_va: int = c.aligned_va
        self.aligned_size: int = c.aligned_size
        self.page_size: int = c.page_size
        self.entries: int = c.entries
        self.gpu_uuid: bytes = bytes(ffi.buffer(c.gpu_uuid))
        self.slot: int = c.slot
        self.valid_word: int = c.valid_word
        self.persistent = bool(c.pin_flags & lib.GPUPIN_PIN_PERSISTENT)
        self.dmabuf = bool(c.pin_flags & lib.GPUPIN_PIN_DMABUF)
        # False: the kernel never invalidates this pin (persistent, or a static dma-buf exporter
        # such as NVIDIA's); only a buffer-id check tells that the memory was freed and reused.
        self.revocable = bool(c.pin_flags & lib.GPUPIN_PIN_REVOCABLE)

    def is_valid(self) -> bool:
        """True while the kernel has not invalidated or released the pin."""
        return self.device.read_word(self.slot) == self.valid_word

    def query(self) -> PinState:
        return self.device.query(self.handle)

    def unpin(self) -> None:
        self.device.unpin(self.handle)

    def __repr__(self) -> str:
        return (
            f"Pin(handle={self.handle}, va={self.va:#x}, size={self.size}, "
            f"aligned=[{self.aligned_va:#x}+{self.aligned_size:#x}], entries={self.entries})"
        )


class Device(Closable):
    """An open ``/dev/gpupin``.  Each open file owns its pins; close releases them.

    The file is opened non-blocking (``O_NONBLOCK``), and stays so: ``read_events`` reads
    until the queue is empty without ever changing the file's flags, so any number of threads
    and registration caches may share one Device.  See ``fileno()`` for reading it yourself.
    """

    def __init__(self, path: str = DEFAULT_PATH) -> None:
        self.path = path
        self._pid = os.getpid()  # the opener: the kernel refuses this file to other processes
        try:
            # Non-blocking for good: threads share the file, so its flags never change (a thread
            # that made it blocking for a moment would leave another one asleep in read()).
            self._fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            raise DriverNotLoaded(
                f"{path} does not exist: load the module with 'gpupin load' "
                "(or 'gpupin load --sim' without an NVIDIA GPU), or 'modprobe gpupin'"
            ) from None
        except PermissionError:
            raise PermissionDenied(
                f"cannot open {path}: add this user to the 'gpupin' group or run as root",
                errno.EACCES,
            ) from None
        self._map: mmap.mmap | None = None
        self._words: memoryview | None = None
        self._lock = threading.Lock()
        self._children: weakref.WeakSet[Any] = weakref.WeakSet()
        _DEVICES.add(self)  # _cover_maps_in_child covers its validity map in a fork child
        try:
            info = self.info()
        except BaseException:
            os.close(self._fd)
            self._fd = -1
            raise
        if info.abi_version != ABI_VERSION:
            self.close()
            raise AbiMismatch(
                f"{path} speaks ABI {info.abi_version}, this package was built for "
                f"{ABI_VERSION}: rebuild the package or load the matching module"
            )

    # -- plumbing -----------------------------------------------------------
    def fileno(self) -> int:
        """The open file's descriptor, for ioctls, ``mmap`` and select/poll/selectors.

        The file is non-blocking: ``read()`` on it raises ``BlockingIOError`` (EAGAIN) when no
        record is queued, so whoever reads it directly must wait with select, poll or selectors
        first.  Do not change its flags (``os.set_blocking``, ``fcntl``): other threads, and the
        registration caches built on this Device, share the file and count on ``read()`` never
        sleeping; with a blocking file one of them could sleep until the next invalidation,
        holding its locks.  For a blocking read, open a Device of your own.
        """
        if self._fd < 0:
            raise GpupinError(f"{self.path} is closed")
        return self._fd

    def _forked(self, what: str) -> ForkedDevice | None:
        """The error for EACCES in a process other than the opener (a fork child), else None."""
        if self._pid == os.getpid():
            return None
        return ForkedDevice(
            f"{what} failed: {self.path} was opened by process {self._pid}, and this is process "
            f"{os.getpid()} (a fork child): the kernel refuses pins, mappings and records of another "
            "process's file (EACCES); open a Device in this process (Device.reopen(); a "
            "RegistrationCache does that by itself)",
            errno.EACCES,
        )

    def _addrs_refused(self, what: str) -> PermissionDenied:
        """The error for EPERM from GET_PAGES or DMA_ADDRS: the kernel gives physical and bus
        addresses only to the process that opened the file, and only if it had CAP_SYS_ADMIN."""
        if self._pid != os.getpid():
            return ForkedDevice(
                f"{what} failed: {self.path} was opened by process {self._pid}, and this is process "
                f"{os.getpid()} (a fork child): the kernel gives physical and bus addresses only to the "
                "process that opened the file (EPERM); open a Device in this process as root "
                "(Device.reopen()) and pin there",
                errno.EPERM,
            )
        return PermissionDenied(
            f"{what} failed: {os.strerror(errno.EPERM)} [EPERM]; physical and bus addresses are only "
            f"for the process that opened {self.path}, and only if it had CAP_SYS_ADMIN (root) when it "
            "opened it: open the Device as root in the process that reads them and pin there (a file "
            "inherited through fork or received over a socket gives none)",
            errno.EPERM,
        )

    def reopen(self) -> Device:
        """A new Device on the same path, owned by the calling process (e.g. a fork child)."""
        return Device(self.path)

    @property
    def closed(self) -> bool:
        return self._fd < 0

    @property
    def opener_pid(self) -> int:
        """The process that opened this Device: the only one the kernel lets pin through it."""
        return self._pid

    def register_child(self, obj: Any) -> None:
        """Something (a RegistrationCache) to close before this device closes.  ``close()``
        calls its ``quiesce(True)``, counts its ``held()`` references, and then closes it, or
        calls ``quiesce(False)`` and refuses."""
        self._children.add(obj)

    def unregister_child(self, obj: Any) -> None:
        self._children.discard(obj)

    def close(self) -> None:
        """Close the file (and the caches built on it): the kernel releases every pin it holds.

        Refuses with InUse, closing nothing, while a cache on this device holds a registration
        (a NIC may still be moving data through its pin): release it first.  The caches stop
        handing out references while their holders are counted, so the count stays true.
        """
        children = list(getattr(self, "_children", ()))
        for child in children:
            child.quiesce(True)
        held = sum(int(child.held()) for child in children)
        if held:
            for child in children:
                child.quiesce(False)
            raise InUse(
                f"close of {self.path}: {held} registration(s) of its registration caches are still "
                "held; release them and close again (the file and its pins stay open until then)"
            )
        for child in children:
            child.close()
        if self._words is not None:
            self._words.release()
            self._words = None
        if self._map is not None:
            self._map.close()
            self._map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> Device:
        return self

    def _call(self, cmd: int, arg: Any, name: str, desc: str = "", **kw: Any) -> None:
        ret = lib.gpupin_call(self.fileno(), cmd, arg)
        if ret < 0:
            raise self._error(ret, name, desc, **kw)

    def _error(self, ret: int, name: str, desc: str = "", **kw: Any) -> GpupinError:
        """The exception for a failed ioctl: ``ret`` is -errno."""
        if ret == -errno.EACCES:
            forked = self._forked(f"{name}({desc})" if desc else name)
            if forked is not None:
                return forked
        return from_errno(-ret, name, desc, **kw)

    def validity_map(self) -> mmap.mmap:
        """The read-only validity map (one u64 per pin slot), mapped on first use."""
        self._map_words()
        assert self._map is not None
        return self._map

    def read_word(self, slot: int) -> int:
        """The validity map's word for pin slot ``slot`` (one memory read): equal to the pin's
        ``valid_word`` while the kernel has not invalidated or released it (``Pin.is_valid``)."""
        words = self._words
        if words is None:
            words = self._map_words()
        return int(words[slot])

    def _map_words(self) -> memoryview:
        with self._lock:
            if self._words is None:
                size = self.info().map_size
                try:
                    self._map = mmap.mmap(self.fileno(), size, mmap.MAP_SHARED, mmap.PROT_READ)
                except PermissionError:
                    raise self._forked("mmap of the validity map") or from_errno(errno.EACCES, "mmap") from None
                self._words = memoryview(self._map).cast("Q")
            return self._words

    # -- ioctls --------------------------------------------------------------
    def info(self) -> Info:
        c = ffi.new("struct gpupin_info *")
        self._call(lib.GPUPIN_IOC_INFO, c, "INFO")
        return Info(
            abi_version=c.abi_version,
            version=_cstr(c.version),
            provider=_cstr(c.provider),
            caps=c.caps,
            gpu_page_size=c.gpu_page_size,
            max_pinned_bytes=c.max_pinned_bytes,
            pinned_bytes=c.pinned_bytes,
            max_pins_per_file=c.max_pins_per_file,
            file_pins=c.file_pins,
            map_size=c.map_size,
        )

    def pin(self, va: int, size: int, *, persistent: bool = False, user_tag: int = 0) -> Pin:
        """Pin [va, va + size), widened to 64 KiB GPU pages."""
        if size <= 0:
            raise InvalidArgument(f"PIN(va={va:#x}, size={size}): size must be > 0")
        if va < 0 or va + size - 1 > U64_MAX or not 0 <= user_tag <= U64_MAX:
            raise InvalidArgument(f"PIN(va={va:#x}, size={size}): range outside 64-bit space")
        c = ffi.new("struct gpupin_pin *")
        c.va, c.size, c.user_tag = va, size, user_tag
        c.flags = lib.GPUPIN_PIN_PERSISTENT if persistent else 0
        desc = f"va={va:#x}, size={size}"
        ret = lib.gpupin_call(self.fileno(), lib.GPUPIN_IOC_PIN, c)
        if ret == -errno.EINVAL:
            # The arguments passed our checks, so the provider refused the range.
            raise from_errno(
                errno.EINVAL,
                "PIN",
                desc,
                cls=NotGpuMemory,
                hint=("the range is not GPU memory allocated by this process (or spans allocations)"),
            )
        if ret == -errno.ENXIO:
            raise from_errno(
                errno.ENXIO,
                "PIN",
                desc,
                hint=(
                    "the GPU memory was freed while it was being pinned (by another thread, or its "
                    "CUDA context went): allocate it again and pin the new memory"
                ),
            )
        if ret < 0:
            raise self._error(ret, "PIN", desc)
        if self._words is None:
            self._map_words()
        return Pin(self, c, va, size, user_tag)

    def pin_dmabuf(
        self, fd: int, size: int | None = None, *, offset: int = 0, user_tag: int = 0, pci: str | None = None
    ) -> Pin:
        """Pin [offset, offset + size) of the dma-buf ``fd`` (default: to its end).

        The pin holds the buffer, so ``fd`` may be closed afterwards.  Its ``va`` is ``offset``;
        pages are CPU pages.  ``pci`` (e.g. '0000:00:03.0') names the device the buffer is
        imported for: ``get_pages`` then gives that device's bus addresses.  Without it nothing
        is imported (``dma_map`` gives addresses per device); an exporter that can revoke its
        buffer needs it.  ``Pin.revocable`` says whether the pin is ever invalidated: NVIDIA's
        exporter never revokes, so its memory stays allocated until the pin goes.
        """
        if size is None:
            try:
                size = os.lseek(fd, 0, os.SEEK_END) - offset
            except OSError as exc:
                raise from_errno(
                    exc.errno or errno.EBADF, "PIN_DMABUF", f"fd={fd}", hint=("the fd is not an open dma-buf")
                ) from None
        if size <= 0 or offset < 0 or offset + size - 1 > U64_MAX or not 0 <= user_tag <= U64_MAX:
            raise InvalidArgument(
                f"PIN_DMABUF(fd={fd}, offset={offset}, size={size}): size must be > 0 and the range inside 64-bit space"
            )
        c = ffi.new("struct gpupin_pin_dmabuf *")
        c.fd, c.offset, c.size, c.user_tag = fd, offset, size, user_tag
        desc = f"fd={fd}, offset={offset}, size={size}"
        if pci is not None:
            c.flags = lib.GPUPIN_PIN_DMABUF_PCI_DEV
            c.pci_domain, c.pci_bus, c.pci_devfn = parse_pci(pci)
            desc += f", pci={pci}"
        ret = lib.gpupin_call(self.fileno(), lib.GPUPIN_IOC_PIN_DMABUF, c)
        if ret == -errno.EINVAL:
            hint = "fd must be a dma-buf, offset page aligned, and [offset, offset + size) inside it"
            if pci is None:
                hint += "; a buffer whose exporter can revoke it needs the importing device (pci=)"
            raise from_errno(errno.EINVAL, "PIN_DMABUF", desc, hint=hint)
        if ret == -errno.ENODEV and pci is not None:
            raise from_errno(errno.ENODEV, "PIN_DMABUF", desc, hint=f"no PCI device {pci} (see lspci -D)")
        if ret == -errno.EBADF:
            raise from_errno(
                errno.EBADF, "PIN_DMABUF", desc, cls=InvalidArgument, hint="fd is not an open file descriptor"
            )
        if ret < 0:
            raise self._error(ret, "PIN_DMABUF", desc)
        if self._words is None:
            self._map_words()
        return Pin(self, c, offset, size, user_tag)

    def unpin(self, handle: int | Pin) -> None:
        h = handle.handle if isinstance(handle, Pin) else handle
        c = ffi.new("struct gpupin_unpin *")
        c.handle = _u64(h, "handle")
        self._call(lib.GPUPIN_IOC_UNPIN, c, "UNPIN", f"handle={h}")

    def query(self, handle: int | Pin) -> PinState:
        h = handle.handle if isinstance(handle, Pin) else handle
        c = ffi.new("struct gpupin_query *")
        c.handle = _u64(h, "handle")
        self._call(lib.GPUPIN_IOC_QUERY, c, "QUERY", f"handle={h}")
        return PinState(
            handle=h,
            state=STATE_NAMES.get(c.state, str(c.state)),
            va=c.va,
            size=c.size,
            aligned_va=c.aligned_va,
            aligned_size=c.aligned_size,
            user_tag=c.user_tag,
            entries=c.entries,
            dma_mappings=c.dma_mappings,
            persistent=bool(c.pin_flags & lib.GPUPIN_PIN_PERSISTENT),
            slot=c.slot,
            dmabuf=bool(c.pin_flags & lib.GPUPIN_PIN_DMABUF),
            revocable=bool(c.pin_flags & lib.GPUPIN_PIN_REVOCABLE),
        )

    def get_pages(self, handle: int | Pin, first: int = 0, count: int | None = None) -> list[int]:
        """Physical addresses of the pin's 64 KiB pages (a dma-buf pin's: the bus addresses of
        its exporter's pages, see pin_dmabuf): only in the process that opened the
        Device, and only if it had CAP_SYS_ADMIN (PermissionDenied, or ForkedDevice in a fork
        child, otherwise)."""
        h = handle.handle if isinstance(handle, Pin) else handle
        if count is None:
            count = self.query(h).entries - first
        if count <= 0 or first < 0:
            raise InvalidArgument(f"GET_PAGES(handle={h}, first={first}, count={count}): empty range")
        out = ffi.new("__u64[]", count)
        c = ffi.new("struct gpupin_get_pages *")
        c.handle, c.first, c.count = _u64(h, "handle"), first, count
        c.addrs = int(ffi.cast("uintptr_t", out))
        ret = lib.gpupin_call(self.fileno(), lib.GPUPIN_IOC_GET_PAGES, c)
        desc = f"handle={h}, first={first}, count={count}"
        if ret == -errno.EOPNOTSUPP:
            raise from_errno(
                errno.EOPNOTSUPP,
                "GET_PAGES",
                desc,
                hint=(
                    "this dma-buf pin was imported for no device: pin it with pin_dmabuf(..., pci=) "
                    "or use dma_map() and dma_addrs() for each device"
                ),
            )
        if ret == -errno.EPERM:
            raise self._addrs_refused(f"GET_PAGES({desc})")
        if ret < 0:
            raise from_errno(-ret, "GET_PAGES", desc)
        return list(out)

    def dma_map(self, handle: int | Pin, pci: str) -> DmaMapping:
        """Map the pin's pages for DMA by the PCI device ``pci`` (e.g. '0000:00:03.0')."""
        h = handle.handle if isinstance(handle, Pin) else handle
        domain, bus, devfn = parse_pci(pci)
        c = ffi.new("struct gpupin_dma_map *")
        c.handle, c.pci_domain, c.pci_bus, c.pci_devfn = _u64(h, "handle"), domain, bus, devfn
        self._call(lib.GPUPIN_IOC_DMA_MAP, c, "DMA_MAP", f"handle={h}, pci={pci}")
        return DmaMapping(handle=h, mapping_id=c.mapping_id, entries=c.entries, pci=pci)

    def dma_addrs(self, mapping: DmaMapping, first: int = 0, count: int | None = None) -> list[int]:
        """Bus addresses of a DMA mapping's entries: as ``get_pages``, only in the opener with
        CAP_SYS_ADMIN."""
        if count is None:
            count = mapping.entries - first
        if count <= 0 or first < 0:
            raise InvalidArgument(f"DMA_ADDRS(first={first}, count={count}): empty range")
        out = ffi.new("__u64[]", count)
        c = ffi.new("struct gpupin_dma_addrs *")
        c.handle, c.mapping_id, c.first, c.count = mapping.handle, mapping.mapping_id, first, count
        c.addrs = int(ffi.cast("uintptr_t", out))
        desc = f"handle={mapping.handle}, mapping={mapping.mapping_id}"
        ret = lib.gpupin_call(self.fileno(), lib.GPUPIN_IOC_DMA_ADDRS, c)
        if ret == -errno.EPERM:
            raise self._addrs_refused(f"DMA_ADDRS({desc})")
        if ret < 0:
            raise self._error(ret, "DMA_ADDRS", desc)
        return list(out)

    def dma_unmap(self, mapping: DmaMapping) -> None:
        c = ffi.new("struct gpupin_dma_unmap *")
        c.handle, c.mapping_id = mapping.handle, mapping.mapping_id
        self._call(lib.GPUPIN_IOC_DMA_UNMAP, c, "DMA_UNMAP", f"handle={mapping.handle}, mapping={mapping.mapping_id}")

    # -- invalidation records ------------------------------------------------
    def read_events(self) -> list[Event]:
        """Invalidation records queued now (never blocks: reads until the queue is empty).

        Each record goes to exactly one reader: with several threads reading, each gets some.
        """
        size = ffi.sizeof("struct gpupin_event")
        out: list[Event] = []
        fd = self.fileno()
        while True:
            try:
                data = os.read(fd, size * 64)
            except BlockingIOError:
                break
            except PermissionError:
                raise self._forked("read of invalidation records") or from_errno(errno.EACCES, "read") from None
            if not data:  # end of file: never from gpupin, which has no end
                break
            buf = ffi.from_buffer("struct gpupin_event[]", data)
            for i in range(len(data) // size):
                e = buf[i]
                out.append(Event(e.handle, e.user_tag, REASON_NAMES.get(e.reason, str(e.reason)), e.slot))
        return out

    def wait_invalidations(self, timeout: float | None = None) -> list[Event]:
        """Wait up to ``timeout`` seconds (None: forever) for invalidation records.

        Returns the records read, or [] once the timeout has passed with none: records that
        another thread takes first (between this one's poll and read) do not end the wait.
        """
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        poller = select.poll()
        poller.register(self.fileno(), select.POLLIN)
        while True:
            ms = None if deadline is None else max(0, math.ceil((deadline - time.monotonic()) * 1000))
            ready = poller.poll(ms)
            if ready:
                events = self.read_events()
                # Without POLLIN (an error, a hangup) there is nothing to wait for.
                if events or not ready[0][1] & select.POLLIN:
                    return events
            if deadline is not None and time.monotonic() >= deadline:
                return []


# Every live Device, for the one fork hook below (a hook per Device would pile up: they
# cannot be unregistered).
_DEVICES: weakref.WeakSet[Device] = weakref.WeakSet()


def _cover_maps_in_child() -> None:
    """The fork hook: the kernel does not copy validity maps into the child; read zeros there."""
    error: BaseException | None = None
    for dev in list(_DEVICES):
        try:
            _cover_map(dev)
        except Exception as exc:  # the other devices still get their cover; reported below
            error = error or exc
    if error is not None:
        raise error


def _cover_map(dev: Device) -> None:
    # Part of Device, written beside it: the fork hook must reach every Device, and per-Device
    # hooks cannot be unregistered.  It covers the Device's private map and renews its lock.
    if dev._map is None:
        return
    dev._lock = threading.Lock()
    addr = int(ffi.cast("uintptr_t", ffi.from_buffer(dev._map)))
    lib.gpupin_cover_zero(addr, len(dev._map))


os.register_at_fork(after_in_child=_cover_maps_in_child)


def _u64(value: int, name: str) -> int:
    if not 0 <= value <= U64_MAX:
        raise InvalidArgument(f"{name}={value} is not a 64-bit unsigned value")
    return value
