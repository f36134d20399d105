// SPDX-License-Identifier: (GPL-2.0 OR MIT)
/*
 * gpupin: pin objects - PIN, UNPIN, QUERY and GET_PAGES, the nv-p2p free
 * callback, and teardown.
 *
 * This file owns every pin's life, whatever its memory: a new pin
 * (gpupin_pin_new: alloc, reserve, acquire, PINNED, publish), its
 * invalidation and its release.  The memory itself comes from a backend,
 * called through its struct gpupin_pin_backend_ops (gpupin.h): nv-p2p's is
 * here (gpupin_nvp2p_backend), dma-buf's in dmabuf.c.
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
 *
 * A put_pages that returns 0 from the pinning process may have released
 * nothing all the same: NVIDIA looks the mapping up through the process's
 * registration, which an MPS client's teardown removes while the memory and
 * the armed callback stay with the MPS server.  So the callback can come for
 * a pin gpupin has freed.  Its data is therefore an id (gpupin_cb_pins),
 * never a pointer: see gpupin_free_callback().  It may even come after
 * gpupin.ko was unloaded, so the function NVIDIA gets is not ours but
 * gpupin_cb.ko's (kernel/cb/tramp.c), which stays loaded, calls
 * gpupin_free_callback() through its registration while gpupin.ko is there,
 * and gives the ids, so that they are not handed out again by a reloaded
 * gpupin.ko either.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/capability.h>
#include <linux/delay.h>
#include <linux/err.h>
#include <linux/mm.h>
#include <linux/module.h>
#include <linux/overflow.h>
#include <linux/rcupdate.h>
#include <linux/sched.h>
#include <linux/slab.h>
#include <linux/uaccess.h>
#include <linux/wait_bit.h>
#include "gpupin.h"
#include "cb/gpupin_cb.h"
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

/*
 * nv-p2p's release_here: may the pages of @pin be put from here?
 * Non-persistent pages only by the process that pinned them (the file's
 * owner: PIN checks that).
 */
static bool gpupin_nvp2p_release_here(const struct gpupin_pin_obj *pin)
{
	return !pin->pt || (pin->flags & GPUPIN_PIN_PERSISTENT) ||
	       gpupin_caller_owns(pin->file);
}

/*
 * The nv-p2p free callback's data: an id, looked up here, never a pointer
 * to the pin.  NVIDIA may call the callback after gpupin freed the pin (a
 * put_pages that returned 0 having released nothing, gpupin_nvp2p_release());
 * a pointer would then be a use after free, or another pin that got the
 * same address.  An id stays here until the pin's callback takes it out or
 * the pin's last reference goes; the callback takes its reference under the
 * xarray's lock (kref_get_unless_zero: the last put may be on its way to
 * erase it).  So an id it finds is a live pin, and one it does not find is
 * a late, duplicate or unknown callback: NVIDIA runs a registration's
 * callback once, so a second one with the same id finds nothing.  Ids
 * count up over 64 bits (the callback's data is a pointer: nv-p2p exists
 * on 64-bit kernels only) and are never handed out twice, not even by
 * gpupin.ko loaded again (gpupin_cb_new_id() counts in gpupin_cb.ko, which
 * stays loaded), so a stale id can never find a newer pin.  The lock's
 * place in the lock order: gpupin.h (innermost, taken alone).
 */
static DEFINE_XARRAY(gpupin_cb_pins);

/* Give @pin its callback id; -ENOMEM if the xarray cannot grow. */
static int gpupin_cb_id_alloc(struct gpupin_pin_obj *pin)
{
	unsigned long id;
	int ret;

	BUILD_BUG_ON(sizeof(void *) < sizeof(u64));
	id = gpupin_cb_new_id();
	ret = xa_insert(&gpupin_cb_pins, id, pin, GFP_KERNEL);
	if (ret < 0)
		return ret;
	pin->cb_id = id;
	return 0;
}

/*
 * The pin of callback data @data with a reference, its id taken out; NULL
 * if it is gone, had its callback already, or never was.
 */
static struct gpupin_pin_obj *gpupin_cb_pin_take(void *data)
{
	unsigned long id = (unsigned long)data;
	struct gpupin_pin_obj *pin;

	if (!id)
		return NULL;
	xa_lock(&gpupin_cb_pins);
	pin = __xa_erase(&gpupin_cb_pins, id);
	if (pin && !kref_get_unless_zero(&pin->ref))
		pin = NULL;	/* its last put is on its way */
	xa_unlock(&gpupin_cb_pins);
	return pin;
}

/* Module unload: every pin, so every id, is gone by then. */
void gpupin_cb_ids_exit(void)
{
	WARN_ON(!xa_empty(&gpupin_cb_pins));
	xa_destroy(&gpupin_cb_pins);
}

static void gpupin_pin_free(struct kref *ref)
{
	struct gpupin_pin_obj *pin = container_of(ref, struct gpupin_pin_obj, ref);

	/* From here on a callback with this pin's id finds nothing (if it did not take it). */
	if (pin->cb_id)
		xa_cmpxchg(&gpupin_cb_pins, pin->cb_id, pin, NULL, 0);
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
		atomic64_sub(pin->aligned_size, &gpupin_pinned_bytes);
		gpupin_dbg("detached pin %llu released by its free callback\n", pin->handle);
		gpupin_set_state(pin, GPUPIN_PIN_INVALIDATED);
		gpupin_pin_put(pin);
		gpupin_file_put(f);
		atomic_dec(&gpupin_nr_detached);
		return true;
	}

	/* Unpin (RELEASING) and a failed PIN (PINNING) account for themselves. */
	if (prev == GPUPIN_PIN_PINNED) {
		atomic64_sub(pin->aligned_size, &gpupin_pinned_bytes);
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

/* nv-p2p's teardown: the provider tore the mappings down; free their descriptors and the table. */
static void gpupin_nvp2p_teardown(struct gpupin_pin_obj *pin)
{
	gpupin_free_maps_invalidated(pin);
	nvidia_p2p_free_page_table(pin->pt);
}

/*
 * Free callbacks still running gpupin's code.  gpupin_cb.ko holds the
 * module across every callback (a detached pin's own module reference goes
 * inside it), so an unload is refused while one runs; gpupin_exit() still
 * waits for this count to reach zero, then for every task to have left the
 * few instructions after the decrement (synchronize_rcu_tasks(), as for
 * code that module text frees under), should a callback ever come another
 * way.
 */
atomic_t gpupin_callbacks_running = ATOMIC_INIT(0);

/*
 * The nv-p2p free callback: the GPU memory under the pin is being freed.
 * Never calls put_pages or dma_unmap_pages, and never waits for a thread
 * that may wait for NVIDIA's lock (gpupin_pin_invalidate() waits only for
 * in-flight users).  @data is the pin's id (gpupin_cb_pins): the pin is
 * looked up, with a reference, under the xarray's lock, the innermost lock,
 * held for nothing else.  An id that finds nothing - a callback for a pin
 * gpupin already freed, because a put_pages that returned 0 released
 * nothing (an MPS client's registration pruned), or a duplicate - returns
 * at once: that pin's table, which the driver frees after this returns on
 * the drivers gpupin supports (nvidia_p2p_free_page_table is a no-op
 * there), is not freed by gpupin.
 *
 * NVIDIA does not call this directly: it calls gpupin_cb_free_callback()
 * (gpupin_cb.ko), which holds this module while it runs this, the handler
 * gpupin_init() registers.  A callback whose pin is gone may come after
 * gpupin.ko was unloaded (an MPS server freeing a client's memory after the
 * client's file closed; NVIDIA's API gives no way to know whether put_pages
 * released anything, so gpupin cannot hold itself for it): gpupin_cb.ko then
 * finds no handler, counts it and returns.
 */
static void gpupin_free_callback(void *data)
{
	struct gpupin_pin_obj *pin;
	bool detached = false;

	atomic_inc(&gpupin_callbacks_running);
	pin = gpupin_cb_pin_take(data);
	if (pin) {
		detached = gpupin_pin_invalidate(pin, true);
		gpupin_pin_put(pin);
	} else {
		pr_notice_ratelimited("free callback for pin id %lu: released or called back before, ignored\n",
				      (unsigned long)data);
	}
	if (detached)
		module_put(THIS_MODULE);
	gpupin_fault_callback_tail();
	if (atomic_dec_and_test(&gpupin_callbacks_running))
		wake_up_var(&gpupin_callbacks_running);
}

/* What gpupin_cb.ko calls, holding this module, while it is registered. */
static const struct gpupin_cb_handler gpupin_handler = {
	.owner = THIS_MODULE,
	.free_callback = gpupin_free_callback,
};

/* Module load, before anything can pin: receive the free callbacks. */
int gpupin_cb_handler_init(void)
{
	return gpupin_cb_register(&gpupin_handler);
}

/*
 * Module unload, before anything is torn down: from here on no callback
 * reaches gpupin_free_callback() (gpupin_cb.ko finds this module going,
 * counts the callback and returns).  None can be in it either: it would
 * hold this module, which could then not be unloading.
 */
void gpupin_cb_handler_exit(void)
{
	gpupin_cb_unregister(&gpupin_handler);
}

/*
 * A module load that fails, instead of gpupin_cb_handler_exit(): the loader
 * frees this module's memory as soon as gpupin_init() returns, without the
 * check for references an unload makes.  gpupin_cb.ko takes a module that is
 * still loading like any other, so a callback for a pin of an earlier
 * gpupin.ko (one whose put_pages released nothing: see the top of this file)
 * may be in gpupin_free_callback() now.  No pin of this instance exists (the
 * device was not created), so unregister, then wait until that callback's
 * module reference - the only one besides the loader's own - is back:
 * gpupin_cb.ko drops it once the callback has returned to it.
 */
void gpupin_cb_handler_abort(void)
{
	gpupin_cb_handler_exit();
#ifdef CONFIG_MODULE_UNLOAD
	/*
	 * Also a netlink dump left half read holds the module (the family is
	 * registered before the device fails): the load waits for its socket to
	 * close, and says so every 10 s.
	 */
	for (unsigned int i = 1; module_refcount(THIS_MODULE) > 1; i++) {
		msleep(20);
		if (!(i % 500))
			pr_warn("failed load: waiting for %d reference(s) to the module (a free callback running, or a netlink dump not read to its end)\n",
				module_refcount(THIS_MODULE) - 1);
	}
#else
	/*
	 * No references are counted: wait for the callbacks gpupin counts
	 * and for every task to have left their last instructions.  One that
	 * gpupin_cb.ko passed on but that has not counted itself yet is not
	 * seen here.
	 */
	wait_var_event(&gpupin_callbacks_running, !atomic_read(&gpupin_callbacks_running));
	synchronize_rcu_tasks();
#endif
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

/*
 * gpupin_p2p_tables: no nv-p2p put_pages of gpupin's runs while one of its
 * get_pages does.  NVIDIA finds a non-persistent put's mapping by the page
 * table's pointer value among the calling process's (RmP2PPutPages,
 * p2p.c), frees a table right after its free callback
 * (nv_p2p_mem_info_free_callback, nv-p2p.c), and nv_p2p_get_pages allocates
 * the next table before it takes the RM lock: the freed address may come
 * straight back.  A put waiting for the RM lock while a callback frees its
 * table would then release the newer pin that got that address.  Under
 * this mutex a put first checks that the callback has not taken its pin
 * (the callback moves the pin on before NVIDIA frees the table), and no
 * get_pages can be handed the table until the put has returned: it then
 * finds the live mapping, or nothing.  Other nv-p2p clients in the same
 * process (another module pinning for it) are not serialised with gpupin
 * and can still be handed such an address: kernel/sim/FIDELITY.md.
 *
 * Lock order (gpupin.h): taken with no gpupin lock held but a kernel-API
 * reference's map_lock (topo.c's probe), around nv-p2p get_pages and
 * put_pages only, so only NVIDIA's RM lock nests inside it; never taken by
 * the free callback, which runs under that RM lock.
 */
static DEFINE_MUTEX(gpupin_p2p_tables);

/* A persistent pin outside a pin object (topo.c's probe), kept apart from puts all the same. */
int gpupin_p2p_get_persistent(u64 va, u64 len, struct nvidia_p2p_page_table **pt)
{
	int ret;

	mutex_lock(&gpupin_p2p_tables);
	ret = nvidia_p2p_get_pages_persistent(va, len, pt, 0);
	mutex_unlock(&gpupin_p2p_tables);
	return ret;
}

int gpupin_p2p_put_persistent(u64 va, struct nvidia_p2p_page_table *pt)
{
	int ret;

	mutex_lock(&gpupin_p2p_tables);
	ret = nvidia_p2p_put_pages_persistent(va, pt, 0);
	mutex_unlock(&gpupin_p2p_tables);
	return ret;
}

/* Is the release of @pin, claimed as @claimed, still the caller's (no free callback took it)? */
static bool gpupin_pin_still_claimed(struct gpupin_pin_obj *pin, enum gpupin_pin_state claimed)
{
	bool ours;

	spin_lock(&pin->lock);
	ours = pin->state == claimed;
	spin_unlock(&pin->lock);
	return ours;
}

/*
 * nv-p2p's release: put the pages of a pin whose release the caller claimed
 * (state @claimed), unless get_pages gave none or the free callback took the
 * pin meanwhile: NVIDIA has then freed the table, and a put of its address
 * could release another pin of this process that got it.  A callback that
 * comes after the check finishes before the put gets NVIDIA's lock, and no
 * get_pages can reuse the table before the put returns
 * (gpupin_p2p_tables).  Returns put_pages' error for a pin whose callback
 * may still be armed: the pin is then kept for it.
 */
static int gpupin_nvp2p_release(struct gpupin_pin_obj *pin, enum gpupin_pin_state claimed)
{
	bool persistent = pin->flags & GPUPIN_PIN_PERSISTENT;
	int ret;

	if (!pin->pt)
		return 0;
	mutex_lock(&gpupin_p2p_tables);
	if (!gpupin_pin_still_claimed(pin, claimed)) {
		mutex_unlock(&gpupin_p2p_tables);
		return 0;	/* the callback released them */
	}
	if (persistent || gpupin_fault_put_other_kind())
		ret = nvidia_p2p_put_pages_persistent(pin->aligned_va, pin->pt, 0);
	else
		ret = nvidia_p2p_put_pages(0, 0, pin->aligned_va, pin->pt);
	mutex_unlock(&gpupin_p2p_tables);
	/*
	 * 0 means "maybe released": NVIDIA returns 0 too when it found no
	 * mapping of this process for the table (an MPS client's registration
	 * pruned), and the callback stays armed.  The caller may free the pin
	 * all the same: the callback reaches it only by id, and finds nothing
	 * once the pin is gone (gpupin_free_callback()).
	 */
	if (!ret)
		return 0;
	pr_warn_ratelimited("put_pages failed: %d\n", ret);
	if (persistent)
		return 0;	/* no callback will come: nothing more to do */
	return ret;
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
		if (from == GPUPIN_PIN_PINNED)
			atomic64_sub(pin->aligned_size, &gpupin_pinned_bytes);
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

/*
 * Can gpupin read a page table of @version?  NVIDIA's rule for the header it
 * was built against (same major, minor at least the header's).  Built against
 * a 2.x header (R580 on), 1.x tables from 1.2 on as well: 2.0 appended
 * `flags` to the 1.2 layout, and gpupin reads no field after gpu_uuid (added
 * in 1.2), so a 1.2 table - smaller by that member - is read in bounds.
 */
bool gpupin_table_version_ok(u32 version)
{
	u32 major = NVIDIA_P2P_MAJOR_VERSION(version);
	u32 minor = NVIDIA_P2P_MINOR_VERSION(version);
	u32 built = NVIDIA_P2P_MAJOR_VERSION(NVIDIA_P2P_PAGE_TABLE_VERSION);

	if (major == built)
		return minor >= NVIDIA_P2P_MINOR_VERSION(NVIDIA_P2P_PAGE_TABLE_VERSION);
	return built == 2 && major == 1 && minor >= 2;
}

static int gpupin_check_table(struct gpupin_pin_obj *pin)
{
	struct nvidia_p2p_page_table *pt = pin->pt;

	if (!gpupin_table_version_ok(pt->version)) {
		pr_warn_ratelimited("incompatible page table version 0x%08x\n", pt->version);
		return -EPROTO;
	}
	if (pt->page_size != NVIDIA_P2P_PAGE_SIZE_64KB) {
		pr_warn_ratelimited("unsupported GPU page size type %u\n", pt->page_size);
		return -EOPNOTSUPP;
	}
	if (pt->entries != pin->entries) {
		pr_warn_ratelimited("page table has %u entries for %llu bytes\n",
				    pt->entries, pin->aligned_size);
		return -EPROTO;
	}
	return 0;
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
	default:
		atomic64_inc(&gpupin_stats.fail_other);
	}
}

/* Reserve @size bytes of the module-wide budget; -ENOSPC past it. */
static int gpupin_budget_get(u64 size)
{
	unsigned long max = READ_ONCE(gpupin_max_pinned_bytes);
	s64 now = atomic64_add_return(size, &gpupin_pinned_bytes);

	if (max && now > max) {
		atomic64_sub(size, &gpupin_pinned_bytes);
		return -ENOSPC;
	}
	return 0;
}

static int gpupin_pin_validate(struct gpupin_pin *arg)
{
	u64 end, aligned_end;

	if ((arg->flags & ~GPUPIN_PIN_FLAGS_ALL) || arg->pad ||
	    arg->reserved[0] || arg->reserved[1])
		return -EINVAL;
	if (!arg->size || check_add_overflow(arg->va, arg->size, &end) ||
	    check_add_overflow(end, GPU_BOUND_SIZE - 1, &aligned_end))
		return -EINVAL;
	aligned_end &= GPU_BOUND_MASK;
	arg->aligned_va = arg->va & GPU_BOUND_MASK;
	arg->aligned_size = aligned_end - arg->aligned_va;
	if ((arg->aligned_size >> GPU_BOUND_SHIFT) > U32_MAX)
		return -EINVAL;
	return 0;
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
	int ret = gpupin_budget_get(pin->aligned_size);

	if (!ret) {
		ret = gpupin_pin_account(f, pin);
		if (!ret)
			return 0;
		atomic64_sub(pin->aligned_size, &gpupin_pinned_bytes);
	}
	if (ret == -ENOSPC)
		gpupin_nl_budget_event(f, pin->aligned_size);
	gpupin_count_failure(ret);
	gpupin_pin_put(pin);
	return ret;
}

/* Undo gpupin_pin_reserve() for a pin that failed with @err; frees it. */
static void gpupin_pin_unreserve(struct gpupin_file *f, struct gpupin_pin_obj *pin, int err)
{
	gpupin_pin_unaccount(f, pin);
	atomic64_sub(pin->aligned_size, &gpupin_pinned_bytes);
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

/* nv-p2p's commit: check the page table and keep its GPU UUID. */
static int gpupin_nvp2p_commit(struct gpupin_pin_obj *pin)
{
	int ret = gpupin_check_table(pin);

	if (!ret && pin->pt->gpu_uuid)
		memcpy(pin->gpu_uuid, pin->pt->gpu_uuid, sizeof(pin->gpu_uuid));
	return ret;
}

/* The pin's GPU UUID (zeros where the provider gives none). */
void gpupin_pin_uuid(const struct gpupin_pin_obj *pin, u8 uuid[16])
{
	memcpy(uuid, pin->gpu_uuid, 16);
}

/* nv-p2p's addrs: the pages' physical addresses. */
static int gpupin_nvp2p_addrs(const struct gpupin_pin_obj *pin, u64 *addrs, u32 first, u32 count)
{
	u32 i;

	for (i = 0; i < count; i++)
		addrs[i] = pin->pt->pages[first + i]->physical_address;
	return 0;
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

/* PIN's result for @pin (gpupin_pin_req.fill): @out is its struct gpupin_pin. */
static void gpupin_pin_fill(void *out, const struct gpupin_pin_obj *pin)
{
	struct gpupin_pin *arg = out;

	BUILD_BUG_ON(sizeof(arg->gpu_uuid) != 16);
	arg->handle = pin->handle;
	arg->page_size = BIT(pin->page_shift);
	arg->entries = pin->entries;
	gpupin_pin_uuid(pin, arg->gpu_uuid);
	arg->slot = pin->slot;
	arg->pin_flags = pin->flags;
	arg->valid_word = pin->handle;
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

/* What gpupin_nvp2p_acquire() leaves in pin->pt for get_pages to overwrite. */
#define GPUPIN_PT_UNSET ((struct nvidia_p2p_page_table *)ERR_PTR(-EINVAL))

/*
 * A failed get_pages' error as PIN reports it.  NVIDIA's nv_p2p_get_pages
 * pins (rm_p2p_get_pages) and then arms the callback
 * (rm_p2p_register_callback), taking its API lock for each.  Memory freed
 * in between loses its mapping without a callback; the registration then
 * fails with -EINVAL, and the failure path's put_pages, finding nothing,
 * sets *page_table to NULL.  No other -EINVAL leaves NULL there: the
 * argument checks leave it as it was (GPUPIN_PT_UNSET), and RM refusing
 * the range leaves it pointing at the freed table.  So -EINVAL with @pt
 * NULL is memory freed while gpupin pinned it: -ENXIO, as when the callback
 * runs before get_pages returns.  (An MPS client torn down in that window,
 * losing its registration, looks the same: its memory is gone for it.)
 */
static int gpupin_get_pages_err(int err, const struct nvidia_p2p_page_table *pt,
				bool persistent)
{
	if (err == -EINVAL && !pt && !persistent)
		return -ENXIO;
	return gpupin_provider_err(err);
}

/*
 * nv-p2p's acquire: get_pages of [aligned_va, aligned_va + aligned_size),
 * persistent or with the free callback, whose data is the pin's id.  The
 * callback may run as soon as get_pages returns.
 */
static int gpupin_nvp2p_acquire(struct gpupin_pin_obj *pin, void *req)
{
	bool persistent = pin->flags & GPUPIN_PIN_PERSISTENT;
	int ret;

	if (!persistent) {
		ret = gpupin_cb_id_alloc(pin);
		if (ret)
			return ret;
	}

	pin->pt = GPUPIN_PT_UNSET;	/* see gpupin_get_pages_err() */
	mutex_lock(&gpupin_p2p_tables);
	if (persistent)
		ret = nvidia_p2p_get_pages_persistent(pin->aligned_va, pin->aligned_size,
						      &pin->pt, 0);
	else
		ret = nvidia_p2p_get_pages(0, 0, pin->aligned_va, pin->aligned_size,
					   &pin->pt, gpupin_cb_free_callback,
					   (void *)(unsigned long)pin->cb_id);
	mutex_unlock(&gpupin_p2p_tables);
	if (ret) {
		gpupin_dbg("get_pages failed: %d\n", ret);
		ret = gpupin_get_pages_err(ret, pin->pt, persistent);
		pin->pt = NULL;
	}
	return ret;
}

/* The nv-p2p backend (gpupin.h: struct gpupin_pin_backend_ops). */
static const struct gpupin_pin_backend_ops gpupin_nvp2p_backend = {
	.acquire = gpupin_nvp2p_acquire,
	.commit = gpupin_nvp2p_commit,
	.release_here = gpupin_nvp2p_release_here,
	.release = gpupin_nvp2p_release,
	.teardown = gpupin_nvp2p_teardown,
	.addrs = gpupin_nvp2p_addrs,
	.unmap_in_use = true,
};

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
	ret = pin->ops->acquire(pin, req->priv);
	/* -ENXIO: the memory went (free callback, revocation) while it was taken. */
	if (!ret)
		ret = gpupin_pin_mark_pinned(f, pin);
	if (ret) {
		/* Detached (put_pages failed): its callback gives the bytes back, not unreserve. */
		if (!gpupin_pin_release_pages(pin, GPUPIN_PIN_PINNING))
			atomic64_add(pin->aligned_size, &gpupin_pinned_bytes);
		gpupin_pin_unreserve(f, pin, ret);
		return ret;
	}
	req->fill(req->arg, pin);
	return gpupin_pin_publish(f, pin, req->uarg, req->arg, req->len);
}

/* PIN: copy in, validate, then a new nv-p2p pin (gpupin_pin_new). */
long gpupin_ioctl_pin(struct gpupin_file *f, struct gpupin_pin __user *uarg)
{
	struct gpupin_pin_req req;
	struct gpupin_pin arg;
	bool persistent;
	int ret;

	if (copy_from_user(&arg, uarg, sizeof(arg)))
		return -EFAULT;
	ret = gpupin_pin_validate(&arg);
	if (ret)
		return ret;
	if (!gpupin_caller_owns(f))
		return -EACCES;
	persistent = (arg.flags & GPUPIN_PIN_PERSISTENT) || READ_ONCE(gpupin_default_persistent);
	if (persistent && !(gpupin_caps & GPUPIN_CAP_PERSISTENT))
		return -EOPNOTSUPP;
#ifdef GPUPIN_NV_GET_PAGES_DOUBLE_FREE
	/* NVIDIA's get_pages with a callback can double-free here: main.c says why. */
	if (!persistent && !READ_ONCE(gpupin_nv_unsafe_get_pages))
		return -EOPNOTSUPP;
#endif
	req = (struct gpupin_pin_req) {
		.ops = &gpupin_nvp2p_backend,
		.va = arg.va,
		.size = arg.size,
		.aligned_va = arg.aligned_va,
		.aligned_size = arg.aligned_size,
		.user_tag = arg.user_tag,
		.page_shift = GPU_BOUND_SHIFT,
		/* Non-persistent pages come with a free callback: NVIDIA revokes them. */
		.flags = persistent ? GPUPIN_PIN_PERSISTENT : GPUPIN_PIN_REVOCABLE,
		.fill = gpupin_pin_fill,
		.arg = &arg,
		.len = sizeof(arg),
		.uarg = uarg,
	};
	return gpupin_pin_new(f, &req);
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
