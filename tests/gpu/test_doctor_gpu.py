"""``gpupin doctor``'s GPU checks on a host with a GPU: they read real values there."""

from __future__ import annotations

import pytest

from conftest import gpus
from gpupin.tools import doctor


def test_bar1_usage_read_through_nvml(cuda) -> None:  # type: ignore[no-untyped-def]
    checks = doctor.check_bar1()
    if "nvidia-ml-py" in checks[0].detail:  # an optional extra, as cuFile is: say so and skip
        pytest.skip(f"{checks[0].detail}: {checks[0].fix} (the lent machine: carry its wheel in .wheels)")
    if checks[0].detail.startswith("NVML not present"):
        # nvidia-smi reads the GPUs through that same library: where it listed them, NVML is
        # there and doctor failed to find it.
        if gpus().source == "nvidia-smi -L":
            pytest.fail(f"nvidia-smi -L lists GPUs but doctor found no NVML: {checks[0].detail}", pytrace=False)
        pytest.skip("libnvidia-ml.so.1 is not installed on this GPU host")
    first = checks[0]
    assert first.name == "BAR1" and first.status in ("pass", "warn"), checks
    assert first.detail.startswith("GPU 0: ") and "MiB used of" in first.detail, checks


def test_stream_memops_attributes_read(cuda) -> None:  # type: ignore[no-untyped-def]
    checks = doctor.check_stream_memops()
    first = checks[0]
    assert first.name == "stream memops" and first.status in ("pass", "warn"), checks
    assert first.detail.startswith("GPU 0: ") and "CAN_USE_" in first.detail, checks
    if first.status == "warn":
        assert "NVreg_EnableStreamMemOPs=1" in first.fix
