"""The gpupin exception hierarchy.

Every error raised by the package derives from :class:`GpupinError`.  Errors
from the kernel are chosen by errno and name the call and its argument, and
say what to do about it.
"""

from __future__ import annotations

import errno
import os


class GpupinError(Exception):
    """Base class of every gpupin error.  ``errno`` is set when the kernel said it."""

    errno: int | None = None

    def __init__(self, message: str, err: int | None = None) -> None:
        super().__init__(message)
        if err is not None:
            self.errno = err


class InvalidArgument(GpupinError):
    """An argument was rejected (EINVAL): bad flags, sizes, alignment or reserved fields."""


class NotGpuMemory(InvalidArgument):
    """The address is not device memory that this process may pin."""


class UnknownHandle(GpupinError):
    """No pin (or DMA mapping) with that handle exists in this file (ENOENT)."""


class PinInvalidated(GpupinError):
    """The GPU memory under the pin was freed; unpin it and pin again (ENXIO)."""


class NotRevocable(InvalidArgument):
    """The cache was asked to trust the validity word alone (validate='kernel') for a pin
    the kernel never invalidates (persistent, or a dma-buf from a static exporter such as
    NVIDIA's): use buffer-id validation, validate='buffer_id' or 'both'."""


class InUse(GpupinError):
    """Refused because something is still in use (EBUSY): e.g. closing a cache, or the device
    under it, while a registration of it is held."""

    errno = errno.EBUSY


class BarExhausted(GpupinError):
    """The GPU's BAR space is full (ENOMEM from the provider): unpin something."""


class BudgetExceeded(GpupinError):
    """gpupin's own limit was reached (ENOSPC): max_pinned_bytes, max_pins_per_file, or a
    pin's DMA mappings (DMA_MAP)."""


class QuotaExceeded(BudgetExceeded):
    """A pin would pass the caller's share (EDQUOT): its cgroup's dmem.max for the GPU's
    ``gpupin/<pci device>/bar1`` region, or gpupin's max_file_pinned_bytes for the open file.
    A kind of :class:`BudgetExceeded`: a registration cache evicts idle pins and retries."""


class PermissionDenied(GpupinError):
    """EPERM/EACCES: the call needs CAP_SYS_ADMIN, or the file belongs to another process."""


class ForkedDevice(PermissionDenied):
    """A process other than the Device's opener (a fork child) tried to pin, unpin, map or
    read records: the kernel refuses that (EACCES), and the pins belong to the opener; or to
    read physical or bus addresses (get_pages, dma_addrs): only the opener may (EPERM).
    Open a Device in this process.  ``errno`` is EACCES, or EPERM for the addresses."""


class DriverNotLoaded(GpupinError):
    """The kernel module (or the CUDA driver) is not loaded."""


class AbiMismatch(GpupinError):
    """The loaded module speaks another ABI version than this package was built for."""


class EventsLost(GpupinError):
    """ENOBUFS on the netlink events socket: events were dropped; read the state again."""


class ModuleError(GpupinError):
    """Loading or unloading a kernel module failed."""


class GdsError(GpupinError):
    """cuFile (GPUDirect Storage) refused a call.  ``status`` is its CUfileOpError number."""

    status: int | None = None

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class TransferAborted(GpupinError):
    """A peer-driver transfer stopped because the GPU memory went away (ENODEV or EIO).

    ``done`` is the number of bytes moved before it stopped; for a read,
    ``partial`` holds them.
    """

    done: int = 0
    partial: bytes = b""

    def __init__(self, message: str, err: int | None = None, done: int = 0) -> None:
        super().__init__(message, err)
        self.done = done


_HINTS = {
    errno.EINVAL: "check the arguments (flags and reserved fields must be 0, size > 0)",
    errno.ENOENT: "the handle is not (or no longer) a pin of this file",
    errno.ENXIO: "the GPU memory was freed: unpin the handle and pin again",
    errno.ENOMEM: "the GPU BAR is exhausted: unpin unused regions and retry",
    errno.ENOSPC: (
        "a gpupin limit is reached: unpin, or raise max_pinned_bytes/max_pins_per_file (PIN); unmap (DMA_MAP:"
        " at most 16 mappings per pin)"
    ),
    errno.EDQUOT: (
        "this process's share of GPU BAR1 is used up: unpin, or raise its cgroup's dmem.max for the"
        " GPU's gpupin/<pci device>/bar1 region (or gpupin's max_file_pinned_bytes; `gpupin doctor` says"
        " which limit is in force)"
    ),
    errno.EPERM: "this needs CAP_SYS_ADMIN (run as root)",
    errno.EACCES: "this file was opened by another process: open /dev/gpupin in this one",
    errno.ENODEV: "no such PCI device",
    errno.ENOTTY: "the module does not know this command: is it the version this package expects?",
    errno.EPROTO: "the provider returned a page table or mapping of an unsupported version",
    errno.EOPNOTSUPP: (
        "the provider does not support this (a peer mapping or a dma-buf import needs a PCI path that"
        " allows peer-to-peer; gpupin reads 64 KiB GPU pages only; on an NVIDIA driver whose get_pages"
        " can double-free (525.47.22 to 525.125.06, 535.43.02 to 535.43.23, 535.54.03 to 535.113.01, and 545.23),"
        " gpupin refuses non-persistent pins: update the driver,"
        " pin persistent, or see nv_unsafe_get_pages in the kernel log)"
    ),
}

_CLASSES: dict[int, type[GpupinError]] = {
    errno.EINVAL: InvalidArgument,
    errno.ENOENT: UnknownHandle,
    errno.ENXIO: PinInvalidated,
    errno.ENOMEM: BarExhausted,
    errno.ENOSPC: BudgetExceeded,
    errno.EDQUOT: QuotaExceeded,
    errno.EPERM: PermissionDenied,
    errno.EACCES: PermissionDenied,
}


def from_errno(
    err: int, call: str, arg: str = "", cls: type[GpupinError] | None = None, hint: str | None = None
) -> GpupinError:
    """Build the exception for a failed kernel call: ``err`` is a positive errno."""
    klass = cls or _CLASSES.get(err, GpupinError)
    what = f"{call}({arg})" if arg else call
    hint = hint or _HINTS.get(err, "")
    msg = f"{what} failed: {os.strerror(err)} [{errno.errorcode.get(err, err)}]"
    if hint:
        msg += f"; {hint}"
    return klass(msg, err)


class CacheExhausted(GpupinError):
    """The cache made 2**30 - 1 entries, every token generation there is, and makes no more:
    generations never wrap (a wrap would give a token out again, and a late release of the old
    one would drop the new entry's reference).  Close it and make a new cache."""
