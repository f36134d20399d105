// SPDX-License-Identifier: (GPL-2.0 OR MIT)
/*
 * gpupin: the detached pins, listed for introspection.
 *
 * A pin released where its pages cannot be put (pin.c: not the pinning
 * process) goes DETACHED: out of its file's handle table, but holding its
 * pages, its BAR space and its share of max_pinned_bytes until NVIDIA's
 * free callback.  This list is how the netlink dump still finds it, and how
 * GET_STATS counts it.
 *
 * A pin is on the list exactly while it holds its detached references (the
 * pin's own, its file's and the module's, pin.c): pin.c adds it in the same
 * pin->lock section that takes them, and the free callback takes it off
 * before it drops them.  So every pin on the list is alive, and so is its
 * file; a reader takes its own references under gpupin_detached_lock (see
 * gpupin.h) and uses the pin after dropping the lock.
 */
#include <linux/kref.h>
#include <linux/list.h>
#include <linux/spinlock.h>
#include "gpupin.h"

static DEFINE_SPINLOCK(gpupin_detached_lock);
static LIST_HEAD(gpupin_detached_list);	/* in detached_seq order */
static u64 gpupin_detached_seq;		/* last given; under the lock */
static u64 gpupin_detached_bytes;	/* their aligned sizes; under the lock */
static u64 gpupin_detached_count;	/* under the lock */

/* @pin just went DETACHED, with its references taken; caller holds pin->lock. */
void gpupin_detached_add(struct gpupin_pin_obj *pin)
{
	spin_lock(&gpupin_detached_lock);
	pin->detached_seq = ++gpupin_detached_seq;
	list_add_tail(&pin->detached_node, &gpupin_detached_list);
	gpupin_detached_bytes += pin->aligned_size;
	gpupin_detached_count++;
	spin_unlock(&gpupin_detached_lock);
}

/* The free callback releases the detached @pin: off the list, before its references go. */
void gpupin_detached_del(struct gpupin_pin_obj *pin)
{
	spin_lock(&gpupin_detached_lock);
	/* Every way into DETACHED lists the pin (gpupin_pin_hold_detached()). */
	if (!WARN_ON_ONCE(list_empty(&pin->detached_node))) {
		list_del_init(&pin->detached_node);
		gpupin_detached_bytes -= pin->aligned_size;
		gpupin_detached_count--;
	}
	spin_unlock(&gpupin_detached_lock);
}

/*
 * Up to @max detached pins listed after @seq (0: from the first), in list
 * order, into @pins, each with a reference to the pin and one to its file:
 * drop them with gpupin_detached_put().  Returns how many.
 */
unsigned int gpupin_detached_get(u64 seq, struct gpupin_pin_obj **pins, unsigned int max)
{
	struct gpupin_pin_obj *pin;
	unsigned int n = 0;

	spin_lock(&gpupin_detached_lock);
	list_for_each_entry(pin, &gpupin_detached_list, detached_node) {
		if (n == max)
			break;
		if (pin->detached_seq <= seq)
			continue;
		kref_get(&pin->ref);
		kref_get(&pin->file->ref);
		pins[n++] = pin;
	}
	spin_unlock(&gpupin_detached_lock);
	return n;
}

/* Drop what gpupin_detached_get() took for @pin; process context. */
void gpupin_detached_put(struct gpupin_pin_obj *pin)
{
	struct gpupin_file *f = pin->file;

	gpupin_pin_put(pin);
	gpupin_file_put(f);
}

/* How many pins are detached, and the bytes they hold (one consistent pair). */
void gpupin_detached_totals(u64 *count, u64 *bytes)
{
	spin_lock(&gpupin_detached_lock);
	*count = gpupin_detached_count;
	*bytes = gpupin_detached_bytes;
	spin_unlock(&gpupin_detached_lock);
}
