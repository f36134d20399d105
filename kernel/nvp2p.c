// SPDX-License-Identifier: (GPL-2.0 OR MIT)
/*
 * gpupin: the nv-p2p backend - PIN pins GPU memory through NVIDIA's
 * nvidia_p2p_get_pages (persistent, or with a free callback), and this is
 * where the free callback comes in.  pin.c runs the pin's life and calls
 * this backend through gpupin_nvp2p_backend; the backend tells it only of
 * a free callback (gpupin_pin_freed()).
 *
 * A put_pages that returns 0 from the pinning process may have released
 * nothing all the same: NVIDIA looks the mapping up through the process's
 * registration, which an MPS client's teardown removes while the memory and
 * the armed callback stay with the MPS server.  So the callback can come for
 * a pin gpupin has freed.  Its data is therefore an id (gpupin_cb_pins),
 * never a pointer: see gpupin_free_callback().  It may even come after
 * gpupin.ko was unloaded, so the function NVIDIA gets is not ours but
 * gpupin_cb.ko's (kernel/cb/tramp.c), which stays loaded, calls
 * gpupin_free_callback() through its registration while gpupin.ko is there,
 * and gives the ids, so that they are not handed out again by a reloaded
 * gpupin.ko either.
 */
#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/delay.h>
#include <linux/err.h>
#include <linux/module.h>
#include <linux/overflow.h>
#include <linux/rcupdate.h>
#include <linux/uaccess.h>
#include <linux/wait_bit.h>
#include "gpupin.h"
#include "cb/gpupin_cb.h"

/*
 * nv-p2p's release_here: may the pages of @pin be put from here?
 * Non-persistent pages only by the process that pinned them (the file's
 * owner: PIN checks that).
 */
static bool gpupin_nvp2p_release_here(const struct gpupin_pin_obj *pin)
{
	return !pin->pt || (pin->flags & GPUPIN_PIN_PERSISTENT) ||
	       gpupin_caller_owns(pin->file);
}

/*
 * The nv-p2p free callback's data: an id, looked up here, never a pointer
 * to the pin.  NVIDIA may call the callback after gpupin freed the pin (a
 * put_pages that returned 0 having released nothing, gpupin_nvp2p_release());
 * a pointer would then be a use after free, or another pin that got the
 * same address.  An id stays here until the pin's callback takes it out or
 * the pin's last reference goes; the callback takes its reference under the
 * xarray's lock (kref_get_unless_zero: the last put may be on its way to
 * erase it).  So an id it finds is a live pin, and one it does not find is
 * a late, duplicate or unknown callback: NVIDIA runs a registration's
 * callback once, so a second one with the same id finds nothing.  Ids
 * count up over 64 bits (the callback's data is a pointer: nv-p2p exists
 * on 64-bit kernels only) and are never handed out twice, not even by
 * gpupin.ko loaded again (gpupin_cb_new_id() counts in gpupin_cb.ko, which
 * stays loaded), so a stale id can never find a newer pin.  The lock's
 * place in the lock order: gpupin.h (innermost, taken alone).
 */
static DEFINE_XARRAY(gpupin_cb_pins);

/* Give @pin its callback id; -ENOMEM if the xarray cannot grow. */
static int gpupin_cb_id_alloc(struct gpupin_pin_obj *pin)
{
	unsigned long id;
	int ret;

	BUILD_BUG_ON(sizeof(void *) < sizeof(u64));
	id = gpupin_cb_new_id();
	ret = xa_insert(&gpupin_cb_pins, id, pin, GFP_KERNEL);
	if (ret < 0)
		return ret;
	pin->cb_id = id;
	return 0;
}

/*
 * The pin of callback data @data with a reference, its id taken out; NULL
 * if it is gone, had its callback already, or never was.
 */
static struct gpupin_pin_obj *gpupin_cb_pin_take(void *data)
{
	unsigned long id = (unsigned long)data;
	struct gpupin_pin_obj *pin;

	if (!id)
		return NULL;
	xa_lock(&gpupin_cb_pins);
	pin = __xa_erase(&gpupin_cb_pins, id);
	if (pin && !kref_get_unless_zero(&pin->ref))
		pin = NULL;	/* its last put is on its way */
	xa_unlock(&gpupin_cb_pins);
	return pin;
}

/*
 * nv-p2p's forget, at the pin's last put (any context, the free callback's
 * too): from here on a callback with this pin's id finds nothing (if it did
 * not take it).
 */
static void gpupin_nvp2p_forget(struct gpupin_pin_obj *pin)
{
	if (pin->cb_id)
		xa_cmpxchg(&gpupin_cb_pins, pin->cb_id, pin, NULL, 0);
}

/* Module unload: every pin, so every id, is gone by then. */
void gpupin_cb_ids_exit(void)
{
	WARN_ON(!xa_empty(&gpupin_cb_pins));
	xa_destroy(&gpupin_cb_pins);
}

/*
 * gpupin_p2p_tables: no nv-p2p put_pages of gpupin's runs while one of its
 * get_pages does.  NVIDIA finds a non-persistent put's mapping by the page
 * table's pointer value among the calling process's (RmP2PPutPages,
 * p2p.c), frees a table right after its free callback
 * (nv_p2p_mem_info_free_callback, nv-p2p.c), and nv_p2p_get_pages allocates
 * the next table before it takes the RM lock: the freed address may come
 * straight back.  A put waiting for the RM lock while a callback frees its
 * table would then release the newer pin that got that address.  Under
 * this mutex a put first checks that the callback has not taken its pin
 * (the callback moves the pin on before NVIDIA frees the table), and no
 * get_pages can be handed the table until the put has returned: it then
 * finds the live mapping, or nothing.  Other nv-p2p clients in the same
 * process (another module pinning for it) are not serialised with gpupin
 * and can still be handed such an address: kernel/sim/FIDELITY.md.
 *
 * Lock order (gpupin.h): taken with no gpupin lock held but a kernel-API
 * reference's map_lock (topo.c's probe; PIN's BAR1 probe holds none),
 * around nv-p2p get_pages and put_pages only, so only NVIDIA's RM lock nests
 * inside it; never taken by the free callback, which runs under that RM lock.
 */
static DEFINE_MUTEX(gpupin_p2p_tables);

/* A persistent pin outside a pin object (topo.c's probe), kept apart from puts all the same. */
int gpupin_p2p_get_persistent(u64 va, u64 len, struct nvidia_p2p_page_table **pt)
{
	int ret;

	mutex_lock(&gpupin_p2p_tables);
	ret = nvidia_p2p_get_pages_persistent(va, len, pt, 0);
	mutex_unlock(&gpupin_p2p_tables);
	return ret;
}

int gpupin_p2p_put_persistent(u64 va, struct nvidia_p2p_page_table *pt)
{
	int ret;

	mutex_lock(&gpupin_p2p_tables);
	ret = nvidia_p2p_put_pages_persistent(va, pt, 0);
	mutex_unlock(&gpupin_p2p_tables);
	return ret;
}

/*
 * Can gpupin read a page table of @version?  NVIDIA's rule for the header it
 * was built against (same major, minor at least the header's).  Built against
 * a 2.x header (R580 on), 1.x tables from 1.2 on as well: 2.0 appended
 * `flags` to the 1.2 layout, and gpupin reads no field after gpu_uuid (added
 * in 1.2), so a 1.2 table - smaller by that member - is read in bounds.
 */
bool gpupin_table_version_ok(u32 version)
{
	u32 major = NVIDIA_P2P_MAJOR_VERSION(version);
	u32 minor = NVIDIA_P2P_MINOR_VERSION(version);
	u32 built = NVIDIA_P2P_MAJOR_VERSION(NVIDIA_P2P_PAGE_TABLE_VERSION);

	if (major == built)
		return minor >= NVIDIA_P2P_MINOR_VERSION(NVIDIA_P2P_PAGE_TABLE_VERSION);
	return built == 2 && major == 1 && minor >= 2;
}

static int gpupin_check_table(struct gpupin_pin_obj *pin)
{
	struct nvidia_p2p_page_table *pt = pin->pt;

	if (!gpupin_table_version_ok(pt->version)) {
		pr_warn_ratelimited("incompatible page table version 0x%08x\n", pt->version);
		return -EPROTO;
	}
	if (pt->page_size != NVIDIA_P2P_PAGE_SIZE_64KB) {
		pr_warn_ratelimited("unsupported GPU page size type %u\n", pt->page_size);
		return -EOPNOTSUPP;
	}
	if (pt->entries != pin->entries) {
		pr_warn_ratelimited("page table has %u entries for %llu bytes\n",
				    pt->entries, pin->aligned_size);
		return -EPROTO;
	}
	return 0;
}

/* nv-p2p's commit: check the page table and keep its GPU UUID. */
static int gpupin_nvp2p_commit(struct gpupin_pin_obj *pin)
{
	int ret = gpupin_check_table(pin);

	if (!ret && pin->pt->gpu_uuid)
		memcpy(pin->gpu_uuid, pin->pt->gpu_uuid, sizeof(pin->gpu_uuid));
	return ret;
}

/*
 * nv-p2p's bar1_addr: page 0's physical address, a BAR1 address on a
 * discrete GPU (RmThirdPartyP2PGetPages, p2p.c: the GPU's FB aperture base
 * plus the mapping's offset).  A 2.x table flags CPU-cacheable pages
 * (NVIDIA_P2P_PAGE_TABLE_FLAGS_CPU_CACHEABLE, set by nv_p2p_get_pages for
 * coherent C2C/NVLink memory): they take no BAR1.  Built against a 1.x
 * header (drivers before 580.65.06) there is no flag: coherent pages lie in
 * no BAR on bare metal, but in a GH200/GB200 VM they lie in the GPU's PCI
 * resource 4 (nv-pci.c), so budget.c charges them to its region though they
 * take no BAR1 (budgets.md says so).  A table gpupin cannot read gives 0
 * (its commit refuses it).
 */
static u64 gpupin_table_bar1_addr(const struct nvidia_p2p_page_table *pt)
{
	/* A 2.x header (R580 on): tables may carry flags. */
#ifdef NVIDIA_P2P_PAGE_TABLE_FLAGS_CPU_CACHEABLE
	if (NVIDIA_P2P_MAJOR_VERSION(pt->version) >= 2 &&
	    (pt->flags & NVIDIA_P2P_PAGE_TABLE_FLAGS_CPU_CACHEABLE))
		return 0;
#endif
	return pt->pages[0]->physical_address;
}

static u64 gpupin_nvp2p_bar1_addr(const struct gpupin_pin_obj *pin)
{
	if (gpupin_check_table((struct gpupin_pin_obj *)pin))
		return 0;
	return gpupin_table_bar1_addr(pin->pt);
}

/*
 * nv-p2p's probe_bar1: pin the first 64 KiB with the persistent API, read
 * their address as bar1_addr does, give them back (as topo.c's probe; the
 * persistent table has no callback, so only this put releases it).  0 where
 * NVIDIA cannot be asked: not the pinning process (NVIDIA looks the address
 * up in the caller's context), no persistent pins (MIG before 570, vGPU),
 * BAR1 full, the memory not there.
 */
static u64 gpupin_nvp2p_probe_bar1(struct gpupin_pin_obj *pin)
{
	struct nvidia_p2p_page_table *pt = NULL;
	u64 addr = 0;

	if (!gpupin_caller_owns(pin->file))
		return 0;
	/* On failure *pt may point to a freed table: never touched. */
	if (gpupin_p2p_get_persistent(pin->aligned_va, GPU_BOUND_SIZE, &pt))
		return 0;
	if (gpupin_table_version_ok(pt->version) && pt->entries == 1 &&
	    pt->page_size == NVIDIA_P2P_PAGE_SIZE_64KB)
		addr = gpupin_table_bar1_addr(pt);
	if (gpupin_p2p_put_persistent(pin->aligned_va, pt))
		pr_warn_ratelimited("BAR1 probe: put_pages_persistent failed\n");
	return addr;
}

/* nv-p2p's addrs: the pages' physical addresses. */
static int gpupin_nvp2p_addrs(const struct gpupin_pin_obj *pin, u64 *addrs, u32 first, u32 count)
{
	u32 i;

	for (i = 0; i < count; i++)
		addrs[i] = pin->pt->pages[first + i]->physical_address;
	return 0;
}

/* nv-p2p's teardown: the provider tore the mappings down; free their descriptors and the table. */
static void gpupin_nvp2p_teardown(struct gpupin_pin_obj *pin)
{
	gpupin_free_maps_invalidated(pin);
	nvidia_p2p_free_page_table(pin->pt);
}

/*
 * Free callbacks still running gpupin's code.  gpupin_cb.ko holds the
 * module across every callback (a detached pin's own module reference goes
 * inside it), so an unload is refused while one runs; gpupin_exit() still
 * waits for this count to reach zero, then for every task to have left the
 * few instructions after the decrement (synchronize_rcu_tasks(), as for
 * code that module text frees under), should a callback ever come another
 * way.
 */
atomic_t gpupin_callbacks_running = ATOMIC_INIT(0);

/*
 * The nv-p2p free callback: the GPU memory under the pin is being freed.
 * Never calls put_pages or dma_unmap_pages, and never waits for a thread
 * that may wait for NVIDIA's lock (gpupin_pin_freed() waits only for
 * in-flight users).  @data is the pin's id (gpupin_cb_pins): the pin is
 * looked up, with a reference, under the xarray's lock, the innermost lock,
 * held for nothing else.  An id that finds nothing - a callback for a pin
 * gpupin already freed, because a put_pages that returned 0 released
 * nothing (an MPS client's registration pruned), or a duplicate - returns
 * at once: that pin's table, which the driver frees after this returns on
 * the drivers gpupin supports (nvidia_p2p_free_page_table is a no-op
 * there), is not freed by gpupin.
 *
 * NVIDIA does not call this directly: it calls gpupin_cb_free_callback()
 * (gpupin_cb.ko), which holds this module while it runs this, the handler
 * gpupin_init() registers.  A callback whose pin is gone may come after
 * gpupin.ko was unloaded (an MPS server freeing a client's memory after the
 * client's file closed; NVIDIA's API gives no way to know whether put_pages
 * released anything, so gpupin cannot hold itself for it): gpupin_cb.ko then
 * finds no handler, counts it and returns.
 */
static void gpupin_free_callback(void *data)
{
	struct gpupin_pin_obj *pin;
	bool detached = false;

	atomic_inc(&gpupin_callbacks_running);
	pin = gpupin_cb_pin_take(data);
	if (pin) {
		detached = gpupin_pin_freed(pin);
		gpupin_pin_put(pin);
	} else {
		pr_notice_ratelimited("free callback for pin id %lu: released or called back before, ignored\n",
				      (unsigned long)data);
	}
	if (detached)
		module_put(THIS_MODULE);
	gpupin_fault_callback_tail();
	if (atomic_dec_and_test(&gpupin_callbacks_running))
		wake_up_var(&gpupin_callbacks_running);
}

/* What gpupin_cb.ko calls, holding this module, while it is registered. */
static const struct gpupin_cb_handler gpupin_handler = {
	.owner = THIS_MODULE,
	.free_callback = gpupin_free_callback,
};

/* Module load, before anything can pin: receive the free callbacks. */
int gpupin_cb_handler_init(void)
{
	return gpupin_cb_register(&gpupin_handler);
}

/*
 * Module unload, before anything is torn down: from here on no callback
 * reaches gpupin_free_callback() (gpupin_cb.ko finds this module going,
 * counts the callback and returns).  None can be in it either: it would
 * hold this module, which could then not be unloading.
 */
void gpupin_cb_handler_exit(void)
{
	gpupin_cb_unregister(&gpupin_handler);
}

/*
 * A module load that fails, instead of gpupin_cb_handler_exit(): the loader
 * frees this module's memory as soon as gpupin_init() returns, without the
 * check for references an unload makes.  gpupin_cb.ko takes a module that is
 * still loading like any other, so a callback for a pin of an earlier
 * gpupin.ko (one whose put_pages released nothing: see the top of this file)
 * may be in gpupin_free_callback() now.  No pin of this instance exists (the
 * device was not created), so unregister, then wait until that callback's
 * module reference - the only one besides the loader's own - is back:
 * gpupin_cb.ko drops it once the callback has returned to it.
 */
void gpupin_cb_handler_abort(void)
{
	gpupin_cb_handler_exit();
#ifdef CONFIG_MODULE_UNLOAD
	/*
	 * Also a netlink dump left half read holds the module (the family is
	 * registered before the device fails): the load waits for its socket to
	 * close, and says so every 10 s.
	 */
	for (unsigned int i = 1; module_refcount(THIS_MODULE) > 1; i++) {
		msleep(20);
		if (!(i % 500))
			pr_warn("failed load: waiting for %d reference(s) to the module (a free callback running, or a netlink dump not read to its end)\n",
				module_refcount(THIS_MODULE) - 1);
	}
#else
	/*
	 * No references are counted: wait for the callbacks gpupin counts
	 * and for every task to have left their last instructions.  One that
	 * gpupin_cb.ko passed on but that has not counted itself yet is not
	 * seen here.
	 */
	wait_var_event(&gpupin_callbacks_running, !atomic_read(&gpupin_callbacks_running));
	synchronize_rcu_tasks();
#endif
}

/*
 * nv-p2p's release: put the pages of a pin whose release the caller claimed
 * (state @claimed), unless get_pages gave none or the free callback took the
 * pin meanwhile: NVIDIA has then freed the table, and a put of its address
 * could release another pin of this process that got it.  A callback that
 * comes after the check finishes before the put gets NVIDIA's lock, and no
 * get_pages can reuse the table before the put returns
 * (gpupin_p2p_tables).  Returns put_pages' error for a pin whose callback
 * may still be armed: the pin is then kept for it.
 */
static int gpupin_nvp2p_release(struct gpupin_pin_obj *pin, enum gpupin_pin_state claimed)
{
	bool persistent = pin->flags & GPUPIN_PIN_PERSISTENT;
	int ret;

	if (!pin->pt)
		return 0;
	mutex_lock(&gpupin_p2p_tables);
	if (!gpupin_pin_still_claimed(pin, claimed)) {
		mutex_unlock(&gpupin_p2p_tables);
		return 0;	/* the callback released them */
	}
	if (persistent || gpupin_fault_put_other_kind())
		ret = nvidia_p2p_put_pages_persistent(pin->aligned_va, pin->pt, 0);
	else
		ret = nvidia_p2p_put_pages(0, 0, pin->aligned_va, pin->pt);
	mutex_unlock(&gpupin_p2p_tables);
	/*
	 * 0 means "maybe released": NVIDIA returns 0 too when it found no
	 * mapping of this process for the table (an MPS client's registration
	 * pruned), and the callback stays armed.  The caller may free the pin
	 * all the same: the callback reaches it only by id, and finds nothing
	 * once the pin is gone (gpupin_free_callback()).
	 */
	if (!ret)
		return 0;
	pr_warn_ratelimited("put_pages failed: %d\n", ret);
	if (persistent)
		return 0;	/* no callback will come: nothing more to do */
	return ret;
}

/* What gpupin_nvp2p_acquire() leaves in pin->pt for get_pages to overwrite. */
#define GPUPIN_PT_UNSET ((struct nvidia_p2p_page_table *)ERR_PTR(-EINVAL))

/*
 * A failed get_pages' error as PIN reports it.  NVIDIA's nv_p2p_get_pages
 * pins (rm_p2p_get_pages) and then arms the callback
 * (rm_p2p_register_callback), taking its API lock for each.  Memory freed
 * in between loses its mapping without a callback; the registration then
 * fails with -EINVAL, and the failure path's put_pages, finding nothing,
 * sets *page_table to NULL.  No other -EINVAL leaves NULL there: the
 * argument checks leave it as it was (GPUPIN_PT_UNSET), and RM refusing
 * the range leaves it pointing at the freed table.  So -EINVAL with @pt
 * NULL is memory freed while gpupin pinned it: -ENXIO, as when the callback
 * runs before get_pages returns.  (An MPS client torn down in that window,
 * losing its registration, looks the same: its memory is gone for it.)
 */
static int gpupin_get_pages_err(int err, const struct nvidia_p2p_page_table *pt,
				bool persistent)
{
	if (err == -EINVAL && !pt && !persistent)
		return -ENXIO;
	return gpupin_provider_err(err);
}

/*
 * nv-p2p's acquire: get_pages of [aligned_va, aligned_va + aligned_size),
 * persistent or with the free callback, whose data is the pin's id.  The
 * callback may run as soon as get_pages returns.
 */
static int gpupin_nvp2p_acquire(struct gpupin_pin_obj *pin, void *req)
{
	bool persistent = pin->flags & GPUPIN_PIN_PERSISTENT;
	int ret;

	if (!persistent) {
		ret = gpupin_cb_id_alloc(pin);
		if (ret)
			return ret;
	}

	pin->pt = GPUPIN_PT_UNSET;	/* see gpupin_get_pages_err() */
	mutex_lock(&gpupin_p2p_tables);
	if (persistent)
		ret = nvidia_p2p_get_pages_persistent(pin->aligned_va, pin->aligned_size,
						      &pin->pt, 0);
	else
		ret = nvidia_p2p_get_pages(0, 0, pin->aligned_va, pin->aligned_size,
					   &pin->pt, gpupin_cb_free_callback,
					   (void *)(unsigned long)pin->cb_id);
	mutex_unlock(&gpupin_p2p_tables);
	if (ret) {
		gpupin_dbg("get_pages failed: %d\n", ret);
		ret = gpupin_get_pages_err(ret, pin->pt, persistent);
		pin->pt = NULL;
	}
	return ret;
}

/* The nv-p2p backend (gpupin.h: struct gpupin_pin_backend_ops). */
static const struct gpupin_pin_backend_ops gpupin_nvp2p_backend = {
	.acquire = gpupin_nvp2p_acquire,
	.commit = gpupin_nvp2p_commit,
	.release_here = gpupin_nvp2p_release_here,
	.release = gpupin_nvp2p_release,
	.teardown = gpupin_nvp2p_teardown,
	.forget = gpupin_nvp2p_forget,
	.addrs = gpupin_nvp2p_addrs,
	.bar1_addr = gpupin_nvp2p_bar1_addr,
	.probe_bar1 = gpupin_nvp2p_probe_bar1,
	.unmap_in_use = true,
};

/* PIN's checks of every field; the range widened to 64 KiB into aligned_va and aligned_size. */
static int gpupin_pin_validate(struct gpupin_pin *arg)
{
	u64 end, aligned_end;

	if ((arg->flags & ~GPUPIN_PIN_FLAGS_ALL) || arg->pad ||
	    arg->reserved[0] || arg->reserved[1])
		return -EINVAL;
	if (!arg->size || check_add_overflow(arg->va, arg->size, &end) ||
	    check_add_overflow(end, GPU_BOUND_SIZE - 1, &aligned_end))
		return -EINVAL;
	aligned_end &= GPU_BOUND_MASK;
	arg->aligned_va = arg->va & GPU_BOUND_MASK;
	arg->aligned_size = aligned_end - arg->aligned_va;
	if ((arg->aligned_size >> GPU_BOUND_SHIFT) > U32_MAX)
		return -EINVAL;
	return 0;
}

/* PIN's result for @pin (gpupin_pin_req.fill): @out is its struct gpupin_pin. */
static void gpupin_pin_fill(void *out, const struct gpupin_pin_obj *pin)
{
	struct gpupin_pin *arg = out;

	BUILD_BUG_ON(sizeof(arg->gpu_uuid) != 16);
	arg->handle = pin->handle;
	arg->page_size = BIT(pin->page_shift);
	arg->entries = pin->entries;
	gpupin_pin_uuid(pin, arg->gpu_uuid);
	arg->slot = pin->slot;
	arg->pin_flags = pin->flags;
	arg->valid_word = pin->handle;
}

/* PIN: copy in, validate, then a new nv-p2p pin (gpupin_pin_new). */
long gpupin_ioctl_pin(struct gpupin_file *f, struct gpupin_pin __user *uarg)
{
	struct gpupin_pin_req req;
	struct gpupin_pin arg;
	bool persistent;
	int ret;

	if (copy_from_user(&arg, uarg, sizeof(arg)))
		return -EFAULT;
	ret = gpupin_pin_validate(&arg);
	if (ret)
		return ret;
	if (!gpupin_caller_owns(f))
		return -EACCES;
	persistent = (arg.flags & GPUPIN_PIN_PERSISTENT) || READ_ONCE(gpupin_default_persistent);
	if (persistent && !(gpupin_caps & GPUPIN_CAP_PERSISTENT))
		return -EOPNOTSUPP;
#ifdef GPUPIN_NV_GET_PAGES_DOUBLE_FREE
	/* NVIDIA's get_pages with a callback can double-free here: main.c says why. */
	if (!persistent && !READ_ONCE(gpupin_nv_unsafe_get_pages))
		return -EOPNOTSUPP;
#endif
	req = (struct gpupin_pin_req) {
		.ops = &gpupin_nvp2p_backend,
		.va = arg.va,
		.size = arg.size,
		.aligned_va = arg.aligned_va,
		.aligned_size = arg.aligned_size,
		.user_tag = arg.user_tag,
		.page_shift = GPU_BOUND_SHIFT,
		/* Non-persistent pages come with a free callback: NVIDIA revokes them. */
		.flags = persistent ? GPUPIN_PIN_PERSISTENT : GPUPIN_PIN_REVOCABLE,
		.fill = gpupin_pin_fill,
		.arg = &arg,
		.len = sizeof(arg),
		.uarg = uarg,
	};
	return gpupin_pin_new(f, &req);
}
