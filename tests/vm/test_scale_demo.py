"""The VM benchmark and the demo, run small: they are programs users run, so they are tested.

``vmscale`` (``gpupin bench --only-vm``) reports facts besides its times: a dump racing unpins
lists no pin twice and misses no live one, the per-file limit says ENOSPC with what to do, the
event queue overflows into one record while every validity word stays right.  Those are
asserted here at 2,000 pins; the times are not (they live in ``make bench``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

from conftest import SLOW
from gpupin.tools import bench, vmscale

pytestmark = [
    pytest.mark.vm,
    pytest.mark.simonly(reason="sets the simulator's BAR size and pin latency, and the demo runs on the simulator"),
]

PINS = 2000
SLOTS = 256


def test_vm_scale_figures_at_2000_pins(leakcheck: None, sim_params: Any) -> None:
    # vmscale sets these for speed; the fixture puts the old values back after the test.
    sim_params(pin_latency_us=0, bar_size=64 << 30)
    res = vmscale.run(total=PINS, reps=3, flood_slots=SLOTS, huge=1, callback_bytes=64 << 20)
    assert res["vm_scale_pins"] == PINS
    # GET_PINS listed exactly this process's pins, and a dump racing unpins stayed consistent.
    assert res["vm_dump_pins"] == PINS and res["vm_dump_complete"] is True
    assert res["vm_dump_race_pins"] == PINS
    assert res["vm_dump_race_duplicates"] == 0
    assert res["vm_dump_race_missing_live"] == 0
    assert res["vm_dump_race_unknown"] == 0
    assert 0 <= res["vm_dump_race_unpinned_seen"] <= PINS // 2
    # The per-file limit: a typed error naming the errno and the knob to turn.
    said = res["vm_per_file_limit_error"]
    assert said.startswith("BudgetExceeded (ENOSPC)") and "max_pins_per_file" in said, said
    # The validity map holds a word per slot: at least one per live pin.
    assert res["vm_validity_map_bytes"] >= PINS * 8
    # Flood: more invalidations than slots; the queue keeps what fits plus one overflow record.
    assert res["vm_flood_invalidations"] == PINS and res["vm_flood_slots"] == SLOTS
    assert res["vm_flood_overflow_first"] is True
    assert res["vm_flood_events_read"] <= SLOTS + 1
    assert res["vm_flood_words_right"] == PINS
    assert res["vm_burst_pins"] == PINS and res["vm_1g_pins"] == 1
    assert isinstance(res["vm_slab_bytes_per_1g_pin"], float), res["vm_slab_bytes_per_1g_pin"]
    # The free callback unmapped 16 own mappings of 1,024 pages; both frees were timed.
    assert res["vm_callback_unmapped_pages"] == 16 * 1024, res
    assert res["vm_callback_free_ms"] > 0 and res["vm_callback_free_mapped_ms"] > 0, res
    assert isinstance(res["vm_callback_bound_80gib_16_maps_s"], float), res
    for key in (
        "vm_pin_unpin_many_over_100",
        "vm_query_many_over_100",
        "vm_pin_unpin_64files_over_100",
        "vm_dump_us_per_pin",
        "vm_unpin_all_us_per_pin",
    ):
        assert isinstance(res[key], float) and res[key] > 0, (key, res[key])


def test_real_ioctl_figures_and_table(leakcheck: None, sim_params: Any) -> None:
    sim_params(pin_latency_us=0, bar_size=2 << 30)
    res = bench.bench_vm(3)
    assert isinstance(res["vm_pin_unpin_64k_us"], float) and res["vm_pin_unpin_64k_us"] > 0
    # 1 GiB fits the guest; if it did not, the figure says why instead of a number.
    assert isinstance(res["vm_pin_unpin_1g_us"], (float, str))
    res["targets"] = {}
    table = bench.format_table(res)
    assert table.splitlines()[0].split() == ["figure", "value"]
    assert any(line.startswith("vm_pin_unpin_64k_us") for line in table.splitlines())


def test_sim_buffer_id_hit_beside_its_floor(leakcheck: None, sim_params: Any) -> None:
    """The VM part of make bench measures SimMemory's buffer-id hit, its floor (the query in a
    C loop), the query from Python and the Python fallback's hit in one run, and leaves no pin
    and no allocation behind (leakcheck)."""
    sim_params(pin_latency_us=0)
    res = bench.bench_sim_hit(3, 500)
    for key in (
        "sim_hit_buffer_id_ns",
        "sim_hit_buffer_id_py_ns",
        "sim_buffer_id_query_floor_ns",
        "sim_buffer_id_query_ns",
        "sim_dict_lookup_ns",
    ):
        assert isinstance(res[key], float) and res[key] > 0, (key, res[key])
    assert res["sim_buffer_id_hit_over_floor"] == res["sim_hit_buffer_id_ns"] / res["sim_buffer_id_query_floor_ns"]
    assert "sim_buffer_id_hit_over_floor" in bench.TARGETS


def test_demo_runs_end_to_end() -> None:
    """``make demo``'s program, in the guest where the suite already loaded the modules."""
    r = subprocess.run(
        [sys.executable, "-m", "gpupin.tools.demo"],
        capture_output=True,
        text=True,
        timeout=300 * SLOW,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    for step in (
        "== 1. Load",
        "== 2. Pin",
        "== 3. Free",
        "== 4. The registration cache",
        "== 5. A third-party",
        "== 6. Clean up",
    ):
        assert step in out, step
    assert "valid now: False; state: invalidated" in out, out
    assert "invalidation record: handle" in out and "reason freed" in out, out
    assert "1000 transfers over 4 buffers: 4 pins, 996 hits, 4 misses" in out, out
    assert "b'bytes the peer device reads by DMA'" in out, out
    assert "everything released; simulator counters: all zero" in out, out
