"""The example peer driver (examples/peer/peer.c, ``gpupin_peer.ko``) from Python.

``/dev/gpupin_peer`` stands for a third-party device that DMAs to GPU memory
pinned through gpupin, using gpupin's kernel API.  Tests and the demo use it
to move bytes through a pin's DMA mapping and to hold driver references.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

from ._closable import Closable, open_node
from ._native import ffi, lib
from .device import Device, Pin
from .errors import DriverNotLoaded, InvalidArgument, PinInvalidated, TransferAborted, from_errno

PEER_PATH = "/dev/gpupin_peer"


def load_peer(pci: str | None = None) -> None:
    """Load gpupin_peer.ko (from the build tree, else installed) as the DMA engine of ``pci``.

    ``pci`` is a PCI address (``DDDD:BB:DD.F``, e.g. a NIC's); without it, the last PCI
    device.  A peer already loaded for another device is reloaded for ``pci``."""
    from . import kmod

    sysfs = "/sys/bus/pci/devices"
    if pci is not None and not os.path.isdir(f"{sysfs}/{pci}"):
        raise InvalidArgument(f"load_peer(pci={pci!r}): no such PCI device (see 'lspci -D')")
    if kmod.is_loaded("gpupin_peer"):
        if pci is None or kmod.parameters("gpupin_peer").get("pci") == pci:
            return
        kmod.unload("gpupin_peer")
    if pci is None:
        devs = sorted(os.listdir(sysfs)) if os.path.isdir(sysfs) else []
        if not devs:
            raise DriverNotLoaded("no PCI device for the example peer driver to map for")
        pci = devs[-1]
    kmod.load(kmod.module_file("gpupin_peer"), {"pci": pci})


@dataclass(frozen=True)
class PeerStatus:
    holds: int
    notified: int
    transfers: int
    aborted: int
    ram_pages: int  # GPU pages (or parts) copied through RAM mappings, since open
    bar_pages: int  # ... through write-combined BAR mappings (a GPU's BAR1)


def _handle(pin: Pin | int) -> int:
    return pin.handle if isinstance(pin, Pin) else int(pin)


class Peer(Closable):
    """One open of /dev/gpupin_peer; closing it drops every hold."""

    def __init__(self, path: str = PEER_PATH) -> None:
        self._fd = open_node(path, "load the example peer driver with 'gpupin load --peer'")

    def close(self) -> None:
        if getattr(self, "_fd", -1) >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> Peer:
        return self

    def _call(self, cmd: int, arg: object, what: str) -> int:
        if self._fd < 0:
            raise InvalidArgument(f"{what}: the peer device is closed")
        return int(lib.gpupin_call(self._fd, cmd, arg))

    def _xfer(self, device: Device, pin: Pin | int, offset: int, buf: bytearray | bytes, to_gpu: bool) -> None:
        c = ffi.new("struct gpupin_peer_xfer *")
        c.gpupin_fd = device.fileno()
        c.handle = _handle(pin)
        c.offset = offset
        c.length = len(buf)
        cbuf = ffi.from_buffer(buf)
        c.buf = int(ffi.cast("uintptr_t", cbuf))
        c.flags = lib.GPUPIN_PEER_TO_GPU if to_gpu else 0
        what = f"peer {'write' if to_gpu else 'read'}"
        desc = f"handle={c.handle}, offset={offset}, {len(buf)} bytes"
        ret = self._call(lib.GPUPIN_PEER_IOC_XFER, c, what)
        if ret in (-errno.ENODEV, -errno.EIO):
            raise TransferAborted(
                f"{what}({desc}) stopped after {int(c.done)} bytes: the GPU memory was freed "
                "(the pin is invalidated; pin the new memory again)",
                -ret,
                int(c.done),
            )
        if ret < 0:
            raise from_errno(-ret, what, desc)

    def read(self, device: Device, pin: Pin | int, offset: int, size: int) -> bytes:
        """Copy ``size`` bytes at ``offset`` from the start of the pin through its DMA mapping."""
        if size <= 0:
            raise InvalidArgument(f"peer read(size={size}): size must be > 0")
        out = bytearray(size)
        try:
            self._xfer(device, pin, offset, out, False)
        except TransferAborted as exc:
            exc.partial = bytes(out[: exc.done])
            raise
        return bytes(out)

    def write(self, device: Device, pin: Pin | int, offset: int, data: bytes) -> None:
        """Copy ``data`` to ``offset`` from the start of the pin through its DMA mapping."""
        if not data:
            raise InvalidArgument("peer write: no data (length must be > 0)")
        self._xfer(device, pin, offset, data, True)

    def hold(self, device: Device, pin: Pin | int, *, map_race: bool = False) -> int:
        """Keep a driver reference (with a DMA mapping) to the pin; returns the hold id.

        ``map_race``: the driver maps the reference from two threads at once (tests gpupin)."""
        c = ffi.new("struct gpupin_peer_hold *")
        c.flags = lib.GPUPIN_PEER_HOLD_MAP_RACE if map_race else 0
        c.gpupin_fd = device.fileno()
        c.handle = _handle(pin)
        ret = self._call(lib.GPUPIN_PEER_IOC_HOLD, c, "peer hold")
        if ret == -errno.ENODEV:
            raise PinInvalidated(
                f"peer hold(handle={c.handle}) failed: the GPU memory was freed; unpin it and pin the new memory",
                errno.ENODEV,
            )
        if ret < 0:
            raise from_errno(-ret, "peer hold", f"handle={c.handle}")
        return int(c.hold_id)

    def release(self, hold_id: int, from_kworker: bool = False) -> None:
        """Drop a hold; ``from_kworker`` drops it from a work item, as a driver's deferred teardown."""
        c = ffi.new("struct gpupin_peer_release *")
        c.hold_id = hold_id
        c.flags = lib.GPUPIN_PEER_RELEASE_ASYNC if from_kworker else 0
        ret = self._call(lib.GPUPIN_PEER_IOC_RELEASE, c, "peer release")
        if ret < 0:
            raise from_errno(-ret, "peer release", f"hold_id={hold_id}", hint="no such hold on this peer file")

    def status(self) -> PeerStatus:
        c = ffi.new("struct gpupin_peer_status *")
        ret = self._call(lib.GPUPIN_PEER_IOC_STATUS, c, "peer status")
        if ret < 0:
            raise from_errno(-ret, "peer status")
        return PeerStatus(
            int(c.holds), int(c.notified), int(c.transfers), int(c.aborted), int(c.ram_pages), int(c.bar_pages)
        )
