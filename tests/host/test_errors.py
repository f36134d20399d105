"""Errors: one hierarchy, chosen by errno, naming the call, the argument and what to do."""

from __future__ import annotations

import enum
import errno
import types
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
        (errno.EDQUOT, gpupin.QuotaExceeded),
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
    quota = from_errno(errno.EDQUOT, "PIN")
    assert "dmem.max" in str(quota) and "max_file_pinned_bytes" in str(quota)
    # A cache evicts idle registrations on either: EDQUOT is a kind of budget exhaustion.
    assert isinstance(quota, gpupin.BudgetExceeded)


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


class FakeCudaDriver(types.ModuleType):
    """``cuda.bindings.driver``'s few calls that driver_status makes, answering as told: results
    as cuda-python returns them (a tuple led by a CUresult), ``init`` None for a host whose
    libcuda does not load (cuda-python raises RuntimeError at the first call)."""

    class CUresult(enum.IntEnum):
        CUDA_SUCCESS = 0
        CUDA_ERROR_NO_DEVICE = 100

    def __init__(self, init: int | None = 0, count: int = 1) -> None:
        super().__init__("cuda.bindings.driver")
        self.init, self.count = init, count

    def cuInit(self, flags: int) -> tuple[Any]:
        if self.init is None:
            raise RuntimeError("Failed to dlopen libcuda.so.1")
        return (self.CUresult(self.init),)

    def cuDeviceGetCount(self) -> tuple[Any, int]:
        return self.CUresult.CUDA_SUCCESS, self.count

    def cuDriverGetVersion(self) -> tuple[Any, int]:
        return self.CUresult.CUDA_SUCCESS, 13000


def test_fake_cuda_driver_is_cuda_python_shaped() -> None:
    """What FakeCudaDriver offers, cuda-python's driver module has (where it is installed)."""
    try:
        from cuda.bindings import driver
    except ImportError:
        pytest.skip("cuda-python is not installed here (pip install 'gpupin[cuda]')")
    names = ["cuInit", "cuDeviceGetCount", "cuDriverGetVersion", "CUresult"]
    assert [n for n in names if not hasattr(driver, n)] == []
    for member in FakeCudaDriver.CUresult:
        assert driver.CUresult[member.name] == member.value


def test_cuda_driver_status_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    """What 'gpupin nixl status' says about VRAM: no cuda-python, no libcuda, cuInit failing,
    no device, and all there."""
    import builtins

    from gpupin.cuda import driver_status

    ok, why = driver_status()  # this host, whatever it has
    assert isinstance(ok, bool) and why
    real_import = builtins.__import__

    def no_cuda(name: str, *a: Any, **kw: Any) -> Any:
        if name.startswith("cuda"):
            raise ImportError(name)
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_cuda)
    ok, why = driver_status()
    assert not ok and why.startswith("cuda-python is not installed: pip install 'gpupin[cuda]'")
    monkeypatch.setattr(builtins, "__import__", real_import)
    fake = [FakeCudaDriver()]
    monkeypatch.setattr("gpupin.cuda._driver", lambda: fake[0])
    fake[0] = FakeCudaDriver(init=None)
    assert driver_status() == (False, "no CUDA driver here (libcuda.so.1 does not load: Failed to dlopen libcuda.so.1)")
    fake[0] = FakeCudaDriver(init=100)
    assert driver_status() == (False, "the CUDA driver is not usable here: cuInit returned CUDA_ERROR_NO_DEVICE")
    fake[0] = FakeCudaDriver(count=0)
    assert driver_status() == (False, "the CUDA driver sees no device (0 devices)")
    fake[0] = FakeCudaDriver(count=2)
    assert driver_status() == (True, "CUDA driver 13.0, 2 device(s)")
