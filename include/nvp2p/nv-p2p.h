/* SPDX-License-Identifier: (GPL-2.0 OR MIT) */
/*
 * gpupin's own declaration of the documented NVIDIA nv-p2p kernel ABI.
 *
 * Written from NVIDIA's GPUDirect RDMA documentation (the kernel API of its
 * GPUDirect RDMA guide); what NVIDIA's driver does behind each call is in
 * kernel/sim/FIDELITY.md.  It is used when no NVIDIA driver sources are
 * given; the simulator (kernel/sim) implements it and gpupin.ko calls it.
 * It declares the newest layout gpupin knows (page table 2.0, R580 on);
 * gpupin also reads 1.2 tables (R535..R575), and the simulator hands out
 * either.
 *
 * With NVIDIA_SRC=... the driver's own nv-p2p.h is used instead.  The symbol
 * CRCs of a build against this header never match a real driver's (genksyms
 * hashes typedef spellings, every member and the expansion of struct
 * pci_dev), so a gpupin.ko for a real driver must be built against that
 * driver's sources: DKMS does it, `make check-nvidia` checks it.
 */
#ifndef _NV_P2P_H_
#define _NV_P2P_H_

#include <linux/types.h>

struct pci_dev;

enum nvidia_p2p_page_size_type {
	NVIDIA_P2P_PAGE_SIZE_4KB = 0,
	NVIDIA_P2P_PAGE_SIZE_64KB = 1,
	NVIDIA_P2P_PAGE_SIZE_128KB = 2,
	NVIDIA_P2P_PAGE_SIZE_COUNT
};

struct nvidia_p2p_page {
	u64 physical_address;
	union nvidia_p2p_request_registers {
		struct {
			u32 wreqmb_h;
			u32 rreqmb_h;
			u32 rreqmb_0;
			u32 reserved[3];
		} fermi;
	} registers;
};

#define NVIDIA_P2P_GPU_UUID_LEN 16

struct nvidia_p2p_page_table {
	u32 version;
	u32 page_size;		/* enum nvidia_p2p_page_size_type */
	struct nvidia_p2p_page **pages;
	u32 entries;
	u8 *gpu_uuid;		/* from version 1.2 on */
	u32 flags;		/* from version 2.0 on: not there in a 1.x table */
};

struct nvidia_p2p_dma_mapping {
	u32 version;
	enum nvidia_p2p_page_size_type page_size_type;
	u32 entries;
	u64 *dma_addresses;
	void *private;
	struct pci_dev *pci_dev;
};

#define NVIDIA_P2P_MAJOR_VERSION_MASK 0xffff0000
#define NVIDIA_P2P_MINOR_VERSION_MASK 0x0000ffff

#define NVIDIA_P2P_MAJOR_VERSION(v) (((v) & NVIDIA_P2P_MAJOR_VERSION_MASK) >> 16)
#define NVIDIA_P2P_MINOR_VERSION(v) ((v) & NVIDIA_P2P_MINOR_VERSION_MASK)

#define NVIDIA_P2P_MAJOR_VERSION_MATCHES(p, v)				\
	(NVIDIA_P2P_MAJOR_VERSION((p)->version) == NVIDIA_P2P_MAJOR_VERSION(v))

/* Same major, and a minor at least the one this code was written for. */
#define NVIDIA_P2P_VERSION_COMPATIBLE(p, v)				\
	(NVIDIA_P2P_MAJOR_VERSION_MATCHES(p, v) &&			\
	 NVIDIA_P2P_MINOR_VERSION((p)->version) >= NVIDIA_P2P_MINOR_VERSION(v))

#define NVIDIA_P2P_PAGE_TABLE_VERSION 0x00020000
#define NVIDIA_P2P_PAGE_TABLE_VERSION_COMPATIBLE(p)			\
	NVIDIA_P2P_VERSION_COMPATIBLE(p, NVIDIA_P2P_PAGE_TABLE_VERSION)

#define NVIDIA_P2P_DMA_MAPPING_VERSION 0x00020003
#define NVIDIA_P2P_DMA_MAPPING_VERSION_COMPATIBLE(p)			\
	NVIDIA_P2P_VERSION_COMPATIBLE(p, NVIDIA_P2P_DMA_MAPPING_VERSION)

#define NVIDIA_P2P_PAGE_TABLE_FLAGS_CPU_CACHEABLE 0x1

#define NVIDIA_P2P_CAP_GET_PAGES_PERSISTENT_API

int nvidia_p2p_get_pages(u64 p2p_token, u32 va_space_token,
			 u64 virtual_address, u64 length,
			 struct nvidia_p2p_page_table **page_table,
			 void (*free_callback)(void *data), void *data);

int nvidia_p2p_put_pages(u64 p2p_token, u32 va_space_token,
			 u64 virtual_address,
			 struct nvidia_p2p_page_table *page_table);

int nvidia_p2p_free_page_table(struct nvidia_p2p_page_table *page_table);

int nvidia_p2p_get_pages_persistent(u64 virtual_address, u64 length,
				    struct nvidia_p2p_page_table **page_table,
				    u32 flags);

int nvidia_p2p_put_pages_persistent(u64 virtual_address,
				    struct nvidia_p2p_page_table *page_table,
				    u32 flags);

int nvidia_p2p_dma_map_pages(struct pci_dev *peer,
			     struct nvidia_p2p_page_table *page_table,
			     struct nvidia_p2p_dma_mapping **dma_mapping);

int nvidia_p2p_dma_unmap_pages(struct pci_dev *peer,
			       struct nvidia_p2p_page_table *page_table,
			       struct nvidia_p2p_dma_mapping *dma_mapping);

int nvidia_p2p_free_dma_mapping(struct nvidia_p2p_dma_mapping *dma_mapping);

#endif /* _NV_P2P_H_ */
