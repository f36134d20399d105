// SPDX-License-Identifier: (GPL-2.0 OR MIT)
/*
 * nvp2p_sim: NVIDIA's peer-to-peer topology verdict (deny_peers), read by
 * dma_map_pages (sim_dma.c) and the static dma-buf exporter's attach
 * (sim_dmabuf.c).
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/moduleparam.h>
#include <linux/pci.h>
#include <linux/spinlock.h>
#include <linux/string.h>
#include <linux/sysfs.h>
#include "sim.h"

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
