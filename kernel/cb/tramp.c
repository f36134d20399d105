// SPDX-License-Identifier: (GPL-2.0 OR MIT)
/*
 * gpupin_cb: the free callback gpupin.ko passes to nvidia_p2p_get_pages,
 * and the ids it passes as the callback's data.  A module of its own that
 * stays loaded.
 *
 * Why: NVIDIA's put_pages finds a mapping through the calling process's
 * registration, and an MPS client's teardown removes that registration
 * while the memory, and the armed callback, stay with the MPS server
 * (nv_p2p_put_pages turns the "not found" into 0).  gpupin cannot tell such
 * a put from one that released the pages, so it cannot hold itself loaded
 * for the callback.  Were the callback a function of gpupin.ko, the server
 * freeing the memory after gpupin.ko was unloaded would jump into freed
 * text.  Here it jumps into this module, which forwards the call to
 * gpupin.ko while that is loaded and otherwise counts it and returns.
 *
 * The ids live here too: a counter in gpupin.ko would start again at 1 when
 * it is loaded again, and a callback armed by the earlier gpupin.ko would
 * then carry the id of a newer pin.
 *
 * There is deliberately no module_exit: without one the kernel refuses to
 * unload the module (only a forced unload, CONFIG_MODULE_FORCE_UNLOAD and
 * rmmod -f, can), because NVIDIA may call gpupin_cb_free_callback at any
 * time for as long as its driver holds memory that gpupin ever pinned.
 *
 * Locking (gpupin.h lists it with gpupin.ko's locks):
 *   gpupin_cb_reg_lock (mutex) - serialises gpupin_cb_register() and
 *       gpupin_cb_unregister(), the only writers of gpupin_cb_current.
 *       Taken by gpupin.ko's module init and exit with no other lock held;
 *       the callback never takes it.  synchronize_rcu() runs after it is
 *       dropped.
 *   gpupin_cb_current (RCU) - the registered handler.  The callback reads
 *       it under rcu_read_lock() (inside NVIDIA's RM API lock) and takes a
 *       reference to its owner there; nothing is taken inside that read
 *       section, and the handler runs after it ends, holding only the module
 *       reference.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/atomic.h>
#include <linux/errno.h>
#include <linux/kernel.h>
#include <linux/module.h>
#include <linux/moduleparam.h>
#include <linux/mutex.h>
#include <linux/rcupdate.h>
#include "gpupin_cb.h"

static DEFINE_MUTEX(gpupin_cb_reg_lock);
static const struct gpupin_cb_handler __rcu *gpupin_cb_current;

/* Callbacks that found no handler, or one on its way out: nobody to tell. */
static atomic64_t gpupin_cb_orphaned = ATOMIC64_INIT(0);
/* The last id given; 0 is never one (gpupin: "no callback"). */
static atomic64_t gpupin_cb_last_id = ATOMIC64_INIT(0);

static int gpupin_cb_get_orphaned(char *buf, const struct kernel_param *kp)
{
	return scnprintf(buf, PAGE_SIZE, "%lld\n", (long long)atomic64_read(&gpupin_cb_orphaned));
}

static const struct kernel_param_ops gpupin_cb_orphaned_ops = {
	.get = gpupin_cb_get_orphaned,
};

module_param_cb(orphaned_callbacks, &gpupin_cb_orphaned_ops, NULL, 0444);
MODULE_PARM_DESC(orphaned_callbacks,
		 "free callbacks that came while gpupin was not loaded (read-only)");

static int gpupin_cb_get_last_id(char *buf, const struct kernel_param *kp)
{
	return scnprintf(buf, PAGE_SIZE, "%lld\n", (long long)atomic64_read(&gpupin_cb_last_id));
}

static const struct kernel_param_ops gpupin_cb_last_id_ops = {
	.get = gpupin_cb_get_last_id,
};

module_param_cb(last_id, &gpupin_cb_last_id_ops, NULL, 0444);
MODULE_PARM_DESC(last_id, "the last callback id given to gpupin (read-only)");

/*
 * The nv-p2p free callback, run by NVIDIA with its RM API lock held: call
 * the registered handler with @data, holding its module meanwhile.  With no
 * handler, or one whose module is being unloaded (try_module_get fails once
 * the unload has begun, so its exit is not raced), the callback is for a
 * pin that is gone with the module: count it and return.
 */
void gpupin_cb_free_callback(void *data)
{
	const struct gpupin_cb_handler *h;

	rcu_read_lock();
	h = rcu_dereference(gpupin_cb_current);
	if (h && !try_module_get(h->owner))
		h = NULL;
	rcu_read_unlock();
	if (!h) {
		atomic64_inc(&gpupin_cb_orphaned);
		pr_notice_ratelimited("free callback for id %lu with gpupin not loaded, ignored\n",
				      (unsigned long)data);
		return;
	}
	h->free_callback(data);
	module_put(h->owner);
}
EXPORT_SYMBOL_GPL(gpupin_cb_free_callback);

/*
 * A new callback id: counts up over 64 bits for as long as the machine
 * runs, whichever gpupin.ko asks, so never one given before.
 */
u64 gpupin_cb_new_id(void)
{
	return atomic64_inc_return(&gpupin_cb_last_id);
}
EXPORT_SYMBOL_GPL(gpupin_cb_new_id);

/* Make @h the handler; -EBUSY if another is registered. */
int gpupin_cb_register(const struct gpupin_cb_handler *h)
{
	int ret = 0;

	mutex_lock(&gpupin_cb_reg_lock);
	if (rcu_dereference_protected(gpupin_cb_current, lockdep_is_held(&gpupin_cb_reg_lock)))
		ret = -EBUSY;
	else
		rcu_assign_pointer(gpupin_cb_current, h);
	mutex_unlock(&gpupin_cb_reg_lock);
	return ret;
}
EXPORT_SYMBOL_GPL(gpupin_cb_register);

/*
 * Forget @h: when this returns, no callback can reach it any more, and none
 * is still reading it (a callback already in @h holds its owner, so its
 * module is not being unloaded).
 */
void gpupin_cb_unregister(const struct gpupin_cb_handler *h)
{
	const struct gpupin_cb_handler *cur;

	mutex_lock(&gpupin_cb_reg_lock);
	cur = rcu_dereference_protected(gpupin_cb_current, lockdep_is_held(&gpupin_cb_reg_lock));
	if (!WARN_ON(cur != h))
		RCU_INIT_POINTER(gpupin_cb_current, NULL);
	mutex_unlock(&gpupin_cb_reg_lock);
	synchronize_rcu();
}
EXPORT_SYMBOL_GPL(gpupin_cb_unregister);

static int __init gpupin_cb_init(void)
{
	return 0;
}

/* No module_exit on purpose: see the top of this file. */
module_init(gpupin_cb_init);

MODULE_LICENSE("Dual MIT/GPL");
MODULE_DESCRIPTION("gpupin's nv-p2p free callback entry point (stays loaded)");
MODULE_AUTHOR("gpupin developers");
