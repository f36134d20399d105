// SPDX-License-Identifier: (GPL-2.0 OR MIT)
/*
 * nvp2p_sim: DMA mappings of page tables for a peer device
 * (dma_map_pages, dma_unmap_pages, free_dma_mapping).
 *
 * dma_map_pages takes the API lock, dma_unmap_pages does not (NVIDIA takes
 * only the table's own mapping lock there), so it works inside the free
 * callback.  A mapping left on a table when its callback returns is
 * unmapped and freed with the table, poisoned (sim_map_bury).
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/delay.h>
#include <linux/dma-mapping.h>
#include <linux/export.h>
#include <linux/hashtable.h>
#include <linux/mm.h>
#include <linux/pci.h>
#include <linux/sched.h>
#include <linux/slab.h>
#include <linux/string.h>
#include "sim.h"

/*
 * The knobs of the DMA-mapping calls: module parameters, writable at any
 * time, so read with READ_ONCE.
 */
static struct {
	/* What dma_map_pages hands out. */
	unsigned int dma_mapping_version;
	/* Delays that widen a client's race windows. */
	unsigned int dma_map_latency_us;
	unsigned int unmap_latency_us;
	/* Fault injection (sim_injected_error_locked). */
	int fail_dma_map_nth;
} sim_dma_knobs = {
	.dma_mapping_version = NVIDIA_P2P_DMA_MAPPING_VERSION,
};

module_param_named(dma_mapping_version, sim_dma_knobs.dma_mapping_version, uint, 0644);
MODULE_PARM_DESC(dma_mapping_version, "DMA-mapping version handed out by dma_map_pages (default 0x00020003); others test clients' version checks");
module_param_named(dma_map_latency_us, sim_dma_knobs.dma_map_latency_us, uint, 0644);
MODULE_PARM_DESC(dma_map_latency_us, "Delay between dma_map_pages reading the table and taking the API lock, in microseconds (default 0)");
module_param_named(unmap_latency_us, sim_dma_knobs.unmap_latency_us, uint, 0644);
MODULE_PARM_DESC(unmap_latency_us, "Delay before dma_unmap_pages reads the table, in microseconds (default 0)");
module_param_named(fail_dma_map_nth, sim_dma_knobs.fail_dma_map_nth, int, 0644);
MODULE_PARM_DESC(fail_dma_map_nth, "Fail the Nth dma_map_pages call from now with -fail_errno, then reset to 0 (0 = off)");

static void sim_map_free(struct sim_map *map)
{
	kvfree(map->m.dma_addresses);
	kfree(map);
}

/* Undo the IOMMU mappings of @map (its descriptor stays). */
static void sim_map_unmap(struct sim_map *map)
{
	u32 i;

	for (i = 0; i < map->m.entries; i++) {
		if (map->pin->bar_len)
			dma_unmap_resource(map->dev, map->m.dma_addresses[i], SIM_PAGE_SIZE,
					   DMA_BIDIRECTIONAL, 0);
		else
			dma_unmap_page(map->dev, map->m.dma_addresses[i], SIM_PAGE_SIZE,
				       DMA_BIDIRECTIONAL);
	}
}

/* Free @map as NVIDIA does: unmapped, poisoned, kept with its pin. */
void sim_map_bury(struct sim_map *map)
{
	sim_map_unmap(map);
	kvfree(map->m.dma_addresses);
	memset(&map->m, SIM_POISON, sizeof(map->m));
}

/*
 * dma_map_pages' first read of @pt (NVIDIA's container_of and gpu_uuid read,
 * without a lock).  A freed table, however recently freed, is a use after
 * free: no grace window.
 */
static struct sim_pin *sim_pin_get_live(struct nvidia_p2p_page_table *pt, const char *fn)
{
	struct sim_pin *pin;

	spin_lock(&sim_lock);
	pin = sim_pin_lookup_locked(pt);
	if (!pin) {
		/* NVIDIA reads it all the same (container_of): whatever is there. */
		sim_count_uaf(fn, "page table it never handed out (or long freed)");
	} else if (pin->state == SIM_PIN_FREED) {
		sim_count_uaf(fn, "page table");
		pin = NULL;
	} else {
		refcount_inc(&pin->refs);
	}
	spin_unlock(&sim_lock);
	return pin;
}

int nvidia_p2p_dma_map_pages(struct pci_dev *peer,
			     struct nvidia_p2p_page_table *page_table,
			     struct nvidia_p2p_dma_mapping **dma_mapping)
{
	struct sim_map *map;
	struct sim_pin *pin;
	u32 i;
	int err;

	if (!peer || !page_table || !dma_mapping)
		return -EINVAL;
	/* NVIDIA reads the table (container_of) before anything else. */
	pin = sim_pin_get_live(page_table, __func__);
	if (!pin)
		return -EINVAL;
	/* NVIDIA NULLs it before its allocations and RM: any later failure leaves NULL. */
	*dma_mapping = NULL;
	if (READ_ONCE(sim_dma_knobs.dma_map_latency_us))
		fsleep(READ_ONCE(sim_dma_knobs.dma_map_latency_us));
	err = sim_api_lock(__func__);
	if (err)
		goto out_put;
	err = -EINVAL;
	spin_lock(&sim_lock);
	if (pin->state == SIM_PIN_FREED && pin->freed_by_put) {
		/* The client put the table while it was mapping it: its own bug. */
		sim_count_uaf(__func__, "page table (put by the client during the call)");
	} else if (pin->state == SIM_PIN_FREED) {
		/*
		 * Freed by a callback while we waited for the lock: NVIDIA's
		 * dma_map_pages goes on with the freed table, maps released BAR
		 * pages and links the mapping into the freed mem_info (heap
		 * corruption).  Only a client that cannot race the free may call
		 * it; refused here and counted.
		 */
		sim_count_misuse(&sim_stats.dma_map_races,
				 "dma_map_pages: the table was freed while it waited for the API lock (heap corruption in NVIDIA's driver)");
	} else if (pin->state == SIM_PIN_LIVE) {
		err = sim_injected_error_locked(&sim_dma_knobs.fail_dma_map_nth);
	}
	spin_unlock(&sim_lock);
	/* rm_p2p_dma_map_pages: the topology check, under the API lock */
	if (!err && sim_peer_denied(&peer->dev))
		err = -ENOTSUPP;
	if (err)
		goto out_unlock;

	err = -ENOMEM;
	map = kzalloc(sizeof(*map), GFP_KERNEL);
	if (!map)
		goto out_unlock;
	map->m.dma_addresses = kvcalloc(pin->len >> SIM_PAGE_SHIFT, sizeof(u64), GFP_KERNEL);
	if (!map->m.dma_addresses) {
		kfree(map);
		goto out_unlock;
	}
	map->dev = &peer->dev;
	map->pin = pin;
	map->m.version = READ_ONCE(sim_dma_knobs.dma_mapping_version);
	map->m.page_size_type = NVIDIA_P2P_PAGE_SIZE_64KB;
	map->m.private = map;
	map->m.pci_dev = peer;
	for (i = 0; i < pin->len >> SIM_PAGE_SHIFT; i++) {
		/* BAR pages as NVIDIA maps them (nv_dma_map_peer), or host pages */
		dma_addr_t a = pin->bar_len ?
			dma_map_resource(map->dev, pin->page_array[i].physical_address,
					 SIM_PAGE_SIZE, DMA_BIDIRECTIONAL, 0) :
			dma_map_page(map->dev, sim_pin_chunk(pin, i), 0,
				     SIM_PAGE_SIZE, DMA_BIDIRECTIONAL);

		if (dma_mapping_error(map->dev, a)) {
			err = -EIO;
			sim_map_unmap(map);
			sim_map_free(map);
			goto out_unlock;
		}
		map->m.dma_addresses[i] = a;
		map->m.entries = i + 1;
	}
	/* Under the API lock no callback can run: the pin is still LIVE. */
	spin_lock(&sim_lock);
	list_add_tail(&map->node, &pin->maps);
	sim_stats.dma_mappings++;
	spin_unlock(&sim_lock);
	*dma_mapping = &map->m;
	err = 0;
out_unlock:
	sim_api_unlock();
out_put:
	sim_pin_put(pin);
	return err;
}
EXPORT_SYMBOL_GPL(nvidia_p2p_dma_map_pages);

/*
 * The mapping @m of @pin, for @fn: taken off nothing, just found.  A freed
 * one (or one of a freed table) is counted as a use after free.  Caller
 * holds sim_lock.
 */
static struct sim_map *sim_map_find_locked(struct sim_pin *pin, struct nvidia_p2p_dma_mapping *m,
					   const char *fn)
{
	struct sim_map *map;

	list_for_each_entry(map, &pin->maps, node) {
		if (&map->m != m)
			continue;
		if (map->freed) {
			sim_count_uaf(fn, "DMA mapping");
			return NULL;
		}
		return map;
	}
	return NULL;
}

/* Takes only the table's own mapping lock in NVIDIA's driver: never the API lock. */
int nvidia_p2p_dma_unmap_pages(struct pci_dev *peer,
			       struct nvidia_p2p_page_table *page_table,
			       struct nvidia_p2p_dma_mapping *dma_mapping)
{
	struct sim_map *map = NULL;
	struct sim_pin *pin;
	int ret = -EINVAL;

	if (!peer || !page_table || !dma_mapping)
		return -EINVAL;
	if (READ_ONCE(sim_dma_knobs.unmap_latency_us))
		fsleep(READ_ONCE(sim_dma_knobs.unmap_latency_us));
	spin_lock(&sim_lock);
	pin = sim_pin_lookup_locked(page_table);
	if (!pin) {
		/* NVIDIA takes the mapping lock inside it (container_of): whatever is there. */
		sim_count_uaf(__func__, "page table it never handed out (or long freed)");
	} else if (pin->state == SIM_PIN_FREED) {
		sim_count_uaf(__func__, "page table");
	} else {
		/*
		 * Also inside the free callback: NVIDIA takes only the table's
		 * mapping semaphore here (nv_p2p_remove_dma_mapping).  A mapping
		 * no longer on the table's list (already unmapped) is found by
		 * pointer value or not at all: 0, nothing done.
		 */
		map = sim_map_find_locked(pin, dma_mapping, __func__);
		if (map) {
			list_del(&map->node);
			sim_stats.dma_mappings--;
			/* NVIDIA: WARN_ON(peer != dma_mapping->pci_dev), then unmaps it anyway. */
			if (peer != map->m.pci_dev)
				sim_count_misuse(&sim_stats.unmap_peer_mismatches,
						 "dma_unmap_pages with another peer than the mapping's");
		}
		ret = 0;
	}
	spin_unlock(&sim_lock);
	if (!map)
		return ret;
	sim_map_unmap(map);
	sim_map_free(map);
	return 0;
}
EXPORT_SYMBOL_GPL(nvidia_p2p_dma_unmap_pages);

/*
 * Only legal from inside the free callback: the mapping is freed then (and
 * stays in the graveyard with its table).
 */
int nvidia_p2p_free_dma_mapping(struct nvidia_p2p_dma_mapping *dma_mapping)
{
	struct sim_map *map = NULL;
	struct sim_pin *pin, *p;
	unsigned int bkt;

	if (!dma_mapping)
		return -EINVAL;
	/* Found through the registry, not by trusting the pointer. */
	spin_lock(&sim_lock);
	hash_for_each(sim_pins, bkt, p, hnode) {
		map = sim_map_find_locked(p, dma_mapping, __func__);
		if (map) {
			pin = p;
			break;
		}
	}
	if (map && (pin->state != SIM_PIN_CALLBACK || pin->cb_task != current))
		map = NULL;
	if (map) {
		map->freed = true;
		sim_stats.dma_mappings--;
	}
	spin_unlock(&sim_lock);
	if (WARN_ONCE(!map, "%s outside the free callback\n", __func__))
		return -EINVAL;
	/* Unmapped and poisoned when the callback returns (sim_pin_bury). */
	return 0;
}
EXPORT_SYMBOL_GPL(nvidia_p2p_free_dma_mapping);
