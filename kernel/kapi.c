// SPDX-License-Identifier: (GPL-2.0 OR MIT)
/*
 * gpupin: the kernel API for third-party device drivers
 * (include/gpupin/gpupin.h).  A reference holds the pin (kref), the gpupin
 * file (so the file's release, which destroys its pins, waits for the
 * driver) and at most one share of a DMA mapping.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/err.h>
#include <linux/file.h>
#include <linux/fs.h>
#include <linux/module.h>
#include <linux/pci.h>
#include <linux/slab.h>
#include <gpupin/gpupin.h>
#include "gpupin.h"

struct gpupin_ref {
	struct list_head node;		/* pin->refs, under pin->refs_lock */
	struct gpupin_pin_obj *pin;	/* holds a kref */
	struct file *file;		/* holds a file reference */
	void (*notify)(void *priv);
	void *priv;
	bool notified;			/* under pin->refs_lock */
	/*
	 * Serialises gpupin_ref_dma_map() calls on this reference, so two of
	 * them cannot both map and leave one share behind.  Taken with no gpupin
	 * lock held; the notifier never takes it.
	 */
	struct mutex map_lock;
	u32 map_id;			/* 0 = not mapped; set under map_lock */
	struct gpupin_map *map;		/* valid inside access sections */
};

/*
 * From the free callback, the pin already INVALIDATING: tell every driver
 * holding a reference to stop DMA.  Each notifier runs once.
 */
void gpupin_notify_refs(struct gpupin_pin_obj *pin)
{
	struct gpupin_ref *ref;

	mutex_lock(&pin->refs_lock);
	list_for_each_entry(ref, &pin->refs, node) {
		if (ref->notify && !ref->notified) {
			ref->notified = true;
			ref->notify(ref->priv);
		}
	}
	mutex_unlock(&pin->refs_lock);
}

struct gpupin_ref *gpupin_ref_get(int fd, u64 handle, void (*notify)(void *priv), void *priv)
{
	struct gpupin_pin_obj *pin;
	struct gpupin_file *f;
	struct gpupin_ref *ref;
	struct file *file;
	int ret;

	file = fget(fd);
	if (!file)
		return ERR_PTR(-EBADF);
	ret = -EINVAL;
	f = gpupin_file_of(file);
	if (!f)
		goto err_fput;
	ret = -EACCES;
	if (!gpupin_caller_owns(f))
		goto err_fput;
	ret = -ENOMEM;
	ref = gpupin_kzalloc(sizeof(*ref), GFP_KERNEL);
	if (!ref)
		goto err_fput;
	ret = -ENOENT;
	pin = gpupin_pin_lookup(f, handle);
	if (!pin)
		goto err_free;
	mutex_init(&ref->map_lock);
	ref->pin = pin;
	ref->file = file;
	ref->notify = notify;
	ref->priv = priv;

	mutex_lock(&pin->refs_lock);
	if (pin->gone || pin->orphaned) {
		ret = -ENOENT;		/* unpinned as we looked it up */
	} else {
		spin_lock(&pin->lock);
		ret = pin->state == GPUPIN_PIN_PINNED ? 0 : -ENODEV;
		spin_unlock(&pin->lock);
	}
	if (!ret) {
		list_add_tail(&ref->node, &pin->refs);
		pin->nr_refs++;
	}
	mutex_unlock(&pin->refs_lock);
	if (ret)
		goto err_pin;
	gpupin_dbg("pin %llu: driver reference taken\n", pin->handle);
	return ref;

err_pin:
	gpupin_pin_put(pin);
err_free:
	kfree(ref);
err_fput:
	fput(file);
	return ERR_PTR(ret);
}
EXPORT_SYMBOL_GPL(gpupin_ref_get);

void gpupin_ref_put(struct gpupin_ref *ref)
{
	struct gpupin_pin_obj *pin = ref->pin;
	bool last;

	if (ref->map_id)
		gpupin_map_drop_driver(pin, ref->map_id);
	mutex_lock(&pin->refs_lock);
	list_del(&ref->node);
	last = !--pin->nr_refs && pin->orphaned;
	if (last)
		pin->gone = true;
	mutex_unlock(&pin->refs_lock);
	if (last)	/* the user unpinned it meanwhile; now it goes */
		gpupin_pin_destroy_now(pin->file, pin, pin->orphan_reason);
	gpupin_pin_put(pin);
	fput(ref->file);
	mutex_destroy(&ref->map_lock);
	kfree(ref);
}
EXPORT_SYMBOL_GPL(gpupin_ref_put);

int gpupin_ref_info(struct gpupin_ref *ref, struct gpupin_ref_info *info)
{
	struct gpupin_pin_obj *pin = ref->pin;
	int ret = gpupin_pin_use(pin);

	if (ret)
		return -ENODEV;
	info->va = pin->va;
	info->size = pin->size;
	info->aligned_va = pin->aligned_va;
	info->page_size = BIT(pin->page_shift);
	info->entries = pin->entries;
	BUILD_BUG_ON(sizeof(info->gpu_uuid) != 16);
	gpupin_pin_uuid(pin, info->gpu_uuid);
	BUILD_BUG_ON((GPUPIN_REF_PERSISTENT ^ GPUPIN_PIN_PERSISTENT) |
		     (GPUPIN_REF_DMABUF ^ GPUPIN_PIN_DMABUF) |
		     (GPUPIN_REF_REVOCABLE ^ GPUPIN_PIN_REVOCABLE));
	/* Set when the pin is made, before anyone can take a reference. */
	info->flags = pin->flags & (GPUPIN_REF_PERSISTENT | GPUPIN_REF_DMABUF |
				    GPUPIN_REF_REVOCABLE);
	gpupin_pin_unuse(pin);
	return 0;
}
EXPORT_SYMBOL_GPL(gpupin_ref_info);

int gpupin_ref_dma_map(struct gpupin_ref *ref, struct pci_dev *pdev)
{
	struct gpupin_pin_obj *pin = ref->pin;
	struct gpupin_map *map;
	u32 id;
	int ret;

	if (!pdev)
		return -EINVAL;
	mutex_lock(&ref->map_lock);
	if (ref->map_id) {
		ret = -ENODEV;
		if (!gpupin_pin_use(pin)) {
			ret = ref->map->pdev == pdev ? 0 : -EBUSY;
			gpupin_pin_unuse(pin);
		}
		goto out;
	}
	ret = gpupin_map_for_driver(pin, pdev, &map, &id);
	if (ret == -ENXIO)
		ret = -ENODEV;
	if (!ret) {
		ref->map = map;
		ref->map_id = id;
	}
out:
	mutex_unlock(&ref->map_lock);
	return ret;
}
EXPORT_SYMBOL_GPL(gpupin_ref_dma_map);

int gpupin_access_begin(struct gpupin_ref *ref)
{
	return gpupin_pin_use(ref->pin) ? -ENODEV : 0;
}
EXPORT_SYMBOL_GPL(gpupin_access_begin);

void gpupin_access_end(struct gpupin_ref *ref)
{
	gpupin_pin_unuse(ref->pin);
}
EXPORT_SYMBOL_GPL(gpupin_access_end);

u64 gpupin_ref_page_phys(struct gpupin_ref *ref, u32 idx)
{
	return gpupin_pin_page_addr(ref->pin, idx);
}
EXPORT_SYMBOL_GPL(gpupin_ref_page_phys);

dma_addr_t gpupin_ref_dma_addr(struct gpupin_ref *ref, u32 idx)
{
	if (!ref->map_id || idx >= ref->pin->entries)
		return 0;
	return ref->map->dma[idx];
}
EXPORT_SYMBOL_GPL(gpupin_ref_dma_addr);
