// SPDX-License-Identifier: (GPL-2.0 OR MIT)
/*
 * gpupin: fault injection for gpupin's own allocations, compiled into test
 * builds only (over the simulator, or GPUPIN_TESTING=1 on make's command
 * line); a production module has neither a fault attribute nor a parameter.
 *
 * Where the kernel has the fault-injection framework with its debugfs
 * interface (CONFIG_FAULT_INJECTION_DEBUG_FS), gpupin's allocations consult
 * one fault_attr, /sys/kernel/debug/gpupin/fail_alloc/ (probability,
 * interval, times, space, verbose, task-filter: see
 * Documentation/fault-injection/fault-injection.rst), and the per-task
 * /proc/<pid>/task/<tid>/fail-nth works as for any other fault site.
 * Debian's kernels lack the framework; there a module parameter,
 * fail_alloc_nth, counts down to one failure instead.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/atomic.h>
#include <linux/debugfs.h>
#include <linux/delay.h>
#include <linux/err.h>
#include <linux/fault-inject.h>
#include <linux/module.h>
#include <linux/moduleparam.h>
#include <linux/pci.h>
#include "compat.h"
#include "gpupin.h"

static unsigned int gpupin_callback_tail_delay_ms;
module_param_named(callback_tail_delay_ms, gpupin_callback_tail_delay_ms, uint, 0644);
MODULE_PARM_DESC(callback_tail_delay_ms, "Testing: the free callback pauses this long after it let go of its pin and module reference (widens the window of an unload racing it)");

static void gpupin_fault_pause(const unsigned int *ms_param)
{
	unsigned int ms = READ_ONCE(*ms_param);

	if (ms)
		msleep(ms);
}

/* The free callback's tail, after its pin and module reference went. */
void gpupin_fault_callback_tail(void)
{
	gpupin_fault_pause(&gpupin_callback_tail_delay_ms);
}

static unsigned int gpupin_fail_init_ms;
module_param_named(fail_init_ms, gpupin_fail_init_ms, uint, 0444);
MODULE_PARM_DESC(fail_init_ms, "Testing: module init pauses this long once the callback handler and the netlink family are set up, before the device exists, then fails with -EAGAIN (a load that fails while a free callback is in gpupin; 0 = off)");

/*
 * Module init's last step before the device is registered (no pin can exist yet): 0, or the
 * injected failure after its pause.
 */
int gpupin_fault_init_end(void)
{
	unsigned int ms = READ_ONCE(gpupin_fail_init_ms);

	if (!ms)
		return 0;
	msleep(ms);
	return -EAGAIN;
}

static unsigned int gpupin_release_delay_ms;
module_param_named(release_delay_ms, gpupin_release_delay_ms, uint, 0644);
MODULE_PARM_DESC(release_delay_ms, "Testing: an unpin pauses this long between claiming a pin and putting its pages (widens the window for a free callback racing it)");

/* An unpin's pause after it claimed the pin and unmapped it, before put_pages. */
void gpupin_fault_release_delay(void)
{
	gpupin_fault_pause(&gpupin_release_delay_ms);
}

static unsigned int gpupin_unmap_late_delay_ms;
module_param_named(unmap_late_delay_ms, gpupin_unmap_late_delay_ms, uint, 0644);
MODULE_PARM_DESC(unmap_late_delay_ms, "Testing: a dma-buf mapping's unmap pauses this long between its last use of the pin and destroying the mapping (an unpin may let the pin's buffer go meanwhile)");

/* The pause of a dma-buf mapping's unmap after it stopped using the pin. */
void gpupin_fault_unmap_late_delay(void)
{
	gpupin_fault_pause(&gpupin_unmap_late_delay_ms);
}

static unsigned int gpupin_own_map_batch_delay_ms;
module_param_named(own_map_batch_delay_ms, gpupin_own_map_batch_delay_ms, uint, 0644);
MODULE_PARM_DESC(own_map_batch_delay_ms, "Testing: gpupin's own DMA mapping of a pin pauses this long after each batch of 1024 pages, as an in-flight user (makes a map of a large pin slow)");

/* An own mapping's pause between two batches of pages, still in flight. */
void gpupin_fault_own_map_batch(void)
{
	gpupin_fault_pause(&gpupin_own_map_batch_delay_ms);
}

static bool gpupin_put_other_kind;
module_param_named(put_other_kind, gpupin_put_other_kind, bool, 0644);
MODULE_PARM_DESC(put_other_kind, "Testing: the next put_pages of a non-persistent pin goes through nvidia_p2p_put_pages_persistent (a client bug: NVIDIA dereferences NULL), then this resets");

/* Should this put of a non-persistent pin be a persistent one?  Once per setting. */
bool gpupin_fault_put_other_kind(void)
{
	return READ_ONCE(gpupin_put_other_kind) && xchg(&gpupin_put_other_kind, false);
}

static bool gpupin_no_map_resource;
module_param_named(own_map_no_map_resource, gpupin_no_map_resource, bool, 0644);
MODULE_PARM_DESC(own_map_no_map_resource, "Testing: gpupin's own mappings of BAR pages act as if the peer's DMA ops had no map_resource (Xen's swiotlb-xen): bus addresses, as NVIDIA's driver");

bool gpupin_fault_no_map_resource(void)
{
	return READ_ONCE(gpupin_no_map_resource);
}

/* Writing anything forgets NVIDIA's topology verdicts (topo.c). */
static int gpupin_forget_topology_set(const char *val, const struct kernel_param *kp)
{
	gpupin_topo_forget();
	return 0;
}

static const struct kernel_param_ops gpupin_forget_topology_ops = {
	.set = gpupin_forget_topology_set,
};
module_param_cb(forget_topology, &gpupin_forget_topology_ops, NULL, 0200);
MODULE_PARM_DESC(forget_topology, "Testing: write 1 to forget NVIDIA's topology verdicts gpupin keeps per GPU and peer (the simulator's deny_peers changed)");

static bool gpupin_unmap_other_peer;
module_param_named(unmap_other_peer, gpupin_unmap_other_peer, bool, 0644);
MODULE_PARM_DESC(unmap_other_peer, "Testing: the next nvidia_p2p_dma_unmap_pages gets another PCI device than the mapping's as its peer (a client bug NVIDIA WARNs about), then this resets");

/*
 * The peer to pass to nvidia_p2p_dma_unmap_pages for a mapping made for
 * @pdev: @pdev, or once after unmap_other_peer was set another PCI device.
 * No reference is kept on that one: NVIDIA only compares the pointer, and
 * the test VM's devices never go away.
 */
struct pci_dev *gpupin_fault_unmap_peer(struct pci_dev *pdev)
{
	struct pci_dev *other = NULL;

	if (!READ_ONCE(gpupin_unmap_other_peer) || !xchg(&gpupin_unmap_other_peer, false))
		return pdev;
	/* for_each_pci_dev() holds a reference to the device it stopped at. */
	for_each_pci_dev(other) {
		if (other != pdev) {
			pci_dev_put(other);
			return other;
		}
	}
	return pdev;
}

#if IS_ENABLED(CONFIG_FAULT_INJECTION_DEBUG_FS)

static DECLARE_FAULT_ATTR(gpupin_fail_alloc_attr);
static struct dentry *gpupin_debugfs;

bool gpupin_fail_alloc(void)
{
	return should_fail(&gpupin_fail_alloc_attr, 1);
}

int gpupin_fault_init(void)
{
	struct dentry *d;

	/* One line per forced failure, no stack dump (the default, 2, dumps one). */
	gpupin_fail_alloc_attr.verbose = 1;
	gpupin_debugfs = debugfs_create_dir("gpupin", NULL);
	d = fault_create_debugfs_attr("fail_alloc", gpupin_debugfs, &gpupin_fail_alloc_attr);
	if (IS_ERR(d)) {
		pr_err("fault injection: no debugfs attribute: %pe\n", d);
		debugfs_remove_recursive(gpupin_debugfs);
		gpupin_debugfs = NULL;
		return PTR_ERR(d);
	}
	return 0;
}

void gpupin_fault_exit(void)
{
	debugfs_remove_recursive(gpupin_debugfs);
	gpupin_fault_attr_put_dname(&gpupin_fail_alloc_attr);
}

#else /* no fault-injection framework: a countdown parameter */

static int gpupin_fail_alloc_nth;
module_param_named(fail_alloc_nth, gpupin_fail_alloc_nth, int, 0644);
MODULE_PARM_DESC(fail_alloc_nth, "Testing: fail gpupin's own Nth memory allocation from now (ENOMEM), then reset to 0 (0 = off)");

/* True for the allocation that brings fail_alloc_nth to 0. */
bool gpupin_fail_alloc(void)
{
	int n = READ_ONCE(gpupin_fail_alloc_nth);

	while (n > 0) {
		int seen = cmpxchg(&gpupin_fail_alloc_nth, n, n - 1);

		if (seen == n)
			return n == 1;
		n = seen;
	}
	return false;
}

int gpupin_fault_init(void)
{
	return 0;
}

void gpupin_fault_exit(void)
{
}

#endif
