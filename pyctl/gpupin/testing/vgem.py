"""dma-bufs from vgem, the kernel's virtual GEM driver: a second exporter for tests.

``VgemBuffer(size)`` is a dumb buffer on the vgem DRM device, exported as a
dma-buf (``fd``) and mapped for reading and writing.  vgem is a static
exporter backed by shmem pages; it never revokes.
"""

from __future__ import annotations

import glob
import mmap
import os

from .._closable import Closable
from .._native import lib
from ..errors import DriverNotLoaded, GpupinError, from_errno

try:
    from .._gpupin_drm import ffi as drm_ffi
    from .._gpupin_drm import lib as drm_lib
except ImportError:  # built only where libdrm's DRM headers are installed
    drm_ffi = drm_lib = None


def vgem_node() -> str:
    """The /dev/dri node of the vgem device; DriverNotLoaded when vgem is not loaded."""
    for card in sorted(glob.glob("/sys/class/drm/card[0-9]*")):
        dev = os.path.realpath(os.path.join(card, "device"))
        if os.path.basename(dev) == "vgem":
            return "/dev/dri/" + os.path.basename(card)
    raise DriverNotLoaded("no vgem DRM device: load it with 'modprobe vgem'")


class VgemBuffer(Closable):
    """A vgem dumb buffer of at least ``size`` bytes, exported as the dma-buf ``fd``."""

    def __init__(self, size: int) -> None:
        if drm_lib is None:
            raise GpupinError("gpupin was built without the DRM headers: install libdrm-dev and run 'make pyext'")
        if size <= 0:
            raise GpupinError(f"VgemBuffer(size={size}): size must be > 0")
        self.fd = -1
        self._map: mmap.mmap | None = None
        self._card = os.open(vgem_node(), os.O_RDWR | os.O_CLOEXEC)
        try:
            page = mmap.PAGESIZE
            c = drm_ffi.new("struct drm_mode_create_dumb *")
            c.width, c.bpp, c.height = page, 8, -(-size // page)
            self._ioctl(drm_lib.DRM_IOCTL_MODE_CREATE_DUMB, c, "MODE_CREATE_DUMB")
            self.size = int(c.size)
            p = drm_ffi.new("struct drm_prime_handle *")
            p.handle, p.flags = c.handle, drm_lib.DRM_CLOEXEC | drm_lib.DRM_RDWR
            self._ioctl(drm_lib.DRM_IOCTL_PRIME_HANDLE_TO_FD, p, "PRIME_HANDLE_TO_FD")
            self.fd = int(p.fd)
            # The dma-buf holds the object: the GEM handle can go.
            g = drm_ffi.new("struct drm_gem_close *")
            g.handle = c.handle
            self._ioctl(drm_lib.DRM_IOCTL_GEM_CLOSE, g, "GEM_CLOSE")
            self._map = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            self.close()
            raise

    def _ioctl(self, cmd: int, arg: object, name: str) -> None:
        ret = lib.gpupin_call(self._card, cmd, arg)
        if ret < 0:
            raise from_errno(-ret, f"vgem {name}")

    def write(self, offset: int, data: bytes) -> None:
        assert self._map is not None
        self._map[offset : offset + len(data)] = data

    def read(self, offset: int, size: int) -> bytes:
        assert self._map is not None
        return bytes(self._map[offset : offset + size])

    def close(self) -> None:
        if getattr(self, "_map", None) is not None:
            self._map.close()  # type: ignore[union-attr]
            self._map = None
        if getattr(self, "fd", -1) >= 0:
            os.close(self.fd)
            self.fd = -1
        if getattr(self, "_card", -1) >= 0:
            os.close(self._card)
            self._card = -1
