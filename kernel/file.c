// SPDX-License-Identifier: (GPL-2.0 OR MIT)
/*
 * gpupin: /dev/gpupin file operations - open/release, ioctl dispatch, the
 * read-only validity map (mmap), and invalidation records (read/poll).
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/fs.h>
#include <linux/miscdevice.h>
#include <linux/mm.h>
#include <linux/capability.h>
#include <linux/poll.h>
#include <linux/sched.h>
#include <linux/slab.h>
#include <linux/uaccess.h>
#include <linux/vmalloc.h>
#include "compat.h"
#include "gpupin.h"
#include "../include/uapi/gpupin_netlink.h"

/* Lock order and purpose: see gpupin.h. */
DEFINE_MUTEX(gpupin_files_lock);
LIST_HEAD(gpupin_files);
static u64 gpupin_next_file_id;		/* under gpupin_files_lock */

/* Queue an invalidation record; called from the free callback. */
void gpupin_queue_event(struct gpupin_file *f, struct gpupin_event_rec *rec)
{
	spin_lock(&f->ev_lock);
	if (f->nr_events >= f->nr_slots) {
		/* Bounded: the reader is told to revalidate everything. */
		f->ev_overflow = true;
		kfree(rec);
	} else {
		list_add_tail(&rec->node, &f->events);
		f->nr_events++;
	}
	spin_unlock(&f->ev_lock);
	wake_up_interruptible(&f->ev_wait);
}

static bool gpupin_events_pending(struct gpupin_file *f)
{
	bool pending;

	spin_lock(&f->ev_lock);
	pending = !list_empty(&f->events) || f->ev_overflow;
	spin_unlock(&f->ev_lock);
	return pending;
}

/*
 * Copy the next record into @ev without taking it off the queue; false if
 * there is none.  The overflow record comes first.  Caller holds read_lock,
 * so the record is still first when gpupin_event_drop() takes it.
 */
static bool gpupin_event_peek(struct gpupin_file *f, struct gpupin_event *ev,
			      struct gpupin_event_rec **which)
{
	struct gpupin_event_rec *rec;
	bool found = true;

	spin_lock(&f->ev_lock);
	rec = list_first_entry_or_null(&f->events, struct gpupin_event_rec, node);
	*which = NULL;			/* NULL: the overflow record */
	if (f->ev_overflow) {
		memset(ev, 0, sizeof(*ev));
		ev->reason = GPUPIN_INVAL_OVERFLOW;
	} else if (rec) {
		*ev = rec->ev;
		*which = rec;
	} else {
		found = false;
	}
	spin_unlock(&f->ev_lock);
	return found;
}

/*
 * Take what gpupin_event_peek() gave (@rec, or the overflow record for
 * NULL) off the queue; an overflow that came meanwhile stays pending.
 */
static void gpupin_event_drop(struct gpupin_file *f, struct gpupin_event_rec *rec)
{
	spin_lock(&f->ev_lock);
	if (rec) {
		list_del(&rec->node);
		f->nr_events--;
	} else {
		f->ev_overflow = false;
	}
	spin_unlock(&f->ev_lock);
	kfree(rec);
}

/*
 * Records are for the process that pins (another one, such as a forked
 * child, would take them from it: -EACCES).  A record leaves the queue only
 * once it was copied out, so a fault loses nothing.
 */
static ssize_t gpupin_read(struct file *file, char __user *buf, size_t count, loff_t *ppos)
{
	struct gpupin_file *f = file->private_data;
	struct gpupin_event_rec *rec;
	struct gpupin_event ev;
	size_t done = 0;
	int ret = 0;

	if (!gpupin_caller_owns(f))
		return -EACCES;
	if (count < sizeof(ev))
		return -EINVAL;
	if (mutex_lock_interruptible(&f->read_lock))
		return -ERESTARTSYS;
	while (done + sizeof(ev) <= count) {
		if (!gpupin_event_peek(f, &ev, &rec)) {
			if (done)
				break;
			ret = -EAGAIN;
			if (file->f_flags & O_NONBLOCK)
				break;
			mutex_unlock(&f->read_lock);
			ret = wait_event_interruptible(f->ev_wait, gpupin_events_pending(f));
			if (ret)
				return ret;
			if (mutex_lock_interruptible(&f->read_lock))
				return -ERESTARTSYS;
			continue;
		}
		if (copy_to_user(buf + done, &ev, sizeof(ev))) {
			ret = -EFAULT;
			break;
		}
		gpupin_event_drop(f, rec);
		done += sizeof(ev);
	}
	mutex_unlock(&f->read_lock);
	return done ? done : ret;
}

static __poll_t gpupin_poll(struct file *file, poll_table *wait)
{
	struct gpupin_file *f = file->private_data;

	if (!gpupin_caller_owns(f))
		return EPOLLERR;
	poll_wait(file, &f->ev_wait, wait);
	return gpupin_events_pending(f) ? EPOLLIN | EPOLLRDNORM : 0;
}

/* The validity map: read-only, shared, one u64 per slot. */
static int gpupin_mmap(struct file *file, struct vm_area_struct *vma)
{
	struct gpupin_file *f = file->private_data;

	if (vma->vm_flags & (VM_WRITE | VM_EXEC))
		return -EPERM;
	if (vma->vm_pgoff || vma->vm_end - vma->vm_start > f->vmap_size)
		return -EINVAL;
	/* Not inherited across fork: the map describes the opener's pins. */
	gpupin_vm_flags_mod(vma, VM_DONTCOPY | VM_DONTEXPAND, VM_MAYWRITE | VM_MAYEXEC);
	return remap_vmalloc_range(vma, f->vmap, 0);
}

static long gpupin_ioctl(struct file *file, unsigned int cmd, unsigned long arg)
{
	struct gpupin_file *f = file->private_data;
	void __user *uarg = (void __user *)arg;

	switch (cmd) {
	case GPUPIN_IOC_INFO:
		return gpupin_ioctl_info(f, uarg);
	case GPUPIN_IOC_PIN:
		return gpupin_ioctl_pin(f, uarg);
	case GPUPIN_IOC_UNPIN:
		return gpupin_ioctl_unpin(f, uarg);
	case GPUPIN_IOC_QUERY:
		return gpupin_ioctl_query(f, uarg);
	case GPUPIN_IOC_GET_PAGES:
		return gpupin_ioctl_get_pages(f, uarg);
	case GPUPIN_IOC_DMA_MAP:
		return gpupin_ioctl_dma_map(f, uarg);
	case GPUPIN_IOC_DMA_ADDRS:
		return gpupin_ioctl_dma_addrs(f, uarg);
	case GPUPIN_IOC_DMA_UNMAP:
		return gpupin_ioctl_dma_unmap(f, uarg);
	case GPUPIN_IOC_PIN_DMABUF:
		return gpupin_ioctl_pin_dmabuf(f, uarg);
	default:
		return -ENOTTY;
	}
}

static int gpupin_open(struct inode *inode, struct file *file)
{
	struct gpupin_file *f;

	f = gpupin_kzalloc(sizeof(*f), GFP_KERNEL);
	if (!f)
		return -ENOMEM;
	f->nr_slots = clamp_t(unsigned int, READ_ONCE(gpupin_max_pins_per_file),
			      1, GPUPIN_MAX_SLOTS);
	f->vmap_size = PAGE_ALIGN(f->nr_slots * sizeof(u64));
	f->vmap = gpupin_fail_alloc() ? NULL : vmalloc_user(f->vmap_size);
	if (!f->vmap) {
		kfree(f);
		return -ENOMEM;
	}
	kref_init(&f->ref);
	mutex_init(&f->lock);
	mutex_init(&f->read_lock);
	xa_init(&f->pins);
	ida_init(&f->slots);
	spin_lock_init(&f->ev_lock);
	INIT_LIST_HEAD(&f->events);
	init_waitqueue_head(&f->ev_wait);
	f->owner = get_pid(task_tgid(current));
	/* Privilege is the opener's, not that of whoever holds the fd later. */
	f->admin = file_ns_capable(file, &init_user_ns, CAP_SYS_ADMIN);
	mutex_lock(&gpupin_files_lock);
	f->id = ++gpupin_next_file_id;
	list_add_tail(&f->node, &gpupin_files);
	mutex_unlock(&gpupin_files_lock);
	file->private_data = f;
	return 0;
}

static void gpupin_file_free(struct kref *ref)
{
	struct gpupin_file *f = container_of(ref, struct gpupin_file, ref);
	struct gpupin_event_rec *rec, *tmp;

	list_for_each_entry_safe(rec, tmp, &f->events, node)
		kfree(rec);
	xa_destroy(&f->pins);
	ida_destroy(&f->slots);
	vfree(f->vmap);
	put_pid(f->owner);
	kfree(f);
}

/* Drop a reference to @f: the open file's, or a detached pin's (pin.c). */
void gpupin_file_put(struct gpupin_file *f)
{
	kref_put(&f->ref, gpupin_file_free);
}

/*
 * Last close (or process death): every pin of the file goes.  Pins whose
 * pages cannot be put from this context are detached and keep the
 * gpupin_file until their free callback.
 */
static int gpupin_release(struct inode *inode, struct file *file)
{
	struct gpupin_file *f = file->private_data;

	mutex_lock(&gpupin_files_lock);
	list_del(&f->node);
	mutex_unlock(&gpupin_files_lock);
	gpupin_file_release_pins(f, (current->flags & PF_EXITING) ? GPUPIN_NL_REASON_PROCESS_EXIT :
								   GPUPIN_NL_REASON_CLOSE);
	gpupin_file_put(f);
	return 0;
}

static const struct file_operations gpupin_fops = {
	.owner = THIS_MODULE,
	.open = gpupin_open,
	.release = gpupin_release,
	.unlocked_ioctl = gpupin_ioctl,
	.compat_ioctl = compat_ptr_ioctl,
	.mmap = gpupin_mmap,
	.read = gpupin_read,
	.poll = gpupin_poll,
	.llseek = noop_llseek,
};

/* The gpupin state of @file, or NULL when it is not a /dev/gpupin file. */
struct gpupin_file *gpupin_file_of(struct file *file)
{
	return file->f_op == &gpupin_fops ? file->private_data : NULL;
}

static struct miscdevice gpupin_miscdev = {
	.minor = MISC_DYNAMIC_MINOR,
	.name = "gpupin",
	.fops = &gpupin_fops,
	.mode = 0660,
};

int gpupin_file_init(void)
{
	return misc_register(&gpupin_miscdev);
}

void gpupin_file_exit(void)
{
	misc_deregister(&gpupin_miscdev);
}
