"""Pins the kernel never invalidates (persistent, static dma-buf exporters) and the cache's
validate='kernel' refusal of them, on FakeDevice/FakeMemory."""

from __future__ import annotations

import os

import pytest

import gpupin
from gpupin.cache import RegistrationCache
from gpupin.testing.fake import FakeDevice, FakeMemory, FakePin

MiB = 1 << 20


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_fake_nvp2p_pin_is_revocable_and_invalidated_on_free() -> None:
    mem = FakeMemory()
    dev = FakeDevice(mem)
    a = mem.alloc(MiB)
    p = dev.pin(a, MiB)
    assert p.revocable and not p.persistent and not p.dmabuf
    mem.free(a)
    assert not p.is_valid() and dev.live_pins == 0 and [e.handle for e in dev.read_events()] == [p.handle]
    dev.unpin(p)


def test_fake_persistent_pin_is_not_revocable_and_holds_the_memory() -> None:
    mem = FakeMemory()
    dev = FakeDevice(mem)
    a = mem.alloc(MiB)
    p = dev.pin(a, MiB, persistent=True)
    assert p.persistent and not p.revocable
    mem.free(a)
    assert p.is_valid() and dev.live_pins == 1 and dev.bar_used == MiB and dev.read_events() == []
    dev.unpin(p)
    assert dev.bar_used == 0 and dev.live_pins == 0


@pytest.mark.parametrize("revocable", [False, True])
def test_fake_dmabuf_pin_follows_its_exporter(revocable: bool) -> None:
    mem = FakeMemory()
    dev = FakeDevice(mem, dmabuf_revocable=revocable)
    a = mem.alloc(2 * MiB)
    fd = mem.export_dmabuf(a + 5)
    p = dev.pin_dmabuf(fd, user_tag=a)
    os.close(fd)
    assert p.dmabuf and p.revocable is revocable and (p.va, p.size) == (0, 2 * MiB)
    mem.free(a)
    b = mem.alloc(2 * MiB)
    assert b == a  # the same address, other memory
    # A static exporter holds the memory: nothing tells the pin that the address was reused.
    assert p.is_valid() is not revocable and dev.live_pins == (0 if revocable else 1)
    assert len(dev.read_events()) == (1 if revocable else 0)
    dev.unpin(p)
    assert dev.bar_used == 0


def test_fake_pin_dmabuf_refuses_other_fds() -> None:
    mem = FakeMemory()
    dev = FakeDevice(mem)
    r, w = os.pipe()
    try:
        with pytest.raises(gpupin.InvalidArgument, match="not a dma-buf"):
            dev.pin_dmabuf(r)
    finally:
        os.close(r)
        os.close(w)
    assert dev.pins == {}


def test_kernel_validation_refuses_a_static_dmabuf_and_leaks_nothing() -> None:
    mem = FakeMemory()
    dev = FakeDevice(mem)  # NVIDIA's exporter: static
    cache = RegistrationCache(dev, mem, validate="kernel", backend="dmabuf")
    a = mem.alloc(MiB)
    fds = open_fds()
    with pytest.raises(gpupin.NotRevocable, match=r"validate='buffer_id' or 'both'") as ei:
        cache.acquire(a, 10)
    assert isinstance(ei.value, gpupin.InvalidArgument)
    assert "dma-buf" in str(ei.value) and "never" in str(ei.value)
    assert dev.pin_calls == 1 and dev.pins == {} and dev.bar_used == 0 and dev.unpin_calls == 1
    assert open_fds() == fds  # the exported fd is closed too
    st = cache.stats()
    assert (len(cache), st.regions, st.bytes_pinned, st.pins, st.in_use) == (0, 0, 0, 0, 0)
    with pytest.raises(gpupin.NotRevocable):  # every time: nothing half-cached was left
        cache.acquire(a, 10)
    assert dev.pins == {}
    cache.close()


def test_kernel_validation_refuses_a_pin_the_kernel_does_not_call_revocable() -> None:
    """A gpupin.ko without GPUPIN_PIN_REVOCABLE marks no pin: validate='kernel' says so."""

    class OldKernel(FakeDevice):
        def pin(self, va: int, size: int, *, persistent: bool = False, user_tag: int = 0) -> FakePin:
            p = super().pin(va, size, persistent=persistent, user_tag=user_tag)
            p.revocable = False
            return p

    mem = FakeMemory()
    dev = OldKernel(mem)
    cache = RegistrationCache(dev, mem, validate="kernel")
    with pytest.raises(gpupin.NotRevocable, match="did not mark revocable"):
        cache.acquire(mem.alloc(MiB), 1)
    assert dev.pins == {}
    # Buffer-id validation works with the same pins.
    by_id = RegistrationCache(dev, mem, validate="buffer_id")
    with by_id.acquire(mem.alloc(MiB), 1) as r:
        assert r.valid
    by_id.close()
    assert dev.pins == {}


def test_kernel_validation_with_a_revoking_exporter() -> None:
    mem = FakeMemory()
    dev = FakeDevice(mem, dmabuf_revocable=True)
    cache = RegistrationCache(dev, mem, validate="kernel", backend="dmabuf")
    a = mem.alloc(MiB)
    with cache.acquire(a, 10) as r:
        h1 = r.handle
        assert dev.pins[h1].revocable and dev.pins[h1].dmabuf
    mem.free(a)
    assert mem.alloc(MiB) == a
    with cache.acquire(a, 10) as r:
        assert r.handle != h1 and r.valid
    st = cache.stats()
    assert (st.pins, st.unpins, st.invalidations_kernel) == (2, 1, 1)
    cache.close()
    assert dev.pins == {} and dev.bar_used == 0


@pytest.mark.parametrize("validate", ["buffer_id", "both"])
def test_buffer_id_validation_catches_reuse_under_a_static_dmabuf(validate: str) -> None:
    """NVIDIA's case: the old pin stays 'valid' after the free; the buffer id tells, and the
    cache's unpin of the stale entry gives the held memory back."""
    mem = FakeMemory()
    dev = FakeDevice(mem)
    cache = RegistrationCache(dev, mem, validate=validate, backend="dmabuf")  # type: ignore[arg-type]
    a = mem.alloc(MiB)
    with cache.acquire(a, 10) as r:
        old = dev.pins[r.handle]
        assert not old.revocable
    mem.free(a)
    assert old.is_valid() and dev.bar_used == MiB  # freed, but held by the pin
    assert mem.alloc(MiB) == a
    with cache.acquire(a, 10) as r:
        assert r.handle != old.handle and r.valid
    assert old.handle not in dev.pins and dev.bar_used == MiB  # the old memory went back
    st = cache.stats()
    assert (st.pins, st.unpins, st.invalidations_buffer_id, st.invalidations_kernel) == (2, 1, 1, 0)
    cache.close()
    assert dev.pins == {} and dev.bar_used == 0


def test_dmabuf_pci_is_only_for_the_dmabuf_backend() -> None:
    with pytest.raises(gpupin.InvalidArgument, match="only for the dma-buf backend"):
        mem = FakeMemory()
        RegistrationCache(FakeDevice(mem), mem, dmabuf_pci="0000:00:03.0")
