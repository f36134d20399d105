"""doctor's readers on synthetic /proc and /sys data."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from gpupin.tools import doctor


def test_iommu(tmp_path: Path) -> None:
    units = tmp_path / "iommu"
    units.mkdir()
    assert doctor.check_iommu("quiet", str(units)).status == "pass"
    (units / "dmar0").mkdir()
    c = doctor.check_iommu("quiet intel_iommu=on", str(units))
    assert c.status == "warn" and "iommu=pt" in c.fix
    assert doctor.check_iommu("intel_iommu=on iommu=pt", str(units)).status == "pass"


def config_with_acs(ctrl: int) -> bytes:
    cfg = bytearray(4096)
    # AER at 0x100 pointing to ACS at 0x140
    cfg[0x100:0x104] = (0x0001 | (1 << 16) | (0x140 << 20)).to_bytes(4, "little")
    cfg[0x140:0x144] = (0x000D | (1 << 16) | (0 << 20)).to_bytes(4, "little")
    cfg[0x146:0x148] = ctrl.to_bytes(2, "little")
    return bytes(cfg)


def test_acs_parse() -> None:
    assert doctor.acs_control(config_with_acs(0x1D)) == 0x1D
    assert doctor.acs_control(bytes(4096)) is None
    assert doctor.acs_control(bytes(256)) is None


def fake_dev(root: Path, name: str, cls: str, vendor: str = "0x8086", config: bytes = b"") -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "class").write_text(cls + "\n")
    (d / "vendor").write_text(vendor + "\n")
    (d / "config").write_bytes(config or bytes(64))
    return d


def test_acs_on_bridges(tmp_path: Path) -> None:
    fake_dev(tmp_path, "0000:00:01.0", "0x060400", config=config_with_acs(0x0C))
    c = doctor.check_acs(tmp_path)
    assert c.status == "warn" and "P2P request redirect" in c.detail and "0000:00:01.0" in c.detail
    fake_dev(tmp_path / "b", "0000:00:01.0", "0x060400", config=config_with_acs(0x01))
    assert doctor.check_acs(tmp_path / "b").status == "pass"


def test_topology(tmp_path: Path) -> None:
    # host bridge pci0000:00 -> switch port 00:01.0 -> GPU 01:00.0 and NIC 01:00.1 ; NIC2 on pci0000:80
    sw = tmp_path / "devices" / "pci0000:00" / "0000:00:01.0"
    gpu = fake_dev(sw, "0000:01:00.0", "0x030200", "0x10de")
    nic = fake_dev(sw, "0000:01:00.1", "0x020000")
    nic2 = fake_dev(tmp_path / "devices" / "pci0000:80", "0000:80:00.0", "0x020000")
    nic3 = fake_dev(tmp_path / "devices" / "pci0000:00", "0000:00:02.0", "0x020000")
    assert doctor.topology(gpu, nic).startswith("same PCIe switch")
    assert doctor.topology(gpu, nic2).startswith("across root complexes")
    assert doctor.topology(gpu, nic3).startswith("same root complex")
    bus = tmp_path / "bus"
    bus.mkdir()
    for d in (gpu, nic2):
        (bus / d.name).symlink_to(d)
    checks = doctor.check_topology(bus)
    assert len(checks) == 1 and checks[0].status == "warn"


def test_modules(tmp_path: Path) -> None:
    (tmp_path / "nvidia").mkdir()
    (tmp_path / "nv_peer_mem").mkdir()
    (tmp_path / "nvidia_peermem").mkdir()
    checks = {c.name: c for c in doctor.check_modules(str(tmp_path))}
    assert checks["nvidia"].status == "pass"
    assert checks["nv_peer_mem"].status == "fail"
    assert checks["gpupin"].status == "warn"
    # nvidia_peermem pins through nv-p2p too: gpupin's non-persistent pins can meet its puts.
    assert checks["nv-p2p neighbours"].status == "warn" and "nvidia_peermem" in checks["nv-p2p neighbours"].detail
    assert "default_persistent" in checks["nv-p2p neighbours"].fix
    (tmp_path / "gpupin" / "parameters").mkdir(parents=True)
    (tmp_path / "gpupin" / "parameters" / "default_persistent").write_text("Y\n")
    checks = {c.name: c for c in doctor.check_modules(str(tmp_path))}
    assert checks["nv-p2p neighbours"].status == "pass"
    assert doctor.check_nv_p2p_neighbours(str(tmp_path / "nowhere")) is None  # none loaded: no line


def test_gds_nvidia_fs_and_cufile_json(tmp_path: Path) -> None:
    (tmp_path / "nvidia_fs").mkdir()
    (tmp_path / "nvidia_fs" / "version").write_text("2.20.5\n")
    c = doctor.check_nvidia_fs(str(tmp_path))
    assert c.status == "pass" and "2.20.5" in c.detail
    c = doctor.check_nvidia_fs(str(tmp_path / "none"))
    assert c.status == "info" and "compatibility mode" in c.detail and "nvidia-gds" in c.fix
    cfg = tmp_path / "cufile.json"
    cfg.write_text(
        '{\n  // comment\n  "logging": {"dir": "http://not-a-comment"},\n'
        '  "properties": {"max_device_pinned_mem_size_kb": 33554432, // trailing\n'
        '                 "allow_compat_mode": true, "use_pci_p2pdma": false,},\n}\n'
    )
    (c,) = doctor.check_cufile_json(str(cfg))
    assert c.status == "pass"
    assert "max_device_pinned_mem_size_kb=33554432" in c.detail and "use_pci_p2pdma=False" in c.detail
    cfg.write_text('{"properties": {"allow_compat_mode": false}}')
    checks = doctor.check_cufile_json(str(cfg))
    if not Path("/sys/module/nvidia_fs").is_dir():
        assert checks[-1].status == "fail" and "allow_compat_mode" in checks[-1].fix
    cfg.write_text('{"properties": ')
    (c,) = doctor.check_cufile_json(str(cfg))
    assert c.status == "fail" and "cannot be read" in c.detail
    (c,) = doctor.check_cufile_json(str(tmp_path / "absent.json"))
    assert c.status == "info" and "CUFILE_ENV_PATH_JSON" in c.fix


def test_p2pdma_from_kernel_config() -> None:
    assert doctor.check_p2pdma("y").status == "pass"
    assert "nvidia-fs" in doctor.check_p2pdma("n").detail


def test_nvreg_from_params_and_modprobe(tmp_path: Path) -> None:
    params = tmp_path / "params"
    params.write_text('EnableStreamMemOPs: 0\nRegistryDwords: ""\n')
    peer, memops = doctor.check_nvreg(str(params), str(tmp_path))
    assert peer.status == "info" and "PeerMappingOverride=1" in peer.fix
    assert memops.status == "info" and "NVreg_EnableStreamMemOPs=1" in memops.fix
    params.write_text('EnableStreamMemOPs: 1\nRegistryDwords: "PeerMappingOverride=1;"\n')
    assert [c.status for c in doctor.check_nvreg(str(params), str(tmp_path))] == ["pass", "pass"]
    conf = tmp_path / "modprobe.d"
    conf.mkdir()
    (conf / "nv.conf").write_text(
        'options nvidia NVreg_RegistryDwords="PeerMappingOverride=1;" NVreg_EnableStreamMemOPs=1\n'
    )
    checks = doctor.check_nvreg(str(tmp_path / "no-params"), str(conf))
    assert [c.status for c in checks] == ["pass", "pass"] and str(conf) in checks[0].detail
    (c,) = doctor.check_nvreg(str(tmp_path / "no-params"), str(tmp_path / "empty"))
    assert c.status == "info" and "no NVIDIA driver parameters" in c.detail


def test_udev_entry_that_cufile_needs(tmp_path: Path) -> None:
    import os

    st = os.stat(tmp_path)
    udev = tmp_path / "udev"
    udev.mkdir()
    c = doctor.check_udev_for_gds(str(tmp_path), str(udev))
    if os.major(st.st_dev) == 0:
        assert c.status == "info" and "virtual file system" in c.detail
        return
    assert c.status == "warn" and "HANDLE_NOT_REGISTERED" in c.detail
    (udev / f"b{os.major(st.st_dev)}:{os.minor(st.st_dev)}").write_text("E:ID_FS_USAGE=filesystem\n")
    assert doctor.check_udev_for_gds(str(tmp_path), str(udev)).status == "pass"


def test_nixl_verdicts() -> None:
    """check_nixl on probe results: missing (warn, install), UCX not loading (fail), VRAM (warn
    with why and a fix for each reason), the self-test (pass or fail), other backends (info)."""
    from gpupin.nixl import INSTALL, NixlStatus, PluginStatus

    missing = NixlStatus(False, error=f"NIXL is not installed for this Python (nixl_cu13: gone): {INSTALL} (...)")
    (c,) = doctor.check_nixl(missing)
    assert c.status == "warn" and c.detail == "NIXL is not installed for this Python (nixl_cu13: gone)"
    assert c.fix.startswith(INSTALL)

    def status(ucx: PluginStatus, **kw: Any) -> NixlStatus:
        return NixlStatus(True, "1.5.1", "nixl_cu13", "/site/nixl_cu13", plugins=[ucx, posix, gds], **kw)

    posix, gds = PluginStatus("POSIX", True, ["DRAM_SEG"]), PluginStatus("GDS", False, [], "needs libcufile.so.0")
    broken = status(PluginStatus("UCX", False, [], "NIXL_ERR_BACKEND (no transports)"))
    assert [(c.status, c.name) for c in doctor.check_nixl(broken)] == [("pass", "NIXL"), ("fail", "NIXL UCX")]
    assert "no transports" in doctor.check_nixl(broken)[1].detail
    ucx = PluginStatus("UCX", True, ["DRAM_SEG", "VRAM_SEG"])
    good = status(ucx, vram=True, vram_detail="UCX lists VRAM_SEG; CUDA driver 13.0, 1 device(s)", selftest=True)
    checks = {c.name: c for c in doctor.check_nixl(good)}
    assert [c.status for c in checks.values()] == ["pass", "pass", "pass", "pass", "info"]
    assert "1.5.1" in checks["NIXL"].detail and "others that load: POSIX; 1 do not" in checks["NIXL backends"].detail
    for why, fix in (
        ("UCX lists VRAM_SEG; no CUDA driver here (libcuda.so.1 not found)", "NVIDIA GPU"),
        ("UCX lists VRAM_SEG; CUDA driver 13.0, 1 device(s), but cuda-python is not installed", "gpupin[cuda]"),
    ):
        checks = {c.name: c for c in doctor.check_nixl(status(ucx, vram_detail=why, selftest=False))}
        assert checks["NIXL VRAM"].status == "warn" and why in checks["NIXL VRAM"].detail
        assert fix in checks["NIXL VRAM"].fix
        assert checks["NIXL self-test"].status == "fail" and "--log" in checks["NIXL self-test"].fix
    checks = {c.name: c for c in doctor.check_nixl(status(PluginStatus("UCX", True, ["DRAM_SEG"]), vram_detail="x"))}
    assert "built with CUDA" in checks["NIXL VRAM"].fix and "NIXL self-test" not in checks  # it did not run
    (c,) = doctor.check_nixl(NixlStatus(True, "1.5.1", "nixl_cu13", "/x", error="no NIXL agent could be made"))
    assert c.status == "fail" and "reinstall" in c.fix


class FakeNvmlError(Exception):
    """pynvml.NVMLError: ``value`` is NVML's return code."""

    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


def fake_pynvml(bars: list[tuple[int, int] | None], init_error: int = 0) -> types.ModuleType:
    """The pynvml calls check_bar1 makes, answering with ``bars`` ((used, total) bytes per GPU,
    None where the query fails); ``init_error``: nvmlInit raises that return code."""
    m = types.ModuleType("pynvml")
    m.NVMLError = FakeNvmlError  # type: ignore[attr-defined]
    m.NVML_ERROR_LIBRARY_NOT_FOUND = 12  # type: ignore[attr-defined]
    m.shutdowns = 0  # type: ignore[attr-defined]

    def init() -> None:
        if init_error:
            raise FakeNvmlError(init_error)

    def shutdown() -> None:
        m.shutdowns += 1  # type: ignore[attr-defined]

    def bar1(i: int) -> Any:
        if bars[i] is None:
            raise FakeNvmlError(999)
        used, total = bars[i]  # type: ignore[misc]
        return types.SimpleNamespace(bar1Total=total, bar1Used=used, bar1Free=total - used)

    m.nvmlInit = init  # type: ignore[attr-defined]
    m.nvmlShutdown = shutdown  # type: ignore[attr-defined]
    m.nvmlDeviceGetCount = lambda: len(bars)  # type: ignore[attr-defined]
    m.nvmlDeviceGetHandleByIndex = lambda i: i  # type: ignore[attr-defined]
    m.nvmlDeviceGetBAR1MemoryInfo = bar1  # type: ignore[attr-defined]
    return m


def test_fake_pynvml_is_nvidia_ml_py_shaped() -> None:
    """What the fake below offers, nvidia-ml-py has (where it is installed): the same names,
    the library-not-found code, the BAR1 structure's fields."""
    if importlib.util.find_spec("pynvml") is None:
        pytest.skip("nvidia-ml-py is not installed here (pip install 'gpupin[nvml]')")
    import pynvml

    fake = fake_pynvml([])
    names = [n for n in vars(fake) if n.startswith(("nvml", "NVML"))]
    assert not [n for n in names if not hasattr(pynvml, n)], names
    assert pynvml.NVML_ERROR_LIBRARY_NOT_FOUND == fake.NVML_ERROR_LIBRARY_NOT_FOUND
    assert {"bar1Total", "bar1Used", "bar1Free"} <= {f[0] for f in pynvml.c_nvmlBAR1Memory_t._fields_}
    # And the real one, on this host: a row per GPU, or why there is none; never a failure.
    assert all(c.name == "BAR1" and c.status != "fail" for c in doctor.check_bar1())


def test_bar1_per_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    MiB = 1 << 20
    nvml = fake_pynvml([(10 * MiB, 256 * MiB), (250 * MiB, 256 * MiB), None])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    a, b, c = doctor.check_bar1()
    assert (a.status, a.detail, a.fix) == ("pass", "GPU 0: 10 MiB used of 256 MiB", "")
    assert (b.status, b.detail) == ("warn", "GPU 1: 250 MiB used of 256 MiB") and "unpin" in b.fix
    assert (c.status, c.detail) == ("warn", "GPU 2: BAR1 info unavailable")
    assert nvml.shutdowns == 1  # type: ignore[attr-defined]


def test_bar1_without_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    """No nvidia-ml-py: the row says what to install, and is no failure; no libnvidia-ml, or
    nvmlInit failing, as before."""
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    (c,) = doctor.check_bar1()
    assert c.status == "info" and "nvidia-ml-py" in c.detail and "gpupin[nvml]" in c.fix
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([], init_error=12))
    assert doctor.check_bar1() == [doctor.Check("info", "BAR1", "NVML not present: cannot read BAR1 usage")]
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([], init_error=9))
    (c,) = doctor.check_bar1()
    assert c.status == "warn" and c.detail.startswith("NVML present but nvmlInit failed")


def test_budget_says_which_limits_are_in_force(tmp_path: Path) -> None:
    assert [c.detail for c in doctor.check_budget(tmp_path / "absent")] == [
        "gpupin.ko is not loaded: its limits are its parameters once it is"
    ]
    params = tmp_path / "parameters"
    params.mkdir()
    for name, value in (("dmem", "N"), ("max_pinned_bytes", str(1 << 30)), ("max_file_pinned_bytes", "0")):
        (params / name).write_text(value + "\n")
    checks = doctor.check_budget(params)
    assert {c.status for c in checks} == {"info"} and {c.name for c in checks} == {"budget"}
    assert [c.detail for c in checks] == [
        "module-wide: 1.0 GiB (max_pinned_bytes; ENOSPC past it)",
        "per process: no dmem controller here (6.14+ with CONFIG_CGROUP_DMEM has one); "
        "no per-file limit (max_file_pinned_bytes=0)",
    ]
