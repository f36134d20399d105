"""GPUDirect Storage: a cuFile buffer-registration cache with buffer-ID checks.

cuFile users pay for ``cuFileBufRegister`` the way RDMA users pay for pinning
(4-5 ms for 64 KiB-1 MiB, about 18 ms from 256 MiB, on an H100 with driver
580).  NVIDIA's GDS best-practices guide says: register a reused buffer once,
never per IO; register whole allocations; leave small or one-shot buffers and
buffers over cuFile's per-buffer limit to cuFile's own bounce buffers; do not
register when BAR1 is scarce.  :class:`GdsCache` does that with the
registration cache's engine: the first use registers the whole allocation, every
later use is a hit checked against the allocation's CUDA buffer id (the C hot
path of ``validate="buffer_id"``), and an entry whose memory was freed and
reallocated is deregistered and registered again.  cuFile itself cannot tell:
it keeps treating a freed address as registered (``MEMORY_ALREADY_REGISTERED``
after a free and a new allocation at the same address), so without the
buffer-id check a registration outlives its memory.

``CuFileDriver`` is the cache's "device": ``pin`` is ``cuFileBufRegister`` of the
allocation, ``unpin`` is ``cuFileBufDeregister``.  cuda-python's
``cuda.bindings.cufile`` is imported when a driver is made; libcufile comes from
the system or from the ``nvidia-cufile`` wheel (found in site-packages and
loaded, so no LD_LIBRARY_PATH is needed).
"""

from __future__ import annotations

import errno
import glob
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ._closable import Closable
from ._dlopen import load
from .cache import CacheStats, LibraryDriver, LibraryRegistration, Registration, RegistrationCache
from .errors import BarExhausted, DriverNotLoaded, GdsError, InvalidArgument, UnknownHandle
from .memory import MemoryProvider

KiB = 1 << 10
MiB = 1 << 20

# CUfileOpError numbers (cufile.h; the same in cuda.bindings.cufile.OpError).
MEMORY_ALREADY_REGISTERED = 5023
MEMORY_NOT_REGISTERED = 5024
INVALID_MAPPING_SIZE = 5016
GPU_MEMORY_PINNING_FAILED = 5036
NOMEM_ERROR = 5043
# Out of pinnable memory: the cache evicts and retries.  INVALID_MAPPING_SIZE is what
# cuFile 1.15 returns for a buffer over max_device_pinned_mem_size (measured).
_RESOURCE = {INVALID_MAPPING_SIZE, GPU_MEMORY_PINNING_FAILED, NOMEM_ERROR}


def _preload_libcufile() -> str | None:
    """Load libcufile from an ``nvidia-cufile`` wheel if the loader cannot find one.

    cuda.bindings opens ``libcufile.so.0`` by name; a library already loaded under
    that soname satisfies it.  Returns the path loaded, or None.
    """
    try:
        load("libcufile.so.0", global_symbols=True)
        return None
    except OSError:
        pass
    for base in sys.path:
        for path in sorted(glob.glob(os.path.join(base or ".", "nvidia", "*", "lib", "libcufile.so.0"))):
            try:
                load(path, global_symbols=True)
                return path
            except OSError:
                continue
    return None


def load_cufile() -> Any:
    """``cuda.bindings.cufile``, with libcufile loaded; DriverNotLoaded says what is missing."""
    _preload_libcufile()
    try:
        from cuda.bindings import cufile
    except ImportError as exc:
        raise DriverNotLoaded(
            f"cuFile is not usable from Python ({exc}): it needs cuda-python >= 12.9 "
            "(pip install cuda-python) and libcufile (pip install nvidia-cufile, or CUDA's GDS package)"
        ) from None
    return cufile


def _status(exc: BaseException) -> int | None:
    st = getattr(exc, "status", None)
    return int(st) if st is not None else None


class CuFileBuffer(LibraryRegistration):
    """One cuFile buffer registration: what the cache holds as its pin."""

    __slots__ = ()


@dataclass(frozen=True)
class Properties:
    """What cuFile reports about itself (``gpupin gds status``)."""

    version: int
    compat_mode_allowed: bool
    compat_mode_forced: bool
    nvidia_fs_loaded: bool
    max_device_pinned_mem_bytes: int
    per_buffer_cache_bytes: int
    max_direct_io_bytes: int
    bar1_bytes: int
    config: str | None

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class CuFileDriver(LibraryDriver):
    """cuFile's buffer registration behind the registration cache's device protocol.

    ``cufile`` is the module to use (``cuda.bindings.cufile`` by default;
    :class:`gpupin.testing.fake.FakeCuFile` in host tests).  The driver opens cuFile
    (``cuFileDriverOpen``, about 0.4 s) and closes it on ``close()``.
    """

    library = "cuFile"
    cache_name = "GdsCache"

    def __init__(self, cufile: Any = None, *, device: int = 0) -> None:
        self.cufile = cufile if cufile is not None else load_cufile()
        self.gpu = device
        self._next = 1
        self._by_handle: dict[int, int] = {}  # live handle -> address registered
        self._by_addr: dict[int, int] = {}  # address -> the handle that owns its registration
        self.registrations = 0
        self.deregistrations = 0
        self.superseded = 0
        self._lock = threading.RLock()
        self._open = False
        try:
            self.cufile.driver_open()
        except self.cufile.cuFileError as exc:
            raise GdsError(
                f"cuFileDriverOpen failed: {exc}; run 'gpupin doctor' for GDS readiness", _status(exc)
            ) from None
        self._open = True

    # -- the device protocol of RegistrationCache ------------------------------
    def pin(self, va: int, size: int, *, persistent: bool = False, user_tag: int = 0) -> CuFileBuffer:
        if size <= 0:
            raise InvalidArgument(f"cuFileBufRegister({va:#x}, {size}): size must be > 0")
        cf = self.cufile
        with self._lock:
            if self._by_addr.get(va) is not None:
                # The cache found this address's registration stale (its memory was freed and
                # reallocated) but an IO still holds it.  cuFile keys registrations by address
                # and would answer ALREADY_REGISTERED: deregister it now, and make the old
                # handle's later unpin a no-op.
                self.supersede(va)
            try:
                cf.buf_register(va, size, 0)
            except cf.cuFileError as exc:
                raise self._register_error(va, size, exc) from None
            h = self._next
            self._next += 1
            self._by_handle[h] = va
            self._by_addr[va] = h
            self.registrations += 1
            return CuFileBuffer(h, va, size)

    def _register_error(self, va: int, size: int, exc: Any) -> Exception:
        st = _status(exc)
        what = f"cuFileBufRegister({va:#x}, {size})"
        if st == INVALID_MAPPING_SIZE and size > self.max_pinned_bytes():
            return GdsError(
                f"{what} failed: {exc}; one buffer over cuFile's max_device_pinned_mem_size "
                f"({self.max_pinned_bytes()} bytes): leave it to bounce buffers (GdsCache.use) or raise "
                "max_device_pinned_mem_size_kb in cufile.json",
                st,
            )
        if st in _RESOURCE:  # out of pinnable memory: the cache evicts and retries
            return BarExhausted(f"{what} failed: {exc}")
        if st == MEMORY_ALREADY_REGISTERED:
            return GdsError(
                f"{what}: the address is registered with cuFile outside this cache (by the application, "
                "another library or another GdsCache); deregister it there, or let one cache own every "
                "registration of this memory",
                st,
            )
        return GdsError(f"{what} failed: {exc}", st)

    def max_pinned_bytes(self) -> int:
        S = self.cufile.SizeTConfigParameter
        return int(self.cufile.get_parameter_size_t(S.PROPERTIES_MAX_DEVICE_PINNED_MEM_SIZE_KB)) * KiB

    def supersede(self, va: int, handle: int | None = None) -> None:
        """Deregister the registration at ``va`` now, whoever holds it; its unpin becomes a no-op.
        ``handle``: only if the registration there is that one (not a newer one of the address)."""
        with self._lock:
            old = self._by_addr.get(va)
            if old is None or (handle is not None and old != handle):
                return
            self._deregister(va)
            del self._by_addr[va]
            if old in self._by_handle:  # its holder's unpin is then a no-op
                self._by_handle[old] = -1
            self.superseded += 1

    def unpin(self, handle: Any) -> None:
        h = int(getattr(handle, "handle", handle))
        with self._lock:
            va = self._by_handle.pop(h, None)
            if va is None:
                raise UnknownHandle(f"cuFile registration {h}: not a registration of this driver")
            if va >= 0 and self._by_addr.get(va) == h:
                # If cuFile refuses, the handle is gone all the same (the cache forgets it) but
                # the address stays marked registered: the next registration there deregisters
                # it first (supersede), and `live` keeps counting it until then.
                self._deregister(va)
                del self._by_addr[va]

    def _deregister(self, va: int) -> None:
        cf = self.cufile
        try:
            cf.buf_deregister(va)
        except cf.cuFileError as exc:
            if _status(exc) != MEMORY_NOT_REGISTERED:
                raise GdsError(f"cuFileBufDeregister({va:#x}) failed: {exc}", _status(exc)) from None
            return  # nothing was registered there: not a deregistration
        self.deregistrations += 1

    # -- what cuFile says about itself --------------------------------------------
    def properties(self) -> Properties:
        cf = self.cufile
        S, B = cf.SizeTConfigParameter, cf.BoolConfigParameter
        try:
            bar = int(cf.get_bar_size_in_kb(self.gpu)) * KiB
        except cf.cuFileError:
            bar = 0
        return Properties(
            version=int(cf.get_version()),
            compat_mode_allowed=bool(cf.get_parameter_bool(B.PROPERTIES_ALLOW_COMPAT_MODE)),
            compat_mode_forced=bool(cf.get_parameter_bool(B.FORCE_COMPAT_MODE)),
            nvidia_fs_loaded=os.path.exists("/sys/module/nvidia_fs"),
            max_device_pinned_mem_bytes=int(cf.get_parameter_size_t(S.PROPERTIES_MAX_DEVICE_PINNED_MEM_SIZE_KB)) * KiB,
            per_buffer_cache_bytes=int(cf.get_parameter_size_t(S.PROPERTIES_PER_BUFFER_CACHE_SIZE_KB)) * KiB,
            max_direct_io_bytes=int(cf.get_parameter_size_t(S.PROPERTIES_MAX_DIRECT_IO_SIZE_KB)) * KiB,
            bar1_bytes=bar,
            config=cufile_json_path(),
        )

    @property
    def live(self) -> int:
        return len(self._by_addr)

    def close(self) -> None:
        """Close the cache over this driver (deregistering everything), then cuFile."""
        self.close_cache()
        if self._open:
            self._open = False
            try:
                self.cufile.driver_close()
            except self.cufile.cuFileError:
                pass


def cufile_json_path() -> str | None:
    """The cufile.json cuFile reads: CUFILE_ENV_PATH_JSON, else /etc/cufile.json, if it exists."""
    path = os.environ.get("CUFILE_ENV_PATH_JSON") or "/etc/cufile.json"
    return path if os.path.exists(path) else None


@dataclass(frozen=True)
class GdsPolicy:
    """When registering pays, after the GDS best-practices guide's patterns.

    - ``min_size``: smaller buffers go through cuFile's bounce buffers (default: cuFile's
      ``per_buffer_cache_size_kb``, 1 MiB: an unregistered IO up to that size is one
      bounce-buffer copy, and a 4-5 ms registration does not pay for itself).
    - ``min_reuse``: a buffer used fewer times than this is one-shot (pattern 1's cost
      for nothing); 2 by default.
    - ``bar_headroom``: fraction of BAR1 that must stay free after the registration
      (pattern 3: do not register when BAR1 is scarce); 0.1 by default.
    - buffers over cuFile's ``max_device_pinned_mem_size`` cannot be registered at all.
    """

    min_size: int | None = None
    min_reuse: int = 2
    bar_headroom: float = 0.1

    def __post_init__(self) -> None:
        if self.min_size is not None and self.min_size < 0:
            raise InvalidArgument(f"GdsPolicy(min_size={self.min_size}): must be >= 0")
        if self.min_reuse < 1:
            raise InvalidArgument(f"GdsPolicy(min_reuse={self.min_reuse}): must be >= 1")
        if not 0.0 <= self.bar_headroom < 1.0:
            raise InvalidArgument(f"GdsPolicy(bar_headroom={self.bar_headroom}): use a fraction in [0, 1)")


@dataclass(frozen=True)
class Advice:
    register: bool
    reason: str  # "reuse", "small", "one-shot", "bar", "too-large"
    detail: str = ""


@dataclass
class GdsStats(CacheStats):
    """CacheStats (pins = registrations issued, unpins = deregistrations) and the policy's refusals."""

    skipped: dict[str, int] = field(default_factory=dict)


class GdsUse:
    """One IO buffer under the policy: registered (``registration``) or left to bounce buffers."""

    __slots__ = ("ptr", "size", "advice", "registration")

    def __init__(self, ptr: int, size: int, advice: Advice, registration: Registration | None) -> None:
        self.ptr = ptr
        self.size = size
        self.advice = advice
        self.registration = registration

    @property
    def registered(self) -> bool:
        return self.registration is not None

    def release(self) -> None:
        if self.registration is not None:
            self.registration.release()


class GdsCache(RegistrationCache):
    """A cuFile registration cache: whole allocations, buffer-id checked, LRU, limits.

    ``acquire(ptr, size)`` registers the allocation holding ``ptr`` on first use and
    returns a :class:`Registration`; hold it for the IO, release it after.  The hot
    path is ``fast_lookup`` + ``release_token`` (the buffer-id check in C).  ``use()`` applies
    :class:`GdsPolicy` first and registers only where it pays.  ``max_bytes`` defaults
    to cuFile's ``max_device_pinned_mem_size``; a registration cuFile refuses for lack
    of pinnable memory evicts the least recently used unused entry and retries.
    """

    def __init__(
        self,
        driver: CuFileDriver,
        memory: MemoryProvider,
        *,
        max_bytes: int | None = None,
        max_regions: int = 0,
        policy: GdsPolicy | None = None,
    ) -> None:
        props = driver.properties()
        self.properties = props
        if max_bytes is None:
            max_bytes = props.max_device_pinned_mem_bytes
        super().__init__(
            driver,
            memory,
            max_bytes=max_bytes,
            max_regions=max_regions,
            validate="buffer_id",
            whole_allocation=True,
            sync_memops=False,
        )
        self.driver = driver
        self.policy = policy or GdsPolicy()
        self._skipped: dict[str, int] = {}

    def advise(self, size: int, reuse: int = 2, bar_free: int | None = None) -> Advice:
        """Whether to register an allocation of ``size`` bytes used ``reuse`` times.

        ``bar_free``: free BAR1 bytes (default: BAR1 less what this cache holds).
        """
        if size <= 0:
            raise InvalidArgument(f"advise(size={size}): size must be > 0")
        p, props = self.policy, self.properties
        cap = props.max_device_pinned_mem_bytes
        if cap and size > cap:
            return Advice(False, "too-large", f"{size} bytes > cuFile's max_device_pinned_mem_size {cap}")
        min_size = props.per_buffer_cache_bytes if p.min_size is None else p.min_size
        if size < min_size:
            return Advice(False, "small", f"{size} bytes < {min_size}: cuFile's bounce buffers serve it")
        if reuse < p.min_reuse:
            return Advice(False, "one-shot", f"used {reuse} time(s) < {p.min_reuse}: registration would not pay")
        bar = props.bar1_bytes
        if bar:
            free = bar - self._st.bytes_pinned if bar_free is None else bar_free
            if free - size < p.bar_headroom * bar:
                return Advice(
                    False,
                    "bar",
                    f"{free} bytes of BAR1 free, {size} wanted, {p.bar_headroom:.0%} of {bar} must stay free",
                )
        return Advice(True, "reuse")

    def use(self, ptr: int, size: int, *, reuse: int = 2, bar_free: int | None = None) -> GdsUse:
        """The buffer for one IO: a cached registration if the policy says so, else none.

        Advice is for the whole allocation (what would be registered); a buffer
        already cached is a hit whatever the advice.  Every call counts as an acquire;
        a use left unregistered is a miss and counts in ``stats().skipped``.
        """
        tok, stale = self._peek(ptr, size)  # counts the acquire
        if tok >= 0:
            e = self._entry_of(tok)
            assert e is not None
            return GdsUse(ptr, size, Advice(True, "reuse"), Registration(self, e, ptr, size))
        r = self.memory.range_of(ptr)
        adv = self.advise(r.size, reuse, bar_free)
        if not adv.register:
            with self._lock:
                if stale is not None and self._entry_of(stale.token) is stale and not self._buffer_id_ok(stale, ptr):
                    # cuFile finds registrations by address: an unregistered IO here would
                    # use the freed memory's registration.  Drop it now, held or not.
                    self._invalidate(stale, "buffer_id")
                    # Only its own registration: another thread may have registered the new
                    # allocation at this address meanwhile (and be doing IO through it).
                    self.driver.supersede(stale.start, int(stale.pin.handle))
                self._skipped[adv.reason] = self._skipped.get(adv.reason, 0) + 1
            return GdsUse(ptr, size, adv, None)
        tok = self.miss(ptr, size, tok)  # registers, or replaces a stale entry
        e = self._entry_of(tok)
        assert e is not None
        return GdsUse(ptr, size, adv, Registration(self, e, ptr, size))

    @contextmanager
    def buffer(self, ptr: int, size: int, *, reuse: int = 2) -> Iterator[GdsUse]:
        """``with cache.buffer(ptr, n) as b:`` the IO, then the registration is released."""
        u = self.use(ptr, size, reuse=reuse)
        try:
            yield u
        finally:
            u.release()

    def stats(self) -> GdsStats:
        base = super().stats()
        with self._lock:
            return GdsStats(**base.__dict__, skipped=dict(self._skipped))


class GdsFile(Closable):
    """A file opened with O_DIRECT and registered with cuFile (``cuFileHandleRegister``).

    ``read(buf, size, offset)`` reads into device memory: ``buf`` is a pointer, a
    :class:`GdsUse` or a :class:`Registration`; a registered buffer is passed as its
    registration's base and an offset, as cuFile requires.
    """

    def __init__(self, driver: CuFileDriver, path: str, *, write: bool = False) -> None:
        self.driver = driver
        self.path = path
        cf = driver.cufile
        flags = (os.O_RDWR if write else os.O_RDONLY) | getattr(os, "O_DIRECT", 0)
        try:
            self.fd = os.open(path, flags)
        except OSError as exc:
            hint = (
                "; GDS needs a file system that supports O_DIRECT (tmpfs does not)" if exc.errno == errno.EINVAL else ""
            )
            raise GdsError(f"open({path!r}, O_DIRECT) failed: {exc.strerror}{hint}") from None
        self._descr = cf.Descr()
        self._descr.type = cf.FileHandleType.OPAQUE_FD
        self._descr.handle.fd = self.fd
        self._descr.fs_ops = 0
        try:
            self.handle = cf.handle_register(self._descr.ptr)
        except cf.cuFileError as exc:
            os.close(self.fd)
            raise GdsError(
                f"cuFileHandleRegister({path!r}) failed: {exc}; cuFile reads the file system's udev "
                "properties (ID_FS_USAGE): in a container without udev it refuses every file. "
                "'gpupin doctor' checks this",
                _status(exc),
            ) from None
        self._open = True

    @staticmethod
    def _where(buf: int | GdsUse | Registration, buf_offset: int) -> tuple[int, int]:
        if isinstance(buf, GdsUse):
            buf = buf.registration if buf.registration is not None else buf.ptr
        if isinstance(buf, Registration):
            return buf.aligned_va, buf.ptr - buf.aligned_va + buf_offset
        return int(buf), buf_offset

    def read(self, buf: int | GdsUse | Registration, size: int, offset: int = 0, *, buf_offset: int = 0) -> int:
        """Read ``size`` bytes at file ``offset`` into ``buf`` (+ ``buf_offset``); returns the bytes read.

        A raw pointer that you registered yourself must be the registration's base, the
        position inside it ``buf_offset`` (cuFile's rule).
        """
        return self._io("read", buf, size, offset, buf_offset)

    def write(self, buf: int | GdsUse | Registration, size: int, offset: int = 0, *, buf_offset: int = 0) -> int:
        """Write ``size`` bytes of ``buf`` (+ ``buf_offset``) at file ``offset``; returns the bytes written."""
        return self._io("write", buf, size, offset, buf_offset)

    def _io(self, op: str, buf: int | GdsUse | Registration, size: int, offset: int, buf_offset: int) -> int:
        base, off = self._where(buf, buf_offset)
        cf = self.driver.cufile
        what = f"cuFile{op.capitalize()}({self.path!r}, {size} bytes at {offset})"
        try:
            n = int(getattr(cf, op)(self.handle, base, size, offset, off))
        except cf.cuFileError as exc:
            raise GdsError(f"{what} failed: {exc}", _status(exc)) from None
        if n < 0:
            raise GdsError(f"{what} failed: {n}")
        return n

    def close(self) -> None:
        if getattr(self, "_open", False):
            self._open = False
            self.driver.cufile.handle_deregister(self.handle)
            os.close(self.fd)
