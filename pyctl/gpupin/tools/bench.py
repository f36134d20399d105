"""``gpupin bench``: what the registration cache costs and saves.

Figures are ratios measured in one run (these machines are shared and noisy):
- hit: median ns of a cache hit (``lookup``: find, validate, reference, in one
  call into C) for validate=kernel, buffer_id and both, against a bare Python dict
  lookup and a bare buffer-id query of the provider; also lookup + release_token and
  the convenient acquire() + release() through Registration objects;
- trace: 10,000 transfers over 64 buffers with Zipf reuse and 100 us pins,
  cache against pin-per-transfer (pins issued and wall time);
- scale: hit cost with 100,000 cached regions over hit cost with 100; purge()
  time per entry with 100,000 over 10,000 (it must not grow with the entries);
- pressure: 64 MiB of BAR, 256 MiB working set: failed acquires and evictions;
- threads: lookup + release_token hits from 1, 4 and 16 threads on one cache
  (aggregate time per hit; the GIL serialises Python, the cache's own lock
  must not make it worse);
- nixl (``--nixl``): NIXL registration per transfer, by hand and through NixlCache over one
  trace; then NixlEndpoint between this process and a target process (endpoint figures,
  ``bench_nixl_endpoint``): a blocking write against raw NIXL on the same agents at 4 KiB to
  4 MiB, a 64-block scatter write, a confirmed write, and a churn trace (the target frees and
  reallocates exposed buffers between writes: false deliveries and stale bytes, goal 0);
- budget (``--only-vm``, `make bench`'s VM part): the registration cache over gpupin.ko with
  a 16 MiB share (max_file_pinned_bytes: EDQUOT past it) and a 64 MiB working set: hit rate,
  evictions, failed acquires (goal 0) and peak pinned bytes over the share (goal <= 1);
- floor (``--vm``/``--only-vm`` for SimMemory, ``--cuda`` for CudaMemory): a
  buffer-id hit against the provider's query in C called in a C loop, the
  least a validated hit can cost (goal: 2x).
Progress goes to stderr, the table (or JSON) to stdout.
Host figures use FakeDevice (gpupin.testing.fake, imported by the figures that
use it, not when the gpupin command reads these arguments), whose validity map
is an anonymous shared mapping read like the kernel's page.  ``--vm`` adds real
ioctl pin/unpin times against the simulator; ``--cuda`` adds the buffer-id query on
a real GPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from .._native import ffi, lib
from ..cache import RegistrationCache
from ..errors import GpupinError

MiB = 1 << 20
# The reuse trace's FakeDevice busy-waits this long per pin: its times are modelled (the keys
# ending in _modelled), not measured.
TRACE_PIN_LATENCY_S = 100e-6
TARGETS = {
    "direct_over_cuda_python": 0.25,
    "cuda_buffer_id_hit_over_direct_query": 1.5,
    "cuda_buffer_id_hit_over_floor": 2.0,
    "sim_buffer_id_hit_over_floor": 2.0,
    "kernel_hit_over_dict": 1.5,
    "trace_pin_reduction": 100.0,
    "trace_speedup_modelled": 10.0,
    "scale_100k_over_100": 1.5,
    "purge_100k_over_10k": 1.5,
    "pressure_failed_acquires": 0,
    "budget_failed_acquires": 0,
    "budget_peak_over_budget": 1.0,
    "threads_16_over_1": 2.0,
    "vm_pin_unpin_many_over_100": 1.3,
    "vm_query_many_over_100": 1.3,
    "vm_dump_race_duplicates": 0,
    "vm_dump_race_missing_live": 0,
    "gds_registration_reduction": 60.0,
    "gds_speedup": 20.0,
    "gds_hit_over_direct_query": 1.5,
    "nixl_registration_reduction": 100.0,
    "nixl_registration_time_reduction": 20.0,
    "nixl_cache_over_hand_total": 1.2,
    "nixl_hit_over_direct_query": 1.5,
    "nixl_stale_transfers": 0,
    "nixl_ep_over_raw_4k": 1.2,
    "nixl_ep_over_raw_64k": 1.2,
    "nixl_ep_over_raw_1m": 1.2,
    "nixl_ep_over_raw_4m": 1.2,
    "nixl_scatter_ep_over_raw_throughput": 0.9,
    "nixl_churn_false_deliveries": 0,
    "nixl_churn_stale_bytes": 0,
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="fewer repetitions (for tests)")
    p.add_argument("--vm", action="store_true", help="also time real pin/unpin ioctls (needs the modules)")
    p.add_argument("--cuda", action="store_true", help="also measure buffer-id queries on a real GPU")
    p.add_argument("--only-cuda", action="store_true", help="only the GPU figures")
    p.add_argument(
        "--gds", action="store_true", help="only the GPUDirect Storage figures (needs a GPU, cuda-python and libcufile)"
    )
    p.add_argument("--only-vm", action="store_true", help="only the real-ioctl pin/unpin times (needs the modules)")
    p.add_argument(
        "--nixl", action="store_true", help="only the NIXL figures (needs nixl-cu13; VRAM with a GPU, else DRAM)"
    )
    p.add_argument("--out", metavar="FILE", help="write the JSON here as well")
    p.add_argument("--seed", type=int, default=1)


def interleaved_ns(loops: dict[str, Callable[[int], None]], n: int, reps: int) -> dict[str, float]:
    """Median ns per operation of several loops (each ``fn(n)`` runs n operations), measured
    in turn, batch by batch, so that drifts of the machine (clock boost, other tenants) fall
    on all of them alike; every other round in the opposite order, so that none is always
    the one that follows another (and finds the caches as that one left them)."""
    for fn in loops.values():
        fn(min(n, 1000))  # warm up
    samples: dict[str, list[float]] = {k: [] for k in loops}
    order = list(loops.items())
    for rep in range(reps):
        for k, fn in order if rep % 2 == 0 else reversed(order):
            t = time.perf_counter_ns()
            fn(n)
            samples[k].append((time.perf_counter_ns() - t) / n)
    return {k: statistics.median(v) for k, v in samples.items()}


def batch_for(fn: Callable[[int], None], n: int, seconds: float = 0.005, most: int = 4000) -> int:
    """``n``, or more where a batch of ``n`` would take less than ``seconds`` (at most ``most``):
    a batch long enough that its first operation's costs (a cold cache line, a progress
    thread's wakeup) are not a large part of it.  Times one batch of ``n`` to know."""
    t = time.perf_counter_ns()
    fn(n)
    per = max(1, time.perf_counter_ns() - t) / n
    return max(n, min(most, int(seconds * 1e9 / per) + 1))


def _cached(regions: int, validate: str, size: int = 1 << 16) -> tuple[RegistrationCache, list[int]]:
    from ..testing.fake import FakeDevice, FakeMemory

    mem = FakeMemory()
    dev = FakeDevice(mem, slots=max(1 << 12, 2 * regions))
    cache = RegistrationCache(dev, mem, validate=validate)  # type: ignore[arg-type]
    ptrs = [mem.alloc(size) for _ in range(regions)]
    for p in ptrs:
        cache.acquire(p, 8).release()
    return cache, ptrs


def hit_loop(
    cache: RegistrationCache, ptrs: list[int], lookup: Callable[[int, int], int] | None = None
) -> Callable[[int], None]:
    """The hot path: one C call (lookup + validity + reference) per hit."""
    seq = [ptrs[i % len(ptrs)] + 64 for i in range(4096)]
    lookup = lookup or cache.fast_lookup

    def run(n: int) -> None:
        s = seq
        m = len(s)
        for i in range(n):
            lookup(s[i % m], 256)

    return run


def release_all(cache: RegistrationCache, ptrs: list[int]) -> None:
    """Drop the references hit_loop left behind, so that the cache can close."""
    for p in ptrs:
        tok = cache.lookup(p + 64, 1)
        for _ in range(lib.gpc_refs(cache.core, tok)):
            cache.release_token(tok)


def hit_release_loop(cache: RegistrationCache, ptrs: list[int]) -> Callable[[int], None]:
    """fast_lookup (miss when < 0) + release_token: a whole use of a cached registration without
    Python objects, written as ``RegistrationCache.lookup``'s documentation advises."""
    seq = [ptrs[i % len(ptrs)] + 64 for i in range(4096)]
    fast, miss, release = cache.fast_lookup, cache.miss, cache.release_token

    def run(n: int) -> None:
        s = seq
        m = len(s)
        for i in range(n):
            p = s[i % m]
            tok = fast(p, 256)
            if tok < 0:
                tok = miss(p, 256, tok)
            release(tok)

    return run


def acquire_loop(cache: RegistrationCache, ptrs: list[int]) -> Callable[[int], None]:
    """acquire() + release() through Registration objects: the convenient API."""
    seq = [ptrs[i % len(ptrs)] + 64 for i in range(4096)]
    acquire = cache.acquire

    def run(n: int) -> None:
        s = seq
        m = len(s)
        for i in range(n):
            acquire(s[i % m], 256).release()

    return run


def dict_loop(ptrs: list[int]) -> Callable[[int], None]:
    d = {p: p for p in ptrs}
    seq = [ptrs[i % len(ptrs)] for i in range(4096)]

    def run(n: int) -> None:
        s = seq
        m = len(s)
        get = d.get
        for i in range(n):
            get(s[i % m])

    return run


def query_loop(buffer_id: Callable[[int], int], ptrs: list[int]) -> Callable[[int], None]:
    seq = [ptrs[i % len(ptrs)] + 64 for i in range(4096)]

    def run(n: int) -> None:
        s = seq
        m = len(s)
        for i in range(n):
            buffer_id(s[i % m])

    return run


def query_floor_loop(query: Any, ctx: Any, ptrs: list[int]) -> Callable[[int], None]:
    """The floor of a buffer-id hit: the provider's query in C (``c_buffer_id_query``, the one
    the hit path calls) called in a C loop (``gpc_query_loop``), no Python per call."""
    arr = ffi.new("uint64_t[]", [p + 64 for p in ptrs])

    def run(n: int) -> None:
        failed = lib.gpc_query_loop(query, ctx, arr, len(ptrs), n)
        if failed:
            raise GpupinError(
                f"the buffer-id query failed {failed} of {n} times: a floor of errors measures nothing; "
                "keep the allocations alive while the benchmark runs"
            )

    return run


def bench_hit(reps: int, n: int) -> dict[str, Any]:
    loops: dict[str, Callable[[int], None]] = {}
    caches = {}
    for mode in ("kernel", "buffer_id", "both"):
        cache, ptrs = _cached(100, mode)
        caches[mode] = (cache, ptrs)
        # lookup() leaves references behind; they do not change the hit path's cost.
        loops[f"hit_{mode}_ns"] = hit_loop(cache, ptrs)
    cache, ptrs = _cached(100, "kernel")
    # The same lookup as an ordinary cffi call (the hot path before the vectorcall entry point).
    cffi_lookup = functools.partial(lib.gpc_lookup, cache.core)
    loops["hit_kernel_cffi_ns"] = hit_loop(cache, ptrs, cffi_lookup)
    loops["hit_release_kernel_ns"] = hit_release_loop(cache, ptrs)
    loops["acquire_release_kernel_ns"] = acquire_loop(cache, ptrs)
    cache, ptrs = caches["kernel"]
    loops["dict_lookup_ns"] = dict_loop(ptrs)
    loops["buffer_id_query_ns"] = query_loop(cache.memory.buffer_id, ptrs)
    out: dict[str, Any] = dict(interleaved_ns(loops, n, reps))
    out["kernel_hit_over_dict"] = out["hit_kernel_ns"] / out["dict_lookup_ns"]
    out["buffer_id_hit_over_query"] = out["hit_buffer_id_ns"] / out["buffer_id_query_ns"]
    return out


def zipf_trace(n: int, buffers: int, s: float, rng: random.Random) -> list[int]:
    weights = [1.0 / (k + 1) ** s for k in range(buffers)]
    return rng.choices(range(buffers), weights=weights, k=n)


def bench_trace(transfers: int, seed: int) -> dict[str, Any]:
    """A Zipf reuse trace, pinned through the cache and pinned per transfer, over FakeDevice.

    The pin counts are real; the times are not measurements of a pin: FakeDevice busy-waits a
    modelled 100 µs per pin, so ``trace_speedup_modelled`` follows from that figure and the
    pin counts (the VM bench times real ioctls).
    """
    from ..testing.fake import FakeDevice, FakeMemory

    rng = random.Random(seed)
    trace = zipf_trace(transfers, 64, 1.1, rng)
    latency = TRACE_PIN_LATENCY_S
    mem = FakeMemory()
    bufs = [mem.alloc(MiB) for _ in range(64)]

    dev = FakeDevice(mem, pin_latency=latency)
    cache = RegistrationCache(dev, mem, validate="both")
    t = time.perf_counter()
    for k in trace:
        cache.acquire(bufs[k], 4096).release()
    cached_s = time.perf_counter() - t
    cached_pins = dev.pin_calls
    cache.purge()

    dev2 = FakeDevice(mem, pin_latency=latency)
    t = time.perf_counter()
    for k in trace:
        p = dev2.pin(bufs[k], 4096)
        dev2.unpin(p)
    plain_s = time.perf_counter() - t
    return {
        "trace_transfers": transfers,
        "trace_pins_cached": cached_pins,
        "trace_pins_plain": dev2.pin_calls,
        "trace_pin_latency_modelled_us": latency * 1e6,
        "trace_seconds_cached_modelled": cached_s,
        "trace_seconds_plain_modelled": plain_s,
        "trace_pin_reduction": dev2.pin_calls / max(cached_pins, 1),
        "trace_speedup_modelled": plain_s / cached_s,
    }


def bench_scale(reps: int, n: int, big: int) -> dict[str, Any]:
    small_cache, small_ptrs = _cached(100, "kernel")
    big_cache, big_ptrs = _cached(big, "kernel")
    rng = random.Random(7)
    pick = rng.sample(big_ptrs, 100)
    # Interleaved batches: a drift of the machine falls on both sides alike.
    t = interleaved_ns({"small": hit_loop(small_cache, small_ptrs), "large": hit_loop(big_cache, pick)}, n, reps)
    small, large = t["small"], t["large"]
    # purge(): the time per entry must not grow with the entries (it scanned all of them for
    # each one it evicted).  The big cache's 100 picked entries stay: hit_loop holds them.
    tenth_cache, _ = _cached(big // 10, "kernel")
    t0 = time.perf_counter()
    n_tenth = tenth_cache.purge()
    t1 = time.perf_counter()
    n_big = big_cache.purge()
    t2 = time.perf_counter()
    return {
        "scale_regions": big,
        "scale_hit_100_ns": small,
        "scale_hit_big_ns": large,
        "scale_100k_over_100": large / small,
        "purge_tenth_ns_per_entry": (t1 - t0) * 1e9 / n_tenth,
        "purge_big_ns_per_entry": (t2 - t1) * 1e9 / n_big,
        "purge_100k_over_10k": ((t2 - t1) / n_big) / ((t1 - t0) / n_tenth),
    }


def bench_pressure(acquires: int, seed: int) -> dict[str, Any]:
    from ..testing.fake import FakeDevice, FakeMemory

    rng = random.Random(seed)
    mem = FakeMemory()
    dev = FakeDevice(mem, bar_size=64 * MiB)
    cache = RegistrationCache(dev, mem, validate="both")
    bufs = [mem.alloc(4 * MiB) for _ in range(64)]  # 256 MiB working set
    failed = 0
    for _ in range(acquires):
        try:
            cache.acquire(rng.choice(bufs), 4096).release()
        except Exception:
            failed += 1
    st = cache.stats()
    return {
        "pressure_acquires": acquires,
        "pressure_failed_acquires": failed,
        "pressure_evictions": st.evictions_pressure + st.evictions_limit,
        "pressure_peak_bytes": st.peak_bytes,
    }


def bench_threads(per_thread: int, counts: tuple[int, ...] = (1, 4, 16)) -> dict[str, Any]:
    """Hits (fast_lookup + release_token) from several threads at once on one cache: the
    aggregate ns per hit at each thread count, started together behind a barrier."""
    cache, ptrs = _cached(100, "kernel")
    out: dict[str, Any] = {}
    for count in counts:
        barrier = threading.Barrier(count + 1)
        errors: list[BaseException] = []

        def worker(seed: int, barrier: threading.Barrier, errors: list[BaseException]) -> None:
            seq = [ptrs[(seed * 7919 + i * 31) % len(ptrs)] + 64 for i in range(4096)]
            lookup, release = cache.fast_lookup, cache.release_token
            barrier.wait()
            try:
                for i in range(per_thread):
                    tok = lookup(seq[i & 4095], 256)
                    if tok < 0:
                        raise RuntimeError(f"bench_threads: a miss ({tok}) on a cached region")
                    release(tok)
            except BaseException as exc:  # noqa: B036 - reported by the main thread
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(k, barrier, errors)) for k in range(count)]
        for t in threads:
            t.start()
        barrier.wait()
        t0 = time.perf_counter_ns()
        for t in threads:
            t.join()
        elapsed = time.perf_counter_ns() - t0
        if errors:
            raise errors[0]
        out[f"threads_{count}_hit_release_ns"] = elapsed / (count * per_thread)
    if 1 in counts and 16 in counts:
        out["threads_16_over_1"] = out["threads_16_hit_release_ns"] / out["threads_1_hit_release_ns"]
    cache.purge()
    return out


def bench_vm(reps: int) -> dict[str, Any]:
    from ..device import Device
    from ..sim import SimMemory, module_param

    out: dict[str, Any] = {}
    with (
        module_param("nvp2p_sim", "pin_latency_us", 0),
        module_param("nvp2p_sim", "bar_size", 2 << 30),
        SimMemory() as sim,
        Device() as dev,
    ):
        for label, size in (("64k", 1 << 16), ("1g", 1 << 30)):
            try:
                va = sim.alloc(size)
            except Exception as exc:  # the VM may lack the memory
                out[f"vm_pin_unpin_{label}_us"] = f"not measured: {exc}"
                continue
            samples = []
            for _ in range(reps if size < (1 << 30) else max(3, reps // 5)):
                t = time.perf_counter_ns()
                dev.unpin(dev.pin(va, size))
                samples.append((time.perf_counter_ns() - t) / 1000)
            out[f"vm_pin_unpin_{label}_us"] = statistics.median(samples)
            sim.free(va)
    return out


def bench_budget(acquires: int, seed: int, budget: int = 16 * MiB) -> dict[str, Any]:
    """The registration cache under a share (EDQUOT): gpupin.ko's max_file_pinned_bytes of
    ``budget`` bytes, a random trace over a working set four times that (2 MiB buffers of the
    simulator), one acquire and release each.  The cache evicts idle registrations for each
    miss past the share: every acquire succeeds, and the hit rate is what a quarter of the
    working set buys."""
    from ..device import Device
    from ..sim import SimMemory, module_param

    rng = random.Random(seed)
    size = 2 * MiB
    with (
        module_param("nvp2p_sim", "pin_latency_us", 0),
        module_param("gpupin", "max_file_pinned_bytes", budget),
        SimMemory() as sim,
        Device() as dev,
    ):
        bufs = [sim.alloc(size) for _ in range(4 * budget // size)]
        cache = RegistrationCache(dev, sim, validate="both")
        failed = 0
        t = time.perf_counter_ns()
        for _ in range(acquires):
            try:
                cache.acquire(rng.choice(bufs), 4096).release()
            except GpupinError:
                failed += 1
        elapsed = time.perf_counter_ns() - t
        st = cache.stats()
        peak = st.peak_bytes
        cache.close()
        for b in bufs:
            sim.free(b)
    return {
        "budget_mib": budget // MiB,
        "budget_working_set_mib": 4 * budget // MiB,
        "budget_acquires": acquires,
        "budget_failed_acquires": failed,
        "budget_hit_rate": st.hits / max(st.hits + st.misses, 1),
        "budget_evictions": st.evictions_pressure,
        "budget_peak_over_budget": peak / budget,
        "budget_acquire_us": elapsed / acquires / 1e3,
    }


class _PythonQuery:
    """SimMemory as it was before it offered its query in C: the cache checks its buffer ids in
    Python (the fallback of providers without one), each through ``range_of``'s ioctl wrapper.
    Everything else is the provider's."""

    direct_buffer_id_query = False

    def __init__(self, memory: Any) -> None:
        self._memory = memory

    def buffer_id(self, ptr: int) -> int:
        return int(self._memory.range_of(ptr).buffer_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._memory, name)


def bench_sim_hit(reps: int, n: int) -> dict[str, Any]:
    """SimMemory's buffer-id hit (its query one ioctl from C) against the floor, that query in
    a C loop, in the same run; beside them the query from Python and the hit through the
    Python fallback.  Needs the modules (the VM part of ``make bench``)."""
    from ..device import Device
    from ..sim import SimMemory

    out: dict[str, Any] = {}
    with SimMemory() as sim, Device() as dev:
        ptrs = [sim.alloc(1 << 20) for _ in range(8)]
        caches = {
            "sim_hit_buffer_id_ns": RegistrationCache(dev, sim, validate="buffer_id"),
            "sim_hit_buffer_id_py_ns": RegistrationCache(dev, _PythonQuery(sim), validate="buffer_id"),
        }
        loops = {
            "sim_buffer_id_query_floor_ns": query_floor_loop(sim.c_buffer_id_query, sim.c_buffer_id_ctx, ptrs),
            "sim_buffer_id_query_ns": query_loop(sim.buffer_id, ptrs),
            "sim_dict_lookup_ns": dict_loop(ptrs),
        }
        for key, cache in caches.items():
            for p in ptrs:
                cache.acquire(p, 8).release()
            loops[key] = hit_loop(cache, ptrs)
        out.update(interleaved_ns(loops, n, reps))
        for cache in caches.values():
            release_all(cache, ptrs)
            cache.close()
        for p in ptrs:
            sim.free(p)
    out["sim_buffer_id_hit_over_floor"] = out["sim_hit_buffer_id_ns"] / out["sim_buffer_id_query_floor_ns"]
    out["sim_buffer_id_hit_py_over_floor"] = out["sim_hit_buffer_id_py_ns"] / out["sim_buffer_id_query_floor_ns"]
    return out


def bench_cuda(reps: int, n: int) -> dict[str, Any]:
    """Buffer-id queries and buffer-id-checked hits on a real GPU (no kernel module needed: FakeDevice pins)."""
    from .._native import call_floor, cuda_buffer_id
    from ..cuda import CudaMemory
    from ..testing.fake import FakeDevice

    mem = CudaMemory()
    ptrs = [mem.alloc(1 << 20) for _ in range(8)]
    out: dict[str, Any] = {
        "cuda_direct_available": mem.direct_buffer_id_query,
        "direct_binding": "vectorcall" if cuda_buffer_id else "cffi",
    }
    caches = []
    try:
        # The direct query CudaMemory uses: the vectorcall entry point (cffi where it is missing);
        # for information the same libcuda call through an ordinary cffi call and through
        # CudaMemory.buffer_id.  All measured in turn (interleaved_ns).
        direct = cuda_buffer_id or lib.gp_cuda_buffer_id_or_0
        loops = {
            "cuda_python_buffer_id_query_ns": query_loop(mem.buffer_id_cuda_python, ptrs),
            "direct_buffer_id_query_ns": query_loop(direct, ptrs),
            "direct_buffer_id_query_cffi_ns": query_loop(lib.gp_cuda_buffer_id_or_0, ptrs),
            "direct_buffer_id_query_wrapped_ns": query_loop(mem.buffer_id, ptrs),
            "cuda_dict_lookup_ns": dict_loop(ptrs),
        }
        if call_floor is not None:  # the same loop and call into C, without the query
            loops["cuda_python_call_floor_ns"] = query_loop(call_floor, ptrs)
        if mem.direct_buffer_id_query:  # the hit path's own query, in a C loop
            loops["cuda_buffer_id_query_floor_ns"] = query_floor_loop(mem.c_buffer_id_query, mem.c_buffer_id_ctx, ptrs)
        for mode in ("buffer_id", "both"):
            cache = RegistrationCache(FakeDevice(mem), mem, validate=mode)
            for p in ptrs:
                cache.acquire(p, 8).release()
            caches.append(cache)
            loops[f"cuda_hit_{mode}_ns"] = hit_loop(cache, ptrs)
        out.update(interleaved_ns(loops, n, reps))
        for cache in caches:
            cache.purge()
        out["direct_over_cuda_python"] = out["direct_buffer_id_query_ns"] / out["cuda_python_buffer_id_query_ns"]
        out["cuda_buffer_id_hit_over_direct_query"] = out["cuda_hit_buffer_id_ns"] / out["direct_buffer_id_query_ns"]
        if "cuda_buffer_id_query_floor_ns" in out:
            out["cuda_buffer_id_hit_over_floor"] = out["cuda_hit_buffer_id_ns"] / out["cuda_buffer_id_query_floor_ns"]
        if "cuda_python_call_floor_ns" in out and "cuda_buffer_id_query_floor_ns" in out:
            # Where a hit's time goes: the Python loop and call (measured without the query), the
            # query as C alone sees it (the floor), the query's extra cost when called between
            # Python's own work (caches and branch predictors the interpreter evicted), and the
            # cache's own lookup (hit less the direct query).
            call, floor = out["cuda_python_call_floor_ns"], out["cuda_buffer_id_query_floor_ns"]
            out["cuda_hit_part_python_call_ns"] = call
            out["cuda_hit_part_query_in_c_ns"] = floor
            out["cuda_hit_part_query_cold_extra_ns"] = out["direct_buffer_id_query_ns"] - call - floor
            out["cuda_hit_part_cache_lookup_ns"] = out["cuda_hit_buffer_id_ns"] - out["direct_buffer_id_query_ns"]
    finally:
        for p in ptrs:
            mem.free(p)
        mem.close()
    return out


def bench_nixl(
    transfers: int = 10_000, segments: int = 16, seed: int = 1, reps: int = 15, n: int = 20000
) -> dict[str, Any]:
    """NIXL registration three ways over one framework-like trace: tensors carved from
    ``segments`` segments, WRITE to a peer agent, segments freed and allocated again now and
    then.  Register per transfer; register each segment by hand once and again when the trace
    recycles it (the lower bound: it knows what a cache must discover); gpupin's NixlCache.
    VRAM with a CUDA GPU, else DRAM (HostMemory).  Same transfers in each mode."""
    from ..nixl import NixlEndpoint

    try:
        from ..cuda import CudaMemory

        mem: Any = CudaMemory()
        sink_mem: Any = mem
        mem_type, seg = "VRAM", 8 * MiB
    except Exception:  # noqa: BLE001 - no CUDA: DRAM
        from ..hostmem import HostMemory

        mem, sink_mem = HostMemory((segments + 2) * 2 * MiB), HostMemory(4 * MiB)
        mem_type, seg = "DRAM", 2 * MiB
    rng = random.Random(seed)
    sizes = [64 * 1024, 256 * 1024, 1 * MiB]
    trace = []  # (segment, offset, size, recycle the segment after this transfer)
    for _ in range(transfers):
        size = rng.choice(sizes)
        trace.append((rng.randrange(segments), rng.randrange(0, seg - size) & ~4095, size, rng.random() < 0.0025))
    tgt = NixlEndpoint("gpupin-bench-t", sink_mem, mem_type=mem_type)
    ini = NixlEndpoint("gpupin-bench-i", mem, mem_type=mem_type)
    sink = sink_mem.alloc(MiB)
    out: dict[str, Any] = {"nixl_mem_type": mem_type, "nixl_transfers": transfers, "nixl_segments": segments}
    try:
        rb = tgt.expose(sink, MiB)
        ini.connect(tgt.metadata())
        agent, devid = ini.agent, ini.driver.devid
        rdescs = {sz: agent.get_xfer_descs([(sink, sz, rb.devid)], mem_type) for sz in sizes}

        def xfer(ptr: int, size: int) -> None:
            h = agent.initialize_xfer(
                "WRITE", agent.get_xfer_descs([(ptr, size, devid)], mem_type), rdescs[size], rb.agent
            )
            st = agent.transfer(h)
            while st == "PROC":
                tgt.progress()  # no progress threads: the target's agent moves only when polled
                st = agent.check_xfer_state(h)
            agent.release_xfer_handle(h)
            if st != "DONE":
                raise RuntimeError(f"bench transfer failed: {st}")

        def run_mode(mode: str) -> dict[str, float]:
            segs = [mem.alloc(seg) for _ in range(segments)]
            regs: dict[int, Any] = {}
            t_reg = t_dereg = t_look = 0.0
            count = stale = 0
            r0, d0, c0 = ini.driver.register_s, ini.driver.deregister_s, ini.driver.registrations
            t_all = time.perf_counter()  # the hand's first registrations count, as the cache's do
            if mode == "hand":
                for i, p in enumerate(segs):
                    t = time.perf_counter()
                    regs[i] = agent.register_memory([(p, seg, devid, "")], mem_type)
                    t_reg += time.perf_counter() - t
                    count += 1
            for i, off, size, recycle in trace:
                ptr = segs[i] + off
                if mode == "per-transfer":
                    t = time.perf_counter()
                    reg = agent.register_memory([(ptr, size, devid, "")], mem_type)
                    t_reg += time.perf_counter() - t
                    xfer(ptr, size)
                    t = time.perf_counter()
                    agent.deregister_memory(reg)
                    t_dereg += time.perf_counter() - t
                    count += 1
                elif mode == "hand":
                    xfer(ptr, size)
                else:
                    t = time.perf_counter()
                    with ini.cache.acquire(ptr, size) as r:
                        t_look += time.perf_counter() - t
                        stale += r.buffer_id != mem.buffer_id(ptr)
                        xfer(ptr, size)
                if recycle:
                    if mode == "hand":
                        t = time.perf_counter()
                        agent.deregister_memory(regs[i])
                        t_dereg += time.perf_counter() - t
                    mem.free(segs[i])
                    segs[i] = mem.alloc(seg)
                    if mode == "hand":
                        t = time.perf_counter()
                        regs[i] = agent.register_memory([(segs[i], seg, devid, "")], mem_type)
                        t_reg += time.perf_counter() - t
                        count += 1
            total = time.perf_counter() - t_all
            if mode == "hand":
                for r in regs.values():
                    agent.deregister_memory(r)
            if mode == "cache":
                t_reg = ini.driver.register_s - r0
                t_dereg = ini.driver.deregister_s - d0
                t_look -= t_reg  # acquire() time that was registration
                count = ini.driver.registrations - c0
                ini.cache.purge()
            for p in segs:
                mem.free(p)
            return {
                "registrations": count,
                "register_s": t_reg,
                "deregister_s": t_dereg,
                "lookup_s": t_look,
                "total_s": total,
                "stale": stale,
            }

        for mode in ("per-transfer", "hand", "cache"):
            progress(f"bench: nixl {mode} ({transfers} transfers)")
            for k, v in run_mode(mode).items():
                out[f"nixl_{mode.replace('-', '_')}_{k}"] = v
        per, hand, cache = "nixl_per_transfer_", "nixl_hand_", "nixl_cache_"
        out["nixl_registration_reduction"] = out[per + "registrations"] / max(1, out[cache + "registrations"])
        out["nixl_registration_time_reduction"] = (out[per + "register_s"] + out[per + "deregister_s"]) / max(
            1e-9, out[cache + "register_s"] + out[cache + "deregister_s"]
        )
        out["nixl_cache_over_hand_total"] = out[cache + "total_s"] / out[hand + "total_s"]
        out["nixl_stale_transfers"] = out[cache + "stale"]
        # The hit against one bare buffer-id query (the direct CUDA query where there is one).
        ptrs = [mem.alloc(seg) for _ in range(8)]
        for p in ptrs:
            ini.cache.acquire(p, 8).release()
        query = mem.buffer_id
        if mem_type == "VRAM":
            from .._native import cuda_buffer_id

            query = cuda_buffer_id or lib.gp_cuda_buffer_id_or_0
        t = interleaved_ns({"hit": hit_loop(ini.cache, ptrs), "query": query_loop(query, ptrs)}, n, reps)
        out["nixl_hit_ns"], out["nixl_direct_query_ns"] = t["hit"], t["query"]
        out["nixl_hit_over_direct_query"] = t["hit"] / t["query"]
        release_all(ini.cache, ptrs)
        for p in ptrs:
            mem.free(p)
    finally:
        ini.close()
        tgt.close()
        sink_mem.free(sink)
    return out


EP_SIZES = (("4k", 4 << 10), ("64k", 64 << 10), ("1m", MiB), ("4m", 4 * MiB))
# Transfers per timing batch at each size (a batch of each mode in turn, per round), at least;
# more where a batch would last less than 5 ms (batch_for).
EP_BATCH = {"4k": 400, "64k": 200, "1m": 40, "4m": 12}
SCATTER_BLOCKS, SCATTER_BLOCK, SCATTER_REGION = 64, 64 << 10, 16 * MiB
CHURN_SLOTS, CHURN_SLOT = 4, 256 << 10


def _bench_memory(dram_bytes: int) -> tuple[Any, str]:
    """CudaMemory (VRAM) where CUDA works, else HostMemory (DRAM): bench_nixl's choice."""
    try:
        from ..cuda import CudaMemory

        return CudaMemory(), "VRAM"
    except Exception:  # noqa: BLE001 - no CUDA: DRAM
        from ..hostmem import HostMemory

        return HostMemory(dram_bytes), "DRAM"


def _raw_lists(
    ep: Any, local: list[tuple[int, int]], remote: Any, offsets: list[int]
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """NIXL's (address, length, device) lists of the local buffers and their remote places."""
    lspec = [(p, n, ep.driver.devid) for p, n in local]
    rspec = [(remote.addr + off, n, remote.devid) for (_, n), off in zip(local, offsets, strict=True)]
    return lspec, rspec


def _raw_finish(agent: Any, lock: Any, h: Any, st: str, what: str) -> None:
    """Poll a raw transfer until NIXL ends it (``check_xfer_state``), then release its handle."""
    while st == "PROC":
        with lock:
            st = agent.check_xfer_state(h)
    with lock:
        agent.release_xfer_handle(h)
    if st != "DONE":
        raise GpupinError(f"bench: {what} ended {st}")


def raw_write(ep: Any, local: list[tuple[int, int]], remote: Any, offsets: list[int]) -> None:
    """One WRITE through NIXL's own calls on ``ep``'s agent, the endpoint's protocol left out:
    descriptors, ``initialize_xfer`` without a notification, ``transfer``, ``check_xfer_state``
    polled until DONE, ``release_xfer_handle``.  Each call under the agent's lock, as the
    endpoint makes them (its progress thread calls the agent too; NIXL locks nothing)."""
    agent, lock = ep.agent, ep.driver.lock
    lspec, rspec = _raw_lists(ep, local, remote, offsets)
    with lock:
        ldesc = agent.get_xfer_descs(lspec, ep.driver.mem_type)
        rdesc = agent.get_xfer_descs(rspec, remote.mem_type)
        h = agent.initialize_xfer("WRITE", ldesc, rdesc, remote.agent, b"")
        st = agent.transfer(h)
    _raw_finish(agent, lock, h, st, f"a raw NIXL write of {len(local)} block(s)")


def raw_prepped(
    ep: Any, local: list[tuple[int, int]], remote: Any, offsets: list[int]
) -> tuple[Callable[[int], None], Callable[[], None]]:
    """A loop of ``n`` WRITEs through NIXL's prepped lists (``prep_xfer_dlist`` once,
    ``make_prepped_xfer`` per transfer), the endpoint's protocol left out, under the agent's
    lock as raw_write; and the call that releases the lists."""
    agent, lock = ep.agent, ep.driver.lock
    idx = list(range(len(local)))
    lspec, rspec = _raw_lists(ep, local, remote, offsets)
    with lock:
        lh = agent.prep_xfer_dlist("", lspec, ep.driver.mem_type)
        rh = agent.prep_xfer_dlist(remote.agent, rspec, remote.mem_type)
    what = f"a raw prepped NIXL write of {len(local)} block(s)"

    def run(n: int) -> None:
        for _ in range(n):
            with lock:
                h = agent.make_prepped_xfer("WRITE", lh, idx, rh, idx, b"")
                st = agent.transfer(h)
            _raw_finish(agent, lock, h, st, what)

    def release() -> None:
        with lock:
            lh.release()
            rh.release()

    return run, release


def bench_nixl_endpoint(seed: int = 1, reps: int = 15, quick: bool = False) -> dict[str, Any]:
    """NixlEndpoint between two processes (this one initiates; a target process,
    gpupin.tools.nixl_bench_target, exposes), VRAM with a CUDA GPU, else DRAM:
    - a blocking ``write`` against raw NIXL on the same agents and registrations
      (:func:`raw_write`) at 4 KiB to 4 MiB, batches of each in turn (each at least 5 ms
      long but with --quick), medians;
    - 64 blocks of 64 KiB at scattered offsets of one exposed region, ``write_blocks``
      against raw NIXL with the same 64 descriptors in one transfer: GB/s;
    - ``write(..., confirm=True)`` at 4 KiB, for information (the target's check, a round trip);
    - the same 4 KiB write and scatter list through a ``Prepared`` against raw NIXL's prepped
      lists (:func:`raw_prepped`), for information;
    - a churn trace (:func:`churn_trace`): the target takes buffers back, frees them and
      exposes the reallocated ones between (and during) writes."""
    from ..nixl import NixlEndpoint, NixlError, RemoteBuffer
    from .nixl_bench_target import TargetProcess

    rng = random.Random(seed)
    scale = 10 if quick else 1
    mem, mem_type = _bench_memory(32 * MiB)
    progress(f"bench: nixl endpoint: starting the target process ({mem_type})")
    tgt = TargetProcess(mem_type, 32 * MiB)
    ini = None
    out: dict[str, Any] = {"nixl_ep_mem_type": mem_type}
    try:
        ini = NixlEndpoint(f"gpupin-bench-ep-{os.getpid()}", mem, mem_type=mem_type, auto_progress=True)
        ini.connect(tgt.metadata)
        tgt.call("connect", ini.metadata())
        big = EP_SIZES[-1][1]
        dst = tgt.call("alloc", big)
        region = tgt.call("alloc", SCATTER_REGION)
        rb = RemoteBuffer.from_bytes(tgt.call("expose", dst, big))
        rregion = RemoteBuffer.from_bytes(tgt.call("expose", region, SCATTER_REGION))
        src = mem.alloc(big)
        ssrc = mem.alloc(SCATTER_BLOCKS * SCATTER_BLOCK)
        slots = rng.sample(range(SCATTER_REGION // SCATTER_BLOCK), SCATTER_BLOCKS)
        blocks = [(ssrc + i * SCATTER_BLOCK, SCATTER_BLOCK, rregion, s * SCATTER_BLOCK) for i, s in enumerate(slots)]
        scatter_local = [(b[0], b[1]) for b in blocks]
        scatter_offs = [b[3] for b in blocks]

        # Both ways move the bytes (checked once, before any timing).
        for way in ("endpoint", "raw"):
            data = rng.randbytes(big)
            mem.write(src, data)
            if way == "endpoint":
                ini.write(src, big, rb)
            else:
                raw_write(ini, [(src, big)], rb, [0])
            if tgt.call("read", dst, big) != data:
                raise GpupinError(f"bench: a {way} write of {big} bytes did not put them in the target's buffer")
            sdata = rng.randbytes(SCATTER_BLOCKS * SCATTER_BLOCK)
            mem.write(ssrc, sdata)
            if way == "endpoint":
                ini.write_blocks(blocks)
            else:
                raw_write(ini, scatter_local, rregion, scatter_offs)
            got = tgt.call("read", region, SCATTER_REGION)
            for i, off in enumerate(scatter_offs):
                if got[off : off + SCATTER_BLOCK] != sdata[i * SCATTER_BLOCK : (i + 1) * SCATTER_BLOCK]:
                    raise GpupinError(f"bench: a {way} scatter write left block {i} out of the target's region")

        def ep_loop(size: int, confirm: bool = False) -> Callable[[int], None]:
            write = ini.write

            def run(n: int) -> None:
                for _ in range(n):
                    write(src, size, rb, confirm=confirm)

            return run

        def raw_loop(size: int) -> Callable[[int], None]:
            local = [(src, size)]

            def run(n: int) -> None:
                for _ in range(n):
                    raw_write(ini, local, rb, [0])

            return run

        # Both ways for a second first: the GPU's and the CPUs' clocks leave their idle states,
        # UCX caches the peer's memory handles (the first size measured saw that before).
        warm_until = time.monotonic() + (0.1 if quick else 1.0)
        warm_ep, warm_raw = ep_loop(4 << 10), raw_loop(4 << 10)
        while time.monotonic() < warm_until:
            warm_ep(50)
            warm_raw(50)
        for label, size in EP_SIZES:
            ep, raw = ep_loop(size), raw_loop(size)
            batch = max(2, EP_BATCH[label] // scale)
            if not quick:  # a GPU moves 4 MiB in ~20 us: batches of at least 5 ms each
                batch = batch_for(raw, batch)
            progress(f"bench: nixl endpoint write {label}, endpoint and raw in turn ({reps} rounds of {batch})")
            t = interleaved_ns({"ep": ep, "raw": raw}, batch, reps)
            out[f"nixl_ep_write_{label}_us"] = t["ep"] / 1e3
            out[f"nixl_raw_write_{label}_us"] = t["raw"] / 1e3
            out[f"nixl_ep_over_raw_{label}"] = t["ep"] / t["raw"]

        def scatter_ep(n: int) -> None:
            for _ in range(n):
                ini.write_blocks(blocks)

        def scatter_raw(n: int) -> None:
            for _ in range(n):
                raw_write(ini, scatter_local, rregion, scatter_offs)

        batch = max(2, 20 // scale)
        progress(f"bench: nixl endpoint scatter, {SCATTER_BLOCKS} x 64 KiB ({reps} rounds of {batch})")
        t = interleaved_ns({"ep": scatter_ep, "raw": scatter_raw}, batch, reps)
        total = SCATTER_BLOCKS * SCATTER_BLOCK
        out["nixl_scatter_blocks"] = SCATTER_BLOCKS
        out["nixl_scatter_ep_gbps"] = total / t["ep"]  # bytes per ns: GB/s
        out["nixl_scatter_raw_gbps"] = total / t["raw"]
        out["nixl_scatter_ep_over_raw_throughput"] = t["raw"] / t["ep"]

        # Prepared transfers (NIXL's prepped lists) against raw NIXL's prepped lists.
        for label, pblocks in (("4k", [(src, 4 << 10, rb, 0)]), ("scatter", blocks)):
            prepared = ini.prepare("WRITE", pblocks)
            plocal, poffs = [(b[0], b[1]) for b in pblocks], [b[3] for b in pblocks]
            raw_p, raw_release = raw_prepped(ini, plocal, pblocks[0][2], poffs)
            try:

                def prep_ep(n: int, run: Callable[..., None] = prepared.run) -> None:
                    for _ in range(n):
                        run()

                batch = max(2, (EP_BATCH["4k"] if label == "4k" else 20) // scale)
                progress(f"bench: nixl endpoint prepared {label}, endpoint and raw in turn ({reps} rounds of {batch})")
                t = interleaved_ns({"ep": prep_ep, "raw": raw_p}, batch, reps)
            finally:
                prepared.close()
                raw_release()
            if label == "4k":
                out["nixl_prep_ep_write_4k_us"] = t["ep"] / 1e3
                out["nixl_prep_raw_write_4k_us"] = t["raw"] / 1e3
                out["nixl_prep_ep_over_raw_4k"] = t["ep"] / t["raw"]
            else:
                out["nixl_prep_scatter_ep_over_raw_throughput"] = t["raw"] / t["ep"]

        # Last: the check messages make NIXL's next transfers to the peer wait for its progress.
        batch = max(2, 50 // scale)
        progress(f"bench: nixl endpoint write 4k confirmed by the target ({reps} rounds of {batch})")
        t = interleaved_ns({"confirm": ep_loop(4 << 10, confirm=True)}, batch, reps)
        out["nixl_ep_write_confirm_4k_us"] = t["confirm"] / 1e3

        rounds = 30 if quick else 300
        progress(f"bench: nixl endpoint churn trace ({rounds} writes)")
        try:
            out.update(churn_trace(ini, mem, tgt, rounds, rng))
        except NixlError as exc:  # NIXL 1.5.1 over VRAM: see NixlEndpoint._reload
            why = f"not measured: {type(exc).__name__}: {exc}"
            out["nixl_churn_false_deliveries"] = out["nixl_churn_stale_bytes"] = why
            progress(f"bench: nixl endpoint churn trace {why}")
        else:  # the target answered every command: it can close cleanly and say what it saw
            for k, v in tgt.close().items():
                out[f"nixl_churn_target_{k}"] = v
        for p in (src, ssrc):
            mem.free(p)
    finally:
        tgt.kill()
        if ini is not None:
            ini.close()
        mem.close()
    return out


def churn_trace(ini: Any, mem: Any, tgt: Any, rounds: int, rng: random.Random) -> dict[str, Any]:
    """Writes into a target that recycles its buffers: CHURN_SLOTS exposed buffers; now and
    then the target unexposes one, frees it, allocates the same size (mostly at the same
    address), zeroes and exposes it; a quarter of those while a write into it is in flight.
    Each write that returns is checked at the target (false delivery: its bytes are not in
    the buffer it was exposed as, read before the free when it was churned); writes through
    descriptors the target took back are tried too, and the new owner's memory at their
    address is searched for their bytes (stale bytes)."""
    from ..nixl import RemoteBuffer, StaleRemote

    size_of = CHURN_SLOT
    cur = []
    for _ in range(CHURN_SLOTS):
        p = tgt.call("alloc", size_of)
        tgt.call("fill", p, size_of, 0)
        cur.append(RemoteBuffer.from_bytes(tgt.call("expose", p, size_of)))
    expect = [bytearray(size_of) for _ in range(CHURN_SLOTS)]  # what each buffer's owner holds
    taken_back: list[RemoteBuffer] = []
    src, src2 = mem.alloc(size_of), mem.alloc(size_of)
    c = dict.fromkeys(
        (
            "writes", "false_deliveries", "stale_bytes", "stale_bytes_checked", "churns", "churns_in_flight",
            "same_address", "stale_attempts", "stale_refused", "live_refused",
        ),
        0,
    )  # fmt: skip
    for r in range(rounds):
        if r and r % 100 == 0:
            progress(f"bench: nixl endpoint churn trace: {r}/{rounds}, {c['churns']} churns")
        k = rng.randrange(CHURN_SLOTS)
        size = rng.choice((4096, 65536))
        off = rng.randrange(0, size_of - size + 1) & ~63
        data = rng.randbytes(size)
        mem.write(src, data)
        churned = None
        if rng.random() < 0.25:  # the target takes the buffer back while the write may be in flight
            t = ini.post_write([(src, size, cur[k], off)])
            tgt.ask("churn", cur[k].to_bytes(), (off, size))
            t.wait()
            c["writes"] += 1
            churned = tgt.answer("churn")
            c["false_deliveries"] += churned[2] != data
            c["churns_in_flight"] += 1
        else:
            try:
                ini.write(src, size, cur[k], off)
            except StaleRemote:
                c["live_refused"] += 1  # refused, not delivered: counted, not a false delivery
            else:
                c["writes"] += 1
                if tgt.call("read", cur[k].addr + off, size) == data:
                    expect[k][off : off + size] = data
                else:
                    c["false_deliveries"] += 1
            if rng.random() < 0.2:
                churned = tgt.call("churn", cur[k].to_bytes(), None)
        if churned is not None:
            taken_back.append(cur[k])
            cur[k] = RemoteBuffer.from_bytes(churned[1])
            expect[k] = bytearray(size_of)
            c["churns"] += 1
            c["same_address"] += churned[3]
        if taken_back and rng.random() < 0.5:  # a write through a descriptor taken back
            old = rng.choice(taken_back[-2 * CHURN_SLOTS :])
            size = rng.choice((4096, 65536))
            off = rng.randrange(0, size_of - size + 1) & ~63
            stale = rng.randbytes(size)
            mem.write(src2, stale)
            c["stale_attempts"] += 1
            try:
                ini.write(src2, size, old, off)
                c["false_deliveries"] += 1  # it returned, and no buffer is exposed as `old` any more
            except StaleRemote:
                c["stale_refused"] += 1
            owner = next((i for i, b in enumerate(cur) if b.addr == old.addr), None)
            if owner is not None:
                got = tgt.call("read", old.addr + off, size)
                want = expect[owner][off : off + size]
                c["stale_bytes"] += sum(1 for g, s, w in zip(got, stale, want, strict=True) if g == s and g != w)
                c["stale_bytes_checked"] += size
    mem.free(src)
    mem.free(src2)
    return {f"nixl_churn_{k}": v for k, v in c.items()}


def _gds_file(driver: Any, size: int) -> tuple[Any, str, str]:
    """A file cuFile can read for the trace: (GdsFile or None, its path, why not)."""
    from ..errors import GdsError
    from ..gds import GdsFile

    path = os.path.join(os.getcwd(), f".gpupin-gds-bench-{os.getpid()}.bin")
    try:
        with open(path, "wb") as f:
            f.write(os.urandom(size))
        return GdsFile(driver, path), path, ""
    except (OSError, GdsError) as exc:
        return None, path, str(exc).split(";")[0]


def bench_gds(
    ios: int = 1000,
    buffers: int = 16,
    size: int = MiB,
    io_size: int = 64 * 1024,
    seed: int = 1,
    reps: int = 15,
    n: int = 20000,
) -> dict[str, Any]:
    """GPUDirect Storage: a reuse trace of ``ios`` reads over ``buffers`` buffers, registering per
    IO (the guide's pattern 1) against GdsCache, and the cache's hit cost against one direct
    BUFFER_ID query.  Needs a GPU, cuda-python and libcufile."""
    from .._native import cuda_buffer_id
    from ..cuda import CudaMemory
    from ..gds import CuFileDriver, GdsCache

    rng = random.Random(seed)
    mem = CudaMemory()
    drv = CuFileDriver()
    cf = drv.cufile
    ptrs = [mem.alloc(size) for _ in range(buffers)]
    trace = zipf_trace(ios, buffers, 1.1, rng)
    offs = [rng.randrange(0, size - io_size + 1) & ~4095 for _ in range(ios)]
    gf, path, why = _gds_file(drv, 16 * MiB)
    out: dict[str, Any] = {
        "gds_ios": ios,
        "gds_buffers": buffers,
        "gds_buffer_bytes": size,
        "gds_io_bytes": io_size,
        "gds_cufile_version": cf.get_version(),
        "gds_reads": gf is not None,
    }
    if gf is None:
        out["gds_reads_skipped"] = why
    file_offs = [rng.randrange(0, 16 * MiB - io_size + 1) & ~4095 for _ in range(ios)]
    tty = sys.stderr.isatty()
    try:
        # Pattern 1: register and deregister the buffer around every IO.
        t = time.perf_counter()
        for i, b in enumerate(trace):
            p = ptrs[b]
            cf.buf_register(p, size, 0)
            try:
                if gf is not None:
                    gf.read(p, io_size, file_offs[i], buf_offset=offs[i])
            finally:
                cf.buf_deregister(p)
            if i % 100 == 0:
                print(
                    ("\r" if tty else "") + f"gds: pattern 1, IO {i}/{ios}",
                    end="" if tty else "\n",
                    file=sys.stderr,
                    flush=True,
                )
        out["gds_pattern1_s"] = time.perf_counter() - t
        out["gds_pattern1_registrations"] = ios
        # The cache: register each allocation once, a buffer-id-checked hit after.
        cache = GdsCache(drv, mem)
        t = time.perf_counter()
        for i, b in enumerate(trace):
            reg = cache.acquire(ptrs[b] + offs[i], io_size)
            if gf is not None:
                gf.read(reg, io_size, file_offs[i])
            reg.release()
        cache.close()
        out["gds_cache_s"] = time.perf_counter() - t
        out["gds_cache_registrations"] = drv.registrations
        print(
            ("\r" if tty else "") + f"gds: pattern 1 {out['gds_pattern1_s']:.2f} s, "
            f"the cache {out['gds_cache_s']:.2f} s",
            file=sys.stderr,
            flush=True,
        )
        out["gds_registration_reduction"] = ios / max(1, drv.registrations)
        out["gds_speedup"] = out["gds_pattern1_s"] / out["gds_cache_s"]
        # The hit against one bare BUFFER_ID query through libcuda (interleaved batches).
        cache = GdsCache(drv, mem)
        for p in ptrs:
            cache.acquire(p, 8).release()
        direct = cuda_buffer_id or lib.gp_cuda_buffer_id_or_0
        out.update(
            interleaved_ns(
                {
                    "gds_direct_buffer_id_query_ns": query_loop(direct, ptrs),
                    "gds_hit_ns": hit_loop(cache, ptrs),
                    "gds_hit_release_ns": hit_release_loop(cache, ptrs),
                },
                n,
                reps,
            )
        )
        release_all(cache, ptrs)
        cache.close()
        out["gds_hit_over_direct_query"] = out["gds_hit_ns"] / out["gds_direct_buffer_id_query_ns"]
    finally:
        if gf is not None:
            gf.close()
        if os.path.exists(path):
            os.unlink(path)
        for p in ptrs:
            mem.free(p)
        drv.close()
        mem.close()
    return out


def _nixl_log_to_stderr() -> None:
    """NIXL's Python logger writes to stdout (INFO and up, configured at its import), where
    the figures go (``--json``): its handler writes to stderr instead, beside the progress."""
    import logging

    from ..nixl import load_nixl

    try:
        load_nixl()
    except GpupinError:
        return  # not installed: bench_nixl says so
    for h in logging.getLogger("nixl").handlers:
        if isinstance(h, logging.StreamHandler) and h.stream is sys.stdout:
            h.setStream(sys.stderr)


def run(
    quick: bool = False,
    vm: bool = False,
    cuda: bool = False,
    seed: int = 1,
    only_cuda: bool = False,
    only_vm: bool = False,
    gds: bool = False,
    nixl: bool = False,
) -> dict[str, Any]:
    reps, n = (5, 2000) if quick else (15, 20000)
    res: dict[str, Any] = {}
    if nixl:
        _nixl_log_to_stderr()
        res.update(bench_nixl(1000 if quick else 10_000, seed=seed, reps=reps, n=n))
        # Two processes and NIXL's threads vary more than one process's hits: three times
        # the rounds (45) for the endpoint's medians.
        res.update(bench_nixl_endpoint(seed=seed, reps=reps if quick else 3 * reps, quick=quick))
        res["targets"] = _targets(res, lambda k: k.startswith("nixl_"))
        return res
    if gds:
        res.update(bench_gds(1000, seed=seed, reps=reps, n=n))  # --quick: fewer timing batches only
        res["targets"] = _targets(res, lambda k: k.startswith("gds_"))
        return res
    if only_vm:
        from . import vmscale

        progress("bench: real pin/unpin ioctls")
        res.update(bench_vm(5 if quick else 50))
        progress("bench: the simulator's buffer-id hit against its floor")
        res.update(bench_sim_hit(reps, n))
        progress("bench: the registration cache under a 16 MiB share, a 64 MiB working set")
        res.update(bench_budget(500 if quick else 5000, seed))
        res.update(vmscale.run(10_000 if quick else 100_000, 10 if quick else 50))
        res["targets"] = _targets(res, lambda k: k in res)
        return res
    if only_cuda:
        res.update(bench_cuda(reps, n))
        res["targets"] = _targets(res, lambda k: k in res)
        return res
    steps: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("hit path", lambda: bench_hit(reps, n)),
        ("reuse trace", lambda: bench_trace(2000 if quick else 10_000, seed)),
        ("scale", lambda: bench_scale(reps, n, 10_000 if quick else 100_000)),
        ("pressure", lambda: bench_pressure(500 if quick else 5000, seed)),
        ("threads", lambda: bench_threads(10_000 if quick else 50_000)),
    ]
    if vm:
        steps.append(("real ioctls", lambda: bench_vm(5 if quick else 50)))
        steps.append(("the simulator's buffer-id hit", lambda: bench_sim_hit(reps, n)))
    if cuda:
        steps.append(("CUDA buffer-id queries", lambda: bench_cuda(reps, n)))
    t0 = time.monotonic()
    for i, (name, step) in enumerate(steps, 1):
        progress(f"bench: {i}/{len(steps)} {name} ({time.monotonic() - t0:.0f} s so far)")
        res.update(step())
    progress(f"bench: done in {time.monotonic() - t0:.0f} s")
    res["targets"] = _targets(res, lambda k: True)
    return res


def _targets(res: dict[str, Any], keep: Callable[[str], bool]) -> dict[str, Any]:
    """The goals in TARGETS that ``keep`` picks: each with what ``res`` measured and whether
    that met it."""
    return {
        k: {"target": v, "measured": res.get(k), "met": _met(k, v, res.get(k))} for k, v in TARGETS.items() if keep(k)
    }


def progress(msg: str) -> None:
    """A line on stderr (the results go to stdout): long runs say what they are doing."""
    print(msg, file=sys.stderr, flush=True)


def _met(key: str, target: float, value: Any) -> bool | None:
    if not isinstance(value, (int, float)):
        return None
    if key in (
        "trace_pin_reduction",
        "trace_speedup_modelled",
        "gds_registration_reduction",
        "gds_speedup",
        "nixl_registration_reduction",
        "nixl_registration_time_reduction",
        "nixl_scatter_ep_over_raw_throughput",
    ):
        return value >= target
    return value <= target


def format_table(res: dict[str, Any]) -> str:
    w = max([32, *(len(k) for k in res if k != "targets")])
    lines = [f"{'figure':<{w}} {'value':>14}"]
    for k, v in res.items():
        if k == "targets":
            continue
        lines.append(f"{k:<{w}} {v:>14.3f}" if isinstance(v, float) else f"{k:<{w}} {v!s:>14}")
    if any(k.endswith("_modelled") for k in res):
        lines.append(
            f"(*_modelled: over FakeDevice, which busy-waits {TRACE_PIN_LATENCY_S * 1e6:.0f} µs per pin; "
            "modelled, not measured)"
        )
    if not res["targets"]:
        return "\n".join(lines)
    lines.append("")
    tw = max([28, *(len(k) for k in res["targets"])])
    lines.append(f"{'target':<{tw}} {'goal':>8} {'measured':>10}  met")
    for k, t in res["targets"].items():
        m = t["measured"]
        ms = f"{m:.3f}" if isinstance(m, float) else str(m)
        lines.append(f"{k:<{tw}} {t['target']:>8} {ms:>10}  {t['met']}")
    return "\n".join(lines)


def main_args(a: argparse.Namespace) -> None:
    res = run(
        quick=a.quick,
        vm=a.vm,
        cuda=a.cuda,
        seed=a.seed,
        only_cuda=a.only_cuda,
        only_vm=a.only_vm,
        gds=getattr(a, "gds", False),
        nixl=getattr(a, "nixl", False),
    )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=2)
    print(json.dumps(res, indent=2) if a.json else format_table(res), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m gpupin.tools.bench", description=__doc__)
    add_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print JSON")
    main_args(parser.parse_args())
