"""The registration cache under threads over gpupin.ko and the simulator, in every validate mode,
with SimMemory's buffer-id query in C as on a GPU host (gpupin.testing.stress: hits, inserts,
frees and reallocations, evictions, purge(), close() and close(timeout=) racing).

A few seconds per mode in the normal suite; GPUPIN_LONG=1 (make test-long) runs ten minutes in
all, a third per mode; GPUPIN_CACHE_STRESS_S sets the seconds per mode.
"""

from __future__ import annotations

import os

import pytest

from conftest import SLOW, MiB
from gpupin import Device, SimMemory
from gpupin.cache import RegistrationCache
from gpupin.testing.stress import stress_cache

pytestmark = pytest.mark.vm
LONG = os.environ.get("GPUPIN_LONG") == "1"
# Seconds per mode that a run lasts however soon it did everything (0: until it did, 2 s at least).
STRESS_S = float(os.environ.get("GPUPIN_CACHE_STRESS_S") or (200 if LONG else 0))


@pytest.mark.simonly(reason="the simulator's buffer-id query in C and its reuse of freed addresses")
@pytest.mark.parametrize("validate", ["kernel", "buffer_id", "both"])
def test_threads_over_the_simulator_get_only_the_current_allocation(
    device: Device, sim: SimMemory, validate: str
) -> None:
    """No exception escapes a thread but the documented refusals, every registration and
    token handed out is of the allocation at its address at that moment (its buffer id
    against the simulator's), no reference is left, and close() unpins everything."""
    # Nine allocations in use over four regions: inserts evict (LRU) as well as purge.
    cache = RegistrationCache(device, sim, validate=validate, max_regions=4)  # type: ignore[arg-type]
    assert not cache._py_buffer_id, "SimMemory's buffer-id check must run in C"
    limit = STRESS_S or 60 * SLOW
    res = stress_cache(cache, sim, size=MiB, seconds=limit, at_least=STRESS_S or 2.0)
    assert not res.hung, "a thread hung"
    assert not res.errors, res.errors[:3]
    assert not res.wrong, res.wrong[:3]
    assert res.did_everything, (f"in {limit} s the threads did not do each thing once", cache.stats(), res)
    assert cache.held() == 0, "a reference was never released"
    assert not cache.closed
    cache.close(timeout=5)
    assert cache.closed and device.info().file_pins == 0
