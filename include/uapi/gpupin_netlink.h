/* SPDX-License-Identifier: (GPL-2.0 WITH Linux-syscall-note) OR MIT */
/*
 * gpupin generic-netlink family "gpupin", version 1: introspection (who has
 * what pinned), global counters, and an event stream (multicast group
 * "events", CAP_NET_ADMIN only).
 *
 * Requests are validated strictly: unknown attributes and wrong types are
 * rejected with an extended-ACK message.  Unprivileged callers see only the
 * pins of their own thread group; CAP_NET_ADMIN or CAP_SYS_ADMIN see all.
 * Written as defines so the Python build (cffi) can read them.
 */
#ifndef _UAPI_GPUPIN_NETLINK_H
#define _UAPI_GPUPIN_NETLINK_H

#define GPUPIN_NL_FAMILY_NAME "gpupin"
#define GPUPIN_NL_VERSION 1
#define GPUPIN_NL_MCGRP_EVENTS "events"

/* Commands; events reuse the numbers from PINNED on. */
#define GPUPIN_NL_CMD_UNSPEC 0
#define GPUPIN_NL_CMD_GET_INFO 1	/* doit: the facts of the INFO ioctl */
#define GPUPIN_NL_CMD_GET_PINS 2	/* dump: one message per pin */
#define GPUPIN_NL_CMD_GET_STATS 3	/* doit: global counters */
#define GPUPIN_NL_CMD_GET_PIN 4		/* doit: one pin; needs PID and HANDLE */
#define GPUPIN_NL_CMD_PINNED 5		/* event */
#define GPUPIN_NL_CMD_UNPINNED 6	/* event */
#define GPUPIN_NL_CMD_INVALIDATED 7	/* event */
#define GPUPIN_NL_CMD_BUDGET_EXHAUSTED 8	/* event */
/*
 * doit, CAP_NET_ADMIN: deliver events to this socket by unicast.  Kernels whose
 * generic netlink cannot restrict a multicast group to CAP_NET_ADMIN (6.1.y
 * before the GENL_MCAST_CAP_NET_ADMIN backport) register no "events" group;
 * listeners subscribe with this command instead.
 */
#define GPUPIN_NL_CMD_SUBSCRIBE 9

/* Top-level attributes. */
#define GPUPIN_NL_A_UNSPEC 0
#define GPUPIN_NL_A_PID 1		/* u32: thread group (request filter, pin owner) */
#define GPUPIN_NL_A_HANDLE 2		/* u64 */
#define GPUPIN_NL_A_PIN 3		/* nested GPUPIN_NL_PIN_A_* */
#define GPUPIN_NL_A_ABI_VERSION 4	/* u32 */
#define GPUPIN_NL_A_VERSION 5		/* string */
#define GPUPIN_NL_A_PROVIDER 6		/* string */
#define GPUPIN_NL_A_CAPS 7		/* u32 */
#define GPUPIN_NL_A_MAX_PINNED_BYTES 8	/* u64 */
#define GPUPIN_NL_A_PINNED_BYTES 9	/* u64 */
#define GPUPIN_NL_A_MAX_PINS_PER_FILE 10	/* u32 */
#define GPUPIN_NL_A_STATS 11		/* nested GPUPIN_NL_STAT_A_* */
#define GPUPIN_NL_A_SIZE 12		/* u64: BUDGET_EXHAUSTED: bytes asked for */
#define GPUPIN_NL_A_PAD 13
#define GPUPIN_NL_A_MAX 13

/* Attributes of one pin (GPUPIN_NL_A_PIN). */
#define GPUPIN_NL_PIN_A_UNSPEC 0
#define GPUPIN_NL_PIN_A_PID 1		/* u32: owner thread group */
#define GPUPIN_NL_PIN_A_FILE_ID 2	/* u64: which open of /dev/gpupin */
#define GPUPIN_NL_PIN_A_HANDLE 3	/* u64 */
#define GPUPIN_NL_PIN_A_VA 4		/* u64 */
#define GPUPIN_NL_PIN_A_SIZE 5		/* u64 */
#define GPUPIN_NL_PIN_A_ALIGNED_VA 6	/* u64 */
#define GPUPIN_NL_PIN_A_ALIGNED_SIZE 7	/* u64 */
#define GPUPIN_NL_PIN_A_ENTRIES 8	/* u32 */
#define GPUPIN_NL_PIN_A_PAGE_SIZE 9	/* u32 */
#define GPUPIN_NL_PIN_A_STATE 10	/* u32: GPUPIN_STATE_* */
#define GPUPIN_NL_PIN_A_PERSISTENT 11	/* flag */
#define GPUPIN_NL_PIN_A_CREATED_NS 12	/* u64: CLOCK_REALTIME */
#define GPUPIN_NL_PIN_A_USER_TAG 13	/* u64 */
#define GPUPIN_NL_PIN_A_DMA_PEER 14	/* string, once per DMA mapping */
#define GPUPIN_NL_PIN_A_REASON 15	/* u32: GPUPIN_NL_REASON_* (events) */
#define GPUPIN_NL_PIN_A_PAD 16
#define GPUPIN_NL_PIN_A_MAX 16

/* Why a pin went (INVALIDATED and UNPINNED events). */
#define GPUPIN_NL_REASON_FREED 1	/* GPU memory freed: the provider's callback */
#define GPUPIN_NL_REASON_UNPIN 2	/* UNPIN ioctl */
#define GPUPIN_NL_REASON_CLOSE 3	/* the file was closed */
#define GPUPIN_NL_REASON_PROCESS_EXIT 4	/* the owning process died */

/* Global counters (GPUPIN_NL_A_STATS), all u64. */
#define GPUPIN_NL_STAT_A_UNSPEC 0
#define GPUPIN_NL_STAT_A_PINS 1
#define GPUPIN_NL_STAT_A_UNPINS 2
#define GPUPIN_NL_STAT_A_INVAL_FREED 3
#define GPUPIN_NL_STAT_A_INVAL_PROCESS_EXIT 4
#define GPUPIN_NL_STAT_A_DMA_MAPS 5
#define GPUPIN_NL_STAT_A_BYTES_NOW 6
#define GPUPIN_NL_STAT_A_BYTES_PEAK 7
#define GPUPIN_NL_STAT_A_FAIL_ENOMEM 8
#define GPUPIN_NL_STAT_A_FAIL_ENOSPC 9
#define GPUPIN_NL_STAT_A_FAIL_EINVAL 10
#define GPUPIN_NL_STAT_A_FAIL_OTHER 11
#define GPUPIN_NL_STAT_A_CALLBACK_MAX_NS 12
#define GPUPIN_NL_STAT_A_PAD 13
#define GPUPIN_NL_STAT_A_MAX 13

#endif /* _UAPI_GPUPIN_NETLINK_H */
