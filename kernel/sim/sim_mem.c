// SPDX-License-Identifier: (GPL-2.0 OR MIT)
/*
 * nvp2p_sim: simulated GPU memory and /dev/nvp2p_sim.
 *
 * Each open file is a simulated CUDA context owned by the opening thread
 * group, with a private 64 GiB address range.  Allocations are 64 KiB
 * aligned, placed first-fit so a freed address is handed out again (as
 * cuMemAlloc does), and get a new buffer id every time.  Freeing an
 * allocation, or closing the file, runs the free callbacks of every pin on
 * it before the call returns.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/fs.h>
#include <linux/gfp.h>
#include <linux/idr.h>
#include <linux/miscdevice.h>
#include <linux/mm.h>
#include <linux/moduleparam.h>
#include <linux/sched.h>
#include <linux/slab.h>
#include <linux/uaccess.h>
#include <linux/vmalloc.h>
#include "sim.h"

#define SIM_VA_BASE BIT_ULL(44)
#define SIM_MAX_CTX 4096

static LIST_HEAD(sim_ctxs);		/* under sim_lock */
static DEFINE_IDA(sim_ctx_ida);
static atomic64_t sim_next_buffer_id = ATOMIC64_INIT(0);

static unsigned long sim_mem_limit = 1UL << 30;
module_param_named(mem_limit, sim_mem_limit, ulong, 0644);
MODULE_PARM_DESC(mem_limit, "Simulated device memory that all contexts together may allocate, in bytes (default 1 GiB)");

static void sim_alloc_release(struct kref *ref)
{
	struct sim_alloc *alloc = container_of(ref, struct sim_alloc, ref);
	unsigned long i;

	spin_lock(&sim_lock);
	sim_stats.allocations--;
	sim_stats.alloc_bytes -= alloc->size;
	spin_unlock(&sim_lock);
	if (alloc->chunks && alloc->nchunks && alloc->chunks[alloc->nchunks - 1]) {
		/* A complete allocation: poisoned and quarantined. */
		sim_poison_free_chunks(alloc->chunks, alloc->nchunks);
	} else {
		for (i = 0; alloc->chunks && i < alloc->nchunks; i++)
			if (alloc->chunks[i])
				__free_pages(alloc->chunks[i], SIM_CHUNK_ORDER);
		kvfree(alloc->chunks);
	}
	kfree(alloc);
}

void sim_alloc_put(struct sim_alloc *alloc)
{
	kref_put(&alloc->ref, sim_alloc_release);
}

/*
 * Find the allocation of the calling thread group that holds [va, va + len).
 * Caller holds sim_lock.  *err says why there is none: -EINVAL for an
 * address that is not device memory of this process, or a range that runs
 * past the end of its allocation.
 */
struct sim_alloc *sim_find_alloc_locked(u64 va, u64 len, int *err)
{
	struct pid *me = task_tgid(current);
	struct sim_alloc *alloc;
	struct sim_ctx *ctx;

	lockdep_assert_held(&sim_lock);
	*err = -EINVAL;
	list_for_each_entry(ctx, &sim_ctxs, node) {
		if (ctx->owner != me || va < ctx->va_base || va >= ctx->va_limit)
			continue;
		list_for_each_entry(alloc, &ctx->allocs, node) {
			if (va < alloc->va || va >= alloc->va + alloc->size)
				continue;
			if (len > alloc->va + alloc->size - va)
				return NULL;
			*err = 0;
			return alloc;
		}
	}
	return NULL;
}

/* Allocation of @ctx containing @va; caller holds ctx->lock. */
struct sim_alloc *sim_ctx_find(struct sim_ctx *ctx, u64 va)
{
	struct sim_alloc *alloc;

	list_for_each_entry(alloc, &ctx->allocs, node)
		if (va >= alloc->va && va - alloc->va < alloc->size)
			return alloc;
	return NULL;
}

static int sim_ioctl_alloc(struct sim_ctx *ctx, struct nvp2p_sim_alloc __user *uarg)
{
	struct nvp2p_sim_alloc arg;
	struct sim_alloc *alloc, *pos;
	struct list_head *before;
	unsigned long i;
	u64 size, va;
	bool over;
	int ret;

	if (copy_from_user(&arg, uarg, sizeof(arg)))
		return -EFAULT;
	if (arg.flags || arg.pad || arg.va || arg.alloc_size || arg.buffer_id ||
	    arg.reserved[0] || arg.reserved[1])
		return -EINVAL;
	if (!arg.size || arg.size > BIT_ULL(SIM_CTX_SHIFT))
		return -EINVAL;
	size = round_up(arg.size, SIM_PAGE_SIZE);

	alloc = kzalloc(sizeof(*alloc), GFP_KERNEL);
	if (!alloc)
		return -ENOMEM;
	kref_init(&alloc->ref);
	INIT_LIST_HEAD(&alloc->pins);
	INIT_LIST_HEAD(&alloc->exports);
	alloc->size = size;
	/* Counted from here on; sim_alloc_release() uncounts it. */
	spin_lock(&sim_lock);
	sim_stats.allocations++;
	sim_stats.alloc_bytes += size;
	over = sim_stats.alloc_bytes > READ_ONCE(sim_mem_limit);
	spin_unlock(&sim_lock);
	if (over) {
		ret = -ENOMEM;	/* out of simulated device memory (mem_limit) */
		goto err_free;
	}
	alloc->nchunks = size >> SIM_PAGE_SHIFT;
	alloc->chunks = kvcalloc(alloc->nchunks, sizeof(*alloc->chunks), GFP_KERNEL);
	if (!alloc->chunks) {
		ret = -ENOMEM;
		goto err_free;
	}
	for (i = 0; i < alloc->nchunks; i++) {
		alloc->chunks[i] = alloc_pages(GFP_KERNEL | __GFP_ZERO | __GFP_NOWARN,
					       SIM_CHUNK_ORDER);
		if (!alloc->chunks[i]) {
			ret = -ENOMEM;
			goto err_free;
		}
		cond_resched();
	}

	mutex_lock(&ctx->lock);
	/* First fit: the lowest gap that holds the allocation. */
	va = ctx->va_base;
	before = &ctx->allocs;
	list_for_each_entry(pos, &ctx->allocs, node) {
		if (pos->va - va >= size) {
			before = &pos->node;
			break;
		}
		va = pos->va + pos->size;
	}
	if (ctx->va_limit - va < size) {
		mutex_unlock(&ctx->lock);
		ret = -ENOMEM;
		goto err_free;
	}
	alloc->va = va;
	alloc->buffer_id = atomic64_inc_return(&sim_next_buffer_id);
	spin_lock(&sim_lock);
	list_add_tail(&alloc->node, before);
	spin_unlock(&sim_lock);
	mutex_unlock(&ctx->lock);

	arg.va = alloc->va;
	arg.alloc_size = alloc->size;
	arg.buffer_id = alloc->buffer_id;
	if (copy_to_user(uarg, &arg, sizeof(arg))) {
		/* The allocation exists; user space can find it with QUERY. */
		return -EFAULT;
	}
	return 0;

err_free:
	sim_alloc_put(alloc);
	return ret;
}

/*
 * Remove @alloc from its context and run the free callbacks of its pins.
 * Called with sim_big_lock and ctx->lock held; drops the context's reference.
 */
static void sim_free_alloc(struct sim_alloc *alloc)
{
	struct sim_pin *pin, *tmp;
	LIST_HEAD(claimed);

	lockdep_assert_held(&sim_big_lock);
	spin_lock(&sim_lock);
	list_del(&alloc->node);
	list_for_each_entry_safe(pin, tmp, &alloc->pins, node) {
		if (pin->state != SIM_PIN_LIVE)
			continue;
		pin->state = SIM_PIN_CALLBACK;
		list_move_tail(&pin->node, &claimed);
	}
	spin_unlock(&sim_lock);
	sim_run_callbacks(&claimed);
	sim_revoke_exports(alloc);
	sim_alloc_put(alloc);
}

static int sim_ioctl_free(struct sim_ctx *ctx, struct nvp2p_sim_free __user *uarg)
{
	struct nvp2p_sim_free arg;
	struct sim_alloc *alloc;
	int ret = -EINVAL;

	if (copy_from_user(&arg, uarg, sizeof(arg)))
		return -EFAULT;
	if (arg.flags || arg.pad)
		return -EINVAL;

	ret = sim_api_lock("cuMemFree");
	if (ret)
		return ret;
	ret = -EINVAL;
	mutex_lock(&ctx->lock);
	alloc = sim_ctx_find(ctx, arg.va);
	if (alloc && alloc->va == arg.va) {
		sim_free_alloc(alloc);
		ret = 0;
	}
	mutex_unlock(&ctx->lock);
	sim_api_unlock();
	return ret;
}

static int sim_ioctl_query(struct sim_ctx *ctx, struct nvp2p_sim_query __user *uarg)
{
	struct nvp2p_sim_query arg;
	struct sim_alloc *alloc;

	if (copy_from_user(&arg, uarg, sizeof(arg)))
		return -EFAULT;
	if (arg.flags || arg.pad || arg.base || arg.size || arg.buffer_id ||
	    arg.reserved[0] || arg.reserved[1])
		return -EINVAL;
	mutex_lock(&ctx->lock);
	alloc = sim_ctx_find(ctx, arg.va);
	if (alloc) {
		arg.base = alloc->va;
		arg.size = alloc->size;
		arg.buffer_id = alloc->buffer_id;
	}
	mutex_unlock(&ctx->lock);
	if (!alloc)
		return -ENOENT;
	return copy_to_user(uarg, &arg, sizeof(arg)) ? -EFAULT : 0;
}

static int sim_ioctl_rw(struct sim_ctx *ctx, struct nvp2p_sim_rw __user *uarg)
{
	struct nvp2p_sim_rw arg;
	struct sim_alloc *alloc;
	char __user *ubuf;
	u64 off, done = 0;
	int ret = 0;

	if (copy_from_user(&arg, uarg, sizeof(arg)))
		return -EFAULT;
	if ((arg.flags & ~NVP2P_SIM_RW_WRITE) || arg.pad || !arg.len)
		return -EINVAL;
	ubuf = u64_to_user_ptr(arg.buf);

	mutex_lock(&ctx->lock);
	alloc = sim_ctx_find(ctx, arg.va);
	if (!alloc || arg.len > alloc->va + alloc->size - arg.va) {
		ret = -EINVAL;
		goto out;
	}
	off = arg.va - alloc->va;
	while (done < arg.len) {
		u64 pos = off + done;
		void *kaddr = page_address(alloc->chunks[pos >> SIM_PAGE_SHIFT]) +
			      (pos & (SIM_PAGE_SIZE - 1));
		u64 n = min(arg.len - done, SIM_PAGE_SIZE - (pos & (SIM_PAGE_SIZE - 1)));

		if (arg.flags & NVP2P_SIM_RW_WRITE)
			ret = copy_from_user(kaddr, ubuf + done, n) ? -EFAULT : 0;
		else
			ret = copy_to_user(ubuf + done, kaddr, n) ? -EFAULT : 0;
		if (ret)
			break;
		done += n;
		cond_resched();
	}
out:
	mutex_unlock(&ctx->lock);
	return ret;
}

static int sim_ioctl_stats(struct nvp2p_sim_stats __user *uarg)
{
	struct nvp2p_sim_stats s;

	sim_poison_check_all();
	spin_lock(&sim_lock);
	s = sim_stats;
	spin_unlock(&sim_lock);
	return copy_to_user(uarg, &s, sizeof(s)) ? -EFAULT : 0;
}

static long sim_ioctl(struct file *file, unsigned int cmd, unsigned long arg)
{
	struct sim_ctx *ctx = file->private_data;
	void __user *uarg = (void __user *)arg;

	switch (cmd) {
	case NVP2P_SIM_IOC_ALLOC:
		return sim_ioctl_alloc(ctx, uarg);
	case NVP2P_SIM_IOC_FREE:
		return sim_ioctl_free(ctx, uarg);
	case NVP2P_SIM_IOC_QUERY:
		return sim_ioctl_query(ctx, uarg);
	case NVP2P_SIM_IOC_RW:
		return sim_ioctl_rw(ctx, uarg);
	case NVP2P_SIM_IOC_EXPORT:
		return sim_ioctl_export(ctx, uarg);
	case NVP2P_SIM_IOC_STATS:
		return sim_ioctl_stats(uarg);
	case NVP2P_SIM_IOC_RESET_MISUSE:
		sim_reset_misuse();
		return 0;
	default:
		return -ENOTTY;
	}
}

static int sim_open(struct inode *inode, struct file *file)
{
	struct sim_ctx *ctx;
	int id;

	ctx = kzalloc(sizeof(*ctx), GFP_KERNEL);
	if (!ctx)
		return -ENOMEM;
	id = ida_alloc_max(&sim_ctx_ida, SIM_MAX_CTX - 1, GFP_KERNEL);
	if (id < 0) {
		kfree(ctx);
		return id == -ENOSPC ? -EMFILE : id;
	}
	ctx->va_base = SIM_VA_BASE + ((u64)id << SIM_CTX_SHIFT);
	ctx->va_limit = ctx->va_base + BIT_ULL(SIM_CTX_SHIFT);
	ctx->owner = get_pid(task_tgid(current));
	mutex_init(&ctx->lock);
	INIT_LIST_HEAD(&ctx->allocs);
	spin_lock(&sim_lock);
	list_add_tail(&ctx->node, &sim_ctxs);
	spin_unlock(&sim_lock);
	file->private_data = ctx;
	return 0;
}

/* Closing the context frees its memory, as a CUDA context teardown does. */
static int sim_release(struct inode *inode, struct file *file)
{
	struct sim_ctx *ctx = file->private_data;
	struct sim_alloc *alloc;

	/* Teardown cannot give up: wait as long as it takes (lockdep still sees it). */
	while (sim_api_lock("context teardown"))
		;
	mutex_lock(&ctx->lock);
	while (!list_empty(&ctx->allocs)) {
		alloc = list_first_entry(&ctx->allocs, struct sim_alloc, node);
		sim_free_alloc(alloc);
	}
	spin_lock(&sim_lock);
	list_del(&ctx->node);
	spin_unlock(&sim_lock);
	mutex_unlock(&ctx->lock);
	sim_api_unlock();

	ida_free(&sim_ctx_ida, (ctx->va_base - SIM_VA_BASE) >> SIM_CTX_SHIFT);
	put_pid(ctx->owner);
	kfree(ctx);
	return 0;
}

static const struct file_operations sim_fops = {
	.owner = THIS_MODULE,
	.open = sim_open,
	.release = sim_release,
	.unlocked_ioctl = sim_ioctl,
	.compat_ioctl = compat_ptr_ioctl,
	.llseek = noop_llseek,
};

static struct miscdevice sim_miscdev = {
	.minor = MISC_DYNAMIC_MINOR,
	.name = "nvp2p_sim",
	.fops = &sim_fops,
	.mode = 0600,	/* a test device: root only */
};

int sim_chardev_init(void)
{
	return misc_register(&sim_miscdev);
}

void sim_chardev_exit(void)
{
	misc_deregister(&sim_miscdev);
	ida_destroy(&sim_ctx_ida);
}
