/* SPDX-License-Identifier: (GPL-2.0 OR MIT) */
/*
 * gpupin internals.
 *
 * Locking, outermost first:
 *   gpupin_cb_reg_lock (mutex, gpupin_cb.ko: kernel/cb/tramp.c) - the
 *       registration of gpupin_free_callback() as the trampoline's handler.
 *       Taken by gpupin's module init and exit alone (no other lock held;
 *       synchronize_rcu() after dropping it), never by a callback.
 *   gpupin_ref.map_lock (mutex, kapi.c) - serialises one reference's
 *       gpupin_ref_dma_map() calls; the topology probe below may run under
 *       it.
 *   gpupin_p2p_tables (mutex, nvp2p.c) - keeps nv-p2p put_pages and get_pages
 *       (the topology probe's, topo.c, and the BAR1 probe's before a pin's
 *       dmem charge, nvp2p.c, too) apart, so that a put never finds
 *       a newer pin at a freed table's address.  Held around those calls
 *       only, with no gpupin lock but a reference's map_lock (so:
 *       map_lock -> gpupin_p2p_tables -> NVIDIA's RM lock); never taken by
 *       the free callback.
 *   gpupin_topo_lock (mutex, topo.c) - the kept topology verdicts.  Taken
 *       alone, never across an NVIDIA call.
 *   gpupin_bar1_lock (mutex, budget.c) - the GPUs' BAR1 dmem regions.
 *       Taken with no other gpupin lock (module load and unload, the PIN
 *       ioctl), never across an NVIDIA call, never by the free callback;
 *       the PCI bus walk and the dmem controller's own lock nest inside.
 *   gpupin_files_lock (mutex) - the list of open files, for netlink dumps.
 *   gpupin_file.read_lock (mutex) - serialises readers of invalidation
 *       records, so a record leaves the queue only once it was copied out.
 *   dma-buf reservation locks (ww_mutex) - of imported buffers: attach,
 *       map and unmap of gpupin's and peers' attachments; the exporter holds
 *       it while move_notify revokes a pin.  Never taken by an in-flight
 *       user (a revocation waits for those under it).
 *   gpupin_file.lock (mutex) - the file's handle table (lookups take their
 *       pin reference under it) and handle counter.  Never held across an
 *       nv-p2p call, never taken by the free callback.
 *   gpupin_pin_obj.refs_lock (mutex) - the pin's kernel-API references (list,
 *       count, orphaned/gone flags).  Taken by the free callback to run the
 *       references' notifiers; never held across an nv-p2p call.
 *   gpupin_pin_obj.lock (spinlock) - one pin's state, in-flight user count,
 *       DMA mapping list and what it holds of the budgets (budget.c).
 *       Taken by the free callback; never held across an nv-p2p call or
 *       anything that sleeps.
 *   gpupin_file.ev_lock (spinlock) - the file's queue of invalidation
 *       records.  Taken by the free callback, innermost.
 *   gpupin_detached_lock (spinlock, detached.c) - the list of DETACHED pins
 *       (released where their pages could not be put, waiting for their
 *       free callback), its sequence numbers and totals.  Taken under
 *       pin->lock when a pin goes DETACHED, alone by the free callback and
 *       by netlink, which take their references under it and nothing else:
 *       innermost.
 *   gpupin_cb_pins' xa_lock (spinlock, nvp2p.c) - the ids that the nv-p2p
 *       free callback gets as its data, mapped to their pins.  Taken alone:
 *       by the callback to look its pin up and take a reference, by PIN to
 *       give an id, and by the last put of a pin to take its id back.
 *       Nothing is taken under it: innermost.
 *   gpupin_nl_subs_lock (spinlock, netlink.c, unicast-event builds) - the
 *       event subscribers' sockets.  Taken by the event path (from the free
 *       callback too) with no other gpupin lock held; only the subscribers'
 *       own socket locks nest inside it.
 *
 * NVIDIA's driver runs the free callback with its RM API lock held.  The
 * function it calls is gpupin_cb_free_callback() (gpupin_cb.ko, which stays
 * loaded): it reads the registered handler under rcu_read_lock(), takes a
 * reference to gpupin.ko there (nothing else inside that read section),
 * and calls gpupin_free_callback() after rcu_read_unlock(), holding no lock
 * of its own.  So the callback's locks (above) nest directly inside
 * NVIDIA's lock.  nvidia_p2p_get_pages*, put_pages* and dma_map_pages take
 * that lock (only dma_unmap_pages does not).  So the callback takes only
 * the locks above,
 * none of which is held across those calls, and it waits only for
 * in-flight users (gpupin_pin_use), which never call get/put/dma_map while
 * counted: they copy addresses, run a peer's DMA, make or undo gpupin's own
 * DMA mappings (ownmap.c), or dma_unmap_pages.  nvidia_p2p_dma_map_pages is
 * called only for persistent pins, which have no callback (dma.c).
 */
#ifndef _GPUPIN_INTERNAL_H
#define _GPUPIN_INTERNAL_H

#include <linux/bits.h>
#include <linux/errno.h>
#include <linux/idr.h>
#include <linux/kref.h>
#include <linux/list.h>
#include <linux/mutex.h>
#include <linux/pid.h>
#include <linux/spinlock.h>
#include <linux/types.h>
#include <linux/wait.h>
#include <linux/xarray.h>
#include <nv-p2p.h>
#include "../include/uapi/gpupin.h"

/*
 * The drivers without the persistent API (515.x, 520.x, 525.x before
 * 525.105.17 bar 525.47.22-35, 530.x) read the page table in
 * nvidia_p2p_put_pages before taking their lock, and read it again after a
 * successful put freed it (nv-p2p.c): a put racing the free callback, and
 * every successful put, reads freed memory inside NVIDIA.  The macro came
 * with the put that reads nothing before the lock: build for those only.
 */
#ifndef NVIDIA_P2P_CAP_GET_PAGES_PERSISTENT_API
#error "this NVIDIA driver's nvidia_p2p_put_pages reads freed memory (no NVIDIA_P2P_CAP_GET_PAGES_PERSISTENT_API in nv-p2p.h): gpupin needs a driver with the persistent API: 525.47.22-35, 525.105.17 or a later 525, or 535 and later, not 530 (535.129.03 or later recommended)"
#endif

#define GPUPIN_VERSION "0.1.0"
#define GPU_BOUND_SHIFT 16
#define GPU_BOUND_SIZE BIT_ULL(GPU_BOUND_SHIFT)
#define GPU_BOUND_MASK (~(GPU_BOUND_SIZE - 1))
#define GPUPIN_MAX_SLOTS BIT(20)

extern atomic_t gpupin_nr_detached;
extern atomic_t gpupin_callbacks_running;

/* Module parameters (main.c) */
extern unsigned long gpupin_max_pinned_bytes;
extern unsigned long gpupin_max_file_pinned_bytes;	/* budget.c */
extern unsigned int gpupin_max_pins_per_file;
extern bool gpupin_default_persistent;
extern bool gpupin_debug;
extern bool gpupin_p2p_check;
#ifdef GPUPIN_NV_GET_PAGES_DOUBLE_FREE
extern bool gpupin_nv_unsafe_get_pages;	/* main.c says why */
#endif
/* Fault injection (fault.c), in test builds only. */
struct pci_dev;
#ifdef GPUPIN_FAULT_INJECTION
bool gpupin_fail_alloc(void);
void gpupin_fault_callback_tail(void);
int gpupin_fault_init_end(void);
void gpupin_fault_release_delay(void);
void gpupin_fault_unmap_late_delay(void);
void gpupin_fault_own_map_batch(void);
bool gpupin_fault_no_map_resource(void);
struct pci_dev *gpupin_fault_unmap_peer(struct pci_dev *pdev);
bool gpupin_fault_put_other_kind(void);
int gpupin_fault_init(void);
void gpupin_fault_exit(void);
#else
static inline void gpupin_fault_callback_tail(void)
{
}

static inline int gpupin_fault_init_end(void)
{
	return 0;
}

static inline void gpupin_fault_release_delay(void)
{
}

static inline void gpupin_fault_unmap_late_delay(void)
{
}

static inline void gpupin_fault_own_map_batch(void)
{
}

static inline bool gpupin_fault_no_map_resource(void)
{
	return false;
}

static inline struct pci_dev *gpupin_fault_unmap_peer(struct pci_dev *pdev)
{
	return pdev;
}

static inline bool gpupin_fault_put_other_kind(void)
{
	return false;
}

static inline bool gpupin_fail_alloc(void)
{
	return false;
}

static inline int gpupin_fault_init(void)
{
	return 0;
}

static inline void gpupin_fault_exit(void)
{
}
#endif
/* gpupin's own allocations go through these, so tests can fail them. */
#define gpupin_kzalloc(size, gfp) (gpupin_fail_alloc() ? NULL : kzalloc(size, gfp))
#define gpupin_kvmalloc_array(n, size, gfp) \
	(gpupin_fail_alloc() ? NULL : kvmalloc_array(n, size, gfp))
#define gpupin_genlmsg_new(size, gfp) (gpupin_fail_alloc() ? NULL : genlmsg_new(size, gfp))

/*
 * An error from NVIDIA's nv-p2p calls or a dma-buf exporter, as gpupin passes
 * it on.  NVIDIA maps NV_ERR_NOT_SUPPORTED to -ENOTSUPP, and its dma-buf
 * attach refuses an unsupported PCI topology with it: a kernel-internal code
 * (524) that user space has no name for.  It becomes -EOPNOTSUPP.
 */
static inline int gpupin_provider_err(int err)
{
	return err == -ENOTSUPP ? -EOPNOTSUPP : err;
}

extern atomic64_t gpupin_pinned_bytes;

/* Global counters for netlink GET_STATS (main.c). */
struct gpupin_stats {
	atomic64_t pins;
	atomic64_t unpins;
	atomic64_t inval_freed;
	atomic64_t inval_process_exit;
	atomic64_t dma_maps;
	atomic64_t bytes_peak;
	atomic64_t fail_enomem;
	atomic64_t fail_enospc;
	atomic64_t fail_einval;
	atomic64_t fail_other;
	atomic64_t fail_edquot;		/* a file's or a cgroup's quota */
	atomic64_t callback_max_ns;
};

extern struct gpupin_stats gpupin_stats;
extern struct mutex gpupin_files_lock;
extern struct list_head gpupin_files;
extern char gpupin_provider[GPUPIN_NAME_LEN];
extern u32 gpupin_caps;

#define gpupin_dbg(fmt, ...)						\
	do {								\
		if (READ_ONCE(gpupin_debug))				\
			pr_info_ratelimited(fmt, ##__VA_ARGS__);	\
	} while (0)

struct gpupin_file {
	struct kref ref;		/* the open file + each detached pin */
	struct list_head node;		/* gpupin_files, under gpupin_files_lock */
	u64 id;				/* unique per open, for netlink */
	struct mutex lock;		/* see top of file */
	struct xarray pins;		/* handle -> pin, under lock */
	u64 next_handle;		/* last handle given, under lock */
	atomic_t nr_pins;		/* pins holding a slot */
	atomic64_t pinned_bytes;	/* held of max_file_pinned_bytes (budget.c) */
	struct pid *owner;		/* thread group that opened the file */
	bool admin;			/* opener had CAP_SYS_ADMIN (f_cred) */

	u64 *vmap;			/* validity map, one word per slot */
	size_t vmap_size;
	unsigned int nr_slots;
	struct ida slots;

	struct mutex read_lock;		/* see top of file */
	spinlock_t ev_lock;		/* see top of file */
	struct list_head events;	/* gpupin_event_rec, under ev_lock */
	unsigned int nr_events;		/* under ev_lock, at most nr_slots */
	bool ev_overflow;		/* under ev_lock */
	wait_queue_head_t ev_wait;
};

enum gpupin_pin_state {
	GPUPIN_PIN_PINNING,	/* get_pages in progress or unchecked */
	GPUPIN_PIN_PINNED,	/* usable */
	GPUPIN_PIN_RELEASING,	/* unpin owns the pages and is putting them */
	GPUPIN_PIN_INVALIDATING,	/* free callback running */
	GPUPIN_PIN_INVALIDATED,	/* pages gone; only the handle is left */
	/*
	 * Released where the pages cannot be put (not the pinning process):
	 * out of every table, pages kept until the free callback frees it.
	 */
	GPUPIN_PIN_DETACHED,
};

struct gpupin_event_rec {
	struct list_head node;
	struct gpupin_event ev;
};

struct dma_buf;
struct dma_buf_attachment;
struct pci_dev;
struct sg_table;

/* One dma-buf attachment and its mapping. */
struct gpupin_dmabuf_att {
	struct dma_buf_attachment *attach;
	struct sg_table *sgt;		/* NULL once unmapped; under the dma-buf's resv lock */
	bool pinned;			/* dma_buf_pin()ned; under the resv lock */
};

struct gpupin_pin_obj;

/*
 * A pin's backend: how its memory is taken and given back - nv-p2p
 * (nvp2p.c) or dma-buf (dmabuf.c).  pin.c owns the pin's life (reserve, states,
 * publish, invalidation, release, teardown) and calls these at fixed
 * points; a backend never changes a pin's state or accounting itself.  Its
 * way in is the invalidation of a pin whose memory is going:
 * gpupin_pin_revoke() (a dma-buf exporter's move_notify) or
 * gpupin_pin_freed() (the nv-p2p free callback).
 */
struct gpupin_pin_backend_ops {
	/*
	 * Take the memory of a new pin (reserved, PINNING) as @req asks (the
	 * backend's own request: gpupin_pin_req.priv); no lock held.  The
	 * memory may be revoked as soon as it is taken.  On error what it did
	 * take stays recorded in the pin, which is then released like any
	 * other (release, drop).
	 */
	int (*acquire)(struct gpupin_pin_obj *pin, void *req);
	/*
	 * Optional.  Under pin->lock while the pin is still PINNING, just
	 * before it becomes PINNED: the free callback has not begun (it moves
	 * the pin out of PINNING under that lock), so what the backend took is
	 * still there to check and copy from.  Its error fails the pin.
	 */
	int (*commit)(struct gpupin_pin_obj *pin);
	/*
	 * Optional.  May the pin's memory be given back from the calling
	 * context?  If not, its release leaves it DETACHED for its free
	 * callback.  NULL: from anywhere.
	 */
	bool (*release_here)(const struct gpupin_pin_obj *pin);
	/*
	 * Optional.  Give the memory back: the caller claimed the release
	 * (state @claimed) and unmapped the pin.  May find the free callback
	 * took the pin meanwhile.  0, or an errno when the memory is not given
	 * back and a free callback may still come for it: pin.c then keeps the
	 * pin DETACHED for that callback.
	 */
	int (*release)(struct gpupin_pin_obj *pin, enum gpupin_pin_state claimed);
	/*
	 * The memory is going (free callback or revocation) and no in-flight
	 * user is left: drop the mappings.  Runs with the provider's locks
	 * held (gpupin_pin_invalidate() says which of gpupin's it may take).
	 */
	void (*teardown)(struct gpupin_pin_obj *pin);
	/*
	 * Optional.  At the end of a release, once any invalidation has
	 * ended: let go of what the pin still holds.  No lock held.
	 */
	void (*drop)(struct gpupin_pin_obj *pin);
	/*
	 * Optional.  The pin's last reference is gone, in any context (the
	 * free callback's too): forget whatever could still find the pin.
	 */
	void (*forget)(struct gpupin_pin_obj *pin);
	/*
	 * Per-page addresses [@first, @first + @count) into @addrs, the range
	 * checked; the caller is an in-flight user.  0 or a negative errno.
	 */
	int (*addrs)(const struct gpupin_pin_obj *pin, u64 *addrs, u32 first, u32 count);
	/*
	 * Optional.  Under pin->lock while the pin is still PINNING (what the
	 * backend took is there): the CPU physical address of the pin's first
	 * page where it lies in a GPU's BAR1, 0 where the pin takes no BAR1
	 * (coherent memory).  budget.c charges the BAR's dmem region by it.
	 */
	u64 (*bar1_addr)(const struct gpupin_pin_obj *pin);
	/*
	 * Optional.  Before acquire, in the PIN ioctl (no gpupin lock held):
	 * the address bar1_addr will give, learned without taking the pin's
	 * memory, or 0 where it cannot be (budget.c then charges after
	 * acquire).  budget.c charges by it before the memory is taken, so
	 * that a pin past its cgroup's dmem.max never holds BAR1.
	 */
	u64 (*probe_bar1)(struct gpupin_pin_obj *pin);
	/*
	 * A release unmaps the pin as an in-flight user (so a free callback
	 * cannot return while an unmap still uses what NVIDIA frees then);
	 * false where unmapping takes a lock under which a revocation waits
	 * for in-flight users (dma-buf's reservation lock).
	 */
	bool unmap_in_use;
};

/*
 * A new pin as PIN or PIN_DMABUF asks for it, every field of the ioctl
 * checked (gpupin_pin_new).  The range is in pages of 1 << @page_shift.
 */
struct gpupin_pin_req {
	const struct gpupin_pin_backend_ops *ops;
	void *priv;			/* the backend's request, for its acquire */
	u64 va;
	u64 size;
	u64 aligned_va;
	u64 aligned_size;
	u64 user_tag;
	u32 page_shift;
	u32 flags;			/* GPUPIN_PIN_*, fixed for the pin's life */
	/* The ioctl's result: @fill writes the new pin into @arg, then @len bytes go to @uarg. */
	void (*fill)(void *arg, const struct gpupin_pin_obj *pin);
	void *arg;
	size_t len;
	void __user *uarg;
};

/*
 * One pin, handled by the gpupin_pin_* functions (pin.c).  Not "gpupin_pin":
 * that is the PIN ioctl's argument (include/uapi/gpupin.h).
 */
struct gpupin_pin_obj {
	struct kref ref;		/* handle table + temporary lookups */
	const struct gpupin_pin_backend_ops *ops;	/* set when made, never changed */
	struct gpupin_file *file;
	u64 handle;
	u32 slot;
	u32 flags;			/* GPUPIN_PIN_* */
	u64 va;
	u64 size;
	u64 aligned_va;
	u64 aligned_size;
	u64 user_tag;
	u64 created_ns;
	u32 page_shift;			/* GPU_BOUND_SHIFT (nv-p2p) or PAGE_SHIFT (dma-buf) */
	u32 entries;			/* aligned_size >> page_shift */
	struct nvidia_p2p_page_table *pt;	/* nv-p2p pins */
	unsigned long cb_id;		/* nv-p2p pins with a callback: its data (nvp2p.c), or 0 */
	u8 gpu_uuid[16];		/* copied from the page table while PINNING */
	struct dma_buf *dmabuf;		/* dma-buf pins: a reference */
	struct pci_dev *dmabuf_pdev;	/* dma-buf pins: importing device (a reference) or NULL */
	struct gpupin_dmabuf_att att;	/* dma-buf pins: the import for dmabuf_pdev */
	u64 *dmabuf_addrs;		/* dma-buf pins: per page, dmabuf_pdev's address, or NULL */

	spinlock_t lock;		/* see top of file */
	enum gpupin_pin_state state;	/* under lock */
	unsigned int inflight;		/* under lock */
	unsigned int mappers;		/* DMA maps in progress (not in flight); under lock */
	wait_queue_head_t wq;		/* inflight/mappers changes, state changes */
	struct list_head maps;		/* gpupin_map, under lock */
	u32 next_map_id;		/* under lock */
	struct gpupin_event_rec *ev;	/* queued on invalidation */
	/* budget.c: what the pin holds of the budgets, under lock */
	bool budget_held;		/* its bytes in gpupin_pinned_bytes and its file's */
	struct dmem_cgroup_pool_state *dmem_pool;	/* charged there, or NULL */
	struct dmem_cgroup_region *dmem_region;		/* dmem_pool's region */

	struct mutex refs_lock;		/* see top of file */
	struct list_head refs;		/* gpupin_ref (kapi.c), under refs_lock */
	unsigned int nr_refs;		/* under refs_lock */
	bool orphaned;			/* unpinned while referenced, under refs_lock */
	bool gone;			/* being destroyed, under refs_lock */
	u32 orphan_reason;		/* GPUPIN_NL_REASON_* of the deferred unpin */

	/* While DETACHED (detached.c), under gpupin_detached_lock. */
	struct list_head detached_node;
	u64 detached_seq;		/* its place on the list, for a resumed dump */
};

enum gpupin_map_kind {
	GPUPIN_MAP_NVP2P,	/* nvidia_p2p_dma_map_pages: persistent pins only */
	GPUPIN_MAP_OWN,		/* gpupin's own (ownmap.c): non-persistent nv-p2p pins */
	GPUPIN_MAP_DMABUF,	/* an attachment of the pin's dma-buf */
};

struct gpupin_map {
	struct list_head node;
	struct gpupin_pin_obj *pin;	/* the pin it belongs to (no reference) */
	enum gpupin_map_kind kind;
	bool mmio;			/* own: dma_map_resource (BAR pages), else dma_map_page */
	bool bus_direct;		/* own, mmio: bus addresses, nothing mapped */
	u64 bus_offset;			/* own, bus_direct: bus address minus CPU address */
	u32 entries;			/* own: pages mapped */
	phys_addr_t bar_start;		/* own, mmio: the GPU's BAR holding the pages */
	phys_addr_t bar_end;
	u32 id;
	bool user_owned;		/* made by DMA_MAP, not yet DMA_UNMAPped; under pin->lock */
	unsigned int drv_users;		/* kernel-API references sharing it; under pin->lock */
	struct pci_dev *pdev;		/* holds a reference */
	struct nvidia_p2p_dma_mapping *m;	/* nv-p2p pins */
	struct gpupin_dmabuf_att att;	/* dma-buf pins: the peer's attachment */
	struct dma_buf *dmabuf;		/* dma-buf pins: the map's own reference */
	u64 *dma;			/* per page: bus address for pdev */
};

/* pin.c */
long gpupin_ioctl_unpin(struct gpupin_file *f, struct gpupin_unpin __user *uarg);
long gpupin_ioctl_query(struct gpupin_file *f, struct gpupin_query __user *uarg);
long gpupin_ioctl_get_pages(struct gpupin_file *f, struct gpupin_get_pages __user *uarg);
/* Fills a GET_PAGES/DMA_ADDRS window of @pin (in use); 0 or a negative errno. */
typedef int (*gpupin_window_fill_t)(struct gpupin_pin_obj *pin, u64 *addrs, u32 first, u32 count,
				    void *ctx);
long gpupin_copy_addr_window(struct gpupin_file *f, u64 handle, u32 first, u32 count,
			     u64 uaddrs, gpupin_window_fill_t fill, void *ctx);
struct gpupin_pin_obj *gpupin_pin_lookup(struct gpupin_file *f, u64 handle);
struct gpupin_pin_obj *gpupin_pin_lookup_owned(struct gpupin_file *f, u64 handle, int *err);
void gpupin_pin_uuid(const struct gpupin_pin_obj *pin, u8 uuid[16]);
u64 gpupin_pin_page_addr(const struct gpupin_pin_obj *pin, u32 idx);
void gpupin_pin_revoke(struct gpupin_pin_obj *pin);
bool gpupin_pin_freed(struct gpupin_pin_obj *pin);
bool gpupin_pin_still_claimed(struct gpupin_pin_obj *pin, enum gpupin_pin_state claimed);
long gpupin_pin_new(struct gpupin_file *f, const struct gpupin_pin_req *req);
void gpupin_pin_put(struct gpupin_pin_obj *pin);
int gpupin_pin_use(struct gpupin_pin_obj *pin);
void gpupin_pin_unuse(struct gpupin_pin_obj *pin);
void gpupin_file_release_pins(struct gpupin_file *f, u32 reason);
void gpupin_pin_destroy_now(struct gpupin_file *f, struct gpupin_pin_obj *pin, u32 reason);

/* Budgets (budget.c) */
struct dmem_cgroup_pool_state;
struct dmem_cgroup_region;
int gpupin_budget_reserve(struct gpupin_file *f, struct gpupin_pin_obj *pin);
int gpupin_budget_precharge(struct gpupin_pin_obj *pin);
int gpupin_budget_charge_gpu(struct gpupin_pin_obj *pin);
void gpupin_budget_release(struct gpupin_pin_obj *pin);
void gpupin_budget_init(void);
void gpupin_budget_exit(void);
bool gpupin_caller_owns(struct gpupin_file *f);
bool gpupin_may_read_addrs(struct gpupin_file *f);
void gpupin_file_put(struct gpupin_file *f);

/* nvp2p.c */
long gpupin_ioctl_pin(struct gpupin_file *f, struct gpupin_pin __user *uarg);
void gpupin_cb_ids_exit(void);
int gpupin_cb_handler_init(void);
void gpupin_cb_handler_exit(void);
void gpupin_cb_handler_abort(void);
struct nvidia_p2p_page_table;
bool gpupin_table_version_ok(u32 version);
int gpupin_p2p_get_persistent(u64 va, u64 len, struct nvidia_p2p_page_table **pt);
int gpupin_p2p_put_persistent(u64 va, struct nvidia_p2p_page_table *pt);

/* dma.c */
long gpupin_ioctl_dma_map(struct gpupin_file *f, struct gpupin_dma_map __user *uarg);
long gpupin_ioctl_dma_addrs(struct gpupin_file *f, struct gpupin_dma_addrs __user *uarg);
long gpupin_ioctl_dma_unmap(struct gpupin_file *f, struct gpupin_dma_unmap __user *uarg);
void gpupin_unmap_all(struct gpupin_pin_obj *pin);
void gpupin_free_maps_invalidated(struct gpupin_pin_obj *pin);
u32 gpupin_map_count_locked(struct gpupin_pin_obj *pin);
int gpupin_map_create(struct gpupin_pin_obj *pin, struct pci_dev *pdev, bool user,
		      struct gpupin_map **out, u32 *id);
int gpupin_map_add(struct gpupin_pin_obj *pin, struct gpupin_map *map, u32 *id);
int gpupin_map_for_driver(struct gpupin_pin_obj *pin, struct pci_dev *pdev,
			  struct gpupin_map **out, u32 *id);
void gpupin_map_drop_driver(struct gpupin_pin_obj *pin, u32 id);

/* topo.c */
int gpupin_topo_verdict(struct gpupin_pin_obj *pin, struct pci_dev *peer);
bool gpupin_topo_common_switch(struct pci_dev *gpu, struct pci_dev *peer);
void gpupin_topo_forget(void);

/* ownmap.c */
int gpupin_own_map(struct gpupin_pin_obj *pin, struct gpupin_map *map, u32 *id);
void gpupin_own_unmap(struct gpupin_map *map);

/* dmabuf.c */
long gpupin_ioctl_pin_dmabuf(struct gpupin_file *f, struct gpupin_pin_dmabuf __user *uarg);
int gpupin_dmabuf_map(struct gpupin_pin_obj *pin, struct gpupin_map *map, u32 *id);
void gpupin_dmabuf_unmap(struct gpupin_map *map);

/* detached.c */
void gpupin_detached_add(struct gpupin_pin_obj *pin);
void gpupin_detached_del(struct gpupin_pin_obj *pin);
unsigned int gpupin_detached_get(u64 seq, struct gpupin_pin_obj **pins, unsigned int max);
void gpupin_detached_put(struct gpupin_pin_obj *pin);
void gpupin_detached_totals(u64 *count, u64 *bytes);

/* kapi.c */
void gpupin_notify_refs(struct gpupin_pin_obj *pin);

/* netlink.c */
int gpupin_nl_init(void);
void gpupin_nl_exit(void);
void gpupin_nl_pin_event(struct gpupin_pin_obj *pin, u8 cmd, u32 reason);
void gpupin_nl_budget_event(struct gpupin_file *f, u64 size);

/* main.c */
void gpupin_stat_max(atomic64_t *v, s64 now);
long gpupin_ioctl_info(struct gpupin_file *f, struct gpupin_info __user *uarg);

/* file.c */
int gpupin_file_init(void);
void gpupin_file_exit(void);
void gpupin_queue_event(struct gpupin_file *f, struct gpupin_event_rec *rec);
struct gpupin_file *gpupin_file_of(struct file *file);

#endif /* _GPUPIN_INTERNAL_H */
