/* SPDX-License-Identifier: (GPL-2.0 OR MIT) */
/*
 * gpupin: what differs between the kernels gpupin builds for (Debian 12's
 * 6.1 to the newest Debian carries), in one place.  The logic uses only the
 * names below; each says from which kernel the newer form applies.
 */
#ifndef GPUPIN_COMPAT_H
#define GPUPIN_COMPAT_H

#include <linux/mm.h>
#include <linux/module.h>
#include <linux/version.h>
#include <net/genetlink.h>

/* 6.13: MODULE_IMPORT_NS() takes the namespace as a string literal. */
#if LINUX_VERSION_CODE >= KERNEL_VERSION(6, 13, 0)
#define GPUPIN_IMPORT_NS_DMA_BUF() MODULE_IMPORT_NS("DMA_BUF")
#else
#define GPUPIN_IMPORT_NS_DMA_BUF() MODULE_IMPORT_NS(DMA_BUF)
#endif

/* 6.3: vma->vm_flags is read-only; vm_flags_mod() sets and clears under the mmap lock. */
static inline void gpupin_vm_flags_mod(struct vm_area_struct *vma, vm_flags_t set, vm_flags_t clear)
{
#if LINUX_VERSION_CODE >= KERNEL_VERSION(6, 3, 0)
	vm_flags_mod(vma, set, clear);
#else
	vma->vm_flags = (vma->vm_flags | set) & ~clear;
#endif
}

/* 6.6: a dump's parsed attributes moved into a genl_info (genl_info_dump()). */
static inline struct nlattr **gpupin_genl_dump_attrs(struct netlink_callback *cb)
{
#if LINUX_VERSION_CODE >= KERNEL_VERSION(6, 6, 0)
	return genl_info_dump(cb)->attrs;
#else
	return genl_dumpit_info(cb)->attrs;
#endif
}

/*
 * 7.0: dma-buf's move notification is "invalidate mappings": the importer's
 * op and the exporter's call were renamed in separate commits, so Kbuild
 * looks for each in the headers.
 */
#ifdef GPUPIN_HAVE_DMABUF_INVALIDATE_MAPPINGS_OP
#define GPUPIN_DMABUF_MOVE_OP invalidate_mappings
#else
#define GPUPIN_DMABUF_MOVE_OP move_notify
#endif
#ifdef GPUPIN_HAVE_DMABUF_INVALIDATE_MAPPINGS
#define gpupin_dma_buf_move_notify(dmabuf) dma_buf_invalidate_mappings(dmabuf)
#else
#define gpupin_dma_buf_move_notify(dmabuf) dma_buf_move_notify(dmabuf)
#endif

/*
 * Newer kernels (7.2 has it): struct dma_map_ops has map_phys, which maps
 * MMIO too (DMA_ATTR_MMIO, what dma_map_resource passes), instead of
 * map_resource; Kbuild looks in the headers.
 */
#ifdef GPUPIN_HAVE_DMA_MAP_PHYS_OP
#define gpupin_dma_ops_map_mmio(ops) ((ops)->map_phys)
#else
#define gpupin_dma_ops_map_mmio(ops) ((ops)->map_resource)
#endif

#ifdef CONFIG_FAULT_INJECTION_DEBUG_FS
#include <linux/dcache.h>
#include <linux/fault-inject.h>
/*
 * fault_create_debugfs_attr() keeps a reference to the directory in
 * attr->dname where that is a dentry (6.1, 7.x); some stable kernels keep its
 * name instead (Debian's 6.12).  A module drops the reference at unload.
 */
static inline void gpupin_fault_attr_put_dname(struct fault_attr *attr)
{
	struct dentry *d = __builtin_choose_expr(__builtin_types_compatible_p(typeof(attr->dname),
									 struct dentry *),
						 (struct dentry *)attr->dname, NULL);

	dput(d);
}
#endif

/*
 * 6.14: the dmem cgroup controller (include/linux/cgroup_dmem.h, found by
 * Kbuild in the headers, backports too; its calls are stubs where
 * CONFIG_CGROUP_DMEM is off).  Without the header, the same stubs here.
 * GPUPIN_DMEM: whether pins are charged to it.
 */
#ifdef GPUPIN_HAVE_CGROUP_DMEM_H
#include <linux/cgroup_dmem.h>
#define GPUPIN_DMEM IS_ENABLED(CONFIG_CGROUP_DMEM)
#else
#define GPUPIN_DMEM 0

struct dmem_cgroup_region;
struct dmem_cgroup_pool_state;

static inline __printf(2, 3) struct dmem_cgroup_region *
dmem_cgroup_register_region(u64 size, const char *name_fmt, ...)
{
	return NULL;
}

static inline void dmem_cgroup_unregister_region(struct dmem_cgroup_region *region)
{
}

static inline int dmem_cgroup_try_charge(struct dmem_cgroup_region *region, u64 size,
					 struct dmem_cgroup_pool_state **ret_pool,
					 struct dmem_cgroup_pool_state **ret_limit_pool)
{
	*ret_pool = NULL;
	if (ret_limit_pool)
		*ret_limit_pool = NULL;
	return 0;
}

static inline void dmem_cgroup_uncharge(struct dmem_cgroup_pool_state *pool, u64 size)
{
}

static inline void dmem_cgroup_pool_state_put(struct dmem_cgroup_pool_state *pool)
{
}
#endif

#endif /* GPUPIN_COMPAT_H */
