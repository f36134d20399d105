// SPDX-License-Identifier: (GPL-2.0 OR MIT)
/*
 * nvp2p_sim: the nv-p2p kernel API over simulated GPU memory.
 *
 * Same names, prototypes and semantics as NVIDIA's driver, as strict as it
 * wherever a client can tell (see FIDELITY.md beside this file):
 * - 64 KiB pages, versioned page tables and DMA mappings, -EINVAL for
 *   unaligned or foreign ranges and for a missing free callback, -ENOMEM
 *   once the simulated BAR is full.
 * - get_pages and put_pages find the mapping in the calling process: a
 *   put_pages from another thread group (a fork child, a kworker, another
 *   process holding the fd) finds nothing, returns 0, releases nothing and
 *   leaves the free callback armed (puts_not_found).  So does one from the
 *   pinning process once its registration is gone (forget_owner: an MPS
 *   client's teardown), the callback staying armed with the client's data.
 * - Free callbacks run synchronously when the memory is freed, with the API
 *   lock held (sim_rmlock.c); get_pages, put_pages and dma_map_pages take
 *   that lock, dma_unmap_pages does not.
 * - When a callback returns, or put_pages finishes, the page table and every
 *   DMA mapping on it are freed: poisoned and kept in a bounded graveyard so
 *   that a later call passing them is caught (use_after_free_calls).  A
 *   later non-persistent put_pages is harmless (looked up, not found), as in
 *   NVIDIA's driver.  So is the table a failed get_pages leaves *page_table
 *   pointing to, as NVIDIA's does (sim_dangle_table).
 * Inside the callback, the calls that take the API lock fail with -EIO and a
 * WARN (it is not re-entrant), dma_unmap_pages works; a table the callback
 * did not free is counted.
 *
 * One feature a file, as netdevsim is split: this file the pin entry points
 * (get_pages, put_pages) and their knobs; sim_table.c the page tables, their
 * registry and graveyard; sim_bar.c the simulated BAR1; sim_callback.c the
 * free callbacks and the injected frees that run them; sim_owner.c the
 * calling process's registration (forget_owner); sim_dma.c the DMA
 * mappings; sim_topo.c NVIDIA's topology verdict (deny_peers).
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/completion.h>
#include <linux/delay.h>
#include <linux/export.h>
#include <linux/hashtable.h>
#include <linux/module.h>
#include <linux/pid.h>
#include <linux/random.h>
#include <linux/sched.h>
#include <linux/sched/signal.h>
#include <linux/slab.h>
#include <linux/workqueue.h>
#include "sim.h"

/*
 * The knobs of the pin entry points: module parameters, writable at any
 * time in /sys/module/nvp2p_sim/parameters/, so read with READ_ONCE.  The
 * other files keep their own (Documentation/simulator.md lists them).
 */
static struct {
	/* What get_pages hands out, and whether a freed table's address comes back. */
	unsigned int page_table_version;
	bool reuse_freed_tables;
	/* Delays that widen a client's race windows. */
	unsigned int pin_latency_us;
	unsigned int put_latency_us;
	/* Fault injection (sim_injected_error_locked) and forced races. */
	int fail_nth;
	int fail_put_nth;
	int fail_errno;
	bool race_get_pages;
	unsigned int race_get_pages_late_us;
	bool race_put_pages;
	bool free_before_register;
} sim_p2p_knobs = {
	.page_table_version = NVIDIA_P2P_PAGE_TABLE_VERSION,
	.fail_errno = ENOMEM,
};

module_param_named(page_table_version, sim_p2p_knobs.page_table_version, uint, 0644);
MODULE_PARM_DESC(page_table_version, "Page-table version and layout handed out: 0x00020000 (R580 on, default) or 0x00010002 (R535..R575: no flags member); others test clients' version checks");
module_param_named(reuse_freed_tables, sim_p2p_knobs.reuse_freed_tables, bool, 0644);
MODULE_PARM_DESC(reuse_freed_tables, "Hand a freed page table's address to the next get_pages of the same process, so that a stale put_pages hits that newer pin, as on NVIDIA's driver (counted in stale_table_puts; default off)");

module_param_named(pin_latency_us, sim_p2p_knobs.pin_latency_us, uint, 0644);
MODULE_PARM_DESC(pin_latency_us, "Extra latency of each get_pages call in microseconds (default 0)");
module_param_named(put_latency_us, sim_p2p_knobs.put_latency_us, uint, 0644);
MODULE_PARM_DESC(put_latency_us, "Delay between a put_pages call (either kind) and its taking the API lock, in microseconds: a free, its callback and another get_pages may run meanwhile, as while NVIDIA's put waits for its lock (default 0)");

module_param_named(fail_nth, sim_p2p_knobs.fail_nth, int, 0644);
MODULE_PARM_DESC(fail_nth, "Fail the Nth get_pages call from now with -fail_errno, then reset to 0 (0 = off)");
module_param_named(fail_put_nth, sim_p2p_knobs.fail_put_nth, int, 0644);
MODULE_PARM_DESC(fail_put_nth, "Fail the Nth put_pages (either kind) of a live table from now with -fail_errno, leaving it pinned and its callback armed, then reset to 0 (0 = off)");
module_param_named(fail_errno, sim_p2p_knobs.fail_errno, int, 0644);
MODULE_PARM_DESC(fail_errno, "Positive errno returned by the injected failure (default ENOMEM)");
module_param_named(race_get_pages, sim_p2p_knobs.race_get_pages, bool, 0644);
MODULE_PARM_DESC(race_get_pages, "Free the memory as each get_pages drops the API lock: its callback runs before get_pages returns (default off)");
module_param_named(race_get_pages_late_us, sim_p2p_knobs.race_get_pages_late_us, uint, 0644);
MODULE_PARM_DESC(race_get_pages_late_us, "Free the memory on another CPU a random 0 to N-1 microseconds after each non-persistent get_pages drops the API lock, while get_pages takes a random 0 to N-1 microseconds more to return (a preempted caller): the callback may run before get_pages returns, while the client takes the table or publishes the pin, or after (0 = off)");
module_param_named(race_put_pages, sim_p2p_knobs.race_put_pages, bool, 0644);
MODULE_PARM_DESC(race_put_pages, "Fire the free callback concurrently with every put_pages (default off)");
module_param_named(free_before_register, sim_p2p_knobs.free_before_register, bool, 0644);
MODULE_PARM_DESC(free_before_register, "Free the memory between each non-persistent get_pages' pinning and its callback registration: the mapping goes without a callback, get_pages fails -EINVAL with *page_table NULL, as on NVIDIA's driver (default off)");

/*
 * Fault injection: should this call fail?  @nth_param is the countdown
 * (fail_nth for get_pages, fail_put_nth, fail_dma_map_nth,
 * fail_attach_nth, fail_dmabuf_map_nth); the error is fail_errno's.  Caller holds sim_lock.
 */
int sim_injected_error_locked(int *nth_param)
{
	int nth = READ_ONCE(*nth_param);

	if (nth <= 0)
		return 0;
	WRITE_ONCE(*nth_param, nth - 1);
	if (nth > 1)
		return 0;
	nth = abs(READ_ONCE(sim_p2p_knobs.fail_errno));
	return nth >= 1 && nth <= MAX_ERRNO ? -nth : -EIO;
}

static int sim_get_pages(u64 va, u64 len, struct nvidia_p2p_page_table **page_table,
			 void (*free_callback)(void *data), void *data, bool persistent,
			 bool bad_tokens)
{
	struct sim_pin *pin, *dead = NULL;
	struct sim_alloc *alloc;
	bool race = false, unregistered = false, late = false;
	unsigned int late_us;
	LIST_HEAD(evicted);
	u32 entries, version, i;
	int err;

	/* NVIDIA returns these before it touches *page_table. */
	if (!page_table || (!persistent && !free_callback))
		return -EINVAL;
	if ((va | len) & (SIM_PAGE_SIZE - 1))
		return -EINVAL;
	/* RM refuses these: *page_table is left dangling (sim_dangle_table). */
	if (bad_tokens || !len || va + len < va || len > BIT_ULL(SIM_CTX_SHIFT)) {
		sim_dangle_table(page_table, va, persistent);
		return -EINVAL;
	}
	if (READ_ONCE(sim_p2p_knobs.pin_latency_us))
		fsleep(READ_ONCE(sim_p2p_knobs.pin_latency_us));

	entries = len >> SIM_PAGE_SHIFT;
	version = READ_ONCE(sim_p2p_knobs.page_table_version);
	pin = kzalloc(sizeof(*pin), GFP_KERNEL);
	if (!pin) {
		*page_table = NULL;	/* as NVIDIA when its first allocation fails */
		return -ENOMEM;
	}
	pin->pt_size = SIM_TABLE_ALLOC;
	pin->pt = kzalloc(pin->pt_size, GFP_KERNEL);
	pin->page_array = kvcalloc(entries, sizeof(*pin->page_array), GFP_KERNEL);
	pin->pages = kvcalloc(entries, sizeof(*pin->pages), GFP_KERNEL);
	if (!pin->pt || !pin->page_array || !pin->pages) {
		err = -ENOMEM;
		goto err_free;
	}
	for (i = 0; i < entries; i++)
		pin->pages[i] = &pin->page_array[i];
	INIT_LIST_HEAD(&pin->node);
	INIT_LIST_HEAD(&pin->maps);
	INIT_WORK(&pin->race_work, sim_race_work);
	init_completion(&pin->cb_done);
	refcount_set(&pin->refs, 1);
	pin->va = va;
	pin->len = len;
	pin->persistent = persistent;
	pin->free_callback = free_callback;
	pin->data = data;
	pin->owner = get_pid(task_tgid(current));
	sim_table_fill(pin, version, entries);

	err = sim_api_lock(__func__);
	if (err)
		goto err_free;
	spin_lock(&sim_lock);
	sim_stats.get_pages_calls++;
	err = sim_injected_error_locked(&sim_p2p_knobs.fail_nth);
	if (err)
		goto err_unlock;
	alloc = sim_find_alloc_locked(va, len, &err);
	if (!alloc)
		goto err_unlock;
	if (!sim_bar_space_locked(len)) {
		err = -ENOMEM;
		goto err_unlock;
	}
	kref_get(&alloc->ref);
	pin->alloc = alloc;
	pin->bar_start = READ_ONCE(sim_bar_start);
	pin->bar_len = READ_ONCE(sim_bar_len);
	for (i = 0; i < entries; i++)
		pin->page_array[i].physical_address = sim_page_phys(pin, i);
	if (!persistent) {
		list_add_tail(&pin->node, &alloc->pins);
		sim_stats.live_callbacks++;
		if (READ_ONCE(sim_p2p_knobs.reuse_freed_tables))
			dead = sim_reuse_table_locked(pin, version, entries);
	}
	hash_add(sim_pins, &pin->hnode, (unsigned long)pin->pt);
	pin->state = SIM_PIN_LIVE;
	sim_stats.pinned_pages += entries;
	sim_stats.bar_bytes += len;
	sim_stats.page_tables++;
	*page_table = pin->pt;
	late_us = READ_ONCE(sim_p2p_knobs.race_get_pages_late_us);
	if (!persistent && READ_ONCE(sim_p2p_knobs.free_before_register)) {
		/*
		 * NVIDIA's nv_p2p_get_pages (nv-p2p.c) pins through
		 * rm_p2p_get_pages and arms the callback through
		 * rm_p2p_register_callback, taking the API lock for each.
		 * A free in between (CliDelThirdPartyP2PVidmemInfo,
		 * third_party_p2p.c) deletes the mapping without a callback,
		 * releasing its BAR1; RmP2PRegisterCallback (p2p.c) then
		 * finds nothing (-EINVAL), the failure path's put_pages finds
		 * nothing either and sets *page_table to NULL.  NVIDIA leaks
		 * its table there; here it goes to the graveyard.  As with
		 * race_get_pages, the allocation itself stays.
		 */
		sim_pin_retire_locked(pin, &evicted);
		*page_table = NULL;
		unregistered = true;
	} else if (!persistent && READ_ONCE(sim_p2p_knobs.race_get_pages)) {
		/* The memory is freed as soon as the API lock drops. */
		pin->state = SIM_PIN_CALLBACK;
		list_del_init(&pin->node);
		refcount_inc(&pin->refs);
		queue_work(sim_race_wq, &pin->race_work);
		race = true;
	} else if (!persistent && late_us) {
		/*
		 * Freed on another CPU, a little later: the callback meets
		 * the client anywhere between here and well after get_pages
		 * returned.  The registry's reference carries the pin to the
		 * callback; a put meanwhile finds it CALLBACK and waits.
		 */
		pin->state = SIM_PIN_CALLBACK;
		list_del_init(&pin->node);
		pin->race_delay_us = get_random_u32() % late_us;
		queue_work(sim_race_wq, &pin->race_work);
		late = true;
	}
	spin_unlock(&sim_lock);
	sim_api_unlock();
	if (dead)
		sim_pin_put(dead);
	if (unregistered) {
		sim_pin_bury(pin, &evicted);
		sim_pin_put(pin);
		return -EINVAL;
	}
	if (late)
		fsleep(get_random_u32() % late_us);	/* preempted on the way out */
	if (race) {
		/* Return only once the callback ran: the worst case for the client. */
		wait_for_completion(&pin->cb_done);
		sim_pin_put(pin);
	}
	return 0;

err_unlock:
	spin_unlock(&sim_lock);
	sim_api_unlock();
err_free:
	put_pid(pin->owner);
	kvfree(pin->pages);
	kvfree(pin->page_array);
	kfree(pin->pt);
	kfree(pin);
	sim_dangle_table(page_table, va, persistent);
	return err;
}

int nvidia_p2p_get_pages(u64 p2p_token, u32 va_space_token, u64 virtual_address,
			 u64 length, struct nvidia_p2p_page_table **page_table,
			 void (*free_callback)(void *data), void *data)
{
	/* Tokens are unused since CUDA 6.0 (only the owning process may pin): RM refuses others. */
	return sim_get_pages(virtual_address, length, page_table, free_callback,
			     data, false, p2p_token || va_space_token);
}
EXPORT_SYMBOL_GPL(nvidia_p2p_get_pages);

int nvidia_p2p_get_pages_persistent(u64 virtual_address, u64 length,
				    struct nvidia_p2p_page_table **page_table,
				    u32 flags)
{
	if (flags)
		return -EINVAL;
	return sim_get_pages(virtual_address, length, page_table, NULL, NULL, true, false);
}
EXPORT_SYMBOL_GPL(nvidia_p2p_get_pages_persistent);

static int sim_put_pages(u64 va, struct nvidia_p2p_page_table *pt, bool persistent)
{
	const char *fn = persistent ? "nvidia_p2p_put_pages_persistent" : "nvidia_p2p_put_pages";
	LIST_HEAD(evicted);
	struct sim_pin *pin;
	int ret;

	/* nvidia_p2p_put_pages{,_persistent}: a NULL table is nothing to put. */
	if (!pt)
		return 0;
	/*
	 * put_latency_us: rm_p2p_put_pages (osapi.c) waits for the API lock,
	 * as long as a free and its callback hold it; nv_p2p_get_pages
	 * allocates its table before it takes that lock, so it may be handed
	 * this very table's address once the callback freed it.
	 */
	if (READ_ONCE(sim_p2p_knobs.put_latency_us))
		fsleep(READ_ONCE(sim_p2p_knobs.put_latency_us));
	ret = sim_api_lock(fn);
	if (ret)
		return ret;
	spin_lock(&sim_lock);
	pin = sim_pin_lookup_locked(pt);
	/*
	 * A freed table, or one never handed out (or out of the graveyard):
	 * RmP2PPutPages (p2p.c) looks a non-persistent one up by its pointer
	 * value among the process's, finds nothing, and nv_p2p_put_pages
	 * (nv-p2p.c) turns NV_ERR_OBJECT_NOT_FOUND into 0.  A persistent one is
	 * read through container_of (its gpu_uuid, mem_info->private): a use
	 * after free.
	 */
	if (!pin || pin->state == SIM_PIN_FREED) {
		if (persistent)
			sim_count_uaf(fn, pin ? "page table" :
				      "page table it never handed out (or long freed)");
		ret = persistent ? -EINVAL : 0;
		goto out_unlock;
	}
	/*
	 * A put of the other kind.  nv_p2p_put_pages (nv-p2p.c) hands a
	 * persistent put to RmP2PPutPagesPersistent, which dereferences the
	 * table's mem_info->private - NULL for a non-persistent table - under
	 * the API lock: an oops.  A non-persistent put of a persistent table
	 * looks among the process's mappings (RmP2PGetInfoWithoutToken),
	 * finds nothing, returns 0 and the pin leaks.  Both are counted
	 * (strict); the first gets -EINVAL here instead of the oops.  A
	 * persistent put's address is not used (the table is the key).
	 */
	if (pin->persistent != persistent) {
		sim_count_misuse(&sim_stats.put_kind_mismatches, persistent ?
				 "persistent put of a non-persistent table (NVIDIA: NULL deref)" :
				 "put_pages of a persistent table (NVIDIA: 0, the pin leaks)");
		ret = persistent ? -EINVAL : 0;
		goto out_unlock;
	}
	if (!sim_put_finds_locked(pin, persistent)) {
		/* Another process's put is the client's bug; a pruned registration is not. */
		if (!pin->forgotten)
			sim_stats.puts_not_found++;
		ret = persistent ? -EINVAL : 0;
		goto out_unlock;
	}
	/*
	 * fail_put_nth: RM refused the put (rm_p2p_put_pages failing otherwise
	 * than with NV_ERR_OBJECT_NOT_FOUND): nv_p2p_put_pages returns the
	 * error, the pages stay pinned and the callback stays armed.
	 */
	ret = sim_injected_error_locked(&sim_p2p_knobs.fail_put_nth);
	if (ret)
		goto out_unlock;
	/*
	 * A freed table's address that a newer pin of this process got
	 * (reuse_freed_tables), put for the old range: NVIDIA finds the newer
	 * pin by the pointer and releases it.  So does this, and counts it.
	 */
	if (pin->table_reused && pin->va != va)
		sim_count_misuse(&sim_stats.stale_table_puts,
				 "put_pages of a freed page table released a newer pin at the same address");
	if (pin->state == SIM_PIN_LIVE && !persistent && READ_ONCE(sim_p2p_knobs.race_put_pages)) {
		/* Free the memory "now", on another CPU, as put_pages runs. */
		pin->state = SIM_PIN_CALLBACK;
		list_del_init(&pin->node);
		queue_work(sim_race_wq, &pin->race_work);
	}
	if (pin->state == SIM_PIN_CALLBACK) {
		/* The callback holds the API lock in the real driver: wait it out. */
		refcount_inc(&pin->refs);
		spin_unlock(&sim_lock);
		sim_api_unlock();
		wait_for_completion(&pin->cb_done);
		sim_pin_put(pin);
		return 0;
	}
	if (!list_empty(&pin->maps))
		pr_warn_ratelimited("put_pages with DMA mappings still present\n");
	pin->freed_by_put = true;
	sim_pin_retire_locked(pin, &evicted);
	spin_unlock(&sim_lock);
	sim_api_unlock();
	sim_pin_bury(pin, &evicted);
	sim_pin_put(pin);
	return 0;

out_unlock:
	spin_unlock(&sim_lock);
	sim_api_unlock();
	return ret;
}

int nvidia_p2p_put_pages(u64 p2p_token, u32 va_space_token, u64 virtual_address,
			 struct nvidia_p2p_page_table *page_table)
{
	if (p2p_token || va_space_token)
		return -EINVAL;
	return sim_put_pages(virtual_address, page_table, false);
}
EXPORT_SYMBOL_GPL(nvidia_p2p_put_pages);

int nvidia_p2p_put_pages_persistent(u64 virtual_address,
				    struct nvidia_p2p_page_table *page_table,
				    u32 flags)
{
	if (flags)
		return -EINVAL;
	return sim_put_pages(virtual_address, page_table, true);
}
EXPORT_SYMBOL_GPL(nvidia_p2p_put_pages_persistent);

int sim_p2p_init(void)
{
	return sim_callback_init();
}

/* Module unload: no forced free left running, then empty the graveyard. */
void sim_p2p_exit(void)
{
	sim_callback_exit();
	sim_table_exit();
}
