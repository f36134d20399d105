"""HostMemory, and the free holds every provider gpupin ships keeps (ProviderBase)."""

from __future__ import annotations

import pytest

import gpupin
from gpupin.hostmem import HostMemory


def test_a_held_allocation_is_not_freed_until_every_hold_is_released() -> None:
    mem = HostMemory(4 << 20)
    try:
        a = mem.alloc(1 << 20)
        b = mem.alloc(1 << 20)
        h1 = mem.hold_free(a + 4096, "exposed to a peer")  # any address inside names the allocation
        h2 = mem.hold_free(a, "a second holder")
        with pytest.raises(gpupin.InUse, match=r"exposed to a peer \(and 1 more\)"):
            mem.free(a)
        assert mem.buffer_id(a)  # refused: nothing changed
        mem.free(b)  # another allocation is not held
        mem.release_free_hold(h1)
        with pytest.raises(gpupin.InUse, match="a second holder"):
            mem.free(a)
        mem.release_free_hold(h2)
        mem.release_free_hold(h2)  # twice: nothing
        mem.free(a)
        with pytest.raises(gpupin.NotGpuMemory):
            mem.hold_free(a, "freed")  # no allocation there to hold
    finally:
        mem.close()
