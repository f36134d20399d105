"""GPU suites (make test-gpu): the CUDA side on a machine with an NVIDIA GPU.

Where this host shows no NVIDIA GPU (``nvidia-smi -L`` and /proc/driver/nvidia/gpus list
none) everything here skips, with the reason.  Where it shows one, CUDA must work: a missing
cuda-python, a cuInit error or a cuFileDriverOpen failure fails the tests that need them, with
the reason, so that a GPU host cannot pass this suite having run nothing.  cuFile itself is
optional (the gds extra): where it is not installed the GDS tests skip.

gpupin.ko is not needed: caches run over FakeDevice (the kernel module cannot
be loaded on the lent GPU machines), whose validity map is read like the
kernel's.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NoReturn

import pytest

from gpupin.cuda import GpuListing, visible_gpus
from gpupin.errors import DriverNotLoaded, GdsError

if TYPE_CHECKING:
    from gpupin.gds import CuFileDriver


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.gpu)


@functools.cache
def gpus() -> GpuListing:
    """This host's NVIDIA GPUs as listed without CUDA (asked once per run)."""
    return visible_gpus()


def unusable(what: str, exc: BaseException) -> NoReturn:
    """The one decision for every fixture here: ``what`` failed with ``exc``.

    No GPU visible: skip (a host without one has nothing to test).  A GPU visible: fail, with
    the reason, since the suite exists to say whether CUDA works on such a host.
    """
    listing = gpus()
    if not listing.gpus:
        pytest.skip(f"no NVIDIA GPU on this host (nvidia-smi -L and /proc/driver/nvidia/gpus list none): {exc}")
    n = len(listing.gpus)
    hint = "" if "pip install" in str(exc) else "; 'gpupin doctor' says more"
    pytest.fail(
        f"{listing.source} lists {n} GPU{'s' if n > 1 else ''} ({listing.gpus[0]}) but {what}: {exc}{hint}",
        pytrace=False,
    )


@pytest.fixture
def cuda() -> Iterator[object]:
    from gpupin.cuda import CudaMemory

    try:
        mem = CudaMemory()
    except DriverNotLoaded as exc:
        unusable("CUDA cannot initialise", exc)
    yield mem
    mem.close()


@pytest.fixture
def cu():  # type: ignore[no-untyped-def]
    from gpupin.cuda import _driver

    try:
        return _driver()
    except DriverNotLoaded as exc:
        unusable("CUDA cannot initialise", exc)


def open_cufile() -> CuFileDriver:
    """cuFile opened (compatibility mode where nvidia-fs is absent, as on the lent machines).

    cuFile not installed: the test skips (it is optional: pip install 'gpupin[gds]').  Installed
    but cuFileDriverOpen fails: the test fails where a GPU is visible (:func:`unusable`).
    """
    from gpupin.gds import CuFileDriver

    try:
        return CuFileDriver()
    except DriverNotLoaded as exc:
        pytest.skip(f"cuFile is not installed (pip install 'gpupin[gds]'): {exc}")
    except GdsError as exc:
        unusable("cuFile cannot open", exc)


@pytest.fixture
def driver(cuda: Any) -> Iterator[CuFileDriver]:
    drv = open_cufile()
    yield drv
    drv.close()
