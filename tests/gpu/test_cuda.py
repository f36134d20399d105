"""CudaMemory facts (the buffer-id facts of Documentation/measurements.md) and the registration
cache over real CUDA memory."""

from __future__ import annotations

import ctypes
import os

import pytest

import gpupin
from gpupin.cache import RegistrationCache
from gpupin.testing.fake import FakeDevice

MiB = 1 << 20


def ok(res):  # type: ignore[no-untyped-def]
    """Unwrap a cuda-python (err, value...) result, failing on an error."""
    err = res[0] if isinstance(res, tuple) else res
    assert int(err) == 0, f"CUDA call failed: {err}"
    if isinstance(res, tuple):
        return res[1] if len(res) == 2 else res[1:]
    return None


def realloc_same_va(cuda, size: int, tries: int = 8, again=None):  # type: ignore[no-untyped-def]
    """Allocate, free and allocate again (from ``again``, another GPU's CudaMemory, if given)
    until the same address comes back: (first address, its buffer id, second address)."""
    second = cuda if again is None else again
    for _ in range(tries):
        a = cuda.alloc(size)
        ida = cuda.buffer_id(a)
        cuda.free(a)
        b = second.alloc(size)
        if b == a:
            return a, ida, b
        second.free(b)
    pytest.fail(f"cuMemAlloc never returned a freed address again in {tries} tries")


def test_buffer_id_changes_on_free_and_realloc(cuda) -> None:  # type: ignore[no-untyped-def]
    a, id_a, b = realloc_same_va(cuda, 2 * MiB)
    assert cuda.buffer_id(b) != id_a
    assert cuda.buffer_id(b) == cuda.buffer_id_cuda_python(b)
    r = cuda.range_of(b + 4096)
    assert (r.base, r.size) == (b, 2 * MiB) and r.buffer_id == cuda.buffer_id(b)
    cuda.free(b)


def test_driver_status_through_cuda_python(cuda) -> None:  # type: ignore[no-untyped-def]
    """driver_status ('gpupin nixl status', the VRAM line) asks cuda-python: the driver and its GPUs."""
    from gpupin.cuda import driver_status

    ok, seen = driver_status()
    assert ok and seen.startswith("CUDA driver ") and seen.endswith("device(s)"), seen


def test_freed_and_host_pointers_are_not_gpu_memory(cuda) -> None:  # type: ignore[no-untyped-def]
    a = cuda.alloc(MiB)
    cuda.free(a)
    for fn in (cuda.range_of, cuda.buffer_id, cuda.buffer_id_cuda_python):
        with pytest.raises(gpupin.NotGpuMemory):
            fn(a)
    host = ctypes.create_string_buffer(4096)
    with pytest.raises(gpupin.NotGpuMemory):
        cuda.range_of(ctypes.addressof(host))
    assert not cuda.is_device_memory(ctypes.addressof(host))


def test_managed_memory_refused(cuda, cu) -> None:  # type: ignore[no-untyped-def]
    p = int(ok(cu.cuMemAllocManaged(MiB, cu.CUmemAttach_flags.CU_MEM_ATTACH_GLOBAL.value)))
    try:
        with pytest.raises(gpupin.NotGpuMemory, match="managed"):
            cuda.range_of(p)
    finally:
        ok(cu.cuMemFree(p))


class Vmm:
    """Two physical chunks mapped back to back in one reserved range."""

    def __init__(self, cu, device: int = 0) -> None:  # type: ignore[no-untyped-def]
        self.cu = cu
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device
        self.prop = prop
        gran = int(
            ok(
                cu.cuMemGetAllocationGranularity(
                    prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
                )
            )
        )
        self.chunk = max(gran, 2 * MiB)
        self.base = int(ok(cu.cuMemAddressReserve(2 * self.chunk, 0, 0, 0)))
        self.handles = [None, None]
        for i in range(2):
            self.map(i)

    def map(self, i: int) -> None:
        cu = self.cu
        h = ok(cu.cuMemCreate(self.chunk, self.prop, 0))
        ok(cu.cuMemMap(self.base + i * self.chunk, self.chunk, 0, h, 0))
        access = cu.CUmemAccessDesc()
        access.location = self.prop.location
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        ok(cu.cuMemSetAccess(self.base + i * self.chunk, self.chunk, [access], 1))
        self.handles[i] = h

    def unmap(self, i: int) -> None:
        ok(self.cu.cuMemUnmap(self.base + i * self.chunk, self.chunk))
        ok(self.cu.cuMemRelease(self.handles[i]))
        self.handles[i] = None

    def close(self) -> None:
        for i in range(2):
            if self.handles[i] is not None:
                self.unmap(i)
        ok(self.cu.cuMemAddressFree(self.base, 2 * self.chunk))


def test_vmm_chunks_have_their_own_ids_and_ranges(cuda, cu) -> None:  # type: ignore[no-untyped-def]
    v = Vmm(cu)
    try:
        # RANGE_START/RANGE_SIZE span the reservation; range_of reports the chunk's mapping.
        r0, r1 = cuda.range_of(v.base + 100), cuda.range_of(v.base + v.chunk + 100)
        assert (r0.base, r0.size) == (v.base, v.chunk) and (r1.base, r1.size) == (v.base + v.chunk, v.chunk)
        assert r0.buffer_id != r1.buffer_id
        old = r1.buffer_id
        v.unmap(1)
        with pytest.raises(gpupin.NotGpuMemory):
            cuda.buffer_id(v.base + v.chunk)
        v.map(1)
        assert cuda.buffer_id(v.base + v.chunk) != old
    finally:
        v.close()


def test_pool_reuse_gives_a_new_id(cuda, cu) -> None:  # type: ignore[no-untyped-def]
    stream = ok(cu.cuStreamCreate(0))
    try:
        a = int(ok(cu.cuMemAllocAsync(2 * MiB, stream)))
        ok(cu.cuStreamSynchronize(stream))
        id_a = cuda.buffer_id(a)
        ok(cu.cuMemFreeAsync(a, stream))
        b = int(ok(cu.cuMemAllocAsync(2 * MiB, stream)))
        ok(cu.cuStreamSynchronize(stream))
        assert b == a, "the pool did not hand the same address back"
        assert cuda.buffer_id(b) != id_a
        ok(cu.cuMemFreeAsync(b, stream))
        ok(cu.cuStreamSynchronize(stream))
    finally:
        ok(cu.cuStreamDestroy(stream))


def test_sync_memops_once_per_allocation(cuda, cu) -> None:  # type: ignore[no-untyped-def]
    cache = RegistrationCache(FakeDevice(cuda), cuda, validate="buffer_id")
    a = cuda.alloc(4 * MiB)
    attr = cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_SYNC_MEMOPS
    assert not ok(cu.cuPointerGetAttribute(attr, a)), "a new cuMemAlloc has SYNC_MEMOPS off"
    for off in (0, 4096, 3 * MiB):
        cache.acquire(a + off, 64).release()
    assert ok(cu.cuPointerGetAttribute(attr, a)), "the cache did not set SYNC_MEMOPS (CUDA says)"
    assert cuda.sync_memops_calls == 1
    cache.purge()
    cache.acquire(a, 64).release()  # same allocation: not set again
    assert cuda.sync_memops_calls == 1
    cache.purge()
    cuda.free(a)


@pytest.mark.parametrize("validate", ["buffer_id", "both"])
def test_cache_buffer_id_check_misses_on_realloc(cuda, validate: str) -> None:  # type: ignore[no-untyped-def]
    dev = FakeDevice(cuda)
    cache = RegistrationCache(dev, cuda, validate=validate)  # type: ignore[arg-type]
    assert cache._py_buffer_id is False, "the buffer-id check should run in C through libcuda"
    for _ in range(8):  # until cuMemAlloc hands the freed address back: the case under test
        a = cuda.alloc(2 * MiB)
        with cache.acquire(a + 100, 100) as r:
            h = r.handle
        with cache.acquire(a, 2 * MiB) as r:
            assert r.handle == h
        cuda.free(a)
        # The fake device is not told about the free: only the buffer id can catch it.
        b = cuda.alloc(2 * MiB)
        if b == a:
            break
        cache.purge()
        cuda.free(b)
    else:
        pytest.fail("cuMemAlloc never returned a freed address again in 8 tries")
    before = cache.stats()
    with cache.acquire(b, 64) as r:
        assert r.handle != h
    st = cache.stats()
    assert st.invalidations_buffer_id == before.invalidations_buffer_id + 1 and st.misses == before.misses + 1
    cache.purge()
    cuda.free(b)


def test_cache_misses_on_vmm_remap_and_pool_reuse(cuda, cu) -> None:  # type: ignore[no-untyped-def]
    cache = RegistrationCache(FakeDevice(cuda), cuda, validate="buffer_id")
    v = Vmm(cu)
    try:
        with cache.acquire(v.base + v.chunk, 64) as r:
            h = r.handle
            assert r.aligned_va == v.base + v.chunk and r.aligned_size == v.chunk
        v.unmap(1)
        v.map(1)
        with cache.acquire(v.base + v.chunk, 64) as r:
            assert r.handle != h
        assert cache.stats().invalidations_buffer_id == 1
    finally:
        cache.purge()
        v.close()
    stream = ok(cu.cuStreamCreate(0))
    try:
        for _ in range(8):  # until the pool hands the freed block back at the same address
            a = int(ok(cu.cuMemAllocAsync(2 * MiB, stream)))
            ok(cu.cuStreamSynchronize(stream))
            cache.acquire(a, 64).release()
            ok(cu.cuMemFreeAsync(a, stream))
            b = int(ok(cu.cuMemAllocAsync(2 * MiB, stream)))
            ok(cu.cuStreamSynchronize(stream))
            if b == a:
                break
            cache.purge()
            ok(cu.cuMemFreeAsync(b, stream))
            ok(cu.cuStreamSynchronize(stream))
        else:
            pytest.fail("the stream-ordered pool never handed a freed block back at its address")
        before = cache.stats().invalidations_buffer_id
        cache.acquire(b, 64).release()
        assert cache.stats().invalidations_buffer_id == before + 1
        cache.purge()
        ok(cu.cuMemFreeAsync(b, stream))
        ok(cu.cuStreamSynchronize(stream))
    finally:
        ok(cu.cuStreamDestroy(stream))


def test_same_va_on_another_gpu(cuda, cu) -> None:  # type: ignore[no-untyped-def]
    """Memory freed on GPU 0 and its address reused on GPU 1 (one unified address space): a new
    buffer id, and the range is GPU 1's allocation."""
    from gpupin.cuda import CudaMemory

    if int(ok(cu.cuDeviceGetCount())) < 2:
        pytest.skip("needs two GPUs; this machine has one")
    g1 = CudaMemory(1)
    # cuMemAlloc allocates in the thread's current context, which each CudaMemory sets when
    # made: make GPU 0's or GPU 1's current for each call.
    on0, on1 = OnContext(cu, cuda), OnContext(cu, g1)
    try:
        a, id_a, b = realloc_same_va(on0, 2 * MiB, tries=32, again=on1)
        try:
            # GPU 1's context owns it (DEVICE_ORDINAL read through cuda-python 13.3 says 0 for
            # either GPU's memory, measured on two H200s; CONTEXT tells them apart).
            owner = ok(cu.cuPointerGetAttribute(cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_CONTEXT, b))
            assert int(owner) == int(g1._ctx) != int(cuda._ctx)
            assert on1.buffer_id(b) != id_a
            r = g1.range_of(b)
            assert (r.base, r.size, r.buffer_id) == (b, 2 * MiB, on1.buffer_id(b))
        finally:
            on1.free(b)
    finally:
        ok(cu.cuCtxSetCurrent(cuda._ctx))
        g1.close()


class OnContext:
    """A CudaMemory whose alloc, free and buffer_id run with its own context current."""

    def __init__(self, cu, mem) -> None:  # type: ignore[no-untyped-def]
        self.cu, self.mem = cu, mem

    def alloc(self, size: int) -> int:
        ok(self.cu.cuCtxSetCurrent(self.mem._ctx))
        return int(self.mem.alloc(size))

    def free(self, ptr: int) -> None:
        ok(self.cu.cuCtxSetCurrent(self.mem._ctx))
        self.mem.free(ptr)

    def buffer_id(self, ptr: int) -> int:
        return int(self.mem.buffer_id(ptr))


def test_dmabuf_export_of_each_kind(cuda, cu) -> None:  # type: ignore[no-untyped-def]
    """cuMemGetHandleForAddressRange(DMA_BUF_FD) for cuMemAlloc, a VMM chunk and pool memory."""
    import os

    sizes = {}

    def export(ptr: int) -> int:
        fd = cuda.export_dmabuf(ptr)
        try:
            return os.lseek(fd, 0, os.SEEK_END)
        finally:
            os.close(fd)

    a = cuda.alloc(3 * MiB)
    sizes["cuMemAlloc"] = (export(a + 100), cuda.range_of(a).size)
    cuda.free(a)
    v = Vmm(cu)
    try:
        sizes["vmm_chunk"] = (export(v.base + v.chunk + 5), v.chunk)
    finally:
        v.close()
    stream = ok(cu.cuStreamCreate(0))
    try:
        p = int(ok(cu.cuMemAllocAsync(2 * MiB, stream)))
        ok(cu.cuStreamSynchronize(stream))
        sizes["pool"] = (export(p), cuda.range_of(p).size)
        ok(cu.cuMemFreeAsync(p, stream))
        ok(cu.cuStreamSynchronize(stream))
    finally:
        ok(cu.cuStreamDestroy(stream))
    print(f"dma-buf export sizes (buffer, allocation): {sizes}")
    for kind, (buf, alloc) in sizes.items():
        assert buf >= alloc, f"{kind}: the dma-buf ({buf}) is smaller than the allocation ({alloc})"


def test_calls_from_another_thread_use_this_gpus_context(cuda) -> None:  # type: ignore[no-untyped-def]
    """A CUDA context is current per thread: a thread that never made one current (a cache's
    worker, a pool's) still allocates, copies and frees on this CudaMemory's GPU."""
    import threading

    got: list[object] = []

    def worker() -> None:
        try:
            a = cuda.alloc(2 * MiB)
            cuda.write(a, b"thread" * 100)
            got.append(cuda.read(a, 600))
            cuda.free(a)
        except Exception as exc:  # reported by the assertion below
            got.append(exc)

    t = threading.Thread(target=worker)
    t.start()
    t.join(60)
    assert got == [b"thread" * 100], got


@pytest.mark.parametrize("validate", ["buffer_id", "both"])
def test_cache_under_threads_over_cuda(cuda, validate: str) -> None:  # type: ignore[no-untyped-def]
    """The host and VM suites' thread stress over real CUDA memory, the buffer-id check through
    CudaMemory's direct query in C: no exception escapes a thread but the documented refusals,
    every hand-out is the allocation at its address at that moment, no reference is left.
    Not validate="kernel": that mode learns of a cuMemFree from gpupin.ko's free callback, and
    these hosts cannot load it (FakeDevice never hears of the free: it hands out stale pins).
    GPUPIN_CACHE_STRESS_S sets the seconds per mode (a few by default)."""
    from gpupin.testing.stress import stress_cache

    cache = RegistrationCache(FakeDevice(cuda), cuda, validate=validate, max_regions=4)  # type: ignore[arg-type]
    assert not cache._py_buffer_id, "CudaMemory's buffer-id check must run in C"
    seconds = float(os.environ.get("GPUPIN_CACHE_STRESS_S") or 0)
    res = stress_cache(cache, cuda, size=MiB, seconds=seconds or 120, at_least=seconds or 2.0)
    assert not res.hung, "a thread hung"
    assert not res.errors, res.errors[:3]
    assert not res.wrong, res.wrong[:3]
    assert res.did_everything, ("the threads did not do each thing once", cache.stats(), res)
    assert cache.held() == 0, "a reference was never released"
    cache.close(timeout=5)
    assert cache.closed
