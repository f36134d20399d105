// SPDX-License-Identifier: (GPL-2.0 OR MIT)
/*
 * nvp2p_sim: the nv-p2p kernel API over simulated GPU memory.
 *
 * Same names, prototypes and semantics as NVIDIA's documented API: 64 KiB
 * pages, versioned page tables and DMA mappings, -EINVAL for unaligned or
 * foreign ranges and for a missing free callback, -ENOMEM once the simulated
 * BAR is full, put_pages returning 0 after the callback released the pages,
 * and callbacks that run synchronously, under the "driver lock", when the
 * memory is freed.  Misuse that the real driver would punish with memory
 * corruption (put_pages from inside the callback, a page table not freed by
 * the callback) is detected and counted instead.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/delay.h>
#include <linux/dma-mapping.h>
#include <linux/export.h>
#include <linux/hashtable.h>
#include <linux/pci.h>
#include <linux/random.h>
#include <linux/slab.h>
#include <linux/workqueue.h>
#include "sim.h"

/* Every registered pin, by the address of its page table; under sim_lock. */
static DEFINE_HASHTABLE(sim_pins, 10);

struct sim_pin *sim_pin_lookup_locked(struct nvidia_p2p_page_table *pt)
{
	struct sim_pin *pin;

	lockdep_assert_held(&sim_lock);
	hash_for_each_possible(sim_pins, pin, hnode, (unsigned long)pt)
		if (&pin->pt == pt)
			return pin;
	return NULL;
}

void sim_pin_put(struct sim_pin *pin)
{
	if (!refcount_dec_and_test(&pin->refs))
		return;
	sim_alloc_put(pin->alloc);
	kvfree(pin->pages);
	kvfree(pin->page_array);
	kfree(pin);
}

static struct page *sim_pin_chunk(struct sim_pin *pin, u32 i)
{
	struct sim_alloc *alloc = pin->alloc;

	return alloc->chunks[((pin->va - alloc->va) >> SIM_PAGE_SHIFT) + i];
}

static void sim_map_release(struct sim_map *map)
{
	u32 i;

	for (i = 0; i < map->m.entries; i++)
		dma_unmap_page(map->dev, map->m.dma_addresses[i], SIM_PAGE_SIZE,
			       DMA_BIDIRECTIONAL);
	kvfree(map->m.dma_addresses);
	kfree(map);
}

/*
 * Take @pin out of the registry and uncount it.  Caller holds sim_lock and
 * releases the returned mappings (left by the client) after unlocking.
 */
static void sim_pin_unregister_locked(struct sim_pin *pin, struct list_head *leftover)
{
	struct sim_map *map;

	lockdep_assert_held(&sim_lock);
	list_for_each_entry(map, &pin->maps, node) {
		sim_stats.dma_mappings--;
		sim_stats.mappings_not_freed++;
	}
	list_splice_init(&pin->maps, leftover);
	hash_del(&pin->hnode);
	list_del_init(&pin->node);
	pin->state = SIM_PIN_DONE;
	sim_stats.pinned_pages -= pin->pt.entries;
	sim_stats.bar_bytes -= pin->len;
	sim_stats.page_tables--;
	if (!pin->persistent)
		sim_stats.live_callbacks--;
}

static void sim_release_maps(struct list_head *maps)
{
	struct sim_map *map, *tmp;

	list_for_each_entry_safe(map, tmp, maps, node)
		sim_map_release(map);
}

/* Run one claimed pin's callback and release it; sim_big_lock held. */
static void sim_run_callback(struct sim_pin *pin)
{
	LIST_HEAD(leftover);

	lockdep_assert_held(&sim_big_lock);
	pin->cb_task = current;
	pin->free_callback(pin->data);
	pin->cb_task = NULL;

	spin_lock(&sim_lock);
	if (!pin->table_freed)
		sim_stats.tables_not_freed++;
	sim_stats.callbacks_run++;
	sim_pin_unregister_locked(pin, &leftover);
	spin_unlock(&sim_lock);
	sim_release_maps(&leftover);
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

static void sim_race_work(struct work_struct *work)
{
	struct sim_pin *pin = container_of(work, struct sim_pin, race_work);

	mutex_lock(&sim_big_lock);
	sim_run_callback(pin);
	mutex_unlock(&sim_big_lock);
}

/* Fault injection: should this get_pages fail?  Caller holds sim_lock. */
static int sim_injected_error_locked(void)
{
	int nth = READ_ONCE(sim_fail_nth);

	if (nth <= 0)
		return 0;
	WRITE_ONCE(sim_fail_nth, nth - 1);
	if (nth > 1)
		return 0;
	nth = abs(READ_ONCE(sim_fail_errno));
	return nth >= 1 && nth <= MAX_ERRNO ? -nth : -EIO;
}

static int sim_get_pages(u64 va, u64 len, struct nvidia_p2p_page_table **page_table,
			 void (*free_callback)(void *data), void *data, bool persistent)
{
	struct sim_alloc *alloc;
	struct sim_pin *pin;
	u32 entries, i;
	int err;

	if (!page_table || (!persistent && !free_callback))
		return -EINVAL;
	if (!len || ((va | len) & (SIM_PAGE_SIZE - 1)) || va + len < va ||
	    len > BIT_ULL(SIM_CTX_SHIFT))
		return -EINVAL;
	if (READ_ONCE(sim_pin_latency_us))
		fsleep(READ_ONCE(sim_pin_latency_us));

	entries = len >> SIM_PAGE_SHIFT;
	pin = kzalloc(sizeof(*pin), GFP_KERNEL);
	if (!pin)
		return -ENOMEM;
	pin->page_array = kvcalloc(entries, sizeof(*pin->page_array), GFP_KERNEL);
	pin->pages = kvcalloc(entries, sizeof(*pin->pages), GFP_KERNEL);
	if (!pin->page_array || !pin->pages) {
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
	pin->pt.version = READ_ONCE(sim_page_table_version);
	pin->pt.page_size = NVIDIA_P2P_PAGE_SIZE_64KB;
	pin->pt.pages = pin->pages;
	pin->pt.entries = entries;
	pin->pt.gpu_uuid = sim_gpu_uuid;

	mutex_lock(&sim_big_lock);
	spin_lock(&sim_lock);
	sim_stats.get_pages_calls++;
	err = sim_injected_error_locked();
	if (err)
		goto err_unlock;
	alloc = sim_find_alloc_locked(va, len, &err);
	if (!alloc)
		goto err_unlock;
	if (sim_stats.bar_bytes + len > READ_ONCE(sim_bar_size)) {
		err = -ENOMEM;
		goto err_unlock;
	}
	kref_get(&alloc->ref);
	pin->alloc = alloc;
	for (i = 0; i < entries; i++)
		pin->page_array[i].physical_address = page_to_phys(sim_pin_chunk(pin, i));
	if (!persistent) {
		list_add_tail(&pin->node, &alloc->pins);
		sim_stats.live_callbacks++;
	}
	hash_add(sim_pins, &pin->hnode, (unsigned long)&pin->pt);
	pin->state = SIM_PIN_LIVE;
	sim_stats.pinned_pages += entries;
	sim_stats.bar_bytes += len;
	sim_stats.page_tables++;
	*page_table = &pin->pt;
	spin_unlock(&sim_lock);
	mutex_unlock(&sim_big_lock);
	return 0;

err_unlock:
	spin_unlock(&sim_lock);
	mutex_unlock(&sim_big_lock);
err_free:
	kvfree(pin->pages);
	kvfree(pin->page_array);
	kfree(pin);
	return err;
}

int nvidia_p2p_get_pages(u64 p2p_token, u32 va_space_token, u64 virtual_address,
			 u64 length, struct nvidia_p2p_page_table **page_table,
			 void (*free_callback)(void *data), void *data)
{
	/* Tokens are unused since CUDA 6.0: only the owning process may pin. */
	if (p2p_token || va_space_token)
		return -EINVAL;
	return sim_get_pages(virtual_address, length, page_table, free_callback,
			     data, false);
}
EXPORT_SYMBOL_GPL(nvidia_p2p_get_pages);

int nvidia_p2p_get_pages_persistent(u64 virtual_address, u64 length,
				    struct nvidia_p2p_page_table **page_table,
				    u32 flags)
{
	if (flags)
		return -EINVAL;
	return sim_get_pages(virtual_address, length, page_table, NULL, NULL, true);
}
EXPORT_SYMBOL_GPL(nvidia_p2p_get_pages_persistent);

static int sim_put_pages(u64 va, struct nvidia_p2p_page_table *pt, bool persistent)
{
	LIST_HEAD(leftover);
	struct sim_pin *pin;

	if (!pt)
		return -EINVAL;
	mutex_lock(&sim_big_lock);
	spin_lock(&sim_lock);
	pin = sim_pin_lookup_locked(pt);
	if (!pin) {
		spin_unlock(&sim_lock);
		mutex_unlock(&sim_big_lock);
		/* The free callback released it already (or it never was). */
		return persistent ? -EINVAL : 0;
	}
	if (pin->persistent != persistent || pin->va != va) {
		spin_unlock(&sim_lock);
		mutex_unlock(&sim_big_lock);
		return -EINVAL;
	}
	if (WARN_ONCE(pin->cb_task == current,
		      "nvidia_p2p_put_pages called from inside the free callback\n")) {
		spin_unlock(&sim_lock);
		mutex_unlock(&sim_big_lock);
		return -EINVAL;
	}
	if (pin->state == SIM_PIN_LIVE && !persistent && READ_ONCE(sim_race_put_pages)) {
		/* Free the memory "now", on another CPU, as put_pages runs. */
		pin->state = SIM_PIN_CALLBACK;
		list_del_init(&pin->node);
		queue_work(system_unbound_wq, &pin->race_work);
	}
	if (pin->state == SIM_PIN_CALLBACK) {
		refcount_inc(&pin->refs);
		spin_unlock(&sim_lock);
		mutex_unlock(&sim_big_lock);
		wait_for_completion(&pin->cb_done);
		sim_pin_put(pin);
		return 0;
	}
	sim_pin_unregister_locked(pin, &leftover);
	spin_unlock(&sim_lock);
	mutex_unlock(&sim_big_lock);
	if (!list_empty(&leftover))
		pr_warn_ratelimited("put_pages with DMA mappings still present\n");
	sim_release_maps(&leftover);
	sim_pin_put(pin);
	return 0;
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
	if (pin && pin->state == SIM_PIN_CALLBACK && !pin->table_freed) {
		pin->table_freed = true;
		ret = 0;
	}
	spin_unlock(&sim_lock);
	WARN_ONCE(ret, "%s outside the free callback or twice\n", __func__);
	return ret;
}
EXPORT_SYMBOL_GPL(nvidia_p2p_free_page_table);

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
	spin_lock(&sim_lock);
	pin = sim_pin_lookup_locked(page_table);
	if (!pin || pin->state != SIM_PIN_LIVE) {
		spin_unlock(&sim_lock);
		return -EINVAL;
	}
	refcount_inc(&pin->refs);
	spin_unlock(&sim_lock);

	err = -ENOMEM;
	map = kzalloc(sizeof(*map), GFP_KERNEL);
	if (!map)
		goto out_put;
	map->m.dma_addresses = kvcalloc(pin->pt.entries, sizeof(u64), GFP_KERNEL);
	if (!map->m.dma_addresses) {
		kfree(map);
		goto out_put;
	}
	map->dev = &peer->dev;
	map->pin = pin;
	map->m.version = NVIDIA_P2P_DMA_MAPPING_VERSION;
	map->m.page_size_type = NVIDIA_P2P_PAGE_SIZE_64KB;
	map->m.private = map;
	map->m.pci_dev = peer;
	for (i = 0; i < pin->pt.entries; i++) {
		dma_addr_t a = dma_map_page(map->dev, sim_pin_chunk(pin, i), 0,
					    SIM_PAGE_SIZE, DMA_BIDIRECTIONAL);

		if (dma_mapping_error(map->dev, a)) {
			err = -EIO;
			goto out_release;
		}
		map->m.dma_addresses[i] = a;
		map->m.entries = i + 1;
	}

	spin_lock(&sim_lock);
	if (pin->state != SIM_PIN_LIVE) {
		spin_unlock(&sim_lock);
		err = -EINVAL;
		goto out_release;
	}
	list_add_tail(&map->node, &pin->maps);
	sim_stats.dma_mappings++;
	spin_unlock(&sim_lock);
	*dma_mapping = &map->m;
	err = 0;
	goto out_put;

out_release:
	sim_map_release(map);
out_put:
	sim_pin_put(pin);
	return err;
}
EXPORT_SYMBOL_GPL(nvidia_p2p_dma_map_pages);

/* Remove @m from @pin's list if it is there; caller holds sim_lock. */
static bool sim_map_take_locked(struct sim_pin *pin, struct nvidia_p2p_dma_mapping *m)
{
	struct sim_map *map;

	list_for_each_entry(map, &pin->maps, node) {
		if (&map->m == m) {
			list_del(&map->node);
			sim_stats.dma_mappings--;
			return true;
		}
	}
	return false;
}

int nvidia_p2p_dma_unmap_pages(struct pci_dev *peer,
			       struct nvidia_p2p_page_table *page_table,
			       struct nvidia_p2p_dma_mapping *dma_mapping)
{
	struct sim_pin *pin;
	bool found = false;

	if (!peer || !page_table || !dma_mapping)
		return -EINVAL;
	spin_lock(&sim_lock);
	pin = sim_pin_lookup_locked(page_table);
	if (pin)
		found = sim_map_take_locked(pin, dma_mapping);
	spin_unlock(&sim_lock);
	if (!found)
		return -EINVAL;
	sim_map_release(container_of(dma_mapping, struct sim_map, m));
	return 0;
}
EXPORT_SYMBOL_GPL(nvidia_p2p_dma_unmap_pages);

/* Only legal from inside the free callback. */
int nvidia_p2p_free_dma_mapping(struct nvidia_p2p_dma_mapping *dma_mapping)
{
	struct sim_map *map;
	bool found = false;

	if (!dma_mapping)
		return -EINVAL;
	map = container_of(dma_mapping, struct sim_map, m);
	spin_lock(&sim_lock);
	if (map->pin->state == SIM_PIN_CALLBACK && map->pin->cb_task == current)
		found = sim_map_take_locked(map->pin, dma_mapping);
	spin_unlock(&sim_lock);
	if (WARN_ONCE(!found, "%s outside the free callback\n", __func__))
		return -EINVAL;
	sim_map_release(map);
	return 0;
}
EXPORT_SYMBOL_GPL(nvidia_p2p_free_dma_mapping);
