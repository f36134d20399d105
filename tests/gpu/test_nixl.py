"""gpupin.nixl over NIXL's UCX backend with GPU memory (VRAM), two processes, one agent each.

The scenarios are the host suite's (tests/nixl_target.py); here the memory is cuMemAlloc'd,
the registrations are NIXL's VRAM ones, and the freed-target write is the silent loss
measured on an H200 without gpupin (DONE, and the new buffer never got the data).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("nixl_cu13", reason="NIXL is not installed: pip install --no-deps nixl-cu13")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nixl_target import (  # noqa: E402
    MiB,
    RemoteBufferOf,
    Target,
    deregistered_through_nixl,
    scenario_churn,
    scenario_freed_target,
)

import gpupin  # noqa: E402
from gpupin.nixl import NixlEndpoint, NixlError, StaleRemote  # noqa: E402

pytestmark = pytest.mark.timeout(600)
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


@pytest.fixture
def target(cuda: Any) -> Iterator[Target]:
    t = Target("cuda")
    yield t
    if t.proc.poll() is None:
        t.kill()


@pytest.fixture
def ep(cuda: Any, target: Target) -> Iterator[NixlEndpoint]:
    e = NixlEndpoint("initiator", cuda, mem_type="VRAM")
    e.connect(target.metadata)
    target.call("connect", e.metadata())
    yield e
    e.close()


def test_churn_every_byte_lands_where_named(ep: NixlEndpoint, cuda: Any, target: Target) -> None:
    out = scenario_churn(ep, cuda, target, rounds=60, target_churn=False)
    print(f"nixl churn on the GPU: {out}")
    assert out["registrations"] < out["rounds"]
    x = cuda.alloc(MiB)
    rb = RemoteBufferOf(target, target.call("alloc", MiB), MiB)
    ep.write(x, 4096, rb)
    assert not deregistered_through_nixl(ep, x, 4096, rb)  # the check can tell
    agent = ep.agent  # close() retires the endpoint's agent; this reference keeps it for the check
    ep.close()
    assert ep.driver.live == 0 and deregistered_through_nixl(ep, x, 4096, rb, agent)
    assert target.close() == 0
    cuda.free(x)


def test_without_the_check_a_write_into_a_freed_buffer_is_lost(ep: NixlEndpoint, cuda: Any, target: Target) -> None:
    """The hazard itself, with gpupin's check switched off (confirm=False): NIXL says DONE and
    the target's new buffer does not hold the data."""
    dst = target.call("alloc", MiB)
    for _ in range(8):  # cuMemAlloc hands a freed address back, mostly at once
        target.call("fill", dst, MiB, 0)
        rb = RemoteBufferOf(target, dst, MiB)
        src = cuda.alloc(MiB)
        cuda.write(src, b"\x5a" * MiB)
        ep.write(src, MiB, rb)
        target.call("free", dst)
        again = target.call("alloc", MiB)
        if again == dst:
            break
        dst = again
        cuda.free(src)
    else:
        pytest.fail("cuMemAlloc never handed the freed address back")
    target.call("fill", dst, MiB, 0)
    cuda.write(src, b"\xa5" * MiB)
    ep.write(src, MiB, rb, confirm=False)  # NIXL: DONE
    got = target.call("read", dst, MiB)
    landed = got.count(0xA5)
    print(f"without the check: NIXL said DONE, the new buffer holds {landed} of {MiB} bytes")
    assert landed < MiB, "this NIXL delivered into the new buffer: the hazard is gone here"
    target.call("free", dst)
    cuda.free(src)


def test_with_the_check_it_is_never_reported_done(ep: NixlEndpoint, cuda: Any, target: Target) -> None:
    outcome = scenario_freed_target(ep, cuda, target)
    print(f"with gpupin's check: {outcome}")
    assert outcome.split(",")[0] in ("stale", "delivered")


def test_bad_ranges_host_memory_and_a_gone_remote(ep: NixlEndpoint, cuda: Any, target: Target) -> None:
    a = cuda.alloc(MiB)
    b = cuda.alloc(MiB)
    rb = RemoteBufferOf(target, target.call("alloc", 4 * MiB), 4 * MiB)
    with pytest.raises(gpupin.InvalidArgument, match="runs past its allocation"):
        ep.write(a + MiB - 4096, 8192, rb)  # spans two allocations
    import ctypes

    host = ctypes.create_string_buffer(MiB)
    with pytest.raises(gpupin.NotGpuMemory):
        ep.write(ctypes.addressof(host), 4096, rb)  # host memory passed as VRAM
    assert ep.driver.live == 0
    ep.write(a, 4096, rb)
    target.kill()
    with pytest.raises(NixlError) as ei:
        ep.write(a, 4096, rb, timeout=10)
    assert not isinstance(ei.value, StaleRemote)
    assert ep.cache.held() == 0
    ep.close()
    assert ep.driver.live == 0
    cuda.free(a)
    cuda.free(b)
