// SPDX-License-Identifier: (GPL-2.0 OR MIT)
/*
 * nvp2p_sim: use-after-free detection for simulated GPU memory.
 *
 * When the last reference to an allocation goes, its chunks are filled with
 * SIM_POISON and kept in a bounded FIFO quarantine instead of going back to
 * the page allocator.  A chunk leaving the quarantine (or checked by the
 * STATS ioctl, or at unload) must still be all poison: anything else means
 * someone - a peer driver's DMA, say - wrote to the memory after it was
 * freed, and is counted in poison_errors.  Reads after the free return the
 * poison, which tests look for.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/gfp.h>
#include <linux/list.h>
#include <linux/mm.h>
#include <linux/moduleparam.h>
#include <linux/mutex.h>
#include <linux/sched.h>
#include <linux/slab.h>
#include <linux/string.h>
#include "sim.h"

struct sim_quarantined {
	struct list_head node;		/* sim_quarantine, under sim_quarantine_lock */
	unsigned long nchunks;
	struct page **chunks;		/* owned */
};

/* Lock roles and order: see sim.h. */
static DEFINE_MUTEX(sim_quarantine_lock);
static LIST_HEAD(sim_quarantine);	/* oldest first, under sim_quarantine_lock */
static u64 sim_quarantine_bytes;	/* under sim_quarantine_lock */

static unsigned long sim_quarantine_max = 128UL << 20;
module_param_named(quarantine_bytes, sim_quarantine_max, ulong, 0644);
MODULE_PARM_DESC(quarantine_bytes, "Freed simulated memory kept poisoned to catch writes after free (default 128 MiB)");

/* Is every chunk of @q still poison?  Counts the chunks that are not. */
static unsigned long sim_quarantine_check(struct sim_quarantined *q)
{
	unsigned long i, bad = 0;

	for (i = 0; i < q->nchunks; i++) {
		if (memchr_inv(page_address(q->chunks[i]), SIM_POISON, SIM_PAGE_SIZE))
			bad++;
		cond_resched();
	}
	return bad;
}

static void sim_quarantine_count(unsigned long bad, s64 bytes)
{
	if (bad)
		pr_err_ratelimited("%lu freed 64 KiB chunks were written after the free\n", bad);
	spin_lock(&sim_lock);
	sim_stats.poison_errors += bad;
	sim_stats.quarantine_bytes += bytes;
	spin_unlock(&sim_lock);
}

static void sim_quarantine_release(struct sim_quarantined *q)
{
	unsigned long i;

	sim_quarantine_count(sim_quarantine_check(q), -(s64)(q->nchunks << SIM_PAGE_SHIFT));
	for (i = 0; i < q->nchunks; i++)
		__free_pages(q->chunks[i], SIM_CHUNK_ORDER);
	kvfree(q->chunks);
	kfree(q);
}

/* Evict the oldest entries while more than @max bytes are held. */
static void sim_quarantine_trim(u64 max)
{
	struct sim_quarantined *q;

	for (;;) {
		mutex_lock(&sim_quarantine_lock);
		q = list_first_entry_or_null(&sim_quarantine, struct sim_quarantined, node);
		if (q && sim_quarantine_bytes > max) {
			list_del(&q->node);
			sim_quarantine_bytes -= q->nchunks << SIM_PAGE_SHIFT;
		} else {
			q = NULL;
		}
		mutex_unlock(&sim_quarantine_lock);
		if (!q)
			return;
		sim_quarantine_release(q);
	}
}

/*
 * Take over the @nchunks chunks of a freed allocation (and the @chunks
 * array): poison them and quarantine them, or free them at once when they
 * do not fit.
 */
void sim_poison_free_chunks(struct page **chunks, unsigned long nchunks)
{
	struct sim_quarantined *q;
	unsigned long i;
	u64 bytes = (u64)nchunks << SIM_PAGE_SHIFT;

	q = bytes <= READ_ONCE(sim_quarantine_max) ? kzalloc(sizeof(*q), GFP_KERNEL) : NULL;
	if (!q) {	/* too big to hold: nothing to poison it for */
		kfree(q);
		for (i = 0; i < nchunks; i++)
			__free_pages(chunks[i], SIM_CHUNK_ORDER);
		kvfree(chunks);
		return;
	}
	for (i = 0; i < nchunks; i++) {
		memset(page_address(chunks[i]), SIM_POISON, SIM_PAGE_SIZE);
		cond_resched();
	}
	q->chunks = chunks;
	q->nchunks = nchunks;
	mutex_lock(&sim_quarantine_lock);
	list_add_tail(&q->node, &sim_quarantine);
	sim_quarantine_bytes += bytes;
	mutex_unlock(&sim_quarantine_lock);
	sim_quarantine_count(0, bytes);
	sim_quarantine_trim(READ_ONCE(sim_quarantine_max));
}

/* Check everything in quarantine now (the STATS ioctl). */
void sim_poison_check_all(void)
{
	struct sim_quarantined *q;
	unsigned long bad = 0;

	mutex_lock(&sim_quarantine_lock);
	list_for_each_entry(q, &sim_quarantine, node)
		bad += sim_quarantine_check(q);
	/* Count each bad chunk once: poison it again. */
	if (bad) {
		list_for_each_entry(q, &sim_quarantine, node) {
			unsigned long i;

			for (i = 0; i < q->nchunks; i++)
				memset(page_address(q->chunks[i]), SIM_POISON, SIM_PAGE_SIZE);
		}
	}
	mutex_unlock(&sim_quarantine_lock);
	sim_quarantine_count(bad, 0);
}

/* Module unload: check and free the whole quarantine. */
void sim_poison_exit(void)
{
	sim_quarantine_trim(0);
}
