// SPDX-License-Identifier: (GPL-2.0 OR MIT)
/*
 * nvp2p_sim: free callbacks.
 *
 * They run synchronously when the memory is freed (FREE, or the close of
 * /dev/nvp2p_sim: sim_mem.c), with the API lock held (sim_rmlock.c), as
 * NVIDIA's driver runs them; when one returns, its table and every DMA
 * mapping on it are freed (sim_table.c).  The injected frees
 * (race_get_pages, race_get_pages_late_us, race_put_pages) run them on the
 * module's own workqueue, and a client module unloaded with a callback
 * still armed is counted instead of called.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/completion.h>
#include <linux/delay.h>
#include <linux/hashtable.h>
#include <linux/module.h>
#include <linux/moduleparam.h>
#include <linux/notifier.h>
#include <linux/sched.h>
#include <linux/workqueue.h>
#include "sim.h"

/* Module parameter, writable at any time, so read with READ_ONCE. */
static bool sim_callback_twice;
module_param_named(callback_twice, sim_callback_twice, bool, 0644);
MODULE_PARM_DESC(callback_twice, "Run every free callback a second time with the same data once its table was freed: a client must find nothing then (default off)");

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
	if (READ_ONCE(sim_callback_twice) && !READ_ONCE(pin->cb_unloaded)) {
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
struct workqueue_struct *sim_race_wq;

/* The memory is freed "on another CPU" (race_put_pages, race_get_pages*). */
void sim_race_work(struct work_struct *work)
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

int sim_callback_init(void)
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

void sim_callback_exit(void)
{
	unregister_module_notifier(&sim_module_nb);
	destroy_workqueue(sim_race_wq);	/* no forced free left running */
}
