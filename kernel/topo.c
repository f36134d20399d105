// SPDX-License-Identifier: (GPL-2.0 OR MIT)
/*
 * gpupin: NVIDIA's topology verdict for gpupin's own DMA mappings.
 *
 * NVIDIA maps GPU memory for a peer only where its topology check allows it
 * (nv_grdma_pci_topology_supported, kernel-open/nvidia/nv-pci.c): the
 * administrator's NVreg_GrdmaPciTopoCheckOverride first, then chipsets the
 * resource manager flags NV_FLAG_PCI_P2P_UNSUPPORTED_CHIPSET (peer DMA only
 * below a common switch); a coherent GPU is never refused.  Both
 * nvidia_p2p_dma_map_pages (rm_p2p_dma_map_pages, osapi.c) and the dma-buf
 * attach (nv_dma_buf_attach, nv-dmabuf.c) return NV_ERR_NOT_SUPPORTED,
 * -ENOTSUPP, there.  gpupin's own mappings (ownmap.c) must refuse the same
 * peers, but neither input of the check is visible outside NVIDIA's module.
 *
 * So gpupin asks NVIDIA, once per (GPU, peer device): it pins the first
 * 64 KiB of the memory being mapped with the persistent API, maps that for
 * the peer with nvidia_p2p_dma_map_pages, and undoes both.  Why not ask with
 * the non-persistent table itself (NVIDIA accepts it): dma_map_pages waits
 * for the RM API lock under which a free callback runs, and NVIDIA frees the
 * table when the callback returns; the callback cannot wait for the mapper
 * (the mapper waits for the callback's lock), so a free in that window
 * corrupts NVIDIA's heap.  A persistent table has no callback: only our put
 * releases it.  The memory is the caller's own (the persistent lookup is in
 * the calling process, as for the pin), and the probe costs 64 KiB of BAR1
 * for its duration.
 *
 * The answer is kept: the verdict cannot change while NVIDIA's module is
 * loaded (the override is read at load, the chipset at adapter start), and
 * gpupin depends on that module.  Only "allowed" and "refused" (-ENOTSUPP)
 * are answers.  When NVIDIA cannot be asked (no persistent API, MIG before
 * 570, vGPU, confidential computing, a caller outside the pinning process,
 * BAR1 full, a memory freed meanwhile) nothing is kept and the caller
 * mirrors what it can see of the check (gpupin_topo_common_switch).
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/list.h>
#include <linux/mutex.h>
#include <linux/pci.h>
#include <linux/slab.h>
#include <linux/string.h>
#include "gpupin.h"

/* Pairs kept; more GPUs x peers than this are asked each time. */
#define GPUPIN_TOPO_MAX 256

struct gpupin_topo {
	struct list_head node;
	u8 uuid[16];		/* the GPU's, from its page tables */
	struct pci_dev *peer;	/* holds a reference: a new device is a new pair */
	bool allowed;
};

static LIST_HEAD(gpupin_topo_list);
static unsigned int gpupin_topo_n;
static DEFINE_MUTEX(gpupin_topo_lock);	/* guards gpupin_topo_list and gpupin_topo_n */

/*
 * Ask NVIDIA whether @peer may DMA to the GPU memory of @pin: 0 yes,
 * -EOPNOTSUPP no, -ENOENT when it could not be asked.  Takes NVIDIA's API
 * lock: the caller must not be an in-flight user of any pin.
 */
static int gpupin_topo_ask(struct gpupin_pin_obj *pin, struct pci_dev *peer)
{
	struct nvidia_p2p_page_table *pt = NULL;
	struct nvidia_p2p_dma_mapping *m = NULL;
	int ret;

	/* On failure *pt may point to a freed table: never touched. */
	if (gpupin_p2p_get_persistent(pin->aligned_va, GPU_BOUND_SIZE, &pt))
		return -ENOENT;
	/*
	 * The address is pinned again here: freed meanwhile and reallocated on
	 * another GPU, the answer would be that GPU's, kept under this one's UUID.
	 */
	if (!gpupin_table_version_ok(pt->version) || !pt->gpu_uuid ||
	    memcmp(pt->gpu_uuid, pin->gpu_uuid, sizeof(pin->gpu_uuid)))
		ret = -ENODEV;	/* unknown: not kept */
	else
		ret = nvidia_p2p_dma_map_pages(peer, pt, &m);
	if (!ret)
		nvidia_p2p_dma_unmap_pages(peer, pt, m);
	if (gpupin_p2p_put_persistent(pin->aligned_va, pt))
		pr_warn_ratelimited("topology probe: put_pages_persistent failed\n");
	if (!ret)
		return 0;
	return ret == -ENOTSUPP ? -EOPNOTSUPP : -ENOENT;
}

/*
 * NVIDIA's verdict on DMA by @peer to @pin's GPU: 0 allowed, -EOPNOTSUPP
 * refused, -ENOENT unknown (see above).  The caller must not be an
 * in-flight user of any pin.
 */
int gpupin_topo_verdict(struct gpupin_pin_obj *pin, struct pci_dev *peer)
{
	struct gpupin_topo *t;
	int ret = -ENOENT;

	mutex_lock(&gpupin_topo_lock);
	list_for_each_entry(t, &gpupin_topo_list, node) {
		if (t->peer == peer && !memcmp(t->uuid, pin->gpu_uuid, sizeof(t->uuid))) {
			ret = t->allowed ? 0 : -EOPNOTSUPP;
			break;
		}
	}
	mutex_unlock(&gpupin_topo_lock);
	if (ret != -ENOENT)
		return ret;

	/*
	 * Only the pinning process can ask: NVIDIA looks the address up in the
	 * caller's context, where another process (a driver's kworker, the
	 * kernel API from elsewhere) has other memory or none.
	 */
	if (!gpupin_caller_owns(pin->file))
		return -ENOENT;
	/* Unlocked: two first mappings of one pair may both ask; the answer is the same. */
	ret = gpupin_topo_ask(pin, peer);
	if (ret == -ENOENT)
		return ret;
	if (ret)
		pr_info_ratelimited("%s: NVIDIA's topology check refuses peer DMA to GPU %pU\n",
				    pci_name(peer), pin->gpu_uuid);
	t = kzalloc(sizeof(*t), GFP_KERNEL);
	if (!t)
		return ret;	/* not kept: asked again next time */
	memcpy(t->uuid, pin->gpu_uuid, sizeof(t->uuid));
	t->peer = pci_dev_get(peer);
	t->allowed = !ret;
	mutex_lock(&gpupin_topo_lock);
	if (gpupin_topo_n < GPUPIN_TOPO_MAX) {
		list_add(&t->node, &gpupin_topo_list);
		gpupin_topo_n++;
		t = NULL;
	}
	mutex_unlock(&gpupin_topo_lock);
	if (t) {
		pci_dev_put(t->peer);
		kfree(t);
	}
	return ret;
}

/*
 * NVIDIA's rule for a flagged chipset (nv_pci_has_common_pci_switch): some
 * bridge upstream of @gpu is upstream of @peer too.
 */
bool gpupin_topo_common_switch(struct pci_dev *gpu, struct pci_dev *peer)
{
	struct pci_dev *a, *b;

	for (a = pci_upstream_bridge(gpu); a; a = pci_upstream_bridge(a))
		for (b = pci_upstream_bridge(peer); b; b = pci_upstream_bridge(b))
			if (a == b)
				return true;
	return false;
}

/* Forget every verdict (module unload; testing: a simulator whose verdict changed). */
void gpupin_topo_forget(void)
{
	struct gpupin_topo *t, *tmp;
	LIST_HEAD(old);

	mutex_lock(&gpupin_topo_lock);
	list_splice_init(&gpupin_topo_list, &old);
	gpupin_topo_n = 0;
	mutex_unlock(&gpupin_topo_lock);
	list_for_each_entry_safe(t, tmp, &old, node) {
		pci_dev_put(t->peer);
		kfree(t);
	}
}
