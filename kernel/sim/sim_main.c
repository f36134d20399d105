// SPDX-License-Identifier: (GPL-2.0 OR MIT)
/*
 * nvp2p_sim: counters, and module load/unload.  Each module parameter lives
 * in the file that reads it (Documentation/simulator.md lists them by file).
 *
 * The simulator implements NVIDIA's nv-p2p kernel API over host memory so
 * gpupin.ko runs unchanged on machines without a GPU (see sim_p2p.c), and
 * gives user space a simulated GPU to allocate from (see sim_mem.c).
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/module.h>
#include <linux/random.h>
#include "sim.h"

/* Lock roles and order: see sim.h. */
DEFINE_MUTEX(sim_big_lock);
DEFINE_SPINLOCK(sim_lock);
struct nvp2p_sim_stats sim_stats;
u8 sim_gpu_uuid[NVIDIA_P2P_GPU_UUID_LEN];

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
	sim_dmabuf_init();
	ret = sim_p2p_init();
	if (ret)
		return ret;
	ret = sim_chardev_init();
	if (ret) {
		sim_p2p_exit();
		return ret;
	}
	pr_info("simulated GPU ready, BAR %lu MiB\n", sim_bar_size() >> 20);
	return 0;
}

static void __exit nvp2p_sim_exit(void)
{
	sim_chardev_exit();
	sim_dmabuf_exit();
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
