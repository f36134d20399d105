"""The cffi view of the UAPI matches the C compiler's, struct by struct and ioctl by ioctl."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from gpupin import _build
from gpupin._native import ffi, lib

ROOT = Path(__file__).resolve().parents[2]
STRUCTS = _build.struct_names()


@pytest.fixture(scope="module")
def c_sizes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, int]:
    d = tmp_path_factory.mktemp("uapi")
    src = d / "sizes.c"
    body = "\n".join(f'printf("{s} %zu\\n", sizeof(struct {s}));' for s in STRUCTS)
    src.write_text(
        '#include <stdio.h>\n#include <linux/types.h>\n#include "gpupin.h"\n'
        f'#include "nvp2p_sim.h"\n#include "gpupin_peer.h"\nint main(void) {{ {body} return 0; }}\n'
    )
    exe = d / "sizes"
    subprocess.run(["cc", "-Wall", "-Werror", "-I", str(ROOT / "include/uapi"), "-o", str(exe), str(src)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return {k: int(v) for k, v in (line.split() for line in out.splitlines())}


def test_every_struct_is_declared() -> None:
    assert set(STRUCTS) >= {
        "gpupin_info",
        "gpupin_pin",
        "gpupin_unpin",
        "gpupin_query",
        "gpupin_get_pages",
        "gpupin_dma_map",
        "gpupin_dma_addrs",
        "gpupin_dma_unmap",
        "gpupin_event",
        "nvp2p_sim_alloc",
        "nvp2p_sim_stats",
    }


@pytest.mark.parametrize("name", STRUCTS)
def test_sizeof_matches_c(name: str, c_sizes: dict[str, int]) -> None:
    assert ffi.sizeof(f"struct {name}") == c_sizes[name]
    assert c_sizes[name] % 8 == 0, "UAPI structs are padded to 8 bytes"


IOCTLS = {
    "GPUPIN_IOC_INFO": ("gpupin_info", 3),
    "GPUPIN_IOC_PIN": ("gpupin_pin", 3),
    "GPUPIN_IOC_UNPIN": ("gpupin_unpin", 1),
    "GPUPIN_IOC_QUERY": ("gpupin_query", 3),
    "GPUPIN_IOC_GET_PAGES": ("gpupin_get_pages", 1),
    "GPUPIN_IOC_DMA_MAP": ("gpupin_dma_map", 3),
    "GPUPIN_IOC_DMA_ADDRS": ("gpupin_dma_addrs", 1),
    "GPUPIN_IOC_DMA_UNMAP": ("gpupin_dma_unmap", 1),
    "NVP2P_SIM_IOC_ALLOC": ("nvp2p_sim_alloc", 3),
    "NVP2P_SIM_IOC_STATS": ("nvp2p_sim_stats", 2),
    "GPUPIN_IOC_PIN_DMABUF": ("gpupin_pin_dmabuf", 3),
    "NVP2P_SIM_IOC_EXPORT": ("nvp2p_sim_export", 3),
    "GPUPIN_PEER_IOC_XFER": ("gpupin_peer_xfer", 3),
    "GPUPIN_PEER_IOC_HOLD": ("gpupin_peer_hold", 3),
    "GPUPIN_PEER_IOC_RELEASE": ("gpupin_peer_release", 1),
    "GPUPIN_PEER_IOC_STATUS": ("gpupin_peer_status", 2),
}
MAGICS = {
    "GPUPIN_PEER_IOC_": "GPUPIN_PEER_IOC_MAGIC",
    "GPUPIN_IOC_": "GPUPIN_IOC_MAGIC",
    "NVP2P_SIM_IOC_": "NVP2P_SIM_IOC_MAGIC",
}


@pytest.mark.parametrize("name", sorted(IOCTLS))
def test_ioctl_numbers_encode_the_struct(name: str) -> None:
    struct, direction = IOCTLS[name]
    nr = getattr(lib, name)
    assert (nr >> 16) & 0x3FFF == ffi.sizeof(f"struct {struct}"), "size field is the struct's, not a pointer's"
    assert nr >> 30 == direction
    magic = next(getattr(lib, m) for prefix, m in MAGICS.items() if name.startswith(prefix))
    assert (nr >> 8) & 0xFF == magic


def test_ioctl_numbers_are_distinct() -> None:
    nrs = [getattr(lib, n) & 0xFFFF for n in dir(lib) if n.startswith("GPUPIN_IOC_") and n != "GPUPIN_IOC_MAGIC"]
    assert len(nrs) == len(set(nrs)) == 9
