// SPDX-License-Identifier: (GPL-2.0 OR MIT)
/*
 * gpupin: budgets - who may keep how much pinned.
 *
 * Three limits, each checked when a pin is made, in the pinning process's
 * PIN ioctl, and given back exactly once when the pin's pages go (unpin,
 * close, the free callback, a detached pin's callback, a failed pin):
 *
 *  - max_pinned_bytes (main.c): all files together; ENOSPC past it.
 *  - max_file_pinned_bytes: each open file of /dev/gpupin; EDQUOT past it.
 *  - the dmem cgroup controller (Linux 6.14 on, CONFIG_CGROUP_DMEM): one
 *    region per GPU, "gpupin/<pci device>/bar1", for the BAR1 bytes that
 *    third-party pins take; a pin is charged to the pinning task's cgroup
 *    and fails with EDQUOT where that cgroup (or a parent) would pass its
 *    dmem.max.  Its capacity is what NVIDIA lets third parties map: the
 *    BAR less the 36 MiB NVIDIA keeps free (CLI_THIRD_PARTY_P2P_BAR1_RESERVE,
 *    _isSpaceAvailableForBar1P2PMapping in src/nvidia/src/kernel/gpu/bus/p2p.c).
 *
 * Which GPU a pin is on: the PCI device whose memory BAR holds the pin's
 * first page.  The charge comes before the pin's memory is taken where the
 * backend can tell that address first (probe_bar1: nv-p2p pins the first
 * 64 KiB persistently and gives them back), so that a pin past dmem.max
 * holds no BAR1 other tenants could have had; after the memory is taken,
 * the page table's address (read under pin->lock while PINNING: the
 * backend's bar1_addr) confirms the region or moves the charge to the
 * right one (the memory was freed and allocated again on another GPU in
 * between), and where nothing could be learned first, charges it then.
 * NVIDIA's GPUs (vendor 0x10de, display class) get their regions when the
 * module loads, at their frame-buffer BAR (the second memory BAR, as
 * NVIDIA's nv_pci_probe counts them: BAR1 on a discrete GPU), so an
 * administrator can set limits before anything is pinned; another device
 * that holds a pin's pages (the simulator's bar_device) gets its region at
 * the first pin on it.  Pages at no device's BAR (a coherent GPU's memory
 * on bare metal, the simulator's host pages) or flagged CPU-cacheable take
 * no BAR1 and are charged to no region (a coherent GPU in a VM with a
 * driver before 580.65.06 is the exception: budgets.md).
 *
 * What is not charged (Documentation/budgets.md): dma-buf pins (NVIDIA's
 * exporter maps BAR1 for them too, but its bus addresses say nothing of
 * which GPU's); the probe's 64 KiB for its moment; a pin's BAR1 while
 * get_pages holds it before the charge is tried, where no probe could
 * answer (no persistent pins: MIG before 570, vGPU; dmem_probe=N);
 * overlapping pins are charged each, though NVIDIA maps an extent once.
 *
 * Locks: gpupin_bar1_lock (a mutex) guards gpupin_bar1_list; taken in the
 * PIN ioctl (process context, no other gpupin lock held) and at load and
 * unload.  A pin's charge (budget_held, dmem_pool, dmem_region) is under
 * pin->lock: the dmem charge is stored while the pin is still PINNING,
 * where a free callback gives nothing back and the failing PIN does, so
 * that every charge is given back exactly once.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/list.h>
#include <linux/moduleparam.h>
#include <linux/mutex.h>
#include <linux/pci.h>
#include <linux/slab.h>
#include <linux/sysfs.h>
#include "compat.h"
#include "gpupin.h"

unsigned long gpupin_max_file_pinned_bytes;
module_param_named(max_file_pinned_bytes, gpupin_max_file_pinned_bytes, ulong, 0644);
MODULE_PARM_DESC(max_file_pinned_bytes, "Bytes each open file may keep pinned; beyond it PIN fails with EDQUOT (0 = unlimited)");

static bool gpupin_dmem_probe = true;
module_param_named(dmem_probe, gpupin_dmem_probe, bool, 0644);
MODULE_PARM_DESC(dmem_probe, "With dmem: learn each pin's GPU before get_pages (a 64 KiB persistent pin, given back), so that a pin past dmem.max maps no BAR1 (default Y); N charges after get_pages, one NVIDIA call pair less per PIN");

/* dmem: read-only, at load too (what the build decided is what the module does). */
static int gpupin_dmem_set(const char *val, const struct kernel_param *kp)
{
	return -EPERM;
}

static int gpupin_dmem_get(char *buf, const struct kernel_param *kp)
{
	return sysfs_emit(buf, "%c\n", GPUPIN_DMEM ? 'Y' : 'N');
}

static const struct kernel_param_ops gpupin_dmem_ops = {
	.set = gpupin_dmem_set,
	.get = gpupin_dmem_get,
};
module_param_cb(dmem, &gpupin_dmem_ops, NULL, 0444);
MODULE_PARM_DESC(dmem, "Whether pins are charged to the dmem cgroup controller (read-only: Y where the kernel has CONFIG_CGROUP_DMEM)");

/* NVIDIA keeps this much of BAR1 free of third-party mappings. */
#define GPUPIN_BAR1_RESERVE (36ULL << 20)

struct gpupin_bar1 {
	struct list_head node;
	struct pci_dev *pdev;		/* a reference */
	resource_size_t start, end;	/* the memory BAR pins land in, as last seen */
	struct dmem_cgroup_region *region;	/* NULL: a BAR within NVIDIA's reserve */
};

static LIST_HEAD(gpupin_bar1_list);
static DEFINE_MUTEX(gpupin_bar1_lock);	/* guards gpupin_bar1_list */

/* Register @pdev's BAR @bar as a region; under gpupin_bar1_lock.  NULL on failure. */
static struct gpupin_bar1 *gpupin_bar1_add(struct pci_dev *pdev, int bar)
{
	resource_size_t len = pci_resource_len(pdev, bar);
	struct gpupin_bar1 *b;
	struct dmem_cgroup_region *region;

	lockdep_assert_held(&gpupin_bar1_lock);
	if (len > GPUPIN_BAR1_RESERVE) {
		region = dmem_cgroup_register_region(len - GPUPIN_BAR1_RESERVE, "gpupin/%s/bar1",
						     pci_name(pdev));
		if (IS_ERR_OR_NULL(region)) {
			pr_warn_ratelimited("no dmem region for %s: %d\n", pci_name(pdev),
					    (int)PTR_ERR_OR_ZERO(region));
			return NULL;
		}
	} else {
		/* Kept, so that its pins are not looked for again: charged nowhere. */
		pr_info("%s: BAR%d of %llu bytes leaves nothing past NVIDIA's 36 MiB reserve: no dmem region\n",
			pci_name(pdev), bar, (u64)len);
		region = NULL;
	}
	b = gpupin_kzalloc(sizeof(*b), GFP_KERNEL);
	if (!b) {
		dmem_cgroup_unregister_region(region);
		return NULL;
	}
	b->pdev = pci_dev_get(pdev);
	b->start = pci_resource_start(pdev, bar);
	b->end = pci_resource_end(pdev, bar);
	b->region = region;
	list_add_tail(&b->node, &gpupin_bar1_list);
	return b;
}

/* A memory BAR the kernel placed (an unassigned one keeps its size from 0). */
static bool gpupin_bar_placed(struct pci_dev *pdev, int i)
{
	unsigned long flags = pci_resource_flags(pdev, i);

	return (flags & IORESOURCE_MEM) && !(flags & IORESOURCE_UNSET) && pci_resource_len(pdev, i);
}

/* The memory BAR of @pdev that holds @addr, or -1. */
static int gpupin_bar_holding(struct pci_dev *pdev, u64 addr)
{
	int i;

	for (i = 0; i < PCI_STD_NUM_BARS; i++) {
		if (gpupin_bar_placed(pdev, i) && addr >= pci_resource_start(pdev, i) &&
		    addr <= pci_resource_end(pdev, i))
			return i;
	}
	return -1;
}

/*
 * A GPU's frame-buffer BAR, as NVIDIA's nv_pci_probe (nv-pci.c) finds it:
 * the second memory BAR (BAR1 on a discrete GPU; BAR2 where BAR0 is
 * 64-bit, as in some virtual machines); -1 if none.
 */
static int gpupin_fb_bar(struct pci_dev *pdev)
{
	int i, seen = 0;

	for (i = 0; i < PCI_STD_NUM_BARS; i++) {
		if (gpupin_bar_placed(pdev, i) && ++seen == 2)
			return i;
	}
	return -1;
}

/* @pdev's entry, or NULL; under gpupin_bar1_lock. */
static struct gpupin_bar1 *gpupin_bar1_of(struct pci_dev *pdev)
{
	struct gpupin_bar1 *b;

	lockdep_assert_held(&gpupin_bar1_lock);
	list_for_each_entry(b, &gpupin_bar1_list, node) {
		if (b->pdev == pdev)
			return b;
	}
	return NULL;
}

/*
 * The region of the BAR holding @addr, registered on first sight; NULL where
 * no device's BAR holds it, ERR_PTR(-ENOMEM) where one does but its region
 * could not be made (the pin fails rather than go uncharged).
 */
static struct dmem_cgroup_region *gpupin_bar1_region(u64 addr)
{
	struct dmem_cgroup_region *region = NULL;
	struct pci_dev *pdev = NULL;
	struct gpupin_bar1 *b;
	int bar;

	mutex_lock(&gpupin_bar1_lock);
	list_for_each_entry(b, &gpupin_bar1_list, node) {
		if (addr >= b->start && addr <= b->end &&
		    gpupin_bar_holding(b->pdev, addr) >= 0) {
			region = b->region;
			goto out;
		}
	}
	for_each_pci_dev(pdev) {
		bar = gpupin_bar_holding(pdev, addr);
		if (bar < 0)
			continue;
		/* A device met before whose BAR moved (a resize): its one region. */
		b = gpupin_bar1_of(pdev);
		if (b) {
			b->start = pci_resource_start(pdev, bar);
			b->end = pci_resource_end(pdev, bar);
		} else {
			b = gpupin_bar1_add(pdev, bar);
		}
		region = b ? b->region : ERR_PTR(-ENOMEM);
		pci_dev_put(pdev);	/* the loop's reference; b holds its own */
		break;
	}
out:
	mutex_unlock(&gpupin_bar1_lock);
	return region;
}

/*
 * The global and per-file budgets for a new pin, before its memory is
 * taken: ENOSPC past max_pinned_bytes, EDQUOT past max_file_pinned_bytes.
 */
int gpupin_budget_reserve(struct gpupin_file *f, struct gpupin_pin_obj *pin)
{
	unsigned long max = READ_ONCE(gpupin_max_pinned_bytes);
	unsigned long fmax = READ_ONCE(gpupin_max_file_pinned_bytes);
	u64 size = pin->aligned_size;
	s64 now = atomic64_add_return(size, &gpupin_pinned_bytes);

	if (max && now > max) {
		atomic64_sub(size, &gpupin_pinned_bytes);
		return -ENOSPC;
	}
	now = atomic64_add_return(size, &f->pinned_bytes);
	if (fmax && now > fmax) {
		atomic64_sub(size, &f->pinned_bytes);
		atomic64_sub(size, &gpupin_pinned_bytes);
		return -EDQUOT;
	}
	pin->budget_held = true;	/* nobody else knows the pin yet */
	return 0;
}

/* Charge @pin's bytes to @region for the calling task's cgroup; EDQUOT past a dmem.max. */
static int gpupin_dmem_charge(struct gpupin_pin_obj *pin, struct dmem_cgroup_region *region,
			      struct dmem_cgroup_pool_state **pool)
{
	struct dmem_cgroup_pool_state *limit = NULL;
	int ret = dmem_cgroup_try_charge(region, pin->aligned_size, pool, &limit);

	dmem_cgroup_pool_state_put(limit);
	return ret == -EAGAIN ? -EDQUOT : ret;
}

/*
 * Before the backend takes a new pin's memory, in its PIN ioctl: charge the
 * BAR1 bytes to the caller's dmem cgroup at the GPU the backend's probe
 * names; EDQUOT past a dmem.max, with no BAR1 taken.  Nothing is charged
 * where the probe cannot tell (gpupin_budget_charge_gpu does, after).  The
 * pin is known to nobody else yet; a failing PIN gives the charge back.
 */
int gpupin_budget_precharge(struct gpupin_pin_obj *pin)
{
	struct dmem_cgroup_pool_state *pool;
	struct dmem_cgroup_region *region;
	u64 addr;
	int ret;

	if (!GPUPIN_DMEM || !pin->ops->probe_bar1 ||
	    !READ_ONCE(gpupin_dmem_probe))
		return 0;
	addr = pin->ops->probe_bar1(pin);
	if (!addr)
		return 0;
	region = gpupin_bar1_region(addr);
	if (IS_ERR_OR_NULL(region))
		return PTR_ERR_OR_ZERO(region);
	ret = gpupin_dmem_charge(pin, region, &pool);
	if (ret)
		return ret;
	spin_lock(&pin->lock);
	pin->dmem_pool = pool;
	pin->dmem_region = region;
	spin_unlock(&pin->lock);
	return 0;
}

/*
 * Once the backend took a new pin's memory, in its PIN ioctl, before the
 * pin is PINNED: charge its BAR1 bytes where gpupin_budget_precharge could
 * not, or move the charge where the memory turned out to be on another GPU
 * than the probe said (freed and allocated again in between); EDQUOT past
 * a dmem.max.  A charge is stored only while the pin is still PINNING (a
 * free callback then gives nothing back: the failing PIN does); where the
 * memory went meanwhile a new one is undone here (ENXIO).
 */
int gpupin_budget_charge_gpu(struct gpupin_pin_obj *pin)
{
	struct dmem_cgroup_pool_state *pool = NULL, *old = NULL;
	struct dmem_cgroup_region *region = NULL;
	bool kept = false, pinning;
	u64 addr = 0;
	int ret;

	if (!GPUPIN_DMEM || !pin->ops->bar1_addr)
		return 0;
	spin_lock(&pin->lock);
	pinning = pin->state == GPUPIN_PIN_PINNING;
	if (pinning)
		addr = pin->ops->bar1_addr(pin);
	spin_unlock(&pin->lock);
	if (!pinning)	/* the memory went: marking it PINNED says so */
		return 0;
	/*
	 * No BAR1 (coherent or CPU-cacheable pages): a charge the probe made
	 * goes (the memory was allocated again elsewhere since, or NVIDIA's
	 * object for it differs from the probe's) below, as for another GPU.
	 */
	if (addr) {
		region = gpupin_bar1_region(addr);
		if (IS_ERR(region))
			return PTR_ERR(region);
	}
	spin_lock(&pin->lock);
	if (pin->dmem_region == region) {
		spin_unlock(&pin->lock);
		return 0;	/* charged before where it belongs, or nowhere as it should be */
	}
	old = pin->dmem_pool;
	pin->dmem_pool = NULL;
	pin->dmem_region = NULL;
	spin_unlock(&pin->lock);
	if (old)
		dmem_cgroup_uncharge(old, pin->aligned_size);
	if (!region)
		return 0;
	ret = gpupin_dmem_charge(pin, region, &pool);
	if (ret)
		return ret;
	spin_lock(&pin->lock);
	if (pin->state == GPUPIN_PIN_PINNING) {
		pin->dmem_pool = pool;
		pin->dmem_region = region;
		kept = true;
	}
	spin_unlock(&pin->lock);
	if (!kept) {
		dmem_cgroup_uncharge(pool, pin->aligned_size);
		return -ENXIO;
	}
	return 0;
}

/*
 * Give back everything @pin holds of every budget; the second and later
 * calls find nothing.  Process context, pin->lock not held.  The file is
 * alive: an open file holds it, and so does a detached pin.
 */
void gpupin_budget_release(struct gpupin_pin_obj *pin)
{
	struct dmem_cgroup_pool_state *pool;
	bool held;

	spin_lock(&pin->lock);
	held = pin->budget_held;
	pin->budget_held = false;
	pool = pin->dmem_pool;
	pin->dmem_pool = NULL;
	pin->dmem_region = NULL;
	spin_unlock(&pin->lock);
	if (held) {
		atomic64_sub(pin->aligned_size, &pin->file->pinned_bytes);
		atomic64_sub(pin->aligned_size, &gpupin_pinned_bytes);
	}
	if (pool)
		dmem_cgroup_uncharge(pool, pin->aligned_size);
}

/* Regions for NVIDIA's GPUs (BAR1), before anything is pinned. */
void gpupin_budget_init(void)
{
	struct pci_dev *pdev = NULL;

	if (!GPUPIN_DMEM)
		return;
	mutex_lock(&gpupin_bar1_lock);
	for_each_pci_dev(pdev) {
		int bar;

		if (pdev->vendor != PCI_VENDOR_ID_NVIDIA ||
		    (pdev->class >> 16) != PCI_BASE_CLASS_DISPLAY)
			continue;
		bar = gpupin_fb_bar(pdev);
		if (bar >= 0)
			gpupin_bar1_add(pdev, bar);
	}
	mutex_unlock(&gpupin_bar1_lock);
}

/* At unload: no pin is left, so nothing is charged to a region. */
void gpupin_budget_exit(void)
{
	struct gpupin_bar1 *b, *n;

	mutex_lock(&gpupin_bar1_lock);
	list_for_each_entry_safe(b, n, &gpupin_bar1_list, node) {
		list_del(&b->node);
		dmem_cgroup_unregister_region(b->region);
		pci_dev_put(b->pdev);
		kfree(b);
	}
	mutex_unlock(&gpupin_bar1_lock);
}
