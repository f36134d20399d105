"""Errors: one hierarchy, chosen by errno, naming the call, the argument and what to do."""

from __future__ import annotations

import errno

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
