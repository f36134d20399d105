// SPDX-License-Identifier: (GPL-2.0 OR MIT)
/*
 * gpupin: the generic-netlink family "gpupin" - GET_INFO, GET_PINS (a
 * resumable dump, detached pins included), GET_PIN, GET_STATS, and events
 * on the "events" multicast group.  One fill function per object serves both
 * the dump and the events.
 *
 * Locking: the dump takes gpupin_files_lock, then each file's lock, then
 * each pin's lock (the order written in gpupin.h); detached pins it takes
 * with references under gpupin_detached_lock alone, and fills after.  Pin events are built
 * with GFP_NOWAIT (no reclaim, no reserves, no warning: a failure is reported
 * to the listeners, below) and sent without any gpupin lock held, so the free
 * callback never waits for memory or a listener.
 *
 * Events name other processes' addresses, so only CAP_NET_ADMIN may receive
 * them.  Where generic netlink can restrict a multicast group to that
 * capability (GENL_MCAST_CAP_NET_ADMIN), events go to the "events" group;
 * elsewhere (or with GPUPIN_NL_EVENTS_UNICAST) no group is registered and
 * events are queued to the sockets that subscribed with the admin-only
 * SUBSCRIBE command (gpupin_nl_subs: held by socket, not by port id).
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/capability.h>
#include <linux/delay.h>
#include <linux/moduleparam.h>
#include <linux/pci.h>
#include <linux/pid_namespace.h>
#include <linux/sched.h>
#include <net/genetlink.h>
#include <net/netlink.h>
#include <net/sock.h>
#include <linux/netlink.h>
#include <linux/notifier.h>
#include "compat.h"
#include "gpupin.h"
#include "../include/uapi/gpupin_netlink.h"
/* The ops and their policies, generated from the YNL spec; the handlers are below. */
#include "netlink-gen.h"

#if defined(GENL_MCAST_CAP_NET_ADMIN) && !defined(GPUPIN_NL_EVENTS_UNICAST)
#define GPUPIN_NL_MCAST 1

enum { GPUPIN_NL_MCGRP_EVENTS_IDX };

static const struct genl_multicast_group gpupin_nl_mcgrps[] = {
	[GPUPIN_NL_MCGRP_EVENTS_IDX] = {
		.name = GPUPIN_NL_MCGRP_EVENTS,
		.flags = GENL_MCAST_CAP_NET_ADMIN,
	},
};
#else
#define GPUPIN_NL_MCAST 0
#define GPUPIN_NL_MAX_SUBSCRIBERS 64

/*
 * Sockets that asked for events, each holding a reference (sock_hold()):
 * keyed by the socket, never by its port id.  netlink_release() frees the
 * port id (netlink_remove()) before it tells anyone (NETLINK_URELEASE), and
 * another socket may bind that id in between; events go straight into the
 * subscriber's own receive queue, so they cannot reach that socket.
 *
 * gpupin_nl_subs_lock (spinlock): the array and its count.  Taken by the
 * event path (from the free callback too) and innermost of gpupin's locks:
 * only a subscriber's own receive-queue and wait-queue locks nest inside
 * it.  A subscriber is alive while it is in the array; its reference is
 * dropped (sock_put()) only after it left the array and outside the lock.
 */
static DEFINE_SPINLOCK(gpupin_nl_subs_lock);
static struct sock *gpupin_nl_subs[GPUPIN_NL_MAX_SUBSCRIBERS];
static unsigned int gpupin_nl_nsubs;

#ifdef GPUPIN_FAULT_INJECTION
/* Testing: hold the window between a port id's release and gpupin hearing of it open. */
static unsigned int gpupin_nl_release_delay_ms;
module_param_named(nl_release_delay_ms, gpupin_nl_release_delay_ms, uint, 0644);
MODULE_PARM_DESC(nl_release_delay_ms, "Testing: sleep this long before forgetting a released subscriber (0 = off)");
#endif
#endif

static struct genl_family gpupin_nl_family;

static bool gpupin_nl_listening(void)
{
#if GPUPIN_NL_MCAST
	return genl_has_listeners(&gpupin_nl_family, &init_net, GPUPIN_NL_MCGRP_EVENTS_IDX);
#else
	return READ_ONCE(gpupin_nl_nsubs) != 0;
#endif
}

#if !GPUPIN_NL_MCAST
/*
 * Take the subscribers whose sockets were released out of the array and
 * into @dead (at most GPUPIN_NL_MAX_SUBSCRIBERS), for the caller to put
 * outside the lock.  netlink_release() marks a socket SOCK_DEAD
 * (sock_orphan()) before it sends NETLINK_URELEASE, and a socket is never
 * revived, so a live subscriber is never dropped here.  Returns how many.
 */
static unsigned int gpupin_nl_reap_locked(struct sock **dead)
{
	unsigned int i = 0, n = 0;

	lockdep_assert_held(&gpupin_nl_subs_lock);
	while (i < gpupin_nl_nsubs) {
		if (sock_flag(gpupin_nl_subs[i], SOCK_DEAD)) {
			dead[n++] = gpupin_nl_subs[i];
			gpupin_nl_subs[i] = gpupin_nl_subs[--gpupin_nl_nsubs];
		} else {
			i++;
		}
	}
	return n;
}

static void gpupin_nl_put_socks(struct sock **socks, unsigned int n)
{
	while (n)
		sock_put(socks[--n]);
}

/*
 * A generic-netlink socket was released: drop the subscription of every
 * released socket (that one among them).  Only dead sockets go, so a
 * socket that bound the same port id meanwhile keeps its own subscription.
 */
static int gpupin_nl_release_notify(struct notifier_block *nb, unsigned long event, void *ptr)
{
	struct sock *dead[GPUPIN_NL_MAX_SUBSCRIBERS];
	struct netlink_notify *n = ptr;
	unsigned int ndead;

	if (event != NETLINK_URELEASE || n->protocol != NETLINK_GENERIC || n->net != &init_net)
		return NOTIFY_DONE;
#ifdef GPUPIN_FAULT_INJECTION
	if (READ_ONCE(gpupin_nl_release_delay_ms))
		msleep(READ_ONCE(gpupin_nl_release_delay_ms));
#endif
	spin_lock(&gpupin_nl_subs_lock);
	ndead = gpupin_nl_reap_locked(dead);
	spin_unlock(&gpupin_nl_subs_lock);
	gpupin_nl_put_socks(dead, ndead);
	return NOTIFY_DONE;
}

static struct notifier_block gpupin_nl_notifier = {
	.notifier_call = gpupin_nl_release_notify,
};

/*
 * An event @sk will not get: make its next read fail with ENOBUFS, as
 * netlink does for a full receive queue (NETLINK_NO_ENOBUFS, which gpupin
 * cannot read, is not honoured).
 */
static void gpupin_nl_sock_lost(struct sock *sk)
{
	WRITE_ONCE(sk->sk_err, ENOBUFS);
	sk_error_report(sk);
}
#endif

/* Hand a finished event to its listeners; consumes @skb. */
static void gpupin_nl_send_event(struct sk_buff *skb, gfp_t gfp)
{
#if GPUPIN_NL_MCAST
	genlmsg_multicast(&gpupin_nl_family, skb, 0, GPUPIN_NL_MCGRP_EVENTS_IDX, gfp);
#else
	unsigned int i;

	/* Atomic context: the subscribers stay alive while the lock is held. */
	spin_lock(&gpupin_nl_subs_lock);
	for (i = 0; i < gpupin_nl_nsubs; i++) {
		struct sock *sk = gpupin_nl_subs[i];
		struct sk_buff *copy;

		if (sock_flag(sk, SOCK_DEAD))
			continue;	/* released: gpupin_nl_release_notify() drops it */
		copy = skb_clone(skb, GFP_NOWAIT | __GFP_NOWARN);
		if (!copy || sock_queue_rcv_skb(sk, copy)) {
			kfree_skb(copy);
			gpupin_nl_sock_lost(sk);
		}
	}
	spin_unlock(&gpupin_nl_subs_lock);
	nlmsg_free(skb);
#endif
}

static bool gpupin_nl_privileged(const struct sk_buff *skb)
{
	return netlink_capable(skb, CAP_NET_ADMIN) || netlink_capable(skb, CAP_SYS_ADMIN);
}

/* The family lives in the initial namespaces: report global pids. */
static u32 gpupin_nl_pid(struct pid *pid)
{
	return pid_nr(pid);
}

/*
 * GPUPIN_NL_STATE_* for a pin's state: pinning (unpublished), releasing and
 * invalidating pins are on their way to invalidated.
 */
static u32 gpupin_nl_state(enum gpupin_pin_state state)
{
	switch (state) {
	case GPUPIN_PIN_PINNED:
		return GPUPIN_NL_STATE_PINNED;
	case GPUPIN_PIN_DETACHED:
		return GPUPIN_NL_STATE_DETACHED;
	default:
		return GPUPIN_NL_STATE_INVALIDATED;
	}
}

/* One pin's attributes, nested in GPUPIN_NL_A_PIN; shared by dump and events. */
static int gpupin_nl_fill_pin(struct sk_buff *skb, struct gpupin_pin_obj *pin, u32 reason)
{
	struct gpupin_file *f = pin->file;
	struct gpupin_map *map;
	struct nlattr *nest;
	u32 state;
	int ret = -EMSGSIZE;

	nest = nla_nest_start(skb, GPUPIN_NL_A_PIN);
	if (!nest)
		return -EMSGSIZE;
	if (nla_put_u32(skb, GPUPIN_NL_PIN_A_PID, gpupin_nl_pid(f->owner)) ||
	    nla_put_u64_64bit(skb, GPUPIN_NL_PIN_A_FILE_ID, f->id, GPUPIN_NL_PIN_A_PAD) ||
	    nla_put_u64_64bit(skb, GPUPIN_NL_PIN_A_HANDLE, pin->handle, GPUPIN_NL_PIN_A_PAD) ||
	    nla_put_u64_64bit(skb, GPUPIN_NL_PIN_A_VA, pin->va, GPUPIN_NL_PIN_A_PAD) ||
	    nla_put_u64_64bit(skb, GPUPIN_NL_PIN_A_SIZE, pin->size, GPUPIN_NL_PIN_A_PAD) ||
	    nla_put_u64_64bit(skb, GPUPIN_NL_PIN_A_ALIGNED_VA, pin->aligned_va,
			      GPUPIN_NL_PIN_A_PAD) ||
	    nla_put_u64_64bit(skb, GPUPIN_NL_PIN_A_ALIGNED_SIZE, pin->aligned_size,
			      GPUPIN_NL_PIN_A_PAD) ||
	    nla_put_u32(skb, GPUPIN_NL_PIN_A_ENTRIES, pin->entries) ||
	    nla_put_u32(skb, GPUPIN_NL_PIN_A_PAGE_SIZE, BIT(pin->page_shift)) ||
	    nla_put_u64_64bit(skb, GPUPIN_NL_PIN_A_CREATED_NS, pin->created_ns,
			      GPUPIN_NL_PIN_A_PAD) ||
	    nla_put_u64_64bit(skb, GPUPIN_NL_PIN_A_USER_TAG, pin->user_tag, GPUPIN_NL_PIN_A_PAD) ||
	    nla_put(skb, GPUPIN_NL_PIN_A_GPU_UUID, sizeof(pin->gpu_uuid), pin->gpu_uuid))
		goto cancel;
	if ((pin->flags & GPUPIN_PIN_PERSISTENT) && nla_put_flag(skb, GPUPIN_NL_PIN_A_PERSISTENT))
		goto cancel;
	if (reason && nla_put_u32(skb, GPUPIN_NL_PIN_A_REASON, reason))
		goto cancel;

	spin_lock(&pin->lock);
	state = gpupin_nl_state(pin->state);
	ret = nla_put_u32(skb, GPUPIN_NL_PIN_A_STATE, state);
	list_for_each_entry(map, &pin->maps, node) {
		if (ret)
			break;
		ret = nla_put_string(skb, GPUPIN_NL_PIN_A_DMA_PEER, pci_name(map->pdev));
	}
	spin_unlock(&pin->lock);
	if (ret)
		goto cancel;
	nla_nest_end(skb, nest);
	return 0;
cancel:
	nla_nest_cancel(skb, nest);
	return -EMSGSIZE;
}

/*
 * An event that could not be built is lost: mark the listeners' sockets, as
 * rtnetlink does, so that their next read fails with ENOBUFS (as when their
 * receive buffer overflows) and they know to read the state again.  Sockets
 * that set NETLINK_NO_ENOBUFS are not marked (in the unicast fallback, which
 * marks each subscriber, they are).
 */
static void gpupin_nl_event_lost(void)
{
#if GPUPIN_NL_MCAST
	genl_set_err(&gpupin_nl_family, &init_net, 0, GPUPIN_NL_MCGRP_EVENTS_IDX, -ENOBUFS);
#else
	unsigned int i;

	spin_lock(&gpupin_nl_subs_lock);
	for (i = 0; i < gpupin_nl_nsubs; i++)
		if (!sock_flag(gpupin_nl_subs[i], SOCK_DEAD))
			gpupin_nl_sock_lost(gpupin_nl_subs[i]);
	spin_unlock(&gpupin_nl_subs_lock);
#endif
}

/* Send an event about @pin to the "events" group, if anyone listens. */
void gpupin_nl_pin_event(struct gpupin_pin_obj *pin, u8 cmd, u32 reason)
{
	struct sk_buff *skb;
	void *hdr;

	if (!gpupin_nl_listening())
		return;
	skb = gpupin_genlmsg_new(NLMSG_GOODSIZE, GFP_NOWAIT | __GFP_NOWARN);
	if (!skb) {
		gpupin_nl_event_lost();
		return;
	}
	hdr = genlmsg_put(skb, 0, 0, &gpupin_nl_family, 0, cmd);
	if (!hdr || gpupin_nl_fill_pin(skb, pin, reason)) {
		nlmsg_free(skb);
		gpupin_nl_event_lost();
		return;
	}
	genlmsg_end(skb, hdr);
	gpupin_nl_send_event(skb, GFP_NOWAIT | __GFP_NOWARN);
}

void gpupin_nl_budget_event(struct gpupin_file *f, u64 size)
{
	struct sk_buff *skb;
	void *hdr;

	if (!gpupin_nl_listening())
		return;
	skb = gpupin_genlmsg_new(NLMSG_DEFAULT_SIZE, GFP_KERNEL);
	if (!skb) {
		gpupin_nl_event_lost();
		return;
	}
	hdr = genlmsg_put(skb, 0, 0, &gpupin_nl_family, 0, GPUPIN_NL_CMD_BUDGET_EXHAUSTED);
	if (!hdr ||
	    nla_put_u32(skb, GPUPIN_NL_A_PID, gpupin_nl_pid(f->owner)) ||
	    nla_put_u64_64bit(skb, GPUPIN_NL_A_SIZE, size, GPUPIN_NL_A_PAD) ||
	    nla_put_u64_64bit(skb, GPUPIN_NL_A_PINNED_BYTES,
			      atomic64_read(&gpupin_pinned_bytes), GPUPIN_NL_A_PAD) ||
	    nla_put_u64_64bit(skb, GPUPIN_NL_A_MAX_PINNED_BYTES,
			      READ_ONCE(gpupin_max_pinned_bytes), GPUPIN_NL_A_PAD)) {
		nlmsg_free(skb);
		gpupin_nl_event_lost();
		return;
	}
	genlmsg_end(skb, hdr);
	gpupin_nl_send_event(skb, GFP_KERNEL);
}

int gpupin_nl_get_info_doit(struct sk_buff *skb, struct genl_info *info)
{
	struct sk_buff *msg;
	void *hdr;

	msg = gpupin_genlmsg_new(NLMSG_DEFAULT_SIZE, GFP_KERNEL);
	if (!msg)
		return -ENOMEM;
	hdr = genlmsg_put_reply(msg, info, &gpupin_nl_family, 0, GPUPIN_NL_CMD_GET_INFO);
	if (!hdr ||
	    nla_put_u32(msg, GPUPIN_NL_A_ABI_VERSION, GPUPIN_ABI_VERSION) ||
	    nla_put_string(msg, GPUPIN_NL_A_VERSION, GPUPIN_VERSION) ||
	    nla_put_string(msg, GPUPIN_NL_A_PROVIDER, gpupin_provider) ||
	    nla_put_u32(msg, GPUPIN_NL_A_CAPS, gpupin_caps) ||
	    nla_put_u64_64bit(msg, GPUPIN_NL_A_MAX_PINNED_BYTES,
			      READ_ONCE(gpupin_max_pinned_bytes), GPUPIN_NL_A_PAD) ||
	    nla_put_u64_64bit(msg, GPUPIN_NL_A_PINNED_BYTES,
			      atomic64_read(&gpupin_pinned_bytes), GPUPIN_NL_A_PAD) ||
	    nla_put_u32(msg, GPUPIN_NL_A_MAX_PINS_PER_FILE, READ_ONCE(gpupin_max_pins_per_file))) {
		nlmsg_free(msg);
		return -EMSGSIZE;
	}
	genlmsg_end(msg, hdr);
	return genlmsg_reply(msg, info);
}

int gpupin_nl_get_stats_doit(struct sk_buff *skb, struct genl_info *info)
{
	static const struct {
		int attr;
		atomic64_t *v;
	} rows[] = {
		{ GPUPIN_NL_STAT_A_PINS, &gpupin_stats.pins },
		{ GPUPIN_NL_STAT_A_UNPINS, &gpupin_stats.unpins },
		{ GPUPIN_NL_STAT_A_INVAL_FREED, &gpupin_stats.inval_freed },
		{ GPUPIN_NL_STAT_A_INVAL_PROCESS_EXIT, &gpupin_stats.inval_process_exit },
		{ GPUPIN_NL_STAT_A_DMA_MAPS, &gpupin_stats.dma_maps },
		{ GPUPIN_NL_STAT_A_BYTES_NOW, &gpupin_pinned_bytes },
		{ GPUPIN_NL_STAT_A_BYTES_PEAK, &gpupin_stats.bytes_peak },
		{ GPUPIN_NL_STAT_A_FAIL_ENOMEM, &gpupin_stats.fail_enomem },
		{ GPUPIN_NL_STAT_A_FAIL_ENOSPC, &gpupin_stats.fail_enospc },
		{ GPUPIN_NL_STAT_A_FAIL_EINVAL, &gpupin_stats.fail_einval },
		{ GPUPIN_NL_STAT_A_FAIL_OTHER, &gpupin_stats.fail_other },
		{ GPUPIN_NL_STAT_A_CALLBACK_MAX_NS, &gpupin_stats.callback_max_ns },
		{ GPUPIN_NL_STAT_A_FAIL_EDQUOT, &gpupin_stats.fail_edquot },
	};
	u64 detached, detached_bytes;
	struct nlattr *nest;
	struct sk_buff *msg;
	void *hdr;
	int i;

	msg = gpupin_genlmsg_new(NLMSG_DEFAULT_SIZE, GFP_KERNEL);
	if (!msg)
		return -ENOMEM;
	hdr = genlmsg_put_reply(msg, info, &gpupin_nl_family, 0, GPUPIN_NL_CMD_GET_STATS);
	if (!hdr)
		goto err;
	nest = nla_nest_start(msg, GPUPIN_NL_A_STATS);
	if (!nest)
		goto err;
	for (i = 0; i < ARRAY_SIZE(rows); i++)
		if (nla_put_u64_64bit(msg, rows[i].attr, atomic64_read(rows[i].v),
				      GPUPIN_NL_STAT_A_PAD))
			goto err;
	gpupin_detached_totals(&detached, &detached_bytes);
	if (nla_put_u64_64bit(msg, GPUPIN_NL_STAT_A_DETACHED, detached, GPUPIN_NL_STAT_A_PAD) ||
	    nla_put_u64_64bit(msg, GPUPIN_NL_STAT_A_DETACHED_BYTES, detached_bytes,
			      GPUPIN_NL_STAT_A_PAD))
		goto err;
	nla_nest_end(msg, nest);
	genlmsg_end(msg, hdr);
	return genlmsg_reply(msg, info);
err:
	nlmsg_free(msg);
	return -EMSGSIZE;
}

/* May the requester see pins of @f? */
static bool gpupin_nl_may_see(const struct sk_buff *skb, struct gpupin_file *f)
{
	return f->owner == task_tgid(current) || gpupin_nl_privileged(skb);
}

int gpupin_nl_get_pin_doit(struct sk_buff *skb, struct genl_info *info)
{
	struct gpupin_pin_obj *pin = NULL;
	struct gpupin_file *f;
	struct sk_buff *msg;
	struct pid *pid;
	u64 handle;
	void *hdr;
	int ret;

	/* The extended ACK names the missing attribute by type, and says it in words. */
	if (GENL_REQ_ATTR_CHECK(info, GPUPIN_NL_A_PID) ||
	    GENL_REQ_ATTR_CHECK(info, GPUPIN_NL_A_HANDLE)) {
		NL_SET_ERR_MSG(info->extack, "GET_PIN needs the PID and HANDLE attributes");
		return -EINVAL;
	}
	msg = gpupin_genlmsg_new(NLMSG_DEFAULT_SIZE, GFP_KERNEL);
	if (!msg)
		return -ENOMEM;
	hdr = genlmsg_put_reply(msg, info, &gpupin_nl_family, 0, GPUPIN_NL_CMD_GET_PIN);
	if (!hdr) {
		nlmsg_free(msg);
		return -EMSGSIZE;
	}
	/* PIDs are global (init namespace), as the dump and the events report them. */
	rcu_read_lock();
	pid = get_pid(find_pid_ns(nla_get_u32(info->attrs[GPUPIN_NL_A_PID]), &init_pid_ns));
	rcu_read_unlock();
	handle = nla_get_u64(info->attrs[GPUPIN_NL_A_HANDLE]);

	/* Filled under the files lock: the pin's file cannot go meanwhile. */
	ret = -ENOENT;
	mutex_lock(&gpupin_files_lock);
	list_for_each_entry(f, &gpupin_files, node) {
		if (!pid || f->owner != pid || !gpupin_nl_may_see(skb, f))
			continue;
		pin = gpupin_pin_lookup(f, handle);
		if (pin) {
			ret = gpupin_nl_fill_pin(msg, pin, 0);
			gpupin_pin_put(pin);
			break;
		}
	}
	mutex_unlock(&gpupin_files_lock);
	put_pid(pid);
	if (ret) {
		nlmsg_free(msg);
		if (ret == -ENOENT)
			NL_SET_ERR_MSG(info->extack,
				       "no pin with that handle visible to you in that process");
		return ret;
	}
	genlmsg_end(msg, hdr);
	return genlmsg_reply(msg, info);
}

/* Dump cursor, in cb->args. */
enum {
	GPUPIN_NL_CUR_FILE,		/* the file id being dumped */
	GPUPIN_NL_CUR_HANDLE,		/* the last handle sent from it */
	GPUPIN_NL_CUR_DETACHED,		/* files done: detached pins after this seq */
};

/* Put one GET_PINS message for @pin into the dump; -EMSGSIZE when full. */
static int gpupin_nl_dump_pin(struct sk_buff *skb, struct netlink_callback *cb,
			      struct gpupin_pin_obj *pin)
{
	void *hdr;

	hdr = genlmsg_put(skb, NETLINK_CB(cb->skb).portid, cb->nlh->nlmsg_seq,
			  &gpupin_nl_family, NLM_F_MULTI, GPUPIN_NL_CMD_GET_PINS);
	if (!hdr)
		return -EMSGSIZE;
	if (gpupin_nl_fill_pin(skb, pin, 0)) {
		genlmsg_cancel(skb, hdr);
		return -EMSGSIZE;
	}
	genlmsg_end(skb, hdr);
	return 0;
}

#define GPUPIN_NL_DETACHED_BATCH 32

/*
 * The detached pins (out of every handle table: detached.c lists them) after
 * the files' pins, in the order they were detached; the cursor is the last
 * one's sequence number plus one (0: not begun).  Each batch is taken with
 * references, so the free callback may release a pin meanwhile.
 */
static int gpupin_nl_dump_detached(struct sk_buff *skb, struct netlink_callback *cb,
				   bool filter, u32 want)
{
	struct gpupin_pin_obj *pins[GPUPIN_NL_DETACHED_BATCH];
	unsigned int i, n;
	int err = 0;

	do {
		n = gpupin_detached_get(cb->args[GPUPIN_NL_CUR_DETACHED] - 1, pins,
					ARRAY_SIZE(pins));
		for (i = 0; i < n; i++) {
			struct gpupin_file *f = pins[i]->file;

			if (!err && gpupin_nl_may_see(cb->skb, f) &&
			    (!filter || gpupin_nl_pid(f->owner) == want))
				err = gpupin_nl_dump_pin(skb, cb, pins[i]);
			if (!err)
				cb->args[GPUPIN_NL_CUR_DETACHED] = pins[i]->detached_seq + 1;
			gpupin_detached_put(pins[i]);
		}
	} while (!err && n == ARRAY_SIZE(pins));
	return err;
}

/*
 * Dump every visible pin, in (file id, handle) order, then the detached
 * ones; with PID (a global thread-group id, as PIN_A_PID reports it) only
 * that process's.  The cursor lives in cb->args (GPUPIN_NL_CUR_*).
 */
int gpupin_nl_get_pins_dumpit(struct sk_buff *skb, struct netlink_callback *cb)
{
	struct nlattr **attrs = gpupin_genl_dump_attrs(cb);
	struct gpupin_pin_obj *pin;
	struct gpupin_file *f;
	unsigned long idx;
	bool filter = attrs && attrs[GPUPIN_NL_A_PID];
	u32 want = filter ? nla_get_u32(attrs[GPUPIN_NL_A_PID]) : 0;
	int err = 0;

	if (cb->args[GPUPIN_NL_CUR_DETACHED])
		goto detached;
	mutex_lock(&gpupin_files_lock);
	list_for_each_entry(f, &gpupin_files, node) {
		if (f->id < cb->args[GPUPIN_NL_CUR_FILE] || !gpupin_nl_may_see(cb->skb, f))
			continue;
		if (filter && gpupin_nl_pid(f->owner) != want)
			continue;
		if (f->id != cb->args[GPUPIN_NL_CUR_FILE]) {
			cb->args[GPUPIN_NL_CUR_FILE] = f->id;
			cb->args[GPUPIN_NL_CUR_HANDLE] = 0;
		}
		mutex_lock(&f->lock);
		xa_for_each_start(&f->pins, idx, pin, cb->args[GPUPIN_NL_CUR_HANDLE] + 1) {
			err = gpupin_nl_dump_pin(skb, cb, pin);
			if (err)
				break;
			cb->args[GPUPIN_NL_CUR_HANDLE] = idx;
		}
		mutex_unlock(&f->lock);
		if (err)
			break;
	}
	mutex_unlock(&gpupin_files_lock);
	if (err)
		goto out;
	cb->args[GPUPIN_NL_CUR_DETACHED] = 1;
detached:
	err = gpupin_nl_dump_detached(skb, cb, filter, want);
out:
	/* A full skb is resumed on the next call; an empty one ends the dump. */
	return err == -EMSGSIZE && skb->len == 0 ? -EMSGSIZE : skb->len;
}

/* SUBSCRIBE: the genl core already checked CAP_NET_ADMIN (GENL_ADMIN_PERM). */
int gpupin_nl_subscribe_doit(struct sk_buff *skb, struct genl_info *info)
{
#if GPUPIN_NL_MCAST
	NL_SET_ERR_MSG(info->extack, "join the \"events\" multicast group instead");
	return -EOPNOTSUPP;
#else
	/* The requesting socket (netlink_unicast_kernel() set it), alive for this call. */
	struct sock *sk = NETLINK_CB(skb).sk;
	struct sock *dead[GPUPIN_NL_MAX_SUBSCRIBERS];
	unsigned int i, ndead;
	int ret = 0;

	spin_lock(&gpupin_nl_subs_lock);
	ndead = gpupin_nl_reap_locked(dead);
	for (i = 0; i < gpupin_nl_nsubs; i++)
		if (gpupin_nl_subs[i] == sk)
			goto out;
	if (gpupin_nl_nsubs == GPUPIN_NL_MAX_SUBSCRIBERS) {
		NL_SET_ERR_MSG(info->extack, "too many event subscribers");
		ret = -ENOSPC;
		goto out;
	}
	sock_hold(sk);
	gpupin_nl_subs[gpupin_nl_nsubs++] = sk;
out:
	spin_unlock(&gpupin_nl_subs_lock);
	gpupin_nl_put_socks(dead, ndead);
	return ret;
#endif
}

static struct genl_family gpupin_nl_family __ro_after_init = {
	.name = GPUPIN_NL_FAMILY_NAME,
	.version = GPUPIN_NL_VERSION,
	.module = THIS_MODULE,
	.ops = gpupin_nl_ops,
	.n_ops = ARRAY_SIZE(gpupin_nl_ops),
	.resv_start_op = GPUPIN_NL_CMD_GET_INFO,
#if GPUPIN_NL_MCAST
	.mcgrps = gpupin_nl_mcgrps,
	.n_mcgrps = ARRAY_SIZE(gpupin_nl_mcgrps),
#endif
};

int gpupin_nl_init(void)
{
#if !GPUPIN_NL_MCAST
	int ret = netlink_register_notifier(&gpupin_nl_notifier);

	if (ret)
		return ret;
	ret = genl_register_family(&gpupin_nl_family);
	if (ret)
		netlink_unregister_notifier(&gpupin_nl_notifier);
	return ret;
#else
	return genl_register_family(&gpupin_nl_family);
#endif
}

void gpupin_nl_exit(void)
{
	genl_unregister_family(&gpupin_nl_family);
#if !GPUPIN_NL_MCAST
	netlink_unregister_notifier(&gpupin_nl_notifier);
	/* No file is open, so no event can be sent: let the subscribers go. */
	gpupin_nl_put_socks(gpupin_nl_subs, gpupin_nl_nsubs);
	gpupin_nl_nsubs = 0;
#endif
}
