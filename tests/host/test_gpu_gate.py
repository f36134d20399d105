"""The GPU suite's gate (tests/gpu/conftest.py): skip where no GPU is visible, fail where one is.

A fake ``nvidia-smi`` on PATH lists a GPU; a fake ``cuda`` package (cuda-python's layout, made
here) stands for CUDA: missing, or its cuInit failing, or cuFileDriverOpen failing.  The suite
is run in a child pytest, as ``make test-gpu`` runs it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpupin.cuda import GpuListing, visible_gpus

ROOT = Path(__file__).resolve().parents[2]
GPU_LINE = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-00000000-1111-2222-3333-444444444444)"

# cuda.bindings.driver as far as CudaMemory's constructor goes.  FAKE_CUINIT names the
# CUresult cuInit returns.
FAKE_DRIVER = """
import enum, os

class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_NO_DEVICE = 100

class _Attrs:
    def __getattr__(self, name):
        return 1

CUpointer_attribute = _Attrs()
CUmemorytype = _Attrs()

def cuInit(flags):
    return (CUresult[os.environ.get("FAKE_CUINIT", "CUDA_SUCCESS")],)

def cuDeviceGet(n):
    return (CUresult.CUDA_SUCCESS, n)

def cuDevicePrimaryCtxRetain(dev):
    return (CUresult.CUDA_SUCCESS, 1)

def cuDevicePrimaryCtxRelease(dev):
    return (CUresult.CUDA_SUCCESS,)

def cuCtxSetCurrent(ctx):
    return (CUresult.CUDA_SUCCESS,)
"""

# cuda.bindings.cufile whose cuFileDriverOpen fails, as on a host with a broken GDS setup.
FAKE_CUFILE = """
class cuFileError(Exception):
    status = 5030

def driver_open():
    raise cuFileError("CU_FILE_DRIVER_NOT_INITIALIZED (5030)")

def driver_close():
    pass
"""


def fake_nvidia_smi(bindir: Path, *, lists: bool = True) -> None:
    bindir.mkdir(exist_ok=True)
    script = bindir / "nvidia-smi"
    if lists:
        script.write_text(f'#!/bin/sh\n[ "$1" = -L ] && echo "{GPU_LINE}"\n')
    else:
        script.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not talk to the driver.'\nexit 9\n")
    script.chmod(0o755)


def fake_cuda(site: Path, *, cufile: bool = False) -> None:
    pkg = site / "cuda" / "bindings"
    pkg.mkdir(parents=True)
    (site / "cuda" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "driver.py").write_text(FAKE_DRIVER)
    if cufile:
        (pkg / "cufile.py").write_text(FAKE_CUFILE)


def hide_cuda(site: Path) -> None:
    """A ``cuda`` package that is not there (whatever the venv holds)."""
    (site / "cuda").mkdir(parents=True)
    (site / "cuda" / "__init__.py").write_text("raise ImportError('cuda-python hidden by the test')\n")


def run_suite(tmp_path: Path, bindir: Path, site: Path, *tests: str, **env: str) -> subprocess.CompletedProcess[str]:
    e = dict(os.environ)
    e["PATH"] = f"{bindir}{os.pathsep}/usr/bin{os.pathsep}/bin"
    e["PYTHONPATH"] = f"{site}{os.pathsep}{ROOT / 'pyctl'}"
    e.update(env)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *tests],
        cwd=ROOT,
        env=e,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_visible_gpus_reads_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_nvidia_smi(tmp_path / "bin")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert visible_gpus(proc=str(tmp_path / "no-proc")) == GpuListing("nvidia-smi -L", [GPU_LINE])


def test_visible_gpus_falls_back_to_the_driver_proc_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_nvidia_smi(tmp_path / "bin", lists=False)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    proc = tmp_path / "gpus"
    (proc / "0000:41:00.0").mkdir(parents=True)
    assert visible_gpus(proc=str(proc)) == GpuListing(str(proc), ["0000:41:00.0"])


def test_no_gpu_visible(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_nvidia_smi(tmp_path / "bin", lists=False)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert visible_gpus(proc=str(tmp_path / "no-proc")) == GpuListing("", [])
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert visible_gpus(proc=str(tmp_path / "no-proc")) == GpuListing("", [])


def test_gpu_listed_but_cuda_python_missing_fails(tmp_path: Path) -> None:
    fake_nvidia_smi(tmp_path / "bin")
    hide_cuda(tmp_path / "site")
    r = run_suite(tmp_path, tmp_path / "bin", tmp_path / "site", "tests/gpu/test_cuda.py", "-k", "host_pointers")
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "1 error" in out and "skipped" not in out, out
    assert (
        f"nvidia-smi -L lists 1 GPU ({GPU_LINE}) but CUDA cannot initialise: "
        "cuda-python is not installed: pip install 'gpupin[cuda]'" in out
    ), out


def test_gpu_listed_but_cuinit_failing_fails(tmp_path: Path) -> None:
    fake_nvidia_smi(tmp_path / "bin")
    fake_cuda(tmp_path / "site")
    r = run_suite(
        tmp_path,
        tmp_path / "bin",
        tmp_path / "site",
        "tests/gpu/test_cuda.py",
        "-k",
        "host_pointers",
        FAKE_CUINIT="CUDA_ERROR_NO_DEVICE",
    )
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert (
        "but CUDA cannot initialise: the CUDA driver is not usable here: cuInit returned CUDA_ERROR_NO_DEVICE; "
        "'gpupin doctor' says more" in out
    ), out


def test_gpu_listed_but_cufile_open_failing_fails(tmp_path: Path) -> None:
    """CUDA comes up (the fake); cuFile is installed but cuFileDriverOpen fails: a failure."""
    fake_nvidia_smi(tmp_path / "bin")
    fake_cuda(tmp_path / "site", cufile=True)
    r = run_suite(tmp_path, tmp_path / "bin", tmp_path / "site", "tests/gpu/test_gds.py", "-k", "registered_once")
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "but cuFile cannot open: cuFileDriverOpen failed: CU_FILE_DRIVER_NOT_INITIALIZED (5030)" in out, out


def test_cufile_not_installed_skips(tmp_path: Path) -> None:
    """cuFile is optional (the gds extra): not installed, its tests skip, saying how to install it."""
    fake_nvidia_smi(tmp_path / "bin")
    fake_cuda(tmp_path / "site")
    r = run_suite(tmp_path, tmp_path / "bin", tmp_path / "site", "tests/gpu/test_gds.py", "-k", "registered_once")
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "1 skipped" in out, out
    assert "cuFile is not installed (pip install 'gpupin[gds]')" in out, out


@pytest.mark.skipif(os.path.isdir("/proc/driver/nvidia/gpus"), reason="this host's NVIDIA driver lists GPUs")
def test_no_gpu_visible_skips(tmp_path: Path) -> None:
    fake_nvidia_smi(tmp_path / "bin", lists=False)
    hide_cuda(tmp_path / "site")
    r = run_suite(tmp_path, tmp_path / "bin", tmp_path / "site", "tests/gpu/test_cuda.py", "-k", "host_pointers")
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "1 skipped" in out, out
    assert "no NVIDIA GPU on this host" in out, out
