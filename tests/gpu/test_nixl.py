"""gpupin.nixl over NIXL's UCX backend with GPU memory (VRAM), two processes, one agent each.

The scenarios are the host suite's (tests/nixl_target.py); here the memory is cuMemAlloc'd,
the registrations are NIXL's VRAM ones, and the freed-target write is the silent loss
measured on an H200 through NIXL alone (DONE, and the new buffer never got the data), which
gpupin's leases prevent.
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
    scenario_prepared,
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
    e = NixlEndpoint("initiator", cuda, mem_type="VRAM", auto_progress=True)
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


def test_raw_nixl_loses_a_write_into_a_freed_buffer(cuda: Any) -> None:
    """The hazard itself, through NIXL's own calls (what gpupin's leases stand between): the
    target frees the buffer behind NIXL and allocates again at its address; a write through
    the descriptor NIXL still has reports DONE and the new buffer does not hold the data.
    In a process of its own (raw_nixl_hazard.py): on an H200 such a write once crashed the
    process that made it (SIGSEGV in nixl_agent.transfer), the same hazard at its worst."""
    import json
    import subprocess

    r = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("raw_nixl_hazard.py"))],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if r.returncode < 0:
        print(f"raw NIXL: the writing process died of signal {-r.returncode} (the hazard, at its worst)")
        return
    assert r.returncode == 0, f"raw_nixl_hazard.py exited {r.returncode}: {r.stderr[-3000:]}"
    out = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"raw NIXL: {out['state']}, the new buffer holds {out['landed']} of {MiB} bytes")
    assert out["state"] == "DONE" and out["landed"] < MiB, "this NIXL delivered into the new buffer: the hazard is gone"


def test_a_write_into_a_freed_buffer_is_prevented(ep: NixlEndpoint, cuda: Any, target: Target) -> None:
    assert scenario_freed_target(ep, cuda, target) == "refused"


def test_a_prepared_write_lands_while_what_it_names_changes(ep: NixlEndpoint, cuda: Any, target: Target) -> None:
    out = scenario_prepared(ep, cuda, target)
    print(f"nixl prepared on the GPU: {out}")
    assert out["lists_prepped"] == 3 + out["local_again"]


def test_a_smaller_buffer_at_the_same_base_gets_the_bytes(ep: NixlEndpoint, cuda: Any, target: Target) -> None:
    """Measured on an H100 before the initiator renewed its view of a peer that dropped a
    registration: a write into a new, smaller buffer at the old base reported done, 0 bytes
    there (NIXL routed it through the old registration's descriptor)."""
    src = cuda.alloc(MiB)
    for _ in range(8):
        a = target.call("alloc", MiB)
        ra = RemoteBufferOf(target, a, MiB)
        ep.write(src, MiB, ra)
        target.call("unexpose", ra.to_bytes())
        target.call("free", a)
        b = target.call("alloc", MiB // 2)
        if b == a:
            break
        target.call("free", b)
    else:
        pytest.skip("cuMemAlloc never put a smaller buffer at a freed base here")
    target.call("fill", b, MiB // 2, 0)
    rb = RemoteBufferOf(target, b, MiB // 2)
    cuda.write(src, b"\xa5" * MiB)
    ep.write(src, MiB // 2, rb, confirm=True)
    landed = target.call("read", b, MiB // 2).count(0xA5)
    assert landed == MiB // 2, f"the write reported done, the new buffer holds {landed} of {MiB // 2} bytes"
    target.call("unexpose", rb.to_bytes())
    target.call("free", b)
    cuda.free(src)


def test_a_free_behind_the_providers_back_is_detected(ep: NixlEndpoint, cuda: Any, target: Target) -> None:
    import time

    dst = target.call("alloc", MiB)
    rb = RemoteBufferOf(target, dst, MiB)
    src = cuda.alloc(MiB)
    ep.write(src, 4096, rb)
    target.call("free_behind", dst)  # cuMemFree itself: the provider's hold cannot see it
    target.call("alloc", MiB)
    deadline = time.monotonic() + 10
    while target.call("stats")["stale_exposures"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert target.call("stats")["stale_exposures"] == 1
    deadline = time.monotonic() + 10
    while ep._leases and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(StaleRemote):
        ep.write(src, 4096, rb)
    cuda.free(src)


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
