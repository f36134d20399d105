/* SPDX-License-Identifier: (GPL-2.0 WITH Linux-syscall-note) OR MIT */
/*
 * gpupin generic-netlink family "gpupin", version 1: introspection (who has
 * what pinned), global counters, and an event stream (multicast group
 * "events", CAP_NET_ADMIN only).
 *
 * Requests are validated strictly: unknown attributes and wrong types are
 * rejected with an extended-ACK message.  Unprivileged callers see only the
 * pins of their own thread group; CAP_NET_ADMIN or CAP_SYS_ADMIN see all.
 */
#ifndef _UAPI_GPUPIN_NETLINK_H
#define _UAPI_GPUPIN_NETLINK_H

#define GPUPIN_NL_FAMILY_NAME "gpupin"
#define GPUPIN_NL_VERSION 1
#define GPUPIN_NL_MCGRP_EVENTS "events"

/*
 * The family is described by Documentation/netlink/specs/gpupin.yaml (YNL);
 * the names and numbers below must match it (tests/host/test_ynl_spec.py).
 *
 * Each command has its own policy (since gpupin 0.1 with per-operation
 * policies): GET_INFO, GET_STATS and SUBSCRIBE reject every attribute,
 * GET_PINS takes only PID (>= 1, a filter), GET_PIN needs PID and HANDLE.
 * PIDs are global (init namespace) thread-group ids.
 */

/* Commands; events reuse the numbers from PINNED on. */
enum gpupin_nl_cmd {
	GPUPIN_NL_CMD_UNSPEC,
	GPUPIN_NL_CMD_GET_INFO,		/* doit: the facts of the INFO ioctl */
	GPUPIN_NL_CMD_GET_PINS,		/* dump: one message per pin; PID filters */
	GPUPIN_NL_CMD_GET_STATS,	/* doit: global counters */
	GPUPIN_NL_CMD_GET_PIN,		/* doit: one pin; needs PID and HANDLE */
	GPUPIN_NL_CMD_PINNED,		/* event */
	GPUPIN_NL_CMD_UNPINNED,		/* event */
	GPUPIN_NL_CMD_INVALIDATED,	/* event */
	GPUPIN_NL_CMD_BUDGET_EXHAUSTED,	/* event */
	/*
	 * doit, CAP_NET_ADMIN: deliver events to this socket by unicast.
	 * Kernels whose generic netlink cannot restrict a multicast group to
	 * CAP_NET_ADMIN (6.1.y before the GENL_MCAST_CAP_NET_ADMIN backport)
	 * register no "events" group; listeners subscribe with this instead.
	 */
	GPUPIN_NL_CMD_SUBSCRIBE,

	__GPUPIN_NL_CMD_MAX
};

#define GPUPIN_NL_CMD_MAX (__GPUPIN_NL_CMD_MAX - 1)

/* Top-level attributes. */
enum gpupin_nl_attr {
	GPUPIN_NL_A_UNSPEC,
	GPUPIN_NL_A_PID,		/* u32: thread group (request filter, pin owner) */
	GPUPIN_NL_A_HANDLE,		/* u64 */
	GPUPIN_NL_A_PIN,		/* nested GPUPIN_NL_PIN_A_* */
	GPUPIN_NL_A_ABI_VERSION,	/* u32 */
	GPUPIN_NL_A_VERSION,		/* string */
	GPUPIN_NL_A_PROVIDER,		/* string */
	GPUPIN_NL_A_CAPS,		/* u32 */
	GPUPIN_NL_A_MAX_PINNED_BYTES,	/* u64 */
	GPUPIN_NL_A_PINNED_BYTES,	/* u64 */
	GPUPIN_NL_A_MAX_PINS_PER_FILE,	/* u32 */
	GPUPIN_NL_A_STATS,		/* nested GPUPIN_NL_STAT_A_* */
	GPUPIN_NL_A_SIZE,		/* u64: BUDGET_EXHAUSTED: bytes asked for */
	GPUPIN_NL_A_PAD,

	__GPUPIN_NL_A_MAX
};

#define GPUPIN_NL_A_MAX (__GPUPIN_NL_A_MAX - 1)

/* Attributes of one pin (GPUPIN_NL_A_PIN). */
enum gpupin_nl_pin_attr {
	GPUPIN_NL_PIN_A_UNSPEC,
	GPUPIN_NL_PIN_A_PID,		/* u32: owner thread group */
	GPUPIN_NL_PIN_A_FILE_ID,	/* u64: which open of /dev/gpupin */
	GPUPIN_NL_PIN_A_HANDLE,		/* u64 */
	GPUPIN_NL_PIN_A_VA,		/* u64 */
	GPUPIN_NL_PIN_A_SIZE,		/* u64 */
	GPUPIN_NL_PIN_A_ALIGNED_VA,	/* u64 */
	GPUPIN_NL_PIN_A_ALIGNED_SIZE,	/* u64 */
	GPUPIN_NL_PIN_A_ENTRIES,	/* u32 */
	GPUPIN_NL_PIN_A_PAGE_SIZE,	/* u32 */
	GPUPIN_NL_PIN_A_STATE,		/* u32: GPUPIN_NL_STATE_* */
	GPUPIN_NL_PIN_A_PERSISTENT,	/* flag */
	GPUPIN_NL_PIN_A_CREATED_NS,	/* u64: CLOCK_REALTIME */
	GPUPIN_NL_PIN_A_USER_TAG,	/* u64 */
	GPUPIN_NL_PIN_A_DMA_PEER,	/* string, once per DMA mapping */
	GPUPIN_NL_PIN_A_REASON,		/* u32: GPUPIN_NL_REASON_* (events) */
	GPUPIN_NL_PIN_A_PAD,

	__GPUPIN_NL_PIN_A_MAX
};

#define GPUPIN_NL_PIN_A_MAX (__GPUPIN_NL_PIN_A_MAX - 1)

/*
 * A pin's state (GPUPIN_NL_PIN_A_STATE).  PINNED and INVALIDATED have the
 * numbers of GPUPIN_STATE_* in the ioctl ABI (gpupin.h).
 */
enum gpupin_nl_state {
	GPUPIN_NL_STATE_PINNED = 1,	/* usable */
	GPUPIN_NL_STATE_INVALIDATED,	/* the GPU memory went; the handle is left */
	/*
	 * Released where its pages could not be put (another process closed
	 * the last file reference): in no handle table, but its pages, BAR
	 * space and share of max_pinned_bytes stay until the GPU driver frees
	 * the memory (its owner frees it or exits).  Dump only.
	 */
	GPUPIN_NL_STATE_DETACHED,
};

/* Why a pin went (INVALIDATED and UNPINNED events). */
enum gpupin_nl_reason {
	GPUPIN_NL_REASON_FREED = 1,	/* GPU memory freed: the provider's callback */
	GPUPIN_NL_REASON_UNPIN,		/* UNPIN ioctl */
	GPUPIN_NL_REASON_CLOSE,		/* the file was closed */
	GPUPIN_NL_REASON_PROCESS_EXIT,	/* the owning process died */
};

/* Global counters (GPUPIN_NL_A_STATS), all u64; new ones after PAD. */
enum gpupin_nl_stat_attr {
	GPUPIN_NL_STAT_A_UNSPEC,
	GPUPIN_NL_STAT_A_PINS,
	GPUPIN_NL_STAT_A_UNPINS,
	GPUPIN_NL_STAT_A_INVAL_FREED,
	GPUPIN_NL_STAT_A_INVAL_PROCESS_EXIT,
	GPUPIN_NL_STAT_A_DMA_MAPS,
	GPUPIN_NL_STAT_A_BYTES_NOW,
	GPUPIN_NL_STAT_A_BYTES_PEAK,
	GPUPIN_NL_STAT_A_FAIL_ENOMEM,
	GPUPIN_NL_STAT_A_FAIL_ENOSPC,
	GPUPIN_NL_STAT_A_FAIL_EINVAL,
	GPUPIN_NL_STAT_A_FAIL_OTHER,
	GPUPIN_NL_STAT_A_CALLBACK_MAX_NS,
	GPUPIN_NL_STAT_A_PAD,
	GPUPIN_NL_STAT_A_DETACHED,	/* pins DETACHED now */
	GPUPIN_NL_STAT_A_DETACHED_BYTES,	/* bytes they hold (in BYTES_NOW too) */

	__GPUPIN_NL_STAT_A_MAX
};

#define GPUPIN_NL_STAT_A_MAX (__GPUPIN_NL_STAT_A_MAX - 1)

#endif /* _UAPI_GPUPIN_NETLINK_H */
