// SPDX-License-Identifier: (GPL-2.0 OR MIT)
/*
 * gpupin: DMA mappings of pinned pages for a peer PCI device (DMA_MAP,
 * DMA_ADDRS, DMA_UNMAP, and the kernel API's).  Three kinds, by pin:
 * persistent nv-p2p pins through nvidia_p2p_dma_map_pages (no free callback
 * can race it), non-persistent ones by gpupin itself (ownmap.c: NVIDIA's
 * call is not safe against a racing free), dma-buf pins through an
 * attachment of the buffer (dmabuf.c).  Mappings live on their pin and go
 * away on DMA_UNMAP, unpin, close, or invalidation (the free callback unmaps
 * gpupin's own; a revocation unmaps attachments).
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/capability.h>
#include <linux/mm.h>
#include <linux/pci.h>
#include <linux/slab.h>
#include <linux/uaccess.h>
#include "gpupin.h"

#define GPUPIN_MAX_MAPS_PER_PIN 16

static void gpupin_map_destroy(struct gpupin_pin_obj *pin, struct gpupin_map *map)
{
	int ret;

	switch (map->kind) {
	case GPUPIN_MAP_DMABUF:
		gpupin_dmabuf_unmap(map);
		break;
	case GPUPIN_MAP_OWN:
		gpupin_own_unmap(map);
		break;
	case GPUPIN_MAP_NVP2P:
		ret = nvidia_p2p_dma_unmap_pages(gpupin_fault_unmap_peer(map->pdev), pin->pt,
						 map->m);
		if (ret)
			pr_warn_ratelimited("dma_unmap_pages failed: %d\n", ret);
		break;
	}
	pci_dev_put(map->pdev);
	kfree(map);
}

/*
 * Unmap every mapping of a pin whose pages the caller is releasing (state
 * RELEASING, no users in flight).
 */
void gpupin_unmap_all(struct gpupin_pin_obj *pin)
{
	struct gpupin_map *map, *tmp;
	LIST_HEAD(maps);

	spin_lock(&pin->lock);
	list_splice_init(&pin->maps, &maps);
	spin_unlock(&pin->lock);
	list_for_each_entry_safe(map, tmp, &maps, node)
		gpupin_map_destroy(pin, map);
}

u32 gpupin_map_count_locked(struct gpupin_pin_obj *pin)
{
	struct gpupin_map *map;
	u32 n = 0;

	lockdep_assert_held(&pin->lock);
	list_for_each_entry(map, &pin->maps, node)
		n++;
	return n;
}

/*
 * From the free callback, no user in flight: unmap gpupin's own mappings
 * (they take no NVIDIA lock).  A pin with a callback never has one of
 * NVIDIA's (only persistent pins do): should one be listed, it is NVIDIA's
 * to free after the callback, with the peer's pci_dev, which is then kept.
 */
void gpupin_free_maps_invalidated(struct gpupin_pin_obj *pin)
{
	struct gpupin_map *map, *tmp;
	LIST_HEAD(maps);

	spin_lock(&pin->lock);
	list_splice_init(&pin->maps, &maps);
	spin_unlock(&pin->lock);
	list_for_each_entry_safe(map, tmp, &maps, node) {
		if (WARN_ON_ONCE(map->kind != GPUPIN_MAP_OWN)) {
			nvidia_p2p_free_dma_mapping(map->m);
			kfree(map);
			continue;
		}
		gpupin_own_unmap(map);
		pci_dev_put(map->pdev);
		kfree(map);
	}
}

/* Mapping @id of @pin, or NULL; caller holds pin->lock. */
static struct gpupin_map *gpupin_map_find_locked(struct gpupin_pin_obj *pin, u32 id)
{
	struct gpupin_map *map;

	list_for_each_entry(map, &pin->maps, node)
		if (map->id == id)
			return map;
	return NULL;
}

/*
 * Put @map on @pin's list under a new id (*@id, read here: once listed the
 * map may go at any time); -ENOSPC past the per-pin limit.  Caller holds
 * pin->lock.
 */
static int gpupin_map_link_locked(struct gpupin_pin_obj *pin, struct gpupin_map *map, u32 *id)
{
	lockdep_assert_held(&pin->lock);
	if (gpupin_map_count_locked(pin) >= GPUPIN_MAX_MAPS_PER_PIN)
		return -ENOSPC;		/* others mapped meanwhile */
	map->id = ++pin->next_map_id;
	*id = map->id;
	list_add_tail(&map->node, &pin->maps);
	return 0;
}

/* gpupin_map_link_locked(), or -ENXIO once the pin is no longer PINNED. */
int gpupin_map_add(struct gpupin_pin_obj *pin, struct gpupin_map *map, u32 *id)
{
	int ret = -ENXIO;

	spin_lock(&pin->lock);
	if (pin->state == GPUPIN_PIN_PINNED)
		ret = gpupin_map_link_locked(pin, map, id);
	spin_unlock(&pin->lock);
	return ret;
}

/* Check a new nv-p2p mapping and list it; caller holds pin->lock, pin PINNED. */
static int gpupin_nvp2p_map_add_locked(struct gpupin_pin_obj *pin, struct gpupin_map *map,
				       u32 *id)
{
	lockdep_assert_held(&pin->lock);
	if (!NVIDIA_P2P_DMA_MAPPING_VERSION_COMPATIBLE(map->m) ||
	    map->m->entries != pin->entries) {
		pr_warn_ratelimited("incompatible DMA mapping (version 0x%08x)\n",
				    map->m->version);
		return -EPROTO;
	}
	map->dma = map->m->dma_addresses;
	return gpupin_map_link_locked(pin, map, id);
}

/*
 * A persistent pin: nvidia_p2p_dma_map_pages.  Such a pin has no free
 * callback, so only its own unpin can release the table, and that waits
 * for us (pin->mappers).  Not as an in-flight user: the call takes the
 * driver's API lock.  Never for a pin with a callback: see ownmap.c.
 */
static int gpupin_nvp2p_map(struct gpupin_pin_obj *pin, struct gpupin_map *map, u32 *id)
{
	bool undo = false;
	int ret = 0;

	map->kind = GPUPIN_MAP_NVP2P;

	spin_lock(&pin->lock);
	if (pin->state == GPUPIN_PIN_PINNED)
		pin->mappers++;		/* an unpin waits for us (not the callback) */
	else
		ret = -ENXIO;
	spin_unlock(&pin->lock);
	if (ret)
		return ret;
	ret = gpupin_provider_err(nvidia_p2p_dma_map_pages(map->pdev, pin->pt, &map->m));

	spin_lock(&pin->lock);
	pin->mappers--;
	switch (pin->state) {
	case GPUPIN_PIN_PINNED:
		if (!ret)
			ret = gpupin_nvp2p_map_add_locked(pin, map, id);
		undo = ret && map->m;
		break;
	case GPUPIN_PIN_RELEASING:
	case GPUPIN_PIN_DETACHED:
		/* Unpinned meanwhile: the unpin waits for us; undo our mapping. */
		undo = !ret && map->m;
		ret = -ENXIO;
		break;
	default:
		/* Invalidated: impossible without a callback; nothing of ours to touch. */
		ret = -ENXIO;
	}
	/* Undo as an in-flight user, as every unmap of a table is. */
	if (undo)
		pin->inflight++;
	wake_up_all(&pin->wq);
	spin_unlock(&pin->lock);
	if (undo) {
		nvidia_p2p_dma_unmap_pages(map->pdev, pin->pt, map->m);
		gpupin_pin_unuse(pin);
	}
	return ret;
}

/*
 * Map @pin's pages for @pdev and add the mapping to the pin, owned by user
 * space (@user) or by one kernel-API reference; *@id is its id (read before
 * anyone else could free it).  The caller must not be an in-flight user.
 * Takes its own reference on @pdev.
 */
int gpupin_map_create(struct gpupin_pin_obj *pin, struct pci_dev *pdev, bool user,
		      struct gpupin_map **out, u32 *id)
{
	struct gpupin_map *map;
	unsigned int n;
	int ret;

	spin_lock(&pin->lock);
	n = gpupin_map_count_locked(pin);
	spin_unlock(&pin->lock);
	if (n >= GPUPIN_MAX_MAPS_PER_PIN)
		return -ENOSPC;
	map = gpupin_kzalloc(sizeof(*map), GFP_KERNEL);
	if (!map)
		return -ENOMEM;
	map->pin = pin;
	map->pdev = pci_dev_get(pdev);
	map->user_owned = user;
	map->drv_users = !user;
	/* The id is fixed before the map is published (map->id is set under pin->lock). */
	*id = 0;
	if (pin->flags & GPUPIN_PIN_DMABUF)
		ret = gpupin_dmabuf_map(pin, map, id);
	else if (pin->flags & GPUPIN_PIN_PERSISTENT)
		ret = gpupin_nvp2p_map(pin, map, id);
	else
		ret = gpupin_own_map(pin, map, id);
	if (ret) {
		pci_dev_put(map->pdev);
		kfree(map);
		return ret;
	}
	atomic64_inc(&gpupin_stats.dma_maps);
	*out = map;
	return 0;
}

/*
 * A kernel-API reference's mapping for @pdev: an existing one of the pin is
 * shared, else a new one is made.  The caller must not be an in-flight user.
 */
int gpupin_map_for_driver(struct gpupin_pin_obj *pin, struct pci_dev *pdev,
			  struct gpupin_map **out, u32 *id)
{
	struct gpupin_map *map, *found = NULL;

	if (gpupin_pin_use(pin))
		return -ENODEV;
	spin_lock(&pin->lock);
	list_for_each_entry(map, &pin->maps, node) {
		if (map->pdev == pdev) {
			map->drv_users++;
			found = map;
			*id = map->id;
			break;
		}
	}
	spin_unlock(&pin->lock);
	gpupin_pin_unuse(pin);
	if (found) {
		*out = found;
		return 0;
	}
	return gpupin_map_create(pin, pdev, false, out, id);
}

/*
 * Destroy @map, taken off @pin's list by the caller, an in-flight user:
 * nv-p2p and own mappings before the use ends (the free callback must not
 * free the page table under the unmap), dma-buf ones after it (unmapping
 * takes the reservation lock, under which a revocation waits for in-flight
 * users).  The kind is the map's own: once the use ends, an unpin may
 * release the pin's buffer and clear pin->dmabuf.
 */
static void gpupin_map_destroy_unuse(struct gpupin_pin_obj *pin, struct gpupin_map *map)
{
	bool late = map && map->kind == GPUPIN_MAP_DMABUF;

	if (map && !late)
		gpupin_map_destroy(pin, map);
	gpupin_pin_unuse(pin);
	if (late) {
		gpupin_fault_unmap_late_delay();
		gpupin_map_destroy(pin, map);
	}
}

/*
 * A kernel-API reference drops its share of mapping @id.  Nothing to do
 * once the memory is gone: the mappings went (nv-p2p) or go at release.
 */
void gpupin_map_drop_driver(struct gpupin_pin_obj *pin, u32 id)
{
	struct gpupin_map *map;

	if (gpupin_pin_use(pin))
		return;
	spin_lock(&pin->lock);
	map = gpupin_map_find_locked(pin, id);
	if (map && !--map->drv_users && !map->user_owned)
		list_del(&map->node);
	else
		map = NULL;
	spin_unlock(&pin->lock);
	gpupin_map_destroy_unuse(pin, map);
}

static int gpupin_dma_map_validate(const struct gpupin_dma_map *arg)
{
	if (arg->flags || arg->reserved[0] || arg->reserved[1] ||
	    arg->pci_domain > 0xffff || arg->pci_bus > 0xff || arg->pci_devfn > 0xff)
		return -EINVAL;
	return 0;
}

/*
 * The core of DMA_MAP for a validated request: a user-owned mapping of
 * @pin for the PCI device the request names; its id and the pin's entries
 * into @arg.
 */
static int gpupin_dma_map_pci(struct gpupin_pin_obj *pin, struct gpupin_dma_map *arg)
{
	struct gpupin_map *map;
	struct pci_dev *pdev;
	u32 id;
	int ret;

	pdev = pci_get_domain_bus_and_slot(arg->pci_domain, arg->pci_bus, arg->pci_devfn);
	if (!pdev)
		return -ENODEV;
	ret = gpupin_map_create(pin, pdev, true, &map, &id);
	if (!ret) {
		arg->mapping_id = id;
		arg->entries = pin->entries;
	}
	pci_dev_put(pdev);
	return ret;
}

/* DMA_MAP: copy in, validate, map (gpupin_dma_map_pci), copy out. */
long gpupin_ioctl_dma_map(struct gpupin_file *f, struct gpupin_dma_map __user *uarg)
{
	struct gpupin_dma_map arg;
	struct gpupin_pin_obj *pin;
	int ret;

	/* A mapping opens the memory to a device: the opener must be the administrator. */
	if (!f->admin)
		return -EPERM;
	if (copy_from_user(&arg, uarg, sizeof(arg)))
		return -EFAULT;
	ret = gpupin_dma_map_validate(&arg);
	if (ret)
		return ret;
	pin = gpupin_pin_lookup_owned(f, arg.handle, &ret);
	if (!pin)
		return ret;
	ret = gpupin_dma_map_pci(pin, &arg);
	/* On a fault the mapping stays; it goes away with the pin. */
	if (!ret && copy_to_user(uarg, &arg, sizeof(arg)))
		ret = -EFAULT;
	gpupin_pin_put(pin);
	return ret;
}

static int gpupin_fill_dma_addrs(struct gpupin_pin_obj *pin, u64 *addrs, u32 first, u32 count,
				 void *ctx)
{
	const u32 *mapping_id = ctx;
	struct gpupin_map *map;
	u32 i;

	spin_lock(&pin->lock);
	map = gpupin_map_find_locked(pin, *mapping_id);
	if (map) {
		for (i = 0; i < count; i++)
			addrs[i] = map->dma[first + i];
	}
	spin_unlock(&pin->lock);
	return map ? 0 : -ENOENT;
}

long gpupin_ioctl_dma_addrs(struct gpupin_file *f, struct gpupin_dma_addrs __user *uarg)
{
	struct gpupin_dma_addrs arg;

	/* Bus addresses are as sensitive as physical ones (gpupin_may_read_addrs). */
	if (!gpupin_may_read_addrs(f))
		return -EPERM;
	if (copy_from_user(&arg, uarg, sizeof(arg)))
		return -EFAULT;
	if (arg.flags || arg.reserved[0] || arg.reserved[1] || !arg.count ||
	    arg.count > GPUPIN_MAX_ADDRS_PER_CALL)
		return -EINVAL;
	return gpupin_copy_addr_window(f, arg.handle, arg.first, arg.count, arg.addrs,
				       gpupin_fill_dma_addrs, &arg.mapping_id);
}

long gpupin_ioctl_dma_unmap(struct gpupin_file *f, struct gpupin_dma_unmap __user *uarg)
{
	struct gpupin_dma_unmap arg;
	struct gpupin_pin_obj *pin;
	struct gpupin_map *map;
	int ret;

	if (copy_from_user(&arg, uarg, sizeof(arg)))
		return -EFAULT;
	if (arg.flags || arg.reserved[0] || arg.reserved[1])
		return -EINVAL;
	pin = gpupin_pin_lookup_owned(f, arg.handle, &ret);
	if (!pin)
		return ret;
	ret = gpupin_pin_use(pin);
	if (ret)
		goto out_put;
	spin_lock(&pin->lock);
	map = gpupin_map_find_locked(pin, arg.mapping_id);
	if (map && !map->user_owned)
		map = NULL;	/* a driver's own mapping */
	ret = map ? 0 : -ENOENT;
	if (map) {
		map->user_owned = false;
		if (map->drv_users)
			map = NULL;	/* drivers still use it: theirs now */
		else
			list_del(&map->node);
	}
	spin_unlock(&pin->lock);
	gpupin_map_destroy_unuse(pin, map);
out_put:
	gpupin_pin_put(pin);
	return ret;
}
