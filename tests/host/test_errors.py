"""Errors: one hierarchy, chosen by errno, naming the call, the argument and what to do."""

from __future__ import annotations

import errno
from typing import Any

import pytest

import gpupin
from gpupin.errors import from_errno


@pytest.mark.parametrize(
    "err,cls",
    [
        (errno.EINVAL, gpupin.InvalidArgument),
        (errno.ENOENT, gpupin.UnknownHandle),
        (errno.ENXIO, gpupin.PinInvalidated),
        (errno.ENOMEM, gpupin.BarExhausted),
        (errno.ENOSPC, gpupin.BudgetExceeded),
        (errno.EPERM, gpupin.PermissionDenied),
        (errno.EACCES, gpupin.PermissionDenied),
        (errno.EIO, gpupin.GpupinError),
    ],
)
def test_mapping(err: int, cls: type) -> None:
    exc = from_errno(err, "PIN", "va=0x1000, size=4096")
    assert type(exc) is cls and exc.errno == err
    assert isinstance(exc, gpupin.GpupinError)
    assert "PIN(va=0x1000, size=4096) failed" in str(exc)
    assert errno.errorcode[err] in str(exc)


def test_messages_say_what_to_do() -> None:
    assert "unpin" in str(from_errno(errno.ENOMEM, "PIN"))
    assert "CAP_SYS_ADMIN" in str(from_errno(errno.EPERM, "GET_PAGES"))
    assert "another process" in str(from_errno(errno.EACCES, "PIN"))
    assert "max_pinned_bytes" in str(from_errno(errno.ENOSPC, "PIN"))


def test_not_gpu_memory_is_an_invalid_argument() -> None:
    assert issubclass(gpupin.NotGpuMemory, gpupin.InvalidArgument)
    exc = from_errno(errno.EINVAL, "PIN", "va=0x1", cls=gpupin.NotGpuMemory, hint="not GPU memory")
    assert isinstance(exc, gpupin.NotGpuMemory) and str(exc).endswith("not GPU memory")


def test_device_missing_says_how_to_load(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(gpupin.DriverNotLoaded, match="gpupin load"):
        gpupin.Device(str(tmp_path / "gpupin"))
    with pytest.raises(gpupin.DriverNotLoaded, match="gpupin load --sim"):
        gpupin.SimMemory(str(tmp_path / "nvp2p_sim"))


def test_cuda_missing_is_driver_not_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real = builtins.__import__

    def no_cuda(name, *a, **kw):  # type: ignore[no-untyped-def]
        if name.startswith("cuda"):
            raise ImportError(name)
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_cuda)
    from gpupin.cuda import CudaMemory

    with pytest.raises(gpupin.DriverNotLoaded, match="cuda-python is not installed"):
        CudaMemory()


class FakeLibcuda:
    """libcuda's few entry points driver_status calls, answering as told."""

    def __init__(self, init: int = 0, count: int = 1) -> None:
        self.init, self.count = init, count

    def cuInit(self, flags: int) -> int:
        return self.init

    def cuDeviceGetCount(self, out: Any) -> int:
        out._obj.value = self.count
        return 0

    def cuDriverGetVersion(self, out: Any) -> int:
        out._obj.value = 13000
        return 0

    def cuGetErrorName(self, err: int, out: Any) -> int:
        out._obj.value = b"CUDA_ERROR_NO_DEVICE"
        return 0


def test_cuda_driver_status_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    """What 'gpupin nixl status' says about VRAM: no libcuda, cuInit failing, no device,
    no cuda-python, and all there."""
    import builtins
    import ctypes

    from gpupin.cuda import driver_status

    ok, why = driver_status()  # this host, whatever it has
    assert isinstance(ok, bool) and why
    real_cdll, real_import = ctypes.CDLL, builtins.__import__
    fake: list[FakeLibcuda | None] = [None]

    def cdll(name: Any, *a: Any, **kw: Any) -> Any:
        if name != "libcuda.so.1":
            return real_cdll(name, *a, **kw)
        if fake[0] is None:
            raise OSError("libcuda.so.1: cannot open shared object file: No such file or directory")
        return fake[0]

    def no_cuda(name: str, *a: Any, **kw: Any) -> Any:
        if name.startswith("cuda"):
            raise ImportError(name)
        return real_import(name, *a, **kw)

    monkeypatch.setattr(ctypes, "CDLL", cdll)
    monkeypatch.setattr(builtins, "__import__", no_cuda)
    assert driver_status() == (False, "no CUDA driver here (libcuda.so.1 not found)")
    fake[0] = FakeLibcuda(init=100)
    assert driver_status() == (False, "the CUDA driver is not usable here: cuInit returned CUDA_ERROR_NO_DEVICE")
    fake[0] = FakeLibcuda(count=0)
    assert driver_status() == (False, "the CUDA driver sees no device (0 devices)")
    fake[0] = FakeLibcuda(count=2)
    ok, why = driver_status()
    assert not ok and why.startswith("CUDA driver 13.0, 2 device(s), but cuda-python is not installed")
    monkeypatch.setattr(builtins, "__import__", real_import)
    monkeypatch.setattr("gpupin.cuda._driver", lambda: object())
    assert driver_status() == (True, "CUDA driver 13.0, 2 device(s)")
