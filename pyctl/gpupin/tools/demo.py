"""``make demo``: pinning, caching and invalidation end to end, narrated.

Loads the modules if needed (the simulator unless nvidia.ko is present), then
walks through what gpupin does.  Run as root where modules can be loaded:
scripts/demo.sh runs it on this host when it can load modules into its own
kernel, else in the VM harness.
"""

from __future__ import annotations

import os
import sys
import textwrap

from .. import kmod
from ..cache import RegistrationCache
from ..device import Device
from ..errors import GpupinError
from ..sim import SimMemory, sim_stats

KiB, MiB = 1 << 10, 1 << 20


def say(title: str, text: str = "") -> None:
    print(f"\n== {title}")
    if text:
        print(textwrap.indent(textwrap.dedent(text).strip(), "   "))


def pci_device() -> str | None:
    try:
        devs = sorted(os.listdir("/sys/bus/pci/devices"))
    except OSError:
        return None
    return devs[-1] if devs else None


def _peer_and_dmabuf(dev: Device, mem: SimMemory) -> None:
    from ..peer import Peer, load_peer

    load_peer()
    va = mem.alloc(256 * KiB)
    mem.write(va + 70_000, b"bytes the peer device reads by DMA")
    pin = dev.pin(va, 256 * KiB)
    with Peer() as peer:
        print(f"   peer read via nv-p2p pin {pin.handle}: {peer.read(dev, pin, 70_000, 34)!r}")
        fd = mem.export_dmabuf(va)
        dpin = dev.pin_dmabuf(fd)
        os.close(fd)
        print(
            f"   dma-buf pin {dpin.handle}: {dpin.entries} pages of {dpin.page_size} bytes; peer read: "
            f"{peer.read(dev, dpin, 70_000, 34)!r}"
        )
        mem.free(va)
        print(
            f"   freed: nv-p2p pin valid {pin.is_valid()}, dma-buf pin valid {dpin.is_valid()} "
            f"(NVIDIA's exporter keeps the memory while the pin holds the buffer), "
            f"records {[e.reason for e in dev.read_events()]}"
        )
    dev.unpin(pin)
    dev.unpin(dpin)


def main() -> int:
    say("1. Load the modules")
    use_sim = not kmod.is_loaded("nvidia")
    if use_sim and not kmod.is_loaded("nvp2p_sim"):
        kmod.load(kmod.module_file("nvp2p_sim"))
        print("   loaded nvp2p_sim (no NVIDIA driver here: the simulator provides nv-p2p)")
    if not kmod.is_loaded("gpupin"):
        kmod.load(kmod.module_file("gpupin"))
        print("   loaded gpupin")
    if not use_sim:
        print("   nvidia.ko is loaded; this demo allocates simulated memory and needs nvp2p_sim")
        return 0
    dev, mem = Device(), SimMemory()
    info = dev.info()
    print(
        f"   /dev/gpupin: ABI {info.abi_version}, version {info.version}, provider {info.provider}, "
        f"persistent={info.persistent}, dma_map={info.dma_map}"
    )

    say("2. Pin GPU memory", "A buffer of 100 KiB at an odd offset is widened to whole 64 KiB GPU pages.")
    va = mem.alloc(1 * MiB)
    mem.write(va + 4096, b"hello from the GPU")
    pin = dev.pin(va + 4096, 100 * KiB, user_tag=42)
    print(
        f"   pin {pin.handle}: asked [{pin.va:#x}, +{pin.size}) -> pinned [{pin.aligned_va:#x}, "
        f"+{pin.aligned_size}), {pin.entries} pages of {pin.page_size} bytes"
    )
    print(f"   GPU UUID {pin.gpu_uuid.hex()}; valid (one memory read of the validity map): {pin.is_valid()}")
    pages = dev.get_pages(pin)
    print(f"   physical pages (root only): {[hex(p) for p in pages]}")
    pci = pci_device()
    if pci:
        m = dev.dma_map(pin, pci)
        print(f"   DMA-mapped for {pci}: mapping {m.mapping_id}, bus addresses {[hex(a) for a in dev.dma_addrs(m)]}")

    say(
        "3. Free the memory while it is pinned",
        "The provider runs gpupin's free callback synchronously inside the free: the pin is "
        "invalidated, its DMA mapping goes, the validity word changes and a record is queued.",
    )
    mem.free(va)
    print(f"   valid now: {pin.is_valid()}; state: {dev.query(pin).state}")
    for ev in dev.wait_invalidations(1.0):
        print(f"   invalidation record: handle {ev.handle}, tag {ev.user_tag}, reason {ev.reason}")
    dev.unpin(pin)
    print("   unpinned the dead handle; simulator leaks:", sim_stats().leaks() or "none")

    say(
        "4. The registration cache",
        "First use pins the whole allocation; later uses inside it are hits with no ioctl. "
        "A new allocation at the same address is detected and re-pinned.",
    )
    cache = RegistrationCache(dev, mem, validate="both")
    bufs = [mem.alloc(2 * MiB) for _ in range(4)]
    for i in range(1000):
        with cache.acquire(bufs[i % 4] + (i * 4096) % MiB, 4096):
            pass
    st = cache.stats()
    print(f"   1000 transfers over 4 buffers: {st.pins} pins, {st.hits} hits, {st.misses} misses")
    old = bufs[0]
    mem.free(old)
    bufs[0] = mem.alloc(2 * MiB)
    print(f"   freed buffer 0 and allocated again: same address? {bufs[0] == old}")
    with cache.acquire(bufs[0], 4096) as reg:
        print(f"   acquire -> pin handle {reg.handle}, valid {reg.valid}")
    st = cache.stats()
    print(
        f"   now {st.pins} pins, {st.invalidations_kernel + st.invalidations_buffer_id} invalidation caught, "
        f"{st.regions} regions, {st.bytes_pinned >> 20} MiB pinned"
    )

    say(
        "5. A third-party driver and a dma-buf",
        "gpupin_peer (an example driver on gpupin's kernel API) copies through the pin's DMA "
        "mapping. The same memory exported as a dma-buf (as NVIDIA's exporter does it) is "
        "pinned too; freeing the allocation invalidates the nv-p2p pin, while the dma-buf pin "
        "keeps the memory until it is unpinned.",
    )
    _peer_and_dmabuf(dev, mem)

    say("6. Clean up")
    cache.purge()
    for b in bufs:
        mem.free(b)
    dev.close()
    mem.close()
    if kmod.is_loaded("gpupin_peer"):
        kmod.unload("gpupin_peer")
    leaks = sim_stats().leaks()
    print(f"   everything released; simulator counters: {leaks or 'all zero'}")
    return 1 if leaks else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except GpupinError as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        sys.exit(1)
