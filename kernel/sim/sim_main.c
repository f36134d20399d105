// SPDX-License-Identifier: (GPL-2.0 OR MIT)
/*
 * nvp2p_sim: module parameters, counters, and module load/unload.
 *
 * The simulator implements NVIDIA's nv-p2p kernel API over host memory so
 * gpupin.ko runs unchanged on machines without a GPU (see sim_p2p.c), and
 * gives user space a simulated GPU to allocate from (see sim_mem.c).
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/module.h>
#include <linux/moduleparam.h>
#include <linux/random.h>
#include "sim.h"

/* Lock roles and order: see sim.h. */
DEFINE_MUTEX(sim_big_lock);
DEFINE_SPINLOCK(sim_lock);
struct nvp2p_sim_stats sim_stats;
u8 sim_gpu_uuid[NVIDIA_P2P_GPU_UUID_LEN];

unsigned long sim_bar_size = 256UL << 20;
module_param_named(bar_size, sim_bar_size, ulong, 0644);
MODULE_PARM_DESC(bar_size, "Simulated BAR1 size in bytes; pins beyond it fail with -ENOMEM (default 256 MiB)");

unsigned int sim_pin_latency_us;
module_param_named(pin_latency_us, sim_pin_latency_us, uint, 0644);
MODULE_PARM_DESC(pin_latency_us, "Extra latency of each get_pages call in microseconds (default 0)");

int sim_fail_nth;
module_param_named(fail_nth, sim_fail_nth, int, 0644);
MODULE_PARM_DESC(fail_nth, "Fail the Nth get_pages call from now with -fail_errno, then reset to 0 (0 = off)");

int sim_fail_errno = ENOMEM;
module_param_named(fail_errno, sim_fail_errno, int, 0644);
MODULE_PARM_DESC(fail_errno, "Positive errno returned by the injected failure (default ENOMEM)");

bool sim_race_put_pages;
module_param_named(race_put_pages, sim_race_put_pages, bool, 0644);
MODULE_PARM_DESC(race_put_pages, "Fire the free callback concurrently with every put_pages (default off)");

bool sim_race_get_pages;
module_param_named(race_get_pages, sim_race_get_pages, bool, 0644);
MODULE_PARM_DESC(race_get_pages, "Free the memory as each get_pages drops the API lock: its callback runs before get_pages returns (default off)");

unsigned int sim_dma_map_latency_us;
module_param_named(dma_map_latency_us, sim_dma_map_latency_us, uint, 0644);
MODULE_PARM_DESC(dma_map_latency_us, "Delay between dma_map_pages reading the table and taking the API lock, in microseconds (default 0)");

unsigned int sim_unmap_latency_us;
module_param_named(unmap_latency_us, sim_unmap_latency_us, uint, 0644);
MODULE_PARM_DESC(unmap_latency_us, "Delay before dma_unmap_pages reads the table, in microseconds (default 0)");

unsigned int sim_lock_timeout_ms = 5000;
module_param_named(lock_timeout_ms, sim_lock_timeout_ms, uint, 0644);
MODULE_PARM_DESC(lock_timeout_ms, "Give up (WARN, -EDEADLK) after waiting this long for the RM API lock: a deadlock on real hardware (default 5000, 0 = wait forever)");

unsigned int sim_callback_timeout_ms = 5000;
module_param_named(callback_timeout_ms, sim_callback_timeout_ms, uint, 0644);
MODULE_PARM_DESC(callback_timeout_ms, "WARN when a free callback runs longer than this, in milliseconds (default 5000, 0 = never)");

unsigned int sim_dead_tables_max = 4096;
module_param_named(dead_tables_max, sim_dead_tables_max, uint, 0644);
MODULE_PARM_DESC(dead_tables_max, "Freed page tables kept poisoned to catch later calls that pass them (default 4096)");

unsigned long sim_mem_limit = 1UL << 30;
module_param_named(mem_limit, sim_mem_limit, ulong, 0644);
MODULE_PARM_DESC(mem_limit, "Simulated device memory that all contexts together may allocate, in bytes (default 1 GiB)");

unsigned int sim_page_table_version = NVIDIA_P2P_PAGE_TABLE_VERSION;
module_param_named(page_table_version, sim_page_table_version, uint, 0644);
MODULE_PARM_DESC(page_table_version, "Page-table version and layout handed out: 0x00020000 (R580 on, default) or 0x00010002 (R535..R575: no flags member); others test clients' version checks");

unsigned int sim_page_size_type = NVIDIA_P2P_PAGE_SIZE_64KB;
module_param_named(page_size_type, sim_page_size_type, uint, 0644);
MODULE_PARM_DESC(page_size_type, "Page size type written into page tables: 1 = 64 KiB (default; what every GPU gives); others test clients' checks, the memory stays in 64 KiB pages");

unsigned int sim_dma_mapping_version = NVIDIA_P2P_DMA_MAPPING_VERSION;
module_param_named(dma_mapping_version, sim_dma_mapping_version, uint, 0644);
MODULE_PARM_DESC(dma_mapping_version, "DMA-mapping version handed out by dma_map_pages (default 0x00020003); others test clients' version checks");

int sim_fail_put_nth;
module_param_named(fail_put_nth, sim_fail_put_nth, int, 0644);
MODULE_PARM_DESC(fail_put_nth, "Fail the Nth put_pages (either kind) of a live table from now with -fail_errno, leaving it pinned and its callback armed, then reset to 0 (0 = off)");

int sim_fail_dma_map_nth;
module_param_named(fail_dma_map_nth, sim_fail_dma_map_nth, int, 0644);
MODULE_PARM_DESC(fail_dma_map_nth, "Fail the Nth dma_map_pages call from now with -fail_errno, then reset to 0 (0 = off)");

int sim_fail_attach_nth;
module_param_named(fail_attach_nth, sim_fail_attach_nth, int, 0644);
MODULE_PARM_DESC(fail_attach_nth, "Fail the Nth attach to an exported dma-buf from now with -fail_errno, then reset to 0 (0 = off)");

int sim_fail_dmabuf_map_nth;
module_param_named(fail_dmabuf_map_nth, sim_fail_dmabuf_map_nth, int, 0644);
MODULE_PARM_DESC(fail_dmabuf_map_nth, "Fail the Nth mapping of an exported dma-buf from now with -fail_errno, then reset to 0 (0 = off)");

int sim_expect_misuse;
module_param_named(expect_misuse, sim_expect_misuse, int, 0644);
MODULE_PARM_DESC(expect_misuse, "Strict misuses a test provokes on purpose: each is counted and logged without a kernel WARNING while this is above 0, and takes one off (default 0: every misuse WARNs)");

bool sim_reuse_freed_tables;
module_param_named(reuse_freed_tables, sim_reuse_freed_tables, bool, 0644);
MODULE_PARM_DESC(reuse_freed_tables, "Hand a freed page table's address to the next get_pages of the same process, so that a stale put_pages hits that newer pin, as on NVIDIA's driver (counted in stale_table_puts; default off)");

/*
 * gpupin looks this up with symbol_get() to tell the simulator from the real
 * driver; it is not part of the nv-p2p API.
 */
const char *nvp2p_sim_provider(void)
{
	return "nvp2p_sim";
}
EXPORT_SYMBOL_GPL(nvp2p_sim_provider);

static int __init nvp2p_sim_init(void)
{
	int ret;

	get_random_bytes(sim_gpu_uuid, sizeof(sim_gpu_uuid));
	ret = sim_p2p_init();
	if (ret)
		return ret;
	ret = sim_chardev_init();
	if (ret) {
		sim_p2p_exit();
		return ret;
	}
	pr_info("simulated GPU ready, BAR %lu MiB\n", sim_bar_size >> 20);
	return 0;
}

static void __exit nvp2p_sim_exit(void)
{
	sim_chardev_exit();
	sim_p2p_exit();
	sim_poison_exit();
	/* Clients hold a module reference while they use our symbols. */
	WARN_ON(sim_stats.page_tables || sim_stats.allocations);
}

module_init(nvp2p_sim_init);
module_exit(nvp2p_sim_exit);

MODULE_LICENSE("Dual MIT/GPL");
MODULE_DESCRIPTION("Simulator of the NVIDIA nv-p2p kernel API over host memory");
MODULE_AUTHOR("gpupin developers");
MODULE_VERSION("0.1");
