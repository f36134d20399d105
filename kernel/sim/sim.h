/* SPDX-License-Identifier: (GPL-2.0 OR MIT) */
/*
 * nvp2p_sim internals: a simulated GPU whose memory is host pages, and an
 * implementation of the nv-p2p API over it.
 *
 * Locking, outermost first:
 *   sim_big_lock (mutex)  - stands for the resource manager's API lock of
 *                           NVIDIA's driver: held while free callbacks run and
 *                           taken by get_pages, put_pages and dma_map_pages
 *                           (never by dma_unmap_pages), always through
 *                           sim_api_lock() (sim_rmlock.c), which tells lockdep
 *                           and gives up with a WARN after lock_timeout_ms, so a
 *                           client that deadlocks the real driver fails a test
 *                           within seconds here instead of hanging it.
 *   ctx->lock (mutex)     - one context's allocation list (alloc/free/rw).
 *   sim_exports_lock (mutex) - the allocations' export lists (sim_dmabuf.c).
 *   dma-buf reservation locks - of the simulator's revocable exports; held
 *                           while importers' move_notify run (revocation).
 *   sim_quarantine_lock (mutex) - the poisoned quarantine of freed chunks
 *                           (sim_poison.c); taken with no other sim lock held.
 *   sim_bar_lock (mutex)  - bar_device's writers and its name (sim_bar.c);
 *                           taken with no other sim lock held.
 *   sim_lock (spinlock)   - the context list, the pin registry, every pin's
 *                           state and mapping list, and the counters.  Never
 *                           held across a callback or a sleeping call.
 *   sim_deny_lock (spinlock) - deny_peers' list (sim_topo.c); nothing is
 *                           taken under it (the static dma-buf exporter's
 *                           attach takes it under sim_lock).
 */
#ifndef _NVP2P_SIM_H
#define _NVP2P_SIM_H

#include <linux/bits.h>
#include <linux/completion.h>
#include <linux/hashtable.h>
#include <linux/kref.h>
#include <linux/list.h>
#include <linux/mutex.h>
#include <linux/pid.h>
#include <linux/refcount.h>
#include <linux/spinlock.h>
#include <linux/types.h>
#include <linux/workqueue.h>
#include <nv-p2p.h>
#include "../../include/uapi/nvp2p_sim.h"

#define SIM_PAGE_SHIFT 16
#define SIM_PAGE_SIZE BIT_ULL(SIM_PAGE_SHIFT)
#define SIM_CHUNK_ORDER (SIM_PAGE_SHIFT - PAGE_SHIFT)
#define SIM_CTX_SHIFT 36	/* 64 GiB of address space per context */
#define SIM_POISON 0x6b		/* fills freed simulated memory */

extern struct mutex sim_big_lock;
extern spinlock_t sim_lock;

extern u8 sim_gpu_uuid[NVIDIA_P2P_GPU_UUID_LEN];

/* Counters, under sim_lock. */
extern struct nvp2p_sim_stats sim_stats;

/* One open of /dev/nvp2p_sim: a simulated CUDA context. */
struct sim_ctx {
	struct list_head node;		/* sim_ctxs, under sim_lock */
	struct pid *owner;		/* thread group that opened it */
	u64 va_base;
	u64 va_limit;
	struct mutex lock;		/* serialises alloc/free/rw */
	struct list_head allocs;	/* sorted by va, under sim_lock */
};

/* One simulated device allocation, backed by 64 KiB host chunks. */
struct sim_alloc {
	struct kref ref;		/* context list + each pin on it */
	struct list_head node;		/* ctx->allocs, under sim_lock */
	u64 va;
	u64 size;
	u64 buffer_id;
	unsigned long nchunks;
	struct page **chunks;
	struct list_head pins;		/* callback pins, under sim_lock */
	struct list_head exports;	/* sim_export, under sim_exports_lock (sim_dmabuf.c) */
};

enum sim_pin_state {
	SIM_PIN_LIVE,		/* pinned, callback armed */
	SIM_PIN_CALLBACK,	/* callback claimed: running or about to */
	SIM_PIN_FREED,		/* table freed: poisoned, kept to catch later calls */
};

/* One get_pages and the page table handed to the client. */
struct sim_pin {
	struct nvidia_p2p_page_table *pt;	/* owned; freed with the pin */
	size_t pt_size;			/* SIM_TABLE_ALLOC: table, then its list head */
	struct nvidia_p2p_page *page_array;
	struct nvidia_p2p_page **pages;
	struct hlist_node hnode;	/* registry by pt, under sim_lock */
	struct list_head node;		/* alloc->pins, then the graveyard; sim_lock */
	struct sim_alloc *alloc;	/* holds a reference until FREED */
	struct pid *owner;		/* thread group that pinned (holds a ref) */
	u64 va;
	u64 len;
	u64 bar_start;			/* bar_device's BAR when pinned (0: host addresses) */
	u64 bar_len;
	bool persistent;
	bool table_freed;		/* client called free_page_table */
	bool cb_unloaded;		/* the callback's module is gone; under sim_lock */
	bool freed_by_put;		/* FREED by put_pages, not a callback; sim_lock */
	bool table_reused;		/* pt is a freed table's address (reuse_freed_tables) */
	bool forgotten;			/* owner's registration dropped (forget_owner); sim_lock */
	enum sim_pin_state state;	/* under sim_lock */
	void (*free_callback)(void *data);
	void *data;
	struct task_struct *cb_task;	/* running the callback */
	struct completion cb_done;
	struct work_struct race_work;	/* race_put_pages, race_get_pages* injection */
	unsigned int race_delay_us;	/* race_get_pages_late_us: the free's delay */
	refcount_t refs;		/* registry + temporary users */
	struct list_head maps;		/* sim_map, under sim_lock */
};

/*
 * NVIDIA embeds the page table in struct nv_p2p_mem_info (nv-p2p.c), where
 * the table's DMA-mapping list head follows it.  Every table is allocated
 * that way here, whatever its version: a client that reads a member its
 * version lacks (`flags` of a 1.2 table, `gpu_uuid` of a 1.0 one) reads that
 * list head - in bounds, but no value of that member - as it would on such
 * a host.
 */
#define SIM_TABLE_ALLOC (sizeof(struct nvidia_p2p_page_table) + sizeof(struct list_head))

struct sim_map {
	struct nvidia_p2p_dma_mapping m;
	struct list_head node;		/* pin->maps, under sim_lock */
	struct sim_pin *pin;
	struct device *dev;
	bool freed;			/* freed as NVIDIA would; kept with its pin */
};

const char *nvp2p_sim_provider(void);

/* sim_p2p.c: the pin entry points */
int sim_injected_error_locked(int *nth_param);
int sim_p2p_init(void);
void sim_p2p_exit(void);

/* sim_table.c: page tables, their registry and graveyard */
#define SIM_PINS_BITS 10
extern DECLARE_HASHTABLE(sim_pins, SIM_PINS_BITS);	/* by table address, under sim_lock */
struct sim_pin *sim_pin_lookup_locked(struct nvidia_p2p_page_table *pt);
void sim_pin_put(struct sim_pin *pin);
void sim_pin_retire_locked(struct sim_pin *pin, struct list_head *evicted);
void sim_pin_bury(struct sim_pin *pin, struct list_head *evicted);
void sim_table_fill(struct sim_pin *pin, u32 version, u32 entries);
struct sim_pin *sim_reuse_table_locked(struct sim_pin *pin, u32 version, u32 entries);
void sim_dangle_table(struct nvidia_p2p_page_table **page_table, u64 va, bool persistent);
void sim_table_exit(void);

/* sim_bar.c: the simulated BAR1 */
extern u64 sim_bar_start, sim_bar_len;	/* of bar_device; len 0: off */
bool sim_bar_space_locked(u64 len);
unsigned long sim_bar_size(void);	/* the bar_size parameter, for sim_main.c */
struct page *sim_pin_chunk(struct sim_pin *pin, u32 i);
u64 sim_page_phys(struct sim_pin *pin, u32 i);

/* sim_callback.c: free callbacks and the injected frees */
extern struct workqueue_struct *sim_race_wq;
void sim_race_work(struct work_struct *work);
void sim_run_callbacks(struct list_head *claimed);
int sim_callback_init(void);
void sim_callback_exit(void);

/* sim_owner.c: the calling process's registration */
bool sim_put_finds_locked(struct sim_pin *pin, bool persistent);

/* sim_dma.c: DMA mappings */
void sim_map_bury(struct sim_map *map);

/* sim_topo.c: NVIDIA's topology verdict */
bool sim_peer_denied(struct device *dev);

/* sim_rmlock.c */
int sim_api_lock(const char *who);
void sim_api_unlock(void);
void sim_watchdog_arm(void (*fn)(void *data));
void sim_watchdog_disarm(void);
void sim_count_uaf(const char *fn, const char *what);
void sim_count_misuse(u64 *counter, const char *what);
void sim_reset_misuse(void);

/* sim_dmabuf.c */
long sim_ioctl_export(struct sim_ctx *ctx, struct nvp2p_sim_export __user *uarg);
void sim_revoke_exports(struct sim_alloc *alloc);
void sim_dmabuf_init(void);
void sim_dmabuf_exit(void);
struct sim_alloc *sim_ctx_find(struct sim_ctx *ctx, u64 va);

/* sim_poison.c */
void sim_poison_free_chunks(struct page **chunks, unsigned long nchunks);
void sim_poison_check_all(void);
void sim_poison_exit(void);

/* sim_mem.c */
void sim_alloc_put(struct sim_alloc *alloc);
struct sim_alloc *sim_find_alloc_locked(u64 va, u64 len, int *err);
int sim_chardev_init(void);
void sim_chardev_exit(void);

#endif /* _NVP2P_SIM_H */
