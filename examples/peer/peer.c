// SPDX-License-Identifier: (GPL-2.0 OR MIT)
/*
 * gpupin_peer: an example third-party driver built on gpupin's kernel API
 * (include/gpupin/gpupin.h).  /dev/gpupin_peer behaves like a DMA engine of
 * a PCI device (module parameter pci, e.g. a NIC): it maps the user's pin
 * for that device and copies between the pinned pages and a user buffer,
 * one GPU page at a time.  The mapping is made and its bus addresses are
 * checked, but the "engine" is the CPU, which needs no bus address: it
 * copies through the pages' physical addresses from the page table, as
 * gdrcopy does.  Where such an address is RAM (the simulator's host pages,
 * a coherent GPU's memory) through the kernel's mapping of the page; where
 * it is not (a GPU's BAR1, the simulator's bar_device) through a
 * write-combined ioremap of that GPU page inside a prefetchable PCI memory
 * BAR, undone before the access section ends.  With an IOMMU the bus
 * addresses differ from the physical ones; the copy does not care.  A
 * dma-buf pin (GPUPIN_REF_DMABUF) has only bus addresses: the CPU uses the
 * peer's own, and only where they are physical (no IOMMU translation, DMA
 * offset or bounce buffering) and RAM.  A dma-buf's MMIO pages are refused
 * (-EOPNOTSUPP): a peer-to-peer bus address through a PCI switch need not
 * be the CPU's physical address of the BAR, so the CPU does not map it.
 *
 * Loaded only by tests and the demo.  Holds (GPUPIN_PEER_IOC_HOLD) stand for
 * registered memory regions that a driver keeps between transfers.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/atomic.h>
#include <linux/delay.h>
#include <linux/err.h>
#include <linux/fs.h>
#include <linux/highmem.h>
#include <linux/io.h>
#include <linux/iommu.h>
#include <linux/ioport.h>
#include <linux/log2.h>
#include <linux/mm.h>
#include <linux/miscdevice.h>
#include <linux/module.h>
#include <linux/moduleparam.h>
#include <linux/mutex.h>
#include <linux/pci.h>
#include <linux/sched/signal.h>
#include <linux/slab.h>
#include <linux/swiotlb.h>
#include <linux/uaccess.h>
#include <linux/workqueue.h>
#include <linux/xarray.h>
#include <gpupin/gpupin.h>
#include "../../include/uapi/gpupin_peer.h"

#define PEER_MAX_HOLDS 1024

static char *peer_pci;
module_param_named(pci, peer_pci, charp, 0444);
MODULE_PARM_DESC(pci, "PCI device (DDDD:BB:DD.F) whose DMA mappings are used (default: the first one)");

static unsigned int peer_chunk_delay_us;
module_param_named(chunk_delay_us, peer_chunk_delay_us, uint, 0644);
MODULE_PARM_DESC(chunk_delay_us, "Pause after each GPU page of a transfer, to let tests race it (default 0)");

static struct pci_dev *peer_pdev;	/* set at load, reference held */

struct peer_file {
	struct mutex lock;		/* holds and the counters below */
	struct xarray holds;		/* hold id -> peer_hold */
	u32 next_id;
	atomic_t notified;		/* holds whose memory went away */
	u64 transfers;
	u64 aborted;
	u64 ram_pages;
	u64 bar_pages;
};

struct peer_hold {
	struct gpupin_ref *ref;
	struct peer_file *pf;
	bool notified;
};

/*
 * A transfer in progress: the notifier stops it at the next page.  The
 * counts are of GPU pages (or parts of one) copied through RAM and through
 * BAR mappings.
 */
struct peer_xfer_state {
	bool stop;
	u64 ram_pages;
	u64 bar_pages;
};

static void peer_xfer_notify(void *priv)
{
	struct peer_xfer_state *st = priv;

	WRITE_ONCE(st->stop, true);
}

static void peer_hold_notify(void *priv)
{
	struct peer_hold *h = priv;

	/* A real driver would quiesce its DMA queue for this region here. */
	WRITE_ONCE(h->notified, true);
	atomic_inc(&h->pf->notified);
}

/*
 * Whether the peer's bus addresses are CPU physical addresses: no IOMMU
 * translates them, no DMA range map offsets them, and no bounce buffer
 * stands in for the memory.
 */
static bool peer_bus_is_phys(void)
{
	struct device *dev = &peer_pdev->dev;
	struct iommu_domain *dom = iommu_get_domain_for_dev(dev);

	if (dom && dom->type != IOMMU_DOMAIN_IDENTITY)
		return false;
	return !dev->dma_range_map && !is_swiotlb_force_bounce(dev);
}

/* Whether [@addr, @addr + @len) lies inside one memory BAR of a PCI device. */
static bool peer_in_pci_bar(u64 addr, u32 len)
{
	struct pci_dev *pdev = NULL;
	int i;

	for_each_pci_dev(pdev) {
		for (i = 0; i < PCI_STD_NUM_BARS; i++) {
			struct resource *res = &pdev->resource[i];

			/* A GPU's BAR1 is prefetchable; register BARs are not WC-safe. */
			if (resource_type(res) != IORESOURCE_MEM ||
			    !(res->flags & IORESOURCE_PREFETCH) ||
			    (res->flags & IORESOURCE_UNSET) || !res->start)
				continue;
			if (res->start <= addr && addr + len - 1 <= res->end) {
				pci_dev_put(pdev);
				return true;
			}
		}
	}
	return false;
}

/* Copy through the kernel's mapping of RAM, one CPU page at a time. */
static int peer_copy_ram(u64 phys, void *bounce, u32 n, bool to_gpu)
{
	u32 done = 0;

	while (done < n) {
		u64 pos = phys + done;
		u32 in_page = offset_in_page(pos);
		u32 len = min_t(u32, n - done, PAGE_SIZE - in_page);
		void *va;

		if (!pfn_valid(PHYS_PFN(pos)))
			return -EOPNOTSUPP;
		va = kmap_local_page(pfn_to_page(PHYS_PFN(pos)));
		if (to_gpu)
			memcpy(va + in_page, bounce + done, len);
		else
			memcpy(bounce + done, va + in_page, len);
		kunmap_local(va);
		done += len;
	}
	return 0;
}

/*
 * Copy through a write-combined mapping of one GPU page's BAR addresses, as
 * gdrcopy maps BAR1 for user space.  The mapping lives only for this page.
 */
static int peer_copy_bar(u64 page, u32 page_size, u32 off, void *bounce, u32 n, bool to_gpu)
{
	void __iomem *io = ioremap_wc(page, page_size);

	if (!io)
		return -ENOMEM;
	if (to_gpu) {
		memcpy_toio(io + off, bounce, n);
		/*
		 * Drain the write-combining buffers, then read back from the same
		 * BAR: a read cannot pass the posted writes before it, so they have
		 * reached the device before the access section ends (and the free
		 * callback may unmap BAR1).
		 */
		wmb();
		(void)ioread8(io + off + n - 1);
	} else {
		memcpy_fromio(bounce, io + off, n);
	}
	iounmap(io);
	return 0;
}

/*
 * Copy @n bytes between @bounce and the GPU page @idx of @ref, starting
 * @off bytes into it, through the CPU's view of the page.  The peer's DMA
 * mapping must exist: a real engine would be given gpupin_ref_dma_addr().
 * Inside an access section.
 */
static int peer_copy_page(struct gpupin_ref *ref, const struct gpupin_ref_info *info, u32 idx,
			  u32 off, void *bounce, u32 n, struct peer_xfer_state *st, bool to_gpu)
{
	bool dmabuf = info->flags & GPUPIN_REF_DMABUF;
	dma_addr_t bus = gpupin_ref_dma_addr(ref, idx);
	u64 page = gpupin_ref_page_phys(ref, idx);
	int ret;

	if (!bus) {
		pr_warn_ratelimited("page %u: no bus address for the peer device\n", idx);
		return -EIO;
	}
	if (dmabuf) {
		/*
		 * A dma-buf pin has no CPU addresses, only bus addresses: the CPU
		 * "engine" may use the peer's own mapping, and only where those
		 * are physical.  The addresses of the device the user imported
		 * the buffer for are never used: its IOMMU is not the peer's.
		 */
		if (!peer_bus_is_phys()) {
			pr_warn_ratelimited("page %u: dma-buf bus address is not physical\n", idx);
			return -EOPNOTSUPP;
		}
		page = bus;
	} else if (!page) {
		return -EIO;
	}
	switch (region_intersects(page + off, n, IORESOURCE_SYSTEM_RAM, IORES_DESC_NONE)) {
	case REGION_INTERSECTS:
		/* Host pages (the simulator) or coherent GPU memory (GH200). */
		ret = peer_copy_ram(page + off, bounce, n, to_gpu);
		if (!ret)
			st->ram_pages++;
		break;
	case REGION_DISJOINT:
		/* A GPU's BAR1 (or the simulator's bar_device): MMIO, no struct page. */
		if (dmabuf) {
			pr_warn_ratelimited("page %u: a dma-buf's MMIO page: this peer copies only RAM pages of a dma-buf\n",
					    idx);
			return -EOPNOTSUPP;
		}
		if (!peer_in_pci_bar(page, info->page_size)) {
			ret = -EOPNOTSUPP;
			break;
		}
		ret = peer_copy_bar(page, info->page_size, off, bounce, n, to_gpu);
		if (!ret)
			st->bar_pages++;
		break;
	default:
		ret = -EOPNOTSUPP;
	}
	if (ret == -EOPNOTSUPP)
		pr_warn_ratelimited("page %u: neither RAM nor inside a PCI memory BAR\n", idx);
	return ret;
}

static int peer_transfer(struct gpupin_ref *ref, struct peer_xfer_state *st,
			 struct gpupin_peer_xfer *arg)
{
	struct gpupin_ref_info info;
	bool to_gpu = arg->flags & GPUPIN_PEER_TO_GPU;
	void __user *ubuf = u64_to_user_ptr(arg->buf);
	void *bounce;
	u64 pos;
	int ret;

	ret = gpupin_ref_info(ref, &info);
	if (ret)
		return ret;
	if (arg->offset > info.size || arg->length > info.size - arg->offset)
		return -EINVAL;
	ret = gpupin_ref_dma_map(ref, peer_pdev);
	if (ret)
		return ret;
	bounce = kmalloc(info.page_size, GFP_KERNEL);
	if (!bounce)
		return -ENOMEM;
	pos = info.va - info.aligned_va + arg->offset;
	while (arg->done < arg->length) {
		u32 off = pos & (info.page_size - 1);
		u32 n = min_t(u64, arg->length - arg->done, info.page_size - off);
		u32 idx = pos >> ilog2(info.page_size);

		if (fatal_signal_pending(current)) {
			ret = -EINTR;
			break;
		}
		/* Never fault on user memory inside an access section. */
		if (to_gpu && copy_from_user(bounce, ubuf + arg->done, n)) {
			ret = -EFAULT;
			break;
		}
		if (READ_ONCE(st->stop) || gpupin_access_begin(ref)) {
			ret = arg->done ? -EIO : -ENODEV;
			break;
		}
		ret = peer_copy_page(ref, &info, idx, off, bounce, n, st, to_gpu);
		gpupin_access_end(ref);
		if (ret)
			break;
		if (!to_gpu && copy_to_user(ubuf + arg->done, bounce, n)) {
			ret = -EFAULT;
			break;
		}
		arg->done += n;
		pos += n;
		if (READ_ONCE(peer_chunk_delay_us))
			fsleep(READ_ONCE(peer_chunk_delay_us));
	}
	kfree(bounce);
	return ret;
}

static long peer_ioctl_xfer(struct peer_file *pf, struct gpupin_peer_xfer __user *uarg)
{
	struct peer_xfer_state st = { };
	struct gpupin_peer_xfer arg;
	struct gpupin_ref *ref;
	long ret;

	if (copy_from_user(&arg, uarg, sizeof(arg)))
		return -EFAULT;
	if ((arg.flags & ~GPUPIN_PEER_XFER_FLAGS_ALL) || arg.done ||
	    arg.reserved[0] || arg.reserved[1] || !arg.length)
		return -EINVAL;
	ref = gpupin_ref_get(arg.gpupin_fd, arg.handle, peer_xfer_notify, &st);
	if (IS_ERR(ref))
		return PTR_ERR(ref);
	ret = peer_transfer(ref, &st, &arg);
	gpupin_ref_put(ref);
	mutex_lock(&pf->lock);
	pf->ram_pages += st.ram_pages;
	pf->bar_pages += st.bar_pages;
	if (!ret)
		pf->transfers++;
	else if (ret == -EIO || ret == -ENODEV)
		pf->aborted++;
	mutex_unlock(&pf->lock);
	if (copy_to_user(&uarg->done, &arg.done, sizeof(arg.done)))
		return -EFAULT;
	return ret;
}

struct peer_map_work {
	struct work_struct work;
	struct gpupin_ref *ref;
	int ret;
};

static void peer_map_fn(struct work_struct *work)
{
	struct peer_map_work *w = container_of(work, struct peer_map_work, work);

	w->ret = gpupin_ref_dma_map(w->ref, peer_pdev);
}

/* Map @ref for the peer; with @race, from a work item and from here at the same time. */
static int peer_map(struct gpupin_ref *ref, bool race)
{
	struct peer_map_work w = { .ref = ref };
	int ret;

	if (!race)
		return gpupin_ref_dma_map(ref, peer_pdev);
	INIT_WORK_ONSTACK(&w.work, peer_map_fn);
	schedule_work(&w.work);
	ret = gpupin_ref_dma_map(ref, peer_pdev);
	flush_work(&w.work);
	destroy_work_on_stack(&w.work);
	return ret ? ret : w.ret;
}

static void peer_hold_free(struct peer_hold *h);

static long peer_ioctl_hold(struct peer_file *pf, struct gpupin_peer_hold __user *uarg)
{
	struct gpupin_peer_hold arg;
	struct peer_hold *h;
	u32 id;
	int ret;

	if (copy_from_user(&arg, uarg, sizeof(arg)))
		return -EFAULT;
	if ((arg.flags & ~GPUPIN_PEER_HOLD_FLAGS_ALL) || arg.hold_id || arg.pad ||
	    arg.reserved[0] || arg.reserved[1])
		return -EINVAL;
	h = kzalloc(sizeof(*h), GFP_KERNEL);
	if (!h)
		return -ENOMEM;
	h->pf = pf;
	h->ref = gpupin_ref_get(arg.gpupin_fd, arg.handle, peer_hold_notify, h);
	if (IS_ERR(h->ref)) {
		ret = PTR_ERR(h->ref);
		goto err_free;
	}
	ret = peer_map(h->ref, arg.flags & GPUPIN_PEER_HOLD_MAP_RACE);
	if (ret)
		goto err_put;
	mutex_lock(&pf->lock);
	ret = xa_alloc(&pf->holds, &id, h, XA_LIMIT(1, PEER_MAX_HOLDS), GFP_KERNEL);
	mutex_unlock(&pf->lock);
	if (ret)
		goto err_put;
	arg.hold_id = id;
	if (copy_to_user(uarg, &arg, sizeof(arg))) {
		struct peer_hold *gone;

		/* A hold the caller cannot name: undo it (unless released already). */
		mutex_lock(&pf->lock);
		gone = xa_erase(&pf->holds, id);
		mutex_unlock(&pf->lock);
		if (gone == h)
			peer_hold_free(h);
		return -EFAULT;
	}
	return 0;

err_put:
	gpupin_ref_put(h->ref);
err_free:
	kfree(h);
	return ret;
}

static void peer_hold_free(struct peer_hold *h)
{
	/* After the put the notifier cannot run any more: read its mark then. */
	gpupin_ref_put(h->ref);
	if (READ_ONCE(h->notified))
		atomic_dec(&h->pf->notified);
	kfree(h);
}

struct peer_release_work {
	struct work_struct work;
	struct peer_hold *h;
};

static void peer_release_fn(struct work_struct *work)
{
	peer_hold_free(container_of(work, struct peer_release_work, work)->h);
}

static long peer_ioctl_release(struct peer_file *pf, struct gpupin_peer_release __user *uarg)
{
	struct gpupin_peer_release arg;
	struct peer_hold *h;

	if (copy_from_user(&arg, uarg, sizeof(arg)))
		return -EFAULT;
	if (arg.flags & ~GPUPIN_PEER_RELEASE_ASYNC)
		return -EINVAL;
	mutex_lock(&pf->lock);
	h = xa_erase(&pf->holds, arg.hold_id);
	mutex_unlock(&pf->lock);
	if (!h)
		return -ENOENT;
	if (arg.flags & GPUPIN_PEER_RELEASE_ASYNC) {
		/* As a driver's deferred teardown: the last fput happens in a kworker. */
		struct peer_release_work w = { .h = h };

		INIT_WORK_ONSTACK(&w.work, peer_release_fn);
		schedule_work(&w.work);
		flush_work(&w.work);
		destroy_work_on_stack(&w.work);
		return 0;
	}
	peer_hold_free(h);
	return 0;
}

static long peer_ioctl_status(struct peer_file *pf, struct gpupin_peer_status __user *uarg)
{
	struct gpupin_peer_status st = { };
	struct peer_hold *h;
	unsigned long id;

	mutex_lock(&pf->lock);
	xa_for_each(&pf->holds, id, h)
		st.holds++;
	st.transfers = pf->transfers;
	st.aborted = pf->aborted;
	st.ram_pages = pf->ram_pages;
	st.bar_pages = pf->bar_pages;
	mutex_unlock(&pf->lock);
	st.notified = atomic_read(&pf->notified);
	return copy_to_user(uarg, &st, sizeof(st)) ? -EFAULT : 0;
}

static long peer_ioctl(struct file *file, unsigned int cmd, unsigned long arg)
{
	struct peer_file *pf = file->private_data;
	void __user *uarg = (void __user *)arg;

	switch (cmd) {
	case GPUPIN_PEER_IOC_XFER:
		return peer_ioctl_xfer(pf, uarg);
	case GPUPIN_PEER_IOC_HOLD:
		return peer_ioctl_hold(pf, uarg);
	case GPUPIN_PEER_IOC_RELEASE:
		return peer_ioctl_release(pf, uarg);
	case GPUPIN_PEER_IOC_STATUS:
		return peer_ioctl_status(pf, uarg);
	default:
		return -ENOTTY;
	}
}

static int peer_open(struct inode *inode, struct file *file)
{
	struct peer_file *pf = kzalloc(sizeof(*pf), GFP_KERNEL);

	if (!pf)
		return -ENOMEM;
	mutex_init(&pf->lock);
	xa_init_flags(&pf->holds, XA_FLAGS_ALLOC1);
	atomic_set(&pf->notified, 0);
	file->private_data = pf;
	return 0;
}

static int peer_release(struct inode *inode, struct file *file)
{
	struct peer_file *pf = file->private_data;
	struct peer_hold *h;
	unsigned long id;

	xa_for_each(&pf->holds, id, h) {
		xa_erase(&pf->holds, id);
		peer_hold_free(h);
	}
	xa_destroy(&pf->holds);
	kfree(pf);
	return 0;
}

static const struct file_operations peer_fops = {
	.owner = THIS_MODULE,
	.open = peer_open,
	.release = peer_release,
	.unlocked_ioctl = peer_ioctl,
	.compat_ioctl = compat_ptr_ioctl,
	.llseek = noop_llseek,
};

static struct miscdevice peer_miscdev = {
	.minor = MISC_DYNAMIC_MINOR,
	.name = "gpupin_peer",
	.fops = &peer_fops,
	.mode = 0660,
};

static struct pci_dev *peer_find_pdev(void)
{
	unsigned int domain, bus, dev, fn;

	if (!peer_pci || !*peer_pci)
		return pci_get_device(PCI_ANY_ID, PCI_ANY_ID, NULL);
	if (sscanf(peer_pci, "%x:%x:%x.%x", &domain, &bus, &dev, &fn) != 4 ||
	    domain > 0xffff || bus > 0xff || dev > 0x1f || fn > 7)
		return NULL;
	return pci_get_domain_bus_and_slot(domain, bus, PCI_DEVFN(dev, fn));
}

static int __init peer_init(void)
{
	int ret;

	peer_pdev = peer_find_pdev();
	if (!peer_pdev) {
		pr_err("no PCI device %s\n", peer_pci ? peer_pci : "at all");
		return -ENODEV;
	}
	ret = misc_register(&peer_miscdev);
	if (ret) {
		pci_dev_put(peer_pdev);
		return ret;
	}
	pr_info("DMA engine of %s ready\n", pci_name(peer_pdev));
	return 0;
}

static void __exit peer_exit(void)
{
	misc_deregister(&peer_miscdev);
	pci_dev_put(peer_pdev);
}

module_init(peer_init);
module_exit(peer_exit);

MODULE_LICENSE("Dual MIT/GPL");
MODULE_DESCRIPTION("Example peer driver: DMA through GPU memory pinned by gpupin");
MODULE_AUTHOR("gpupin developers");
