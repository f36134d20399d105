// SPDX-License-Identifier: (GPL-2.0 OR MIT)
/*
 * gpupin: DMA mappings of pinned pages for a peer PCI device (DMA_MAP,
 * DMA_ADDRS, DMA_UNMAP) through nvidia_p2p_dma_map_pages.  Mappings live on
 * their pin and go away on DMA_UNMAP, unpin, close, or invalidation (where
 * the free callback hands them to nvidia_p2p_free_dma_mapping instead).
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/capability.h>
#include <linux/mm.h>
#include <linux/pci.h>
#include <linux/slab.h>
#include <linux/uaccess.h>
#include "gpupin.h"

#define GPUPIN_MAX_MAPS_PER_PIN 16

static void gpupin_map_destroy(struct gpupin_region *pin, struct gpupin_map *map)
{
	int ret = nvidia_p2p_dma_unmap_pages(map->pdev, pin->pt, map->m);

	if (ret)
		pr_warn_ratelimited("dma_unmap_pages failed: %d\n", ret);
	pci_dev_put(map->pdev);
	kfree(map);
}

/*
 * Unmap every mapping of a pin whose pages the caller is releasing (state
 * RELEASING, no users in flight).
 */
void gpupin_unmap_all(struct gpupin_region *pin)
{
	struct gpupin_map *map, *tmp;
	LIST_HEAD(maps);

	spin_lock(&pin->lock);
	list_splice_init(&pin->maps, &maps);
	spin_unlock(&pin->lock);
	list_for_each_entry_safe(map, tmp, &maps, node)
		gpupin_map_destroy(pin, map);
}

u32 gpupin_map_count_locked(struct gpupin_region *pin)
{
	struct gpupin_map *map;
	u32 n = 0;

	lockdep_assert_held(&pin->lock);
	list_for_each_entry(map, &pin->maps, node)
		n++;
	return n;
}

/*
 * From the free callback: the provider already tore the mappings down, so
 * only their descriptors are freed (never dma_unmap_pages here).
 */
void gpupin_free_maps_invalidated(struct gpupin_region *pin)
{
	struct gpupin_map *map, *tmp;
	LIST_HEAD(maps);

	spin_lock(&pin->lock);
	list_splice_init(&pin->maps, &maps);
	spin_unlock(&pin->lock);
	list_for_each_entry_safe(map, tmp, &maps, node) {
		nvidia_p2p_free_dma_mapping(map->m);
		pci_dev_put(map->pdev);
		kfree(map);
	}
}

/* Mapping @id of @pin, or NULL; caller holds pin->lock. */
static struct gpupin_map *gpupin_map_find_locked(struct gpupin_region *pin, u32 id)
{
	struct gpupin_map *map;

	list_for_each_entry(map, &pin->maps, node)
		if (map->id == id)
			return map;
	return NULL;
}

long gpupin_ioctl_dma_map(struct gpupin_file *f, struct gpupin_dma_map __user *uarg)
{
	struct gpupin_dma_map arg;
	struct gpupin_region *pin;
	struct gpupin_map *map;
	unsigned int n = 0;
	int ret;

	if (copy_from_user(&arg, uarg, sizeof(arg)))
		return -EFAULT;
	if (arg.flags || arg.reserved[0] || arg.reserved[1] ||
	    arg.pci_domain > 0xffff || arg.pci_bus > 0xff || arg.pci_devfn > 0xff)
		return -EINVAL;
	if (!gpupin_caller_owns(f))
		return -EACCES;
	pin = gpupin_pin_lookup(f, arg.handle);
	if (!pin)
		return -ENOENT;

	ret = -ENOMEM;
	map = kzalloc(sizeof(*map), GFP_KERNEL);
	if (!map)
		goto out_put;
	ret = -ENODEV;
	map->pdev = pci_get_domain_bus_and_slot(arg.pci_domain, arg.pci_bus, arg.pci_devfn);
	if (!map->pdev)
		goto out_free;

	ret = gpupin_pin_use(pin);
	if (ret)
		goto out_pdev;
	spin_lock(&pin->lock);
	n = gpupin_map_count_locked(pin);
	spin_unlock(&pin->lock);
	if (n >= GPUPIN_MAX_MAPS_PER_PIN) {
		ret = -ENOSPC;
		goto out_unuse;
	}
	ret = nvidia_p2p_dma_map_pages(map->pdev, pin->pt, &map->m);
	if (ret)
		goto out_unuse;
	if (!NVIDIA_P2P_DMA_MAPPING_VERSION_COMPATIBLE(map->m) ||
	    map->m->entries != pin->pt->entries) {
		pr_warn_ratelimited("incompatible DMA mapping (version 0x%08x)\n",
				    map->m->version);
		nvidia_p2p_dma_unmap_pages(map->pdev, pin->pt, map->m);
		ret = -EPROTO;
		goto out_unuse;
	}
	spin_lock(&pin->lock);
	n = gpupin_map_count_locked(pin);
	if (n < GPUPIN_MAX_MAPS_PER_PIN) {
		map->id = ++pin->next_map_id;
		list_add_tail(&map->node, &pin->maps);
	}
	spin_unlock(&pin->lock);
	if (n >= GPUPIN_MAX_MAPS_PER_PIN) {	/* others mapped meanwhile */
		nvidia_p2p_dma_unmap_pages(map->pdev, pin->pt, map->m);
		ret = -ENOSPC;
		goto out_unuse;
	}
	atomic64_inc(&gpupin_stats.dma_maps);
	gpupin_pin_unuse(pin);

	arg.mapping_id = map->id;
	arg.entries = map->m->entries;
	gpupin_pin_put(pin);
	/* On a fault the mapping stays; it goes away with the pin. */
	return copy_to_user(uarg, &arg, sizeof(arg)) ? -EFAULT : 0;

out_unuse:
	gpupin_pin_unuse(pin);
out_pdev:
	pci_dev_put(map->pdev);
out_free:
	kfree(map);
out_put:
	gpupin_pin_put(pin);
	return ret;
}

long gpupin_ioctl_dma_addrs(struct gpupin_file *f, struct gpupin_dma_addrs __user *uarg)
{
	struct gpupin_dma_addrs arg;
	struct gpupin_region *pin;
	struct gpupin_map *map;
	u64 *addrs;
	u32 i, entries;
	int ret;

	/* Bus addresses are as sensitive as physical ones. */
	if (!capable(CAP_SYS_ADMIN))
		return -EPERM;
	if (copy_from_user(&arg, uarg, sizeof(arg)))
		return -EFAULT;
	if (arg.flags || arg.reserved[0] || arg.reserved[1] || !arg.count)
		return -EINVAL;
	pin = gpupin_pin_lookup(f, arg.handle);
	if (!pin)
		return -ENOENT;
	entries = pin->aligned_size >> GPU_BOUND_SHIFT;
	ret = -EINVAL;
	if (arg.first >= entries || arg.count > entries - arg.first)
		goto out_put;
	ret = -ENOMEM;
	addrs = kvmalloc_array(arg.count, sizeof(*addrs), GFP_KERNEL);
	if (!addrs)
		goto out_put;
	ret = gpupin_pin_use(pin);
	if (ret)
		goto out_free;
	spin_lock(&pin->lock);
	map = gpupin_map_find_locked(pin, arg.mapping_id);
	if (map) {
		for (i = 0; i < arg.count; i++)
			addrs[i] = map->m->dma_addresses[arg.first + i];
	}
	spin_unlock(&pin->lock);
	gpupin_pin_unuse(pin);
	ret = -ENOENT;
	if (map)
		ret = copy_to_user(u64_to_user_ptr(arg.addrs), addrs,
				   array_size(arg.count, sizeof(*addrs))) ? -EFAULT : 0;
out_free:
	kvfree(addrs);
out_put:
	gpupin_pin_put(pin);
	return ret;
}

long gpupin_ioctl_dma_unmap(struct gpupin_file *f, struct gpupin_dma_unmap __user *uarg)
{
	struct gpupin_dma_unmap arg;
	struct gpupin_region *pin;
	struct gpupin_map *map;
	int ret;

	if (copy_from_user(&arg, uarg, sizeof(arg)))
		return -EFAULT;
	if (arg.flags || arg.reserved[0] || arg.reserved[1])
		return -EINVAL;
	if (!gpupin_caller_owns(f))
		return -EACCES;
	pin = gpupin_pin_lookup(f, arg.handle);
	if (!pin)
		return -ENOENT;
	ret = gpupin_pin_use(pin);
	if (ret)
		goto out_put;
	spin_lock(&pin->lock);
	map = gpupin_map_find_locked(pin, arg.mapping_id);
	if (map)
		list_del(&map->node);
	spin_unlock(&pin->lock);
	if (map)
		gpupin_map_destroy(pin, map);
	gpupin_pin_unuse(pin);
	ret = map ? 0 : -ENOENT;
out_put:
	gpupin_pin_put(pin);
	return ret;
}
