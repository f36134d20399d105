// SPDX-License-Identifier: (GPL-2.0 OR MIT)
/*
 * gpupin: module parameters, the INFO ioctl, and module load/unload.
 *
 * gpupin pins NVIDIA GPU memory for third-party PCIe devices through the
 * nv-p2p kernel API, provided by nvidia.ko (open kernel modules) or by the
 * nvp2p_sim.ko simulator on machines without a GPU.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/module.h>
#include <linux/moduleparam.h>
#include <linux/rcupdate.h>
#include <linux/string.h>
#include <linux/uaccess.h>
#include <linux/wait_bit.h>
#include "gpupin.h"

unsigned long gpupin_max_pinned_bytes;
module_param_named(max_pinned_bytes, gpupin_max_pinned_bytes, ulong, 0644);
MODULE_PARM_DESC(max_pinned_bytes, "Bytes all files together may keep pinned; beyond it PIN fails with ENOSPC (0 = unlimited)");

unsigned int gpupin_max_pins_per_file = 65536;
module_param_named(max_pins_per_file, gpupin_max_pins_per_file, uint, 0644);
MODULE_PARM_DESC(max_pins_per_file, "Pins (and validity-map slots) per open file, read at open (default 65536, at most 1048576)");

bool gpupin_default_persistent;
module_param_named(default_persistent, gpupin_default_persistent, bool, 0644);
MODULE_PARM_DESC(default_persistent, "Pin with the persistent API even without GPUPIN_PIN_PERSISTENT (default off)");

bool gpupin_debug;
module_param_named(debug, gpupin_debug, bool, 0644);
MODULE_PARM_DESC(debug, "Log pins, unpins and invalidations (rate-limited; default off)");

bool gpupin_p2p_check;
module_param_named(p2p_check, gpupin_p2p_check, bool, 0644);
MODULE_PARM_DESC(p2p_check, "Refuse gpupin's own DMA mappings of BAR pages where the kernel's PCI peer-to-peer rules (CONFIG_PCI_P2PDMA) see no path; stricter than NVIDIA's own check (default off: logged only)");

#ifdef GPUPIN_NV_GET_PAGES_DOUBLE_FREE
/*
 * Kbuild found this NVIDIA driver's nv_p2p_get_pages (nv-p2p.c) freeing its
 * page arrays before it registers the free callback without clearing them,
 * and freeing them again when the registration fails, as it does when the
 * memory is freed in between (525.47 to 525.125, 535.43.02 to 535.43.23,
 * 535.54 to 535.113, 545.23; cleared from 525.147.05, 535.43.24, 535.129.03,
 * 545.29.02 and in every 550): a cuMemFree racing a PIN double-frees kernel
 * memory inside NVIDIA's driver.  Only non-persistent pins register a
 * callback, so they are refused unless the administrator accepts the risk.
 */
bool gpupin_nv_unsafe_get_pages;
module_param_named(nv_unsafe_get_pages, gpupin_nv_unsafe_get_pages, bool, 0644);
MODULE_PARM_DESC(nv_unsafe_get_pages, "This NVIDIA driver double-frees in nvidia_p2p_get_pages when the memory is freed during a pin (fixed in 525.147.05, 535.129.03, 545.29.02, 550): allow non-persistent pins all the same (default off: they fail with EOPNOTSUPP; persistent pins work)");
#endif

atomic64_t gpupin_pinned_bytes = ATOMIC64_INIT(0);
struct gpupin_stats gpupin_stats;
char gpupin_provider[GPUPIN_NAME_LEN] = "nvidia";
u32 gpupin_caps = GPUPIN_CAP_DMA_MAP | GPUPIN_CAP_DMABUF;

/* Raise *v to @now if it is larger (a lock-free running maximum). */
void gpupin_stat_max(atomic64_t *v, s64 now)
{
	s64 old = atomic64_read(v);

	while (now > old && !atomic64_try_cmpxchg(v, &old, now))
		;
}

long gpupin_ioctl_info(struct gpupin_file *f, struct gpupin_info __user *uarg)
{
	struct gpupin_info arg;
	int i;

	if (copy_from_user(&arg, uarg, sizeof(arg)))
		return -EFAULT;
	if (arg.flags)
		return -EINVAL;
	for (i = 0; i < ARRAY_SIZE(arg.reserved); i++)
		if (arg.reserved[i])
			return -EINVAL;
	memset(&arg, 0, sizeof(arg));
	arg.abi_version = GPUPIN_ABI_VERSION;
	arg.caps = gpupin_caps;
	arg.gpu_page_size = GPU_BOUND_SIZE;
	arg.max_pinned_bytes = READ_ONCE(gpupin_max_pinned_bytes);
	arg.pinned_bytes = atomic64_read(&gpupin_pinned_bytes);
	arg.max_pins_per_file = f->nr_slots;
	mutex_lock(&f->lock);
	arg.file_pins = atomic_read(&f->nr_pins);
	mutex_unlock(&f->lock);
	arg.map_size = f->vmap_size;
	strscpy(arg.version, GPUPIN_VERSION, sizeof(arg.version));
	strscpy(arg.provider, gpupin_provider, sizeof(arg.provider));
	return copy_to_user(uarg, &arg, sizeof(arg)) ? -EFAULT : 0;
}

#ifndef GPUPIN_WITH_NVIDIA
/* Exported by nvp2p_sim.ko only; looked up, never linked against. */
const char *nvp2p_sim_provider(void);
#endif

static void gpupin_detect_provider(void)
{
#ifndef GPUPIN_WITH_NVIDIA
	const char *(*sim_name)(void) = symbol_get(nvp2p_sim_provider);

	if (sim_name) {
		strscpy(gpupin_provider, sim_name(), sizeof(gpupin_provider));
		gpupin_caps |= GPUPIN_CAP_SIMULATOR;
		symbol_put(nvp2p_sim_provider);
	}
#endif
	gpupin_caps |= GPUPIN_CAP_PERSISTENT;	/* gpupin.h refuses drivers without it */
}

static int __init gpupin_init(void)
{
	int ret;

	BUILD_BUG_ON(sizeof(struct gpupin_info) != 144);
	BUILD_BUG_ON(sizeof(struct gpupin_pin) != 112);
	BUILD_BUG_ON(sizeof(struct gpupin_unpin) != 16);
	BUILD_BUG_ON(sizeof(struct gpupin_query) != 96);
	BUILD_BUG_ON(sizeof(struct gpupin_get_pages) != 48);
	BUILD_BUG_ON(sizeof(struct gpupin_dma_map) != 48);
	BUILD_BUG_ON(sizeof(struct gpupin_dma_addrs) != 48);
	BUILD_BUG_ON(sizeof(struct gpupin_dma_unmap) != 32);
	BUILD_BUG_ON(sizeof(struct gpupin_event) != 32);
	BUILD_BUG_ON(sizeof(struct gpupin_pin_dmabuf) != 120);

	gpupin_detect_provider();
	ret = gpupin_cb_handler_init();
	if (ret) {
		pr_err("cannot receive free callbacks from gpupin_cb: %d\n", ret);
		return ret;
	}
	ret = gpupin_fault_init();
	if (ret)
		goto err_cb;
	ret = gpupin_nl_init();
	if (ret)
		goto err_fault;
	ret = gpupin_fault_init_end();	/* before the device: no pin can exist */
	if (ret)
		goto err_nl;
	gpupin_budget_init();	/* the GPUs' dmem regions, before any pin */
	ret = gpupin_file_init();
	if (ret)
		goto err_budget;
#ifdef GPUPIN_NV_GET_PAGES_DOUBLE_FREE
	pr_warn("this NVIDIA driver double-frees in nvidia_p2p_get_pages when memory is freed during a pin: non-persistent pins are %s (update the driver to 535.129.03 or later)\n",
		gpupin_nv_unsafe_get_pages ? "allowed (nv_unsafe_get_pages=1)" : "refused");
#endif
	pr_info("version %s ready, provider %s\n", GPUPIN_VERSION, gpupin_provider);
	return 0;

err_budget:
	gpupin_budget_exit();
err_nl:
	gpupin_nl_exit();
err_fault:
	gpupin_fault_exit();
err_cb:
	gpupin_cb_handler_abort();
	return ret;
}

static void __exit gpupin_exit(void)
{
	/* First: a callback from now on stops in gpupin_cb.ko. */
	gpupin_cb_handler_exit();
	/*
	 * No pin is left.  A callback in our code holds the module (gpupin_cb.ko
	 * takes it), so none should be running: checked all the same.
	 */
	wait_var_event(&gpupin_callbacks_running, !atomic_read(&gpupin_callbacks_running));
	synchronize_rcu_tasks();
	gpupin_cb_ids_exit();
	gpupin_file_exit();
	gpupin_budget_exit();
	gpupin_nl_exit();
	gpupin_fault_exit();
	gpupin_topo_forget();
}

module_init(gpupin_init);
module_exit(gpupin_exit);

MODULE_LICENSE("Dual MIT/GPL");
MODULE_DESCRIPTION("Pin NVIDIA GPU memory for third-party PCIe devices (nv-p2p)");
MODULE_AUTHOR("gpupin developers");
MODULE_VERSION(GPUPIN_VERSION);
#ifdef GPUPIN_WITH_NVIDIA
/* modprobe loads nvidia first even where the imports are unversioned (dkms-build.sh). */
MODULE_SOFTDEP("pre: nvidia");
#endif
