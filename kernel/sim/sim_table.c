// SPDX-License-Identifier: (GPL-2.0 OR MIT)
/*
 * nvp2p_sim: page tables, their registry and the freed-table graveyard.
 *
 * Every table get_pages hands out is registered by its address, live or
 * freed.  When a callback returns, or put_pages finishes, the table and every
 * DMA mapping on it are freed as NVIDIA frees them: poisoned and kept in a
 * bounded graveyard, so that a later call passing them is caught
 * (use_after_free_calls).  So is the table a failed get_pages leaves
 * *page_table pointing to (sim_dangle_table).  Tables are laid out as
 * NVIDIA's, their DMA-mapping list head right after the version's members.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/bug.h>
#include <linux/hashtable.h>
#include <linux/list.h>
#include <linux/lockdep.h>
#include <linux/moduleparam.h>
#include <linux/pid.h>
#include <linux/sched.h>
#include <linux/sched/signal.h>
#include <linux/slab.h>
#include <linux/string.h>
#include "sim.h"

/* Every registered pin, live or freed, by the address of its page table; under sim_lock. */
DEFINE_HASHTABLE(sim_pins, SIM_PINS_BITS);
/* Freed pins (state FREED), oldest first; under sim_lock. */
static LIST_HEAD(sim_graveyard);
static unsigned int sim_nr_dead;	/* under sim_lock */

/*
 * Module parameters, writable at any time in /sys/module/nvp2p_sim/parameters/,
 * so read with READ_ONCE: what each table says of its pages, and how many
 * freed tables are kept.
 */
static struct {
	unsigned int page_size_type;
	unsigned int dead_tables_max;
} sim_table_knobs = {
	.page_size_type = NVIDIA_P2P_PAGE_SIZE_64KB,
	.dead_tables_max = 4096,
};

module_param_named(page_size_type, sim_table_knobs.page_size_type, uint, 0644);
MODULE_PARM_DESC(page_size_type, "Page size type written into page tables: 1 = 64 KiB (default; what every GPU gives); others test clients' checks, the memory stays in 64 KiB pages");
module_param_named(dead_tables_max, sim_table_knobs.dead_tables_max, uint, 0644);
MODULE_PARM_DESC(dead_tables_max, "Freed page tables kept poisoned to catch later calls that pass them (default 4096)");

struct sim_pin *sim_pin_lookup_locked(struct nvidia_p2p_page_table *pt)
{
	struct sim_pin *pin;

	lockdep_assert_held(&sim_lock);
	hash_for_each_possible(sim_pins, pin, hnode, (unsigned long)pt)
		if (pin->pt == pt)
			return pin;
	return NULL;
}

void sim_pin_put(struct sim_pin *pin)
{
	struct sim_map *map, *tmp;

	if (!refcount_dec_and_test(&pin->refs))
		return;
	if (pin->alloc)
		sim_alloc_put(pin->alloc);
	/* Only a freed pin is put for good: its mappings were buried. */
	list_for_each_entry_safe(map, tmp, &pin->maps, node)
		kfree(map);
	put_pid(pin->owner);
	kvfree(pin->pages);
	kvfree(pin->page_array);
	kfree(pin->pt);
	kfree(pin);
}

/*
 * Put the FREED @pin (registered by its table's address) at the graveyard's
 * tail; the oldest beyond dead_tables_max leave the registry and go on
 * @evicted, for sim_pin_put() once sim_lock is dropped.  Never @pin itself.
 */
static void sim_graveyard_add_locked(struct sim_pin *pin, struct list_head *evicted)
{
	struct sim_pin *old;

	lockdep_assert_held(&sim_lock);
	list_add_tail(&pin->node, &sim_graveyard);
	sim_nr_dead++;
	while (sim_nr_dead > READ_ONCE(sim_table_knobs.dead_tables_max)) {
		old = list_first_entry(&sim_graveyard, struct sim_pin, node);
		if (old == pin)
			break;
		list_move_tail(&old->node, evicted);
		hash_del(&old->hnode);
		sim_nr_dead--;
	}
}

static void sim_put_evicted(struct list_head *evicted)
{
	struct sim_pin *old, *next;

	list_for_each_entry_safe(old, next, evicted, node) {
		list_del_init(&old->node);
		sim_pin_put(old);
	}
}

/*
 * The page table of @pin is freed (its callback returned, or it was put):
 * uncount it and move it to the graveyard, still findable by its address.
 * Caller holds sim_lock; sim_pin_bury() finishes the job after unlocking.
 * Pins pushed out of the graveyard go on @evicted for sim_pin_put().
 */
void sim_pin_retire_locked(struct sim_pin *pin, struct list_head *evicted)
{
	struct sim_map *map;

	lockdep_assert_held(&sim_lock);
	list_for_each_entry(map, &pin->maps, node) {
		if (map->freed)
			continue;
		map->freed = true;
		sim_stats.dma_mappings--;
		/*
		 * After a callback NVIDIA frees what is left, as here: a client
		 * cannot free a mapping whose dma_map_pages returned just before
		 * the callback ran and that it had not listed yet.  A put with
		 * mappings left is the client's sloppiness.
		 */
		if (pin->state != SIM_PIN_CALLBACK)
			sim_stats.mappings_not_freed++;
	}
	list_del_init(&pin->node);
	pin->state = SIM_PIN_FREED;
	sim_stats.pinned_pages -= pin->pt->entries;
	sim_stats.bar_bytes -= pin->len;
	sim_stats.page_tables--;
	if (!pin->persistent)
		sim_stats.live_callbacks--;
	/* The caller buries it after unlocking: keep it until then (sim_pin_put). */
	refcount_inc(&pin->refs);
	sim_graveyard_add_locked(pin, evicted);
}

/*
 * After sim_pin_retire_locked(): release what the pin held and poison the
 * page table, so a client still reading it sees garbage (and a pages[]
 * pointer that faults), as it would read freed memory on a real host.
 */
void sim_pin_bury(struct sim_pin *pin, struct list_head *evicted)
{
	struct sim_map *map;

	/* Only this thread touches a FREED pin's maps and arrays. */
	list_for_each_entry(map, &pin->maps, node)
		sim_map_bury(map);
	kvfree(pin->pages);
	kvfree(pin->page_array);
	pin->pages = NULL;
	pin->page_array = NULL;
	memset(pin->pt, SIM_POISON, pin->pt_size);
	sim_alloc_put(pin->alloc);
	pin->alloc = NULL;
	sim_put_evicted(evicted);
}

/* Where the table of @version ends, so where the list head goes. */
static size_t sim_table_end(u32 version)
{
	if (NVIDIA_P2P_MAJOR_VERSION(version) >= 2)
		return sizeof(struct nvidia_p2p_page_table);
	if (NVIDIA_P2P_MAJOR_VERSION(version) == 1 && NVIDIA_P2P_MINOR_VERSION(version) >= 2)
		return offsetofend(struct nvidia_p2p_page_table, gpu_uuid);
	return ALIGN(offsetofend(struct nvidia_p2p_page_table, entries), sizeof(void *));
}

/* Fill the table of @pin for @version (it is zeroed, SIM_TABLE_ALLOC bytes). */
void sim_table_fill(struct sim_pin *pin, u32 version, u32 entries)
{
	size_t end = sim_table_end(version);
	struct list_head *head = (void *)pin->pt + end;

	pin->pt->version = version;
	pin->pt->page_size = READ_ONCE(sim_table_knobs.page_size_type);
	pin->pt->pages = pin->pages;
	pin->pt->entries = entries;
	if (end > offsetof(struct nvidia_p2p_page_table, gpu_uuid))
		pin->pt->gpu_uuid = sim_gpu_uuid;
	INIT_LIST_HEAD(head);	/* an empty mapping list, as NVIDIA's */
}

/*
 * reuse_freed_tables: give @pin the address of the most recently freed
 * non-persistent table of the same process (one for another range), as
 * NVIDIA's allocator may hand freed memory out again; its mappings are
 * found by pointer value, so a stale put_pages of the old table then hits
 * @pin.  Only a table that nobody but the graveyard holds is taken.  Returns
 * the dead pin, which now owns @pin's unused table; the caller puts it after
 * unlocking sim_lock.
 */
struct sim_pin *sim_reuse_table_locked(struct sim_pin *pin, u32 version, u32 entries)
{
	struct sim_pin *old;

	lockdep_assert_held(&sim_lock);
	list_for_each_entry_reverse(old, &sim_graveyard, node) {
		if (old->persistent || old->owner != pin->owner || old->va == pin->va ||
		    refcount_read(&old->refs) != 1)
			continue;
		list_del_init(&old->node);
		hash_del(&old->hnode);
		sim_nr_dead--;
		swap(pin->pt, old->pt);
		memset(pin->pt, 0, pin->pt_size);
		sim_table_fill(pin, version, entries);
		pin->table_reused = true;
		return old;
	}
	return NULL;
}

/*
 * A get_pages that failed once NVIDIA's nv_p2p_get_pages (nv-p2p.c) had
 * allocated its table: it points *page_table at the table first (before
 * calling RM), and on the way out frees the table without resetting the
 * pointer (only a failure after RM pinned resets it, through
 * nv_p2p_put_pages).  So the client is left a dangling pointer: here one
 * to a poisoned table in the graveyard, so that passing it on is caught as
 * a use after free, as any freed table's is.  NULL when even that table
 * cannot be allocated (NVIDIA's own first allocation failing: NULL too).
 */
void sim_dangle_table(struct nvidia_p2p_page_table **page_table, u64 va, bool persistent)
{
	struct sim_pin *pin;
	LIST_HEAD(evicted);

	*page_table = NULL;
	pin = kzalloc(sizeof(*pin), GFP_KERNEL);
	if (!pin)
		return;
	pin->pt_size = SIM_TABLE_ALLOC;
	pin->pt = kmalloc(pin->pt_size, GFP_KERNEL);
	if (!pin->pt) {
		kfree(pin);
		return;
	}
	memset(pin->pt, SIM_POISON, pin->pt_size);
	INIT_LIST_HEAD(&pin->node);
	INIT_LIST_HEAD(&pin->maps);
	init_completion(&pin->cb_done);
	refcount_set(&pin->refs, 1);	/* the registry's, kept by the graveyard */
	pin->va = va;
	pin->persistent = persistent;
	pin->owner = get_pid(task_tgid(current));
	spin_lock(&sim_lock);
	pin->state = SIM_PIN_FREED;
	hash_add(sim_pins, &pin->hnode, (unsigned long)pin->pt);
	sim_graveyard_add_locked(pin, &evicted);
	spin_unlock(&sim_lock);
	sim_put_evicted(&evicted);
	*page_table = pin->pt;
}

/* Only legal from inside the free callback, once per page table. */
int nvidia_p2p_free_page_table(struct nvidia_p2p_page_table *page_table)
{
	struct sim_pin *pin;
	int ret = -EINVAL;

	spin_lock(&sim_lock);
	pin = sim_pin_lookup_locked(page_table);
	if (pin && pin->state == SIM_PIN_FREED) {
		sim_count_uaf(__func__, "page table");
		spin_unlock(&sim_lock);
		return -EINVAL;
	}
	if (pin && pin->state == SIM_PIN_CALLBACK && !pin->table_freed) {
		pin->table_freed = true;
		ret = 0;
	}
	spin_unlock(&sim_lock);
	WARN_ONCE(ret, "%s outside the free callback or twice\n", __func__);
	return ret;
}
EXPORT_SYMBOL_GPL(nvidia_p2p_free_page_table);

/* Module unload: empty the graveyard. */
void sim_table_exit(void)
{
	struct sim_pin *pin, *tmp;
	LIST_HEAD(dead);

	spin_lock(&sim_lock);
	list_splice_init(&sim_graveyard, &dead);
	list_for_each_entry(pin, &dead, node)
		hash_del(&pin->hnode);
	sim_nr_dead = 0;
	spin_unlock(&sim_lock);
	list_for_each_entry_safe(pin, tmp, &dead, node) {
		list_del_init(&pin->node);
		sim_pin_put(pin);
	}
}
