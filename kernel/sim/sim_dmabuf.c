// SPDX-License-Identifier: (GPL-2.0 OR MIT)
/*
 * nvp2p_sim: simulated GPU memory exported as a dma-buf, the way
 * cuMemGetHandleForAddressRange(CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD) exports
 * real GPU memory.  Two exporters, chosen per export:
 *
 * - NVIDIA's (the default; kernel-open/nvidia/nv-dmabuf.c, nv_dma_buf_ops):
 *   static - no pin/unpin, nothing ever calls move_notify - and the export
 *   holds the memory (nv_dma_buf_create duplicates the handles with
 *   rm_dma_buf_dup_mem_handle): freeing the allocation frees nothing while a
 *   reference to the buffer exists.  nv_dma_buf_attach takes the importing
 *   device for a PCI device (to_pci_dev(attachment->dev)->dma_mask), so an
 *   attach by any other device is a strict misuse here (it reads out of
 *   bounds there): counted in dmabuf_nonpci_attaches, WARNed and refused
 *   with -EINVAL.  A dynamic importer without peer2peer is refused with
 *   -ENOTSUPP, as NVIDIA refuses it for GPU memory without struct pages.
 * - A revoking one (NVP2P_SIM_EXPORT_REVOCABLE), as upstream amdgpu or
 *   vfio-pci export: dynamic (pin/unpin, mappings made under the reservation
 *   lock), it revokes the buffer when the allocation is freed: every importer
 *   gets move_notify, later pins and mappings fail with -ENODEV.
 *
 * In both the memory stays until the last reference to the buffer goes (the
 * export holds the allocation, counted in alloc_bytes against mem_limit),
 * then is poisoned as any freed allocation is; and a mapping's scatterlist
 * has no struct pages, as device memory's has (sim_dmabuf_map_segs).
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/dma-buf.h>
#include <linux/dma-fence.h>
#include <linux/dma-mapping.h>
#include <linux/dma-resv.h>
#include <linux/err.h>
#include <linux/fcntl.h>
#include <linux/fs.h>
#include <linux/module.h>
#include <linux/pci.h>
#include <linux/scatterlist.h>
#include <linux/slab.h>
#include <linux/uaccess.h>
#include "../compat.h"
#include "sim.h"

GPUPIN_IMPORT_NS_DMA_BUF();

/* Fault injection for the exporters, with fail_errno (sim_injected_error_locked). */
static int sim_fail_attach_nth;
module_param_named(fail_attach_nth, sim_fail_attach_nth, int, 0644);
MODULE_PARM_DESC(fail_attach_nth, "Fail the Nth attach to an exported dma-buf from now with -fail_errno, then reset to 0 (0 = off)");

static int sim_fail_dmabuf_map_nth;
module_param_named(fail_dmabuf_map_nth, sim_fail_dmabuf_map_nth, int, 0644);
MODULE_PARM_DESC(fail_dmabuf_map_nth, "Fail the Nth mapping of an exported dma-buf from now with -fail_errno, then reset to 0 (0 = off)");

/*
 * move_fences: the revoking exporter migrates the buffer to pin or map it,
 * as amdgpu does (amdgpu_bo_pin -> ttm_bo_validate queues a blit): the op
 * returns at once with the copy still running behind a fence of usage
 * KERNEL in the buffer's reservation object.  The dma-buf core waits for
 * those only for static importers (dma_buf_map_attachment); a dynamic one
 * must wait itself before it uses the addresses.  Here the "copy" ends
 * when a test writes move_fences_signal; move_fences_pending counts the
 * fences not signalled yet; the module's unload signals any left.
 */
static bool sim_move_fences;
module_param_named(move_fences, sim_move_fences, bool, 0644);
MODULE_PARM_DESC(move_fences, "The revoking exporter starts a move behind a KERNEL fence at each pin and map, as amdgpu does; it ends when move_fences_signal is written (default off)");

struct sim_move_fence {
	struct dma_fence base;		/* first: dma_fence_free() frees the whole */
	struct list_head node;		/* sim_move_fences_list, under sim_move_lock */
};

static DEFINE_SPINLOCK(sim_move_lock);	/* the list and the fences' own lock */
static LIST_HEAD(sim_move_fences_list);
static u64 sim_move_context;

static const char *sim_move_fence_name(struct dma_fence *f)
{
	return KBUILD_MODNAME;
}

static const char *sim_move_timeline_name(struct dma_fence *f)
{
	return "move";
}

static const struct dma_fence_ops sim_move_fence_ops = {
	.get_driver_name = sim_move_fence_name,
	.get_timeline_name = sim_move_timeline_name,
};

/* A pending move of @dmabuf; its reservation lock held.  Best effort. */
static void sim_start_move(struct dma_buf *dmabuf)
{
	struct dma_resv *resv = dmabuf->resv;
	struct sim_move_fence *mf;
	static u64 seqno;

	dma_resv_assert_held(resv);
	if (!READ_ONCE(sim_move_fences) || dma_resv_reserve_fences(resv, 1))
		return;
	mf = kzalloc(sizeof(*mf), GFP_KERNEL);
	if (!mf)
		return;
	spin_lock(&sim_move_lock);
	dma_fence_init(&mf->base, &sim_move_fence_ops, &sim_move_lock, sim_move_context, ++seqno);
	dma_fence_get(&mf->base);	/* the list's */
	list_add_tail(&mf->node, &sim_move_fences_list);
	spin_unlock(&sim_move_lock);
	dma_resv_add_fence(resv, &mf->base, DMA_RESV_USAGE_KERNEL);
	dma_fence_put(&mf->base);	/* the reservation object holds its own */
}

/* End every pending move: signal its fence. */
static void sim_end_moves(void)
{
	struct sim_move_fence *mf, *tmp;
	LIST_HEAD(done);

	spin_lock(&sim_move_lock);
	list_splice_init(&sim_move_fences_list, &done);
	list_for_each_entry(mf, &done, node)
		dma_fence_signal_locked(&mf->base);
	spin_unlock(&sim_move_lock);
	list_for_each_entry_safe(mf, tmp, &done, node) {
		list_del(&mf->node);
		dma_fence_put(&mf->base);
	}
}

void sim_dmabuf_init(void)
{
	sim_move_context = dma_fence_context_alloc(1);
}

/* Module unload: no buffer is left (each holds the module), nor may a move be. */
void sim_dmabuf_exit(void)
{
	sim_end_moves();
}

static int sim_move_signal_set(const char *val, const struct kernel_param *kp)
{
	sim_end_moves();
	return 0;
}

static int sim_move_pending_get(char *buf, const struct kernel_param *kp)
{
	struct sim_move_fence *mf;
	unsigned int n = 0;

	spin_lock(&sim_move_lock);
	list_for_each_entry(mf, &sim_move_fences_list, node)
		n++;
	spin_unlock(&sim_move_lock);
	return sysfs_emit(buf, "%u\n", n);
}

static const struct kernel_param_ops sim_move_signal_ops = {
	.set = sim_move_signal_set,
};
module_param_cb(move_fences_signal, &sim_move_signal_ops, NULL, 0200);
MODULE_PARM_DESC(move_fences_signal, "Write anything: every pending move of move_fences ends (its fence signals)");

static const struct kernel_param_ops sim_move_pending_ops = {
	.get = sim_move_pending_get,
};
module_param_cb(move_fences_pending, &sim_move_pending_ops, NULL, 0444);
MODULE_PARM_DESC(move_fences_pending, "Moves of move_fences whose fence has not signalled yet");

/*
 * Guards every alloc->exports list, and keeps a listed buffer from being
 * released while sim_revoke_exports() works on it (the release op takes it
 * to unlist the buffer).  Order: after ctx->lock, before the reservation
 * locks of the buffers.
 */
static DEFINE_MUTEX(sim_exports_lock);

struct sim_export {
	struct list_head node;		/* alloc->exports, under sim_exports_lock */
	struct sim_alloc *alloc;	/* holds a reference */
	struct dma_buf *dmabuf;
	bool revocable;			/* NVP2P_SIM_EXPORT_REVOCABLE; set at export */
	bool revoked;			/* under the dma-buf's reservation lock */
	unsigned int pins;		/* under the dma-buf's reservation lock */
};

/*
 * An importer attaches (refused when a test injects it: fail_attach_nth) or
 * detaches; counted, so that a test sees an importer that left one behind.
 * NVIDIA's exporter (not revocable) also refuses a non-PCI device (a strict
 * misuse), a dynamic importer that cannot take peer-to-peer addresses and a
 * device its topology check denies (deny_peers, sim_topo.c).
 */
static int sim_dmabuf_attach(struct dma_buf *dmabuf, struct dma_buf_attachment *attach)
{
	struct sim_export *exp = dmabuf->priv;
	int err;

	spin_lock(&sim_lock);
	err = sim_injected_error_locked(&sim_fail_attach_nth);
	if (!err && !exp->revocable && !dev_is_pci(attach->dev)) {
		/* nv_dma_buf_attach: to_pci_dev(attachment->dev)->dma_mask */
		sim_count_misuse(&sim_stats.dmabuf_nonpci_attaches,
				 "dma-buf attach by a non-PCI device: NVIDIA's exporter reads it as a pci_dev");
		err = -EINVAL;
	}
	if (!err && !exp->revocable && attach->importer_ops && !attach->peer2peer)
		err = -ENOTSUPP;	/* GPU memory without struct pages */
	/* nv_dma_buf_attach: nv_grdma_pci_topology_supported (deny_peers) */
	if (!err && !exp->revocable && sim_peer_denied(attach->dev))
		err = -ENOTSUPP;
	if (!err)
		sim_stats.dmabuf_attachments++;
	spin_unlock(&sim_lock);
	return err;
}

static void sim_dmabuf_detach(struct dma_buf *dmabuf, struct dma_buf_attachment *attach)
{
	spin_lock(&sim_lock);
	sim_stats.dmabuf_attachments--;
	spin_unlock(&sim_lock);
}

static int sim_dmabuf_pin(struct dma_buf_attachment *attach)
{
	struct sim_export *exp = attach->dmabuf->priv;

	dma_resv_assert_held(attach->dmabuf->resv);
	if (exp->revoked)
		return -ENODEV;
	sim_start_move(attach->dmabuf);
	exp->pins++;
	spin_lock(&sim_lock);
	sim_stats.dmabuf_pins++;
	spin_unlock(&sim_lock);
	return 0;
}

static void sim_dmabuf_unpin(struct dma_buf_attachment *attach)
{
	struct sim_export *exp = attach->dmabuf->priv;

	dma_resv_assert_held(attach->dmabuf->resv);
	WARN_ON_ONCE(!exp->pins);
	exp->pins--;
	spin_lock(&sim_lock);
	sim_stats.dmabuf_pins--;
	spin_unlock(&sim_lock);
}

/* Undoes the first @n segments of sim_dmabuf_map_segs(). */
static void sim_dmabuf_unmap_segs(struct device *dev, struct sg_table *sgt, unsigned int n,
				  enum dma_data_direction dir)
{
	struct scatterlist *sg;
	unsigned int i;

	for_each_sg(sgt->sgl, sg, n, i)
		dma_unmap_page(dev, sg_dma_address(sg), sg_dma_len(sg), dir);
}

/*
 * NVIDIA's table for discrete GPU memory (nv_dma_buf_map_pfns): no struct
 * pages, only DMA addresses and lengths filled in by hand, each chunk cut at
 * the device's page-aligned dma_get_max_seg_size (nv_dma_buf_get_sg_count).
 * An importer must not use sg_page(), sg_phys() or kmap on it.  Here each
 * segment is a piece of a host chunk mapped with dma_map_page; NVIDIA maps
 * BAR1 ranges with dma_map_resource (nv_dma_map_peer).
 */
static int sim_dmabuf_map_segs(struct device *dev, struct sim_alloc *alloc, u32 seg,
			       struct sg_table *sgt, enum dma_data_direction dir)
{
	struct scatterlist *sg = sgt->sgl;
	unsigned int done = 0;
	unsigned long c;
	u32 off;

	for (c = 0; c < alloc->nchunks; c++) {
		for (off = 0; off < SIM_PAGE_SIZE; off += seg) {
			u32 len = min_t(u32, seg, SIM_PAGE_SIZE - off);
			dma_addr_t addr = dma_map_page(dev, alloc->chunks[c], off, len, dir);

			if (dma_mapping_error(dev, addr)) {
				sim_dmabuf_unmap_segs(dev, sgt, done, dir);
				return -ENOMEM;
			}
			sg_set_page(sg, NULL, len, 0);
			sg_dma_address(sg) = addr;
			sg_dma_len(sg) = len;
			done++;
			sg = sg_next(sg);
		}
	}
	sgt->nents = done;
	return 0;
}

/*
 * NVIDIA's exporter takes the RM API lock (and a GPU lock) in its map,
 * unmap and release ops (nv_dma_buf_get_phys_addresses /
 * nv_dma_buf_put_phys_addresses on the first map and last unmap,
 * nv_dma_buf_undup_mem_handles at release; nv-dmabuf.c), under the
 * reservation lock the dma-buf core may hold: the order is reservation
 * lock -> RM API lock.  The static exporter does the same here (on every
 * map and unmap, not only the first and last), so an importer that waits
 * for a dma-buf op from a free callback deadlocks here too (caught by
 * lock_timeout_ms, and by lockdep).  The revocable exporter plays
 * upstream exporters, which have no RM lock: it takes none (its
 * revocation runs under the API lock, sim_revoke_exports()).
 */
static int sim_dmabuf_rm_lock(struct sim_export *exp, const char *who)
{
	return exp->revocable ? 0 : sim_api_lock(who);
}

static void sim_dmabuf_rm_unlock(struct sim_export *exp)
{
	if (!exp->revocable)
		sim_api_unlock();
}

static struct sg_table *sim_dmabuf_map(struct dma_buf_attachment *attach,
				       enum dma_data_direction dir)
{
	struct sim_export *exp = attach->dmabuf->priv;
	struct sim_alloc *alloc = exp->alloc;
	u32 seg = ALIGN_DOWN(dma_get_max_seg_size(attach->dev), PAGE_SIZE);
	struct sg_table *sgt;
	int ret;

	/* The dma-buf core maps a static exporter's buffers without the lock. */
	if (exp->revocable)
		dma_resv_assert_held(attach->dmabuf->resv);
	if (exp->revocable && exp->revoked)
		return ERR_PTR(-ENODEV);
	spin_lock(&sim_lock);
	ret = sim_injected_error_locked(&sim_fail_dmabuf_map_nth);
	spin_unlock(&sim_lock);
	/*
	 * NVIDIA's nv_dma_buf_map returns NULL, which the dma-buf core makes
	 * -ENOMEM; so does a device whose segments are under a page.
	 */
	if (ret == -ENOMEM || seg < PAGE_SIZE)
		return NULL;
	if (ret)
		return ERR_PTR(ret);
	seg = min_t(u32, seg, SIM_PAGE_SIZE);
	sgt = kzalloc(sizeof(*sgt), GFP_KERNEL);
	if (!sgt)
		return ERR_PTR(-ENOMEM);
	ret = sg_alloc_table(sgt, alloc->nchunks * DIV_ROUND_UP(SIM_PAGE_SIZE, seg), GFP_KERNEL);
	if (ret)
		goto err_free;
	ret = sim_dmabuf_rm_lock(exp, "nv_dma_buf_map");
	if (ret)
		goto err_table;
	ret = sim_dmabuf_map_segs(attach->dev, alloc, seg, sgt, dir);
	sim_dmabuf_rm_unlock(exp);
	if (ret)
		goto err_table;
	if (exp->revocable)
		sim_start_move(attach->dmabuf);
	spin_lock(&sim_lock);
	sim_stats.dmabuf_mappings++;
	spin_unlock(&sim_lock);
	return sgt;

err_table:
	sg_free_table(sgt);
err_free:
	kfree(sgt);
	return ERR_PTR(ret);
}

static void sim_dmabuf_unmap(struct dma_buf_attachment *attach, struct sg_table *sgt,
			     enum dma_data_direction dir)
{
	struct sim_export *exp = attach->dmabuf->priv;
	/* A failure was WARNed (inside a callback, or a deadlock): unmap all the same. */
	bool locked = !sim_dmabuf_rm_lock(exp, "nv_dma_buf_unmap");

	sim_dmabuf_unmap_segs(attach->dev, sgt, sgt->nents, dir);
	if (locked)
		sim_dmabuf_rm_unlock(exp);
	sg_free_table(sgt);
	kfree(sgt);
	spin_lock(&sim_lock);
	sim_stats.dmabuf_mappings--;
	spin_unlock(&sim_lock);
}

/* The last reference went: no importer is attached any more. */
static void sim_dmabuf_release(struct dma_buf *dmabuf)
{
	struct sim_export *exp = dmabuf->priv;
	bool locked;

	WARN_ON_ONCE(exp->pins);
	mutex_lock(&sim_exports_lock);
	list_del(&exp->node);
	mutex_unlock(&sim_exports_lock);
	/* nv_dma_buf_release: the memory handles go back under the RM API lock. */
	locked = !sim_dmabuf_rm_lock(exp, "nv_dma_buf_release");
	if (locked)
		sim_dmabuf_rm_unlock(exp);
	spin_lock(&sim_lock);
	sim_stats.dmabuf_exports--;
	spin_unlock(&sim_lock);
	sim_alloc_put(exp->alloc);
	kfree(exp);
}

/* NVIDIA's exporter: no pin/unpin, so the dma-buf core treats it as static. */
static const struct dma_buf_ops sim_dmabuf_static_ops = {
	.attach = sim_dmabuf_attach,
	.detach = sim_dmabuf_detach,
	.map_dma_buf = sim_dmabuf_map,
	.unmap_dma_buf = sim_dmabuf_unmap,
	.release = sim_dmabuf_release,
};

/* The revoking exporter (NVP2P_SIM_EXPORT_REVOCABLE). */
static const struct dma_buf_ops sim_dmabuf_revocable_ops = {
	.attach = sim_dmabuf_attach,
	.detach = sim_dmabuf_detach,
	.pin = sim_dmabuf_pin,
	.unpin = sim_dmabuf_unpin,
	.map_dma_buf = sim_dmabuf_map,
	.unmap_dma_buf = sim_dmabuf_unmap,
	.release = sim_dmabuf_release,
};

long sim_ioctl_export(struct sim_ctx *ctx, struct nvp2p_sim_export __user *uarg)
{
	DEFINE_DMA_BUF_EXPORT_INFO(info);
	struct nvp2p_sim_export arg;
	struct sim_export *exp;
	struct sim_alloc *alloc;
	struct dma_buf *dmabuf;
	int fd;

	if (copy_from_user(&arg, uarg, sizeof(arg)))
		return -EFAULT;
	if ((arg.flags & ~NVP2P_SIM_EXPORT_REVOCABLE) || arg.fd || arg.base || arg.size ||
	    arg.reserved[0] || arg.reserved[1])
		return -EINVAL;
	exp = kzalloc(sizeof(*exp), GFP_KERNEL);
	if (!exp)
		return -ENOMEM;
	exp->revocable = arg.flags & NVP2P_SIM_EXPORT_REVOCABLE;
	mutex_lock(&ctx->lock);
	alloc = sim_ctx_find(ctx, arg.va);
	if (!alloc) {
		mutex_unlock(&ctx->lock);
		kfree(exp);
		return -ENOENT;
	}
	kref_get(&alloc->ref);
	exp->alloc = alloc;
	info.ops = exp->revocable ? &sim_dmabuf_revocable_ops : &sim_dmabuf_static_ops;
	info.size = alloc->size;
	info.flags = O_RDWR;
	info.priv = exp;
	dmabuf = dma_buf_export(&info);
	if (IS_ERR(dmabuf)) {
		mutex_unlock(&ctx->lock);
		sim_alloc_put(alloc);
		kfree(exp);
		return PTR_ERR(dmabuf);
	}
	exp->dmabuf = dmabuf;
	mutex_lock(&sim_exports_lock);
	list_add_tail(&exp->node, &alloc->exports);
	mutex_unlock(&sim_exports_lock);
	spin_lock(&sim_lock);
	sim_stats.dmabuf_exports++;
	spin_unlock(&sim_lock);
	arg.base = alloc->va;
	arg.size = alloc->size;
	mutex_unlock(&ctx->lock);

	fd = dma_buf_fd(dmabuf, O_CLOEXEC);
	if (fd < 0) {
		dma_buf_put(dmabuf);
		return fd;
	}
	arg.fd = fd;
	/* On a fault the fd stays open (it is installed); user space lost it. */
	return copy_to_user(uarg, &arg, sizeof(arg)) ? -EFAULT : 0;
}

/*
 * The allocation is being freed (sim_big_lock and its context's lock held,
 * nv-p2p callbacks done): revoke every revocable export of it.  NVIDIA's
 * exports hold the memory and are left alone.
 */
void sim_revoke_exports(struct sim_alloc *alloc)
{
	struct sim_export *exp;

	/* A listed buffer stays: its release op waits for this lock to unlist it. */
	mutex_lock(&sim_exports_lock);
	list_for_each_entry(exp, &alloc->exports, node) {
		if (!exp->revocable)
			continue;
		dma_resv_lock(exp->dmabuf->resv, NULL);
		exp->revoked = true;
		gpupin_dma_buf_move_notify(exp->dmabuf);
		dma_resv_unlock(exp->dmabuf->resv);
	}
	mutex_unlock(&sim_exports_lock);
}
