"""The GPU benchmarks run small: they are programs users run, so they are tested.

Counts are asserted (the cache registers each buffer once; the buffer-id queries answer), never
times: those live in ``make bench`` (a shared machine is noisy).
"""

from __future__ import annotations

import random

from conftest import open_cufile
from gpupin.tools import bench


def test_cuda_bench_answers_every_figure(cuda) -> None:  # type: ignore[no-untyped-def]
    res = bench.bench_cuda(reps=2, n=300)
    assert res["cuda_direct_available"] is True
    assert res["direct_binding"] in ("vectorcall", "cffi")
    for key in (
        "cuda_python_buffer_id_query_ns",
        "direct_buffer_id_query_ns",
        "direct_buffer_id_query_cffi_ns",
        "direct_buffer_id_query_wrapped_ns",
        "cuda_dict_lookup_ns",
        "cuda_hit_buffer_id_ns",
        "cuda_hit_both_ns",
        "direct_over_cuda_python",
        "cuda_buffer_id_hit_over_direct_query",
        "cuda_buffer_id_query_floor_ns",
        "cuda_buffer_id_hit_over_floor",
    ):
        assert isinstance(res[key], float) and res[key] > 0, (key, res[key])


def test_gds_bench_registers_each_buffer_once(cuda) -> None:  # type: ignore[no-untyped-def]
    open_cufile().close()  # skips where cuFile is not installed, fails where it cannot open
    ios, buffers = 200, 8
    res = bench.bench_gds(ios=ios, buffers=buffers, reps=2, n=300)
    # The trace the benchmark drew (the same generator, seeded alike, drawn first).
    used = len(set(bench.zipf_trace(ios, buffers, 1.1, random.Random(1))))
    assert res["gds_pattern1_registrations"] == ios
    assert res["gds_cache_registrations"] == used
    assert res["gds_registration_reduction"] == ios / used
    if not res["gds_reads"]:
        assert res["gds_reads_skipped"], res  # says why cuFile would not read the file
    for key in ("gds_pattern1_s", "gds_cache_s", "gds_hit_ns", "gds_hit_release_ns", "gds_direct_buffer_id_query_ns"):
        assert isinstance(res[key], float) and res[key] > 0, (key, res[key])
    assert isinstance(res["gds_cufile_version"], int) and res["gds_cufile_version"] > 0
