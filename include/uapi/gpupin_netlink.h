/* SPDX-License-Identifier: ((GPL-2.0 WITH Linux-syscall-note) OR MIT) */
/*
 * Do not edit: generated from Documentation/netlink/specs/gpupin.yaml
 * by scripts/gen-netlink-header.py; run `make netlink-header`.
 */

/*
 * Introspection of gpupin, the GPU memory pinning module: who has what pinned,
 * global counters, and events (pinned, unpinned, invalidated, budget
 * exhausted) on the multicast group "events", for CAP_NET_ADMIN listeners
 * only. Unprivileged callers see only the pins of their own thread group;
 * CAP_NET_ADMIN or CAP_SYS_ADMIN see all. PIDs are global (init namespace)
 * thread-group ids.
 *
 * Requests are validated strictly, against a policy per command: unknown
 * attributes and wrong types are rejected with an extended-ACK message.
 * GET_INFO, GET_STATS and SUBSCRIBE take no attribute, GET_PINS only PID (a
 * filter, at least 1), GET_PIN needs PID and HANDLE. Events are messages of
 * the commands PINNED, UNPINNED, INVALIDATED and BUDGET_EXHAUSTED.
 */
#ifndef _UAPI_GPUPIN_NETLINK_H
#define _UAPI_GPUPIN_NETLINK_H

#define GPUPIN_NL_FAMILY_NAME	"gpupin"
#define GPUPIN_NL_VERSION	1

/**
 * enum gpupin_nl_reason - Why a pin went (INVALIDATED and UNPINNED events).
 * @GPUPIN_NL_REASON_FREED: The GPU memory was freed (the provider's free
 *   callback).
 * @GPUPIN_NL_REASON_UNPIN: The UNPIN ioctl.
 * @GPUPIN_NL_REASON_CLOSE: The file was closed.
 * @GPUPIN_NL_REASON_PROCESS_EXIT: The owning process died.
 */
enum gpupin_nl_reason {
	GPUPIN_NL_REASON_FREED = 1,
	GPUPIN_NL_REASON_UNPIN,
	GPUPIN_NL_REASON_CLOSE,
	GPUPIN_NL_REASON_PROCESS_EXIT,
};

/**
 * enum gpupin_nl_state - The state of a pin. Pinned and invalidated have the
 * numbers of GPUPIN_STATE_* in the ioctl ABI (gpupin.h).
 * @GPUPIN_NL_STATE_PINNED: Usable.
 * @GPUPIN_NL_STATE_INVALIDATED: The GPU memory went; only the handle is left.
 * @GPUPIN_NL_STATE_DETACHED: Released where its pages could not be put
 *   (another process closed the last file reference): in no handle table, but
 *   its pages, BAR space and share of max-pinned-bytes stay until the GPU
 *   driver frees the memory (its owner frees it or exits). In the dump only.
 */
enum gpupin_nl_state {
	GPUPIN_NL_STATE_PINNED = 1,
	GPUPIN_NL_STATE_INVALIDATED,
	GPUPIN_NL_STATE_DETACHED,
};

/**
 * enum gpupin_nl_attr - The top-level attributes.
 * @GPUPIN_NL_A_PID: (u32) Global thread-group id (GET_PINS filter, GET_PIN
 *   owner, BUDGET_EXHAUSTED).
 * @GPUPIN_NL_A_HANDLE: (u64) A pin's handle in its file.
 * @GPUPIN_NL_A_PIN: (nest of GPUPIN_NL_PIN_A_*)
 * @GPUPIN_NL_A_ABI_VERSION: (u32)
 * @GPUPIN_NL_A_VERSION: (string)
 * @GPUPIN_NL_A_PROVIDER: (string)
 * @GPUPIN_NL_A_CAPS: (u32)
 * @GPUPIN_NL_A_MAX_PINNED_BYTES: (u64)
 * @GPUPIN_NL_A_PINNED_BYTES: (u64)
 * @GPUPIN_NL_A_MAX_PINS_PER_FILE: (u32)
 * @GPUPIN_NL_A_STATS: (nest of GPUPIN_NL_STAT_A_*)
 * @GPUPIN_NL_A_SIZE: (u64) BUDGET_EXHAUSTED - the bytes asked for.
 * @GPUPIN_NL_A_PAD: (pad)
 */
enum gpupin_nl_attr {
	GPUPIN_NL_A_UNSPEC,
	GPUPIN_NL_A_PID,
	GPUPIN_NL_A_HANDLE,
	GPUPIN_NL_A_PIN,
	GPUPIN_NL_A_ABI_VERSION,
	GPUPIN_NL_A_VERSION,
	GPUPIN_NL_A_PROVIDER,
	GPUPIN_NL_A_CAPS,
	GPUPIN_NL_A_MAX_PINNED_BYTES,
	GPUPIN_NL_A_PINNED_BYTES,
	GPUPIN_NL_A_MAX_PINS_PER_FILE,
	GPUPIN_NL_A_STATS,
	GPUPIN_NL_A_SIZE,
	GPUPIN_NL_A_PAD,

	__GPUPIN_NL_A_MAX
};

#define GPUPIN_NL_A_MAX (__GPUPIN_NL_A_MAX - 1)

/**
 * enum gpupin_nl_pin_attr - The attributes of one pin (the PIN nest).
 * @GPUPIN_NL_PIN_A_PID: (u32) Owner thread group.
 * @GPUPIN_NL_PIN_A_FILE_ID: (u64) Which open of /dev/gpupin.
 * @GPUPIN_NL_PIN_A_HANDLE: (u64)
 * @GPUPIN_NL_PIN_A_VA: (u64)
 * @GPUPIN_NL_PIN_A_SIZE: (u64)
 * @GPUPIN_NL_PIN_A_ALIGNED_VA: (u64)
 * @GPUPIN_NL_PIN_A_ALIGNED_SIZE: (u64)
 * @GPUPIN_NL_PIN_A_ENTRIES: (u32)
 * @GPUPIN_NL_PIN_A_PAGE_SIZE: (u32)
 * @GPUPIN_NL_PIN_A_STATE: (u32, enum gpupin_nl_state)
 * @GPUPIN_NL_PIN_A_PERSISTENT: (flag)
 * @GPUPIN_NL_PIN_A_CREATED_NS: (u64) CLOCK_REALTIME.
 * @GPUPIN_NL_PIN_A_USER_TAG: (u64)
 * @GPUPIN_NL_PIN_A_DMA_PEER: (string, repeated) PCI name of a device the pin
 *   is DMA-mapped for, once per mapping.
 * @GPUPIN_NL_PIN_A_REASON: (u32, enum gpupin_nl_reason) Events only.
 * @GPUPIN_NL_PIN_A_PAD: (pad)
 * @GPUPIN_NL_PIN_A_GPU_UUID: (binary) The UUID of the GPU the pages are on, 16
 *   bytes, as NVIDIA's page table gives it (nvidia-smi prints it as
 *   GPU-xxxxxxxx-...); zeros where the provider names no GPU (dma-buf pins).
 */
enum gpupin_nl_pin_attr {
	GPUPIN_NL_PIN_A_UNSPEC,
	GPUPIN_NL_PIN_A_PID,
	GPUPIN_NL_PIN_A_FILE_ID,
	GPUPIN_NL_PIN_A_HANDLE,
	GPUPIN_NL_PIN_A_VA,
	GPUPIN_NL_PIN_A_SIZE,
	GPUPIN_NL_PIN_A_ALIGNED_VA,
	GPUPIN_NL_PIN_A_ALIGNED_SIZE,
	GPUPIN_NL_PIN_A_ENTRIES,
	GPUPIN_NL_PIN_A_PAGE_SIZE,
	GPUPIN_NL_PIN_A_STATE,
	GPUPIN_NL_PIN_A_PERSISTENT,
	GPUPIN_NL_PIN_A_CREATED_NS,
	GPUPIN_NL_PIN_A_USER_TAG,
	GPUPIN_NL_PIN_A_DMA_PEER,
	GPUPIN_NL_PIN_A_REASON,
	GPUPIN_NL_PIN_A_PAD,
	GPUPIN_NL_PIN_A_GPU_UUID,

	__GPUPIN_NL_PIN_A_MAX
};

#define GPUPIN_NL_PIN_A_MAX (__GPUPIN_NL_PIN_A_MAX - 1)

/**
 * enum gpupin_nl_stat_attr - Global counters (the STATS nest), all u64. New
 * counters go at the end, after PAD: the numbers of the others never change.
 * @GPUPIN_NL_STAT_A_PINS: (u64)
 * @GPUPIN_NL_STAT_A_UNPINS: (u64)
 * @GPUPIN_NL_STAT_A_INVAL_FREED: (u64)
 * @GPUPIN_NL_STAT_A_INVAL_PROCESS_EXIT: (u64)
 * @GPUPIN_NL_STAT_A_DMA_MAPS: (u64)
 * @GPUPIN_NL_STAT_A_BYTES_NOW: (u64)
 * @GPUPIN_NL_STAT_A_BYTES_PEAK: (u64)
 * @GPUPIN_NL_STAT_A_FAIL_ENOMEM: (u64)
 * @GPUPIN_NL_STAT_A_FAIL_ENOSPC: (u64)
 * @GPUPIN_NL_STAT_A_FAIL_EINVAL: (u64)
 * @GPUPIN_NL_STAT_A_FAIL_OTHER: (u64)
 * @GPUPIN_NL_STAT_A_CALLBACK_MAX_NS: (u64)
 * @GPUPIN_NL_STAT_A_PAD: (pad)
 * @GPUPIN_NL_STAT_A_DETACHED: (u64) Pins detached now (see the state enum).
 * @GPUPIN_NL_STAT_A_DETACHED_BYTES: (u64) The bytes detached pins hold
 *   (counted in bytes-now too).
 * @GPUPIN_NL_STAT_A_FAIL_EDQUOT: (u64) Pins refused by a quota: the pinning
 *   file's max_file_pinned_bytes, or the dmem cgroup limit of the pinning
 *   task's cgroup (EDQUOT).
 */
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
	GPUPIN_NL_STAT_A_DETACHED,
	GPUPIN_NL_STAT_A_DETACHED_BYTES,
	GPUPIN_NL_STAT_A_FAIL_EDQUOT,

	__GPUPIN_NL_STAT_A_MAX
};

#define GPUPIN_NL_STAT_A_MAX (__GPUPIN_NL_STAT_A_MAX - 1)

/**
 * enum gpupin_nl_cmd - The commands and events.
 * @GPUPIN_NL_CMD_UNSPEC: Not a command.
 * @GPUPIN_NL_CMD_GET_INFO: (do) The facts of the INFO ioctl.
 * @GPUPIN_NL_CMD_GET_PINS: (dump) One message per pin the caller may see,
 *   detached pins last; PID keeps one thread group's.
 * @GPUPIN_NL_CMD_GET_STATS: (do) Global counters.
 * @GPUPIN_NL_CMD_GET_PIN: (do) One pin, by owner thread group (PID) and
 *   HANDLE, both required.
 * @GPUPIN_NL_CMD_PINNED: (event, group "events") A pin was made.
 * @GPUPIN_NL_CMD_UNPINNED: (event, group "events") A pin went (reason in the
 *   pin's REASON).
 * @GPUPIN_NL_CMD_INVALIDATED: (event, group "events") The GPU memory under a
 *   pin was freed.
 * @GPUPIN_NL_CMD_BUDGET_EXHAUSTED: (event, group "events") A pin was refused
 *   by the module-wide max_pinned_bytes (ENOSPC); not sent for a quota
 *   (EDQUOT: max_file_pinned_bytes, dmem.max) or a full slot table.
 * @GPUPIN_NL_CMD_SUBSCRIBE: (do, admin-perm) Deliver events to this socket by
 *   unicast. Kernels whose generic netlink cannot restrict a multicast group
 *   to CAP_NET_ADMIN (6.1.y before the GENL_MCAST_CAP_NET_ADMIN backport)
 *   register no "events" group; listeners subscribe with this instead.
 */
enum gpupin_nl_cmd {
	GPUPIN_NL_CMD_UNSPEC,
	GPUPIN_NL_CMD_GET_INFO,
	GPUPIN_NL_CMD_GET_PINS,
	GPUPIN_NL_CMD_GET_STATS,
	GPUPIN_NL_CMD_GET_PIN,
	GPUPIN_NL_CMD_PINNED,
	GPUPIN_NL_CMD_UNPINNED,
	GPUPIN_NL_CMD_INVALIDATED,
	GPUPIN_NL_CMD_BUDGET_EXHAUSTED,
	GPUPIN_NL_CMD_SUBSCRIBE,

	__GPUPIN_NL_CMD_MAX
};

#define GPUPIN_NL_CMD_MAX (__GPUPIN_NL_CMD_MAX - 1)

#define GPUPIN_NL_MCGRP_EVENTS	"events"

#endif /* _UAPI_GPUPIN_NETLINK_H */
