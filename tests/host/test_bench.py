"""`gpupin bench` on this host (FakeDevice), and the VM benchmark's netlink parsing."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time

import pytest

import gpupin
from gpupin._native import lib
from gpupin.tools import vmscale


def test_quick_bench_prints_json_and_progress(tmp_path: object) -> None:
    out = os.path.join(str(tmp_path), "bench.json")
    r = subprocess.run(
        [sys.executable, "-m", "gpupin", "bench", "--quick", "--json", "--out", out],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    with open(out) as f:
        assert json.load(f) == res
    # Every step said what it was doing, on stderr (stdout is the JSON alone).
    for step in ("hit path", "reuse trace", "scale", "pressure", "threads", "done in"):
        assert step in r.stderr, step
    for key in ("hit_kernel_ns", "dict_lookup_ns", "threads_16_hit_release_ns", "scale_hit_big_ns"):
        assert isinstance(res[key], float) and res[key] > 0, key
    # Caching pays on the trace whatever the machine's noise: pins, not times.
    assert res["trace_pins_cached"] == 64 and res["trace_pins_plain"] == res["trace_transfers"]
    assert res["pressure_failed_acquires"] == 0
    t = res["targets"]["trace_pin_reduction"]
    assert t["measured"] == res["trace_pin_reduction"] and t["met"] == (t["measured"] >= t["target"])
    # The trace's times come from FakeDevice's busy-wait per pin: named modelled wherever they appear.
    assert res["trace_pin_latency_modelled_us"] == 100.0
    assert "trace_speedup_modelled" in res["targets"] and "trace_speedup" not in res
    assert not [k for k in res if k.startswith(("trace_seconds", "trace_speedup")) and not k.endswith("_modelled")]
    assert "vm_pin_unpin_many_over_100" not in res  # the VM figures need the modules


@pytest.mark.timeout(300)
def test_quick_nixl_bench_times_the_endpoint_and_finds_no_stale_bytes(tmp_path: object) -> None:
    """--nixl --quick: the registration-cache figures and the endpoint's, from a target process;
    the churn trace churned, tried writes through descriptors taken back, and none delivered."""
    pytest.importorskip("nixl_cu13", reason="NIXL is not installed: run 'make setup' (pip install --no-deps nixl-cu13)")
    out = os.path.join(str(tmp_path), "nixl.json")
    r = subprocess.run(
        [sys.executable, "-m", "gpupin", "bench", "--nixl", "--quick", "--json", "--out", out],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)  # NIXL's log goes to stderr: stdout is the JSON alone
    with open(out) as f:
        assert json.load(f) == res
    for step in ("nixl cache", "nixl endpoint write 4k", "nixl endpoint scatter", "nixl endpoint churn trace"):
        assert step in r.stderr, step
    assert res["nixl_registration_reduction"] > 1  # the registration-cache figures are still there
    for label in ("4k", "64k", "1m", "4m"):
        ep, raw = res[f"nixl_ep_write_{label}_us"], res[f"nixl_raw_write_{label}_us"]
        assert isinstance(ep, float) and isinstance(raw, float) and ep > 0 and raw > 0, label
        assert res[f"nixl_ep_over_raw_{label}"] == pytest.approx(ep / raw)
        assert res["targets"][f"nixl_ep_over_raw_{label}"]["target"] == 1.2
    assert res["nixl_scatter_ep_gbps"] > 0 and res["nixl_scatter_raw_gbps"] > 0
    ratio = res["targets"]["nixl_scatter_ep_over_raw_throughput"]
    assert ratio["met"] == (ratio["measured"] >= 0.9)
    assert res["nixl_ep_write_confirm_4k_us"] > 0
    assert res["nixl_churn_false_deliveries"] == 0 and res["nixl_churn_stale_bytes"] == 0
    assert res["targets"]["nixl_churn_false_deliveries"]["met"] and res["targets"]["nixl_churn_stale_bytes"]["met"]
    # The trace did what it counts: churns (some with a write in flight), writes through
    # descriptors taken back (all refused), the new owners' memory searched.
    assert res["nixl_churn_churns"] > 0 and res["nixl_churn_churns_in_flight"] > 0
    assert res["nixl_churn_stale_attempts"] > 0
    assert res["nixl_churn_stale_refused"] == res["nixl_churn_stale_attempts"]
    assert res["nixl_churn_stale_bytes_checked"] > 0
    assert res["nixl_churn_target_stale_transfers"] == res["nixl_churn_target_live"] == 0


def _attr(atype: int, payload: bytes) -> bytes:
    raw = struct.pack("=HH", 4 + len(payload), atype) + payload
    return raw + b"\0" * (-len(raw) % 4)


def test_dump_parser_reads_nested_pin_attributes() -> None:
    """vmscale's raw GET_PINS parser on a message built by hand: pid, file id and handle
    from the nested GPUPIN_NL_A_PIN, other attributes skipped, padding honoured."""
    pin = (
        _attr(lib.GPUPIN_NL_PIN_A_PID, struct.pack("=I", 4242))
        + _attr(lib.GPUPIN_NL_PIN_A_PAD, b"")
        + _attr(lib.GPUPIN_NL_PIN_A_FILE_ID, struct.pack("=Q", 7))
        + _attr(lib.GPUPIN_NL_PIN_A_STATE, struct.pack("=I", 1))
        + _attr(lib.GPUPIN_NL_PIN_A_HANDLE, struct.pack("=Q", 1 << 40))
    )
    body = _attr(lib.GPUPIN_NL_A_PIN | 0x8000, pin)  # NLA_F_NESTED set, as the kernel may
    got = []
    for atype, p, n in vmscale._attrs(body, 0, len(body)):
        assert atype == lib.GPUPIN_NL_A_PIN
        got = [(t, body[q : q + m]) for t, q, m in vmscale._attrs(body, p, p + n)]
    types = [t for t, _ in got]
    assert types == [
        lib.GPUPIN_NL_PIN_A_PID,
        lib.GPUPIN_NL_PIN_A_PAD,
        lib.GPUPIN_NL_PIN_A_FILE_ID,
        lib.GPUPIN_NL_PIN_A_STATE,
        lib.GPUPIN_NL_PIN_A_HANDLE,
    ]
    assert struct.unpack("=Q", got[-1][1])[0] == 1 << 40


def test_the_floor_loop_calls_the_providers_query_and_refuses_failures() -> None:
    """The floor of a buffer-id hit is the provider's own C query (here FakeMemory's) called
    n times from C over the pointers in turn; a query that fails makes it raise, not report
    the cost of an error."""
    from gpupin.testing.fake import FakeMemory
    from gpupin.tools import bench

    mem = FakeMemory(direct_query=True)
    ptrs = [mem.alloc(1 << 20) for _ in range(3)]
    asked: list[int] = []
    real = mem._c_query

    def counting(ptr: int, out: object) -> int:
        asked.append(ptr)
        return real(ptr, out)

    mem._c_query = counting  # type: ignore[method-assign]
    bench.query_floor_loop(mem.c_buffer_id_query, mem.c_buffer_id_ctx, ptrs)(7)
    assert asked == [p + 64 for p in ptrs] * 2 + [ptrs[0] + 64]
    mem.free(ptrs[1])
    with pytest.raises(gpupin.GpupinError, match="failed 1 of 3 times"):
        bench.query_floor_loop(mem.c_buffer_id_query, mem.c_buffer_id_ctx, ptrs)(3)


def test_a_timing_batch_lasts_long_enough_and_no_longer_than_capped() -> None:
    from gpupin.tools.bench import batch_for

    ran: list[int] = []

    def slow(n: int) -> None:  # about 1 ms an operation
        ran.append(n)
        time.sleep(n * 0.001)

    n = batch_for(slow, 2, seconds=0.02)
    assert ran == [2] and 10 <= n <= 21  # ~20 operations of ~1 ms (sleeps only run long)
    assert batch_for(lambda n: None, 5, most=50) == 50  # an instant one: the cap
    assert batch_for(slow, 40, seconds=0.001) == 40  # already long enough: as asked


def test_interleaved_loops_take_turns_in_both_orders() -> None:
    from gpupin.tools.bench import interleaved_ns

    ran: list[str] = []
    got = interleaved_ns({"a": lambda n: ran.append("a"), "b": lambda n: ran.append("b")}, 10, 4)
    assert ran[2:] == ["a", "b", "b", "a", "a", "b", "b", "a"]  # after one warm-up each
    assert set(got) == {"a", "b"} and all(v > 0 for v in got.values())
