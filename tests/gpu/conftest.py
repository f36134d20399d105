"""GPU suites (make test-gpu): the CUDA side on a machine with an NVIDIA GPU.

Everything here skips, with the reason, where no CUDA driver is usable.
gpupin.ko is not needed: caches run over FakeDevice (the kernel module cannot
be loaded on the lent GPU machines), whose validity map is read like the
kernel's.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gpupin.errors import DriverNotLoaded


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.gpu)


@pytest.fixture
def cuda() -> Iterator[object]:
    from gpupin.cuda import CudaMemory

    try:
        mem = CudaMemory()
    except DriverNotLoaded as exc:
        pytest.skip(f"no usable CUDA driver: {exc}")
    yield mem
    mem.close()


@pytest.fixture
def cu():  # type: ignore[no-untyped-def]
    from gpupin.cuda import _driver

    try:
        return _driver()
    except DriverNotLoaded as exc:
        pytest.skip(str(exc))
