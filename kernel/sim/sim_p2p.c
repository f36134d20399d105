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
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/delay.h>
#include <linux/dma-mapping.h>
#include <linux/export.h>
#include <linux/hashtable.h>
#include <linux/module.h>
#include <linux/pci.h>
#include <linux/random.h>
#include <linux/sched.h>
#include <linux/slab.h>
#include <linux/workqueue.h>
#include "sim.h"

/* Every registered pin, live or freed, by the address of its page table; under sim_lock. */
static DEFINE_HASHTABLE(sim_pins, 10);
/* Freed pins (state FREED), oldest first; under sim_lock. */
static LIST_HEAD(sim_graveyard);
static unsigned int sim_nr_dead;	/* under sim_lock */

/*
 * The knobs of the nv-p2p entry points: module parameters, writable at any
 * time in /sys/module/nvp2p_sim/parameters/, so read with READ_ONCE.
 * bar_device, with its own setter, is further down.
 */
static struct {
	/* What get_pages and dma_map_pages hand out, and how much. */
	unsigned int page_table_version;
	unsigned int page_size_type;
	unsigned int dma_mapping_version;
	unsigned long bar_size;
	/* Freed page tables: how many are kept, whether an address comes back. */
	unsigned int dead_tables_max;
	bool reuse_freed_tables;
	/* Delays that widen a client's race windows. */
	unsigned int pin_latency_us;
	unsigned int put_latency_us;
	unsigned int dma_map_latency_us;
	unsigned int unmap_latency_us;
	/* Fault injection (sim_injected_error_locked) and forced races. */
	int fail_nth;
	int fail_put_nth;
	int fail_dma_map_nth;
	int fail_errno;
	bool race_get_pages;
	unsigned int race_get_pages_late_us;
	bool race_put_pages;
	bool callback_twice;
	bool free_before_register;
} sim_p2p_knobs = {
	.page_table_version = NVIDIA_P2P_PAGE_TABLE_VERSION,
	.page_size_type = NVIDIA_P2P_PAGE_SIZE_64KB,
	.dma_mapping_version = NVIDIA_P2P_DMA_MAPPING_VERSION,
	.bar_size = 256UL << 20,
	.dead_tables_max = 4096,
	.fail_errno = ENOMEM,
};

module_param_named(page_table_version, sim_p2p_knobs.page_table_version, uint, 0644);
MODULE_PARM_DESC(page_table_version, "Page-table version and layout handed out: 0x00020000 (R580 on, default) or 0x00010002 (R535..R575: no flags member); others test clients' version checks");
module_param_named(page_size_type, sim_p2p_knobs.page_size_type, uint, 0644);
MODULE_PARM_DESC(page_size_type, "Page size type written into page tables: 1 = 64 KiB (default; what every GPU gives); others test clients' checks, the memory stays in 64 KiB pages");
module_param_named(dma_mapping_version, sim_p2p_knobs.dma_mapping_version, uint, 0644);
MODULE_PARM_DESC(dma_mapping_version, "DMA-mapping version handed out by dma_map_pages (default 0x00020003); others test clients' version checks");
module_param_named(bar_size, sim_p2p_knobs.bar_size, ulong, 0644);
MODULE_PARM_DESC(bar_size, "Simulated BAR1 size in bytes; a pin fails with -ENOMEM unless 36 MiB of it stay free after the pin, as on NVIDIA's driver (default 256 MiB)");

module_param_named(dead_tables_max, sim_p2p_knobs.dead_tables_max, uint, 0644);
MODULE_PARM_DESC(dead_tables_max, "Freed page tables kept poisoned to catch later calls that pass them (default 4096)");
module_param_named(reuse_freed_tables, sim_p2p_knobs.reuse_freed_tables, bool, 0644);
MODULE_PARM_DESC(reuse_freed_tables, "Hand a freed page table's address to the next get_pages of the same process, so that a stale put_pages hits that newer pin, as on NVIDIA's driver (counted in stale_table_puts; default off)");

module_param_named(pin_latency_us, sim_p2p_knobs.pin_latency_us, uint, 0644);
MODULE_PARM_DESC(pin_latency_us, "Extra latency of each get_pages call in microseconds (default 0)");
module_param_named(put_latency_us, sim_p2p_knobs.put_latency_us, uint, 0644);
MODULE_PARM_DESC(put_latency_us, "Delay between a put_pages call (either kind) and its taking the API lock, in microseconds: a free, its callback and another get_pages may run meanwhile, as while NVIDIA's put waits for its lock (default 0)");
module_param_named(dma_map_latency_us, sim_p2p_knobs.dma_map_latency_us, uint, 0644);
MODULE_PARM_DESC(dma_map_latency_us, "Delay between dma_map_pages reading the table and taking the API lock, in microseconds (default 0)");
module_param_named(unmap_latency_us, sim_p2p_knobs.unmap_latency_us, uint, 0644);
MODULE_PARM_DESC(unmap_latency_us, "Delay before dma_unmap_pages reads the table, in microseconds (default 0)");

module_param_named(fail_nth, sim_p2p_knobs.fail_nth, int, 0644);
MODULE_PARM_DESC(fail_nth, "Fail the Nth get_pages call from now with -fail_errno, then reset to 0 (0 = off)");
module_param_named(fail_put_nth, sim_p2p_knobs.fail_put_nth, int, 0644);
MODULE_PARM_DESC(fail_put_nth, "Fail the Nth put_pages (either kind) of a live table from now with -fail_errno, leaving it pinned and its callback armed, then reset to 0 (0 = off)");
module_param_named(fail_dma_map_nth, sim_p2p_knobs.fail_dma_map_nth, int, 0644);
MODULE_PARM_DESC(fail_dma_map_nth, "Fail the Nth dma_map_pages call from now with -fail_errno, then reset to 0 (0 = off)");
module_param_named(fail_errno, sim_p2p_knobs.fail_errno, int, 0644);
MODULE_PARM_DESC(fail_errno, "Positive errno returned by the injected failure (default ENOMEM)");
module_param_named(race_get_pages, sim_p2p_knobs.race_get_pages, bool, 0644);
MODULE_PARM_DESC(race_get_pages, "Free the memory as each get_pages drops the API lock: its callback runs before get_pages returns (default off)");
module_param_named(race_get_pages_late_us, sim_p2p_knobs.race_get_pages_late_us, uint, 0644);
MODULE_PARM_DESC(race_get_pages_late_us, "Free the memory on another CPU a random 0 to N-1 microseconds after each non-persistent get_pages drops the API lock, while get_pages takes a random 0 to N-1 microseconds more to return (a preempted caller): the callback may run before get_pages returns, while the client takes the table or publishes the pin, or after (0 = off)");
module_param_named(race_put_pages, sim_p2p_knobs.race_put_pages, bool, 0644);
MODULE_PARM_DESC(race_put_pages, "Fire the free callback concurrently with every put_pages (default off)");
module_param_named(callback_twice, sim_p2p_knobs.callback_twice, bool, 0644);
MODULE_PARM_DESC(callback_twice, "Run every free callback a second time with the same data once its table was freed: a client must find nothing then (default off)");
module_param_named(free_before_register, sim_p2p_knobs.free_before_register, bool, 0644);
MODULE_PARM_DESC(free_before_register, "Free the memory between each non-persistent get_pages' pinning and its callback registration: the mapping goes without a callback, get_pages fails -EINVAL with *page_table NULL, as on NVIDIA's driver (default off)");

/*
 * BAR1 that pins may not take: NVIDIA's CLI_THIRD_PARTY_P2P_BAR1_RESERVE
 * (36 MiB, g_third_party_p2p_nvoc.h), checked by
 * _isSpaceAvailableForBar1P2PMapping (src/nvidia/src/kernel/gpu/bus/p2p.c)
 * before each new mapping: free bytes >= reserve + length.
 */
#define SIM_BAR1_RESERVE (36ULL << 20)

/* Does a pin of @len fit in the simulated BAR1?  Under sim_lock. */
static bool sim_bar_space_locked(u64 len)
{
	u64 size = READ_ONCE(sim_p2p_knobs.bar_size);

	lockdep_assert_held(&sim_lock);
	/* NVIDIA refuses too when more is mapped than the BAR holds (the size went down). */
	if (size < sim_stats.bar_bytes)
		return false;
	return size - sim_stats.bar_bytes >= SIM_BAR1_RESERVE + len;
}

/* For the load message (sim_main.c). */
unsigned long sim_bar_size(void)
{
	return READ_ONCE(sim_p2p_knobs.bar_size);
}

static struct sim_pin *sim_pin_lookup_locked(struct nvidia_p2p_page_table *pt)
{
	struct sim_pin *pin;

	lockdep_assert_held(&sim_lock);
	hash_for_each_possible(sim_pins, pin, hnode, (unsigned long)pt)
		if (pin->pt == pt)
			return pin;
	return NULL;
}

static void sim_map_free(struct sim_map *map)
{
	kvfree(map->m.dma_addresses);
	kfree(map);
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

static struct page *sim_pin_chunk(struct sim_pin *pin, u32 i)
{
	struct sim_alloc *alloc = pin->alloc;

	return alloc->chunks[((pin->va - alloc->va) >> SIM_PAGE_SHIFT) + i];
}

/*
 * bar_device: page tables give addresses inside a PCI device's memory BAR,
 * as a discrete GPU's do (its BAR1), instead of the host pages' own: so a
 * client's handling of MMIO pages (dma_map_resource, finding the BAR, a
 * CPU copy through ioremap_wc) runs.  The simulated memory stays the host
 * pages: these addresses reach the device's own memory instead, shared by
 * pages whose addresses wrap onto one slot.  Set it with nothing pinned.
 */
static char sim_bar_device[16];
static u64 sim_bar_start, sim_bar_len;	/* of bar_device; len 0: off */
static DEFINE_MUTEX(sim_bar_lock);	/* serialises bar_device's writers */

static int sim_bar_device_set(const char *val, const struct kernel_param *kp)
{
	unsigned int dom, bus, slot, fn;
	struct resource *best = NULL;
	struct pci_dev *pdev;
	char buf[16];
	u64 start, len;
	int i;

	strscpy(buf, val, sizeof(buf));
	strim(buf);
	mutex_lock(&sim_bar_lock);
	WRITE_ONCE(sim_bar_len, 0);
	sim_bar_device[0] = 0;
	mutex_unlock(&sim_bar_lock);
	if (!buf[0])
		return 0;
	if (sscanf(buf, "%x:%x:%x.%x", &dom, &bus, &slot, &fn) != 4 || slot > 0x1f || fn > 7)
		return -EINVAL;
	pdev = pci_get_domain_bus_and_slot(dom, bus, PCI_DEVFN(slot, fn));
	if (!pdev)
		return -ENODEV;
	for (i = 0; i < PCI_STD_NUM_BARS; i++) {
		struct resource *res = &pdev->resource[i];

		if (resource_type(res) == IORESOURCE_MEM &&
		    (!best || resource_size(res) > resource_size(best)))
			best = res;
	}
	start = best ? ALIGN(best->start, SIM_PAGE_SIZE) : 0;
	len = best && best->end + 1 > start ? (best->end + 1 - start) & ~(SIM_PAGE_SIZE - 1) : 0;
	pci_dev_put(pdev);
	if (!len)
		return -EINVAL;	/* no memory BAR of 64 KiB */
	mutex_lock(&sim_bar_lock);
	WRITE_ONCE(sim_bar_start, start);
	WRITE_ONCE(sim_bar_len, len);
	strscpy(sim_bar_device, buf, sizeof(sim_bar_device));
	mutex_unlock(&sim_bar_lock);
	return 0;
}

static int sim_bar_device_get(char *buf, const struct kernel_param *kp)
{
	int n;

	mutex_lock(&sim_bar_lock);
	n = sysfs_emit(buf, "%s\n", sim_bar_device);
	mutex_unlock(&sim_bar_lock);
	return n;
}

static const struct kernel_param_ops sim_bar_device_ops = {
	.set = sim_bar_device_set,
	.get = sim_bar_device_get,
};
module_param_cb(bar_device, &sim_bar_device_ops, NULL, 0644);
MODULE_PARM_DESC(bar_device, "PCI device (DDDD:BB:DD.F) whose largest memory BAR page tables point into, as a GPU's BAR1 pages do (the memory stays host pages); empty: host page addresses (default)");

/* The address page @i of @pin is reported at. */
static u64 sim_page_phys(struct sim_pin *pin, u32 i)
{
	struct page *chunk = sim_pin_chunk(pin, i);
	u64 slots = pin->bar_len >> SIM_PAGE_SHIFT;

	if (!slots)
		return page_to_phys(chunk);
	slots = (page_to_pfn(chunk) >> SIM_CHUNK_ORDER) % slots;
	return pin->bar_start + (slots << SIM_PAGE_SHIFT);
}

/* Undo the IOMMU mappings of @map (its descriptor stays). */
static void sim_map_unmap(struct sim_map *map)
{
	u32 i;

	for (i = 0; i < map->m.entries; i++) {
		if (map->pin->bar_len)
			dma_unmap_resource(map->dev, map->m.dma_addresses[i], SIM_PAGE_SIZE,
					   DMA_BIDIRECTIONAL, 0);
		else
			dma_unmap_page(map->dev, map->m.dma_addresses[i], SIM_PAGE_SIZE,
				       DMA_BIDIRECTIONAL);
	}
}

/* Free @map as NVIDIA does: unmapped, poisoned, kept with its pin. */
static void sim_map_bury(struct sim_map *map)
{
	sim_map_unmap(map);
	kvfree(map->m.dma_addresses);
	memset(&map->m, SIM_POISON, sizeof(map->m));
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
	while (sim_nr_dead > READ_ONCE(sim_p2p_knobs.dead_tables_max)) {
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
static void sim_pin_retire_locked(struct sim_pin *pin, struct list_head *evicted)
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
static void sim_pin_bury(struct sim_pin *pin, struct list_head *evicted)
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

/*
 * A client module is going away: any callback it left armed would jump into
 * freed text on a real host.  Count each now; such a callback is not run.
 */
static int sim_module_going(struct notifier_block *nb, unsigned long action, void *data)
{
	struct module *mod = data;
	struct sim_pin *pin;
	unsigned int bkt;

	if (action != MODULE_STATE_GOING)
		return NOTIFY_DONE;
	spin_lock(&sim_lock);
	hash_for_each(sim_pins, bkt, pin, hnode) {
		if (pin->persistent || pin->state == SIM_PIN_FREED || pin->cb_unloaded ||
		    !within_module((unsigned long)pin->free_callback, mod))
			continue;
		pin->cb_unloaded = true;
		sim_count_uaf("module unload", "free callback still armed in the unloaded module");
	}
	spin_unlock(&sim_lock);
	return NOTIFY_DONE;
}

static struct notifier_block sim_module_nb = {
	.notifier_call = sim_module_going,
};

/* Run one claimed pin's callback and free its table; API lock held. */
static void sim_run_callback(struct sim_pin *pin)
{
	LIST_HEAD(evicted);

	lockdep_assert_held(&sim_big_lock);
	if (!READ_ONCE(pin->cb_unloaded)) {
		pin->cb_task = current;
		sim_watchdog_arm(pin->free_callback);
		pin->free_callback(pin->data);
		sim_watchdog_disarm();
		pin->cb_task = NULL;
	} else {
		/* Counted at the unload: on a real host this jumps into freed text. */
		pin->table_freed = true;
	}

	spin_lock(&sim_lock);
	/*
	 * A client whose registration was dropped (forget_owner) may have
	 * released its pin and cannot free the table: on the drivers with
	 * that lookup, nvidia_p2p_free_page_table is a no-op and the driver
	 * frees it (nv_p2p_mem_info_free_callback).
	 */
	if (!pin->table_freed && !pin->forgotten)
		sim_stats.tables_not_freed++;
	sim_stats.callbacks_run++;
	sim_pin_retire_locked(pin, &evicted);
	spin_unlock(&sim_lock);
	sim_pin_bury(pin, &evicted);
	/*
	 * callback_twice: the same data again, the table gone.  NVIDIA runs a
	 * registration's callback once, but a client keyed by its data meets
	 * a repeat whenever two registrations share it; it must find nothing.
	 */
	if (READ_ONCE(sim_p2p_knobs.callback_twice) && !READ_ONCE(pin->cb_unloaded)) {
		sim_watchdog_arm(pin->free_callback);
		pin->free_callback(pin->data);
		sim_watchdog_disarm();
	}
	/* The registry's reference stays with the graveyard. */
	complete_all(&pin->cb_done);
	sim_pin_put(pin);
}

/* Run the callbacks of pins claimed (state CALLBACK) on list @claimed. */
void sim_run_callbacks(struct list_head *claimed)
{
	struct sim_pin *pin, *tmp;

	list_for_each_entry_safe(pin, tmp, claimed, node) {
		list_del_init(&pin->node);
		sim_run_callback(pin);
	}
}

/*
 * The forced frees run here, not on a system workqueue: the module's exit
 * drains it, so no work is left in this module's text (race_get_pages_late_us
 * waits for nobody).
 */
static struct workqueue_struct *sim_race_wq;

/* The memory is freed "on another CPU" (race_put_pages, race_get_pages*). */
static void sim_race_work(struct work_struct *work)
{
	struct sim_pin *pin = container_of(work, struct sim_pin, race_work);

	if (pin->race_delay_us)
		fsleep(pin->race_delay_us);
	/* The waiter must not lose the callback: wait as long as it takes. */
	while (sim_api_lock("free (injected race)"))
		;
	sim_run_callback(pin);
	sim_api_unlock();
}

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

/*
 * NVIDIA embeds the page table in struct nv_p2p_mem_info (nv-p2p.c), where
 * the table's DMA-mapping list head follows it.  Every table is allocated
 * that way here, whatever its version: a client that reads a member its
 * version lacks (`flags` of a 1.2 table, `gpu_uuid` of a 1.0 one) reads that
 * list head - in bounds, but no value of that member - as it would on such
 * a host.
 */
#define SIM_TABLE_ALLOC (sizeof(struct nvidia_p2p_page_table) + sizeof(struct list_head))

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
static void sim_table_fill(struct sim_pin *pin, u32 version, u32 entries)
{
	size_t end = sim_table_end(version);
	struct list_head *head = (void *)pin->pt + end;

	pin->pt->version = version;
	pin->pt->page_size = READ_ONCE(sim_p2p_knobs.page_size_type);
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
static struct sim_pin *sim_reuse_table_locked(struct sim_pin *pin, u32 version, u32 entries)
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
static void sim_dangle_table(struct nvidia_p2p_page_table **page_table, u64 va, bool persistent)
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

/*
 * Non-persistent pins are looked up among the calling process's mappings,
 * keyed by the page table (RmP2PGetInfoWithoutToken with
 * osGetCurrentProcess(); the address is not used): from another thread
 * group, or once the process's registration is gone (forget_owner), nothing
 * is found, 0 is returned and nothing changes.  Persistent ones are found by
 * container_of on the table: a freed table is a use after free.
 */
static bool sim_put_finds_locked(struct sim_pin *pin, bool persistent)
{
	return persistent || (pin->owner == task_tgid(current) && !pin->forgotten);
}

/*
 * forget_owner: drop the writing process's registration of its pins, as
 * NVIDIA's driver does when an MPS client is destroyed.  The third-party
 * P2P object's pid list grows by NV503C_CTRL_CMD_REGISTER_PID (the MPS
 * server registers its clients) and shrinks in CliUnregisterFromThirdPartyP2P;
 * RmP2PGetInfoWithoutToken (CliNextThirdPartyP2PInfoWithPid, p2p.c) then
 * finds nothing for the client, while the memory and the armed callbacks
 * stay with the server.  So the pins stay LIVE: a later put_pages from this
 * process returns 0 and releases nothing (not counted: the client cannot
 * know), and freeing the memory runs the callbacks with the client's data.
 * The value is a device address of this process: the pins on the
 * allocation holding it; 0 for all of them.
 */
static int sim_forget_owner_set(const char *val, const struct kernel_param *kp)
{
	struct pid *me = task_tgid(current);
	unsigned int bkt, n = 0;
	struct sim_pin *pin;
	u64 va;
	int ret;

	ret = kstrtou64(val, 0, &va);
	if (ret)
		return ret;
	/* NVIDIA destroys the client under the API lock. */
	ret = sim_api_lock("forget_owner (client teardown)");
	if (ret)
		return ret;
	spin_lock(&sim_lock);
	hash_for_each(sim_pins, bkt, pin, hnode) {
		if (pin->persistent || pin->state != SIM_PIN_LIVE || pin->owner != me ||
		    pin->forgotten)
			continue;
		if (va && (va < pin->alloc->va || va - pin->alloc->va >= pin->alloc->size))
			continue;
		pin->forgotten = true;
		n++;
	}
	spin_unlock(&sim_lock);
	sim_api_unlock();
	pr_info_ratelimited("forget_owner: pid %d's registration of %u pins dropped\n",
			    pid_nr(me), n);
	return 0;
}

/* Reads back how many pins have lost their registration and still have a callback armed. */
static int sim_forget_owner_get(char *buf, const struct kernel_param *kp)
{
	unsigned int bkt, n = 0;
	struct sim_pin *pin;

	spin_lock(&sim_lock);
	hash_for_each(sim_pins, bkt, pin, hnode)
		n += pin->forgotten && pin->state != SIM_PIN_FREED;
	spin_unlock(&sim_lock);
	return sysfs_emit(buf, "%u\n", n);
}

static const struct kernel_param_ops sim_forget_owner_ops = {
	.set = sim_forget_owner_set,
	.get = sim_forget_owner_get,
};
module_param_cb(forget_owner, &sim_forget_owner_ops, NULL, 0644);
MODULE_PARM_DESC(forget_owner, "Write a device address of the writing process (0: all of them): drop that process's registration of its pins there, as an MPS client's teardown does on NVIDIA's driver; its later put_pages return 0 and release nothing, and freeing the memory runs the armed callbacks. Reads: how many such pins still have a callback armed");

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

/*
 * deny_peers: PCI devices NVIDIA's topology check refuses
 * (nv_grdma_pci_topology_supported, kernel-open/nvidia/nv-pci.c: a chipset
 * flagged NV_FLAG_PCI_P2P_UNSUPPORTED_CHIPSET without a common switch, or
 * NVreg_GrdmaPciTopoCheckOverride denying).  rm_p2p_dma_map_pages (osapi.c)
 * and nv_dma_buf_attach (nv-dmabuf.c) then fail with NV_ERR_NOT_SUPPORTED,
 * -ENOTSUPP for the client; so do dma_map_pages here and the static
 * dma-buf exporter's attach (sim_dmabuf.c).
 */
#define SIM_DENY_MAX 8
static struct {
	u32 id[SIM_DENY_MAX];	/* domain << 16 | bus << 8 | devfn */
	unsigned int n;
	char text[SIM_DENY_MAX * 13 + 1];
} sim_deny;
static DEFINE_SPINLOCK(sim_deny_lock);	/* guards sim_deny: readers may not sleep */

static int sim_deny_peers_set(const char *val, const struct kernel_param *kp)
{
	unsigned int dom, bus, slot, fn, i, n = 0;
	char buf[sizeof(sim_deny.text)], *cur, *tok;
	u32 id[SIM_DENY_MAX];

	if (strscpy(buf, val, sizeof(buf)) < 0)
		return -E2BIG;
	cur = strim(buf);
	while ((tok = strsep(&cur, ",")) != NULL) {
		tok = strim(tok);
		if (!*tok)
			continue;
		if (n == SIM_DENY_MAX)
			return -E2BIG;
		if (sscanf(tok, "%x:%x:%x.%x", &dom, &bus, &slot, &fn) != 4 ||
		    dom > 0xffff || bus > 0xff || slot > 0x1f || fn > 7)
			return -EINVAL;
		id[n++] = dom << 16 | bus << 8 | PCI_DEVFN(slot, fn);
	}
	spin_lock(&sim_deny_lock);
	memcpy(sim_deny.id, id, sizeof(id));
	sim_deny.n = n;
	sim_deny.text[0] = 0;
	for (i = 0; i < n; i++)
		scnprintf(sim_deny.text + strlen(sim_deny.text),
			  sizeof(sim_deny.text) - strlen(sim_deny.text), "%s%04x:%02x:%02x.%x",
			  i ? "," : "", id[i] >> 16, (id[i] >> 8) & 0xff,
			  PCI_SLOT(id[i] & 0xff), PCI_FUNC(id[i] & 0xff));
	spin_unlock(&sim_deny_lock);
	return 0;
}

static int sim_deny_peers_get(char *buf, const struct kernel_param *kp)
{
	int n;

	spin_lock(&sim_deny_lock);
	n = sysfs_emit(buf, "%s\n", sim_deny.text);
	spin_unlock(&sim_deny_lock);
	return n;
}

static const struct kernel_param_ops sim_deny_peers_ops = {
	.set = sim_deny_peers_set,
	.get = sim_deny_peers_get,
};
module_param_cb(deny_peers, &sim_deny_peers_ops, NULL, 0644);
MODULE_PARM_DESC(deny_peers, "PCI devices (DDDD:BB:DD.F, comma-separated, at most 8) that NVIDIA's topology check refuses: dma_map_pages and the static dma-buf exporter's attach fail for them with -ENOTSUPP (empty: none, default)");

/* Does NVIDIA's topology check refuse peer DMA by @dev (deny_peers)? */
bool sim_peer_denied(struct device *dev)
{
	struct pci_dev *pdev;
	bool denied = false;
	unsigned int i;
	u32 id;

	if (!dev_is_pci(dev))
		return false;
	pdev = to_pci_dev(dev);
	id = pci_domain_nr(pdev->bus) << 16 | pdev->bus->number << 8 | pdev->devfn;
	spin_lock(&sim_deny_lock);
	for (i = 0; i < sim_deny.n; i++)
		denied |= sim_deny.id[i] == id;
	spin_unlock(&sim_deny_lock);
	return denied;
}

/*
 * dma_map_pages' first read of @pt (NVIDIA's container_of and gpu_uuid read,
 * without a lock).  A freed table, however recently freed, is a use after
 * free: no grace window.
 */
static struct sim_pin *sim_pin_get_live(struct nvidia_p2p_page_table *pt, const char *fn)
{
	struct sim_pin *pin;

	spin_lock(&sim_lock);
	pin = sim_pin_lookup_locked(pt);
	if (!pin) {
		/* NVIDIA reads it all the same (container_of): whatever is there. */
		sim_count_uaf(fn, "page table it never handed out (or long freed)");
	} else if (pin->state == SIM_PIN_FREED) {
		sim_count_uaf(fn, "page table");
		pin = NULL;
	} else {
		refcount_inc(&pin->refs);
	}
	spin_unlock(&sim_lock);
	return pin;
}

int nvidia_p2p_dma_map_pages(struct pci_dev *peer,
			     struct nvidia_p2p_page_table *page_table,
			     struct nvidia_p2p_dma_mapping **dma_mapping)
{
	struct sim_map *map;
	struct sim_pin *pin;
	u32 i;
	int err;

	if (!peer || !page_table || !dma_mapping)
		return -EINVAL;
	/* NVIDIA reads the table (container_of) before anything else. */
	pin = sim_pin_get_live(page_table, __func__);
	if (!pin)
		return -EINVAL;
	/* NVIDIA NULLs it before its allocations and RM: any later failure leaves NULL. */
	*dma_mapping = NULL;
	if (READ_ONCE(sim_p2p_knobs.dma_map_latency_us))
		fsleep(READ_ONCE(sim_p2p_knobs.dma_map_latency_us));
	err = sim_api_lock(__func__);
	if (err)
		goto out_put;
	err = -EINVAL;
	spin_lock(&sim_lock);
	if (pin->state == SIM_PIN_FREED && pin->freed_by_put) {
		/* The client put the table while it was mapping it: its own bug. */
		sim_count_uaf(__func__, "page table (put by the client during the call)");
	} else if (pin->state == SIM_PIN_FREED) {
		/*
		 * Freed by a callback while we waited for the lock: NVIDIA's
		 * dma_map_pages goes on with the freed table, maps released BAR
		 * pages and links the mapping into the freed mem_info (heap
		 * corruption).  Only a client that cannot race the free may call
		 * it; refused here and counted.
		 */
		sim_count_misuse(&sim_stats.dma_map_races,
				 "dma_map_pages: the table was freed while it waited for the API lock (heap corruption in NVIDIA's driver)");
	} else if (pin->state == SIM_PIN_LIVE) {
		err = sim_injected_error_locked(&sim_p2p_knobs.fail_dma_map_nth);
	}
	spin_unlock(&sim_lock);
	/* rm_p2p_dma_map_pages: the topology check, under the API lock */
	if (!err && sim_peer_denied(&peer->dev))
		err = -ENOTSUPP;
	if (err)
		goto out_unlock;

	err = -ENOMEM;
	map = kzalloc(sizeof(*map), GFP_KERNEL);
	if (!map)
		goto out_unlock;
	map->m.dma_addresses = kvcalloc(pin->len >> SIM_PAGE_SHIFT, sizeof(u64), GFP_KERNEL);
	if (!map->m.dma_addresses) {
		kfree(map);
		goto out_unlock;
	}
	map->dev = &peer->dev;
	map->pin = pin;
	map->m.version = READ_ONCE(sim_p2p_knobs.dma_mapping_version);
	map->m.page_size_type = NVIDIA_P2P_PAGE_SIZE_64KB;
	map->m.private = map;
	map->m.pci_dev = peer;
	for (i = 0; i < pin->len >> SIM_PAGE_SHIFT; i++) {
		/* BAR pages as NVIDIA maps them (nv_dma_map_peer), or host pages */
		dma_addr_t a = pin->bar_len ?
			dma_map_resource(map->dev, pin->page_array[i].physical_address,
					 SIM_PAGE_SIZE, DMA_BIDIRECTIONAL, 0) :
			dma_map_page(map->dev, sim_pin_chunk(pin, i), 0,
				     SIM_PAGE_SIZE, DMA_BIDIRECTIONAL);

		if (dma_mapping_error(map->dev, a)) {
			err = -EIO;
			sim_map_unmap(map);
			sim_map_free(map);
			goto out_unlock;
		}
		map->m.dma_addresses[i] = a;
		map->m.entries = i + 1;
	}
	/* Under the API lock no callback can run: the pin is still LIVE. */
	spin_lock(&sim_lock);
	list_add_tail(&map->node, &pin->maps);
	sim_stats.dma_mappings++;
	spin_unlock(&sim_lock);
	*dma_mapping = &map->m;
	err = 0;
out_unlock:
	sim_api_unlock();
out_put:
	sim_pin_put(pin);
	return err;
}
EXPORT_SYMBOL_GPL(nvidia_p2p_dma_map_pages);

/*
 * The mapping @m of @pin, for @fn: taken off nothing, just found.  A freed
 * one (or one of a freed table) is counted as a use after free.  Caller
 * holds sim_lock.
 */
static struct sim_map *sim_map_find_locked(struct sim_pin *pin, struct nvidia_p2p_dma_mapping *m,
					   const char *fn)
{
	struct sim_map *map;

	list_for_each_entry(map, &pin->maps, node) {
		if (&map->m != m)
			continue;
		if (map->freed) {
			sim_count_uaf(fn, "DMA mapping");
			return NULL;
		}
		return map;
	}
	return NULL;
}

/* Takes only the table's own mapping lock in NVIDIA's driver: never the API lock. */
int nvidia_p2p_dma_unmap_pages(struct pci_dev *peer,
			       struct nvidia_p2p_page_table *page_table,
			       struct nvidia_p2p_dma_mapping *dma_mapping)
{
	struct sim_map *map = NULL;
	struct sim_pin *pin;
	int ret = -EINVAL;

	if (!peer || !page_table || !dma_mapping)
		return -EINVAL;
	if (READ_ONCE(sim_p2p_knobs.unmap_latency_us))
		fsleep(READ_ONCE(sim_p2p_knobs.unmap_latency_us));
	spin_lock(&sim_lock);
	pin = sim_pin_lookup_locked(page_table);
	if (!pin) {
		/* NVIDIA takes the mapping lock inside it (container_of): whatever is there. */
		sim_count_uaf(__func__, "page table it never handed out (or long freed)");
	} else if (pin->state == SIM_PIN_FREED) {
		sim_count_uaf(__func__, "page table");
	} else {
		/*
		 * Also inside the free callback: NVIDIA takes only the table's
		 * mapping semaphore here (nv_p2p_remove_dma_mapping).  A mapping
		 * no longer on the table's list (already unmapped) is found by
		 * pointer value or not at all: 0, nothing done.
		 */
		map = sim_map_find_locked(pin, dma_mapping, __func__);
		if (map) {
			list_del(&map->node);
			sim_stats.dma_mappings--;
			/* NVIDIA: WARN_ON(peer != dma_mapping->pci_dev), then unmaps it anyway. */
			if (peer != map->m.pci_dev)
				sim_count_misuse(&sim_stats.unmap_peer_mismatches,
						 "dma_unmap_pages with another peer than the mapping's");
		}
		ret = 0;
	}
	spin_unlock(&sim_lock);
	if (!map)
		return ret;
	sim_map_unmap(map);
	sim_map_free(map);
	return 0;
}
EXPORT_SYMBOL_GPL(nvidia_p2p_dma_unmap_pages);

/*
 * Only legal from inside the free callback: the mapping is freed then (and
 * stays in the graveyard with its table).
 */
int nvidia_p2p_free_dma_mapping(struct nvidia_p2p_dma_mapping *dma_mapping)
{
	struct sim_map *map = NULL;
	struct sim_pin *pin, *p;
	unsigned int bkt;

	if (!dma_mapping)
		return -EINVAL;
	/* Found through the registry, not by trusting the pointer. */
	spin_lock(&sim_lock);
	hash_for_each(sim_pins, bkt, p, hnode) {
		map = sim_map_find_locked(p, dma_mapping, __func__);
		if (map) {
			pin = p;
			break;
		}
	}
	if (map && (pin->state != SIM_PIN_CALLBACK || pin->cb_task != current))
		map = NULL;
	if (map) {
		map->freed = true;
		sim_stats.dma_mappings--;
	}
	spin_unlock(&sim_lock);
	if (WARN_ONCE(!map, "%s outside the free callback\n", __func__))
		return -EINVAL;
	/* Unmapped and poisoned when the callback returns (sim_pin_bury). */
	return 0;
}
EXPORT_SYMBOL_GPL(nvidia_p2p_free_dma_mapping);

int sim_p2p_init(void)
{
	int ret;

	sim_race_wq = alloc_workqueue("nvp2p_sim_race", WQ_UNBOUND, 0);
	if (!sim_race_wq)
		return -ENOMEM;
	ret = register_module_notifier(&sim_module_nb);
	if (ret)
		destroy_workqueue(sim_race_wq);
	return ret;
}

/* Module unload: empty the graveyard. */
void sim_p2p_exit(void)
{
	struct sim_pin *pin, *tmp;
	LIST_HEAD(dead);

	unregister_module_notifier(&sim_module_nb);
	destroy_workqueue(sim_race_wq);	/* no forced free left running */
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
