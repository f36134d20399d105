/* SPDX-License-Identifier: (GPL-2.0 WITH Linux-syscall-note) OR MIT */
/*
 * nvp2p_sim user-space ABI: /dev/nvp2p_sim lets a process allocate, read,
 * write, query and free simulated GPU memory that the simulator's nv-p2p
 * functions then pin.  Each open file is one simulated CUDA context with its
 * own address range; closing it frees everything, running the free callbacks
 * of the pins on it.  Same rules as gpupin.h: zero flags/pad/reserved.
 */
#ifndef _UAPI_NVP2P_SIM_H
#define _UAPI_NVP2P_SIM_H

#include <linux/ioctl.h>
#include <linux/types.h>

#define NVP2P_SIM_IOC_MAGIC 0xC8

struct nvp2p_sim_alloc {
	__u64 size;
	__u32 flags;
	__u32 pad;
	__u64 va;
	__u64 alloc_size;
	__u64 buffer_id;
	__u64 reserved[2];
};

struct nvp2p_sim_free {
	__u64 va;
	__u32 flags;
	__u32 pad;
};

struct nvp2p_sim_query {
	__u64 va;
	__u32 flags;
	__u32 pad;
	__u64 base;
	__u64 size;
	__u64 buffer_id;
	__u64 reserved[2];
};

/* nvp2p_sim_rw.flags */
#define NVP2P_SIM_RW_WRITE 0x1

struct nvp2p_sim_rw {
	__u64 va;
	__u64 len;
	__u64 buf;
	__u32 flags;
	__u32 pad;
};

/* nvp2p_sim_export.flags */
#define NVP2P_SIM_EXPORT_REVOCABLE 0x1

/*
 * Export the allocation holding va as a dma-buf.  By default the exporter
 * behaves like NVIDIA's (nv-dmabuf.c): static (no pin/unpin, never
 * move_notify), the export holds the memory until the last reference to the
 * buffer drops (freeing the allocation frees nothing meanwhile), and only PCI
 * devices may attach.  With NVP2P_SIM_EXPORT_REVOCABLE it is a dynamic
 * exporter that revokes the buffer through move_notify when the allocation
 * is freed (as amdgpu or vfio-pci do).  fd (out) is O_CLOEXEC; base and size
 * (out) say what it covers.
 */
struct nvp2p_sim_export {
	__u64 va;
	__u32 flags;
	__s32 fd;
	__u64 base;
	__u64 size;
	__u64 reserved[2];
};

struct nvp2p_sim_stats {
	__u64 pinned_pages;
	__u64 bar_bytes;
	__u64 live_callbacks;
	__u64 page_tables;
	__u64 dma_mappings;
	__u64 allocations;
	__u64 alloc_bytes;
	__u64 get_pages_calls;
	__u64 callbacks_run;
	__u64 tables_not_freed;
	__u64 mappings_not_freed;
	__u64 quarantine_bytes;		/* freed memory held poisoned */
	__u64 poison_errors;		/* freed 64 KiB chunks written after the free */
	__u64 dmabuf_exports;		/* live dma-bufs exported by EXPORT */
	__u64 dmabuf_mappings;		/* their attachments' live mappings */
	__u64 use_after_free_calls;	/* calls with what NVIDIA's driver has freed */
	__u64 puts_not_found;		/* put_pages from another process: 0, nothing released */
	__u64 lock_timeouts;		/* API lock waits given up: a real-driver deadlock */
	__u64 callback_overruns;	/* free callbacks that ran past callback_timeout_ms */
	__u64 dma_map_races;		/* dma_map_pages on a table freed while it waited */
	__u64 dmabuf_attachments;	/* importers attached to the exported dma-bufs */
	__u64 dmabuf_pins;		/* their pins (dynamic importers' dma_buf_pin) */
	__u64 dmabuf_nonpci_attaches;	/* attaches by a non-PCI device to an NVIDIA-like export */
	__u64 stale_table_puts;		/* put_pages of a freed table that hit a newer pin */
	__u64 unmap_peer_mismatches;	/* dma_unmap_pages with another peer than the mapping's */
	__u64 put_kind_mismatches;	/* a put of the other kind than the table's get */
};

#define NVP2P_SIM_IOC_ALLOC _IOWR(NVP2P_SIM_IOC_MAGIC, 0x00, struct nvp2p_sim_alloc)
#define NVP2P_SIM_IOC_FREE _IOW(NVP2P_SIM_IOC_MAGIC, 0x01, struct nvp2p_sim_free)
#define NVP2P_SIM_IOC_QUERY _IOWR(NVP2P_SIM_IOC_MAGIC, 0x02, struct nvp2p_sim_query)
#define NVP2P_SIM_IOC_RW _IOW(NVP2P_SIM_IOC_MAGIC, 0x03, struct nvp2p_sim_rw)
#define NVP2P_SIM_IOC_STATS _IOR(NVP2P_SIM_IOC_MAGIC, 0x04, struct nvp2p_sim_stats)
#define NVP2P_SIM_IOC_EXPORT _IOWR(NVP2P_SIM_IOC_MAGIC, 0x05, struct nvp2p_sim_export)
/*
 * Zero the counters of strict misuse (use_after_free_calls, puts_not_found,
 * lock_timeouts, callback_overruns, dma_map_races, dmabuf_nonpci_attaches,
 * stale_table_puts, unmap_peer_mismatches, put_kind_mismatches): for a test that provoked them
 * on purpose and checked them.  The other counters are left alone.
 */
#define NVP2P_SIM_IOC_RESET_MISUSE _IO(NVP2P_SIM_IOC_MAGIC, 0x06)

#endif /* _UAPI_NVP2P_SIM_H */
