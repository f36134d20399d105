"""GdsCache against the real cuFile (cuda.bindings.cufile + libcufile from the nvidia-cufile wheel).

On the lent machines cuFile runs in compatibility mode (no nvidia-fs); buffer
registration is real there.  File registration needs the file system's udev
properties; where cuFile refuses it the read test skips with cuFile's reason.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import pytest
from test_cuda import Vmm, ok

from gpupin.cache import CacheFull
from gpupin.errors import GdsError
from gpupin.gds import CuFileDriver, GdsCache, GdsFile, GdsPolicy

MiB = 1 << 20


def registered(drv: CuFileDriver, ptr: int, size: int) -> bool:
    """Whether cuFile holds a registration at ptr (probed: a register that succeeds is undone)."""
    cf = drv.cufile
    try:
        cf.buf_register(ptr, size, 0)
    except cf.cuFileError as exc:
        assert int(exc.status) == 5023, exc
        return True
    cf.buf_deregister(ptr)
    return False


def test_whole_allocation_registered_once(cuda, driver) -> None:  # type: ignore[no-untyped-def]
    cache = GdsCache(driver, cuda)
    assert cache._py_buffer_id is False, "the buffer-id check should run in C through libcuda"
    assert cache.max_bytes == cache.properties.max_device_pinned_mem_bytes > 0
    a = cuda.alloc(4 * MiB)
    try:
        for off in (0, 4096, 3 * MiB):
            cache.acquire(a + off, 4096).release()
        assert driver.registrations == 1
        assert registered(driver, a, 4 * MiB)
        st = cache.stats()
        assert (st.acquires, st.hits, st.pins, st.bytes_pinned) == (3, 2, 1, 4 * MiB)
        cache.close()
        assert not registered(driver, a, 4 * MiB)
    finally:
        cuda.free(a)


def test_double_registration_outside_the_cache_is_reported(cuda, driver) -> None:  # type: ignore[no-untyped-def]
    cache = GdsCache(driver, cuda)
    a = cuda.alloc(MiB)
    driver.cufile.buf_register(a, MiB, 0)
    try:
        with pytest.raises(GdsError, match="outside this cache") as ei:
            cache.acquire(a, 64)
        assert ei.value.status == 5023
    finally:
        driver.cufile.buf_deregister(a)
        cache.close()
        cuda.free(a)


def test_stale_registration_after_realloc_is_detected_and_repaired(cuda, driver) -> None:  # type: ignore[no-untyped-def]
    cache = GdsCache(driver, cuda)
    a = cuda.alloc(2 * MiB)
    cache.acquire(a, 64).release()
    old_id = cuda.buffer_id(a)
    cuda.free(a)
    b = cuda.alloc(2 * MiB)
    try:
        if b != a:
            pytest.fail("cuMemAlloc did not hand the freed address back")
        # cuFile still counts the freed address as registered: only the buffer id tells.
        assert registered(driver, b, 2 * MiB)
        with cache.acquire(b, 64) as reg:
            assert reg._entry.buffer_id == cuda.buffer_id(b) != old_id
        st = cache.stats()
        assert st.invalidations_buffer_id == 1 and st.pins == 2 and st.unpins == 1
        # The new registration is cuFile's current one: a second register is refused.
        assert registered(driver, b, 2 * MiB)
    finally:
        cache.close()
        cuda.free(b)


def test_stale_entry_still_in_use_is_superseded(cuda, driver) -> None:  # type: ignore[no-untyped-def]
    cache = GdsCache(driver, cuda)
    b = 0
    try:
        for _ in range(8):
            a = cuda.alloc(MiB)
            held = cache.acquire(a, 64)  # an IO still holds the registration
            cuda.free(a)
            b = cuda.alloc(MiB)
            if b == a:
                break
            held.release()
            cuda.free(b)
        else:
            pytest.fail("cuMemAlloc never handed a freed address back")
        new = cache.acquire(b, 64)  # deregisters the stale one, registers the new memory
        assert driver.superseded == 1
        held.release()  # must not deregister the new registration
        assert registered(driver, b, MiB)
        new.release()
        cache.close()
        assert not registered(driver, b, MiB)
    finally:
        cache.close()
        if b:
            cuda.free(b)


def test_pool_and_vmm_memory(cuda, cu, driver) -> None:  # type: ignore[no-untyped-def]
    cache = GdsCache(driver, cuda)
    stream = ok(cu.cuStreamCreate(0))
    v = Vmm(cu)
    try:
        a = int(ok(cu.cuMemAllocAsync(3 * 100_000, stream)))  # not a multiple of 64 KiB
        ok(cu.cuStreamSynchronize(stream))
        with cache.acquire(a + 1000, 1000) as r:
            assert (r.aligned_va, r.aligned_size) == (a, 300_000)
        ok(cu.cuMemFreeAsync(a, stream))
        b = int(ok(cu.cuMemAllocAsync(3 * 100_000, stream)))
        ok(cu.cuStreamSynchronize(stream))
        assert b == a, "the pool did not hand the freed block back"
        before = cache.stats().invalidations_buffer_id
        cache.acquire(b, 64).release()
        assert cache.stats().invalidations_buffer_id == before + 1
        # VMM: each mapped chunk is an allocation of its own.
        with cache.acquire(v.base + v.chunk + 64, 64) as r:
            assert (r.aligned_va, r.aligned_size) == (v.base + v.chunk, v.chunk)
        v.unmap(1)
        v.map(1)
        before = cache.stats().invalidations_buffer_id
        cache.acquire(v.base + v.chunk, 64).release()
        assert cache.stats().invalidations_buffer_id == before + 1
        cache.close()
        ok(cu.cuMemFreeAsync(b, stream))
        ok(cu.cuStreamSynchronize(stream))
    finally:
        cache.close()
        v.close()
        ok(cu.cuStreamDestroy(stream))


def test_limits_and_eviction(cuda, driver) -> None:  # type: ignore[no-untyped-def]
    cache = GdsCache(driver, cuda, max_bytes=3 * MiB)
    ptrs = [cuda.alloc(MiB) for _ in range(4)]
    try:
        for p in ptrs:
            cache.acquire(p, 64).release()
        st = cache.stats()
        assert st.evictions_limit == 1 and st.regions == 3
        assert not registered(driver, ptrs[0], MiB) and registered(driver, ptrs[3], MiB)
        held = [cache.acquire(p, 64) for p in ptrs[1:]]
        with pytest.raises(CacheFull):
            cache.acquire(ptrs[0], 64)
        for h in held:
            h.release()
    finally:
        cache.close()
        for p in ptrs:
            cuda.free(p)


def test_over_the_per_buffer_limit_is_left_to_bounce_buffers(cuda, driver) -> None:  # type: ignore[no-untyped-def]
    cache = GdsCache(driver, cuda)
    cap = cache.properties.max_device_pinned_mem_bytes
    assert cache.advise(cap + 1, reuse=100).reason == "too-large"
    assert cache.advise(4096, reuse=100).reason == "small"
    cache.close()


def _udev_reason() -> str:
    st = os.stat(os.getcwd())
    path = f"/run/udev/data/b{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    return f"{path} exists" if os.path.exists(path) else f"{path} is missing (no udev in this container)"


def test_read_into_cached_and_unregistered_buffers(cuda, driver, tmp_path: Any) -> None:  # type: ignore[no-untyped-def]
    path = os.path.join(os.getcwd(), ".gds-test.bin")  # a block-device file system, not tmpfs
    payload = os.urandom(2 * MiB)
    with open(path, "wb") as f:
        f.write(payload)
    cache = GdsCache(driver, cuda, policy=GdsPolicy(min_size=MiB))
    a, small = cuda.alloc(4 * MiB), cuda.alloc(64 * 1024)
    try:
        try:
            gf = GdsFile(driver, path)
        except GdsError as exc:
            pytest.skip(f"cuFile refuses file registration here ({_udev_reason()}): {exc}")
        with gf:
            for _ in range(3):
                with cache.buffer(a + 65536, 2 * MiB, reuse=8) as u:
                    assert u.registered
                    assert gf.read(u, 2 * MiB, 0) == 2 * MiB
            assert cuda.read(a + 65536, 2 * MiB) == payload
            assert driver.registrations == 1
            with cache.buffer(small, 4096) as u:
                assert not u.registered
                assert gf.read(u, 4096, 4096) == 4096
            assert cuda.read(small, 4096) == payload[4096:8192]
        st = cache.stats()
        assert st.hits == 2 and st.skipped == {"small": 1}
    finally:
        cache.close()
        cuda.free(a)
        cuda.free(small)
        os.unlink(path)


def test_doc_example_runs(cuda, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    """Documentation/gds-nixl.md's "For GPUDirect Storage users" example, as written."""
    page = os.path.join(os.path.dirname(__file__), "..", "..", "Documentation", "gds-nixl.md")
    doc = open(page).read()
    section = doc.split("## For GPUDirect Storage users", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    cwd = os.getcwd()
    work = tempfile.mkdtemp(dir=cwd)  # on the work tree's file system (tmp_path may be tmpfs)
    os.chdir(work)
    try:
        try:
            exec(compile(code, "Documentation/gds-nixl.md", "exec"), {})
        except GdsError as exc:
            if "cuFileHandleRegister" in str(exc):
                pytest.skip(f"cuFile refuses file registration here ({_udev_reason()}): {exc}")
            raise
    finally:
        os.chdir(cwd)
        shutil.rmtree(work)
    out = capsys.readouterr().out
    assert "pins=1," in out and "hits=7," in out and "skipped={}" in out, out
