// SPDX-License-Identifier: (GPL-2.0 OR MIT)
/*
 * nvp2p_sim: the simulated BAR1.
 *
 * Its size (bar_size) bounds what can be pinned, less the 36 MiB NVIDIA's
 * driver keeps free; sim_stats.bar_bytes counts what pins hold, raised by
 * get_pages and lowered when a table is freed (sim_pin_retire_locked).  Page
 * tables give the host pages' addresses or, with bar_device, addresses
 * inside a PCI device's memory BAR, as a discrete GPU's BAR1 pages do.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/io.h>
#include <linux/lockdep.h>
#include <linux/mm.h>
#include <linux/moduleparam.h>
#include <linux/mutex.h>
#include <linux/pci.h>
#include <linux/string.h>
#include <linux/sysfs.h>
#include "sim.h"

/* Module parameter, writable at any time, so read with READ_ONCE. */
static unsigned long sim_bar1_size = 256UL << 20;
module_param_named(bar_size, sim_bar1_size, ulong, 0644);
MODULE_PARM_DESC(bar_size, "Simulated BAR1 size in bytes; a pin fails with -ENOMEM unless 36 MiB of it stay free after the pin, as on NVIDIA's driver (default 256 MiB)");

/*
 * BAR1 that pins may not take: NVIDIA's CLI_THIRD_PARTY_P2P_BAR1_RESERVE
 * (36 MiB, g_third_party_p2p_nvoc.h), checked by
 * _isSpaceAvailableForBar1P2PMapping (src/nvidia/src/kernel/gpu/bus/p2p.c)
 * before each new mapping: free bytes >= reserve + length.
 */
#define SIM_BAR1_RESERVE (36ULL << 20)

/* Does a pin of @len fit in the simulated BAR1?  Under sim_lock. */
bool sim_bar_space_locked(u64 len)
{
	u64 size = READ_ONCE(sim_bar1_size);

	lockdep_assert_held(&sim_lock);
	/* NVIDIA refuses too when more is mapped than the BAR holds (the size went down). */
	if (size < sim_stats.bar_bytes)
		return false;
	return size - sim_stats.bar_bytes >= SIM_BAR1_RESERVE + len;
}

/* For the load message (sim_main.c). */
unsigned long sim_bar_size(void)
{
	return READ_ONCE(sim_bar1_size);
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
u64 sim_bar_start, sim_bar_len;	/* of bar_device; len 0: off */
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

/* The host chunk that backs page @i of @pin. */
struct page *sim_pin_chunk(struct sim_pin *pin, u32 i)
{
	struct sim_alloc *alloc = pin->alloc;

	return alloc->chunks[((pin->va - alloc->va) >> SIM_PAGE_SHIFT) + i];
}

/* The address page @i of @pin is reported at. */
u64 sim_page_phys(struct sim_pin *pin, u32 i)
{
	struct page *chunk = sim_pin_chunk(pin, i);
	u64 slots = pin->bar_len >> SIM_PAGE_SHIFT;

	if (!slots)
		return page_to_phys(chunk);
	slots = (page_to_pfn(chunk) >> SIM_CHUNK_ORDER) % slots;
	return pin->bar_start + (slots << SIM_PAGE_SHIFT);
}
