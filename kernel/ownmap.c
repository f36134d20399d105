// SPDX-License-Identifier: (GPL-2.0 OR MIT)
/*
 * gpupin: its own DMA mappings of non-persistent nv-p2p pins.
 *
 * NVIDIA's nvidia_p2p_dma_map_pages cannot be called for a page table that a
 * free callback may release: it reads the table, then waits for the RM API
 * lock under which the callback runs, then links its mapping into the
 * table's private data, which NVIDIA frees when the callback returns (heap
 * corruption, not an error).  The callback cannot wait for such a mapper
 * either: the mapper may be waiting for the lock the callback's caller holds.
 *
 * So gpupin maps the pages of those pins itself, as an in-flight user of the
 * pin (gpupin_pin_use): that takes no NVIDIA lock, so the free callback
 * waits for the mapper, then unmaps every such mapping before it returns.
 * The mapper looks at the pin's state between batches of pages and stops
 * once the pin is going, so that wait is one batch, not the whole table.
 *
 * - BAR pages of a discrete GPU (an address inside a PCI device's memory
 *   BAR) are MMIO: dma_map_resource, as NVIDIA's own peer mappings do
 *   (rm_p2p_dma_map_pages: nv_dma_map_peer).  NVIDIA checks the topology
 *   with its own rules (nv_grdma_pci_topology_supported: allowed unless the
 *   chipset is known not to work), and gpupin follows its verdict (topo.c:
 *   asked of NVIDIA once per GPU and peer; -EOPNOTSUPP where it refuses).
 *   The kernel's rules (pci_p2pdma_distance, with CONFIG_PCI_P2PDMA) are
 *   stricter (the host bridge must be on a short list, and every
 *   pass-through VM fails them), so they only log, and refuse with the
 *   p2p_check parameter.
 *   Where the peer's DMA ops cannot map a resource (no map_resource: Xen's
 *   swiotlb-xen on older kernels, some architectures' IOMMU ops), NVIDIA
 *   hands the peer the BAR's bus address instead (nv_dma_map_peer, nv-dma.c:
 *   "best effort"); so does gpupin, unless an IOMMU translates the peer's
 *   DMA (device_iommu_mapped): there a bus address is no I/O virtual
 *   address, and the peer's DMA would fault or land elsewhere.
 * - GPU memory with struct pages (coherent systems such as GH200, and the
 *   simulator's host pages) is memory to the peer: dma_map_page.  Never
 *   where the peer's DMA is forced through bounce buffers (swiotlb=force,
 *   confidential guests): the peer would read and write the bounce buffer,
 *   and with DMA_ATTR_SKIP_CPU_SYNC (the GPU writes that memory too, so no
 *   CPU sync is right) nothing is ever copied between it and GPU memory.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/dma-map-ops.h>
#include <linux/dma-mapping.h>
#include <linux/iommu.h>
#include <linux/mm.h>
#include <linux/pci.h>
#include <linux/pci-p2pdma.h>
#include <linux/sched.h>
#include <linux/slab.h>
#include <linux/swiotlb.h>
#include "compat.h"
#include "gpupin.h"

/* Pages mapped or unmapped between two chances to reschedule (a 128 GiB pin has 2 M). */
#define GPUPIN_OWN_BATCH 1024

/*
 * The PCI device one of whose memory BARs holds @phys, with a reference, and
 * that BAR into @bar; NULL if none.
 */
static struct pci_dev *gpupin_bar_owner(phys_addr_t phys, struct resource **bar)
{
	struct pci_dev *pdev = NULL;
	int i;

	/* for_each_pci_dev() holds a reference to the device it stopped at. */
	for_each_pci_dev(pdev) {
		for (i = 0; i < PCI_STD_NUM_BARS; i++) {
			struct resource *res = &pdev->resource[i];

			if (resource_type(res) == IORESOURCE_MEM && res->start <= phys &&
			    phys <= res->end) {
				*bar = res;
				return pdev;
			}
		}
	}
	return NULL;
}

/*
 * Can dma_map_resource map for @dev?  NVIDIA's test (nv_dma_use_map_resource,
 * nv-dma.c): no DMA ops (dma-direct maps resources) or ops that have
 * map_resource; without it the kernel's dma_map_resource fails.
 */
static bool gpupin_own_can_map_resource(struct device *dev)
{
	const struct dma_map_ops *ops = get_dma_ops(dev);

	if (gpupin_fault_no_map_resource())
		return false;
	return !ops || gpupin_dma_ops_map_mmio(ops);
}

/*
 * BAR pages for a peer whose DMA ops cannot map a resource: the BAR's bus
 * address (pci_bus_address), as NVIDIA does, in map->bus_offset; refused
 * where an IOMMU translates the peer's DMA.
 */
static int gpupin_own_bus_direct(struct gpupin_map *map, struct pci_dev *gpu,
				 struct resource *bar)
{
	struct pci_dev *peer = map->pdev;

	if (device_iommu_mapped(&peer->dev)) {
		pr_warn_ratelimited("%s: its DMA ops cannot map %s's BAR and an IOMMU translates its DMA: refused\n",
				    pci_name(peer), pci_name(gpu));
		return -EOPNOTSUPP;
	}
	map->bus_direct = true;
	map->bus_offset = pci_bus_address(gpu, bar - gpu->resource) - bar->start;
	gpupin_dbg("%s: no map_resource: bus addresses of %s's BAR, as NVIDIA's driver\n",
		   pci_name(peer), pci_name(gpu));
	return 0;
}

/*
 * NVIDIA could not be asked (@verdict -ENOENT, topo.c): what gpupin sees of
 * its check for BAR pages of @gpu.  The chipsets it flags (Grace, Ampere
 * Altra and AmpereOne: _checkP2pChipsetSupport, osinit.c) are all arm64
 * hosts; there only a common switch allows peer DMA.  The administrator's
 * override is not visible: elsewhere this allows what NVIDIA allows unless
 * the override denies everything.
 */
static int gpupin_own_topo_unknown(struct pci_dev *gpu, struct pci_dev *peer)
{
	if (!IS_ENABLED(CONFIG_ARM64) || gpupin_topo_common_switch(gpu, peer))
		return 0;
	pr_info_ratelimited("%s: NVIDIA's topology verdict is unknown and no switch is shared with %s: refused\n",
			    pci_name(peer), pci_name(gpu));
	return -EOPNOTSUPP;
}

/*
 * May @peer reach @pin's pages, and how: BAR pages (map->mmio, the BAR into
 * map->bar_start/bar_end) or memory.  @verdict is NVIDIA's (topo.c), known
 * not to refuse.  The caller is an in-flight user (the page table stays).
 */
static int gpupin_own_check(struct gpupin_pin_obj *pin, struct gpupin_map *map, int verdict)
{
	phys_addr_t phys = pin->pt->pages[0]->physical_address;
	struct pci_dev *peer = map->pdev, *gpu;
	struct resource *bar;
	int ret = 0;

	gpu = gpupin_bar_owner(phys, &bar);
	map->mmio = gpu;
	if (!gpu) {
		if (!pfn_valid(PHYS_PFN(phys))) {
			pr_warn_ratelimited("GPU pages are neither memory nor in a PCI BAR\n");
			return -EOPNOTSUPP;
		}
		/*
		 * Memory with struct pages.  A peer that cannot address all of
		 * it would get bounce buffers (swiotlb): its DMA would never
		 * reach the GPU's memory.
		 */
		if (dma_addressing_limited(&peer->dev)) {
			gpupin_dbg("%s cannot address all memory: no bounce buffers for GPU pages\n",
				   pci_name(peer));
			return -EOPNOTSUPP;
		}
		if (is_swiotlb_force_bounce(&peer->dev)) {
			pr_warn_ratelimited("%s: its DMA is forced through bounce buffers (swiotlb=force, a confidential guest): GPU pages refused\n",
					    pci_name(peer));
			return -EOPNOTSUPP;
		}
		return 0;
	}
	map->bar_start = bar->start;
	map->bar_end = bar->end;
	if (verdict == -ENOENT)
		ret = gpupin_own_topo_unknown(gpu, peer);
	if (!ret && !gpupin_own_can_map_resource(&peer->dev))
		ret = gpupin_own_bus_direct(map, gpu, bar);
	if (ret) {
		pci_dev_put(gpu);
		return ret;
	}
	/*
	 * The kernel's P2P rules are stricter than NVIDIA's own check
	 * (nv_grdma_pci_topology_supported allows what it does not know to be
	 * broken, and every pass-through VM): refuse only when asked to.
	 */
	if (IS_ENABLED(CONFIG_PCI_P2PDMA) && pci_p2pdma_distance(gpu, &peer->dev, false) < 0) {
		if (READ_ONCE(gpupin_p2p_check))
			ret = -EOPNOTSUPP;
		pr_info_ratelimited("%s: the kernel sees no peer-to-peer path to %s%s\n",
				    pci_name(peer), pci_name(gpu),
				    ret ? ": refused (p2p_check)" : "; mapping as NVIDIA would");
	}
	pci_dev_put(gpu);
	return ret;
}

/* Is @phys of the same kind as the table's first page (and in the same BAR)? */
static bool gpupin_own_same_kind(const struct gpupin_map *map, phys_addr_t phys)
{
	if (map->mmio)
		return phys >= map->bar_start && phys + GPU_BOUND_SIZE - 1 <= map->bar_end;
	return pfn_valid(PHYS_PFN(phys)) && pfn_valid(PHYS_PFN(phys + GPU_BOUND_SIZE - 1));
}

/* Unmap the first @n pages of an own mapping and free its address array. */
static void gpupin_own_unmap_n(struct gpupin_map *map, u32 n)
{
	struct device *dev = &map->pdev->dev;
	u32 i;

	for (i = 0; i < n; i++) {
		if (map->mmio && !map->bus_direct)	/* bus addresses: nothing was mapped */
			dma_unmap_resource(dev, map->dma[i], GPU_BOUND_SIZE, DMA_BIDIRECTIONAL, 0);
		else if (!map->mmio)
			dma_unmap_page_attrs(dev, map->dma[i], GPU_BOUND_SIZE, DMA_BIDIRECTIONAL,
					     DMA_ATTR_SKIP_CPU_SYNC);
		if (!(i % GPUPIN_OWN_BATCH))
			cond_resched();
	}
	kvfree(map->dma);
	map->dma = NULL;
}

/*
 * Unmap an own mapping that is off its pin's list.  The caller is an
 * in-flight user of the pin, or its free callback, or releases the pages:
 * no NVIDIA lock is needed or taken.
 */
void gpupin_own_unmap(struct gpupin_map *map)
{
	gpupin_own_unmap_n(map, map->entries);
}

/*
 * Map every page of @pin (a non-persistent nv-p2p pin) for map->pdev and
 * put the mapping on the pin's list under a new id (*@id).  -ENXIO once the
 * memory is going (a free callback or an unpin took the pin): checked
 * between batches, so either waits for at most one batch of ours, never for
 * the whole table (1.3 M pages for 80 GiB) while NVIDIA holds its RM API
 * lock in the callback.  What was mapped is unmapped again after the use
 * ends: the unmap reads only our own address array, and the peer never saw
 * those addresses.
 */
int gpupin_own_map(struct gpupin_pin_obj *pin, struct gpupin_map *map, u32 *id)
{
	struct device *dev = &map->pdev->dev;
	u32 i, done = 0;
	int ret, verdict;

	map->kind = GPUPIN_MAP_OWN;
	map->entries = pin->entries;
	/* Before the use: asking takes NVIDIA's API lock, under which callbacks wait for users. */
	verdict = gpupin_topo_verdict(pin, map->pdev);
	if (verdict == -EOPNOTSUPP)
		return verdict;
	map->dma = gpupin_kvmalloc_array(pin->entries, sizeof(u64), GFP_KERNEL);
	if (!map->dma)
		return -ENOMEM;
	/* From here until the mapping is listed or we stop, the free callback waits for us. */
	ret = gpupin_pin_use(pin);
	if (ret) {
		kvfree(map->dma);
		map->dma = NULL;
		return ret;
	}
	ret = gpupin_own_check(pin, map, verdict);
	for (i = 0; !ret && i < pin->entries; i++) {
		phys_addr_t phys = pin->pt->pages[i]->physical_address;
		dma_addr_t addr;

		if (i && !(i % GPUPIN_OWN_BATCH)) {
			/* In flight we may sleep; a free callback waits (NVIDIA's lock held). */
			cond_resched();
			gpupin_fault_own_map_batch();
			/* Unlocked: a stale PINNED costs a waiter one more batch at most. */
			if (READ_ONCE(pin->state) != GPUPIN_PIN_PINNED) {
				ret = -ENXIO;
				break;
			}
		}
		if (!gpupin_own_same_kind(map, phys)) {
			ret = -EPROTO;	/* BAR and memory pages, or two BARs, in one table */
			break;
		}
		if (map->bus_direct)
			addr = phys + map->bus_offset;
		else if (map->mmio)
			addr = dma_map_resource(dev, phys, GPU_BOUND_SIZE, DMA_BIDIRECTIONAL, 0);
		else	/* the GPU writes it too: no CPU cache maintenance, ever */
			addr = dma_map_page_attrs(dev, pfn_to_page(PHYS_PFN(phys)),
						  offset_in_page(phys), GPU_BOUND_SIZE,
						  DMA_BIDIRECTIONAL, DMA_ATTR_SKIP_CPU_SYNC);
		if (dma_mapping_error(dev, addr)) {
			ret = -ENOMEM;
			break;
		}
		map->dma[i] = addr;
		done++;
	}
	if (!ret)
		ret = gpupin_map_add(pin, map, id);
	gpupin_pin_unuse(pin);
	/*
	 * Undone outside the use, so a waiting callback does not wait for this
	 * either: our addresses may then point at memory NVIDIA freed, but no
	 * peer has them, and the unmap touches no page (DMA_ATTR_SKIP_CPU_SYNC).
	 */
	if (ret)
		gpupin_own_unmap_n(map, done);
	return ret;
}
