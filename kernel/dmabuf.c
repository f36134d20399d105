// SPDX-License-Identifier: (GPL-2.0 OR MIT)
/*
 * gpupin: the dma-buf backend - PIN_DMABUF pins a dma-buf (the path NVIDIA
 * recommends after nv-p2p: cuMemGetHandleForAddressRange exports GPU memory
 * as one) as a pin like any other, and DMA_MAP of such a pin is an
 * attachment of the buffer for the peer device.  pin.c runs the pin's life
 * and calls this backend through gpupin_dmabuf_backend; the backend tells it
 * only of a revocation (gpupin_pin_revoke()).
 *
 * Every attachment is for a PCI device: NVIDIA's exporter treats the
 * importing device as one (nv_dma_buf_attach: to_pci_dev(dev)->dma_mask),
 * so gpupin never attaches with anything else.  PIN_DMABUF imports the
 * buffer only for a device the caller names; without one the pin just
 * holds the buffer.  Attachments are dynamic (allow_peer2peer, move_notify)
 * and pinned and mapped under the reservation lock, which works the same on
 * 6.1.y and 6.12.
 *
 * Exporters are of two kinds (dma_buf_is_dynamic()).  A static one (NVIDIA's:
 * no pin/unpin, never move_notify) holds the memory as long as the buffer
 * lives: the pin is never invalidated.  A dynamic one (amdgpu, vfio-pci) may
 * revoke: its move_notify invalidates the pin exactly as the nv-p2p free
 * callback does (validity word, poll record, netlink event, driver
 * notifiers) and unmaps every attachment of the pin; detaching waits for the
 * release (unpin, close), since detach takes the reservation lock that
 * move_notify runs under.  gpupin hears a revocation only through an
 * attachment, so a dynamic exporter's buffer needs an importing device.
 *
 * Lock order: the dma-buf reservation lock comes before pin->refs_lock and
 * pin->lock.  Nothing in gpupin takes it while an in-flight user
 * (gpupin_pin_use) is held, because a revocation waits for those under it.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/dma-buf.h>
#include <linux/dma-mapping.h>
#include <linux/dma-resv.h>
#include <linux/err.h>
#include <linux/mm.h>
#include <linux/pci.h>
#include <linux/scatterlist.h>
#include <linux/slab.h>
#include <linux/uaccess.h>
#include "compat.h"
#include "gpupin.h"

GPUPIN_IMPORT_NS_DMA_BUF();

static void gpupin_dmabuf_pin_moved(struct dma_buf_attachment *attach)
{
	gpupin_pin_revoke(attach->importer_priv);
}

static void gpupin_dmabuf_map_moved(struct dma_buf_attachment *attach)
{
	struct gpupin_map *map = attach->importer_priv;

	gpupin_pin_revoke(map->pin);
}

/* gpupin's own import of a pinned buffer. */
static const struct dma_buf_attach_ops gpupin_dmabuf_pin_ops = {
	.allow_peer2peer = true,
	.GPUPIN_DMABUF_MOVE_OP = gpupin_dmabuf_pin_moved,
};

/* A peer device's attachment (DMA_MAP, gpupin_ref_dma_map). */
static const struct dma_buf_attach_ops gpupin_dmabuf_map_ops = {
	.allow_peer2peer = true,
	.GPUPIN_DMABUF_MOVE_OP = gpupin_dmabuf_map_moved,
};

/*
 * Wait for the exporter's moves of @dmabuf to end; its reservation lock held.
 * gpupin's attachments are dynamic, and the dma-buf core waits for a buffer's
 * KERNEL fences only for static ones (dma_buf_map_attachment).  An exporter
 * that migrates the buffer to pin or map it (amdgpu: amdgpu_bo_pin ->
 * ttm_bo_validate) returns with the copy still running behind such a fence:
 * until it signals, a device would read the old contents at the new
 * addresses, and its writes could be overwritten.  NVIDIA's exporter has no
 * fences.  Interruptible: a signal fails the call (-ERESTARTSYS).
 */
static int gpupin_dmabuf_wait_moves(struct dma_buf *dmabuf)
{
	long ret = dma_resv_wait_timeout(dmabuf->resv, DMA_RESV_USAGE_KERNEL, true,
					 MAX_SCHEDULE_TIMEOUT);

	return ret < 0 ? (int)ret : 0;
}

/*
 * Per-page bus addresses of [offset, offset + n pages) of a mapping, into
 * @out.  Every segment must be page aligned.
 */
static int gpupin_sgt_addrs(struct sg_table *sgt, u64 offset, u32 n, u64 *out)
{
	struct scatterlist *sg;
	u64 pos = 0, end = offset + ((u64)n << PAGE_SHIFT);
	u32 filled = 0;
	int i;

	for_each_sgtable_dma_sg(sgt, sg, i) {
		dma_addr_t addr = sg_dma_address(sg);
		u64 len = sg_dma_len(sg);
		u64 p;

		if (!PAGE_ALIGNED(addr) || !PAGE_ALIGNED(len))
			return -EOPNOTSUPP;
		for (p = max(pos, offset); p < pos + len && p < end; p += PAGE_SIZE)
			out[filled++] = addr + (p - pos);
		pos += len;
		if (pos >= end)
			break;
	}
	return filled == n ? 0 : -EINVAL;
}

static void gpupin_att_unmap(struct gpupin_dmabuf_att *att)
{
	if (att->sgt) {
		dma_buf_unmap_attachment(att->attach, att->sgt, DMA_BIDIRECTIONAL);
		att->sgt = NULL;
	}
}

/*
 * The backend's teardown, for a revocation (move_notify, reservation lock
 * held, no in-flight user left): unmap gpupin's import and every peer
 * attachment.  The map list cannot change now: adding needs the
 * reservation lock and a PINNED pin, removing needs an in-flight user, or
 * is release's gpupin_unmap_all(), which never overlaps this: release and
 * revocation each claim the pin exclusively under pin->lock, and a release
 * that lost waits for the revocation to end.
 */
static void gpupin_dmabuf_teardown(struct gpupin_pin_obj *pin)
{
	struct gpupin_map *map;

	dma_resv_assert_held(pin->dmabuf->resv);
	gpupin_att_unmap(&pin->att);
	list_for_each_entry(map, &pin->maps, node)
		gpupin_att_unmap(&map->att);
}

/* Attach @dev to @dmabuf dynamically, with @ops and @priv, into @att. */
static int gpupin_att_attach(struct gpupin_dmabuf_att *att, struct dma_buf *dmabuf,
			     struct device *dev, const struct dma_buf_attach_ops *ops, void *priv)
{
	struct dma_buf_attachment *attach = dma_buf_dynamic_attach(dmabuf, dev, ops, priv);

	if (IS_ERR(attach))
		return gpupin_provider_err(PTR_ERR(attach));
	att->attach = attach;
	return 0;
}

/*
 * The backend's drop, at the end of a release, no lock held: destroy the
 * peer attachments (a revocation only unmapped them), unmap, unpin and
 * detach gpupin's import, and let go of the buffer and device.
 */
static void gpupin_dmabuf_drop(struct gpupin_pin_obj *pin)
{
	struct dma_buf *dmabuf = pin->dmabuf;

	gpupin_unmap_all(pin);
	if (pin->att.attach) {
		dma_resv_lock(dmabuf->resv, NULL);
		gpupin_att_unmap(&pin->att);
		if (pin->att.pinned)
			dma_buf_unpin(pin->att.attach);
		pin->att.pinned = false;
		dma_resv_unlock(dmabuf->resv);
		dma_buf_detach(dmabuf, pin->att.attach);
		pin->att.attach = NULL;
	}
	kvfree(pin->dmabuf_addrs);
	pin->dmabuf_addrs = NULL;
	pin->dmabuf = NULL;
	dma_buf_put(dmabuf);
	pci_dev_put(pin->dmabuf_pdev);
	pin->dmabuf_pdev = NULL;
}

/* The backend's addrs: bus addresses for the device of gpupin's own import. */
static int gpupin_dmabuf_addrs(const struct gpupin_pin_obj *pin, u64 *addrs, u32 first,
			       u32 count)
{
	/* A dma-buf pin has addresses only for the device it was imported for. */
	if (!pin->dmabuf_addrs)
		return -EOPNOTSUPP;
	memcpy(addrs, pin->dmabuf_addrs + first, array_size(count, sizeof(*addrs)));
	return 0;
}

/* What PIN_DMABUF's fields name: the buffer and the importing device (references). */
struct gpupin_dmabuf_req {
	struct dma_buf *dmabuf;
	struct pci_dev *pdev;		/* NULL: no device named */
};

/*
 * Import the buffer for the pin's device (pin->dmabuf_pdev), or for none:
 * attach, pin (a dynamic exporter's) and map it under the reservation
 * lock, and read its bus addresses.
 */
static int gpupin_dmabuf_import(struct gpupin_pin_obj *pin)
{
	struct dma_buf *dmabuf = pin->dmabuf;
	bool dynamic = dma_buf_is_dynamic(dmabuf);
	struct sg_table *sgt;
	int ret;

	if (!pin->dmabuf_pdev) {
		/* A revocation would go unheard without an attachment. */
		return dynamic ? -EINVAL : 0;
	}
	pin->dmabuf_addrs = gpupin_kvmalloc_array(pin->entries, sizeof(u64), GFP_KERNEL);
	if (!pin->dmabuf_addrs)
		return -ENOMEM;
	ret = gpupin_att_attach(&pin->att, dmabuf, &pin->dmabuf_pdev->dev,
				&gpupin_dmabuf_pin_ops, pin);
	if (ret)
		return ret;
	dma_resv_lock(dmabuf->resv, NULL);
	/* A static exporter's memory stays as long as the buffer: nothing to pin. */
	if (dynamic) {
		ret = gpupin_provider_err(dma_buf_pin(pin->att.attach));
		if (ret)
			goto out_unlock;
		pin->att.pinned = true;
	}
	sgt = dma_buf_map_attachment(pin->att.attach, DMA_BIDIRECTIONAL);
	if (IS_ERR(sgt)) {
		ret = gpupin_provider_err(PTR_ERR(sgt));
		goto out_unlock;
	}
	pin->att.sgt = sgt;
	ret = gpupin_dmabuf_wait_moves(dmabuf);
	if (!ret)
		ret = gpupin_sgt_addrs(sgt, pin->aligned_va, pin->entries, pin->dmabuf_addrs);
out_unlock:
	dma_resv_unlock(dmabuf->resv);
	return ret;
}

/*
 * The backend's acquire: the pin takes the request's references (the drop
 * lets them go) and imports the buffer.  A revocation from here on finds
 * the pin PINNING and makes it fail with -ENXIO.
 */
static int gpupin_dmabuf_acquire(struct gpupin_pin_obj *pin, void *priv)
{
	struct gpupin_dmabuf_req *req = priv;
	int ret;

	pin->dmabuf = req->dmabuf;
	pin->dmabuf_pdev = req->pdev;
	req->dmabuf = NULL;
	req->pdev = NULL;
	ret = gpupin_dmabuf_import(pin);
	if (ret)
		gpupin_dbg("dma-buf import failed: %d\n", ret);
	return ret;
}

/*
 * The dma-buf backend (gpupin.h: struct gpupin_pin_backend_ops).  Nothing to
 * give back before a racing revocation ends: the drop does it all after.
 */
static const struct gpupin_pin_backend_ops gpupin_dmabuf_backend = {
	.acquire = gpupin_dmabuf_acquire,
	.teardown = gpupin_dmabuf_teardown,
	.drop = gpupin_dmabuf_drop,
	.addrs = gpupin_dmabuf_addrs,
	.unmap_in_use = false,
};

/* PIN_DMABUF's checks of every field; the page-aligned size into @aligned_size. */
static int gpupin_pin_dmabuf_validate(const struct gpupin_pin_dmabuf *arg, u64 *aligned_size)
{
	u64 end;

	if ((arg->flags & ~GPUPIN_PIN_DMABUF_FLAGS_ALL) || arg->pad || arg->reserved ||
	    (!(arg->flags & GPUPIN_PIN_DMABUF_PCI_DEV) &&
	     (arg->pci_domain || arg->pci_bus || arg->pci_devfn)) ||
	    arg->pci_domain > 0xffff || arg->pci_bus > 0xff || arg->pci_devfn > 0xff ||
	    !arg->size || !PAGE_ALIGNED(arg->offset) ||
	    check_add_overflow(arg->offset, arg->size, &end) || end > U64_MAX - PAGE_SIZE)
		return -EINVAL;
	*aligned_size = PAGE_ALIGN(end) - arg->offset;
	if ((*aligned_size >> PAGE_SHIFT) > U32_MAX)
		return -EINVAL;
	return 0;
}

/*
 * The device and the buffer PIN_DMABUF names, into @req: -ENODEV for no
 * such device, -EBADF or -EINVAL for an fd that is not a dma-buf, -EINVAL
 * for a range past the buffer's end.
 */
static int gpupin_dmabuf_req_get(const struct gpupin_pin_dmabuf *arg,
				 struct gpupin_dmabuf_req *req)
{
	req->pdev = NULL;
	if (arg->flags & GPUPIN_PIN_DMABUF_PCI_DEV) {
		req->pdev = pci_get_domain_bus_and_slot(arg->pci_domain, arg->pci_bus,
							arg->pci_devfn);
		if (!req->pdev)
			return -ENODEV;
	}
	req->dmabuf = dma_buf_get(arg->fd);
	if (IS_ERR(req->dmabuf)) {
		pci_dev_put(req->pdev);
		return PTR_ERR(req->dmabuf);	/* -EBADF, or -EINVAL: not a dma-buf */
	}
	if (arg->offset + arg->size > req->dmabuf->size) {
		dma_buf_put(req->dmabuf);
		pci_dev_put(req->pdev);
		return -EINVAL;
	}
	return 0;
}

/* PIN_DMABUF's result for @pin (gpupin_pin_req.fill): @out is its struct gpupin_pin_dmabuf. */
static void gpupin_pin_dmabuf_fill(void *out, const struct gpupin_pin_obj *pin)
{
	struct gpupin_pin_dmabuf *arg = out;

	arg->handle = pin->handle;
	arg->aligned_va = pin->aligned_va;
	arg->aligned_size = pin->aligned_size;
	arg->page_size = PAGE_SIZE;
	arg->entries = pin->entries;
	memset(arg->gpu_uuid, 0, sizeof(arg->gpu_uuid));
	arg->slot = pin->slot;
	arg->pin_flags = pin->flags;
	arg->valid_word = pin->handle;
}

/*
 * PIN_DMABUF: copy in, validate, resolve the buffer and device, then a new
 * dma-buf pin (gpupin_pin_new).
 */
long gpupin_ioctl_pin_dmabuf(struct gpupin_file *f, struct gpupin_pin_dmabuf __user *uarg)
{
	struct gpupin_pin_dmabuf arg;
	struct gpupin_dmabuf_req dreq;
	struct gpupin_pin_req req;
	u64 aligned_size;
	int ret;

	if (copy_from_user(&arg, uarg, sizeof(arg)))
		return -EFAULT;
	ret = gpupin_pin_dmabuf_validate(&arg, &aligned_size);
	if (ret)
		return ret;
	if (!gpupin_caller_owns(f))
		return -EACCES;
	/* An import for a device maps the memory for it, as DMA_MAP does. */
	if ((arg.flags & GPUPIN_PIN_DMABUF_PCI_DEV) && !f->admin)
		return -EPERM;
	ret = gpupin_dmabuf_req_get(&arg, &dreq);
	if (ret)
		return ret;
	req = (struct gpupin_pin_req) {
		.ops = &gpupin_dmabuf_backend,
		.priv = &dreq,
		.va = arg.offset,
		.size = arg.size,
		.aligned_va = arg.offset,
		.aligned_size = aligned_size,
		.user_tag = arg.user_tag,
		.page_shift = PAGE_SHIFT,
		/* A dynamic exporter may revoke (move_notify); a static one never does. */
		.flags = GPUPIN_PIN_DMABUF |
			 (dma_buf_is_dynamic(dreq.dmabuf) ? GPUPIN_PIN_REVOCABLE : 0),
		.fill = gpupin_pin_dmabuf_fill,
		.arg = &arg,
		.len = sizeof(arg),
		.uarg = uarg,
	};
	ret = gpupin_pin_new(f, &req);
	/* What no pin took: it failed before the backend's acquire. */
	if (dreq.dmabuf)
		dma_buf_put(dreq.dmabuf);
	pci_dev_put(dreq.pdev);
	return ret;
}

/*
 * DMA_MAP of a dma-buf pin: a dynamic attachment for the peer device,
 * mapped and put on the pin's list under the reservation lock (so a
 * revocation sees it).  The mapping holds its own reference to the buffer:
 * an unpin may let go of the pin's while a DMA_UNMAP still works on the
 * mapping.  Takes no in-flight use: a revocation waits for those while
 * holding the lock this needs.
 */
int gpupin_dmabuf_map(struct gpupin_pin_obj *pin, struct gpupin_map *map, u32 *id)
{
	struct dma_buf *dmabuf = NULL;
	struct sg_table *sgt;
	int ret;

	map->kind = GPUPIN_MAP_DMABUF;
	spin_lock(&pin->lock);
	if (pin->state == GPUPIN_PIN_PINNED) {
		dmabuf = pin->dmabuf;
		get_dma_buf(dmabuf);
	}
	spin_unlock(&pin->lock);
	if (!dmabuf)
		return -ENXIO;
	map->dma = gpupin_kvmalloc_array(pin->entries, sizeof(u64), GFP_KERNEL);
	ret = -ENOMEM;
	if (!map->dma)
		goto out_put;
	ret = gpupin_att_attach(&map->att, dmabuf, &map->pdev->dev, &gpupin_dmabuf_map_ops, map);
	if (ret)
		goto out_free;
	dma_resv_lock(dmabuf->resv, NULL);
	sgt = dma_buf_map_attachment(map->att.attach, DMA_BIDIRECTIONAL);
	if (IS_ERR(sgt)) {
		ret = gpupin_provider_err(PTR_ERR(sgt));
	} else {
		map->att.sgt = sgt;
		ret = gpupin_dmabuf_wait_moves(dmabuf);
		if (!ret)
			ret = gpupin_sgt_addrs(sgt, pin->aligned_va, pin->entries, map->dma);
		if (!ret)
			ret = gpupin_map_add(pin, map, id);
		if (ret)
			gpupin_att_unmap(&map->att);
	}
	dma_resv_unlock(dmabuf->resv);
	if (ret) {
		dma_buf_detach(dmabuf, map->att.attach);
		map->att.attach = NULL;
	}
out_free:
	if (ret) {
		kvfree(map->dma);
		map->dma = NULL;
	}
out_put:
	if (ret)
		dma_buf_put(dmabuf);
	else
		map->dmabuf = dmabuf;
	return ret;
}

/* Destroy a peer attachment that is off the pin's list; drops its buffer reference. */
void gpupin_dmabuf_unmap(struct gpupin_map *map)
{
	struct dma_buf *dmabuf = map->dmabuf;

	dma_resv_lock(dmabuf->resv, NULL);
	gpupin_att_unmap(&map->att);
	dma_resv_unlock(dmabuf->resv);
	dma_buf_detach(dmabuf, map->att.attach);
	map->att.attach = NULL;
	kvfree(map->dma);
	map->dma = NULL;
	map->dmabuf = NULL;
	dma_buf_put(dmabuf);
}
