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


def test_buffer_ids_are_answered_in_c_as_allocations_come_and_go() -> None:
    """The C query (what a cache's hit calls, no Python) agrees with buffer_id(): the id of
    the allocation holding an address, none in a gap or past the arena, a new id for a freed
    address handed out again, none at all once the memory is closed."""
    from gpupin._native import ffi, lib

    mem = HostMemory(1 << 20)
    out = ffi.new("uint64_t *")

    def query(ptr: int) -> int | None:
        ret = lib.gp_host_query(mem.c_buffer_id_ctx, ptr, out)
        assert ret in (0, -2), ret  # 0, or -ENOENT
        return int(out[0]) if ret == 0 else None

    try:
        assert mem.direct_buffer_id_query and mem.c_buffer_id_query != ffi.NULL
        a, b = mem.alloc(8192), mem.alloc(100)  # b: one granule (4096)
        assert query(a) == query(a + 8191) == mem.buffer_id(a)
        assert query(b) == query(b + 4095) == mem.buffer_id(b) != query(a)
        assert query(b + 4096) is None and query(mem.BASE - 1) is None and query(mem.BASE + (1 << 20)) is None
        old = query(a)
        mem.free(a)
        assert query(a) is None and query(a + 4096) is None
        c = mem.alloc(4096, at=a + 4096)
        assert query(c) == mem.buffer_id(c) != old and query(a) is None
        mem.close()
        assert query(c) is None  # a cache's entries over closed memory are stale
    finally:
        mem.close()
    with pytest.raises(gpupin.InvalidArgument, match="power of two"):
        HostMemory(1 << 20, granule=3000)
