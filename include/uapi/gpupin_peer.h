/* SPDX-License-Identifier: (GPL-2.0 WITH Linux-syscall-note) OR MIT */
/*
 * gpupin_peer: the example peer driver's ioctls (examples/peer/peer.c).  It
 * stands for a third-party DMA engine: /dev/gpupin_peer copies between a
 * user buffer and GPU memory pinned through gpupin, using the pin's DMA
 * mapping for a PCI device.  Same rules as gpupin.h: zero flags, pad and
 * reserved fields; unknown commands fail with ENOTTY.
 */
#ifndef _UAPI_GPUPIN_PEER_H
#define _UAPI_GPUPIN_PEER_H

#include <linux/ioctl.h>
#include <linux/types.h>

#define GPUPIN_PEER_IOC_MAGIC 0xC9

/* gpupin_peer_xfer.flags */
#define GPUPIN_PEER_TO_GPU 0x1		/* user buffer -> GPU memory; else GPU -> buffer */
#define GPUPIN_PEER_XFER_FLAGS_ALL GPUPIN_PEER_TO_GPU

/*
 * Copy @length bytes at @offset from the start of the pin (its user va)
 * to or from @buf.  Returns 0, or -ENODEV/-EIO when the GPU memory went
 * away before or during the transfer; @done says how many bytes moved.
 */
struct gpupin_peer_xfer {
	__s32 gpupin_fd;
	__u32 flags;
	__u64 handle;
	__u64 offset;
	__u64 length;
	__u64 buf;
	__u64 done;			/* out */
	__u64 reserved[2];
};

/*
 * gpupin_peer_hold.flags: map the reference from a work item and from the
 * calling thread at once (a driver whose threads race to map one region).
 */
#define GPUPIN_PEER_HOLD_MAP_RACE 0x1
#define GPUPIN_PEER_HOLD_FLAGS_ALL GPUPIN_PEER_HOLD_MAP_RACE

/*
 * Hold a reference to the pin (with its DMA mapping) until RELEASE or
 * close: stands for a driver that keeps a registered memory region.
 */
struct gpupin_peer_hold {
	__s32 gpupin_fd;
	__u32 flags;
	__u64 handle;
	__u32 hold_id;			/* out; RELEASE takes it */
	__u32 pad;
	__u64 reserved[2];
};

/* gpupin_peer_release.flags: drop the reference from a kworker (waited for). */
#define GPUPIN_PEER_RELEASE_ASYNC 0x1

struct gpupin_peer_release {
	__u32 hold_id;
	__u32 flags;
};

/*
 * The peer file's view of its holds and transfers.  @ram_pages and
 * @bar_pages count GPU pages (or parts of one) copied since open through
 * the kernel's mapping of RAM (host pages, coherent GPU memory) and
 * through a write-combined mapping of a PCI BAR (a GPU's BAR1).
 */
struct gpupin_peer_status {
	__u32 holds;			/* references held */
	__u32 notified;			/* of which the GPU memory went away */
	__u64 transfers;		/* completed, since open */
	__u64 aborted;			/* stopped by an invalidation, since open */
	__u64 ram_pages;
	__u64 bar_pages;
};

#define GPUPIN_PEER_IOC_XFER _IOWR(GPUPIN_PEER_IOC_MAGIC, 0x00, struct gpupin_peer_xfer)
#define GPUPIN_PEER_IOC_HOLD _IOWR(GPUPIN_PEER_IOC_MAGIC, 0x01, struct gpupin_peer_hold)
#define GPUPIN_PEER_IOC_RELEASE _IOW(GPUPIN_PEER_IOC_MAGIC, 0x02, struct gpupin_peer_release)
#define GPUPIN_PEER_IOC_STATUS _IOR(GPUPIN_PEER_IOC_MAGIC, 0x03, struct gpupin_peer_status)

#endif /* _UAPI_GPUPIN_PEER_H */
