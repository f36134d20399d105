// SPDX-License-Identifier: (GPL-2.0 OR MIT)
/*
 * nvp2p_sim: the calling process's registration.
 *
 * NVIDIA's driver finds a non-persistent pin among the calling process's
 * third-party P2P objects, so put_pages finds only what that process pinned
 * and still has registered; forget_owner drops a process's registration, as
 * an MPS client's teardown does.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/hashtable.h>
#include <linux/kernel.h>
#include <linux/moduleparam.h>
#include <linux/pid.h>
#include <linux/printk.h>
#include <linux/sched.h>
#include <linux/sched/signal.h>
#include <linux/sysfs.h>
#include "sim.h"

/*
 * Non-persistent pins are looked up among the calling process's mappings,
 * keyed by the page table (RmP2PGetInfoWithoutToken with
 * osGetCurrentProcess(); the address is not used): from another thread
 * group, or once the process's registration is gone (forget_owner), nothing
 * is found, 0 is returned and nothing changes.  Persistent ones are found by
 * container_of on the table: a freed table is a use after free.
 */
bool sim_put_finds_locked(struct sim_pin *pin, bool persistent)
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
