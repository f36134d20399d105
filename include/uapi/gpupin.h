/* SPDX-License-Identifier: (GPL-2.0 WITH Linux-syscall-note) OR MIT */
/*
 * gpupin user-space ABI: /dev/gpupin ioctls, the validity map and the
 * invalidation records read from the file.
 *
 * Every structure is made of __u64/__u32/__u8 fields with explicit padding,
 * so it has one layout on every architecture and needs no compat handling.
 * Every "flags", "pad" and "reserved" field must be zero on input, or the
 * call fails with EINVAL; unknown commands fail with ENOTTY.
 *
 * Structure bodies in this file are read by the Python build (cffi cdef):
 * keep one field per line, literal array sizes and no nested types.
 */
#ifndef _UAPI_GPUPIN_H
#define _UAPI_GPUPIN_H

#include <linux/ioctl.h>
#include <linux/types.h>

#define GPUPIN_ABI_VERSION 2
#define GPUPIN_IOC_MAGIC 0xC7

/* GPU pages are 64 KiB: pins are widened to this alignment. */
#define GPUPIN_GPU_PAGE_SHIFT 16
#define GPUPIN_GPU_PAGE_SIZE 65536
#define GPUPIN_UUID_LEN 16
#define GPUPIN_NAME_LEN 32

/* gpupin_info.caps */
#define GPUPIN_CAP_PERSISTENT 0x1
#define GPUPIN_CAP_DMA_MAP 0x2
#define GPUPIN_CAP_SIMULATOR 0x4
#define GPUPIN_CAP_DMABUF 0x8		/* GPUPIN_IOC_PIN_DMABUF */

struct gpupin_info {
	__u32 abi_version;
	__u32 flags;
	__u32 caps;
	__u32 gpu_page_size;
	__u64 max_pinned_bytes;
	__u64 pinned_bytes;
	__u32 max_pins_per_file;
	__u32 file_pins;
	__u64 map_size;
	char version[32];
	char provider[32];
	__u64 reserved[4];
};

/* gpupin_pin.flags (in) and .pin_flags (out) */
#define GPUPIN_PIN_PERSISTENT 0x1
#define GPUPIN_PIN_FLAGS_ALL 0x1
/* .pin_flags (out) only: the pin imports a dma-buf (GPUPIN_IOC_PIN_DMABUF) */
#define GPUPIN_PIN_DMABUF 0x2
/*
 * .pin_flags (out) only: the provider tells gpupin when the memory goes (the
 * nv-p2p free callback of a non-persistent pin, move_notify of a dma-buf
 * exporter that can revoke), and gpupin then clears the validity word and
 * queues an invalidation record.  Without it (persistent pins; dma-bufs of a
 * static exporter, NVIDIA's among them) the pin holds the memory until
 * UNPIN and is never invalidated: the GPU memory stays allocated after
 * cuMemFree, a new allocation may get the same address with other memory,
 * and only a buffer-id check tells a stale pin.
 */
#define GPUPIN_PIN_REVOCABLE 0x4

/*
 * Pin [va, va + size), widened to 64 KiB GPU pages.  EINVAL: the range is
 * not GPU memory of the calling process (or spans allocations).  ENXIO: the
 * memory was freed while it was being pinned, also where the free came
 * between NVIDIA's pinning and the arming of its free callback.  ENOMEM: the
 * GPU's BAR1 is full (or gpupin's own memory, or a dmem region it could not
 * make).  ENOSPC: gpupin's module-wide max_pinned_bytes (or the file's
 * max_pins_per_file) would be passed.  EDQUOT: the caller's share
 * would be: its cgroup's dmem.max for the GPU's gpupin/<pci device>/bar1
 * region, or gpupin's max_file_pinned_bytes for this file
 * (Documentation/budgets.md).  A failed PIN holds nothing once it returned,
 * unless NVIDIA could not give its pages back (then they stay counted until
 * NVIDIA's free callback for them).  Also: EACCES (not the file's opener),
 * EOPNOTSUPP (no persistent pins on this driver, a non-persistent pin on a
 * driver whose get_pages can double-free, GPU pages other than 64 KiB),
 * EPROTO (a page-table version gpupin cannot read), EFAULT.
 */
struct gpupin_pin {
	__u64 va;
	__u64 size;
	__u64 user_tag;
	__u32 flags;
	__u32 pad;
	__u64 handle;
	__u64 aligned_va;
	__u64 aligned_size;
	__u32 page_size;
	__u32 entries;
	__u8 gpu_uuid[16];
	__u32 slot;
	__u32 pin_flags;
	__u64 valid_word;
	__u64 reserved[2];
};

struct gpupin_unpin {
	__u64 handle;
	__u32 flags;
	__u32 pad;
};

/* gpupin_query.state */
#define GPUPIN_STATE_PINNED 1
#define GPUPIN_STATE_INVALIDATED 2

struct gpupin_query {
	__u64 handle;
	__u32 flags;
	__u32 pad;
	__u64 va;
	__u64 size;
	__u64 aligned_va;
	__u64 aligned_size;
	__u64 user_tag;
	__u32 state;
	__u32 entries;
	__u32 dma_mappings;
	__u32 pin_flags;
	__u32 slot;
	__u32 page_size;
	__u64 reserved[2];
};

/* At most this many addresses per GET_PAGES or DMA_ADDRS call (EINVAL above). */
#define GPUPIN_MAX_ADDRS_PER_CALL 65536

/*
 * Physical addresses of pages [first, first + count): only for a file opened
 * by a process with CAP_SYS_ADMIN, and only to that process (EPERM
 * otherwise: also for a fork child or a process that received the fd).
 */
struct gpupin_get_pages {
	__u64 handle;
	__u64 addrs;
	__u32 first;
	__u32 count;
	__u32 flags;
	__u32 pad;
	__u64 reserved[2];
};

/*
 * Map a pin's pages for the PCI device domain:bus:devfn; mapping_id (out)
 * names the mapping.  Only for a file opened by a process with
 * CAP_SYS_ADMIN (EPERM otherwise): a mapping opens the memory to that
 * device.  Each call makes a new mapping, also for a device already mapped
 * (at most 16 per pin, ENOSPC beyond).  ENXIO: the memory is gone.
 *
 * Who maps:
 * - Persistent pins: nvidia_p2p_dma_map_pages (no free callback can race it).
 * - Non-persistent pins: gpupin itself, never NVIDIA.  NVIDIA's
 *   nvidia_p2p_dma_map_pages reads the page table, then waits for the
 *   driver lock that the free callback runs under, and links its mapping
 *   into the table afterwards: a free racing the call corrupts NVIDIA's
 *   heap, and the callback cannot wait for the mapper (deadlock).  gpupin's
 *   own mapping takes no NVIDIA lock, so the free callback waits for it and
 *   unmaps it.  BAR pages (discrete GPUs) go through dma_map_resource, as
 *   inside NVIDIA's call; the kernel's PCI peer-to-peer rules
 *   (CONFIG_PCI_P2PDMA), stricter than NVIDIA's, refuse a device (EOPNOTSUPP)
 *   only with gpupin's p2p_check parameter.  GPU memory with struct pages (coherent
 *   systems such as GH200) goes through dma_map_page: the device reaches it
 *   as system memory, never over FORCE_PCIE; use a persistent pin or a
 *   dma-buf for NVIDIA's own choice of path there.
 * - dma-buf pins: a dynamic attachment of the buffer for that device.
 */
struct gpupin_dma_map {
	__u64 handle;
	__u32 pci_domain;
	__u32 pci_bus;
	__u32 pci_devfn;
	__u32 flags;
	__u32 mapping_id;
	__u32 entries;
	__u64 reserved[2];
};

/*
 * DMA addresses of mapping entries [first, first + count): as GET_PAGES, for
 * the opener alone and with CAP_SYS_ADMIN (EPERM otherwise).
 */
struct gpupin_dma_addrs {
	__u64 handle;
	__u64 addrs;
	__u32 mapping_id;
	__u32 first;
	__u32 count;
	__u32 flags;
	__u64 reserved[2];
};

struct gpupin_dma_unmap {
	__u64 handle;
	__u32 mapping_id;
	__u32 flags;
	__u64 reserved[2];
};

/* gpupin_event.reason */
#define GPUPIN_INVAL_FREED 1	/* the GPU memory was freed, or its dma-buf revoked */
#define GPUPIN_INVAL_OVERFLOW 2	/* records were lost: revalidate every pin */

/* One record per invalidated pin, read() from the file; poll() says when. */
struct gpupin_event {
	__u64 handle;
	__u64 user_tag;
	__u32 reason;
	__u32 slot;
	__u64 reserved;
};

/* gpupin_pin_dmabuf.flags (in) */
#define GPUPIN_PIN_DMABUF_PCI_DEV 0x1	/* import for pci_domain:pci_bus:pci_devfn */
#define GPUPIN_PIN_DMABUF_FLAGS_ALL 0x1

/*
 * Pin [offset, offset + size) of a dma-buf (fd): offset is page aligned,
 * size > 0 and within the buffer.  The result is a pin like PIN's, with
 * page_size = the CPU page size and pin_flags GPUPIN_PIN_DMABUF; va and
 * aligned_va are offsets into the buffer.  The pin holds the buffer: user
 * space may close fd, and the memory stays until UNPIN.
 *
 * The importing device: an exporter maps a buffer for a device, and
 * NVIDIA's treats it as a PCI device (nv_dma_buf_attach reads its DMA mask
 * through to_pci_dev).  With GPUPIN_PIN_DMABUF_PCI_DEV gpupin imports the
 * buffer for that PCI device (ENODEV if there is none; like DMA_MAP, only
 * for a file opened with CAP_SYS_ADMIN, EPERM otherwise): GET_PAGES then
 * gives that device's bus addresses.  Without it (the PCI fields zero)
 * gpupin does not attach at all: the pin only holds the buffer, GET_PAGES
 * fails with EOPNOTSUPP, and DMA_MAP gives addresses for each device.
 *
 * Revocation: a dynamic exporter (one that can move or revoke its memory)
 * tells its importers through move_notify; gpupin then invalidates the pin
 * as the nv-p2p free callback does, and pin_flags has GPUPIN_PIN_REVOCABLE.
 * To hear it gpupin must be attached, so such a buffer needs
 * GPUPIN_PIN_DMABUF_PCI_DEV (EINVAL without).  A static exporter (NVIDIA's:
 * no pin/unpin, never move_notify, export holds the memory) never revokes:
 * cuMemFree frees nothing while the pin holds the buffer, and the pin is
 * never invalidated (no GPUPIN_PIN_REVOCABLE).  An exporter that revokes
 * the buffer while PIN_DMABUF imports it (before the pin is made) fails the
 * call with ENXIO; nothing is pinned.
 */
struct gpupin_pin_dmabuf {
	__s32 fd;
	__u32 flags;
	__u64 offset;
	__u64 size;
	__u64 user_tag;
	__u64 handle;			/* out, as in gpupin_pin ... */
	__u64 aligned_va;
	__u64 aligned_size;
	__u32 page_size;
	__u32 entries;
	__u8 gpu_uuid[16];		/* zero: a dma-buf names no GPU */
	__u32 slot;
	__u32 pin_flags;
	__u64 valid_word;		/* ... out */
	__u32 pci_domain;		/* in, with GPUPIN_PIN_DMABUF_PCI_DEV */
	__u32 pci_bus;
	__u32 pci_devfn;
	__u32 pad;
	__u64 reserved;
};

#define GPUPIN_IOC_INFO _IOWR(GPUPIN_IOC_MAGIC, 0x00, struct gpupin_info)
#define GPUPIN_IOC_PIN _IOWR(GPUPIN_IOC_MAGIC, 0x01, struct gpupin_pin)
#define GPUPIN_IOC_UNPIN _IOW(GPUPIN_IOC_MAGIC, 0x02, struct gpupin_unpin)
#define GPUPIN_IOC_QUERY _IOWR(GPUPIN_IOC_MAGIC, 0x03, struct gpupin_query)
#define GPUPIN_IOC_GET_PAGES _IOW(GPUPIN_IOC_MAGIC, 0x04, struct gpupin_get_pages)
#define GPUPIN_IOC_DMA_MAP _IOWR(GPUPIN_IOC_MAGIC, 0x05, struct gpupin_dma_map)
#define GPUPIN_IOC_DMA_ADDRS _IOW(GPUPIN_IOC_MAGIC, 0x06, struct gpupin_dma_addrs)
#define GPUPIN_IOC_DMA_UNMAP _IOW(GPUPIN_IOC_MAGIC, 0x07, struct gpupin_dma_unmap)
#define GPUPIN_IOC_PIN_DMABUF _IOWR(GPUPIN_IOC_MAGIC, 0x08, struct gpupin_pin_dmabuf)

#endif /* _UAPI_GPUPIN_H */
