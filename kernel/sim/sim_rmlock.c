// SPDX-License-Identifier: (GPL-2.0 OR MIT)
/*
 * nvp2p_sim: the resource manager's API lock, and the checks that make a
 * client's misuse of it visible.
 *
 * NVIDIA's driver runs every free callback with its RM API lock held and
 * takes the same lock in get_pages, put_pages and dma_map_pages.  A client
 * whose callback waits for a thread that is itself waiting for that lock
 * hangs the whole GPU driver.  Here the lock is sim_big_lock, taken through
 * sim_api_lock(): it is annotated for lockdep as one lock class, and a wait
 * longer than lock_timeout_ms gives up with a WARN and -EDEADLK (counted in
 * lock_timeouts) instead of hanging the test.  A free callback that runs
 * longer than callback_timeout_ms is reported by a watchdog (counted in
 * callback_overruns).  Calls that pass a page table or DMA mapping that
 * NVIDIA would already have freed are counted in use_after_free_calls.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/bug.h>
#include <linux/delay.h>
#include <linux/jiffies.h>
#include <linux/lockdep.h>
#include <linux/moduleparam.h>
#include <linux/mutex.h>
#include <linux/ratelimit.h>
#include <linux/workqueue.h>
#include "sim.h"

#ifdef CONFIG_LOCKDEP
static struct lock_class_key sim_api_key;
static struct lockdep_map sim_api_map = STATIC_LOCKDEP_MAP_INIT("nvidia_rm_api_lock", &sim_api_key);
#define sim_api_acquire() lock_map_acquire(&sim_api_map)
#define sim_api_release() lock_map_release(&sim_api_map)
#else
#define sim_api_acquire() do { } while (0)
#define sim_api_release() do { } while (0)
#endif

/* The thread holding the API lock (rmapiLockIsOwner); written under it. */
static struct task_struct *sim_api_owner;

static unsigned int sim_lock_timeout_ms = 5000;
module_param_named(lock_timeout_ms, sim_lock_timeout_ms, uint, 0644);
MODULE_PARM_DESC(lock_timeout_ms, "Give up (WARN, -EDEADLK) after waiting this long for the RM API lock: a deadlock on real hardware (default 5000, 0 = wait forever)");

/*
 * The WARNs below are rate-limited: callers that must have the lock retry
 * (context teardown, the injected free race), so a lasting deadlock would
 * WARN every lock_timeout_ms for good.  One a minute for a deadlock (each
 * is counted in lock_timeouts all the same), the usual limit for calls
 * from inside a callback.
 */
static DEFINE_RATELIMIT_STATE(sim_deadlock_rs, 60 * HZ, 1);
static DEFINE_RATELIMIT_STATE(sim_reentry_rs, DEFAULT_RATELIMIT_INTERVAL,
			      DEFAULT_RATELIMIT_BURST);

/*
 * Take the API lock for @who (an nv-p2p entry point or the free path).
 * Returns 0, -EIO (with a WARN) when the caller holds it already, or
 * -EDEADLK after lock_timeout_ms (with a WARN): a real driver would hang
 * there for good.
 */
int sim_api_lock(const char *who)
{
	unsigned int ms = READ_ONCE(sim_lock_timeout_ms);
	unsigned long deadline = jiffies + msecs_to_jiffies(ms);

	/*
	 * The lock is not re-entrant: rmapiLockAcquire starts with
	 * NV_ASSERT_OR_RETURN(!rmapiLockIsOwner(), NV_ERR_INVALID_LOCK_STATE),
	 * which nvidia_p2p_map_status turns into -EIO.  So put_pages (or
	 * get_pages, dma_map_pages) inside a free callback fails at once.
	 */
	if (READ_ONCE(sim_api_owner) == current) {
		WARN(__ratelimit(&sim_reentry_rs), "nvp2p_sim: %s called with the RM API lock held (inside a free callback): NVIDIA's driver asserts and fails it with -EIO\n",
		     who);
		return -EIO;
	}
	sim_api_acquire();
	while (!mutex_trylock(&sim_big_lock)) {
		if (ms && time_after(jiffies, deadline)) {
			sim_api_release();
			spin_lock(&sim_lock);
			sim_stats.lock_timeouts++;
			spin_unlock(&sim_lock);
			WARN(__ratelimit(&sim_deadlock_rs), "nvp2p_sim: %s waited %u ms for the RM API lock: the real driver would be deadlocked\n",
			     who, ms);
			return -EDEADLK;
		}
		usleep_range(200, 1000);
	}
	WRITE_ONCE(sim_api_owner, current);
	return 0;
}

void sim_api_unlock(void)
{
	WRITE_ONCE(sim_api_owner, NULL);
	mutex_unlock(&sim_big_lock);
	sim_api_release();
}

/*
 * The callback watchdog.  Callbacks run one at a time (under the API lock),
 * so one delayed work item serves them all.
 */
static void *sim_wd_callback;		/* the callback being watched */

static unsigned int sim_callback_timeout_ms = 5000;
module_param_named(callback_timeout_ms, sim_callback_timeout_ms, uint, 0644);
MODULE_PARM_DESC(callback_timeout_ms, "WARN when a free callback runs longer than this, in milliseconds (default 5000, 0 = never)");

static void sim_watchdog_fire(struct work_struct *work)
{
	spin_lock(&sim_lock);
	sim_stats.callback_overruns++;
	spin_unlock(&sim_lock);
	WARN(1, "nvp2p_sim: free callback %ps still running after %u ms with the RM API lock held\n",
	     READ_ONCE(sim_wd_callback), READ_ONCE(sim_callback_timeout_ms));
}

static DECLARE_DELAYED_WORK(sim_wd_work, sim_watchdog_fire);

/* Watch the callback @fn that is about to run; sim_big_lock held. */
void sim_watchdog_arm(void (*fn)(void *data))
{
	unsigned int ms = READ_ONCE(sim_callback_timeout_ms);

	lockdep_assert_held(&sim_big_lock);
	WRITE_ONCE(sim_wd_callback, fn);
	if (ms)
		mod_delayed_work(system_wq, &sim_wd_work, msecs_to_jiffies(ms));
}

void sim_watchdog_disarm(void)
{
	cancel_delayed_work_sync(&sim_wd_work);
}

static int sim_expect_misuse;
module_param_named(expect_misuse, sim_expect_misuse, int, 0644);
MODULE_PARM_DESC(expect_misuse, "Strict misuses a test provokes on purpose: each is counted and logged without a kernel WARNING while this is above 0, and takes one off (default 0: every misuse WARNs)");

/*
 * Count one strict misuse in @counter (a field of sim_stats) and report
 * @what.  A misuse is a kernel WARNING, which fails a test run, unless a
 * test announced it in expect_misuse (then it is logged and the budget goes
 * down by one).  Caller holds sim_lock.
 */
void sim_count_misuse(u64 *counter, const char *what)
{
	static DEFINE_RATELIMIT_STATE(rs, DEFAULT_RATELIMIT_INTERVAL, DEFAULT_RATELIMIT_BURST);
	int expected = READ_ONCE(sim_expect_misuse);

	lockdep_assert_held(&sim_lock);
	(*counter)++;
	if (expected > 0) {
		WRITE_ONCE(sim_expect_misuse, expected - 1);
		pr_warn_ratelimited("expected misuse (expect_misuse): %s\n", what);
		return;
	}
	if (__ratelimit(&rs))
		WARN(1, "nvp2p_sim: %s\n", what);
}

/*
 * A client passed @what (a page table or DMA mapping) to @fn after NVIDIA's
 * driver would have freed it.  Caller holds sim_lock.
 */
void sim_count_uaf(const char *fn, const char *what)
{
	lockdep_assert_held(&sim_lock);
	pr_err_ratelimited("%s called with a %s that NVIDIA's driver has freed (use after free)\n",
			   fn, what);
	sim_count_misuse(&sim_stats.use_after_free_calls,
			 "a call with what NVIDIA's driver has freed");
}

/* NVP2P_SIM_IOC_RESET_MISUSE: zero the counters of strict misuse. */
void sim_reset_misuse(void)
{
	spin_lock(&sim_lock);
	sim_stats.use_after_free_calls = 0;
	sim_stats.puts_not_found = 0;
	sim_stats.lock_timeouts = 0;
	sim_stats.callback_overruns = 0;
	sim_stats.dma_map_races = 0;
	sim_stats.dmabuf_nonpci_attaches = 0;
	sim_stats.stale_table_puts = 0;
	sim_stats.unmap_peer_mismatches = 0;
	sim_stats.put_kind_mismatches = 0;
	spin_unlock(&sim_lock);
}
