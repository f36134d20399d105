// SPDX-License-Identifier: (GPL-2.0 OR MIT)
/*
 * gpupin: pin objects - every pin's life, whatever its memory, and the
 * ioctls on pins that exist (UNPIN, QUERY, GET_PAGES).
 *
 * This file owns the life: a new pin (gpupin_pin_new: alloc, reserve,
 * acquire, PINNED, publish), its invalidation, its release and teardown.
 * The memory itself comes from a backend, called through its struct
 * gpupin_pin_backend_ops (gpupin.h): nv-p2p's in nvp2p.c, dma-buf's in
 * dmabuf.c.  Each backend's file has its PIN ioctl, which checks its own
 * fields and hands over to gpupin_pin_new().
 *
 * A pin's life: PINNING (get_pages called; the callback may already fire)
 * -> PINNED (published in the handle table and the validity map) -> either
 * RELEASING (unpin or close owns the pages and puts them) or INVALIDATING ->
 * INVALIDATED (the free callback released them).  Whoever moves the pin out
 * of PINNING/PINNED owns the release of the pages; the other side only
 * waits, so unpin and the callback are safe in either order.
 *
 * NVIDIA's put_pages finds non-persistent pages in the calling process
 * only: from anywhere else it returns 0, releases nothing and leaves the
 * callback armed.  So a pin released in another context (a fork child's or
 * a kworker's last close, a peer driver's last put) goes DETACHED instead:
 * out of the handle table and the file's slots, but alive - holding its
 * file and the module - until the free callback, which the driver runs when
 * the owner frees the memory or its CUDA context goes.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/capability.h>
#include <linux/err.h>
#include <linux/mm.h>
#include <linux/module.h>
#include <linux/overflow.h>
#include <linux/sched.h>
#include <linux/slab.h>
#include <linux/uaccess.h>
#include "gpupin.h"
#include "../include/uapi/gpupin_netlink.h"

bool gpupin_caller_owns(struct gpupin_file *f)
{
	return task_tgid(current) == f->owner;
}

/*
 * May the caller read physical or bus addresses of @f's pins (GET_PAGES,
 * DMA_ADDRS)?  Only the process that opened the file, and only if it had
 * CAP_SYS_ADMIN then.  A fork child or a process given the fd over a
 * socket shares the file and the opener's privilege, not its right to
 * see where the memory is.
 */
bool gpupin_may_read_addrs(struct gpupin_file *f)
{
	return f->admin && gpupin_caller_owns(f);
}

/* Pins released and waiting for their free callback (DETACHED). */
atomic_t gpupin_nr_detached = ATOMIC_INIT(0);

static void gpupin_pin_free(struct kref *ref)
{
	struct gpupin_pin_obj *pin = container_of(ref, struct gpupin_pin_obj, ref);

	/* Every path that gives the pages back gave the budgets back first. */
	WARN_ON_ONCE(pin->budget_held || pin->dmem_pool);
	if (pin->ops->forget)
		pin->ops->forget(pin);
	kfree(pin->ev);
	kfree(pin);
}

void gpupin_pin_put(struct gpupin_pin_obj *pin)
{
	kref_put(&pin->ref, gpupin_pin_free);
}

/* Look up @handle exactly and take a reference; NULL if it is not a pin. */
struct gpupin_pin_obj *gpupin_pin_lookup(struct gpupin_file *f, u64 handle)
{
	struct gpupin_pin_obj *pin;

	if (handle > ULONG_MAX)
		return NULL;
	mutex_lock(&f->lock);
	pin = xa_load(&f->pins, handle);
	if (pin)
		kref_get(&pin->ref);
	mutex_unlock(&f->lock);
	return pin;
}

/*
 * The pin @handle of @f for a call that changes it: only the process that
 * opened the file may.  Returns a reference, or NULL with *err set.
 */
struct gpupin_pin_obj *gpupin_pin_lookup_owned(struct gpupin_file *f, u64 handle, int *err)
{
	struct gpupin_pin_obj *pin = NULL;

	*err = -EACCES;
	if (gpupin_caller_owns(f)) {
		pin = gpupin_pin_lookup(f, handle);
		*err = pin ? 0 : -ENOENT;
	}
	return pin;
}

/*
 * Mark the caller as an in-flight user of the pin's pages: the free callback
 * waits for it.  Fails with -ENXIO once the pages are gone or going.
 */
int gpupin_pin_use(struct gpupin_pin_obj *pin)
{
	int ret = -ENXIO;

	spin_lock(&pin->lock);
	if (pin->state == GPUPIN_PIN_PINNED) {
		pin->inflight++;
		ret = 0;
	}
	spin_unlock(&pin->lock);
	return ret;
}

void gpupin_pin_unuse(struct gpupin_pin_obj *pin)
{
	spin_lock(&pin->lock);
	pin->inflight--;
	/* Every change: an unpin waits for the count to reach its own share. */
	wake_up_all(&pin->wq);
	spin_unlock(&pin->lock);
}

static void gpupin_set_state(struct gpupin_pin_obj *pin, enum gpupin_pin_state state)
{
	spin_lock(&pin->lock);
	pin->state = state;
	wake_up_all(&pin->wq);
	spin_unlock(&pin->lock);
}

/*
 * The memory under @pin is going away: stop new users, tell drivers holding
 * references, wait for in-flight users, let the backend's teardown drop the
 * mappings, and report the invalidation.  With @always (the nv-p2p free
 * callback, which must free the page table whatever the state) it runs from
 * any state; otherwise only for a pin that is PINNING or PINNED.  Runs with
 * the provider's locks held: takes only pin->lock, refs_lock and the file's
 * ev_lock, and waits only for in-flight users.  Returns true when it let go
 * of a DETACHED pin: the caller then owes the module the reference that pin
 * held, dropped as the very last thing before returning to the provider.
 */
static bool gpupin_pin_invalidate(struct gpupin_pin_obj *pin, bool always)
{
	struct gpupin_file *f = pin->file;
	enum gpupin_pin_state prev;
	struct gpupin_event_rec *rec;
	u64 start = ktime_get_ns();

	spin_lock(&pin->lock);
	prev = pin->state;
	if (!always && prev != GPUPIN_PIN_PINNED && prev != GPUPIN_PIN_PINNING) {
		spin_unlock(&pin->lock);
		return false;
	}
	pin->state = GPUPIN_PIN_INVALIDATING;
	/* User space stops trusting the pin before anything goes. */
	if (prev == GPUPIN_PIN_PINNED)
		WRITE_ONCE(f->vmap[pin->slot], 0);
	spin_unlock(&pin->lock);

	/* Drivers holding references stop their DMA first. */
	gpupin_notify_refs(pin);
	/*
	 * No new user can start now; those running are short and never wait
	 * for the GPU driver's lock (an unpin's dma_unmap_pages among them).
	 */
	wait_event(pin->wq, READ_ONCE(pin->inflight) == 0);

	pin->ops->teardown(pin);

	if (prev == GPUPIN_PIN_DETACHED) {
		/* Nobody is left to tell: let the pin, its file and the module go. */
		gpupin_detached_del(pin);
		gpupin_budget_release(pin);
		gpupin_dbg("detached pin %llu released by its free callback\n", pin->handle);
		gpupin_set_state(pin, GPUPIN_PIN_INVALIDATED);
		gpupin_pin_put(pin);
		gpupin_file_put(f);
		atomic_dec(&gpupin_nr_detached);
		return true;
	}

	/* Unpin (RELEASING) and a failed PIN (PINNING) account for themselves. */
	if (prev == GPUPIN_PIN_PINNED) {
		gpupin_budget_release(pin);
		rec = pin->ev;
		pin->ev = NULL;
		rec->ev.handle = pin->handle;
		rec->ev.user_tag = pin->user_tag;
		rec->ev.reason = GPUPIN_INVAL_FREED;
		rec->ev.slot = pin->slot;
		gpupin_queue_event(f, rec);
	}
	gpupin_dbg("pin %llu invalidated by the provider\n", pin->handle);
	if (prev == GPUPIN_PIN_PINNED) {
		atomic64_inc(&gpupin_stats.inval_freed);
		gpupin_nl_pin_event(pin, GPUPIN_NL_CMD_INVALIDATED, GPUPIN_NL_REASON_FREED);
	}
	gpupin_stat_max(&gpupin_stats.callback_max_ns, ktime_get_ns() - start);
	/* Last touch: a waiting unpin may free the pin as soon as it sees this. */
	gpupin_set_state(pin, GPUPIN_PIN_INVALIDATED);
	return false;
}

/*
 * The nv-p2p free callback (nvp2p.c), NVIDIA's lock held: the memory under
 * @pin goes, whatever the pin's state.  Returns true when it let go of a
 * DETACHED pin: the caller then owes the module that pin's reference.
 */
bool gpupin_pin_freed(struct gpupin_pin_obj *pin)
{
	return gpupin_pin_invalidate(pin, true);
}

/* dma-buf move_notify (reservation lock held): the exporter revokes the buffer. */
void gpupin_pin_revoke(struct gpupin_pin_obj *pin)
{
	gpupin_pin_invalidate(pin, false);
}

static bool gpupin_pin_settled(struct gpupin_pin_obj *pin)
{
	bool settled;

	spin_lock(&pin->lock);
	settled = pin->state != GPUPIN_PIN_INVALIDATING;
	spin_unlock(&pin->lock);
	return settled;
}

/*
 * Hold what a DETACHED pin needs until its free callback: the pin, its file
 * and the module (the callback drops them).  Caller holds pin->lock and has
 * just moved the pin to DETACHED.
 */
static void gpupin_pin_hold_detached(struct gpupin_pin_obj *pin)
{
	lockdep_assert_held(&pin->lock);
	kref_get(&pin->ref);
	kref_get(&pin->file->ref);
	__module_get(THIS_MODULE);
	atomic_inc(&gpupin_nr_detached);
	gpupin_detached_add(pin);	/* for netlink (detached.c) */
}

/* Is the release of @pin, claimed as @claimed, still the caller's (no free callback took it)? */
bool gpupin_pin_still_claimed(struct gpupin_pin_obj *pin, enum gpupin_pin_state claimed)
{
	bool ours;

	spin_lock(&pin->lock);
	ours = pin->state == claimed;
	spin_unlock(&pin->lock);
	return ours;
}

/*
 * The backend could not give back the memory of @pin (state @claimed) and
 * its free callback may still come: DETACHED, kept for it, unless the
 * callback took the pin meanwhile.  Returns true when it detached the pin.
 */
static bool gpupin_pin_detach_unreleased(struct gpupin_pin_obj *pin,
					 enum gpupin_pin_state claimed)
{
	bool detach = false;

	spin_lock(&pin->lock);
	if (pin->state == claimed) {
		pin->state = GPUPIN_PIN_DETACHED;
		gpupin_pin_hold_detached(pin);
		detach = true;
	}
	spin_unlock(&pin->lock);
	if (detach)
		gpupin_dbg("pin %llu detached: put_pages failed, its pages wait for the callback\n",
			   pin->handle);
	return detach;
}

/*
 * Release the pages of @pin if the free callback has not, then wait for a
 * callback that is still running.  Process context; no gpupin lock held.
 * @from is the state that means "ours to release" (PINNED or PINNING).
 * Where the pages cannot be put from here (the backend's release_here) the
 * pin is DETACHED instead: its mappings go, its pages stay until the free
 * callback, which then holds a reference to the pin, its file and the
 * module; so is a pin whose put_pages failed.  Returns false in those cases
 * (the pin's pages are not released, and stay counted until the callback).
 */
static bool gpupin_pin_release_pages(struct gpupin_pin_obj *pin, enum gpupin_pin_state from)
{
	const struct gpupin_pin_backend_ops *ops = pin->ops;
	bool ours, detach = ops->release_here && !ops->release_here(pin);
	enum gpupin_pin_state claimed = detach ? GPUPIN_PIN_DETACHED : GPUPIN_PIN_RELEASING;
	/*
	 * nv-p2p: count ourselves in flight while we unmap, so a free callback
	 * cannot return (NVIDIA then frees the mappings) under
	 * dma_unmap_pages, which does not take the driver's lock.  Not for
	 * dma-buf: unmapping takes the reservation lock, under which a
	 * revocation waits for in-flight users.
	 */
	unsigned int self = ops->unmap_in_use ? 1 : 0;
	bool unmap = false;

	spin_lock(&pin->lock);
	ours = pin->state == from;
	if (ours) {
		pin->state = claimed;
		if (detach)	/* the free callback drops these (no waiting on us first) */
			gpupin_pin_hold_detached(pin);
	}
	spin_unlock(&pin->lock);

	if (ours) {
		/*
		 * A DMA map in progress sees the new state when it returns and
		 * undoes its mapping (dma.c); it may be waiting for the driver
		 * lock, so this wait is outside any in-flight count.
		 */
		wait_event(pin->wq, READ_ONCE(pin->mappers) == 0);
		spin_lock(&pin->lock);
		/* The free callback may have taken the pin meanwhile: its mappings too. */
		unmap = pin->state == claimed;
		if (unmap)
			pin->inflight += self;
		spin_unlock(&pin->lock);
	}
	if (unmap) {
		wait_event(pin->wq, READ_ONCE(pin->inflight) == self);
		gpupin_unmap_all(pin);
		if (self)
			gpupin_pin_unuse(pin);
	}
	if (ours) {
		if (detach) {
			gpupin_dbg("pin %llu detached: its pages wait for the free callback\n",
				   pin->handle);
			return false;
		}
		gpupin_fault_release_delay();
		if (ops->release && ops->release(pin, claimed) &&
		    gpupin_pin_detach_unreleased(pin, claimed))
			return false;
		gpupin_budget_release(pin);
	}
	/* put_pages returns only after a racing callback finished. */
	wait_event(pin->wq, gpupin_pin_settled(pin));
	if (ops->drop)
		ops->drop(pin);
	return true;
}

/* Give back the slot and count of a pin that is out of the handle table. */
static void gpupin_pin_unaccount(struct gpupin_file *f, struct gpupin_pin_obj *pin)
{
	WRITE_ONCE(f->vmap[pin->slot], 0);
	ida_free(&f->slots, pin->slot);
	atomic_dec(&f->nr_pins);
}

/*
 * Tear down a pin already removed from the handle table, now; drops the
 * table's ref.  No kernel-API reference may be left.
 * @reason: GPUPIN_NL_REASON_* for the UNPINNED event.
 */
void gpupin_pin_destroy_now(struct gpupin_file *f, struct gpupin_pin_obj *pin, u32 reason)
{
	/* Detached or not, the pin leaves the file's slots now. */
	gpupin_pin_release_pages(pin, GPUPIN_PIN_PINNED);
	gpupin_pin_unaccount(f, pin);
	atomic64_inc(&gpupin_stats.unpins);
	if (reason == GPUPIN_NL_REASON_PROCESS_EXIT)
		atomic64_inc(&gpupin_stats.inval_process_exit);
	gpupin_nl_pin_event(pin, GPUPIN_NL_CMD_UNPINNED, reason);
	gpupin_dbg("pin %llu released\n", pin->handle);
	gpupin_pin_put(pin);
}

/*
 * Tear down a pin already removed from the handle table, or, while drivers
 * hold references to it, leave that to the last gpupin_ref_put().
 */
static void gpupin_pin_destroy(struct gpupin_file *f, struct gpupin_pin_obj *pin, u32 reason)
{
	bool defer;

	mutex_lock(&pin->refs_lock);
	defer = pin->nr_refs;
	if (defer) {
		pin->orphaned = true;
		pin->orphan_reason = reason;
		/* User space sees it gone now; the slot stays taken until then. */
		WRITE_ONCE(f->vmap[pin->slot], 0);
	} else {
		pin->gone = true;
	}
	mutex_unlock(&pin->refs_lock);
	if (!defer)
		gpupin_pin_destroy_now(f, pin, reason);
}

void gpupin_file_release_pins(struct gpupin_file *f, u32 reason)
{
	struct gpupin_pin_obj *pin;
	unsigned long idx;

	xa_for_each(&f->pins, idx, pin) {
		mutex_lock(&f->lock);
		xa_erase(&f->pins, idx);
		mutex_unlock(&f->lock);
		gpupin_pin_destroy(f, pin, reason);
		cond_resched();
	}
}

static void gpupin_count_failure(int err)
{
	switch (err) {
	case -ENOMEM:
		atomic64_inc(&gpupin_stats.fail_enomem);
		break;
	case -ENOSPC:
		atomic64_inc(&gpupin_stats.fail_enospc);
		break;
	case -EINVAL:
		atomic64_inc(&gpupin_stats.fail_einval);
		break;
	case -EDQUOT:
		atomic64_inc(&gpupin_stats.fail_edquot);
		break;
	default:
		atomic64_inc(&gpupin_stats.fail_other);
	}
}

/* A new pin in state PINNING, not yet reserved; NULL (counted in fail_enomem) if out of memory. */
static struct gpupin_pin_obj *gpupin_pin_alloc(struct gpupin_file *f,
					       const struct gpupin_pin_req *req)
{
	struct gpupin_pin_obj *pin;

	pin = gpupin_kzalloc(sizeof(*pin), GFP_KERNEL);
	if (!pin)
		goto nomem;
	pin->ev = gpupin_kzalloc(sizeof(*pin->ev), GFP_KERNEL);
	if (!pin->ev) {
		kfree(pin);
		goto nomem;
	}
	kref_init(&pin->ref);
	spin_lock_init(&pin->lock);
	init_waitqueue_head(&pin->wq);
	INIT_LIST_HEAD(&pin->maps);
	INIT_LIST_HEAD(&pin->detached_node);
	mutex_init(&pin->refs_lock);
	INIT_LIST_HEAD(&pin->refs);
	pin->ops = req->ops;
	pin->file = f;
	pin->flags = req->flags;
	pin->va = req->va;
	pin->size = req->size;
	pin->aligned_va = req->aligned_va;
	pin->aligned_size = req->aligned_size;
	pin->user_tag = req->user_tag;
	pin->page_shift = req->page_shift;
	pin->entries = req->aligned_size >> req->page_shift;
	pin->created_ns = ktime_get_real_ns();
	pin->state = GPUPIN_PIN_PINNING;
	return pin;

nomem:
	gpupin_count_failure(-ENOMEM);
	return NULL;
}

/* Reserve a handle, a validity slot and a place in the per-file count. */
static int gpupin_pin_account(struct gpupin_file *f, struct gpupin_pin_obj *pin)
{
	int slot;

	/* -ENOSPC once every slot of the file is taken. */
	slot = ida_alloc_max(&f->slots, f->nr_slots - 1, GFP_KERNEL);
	if (slot < 0)
		return slot;
	pin->slot = slot;
	atomic_inc(&f->nr_pins);
	mutex_lock(&f->lock);
	pin->handle = ++f->next_handle;
	mutex_unlock(&f->lock);
	return 0;
}

/*
 * Budget, slot and handle for a new pin; on failure the pin is freed and
 * the failure counted.
 */
static int gpupin_pin_reserve(struct gpupin_file *f, struct gpupin_pin_obj *pin)
{
	int ret = gpupin_budget_reserve(f, pin);

	if (!ret) {
		ret = gpupin_pin_account(f, pin);
		if (!ret)
			return 0;
		gpupin_budget_release(pin);	/* ENOSPC here: the file's slots, not bytes */
	} else if (ret == -ENOSPC) {
		/* max_pinned_bytes, the byte budget the event's figures are of */
		gpupin_nl_budget_event(f, pin->aligned_size);
	}
	gpupin_count_failure(ret);
	gpupin_pin_put(pin);
	return ret;
}

/*
 * Undo gpupin_pin_reserve() for a pin that failed with @err; frees it.  A
 * detached pin's budget stays held: its free callback gives it back.
 */
static void gpupin_pin_unreserve(struct gpupin_file *f, struct gpupin_pin_obj *pin, int err,
				 bool detached)
{
	gpupin_pin_unaccount(f, pin);
	if (!detached)
		gpupin_budget_release(pin);
	gpupin_count_failure(err);
	gpupin_pin_put(pin);
}

/*
 * PINNING -> PINNED and valid in the map; -ENXIO if the memory went first.
 * The backend's commit (if any) runs under pin->lock just before, while
 * the pin is still PINNING; its error fails the pin.
 */
static int gpupin_pin_mark_pinned(struct gpupin_file *f, struct gpupin_pin_obj *pin)
{
	int ret = -ENXIO;

	spin_lock(&pin->lock);
	if (pin->state == GPUPIN_PIN_PINNING) {
		ret = pin->ops->commit ? pin->ops->commit(pin) : 0;
		if (!ret) {
			WRITE_ONCE(f->vmap[pin->slot], pin->handle);
			pin->state = GPUPIN_PIN_PINNED;
		}
	}
	spin_unlock(&pin->lock);
	return ret;
}

/* The pin's GPU UUID (zeros where the provider gives none). */
void gpupin_pin_uuid(const struct gpupin_pin_obj *pin, u8 uuid[16])
{
	memcpy(uuid, pin->gpu_uuid, 16);
}

/*
 * Address of page @idx: its physical address (nv-p2p), or its bus address in
 * gpupin's own import (dma-buf); 0 where the backend has none.  The caller
 * is an in-flight user.
 */
u64 gpupin_pin_page_addr(const struct gpupin_pin_obj *pin, u32 idx)
{
	u64 addr;

	if (idx >= pin->entries || pin->ops->addrs(pin, &addr, idx, 1))
		return 0;
	return addr;
}

/*
 * Make a PINNED pin visible: into the handle table, its result to user
 * space (@len bytes of @arg to @uarg), events and counters.  On failure the
 * pin is torn down again.
 */
static int gpupin_pin_publish(struct gpupin_file *f, struct gpupin_pin_obj *pin,
			      void __user *uarg, const void *arg, size_t len)
{
	int ret;

	/* The result first: until the store below no other thread can reach the pin. */
	if (copy_to_user(uarg, arg, len)) {
		gpupin_count_failure(-EFAULT);
		gpupin_pin_destroy(f, pin, GPUPIN_NL_REASON_UNPIN);
		return -EFAULT;
	}
	/* Done while the pin is still only ours: a racing UNPIN may free it after the store. */
	gpupin_dbg("pin %llu: %llu bytes\n", pin->handle, pin->aligned_size);
	atomic64_inc(&gpupin_stats.pins);
	gpupin_stat_max(&gpupin_stats.bytes_peak, atomic64_read(&gpupin_pinned_bytes));
	gpupin_nl_pin_event(pin, GPUPIN_NL_CMD_PINNED, 0);
	mutex_lock(&f->lock);
	ret = xa_insert(&f->pins, pin->handle, pin, GFP_KERNEL);
	mutex_unlock(&f->lock);
	if (ret) {
		gpupin_count_failure(ret);
		gpupin_pin_destroy(f, pin, GPUPIN_NL_REASON_UNPIN);
		return ret == -EBUSY ? -EEXIST : ret;
	}
	return 0;
}

/*
 * The one way to a new pin, for PIN and PIN_DMABUF once they checked every
 * field of theirs: allocate and reserve it, let the backend take the memory
 * (@req->ops->acquire), make it PINNED, fill and copy out the ioctl's result
 * and publish it.  A pin that fails on the way is released and unreserved
 * here, whatever the backend had taken.
 */
long gpupin_pin_new(struct gpupin_file *f, const struct gpupin_pin_req *req)
{
	struct gpupin_pin_obj *pin;
	int ret;

	pin = gpupin_pin_alloc(f, req);
	if (!pin)
		return -ENOMEM;
	ret = gpupin_pin_reserve(f, pin);
	if (ret)
		return ret;
	/* The dmem charge first where the GPU can be learned (EDQUOT: no BAR1 taken). */
	ret = gpupin_budget_precharge(pin);
	if (ret) {
		gpupin_pin_unreserve(f, pin, ret, false);
		return ret;
	}
	ret = pin->ops->acquire(pin, req->priv);
	/* The GPU is known now: its dmem charge confirmed, moved or made (EDQUOT past a limit). */
	if (!ret)
		ret = gpupin_budget_charge_gpu(pin);
	/* -ENXIO: the memory went (free callback, revocation) while it was taken. */
	if (!ret)
		ret = gpupin_pin_mark_pinned(f, pin);
	if (ret) {
		/* Detached (put_pages failed): its callback gives the bytes back, not unreserve. */
		bool detached = !gpupin_pin_release_pages(pin, GPUPIN_PIN_PINNING);

		gpupin_pin_unreserve(f, pin, ret, detached);
		return ret;
	}
	req->fill(req->arg, pin);
	return gpupin_pin_publish(f, pin, req->uarg, req->arg, req->len);
}

long gpupin_ioctl_unpin(struct gpupin_file *f, struct gpupin_unpin __user *uarg)
{
	struct gpupin_unpin arg;
	struct gpupin_pin_obj *pin = NULL;

	if (copy_from_user(&arg, uarg, sizeof(arg)))
		return -EFAULT;
	if (arg.flags || arg.pad)
		return -EINVAL;
	if (!gpupin_caller_owns(f))
		return -EACCES;
	if (arg.handle <= ULONG_MAX) {
		mutex_lock(&f->lock);
		pin = xa_erase(&f->pins, arg.handle);
		mutex_unlock(&f->lock);
	}
	if (!pin)
		return -ENOENT;
	gpupin_pin_destroy(f, pin, GPUPIN_NL_REASON_UNPIN);
	return 0;
}

/* QUERY's answer for @pin, a reference the caller holds. */
static void gpupin_pin_query(struct gpupin_pin_obj *pin, struct gpupin_query *arg)
{
	arg->va = pin->va;
	arg->size = pin->size;
	arg->aligned_va = pin->aligned_va;
	arg->aligned_size = pin->aligned_size;
	arg->user_tag = pin->user_tag;
	arg->pin_flags = pin->flags;
	arg->slot = pin->slot;
	arg->page_size = BIT(pin->page_shift);
	arg->entries = pin->entries;
	spin_lock(&pin->lock);
	arg->state = pin->state == GPUPIN_PIN_PINNED ? GPUPIN_STATE_PINNED :
						       GPUPIN_STATE_INVALIDATED;
	arg->dma_mappings = gpupin_map_count_locked(pin);
	spin_unlock(&pin->lock);
}

/* QUERY: copy in, validate, answer (gpupin_pin_query), copy out. */
long gpupin_ioctl_query(struct gpupin_file *f, struct gpupin_query __user *uarg)
{
	struct gpupin_query arg;
	struct gpupin_pin_obj *pin;

	if (copy_from_user(&arg, uarg, sizeof(arg)))
		return -EFAULT;
	if (arg.flags || arg.pad || arg.reserved[0] || arg.reserved[1])
		return -EINVAL;
	pin = gpupin_pin_lookup(f, arg.handle);
	if (!pin)
		return -ENOENT;
	gpupin_pin_query(pin, &arg);
	gpupin_pin_put(pin);
	return copy_to_user(uarg, &arg, sizeof(arg)) ? -EFAULT : 0;
}

/*
 * The address window of GET_PAGES and DMA_ADDRS: entries [first, first + count)
 * of the pin @handle, filled by @fill while the pin is in use (so never while
 * its callback waits: the callback must never wait for a fault) and copied to
 * @uaddrs afterwards.  The caller has checked the permission and the fields.
 */
long gpupin_copy_addr_window(struct gpupin_file *f, u64 handle, u32 first, u32 count,
			     u64 uaddrs, gpupin_window_fill_t fill, void *ctx)
{
	struct gpupin_pin_obj *pin;
	u64 *addrs;
	int ret;

	pin = gpupin_pin_lookup(f, handle);
	if (!pin)
		return -ENOENT;
	ret = -EINVAL;
	if (first >= pin->entries || count > pin->entries - first)
		goto out_put;
	ret = -ENOMEM;
	addrs = gpupin_kvmalloc_array(count, sizeof(*addrs), GFP_KERNEL);
	if (!addrs)
		goto out_put;
	ret = gpupin_pin_use(pin);
	if (!ret) {
		ret = fill(pin, addrs, first, count, ctx);
		gpupin_pin_unuse(pin);
	}
	if (!ret && copy_to_user(u64_to_user_ptr(uaddrs), addrs, array_size(count, sizeof(*addrs))))
		ret = -EFAULT;
	kvfree(addrs);
out_put:
	gpupin_pin_put(pin);
	return ret;
}

static int gpupin_fill_pages(struct gpupin_pin_obj *pin, u64 *addrs, u32 first, u32 count,
			     void *ctx)
{
	return pin->ops->addrs(pin, addrs, first, count);
}

long gpupin_ioctl_get_pages(struct gpupin_file *f, struct gpupin_get_pages __user *uarg)
{
	struct gpupin_get_pages arg;

	/* Physical addresses: for the opener alone, and only an administrator. */
	if (!gpupin_may_read_addrs(f))
		return -EPERM;
	if (copy_from_user(&arg, uarg, sizeof(arg)))
		return -EFAULT;
	if (arg.flags || arg.pad || arg.reserved[0] || arg.reserved[1] || !arg.count ||
	    arg.count > GPUPIN_MAX_ADDRS_PER_CALL)
		return -EINVAL;
	return gpupin_copy_addr_window(f, arg.handle, arg.first, arg.count, arg.addrs,
				       gpupin_fill_pages, NULL);
}
