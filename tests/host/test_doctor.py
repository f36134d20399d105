"""doctor's readers on synthetic /proc and /sys data."""

from __future__ import annotations

from pathlib import Path

from gpupin import doctor


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
