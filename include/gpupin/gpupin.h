/* SPDX-License-Identifier: (GPL-2.0 OR MIT) */
/*
 * gpupin kernel API: lets a third-party device driver use a pin that a user
 * process made through /dev/gpupin, and program its DMA engine with it.
 *
 * Walk-through (see examples/peer/peer.c for a complete driver):
 *
 *   1. User space pins GPU memory (GPUPIN_IOC_PIN) and passes the gpupin file
 *      descriptor and the pin's handle to the driver's own ioctl.
 *   2. The driver calls gpupin_ref_get(fd, handle, notify, priv) from that
 *      ioctl (the fd must be a gpupin file opened by the calling process).
 *   3. It maps the pages for its PCI device: gpupin_ref_dma_map(ref, pdev).
 *   4. For each transfer: gpupin_access_begin(ref); read the bus addresses
 *      with gpupin_ref_dma_addr(); start the DMA; gpupin_access_end(ref) once
 *      the engine owns the descriptors (or, for a synchronous engine, when
 *      the transfer is done).  Inside an access call no gpupin_ref_dma_map()
 *      or gpupin_ref_put(), of this reference or another: they may wait for
 *      NVIDIA's lock, which a free callback holds while it waits for the
 *      open access to end (a deadlock).
 *   5. If the GPU memory is freed, gpupin calls notify(priv) from the GPU
 *      driver's free callback, before the pages go away.  The driver must
 *      stop DMA to these pages there and return.  Later accesses fail.
 *   6. gpupin_ref_put(ref) when done; this also drops the DMA mapping share.
 *
 * Contract of the notifier: it runs in process context with the GPU driver's
 * locks held.  Stop DMA to the pages, do not sleep for long, do not call
 * any gpupin function, take no lock that the driver holds while calling
 * gpupin_ref_get(), gpupin_ref_put(), gpupin_access_begin() or
 * gpupin_ref_dma_map(), and wait for no thread that may be inside one of
 * them (the callback holds the pin's reference list while notifiers run).
 * It is called at most once per reference, and not at all once
 * gpupin_ref_put() has returned.
 *
 * A reference keeps the pin and its gpupin file alive: the user's UNPIN or
 * close removes the handle, but the pages are released only when the last
 * driver reference goes.  NVIDIA's driver releases non-persistent pages only
 * for the process that pinned them: when that last put (or the file's last
 * close) happens in another context - a kworker, another process - gpupin
 * keeps the pin, its file and the module until the GPU memory's free
 * callback (the owner freeing the memory or exiting) instead.  A reference
 * never delays the free callback: when the GPU memory is freed the pages go
 * as soon as in-flight accesses end.
 * While any reference exists gpupin.ko cannot be unloaded.
 *
 * Pins made from a dma-buf (GPUPIN_IOC_PIN_DMABUF) work the same way: the
 * notifier runs from the exporter's move_notify (the buffer's reservation
 * lock held; only exporters that can revoke send it - NVIDIA's never does,
 * and its memory stays while the pin holds the buffer), pages are CPU
 * pages, and gpupin_ref_page_phys() gives the bus address for the device
 * the user imported the buffer for (0 when it named none).
 */
#ifndef _GPUPIN_KAPI_H
#define _GPUPIN_KAPI_H

#include <linux/types.h>

struct pci_dev;
struct gpupin_ref;

/**
 * struct gpupin_ref_info - what a reference covers
 * @va: the GPU virtual address the user pinned
 * @size: the size the user pinned
 * @aligned_va: @va rounded down to @page_size; page 0 starts here
 * @page_size: bytes per page (64 KiB; the CPU page size for dma-buf pins)
 * @entries: number of pages
 * @gpu_uuid: the GPU the pages belong to
 * @flags: GPUPIN_REF_*: what kind of pin it is
 */
struct gpupin_ref_info {
	u64 va;
	u64 size;
	u64 aligned_va;
	u32 page_size;
	u32 entries;
	u8 gpu_uuid[16];
	u32 flags;
};

/* gpupin_ref_info.flags (the same bits as the pin's GPUPIN_PIN_* flags of the UAPI) */
#define GPUPIN_REF_PERSISTENT 0x1	/* nv-p2p persistent: no free callback */
#define GPUPIN_REF_DMABUF 0x2		/* imported dma-buf: page addresses are bus addresses */
#define GPUPIN_REF_REVOCABLE 0x4	/* can be revoked: non-persistent, or revoking dma-buf */

/**
 * gpupin_ref_get() - take a reference to a user's pin
 * @fd: a /dev/gpupin file descriptor of the calling process
 * @handle: the pin's handle, as GPUPIN_IOC_PIN returned it
 * @notify: called when the GPU memory goes away (see the contract above);
 *          may be NULL for a driver that only ever accesses inside
 *          gpupin_access_begin()/gpupin_access_end()
 * @priv: passed to @notify
 *
 * Context: process context, from the ioctl of the process that owns @fd.
 * Return: a reference, or ERR_PTR(-EBADF) for a bad fd, -EINVAL when @fd is
 * not a gpupin file, -EACCES when another process opened it, -ENOENT for an
 * unknown handle, -ENODEV when the memory is already gone, -ENOMEM.
 */
struct gpupin_ref *gpupin_ref_get(int fd, u64 handle, void (*notify)(void *priv), void *priv);

/**
 * gpupin_ref_put() - drop a reference taken by gpupin_ref_get()
 * @ref: the reference
 *
 * Drops the reference's share of its DMA mapping; releases the pin if the
 * user already unpinned it and this was the last reference.  Must not be
 * called from the notifier or inside an access section.
 * Context: process context; may sleep.
 */
void gpupin_ref_put(struct gpupin_ref *ref);

/**
 * gpupin_ref_info() - describe the pinned range
 * @ref: the reference
 * @info: filled in
 *
 * Return: 0, or -ENODEV when the memory is gone.
 */
int gpupin_ref_info(struct gpupin_ref *ref, struct gpupin_ref_info *info);

/**
 * gpupin_ref_dma_map() - map the pages for a peer device
 * @ref: the reference
 * @pdev: the device that will DMA to the pages
 *
 * An existing mapping of the same pin for @pdev is shared.  One mapping per
 * reference: a second call for another device fails with -EBUSY; calls on
 * one reference are serialised.
 *
 * Who maps: for a persistent pin nvidia_p2p_dma_map_pages() (no free
 * callback can race it); for a non-persistent pin gpupin itself, because
 * NVIDIA's call corrupts its own heap when the memory is freed while it
 * waits for the driver lock, and a free callback cannot wait for it.
 * gpupin's mapping itself takes no NVIDIA lock: a racing free waits for it
 * and then unmaps it.  But the first mapping of a (GPU, @pdev) pair asks
 * NVIDIA's topology verdict (a persistent 64 KiB pin and
 * nvidia_p2p_dma_map_pages(), under NVIDIA's RM lock), so never call this
 * inside the access section of any reference.  BAR pages are mapped with
 * dma_map_resource(), as inside NVIDIA's call (with the p2p_check parameter
 * and CONFIG_PCI_P2PDMA, -EOPNOTSUPP where the kernel's PCI rules see no
 * peer-to-peer path from @pdev to the GPU); GPU memory
 * with struct pages (coherent systems) with dma_map_page(), so @pdev reaches
 * it as system memory, never over NVIDIA's FORCE_PCIE path.  For a dma-buf
 * pin: a dynamic attachment of the buffer to @pdev.
 * Context: process context; may sleep; may take NVIDIA's RM lock.  Do not
 * call it inside the access section of any reference, nor with a lock that
 * any of your notifiers takes.
 * Return: 0, -EINVAL for a NULL @pdev, -ENODEV when the memory is gone or
 * going, -ENOSPC past the per-pin mapping limit, -EOPNOTSUPP (no peer-to-peer path; or the
 * provider's -ENOTSUPP, which user space cannot name), -ENOMEM, -EPROTO for
 * an NVIDIA DMA mapping of a version gpupin cannot read (given back), or
 * the provider's error.
 */
int gpupin_ref_dma_map(struct gpupin_ref *ref, struct pci_dev *pdev);

/**
 * gpupin_access_begin() - start using the pages or their DMA addresses
 * @ref: the reference
 *
 * Until gpupin_access_end() the pages and the DMA mapping stay: a free
 * callback waits for the access to end - with NVIDIA's driver lock held -
 * so keep it short, never fault on user memory inside it (copy through a
 * kernel buffer), and call nothing that may wait for the GPU driver (no
 * nv-p2p call, no CUDA-side work).
 * Return: 0, or -ENODEV when the memory is gone (or going).
 */
int gpupin_access_begin(struct gpupin_ref *ref);

/**
 * gpupin_access_end() - end an access started by gpupin_access_begin()
 * @ref: the reference
 */
void gpupin_access_end(struct gpupin_ref *ref);

/**
 * gpupin_ref_page_phys() - physical address of one page
 * @ref: the reference, inside an access section
 * @idx: page index, below &gpupin_ref_info.entries
 *
 * For a dma-buf pin (GPUPIN_IOC_PIN_DMABUF) this is the page's bus address
 * for the PCI device the buffer was imported for, or 0 where the user named
 * none (map it with gpupin_ref_dma_map() instead).
 * Return: the address, or 0 for an index out of range.
 */
u64 gpupin_ref_page_phys(struct gpupin_ref *ref, u32 idx);

/**
 * gpupin_ref_dma_addr() - bus address of one page for the mapped device
 * @ref: the reference, mapped, inside an access section
 * @idx: page index, below &gpupin_ref_info.entries
 *
 * Return: the address, or 0 when @idx is out of range or @ref not mapped.
 */
dma_addr_t gpupin_ref_dma_addr(struct gpupin_ref *ref, u32 idx);

#endif /* _GPUPIN_KAPI_H */
