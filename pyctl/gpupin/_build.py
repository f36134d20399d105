"""Build the gpupin cffi extension (out-of-line API mode).

The cdef is generated from the UAPI headers, so the C compiler checks every
structure layout against Python's view and evaluates every ioctl number; no
offset or magic number is written by hand.  Run directly to build in place.
"""

from __future__ import annotations

import re
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
UAPI = ROOT / "include" / "uapi"
HEADERS = ("gpupin.h", "nvp2p_sim.h", "gpupin_netlink.h", "gpupin_peer.h")

_STRUCT = re.compile(r"^struct (\w+) \{\n(.*?)^\};", re.M | re.S)
_DEFINE = re.compile(r"^#define ((?:GPUPIN|NVP2P_SIM)_\w+)\s+[^\s\"]", re.M)

LIBKMOD_CDEF = """
struct kmod_ctx;
struct kmod_module;
struct kmod_list;
struct kmod_ctx *kmod_new(const char *dirname, const char * const *config_paths);
struct kmod_ctx *kmod_unref(struct kmod_ctx *ctx);
int kmod_module_new_from_path(struct kmod_ctx *ctx, const char *path,
                              struct kmod_module **mod);
int kmod_module_new_from_name(struct kmod_ctx *ctx, const char *name,
                              struct kmod_module **mod);
int kmod_module_new_from_lookup(struct kmod_ctx *ctx, const char *given_alias,
                                struct kmod_list **list);
struct kmod_module *kmod_module_unref(struct kmod_module *mod);
int kmod_module_unref_list(struct kmod_list *list);
struct kmod_module *kmod_module_get_module(const struct kmod_list *entry);
struct kmod_list *kmod_list_next(const struct kmod_list *list,
                                 const struct kmod_list *curr);
int kmod_module_insert_module(struct kmod_module *mod, unsigned int flags,
                              const char *options);
int kmod_module_probe_insert_module(struct kmod_module *mod, unsigned int flags,
    const char *extra_options,
    int (*run_install)(struct kmod_module *m, const char *cmdline, void *data),
    const void *data,
    void (*print_action)(struct kmod_module *m, bool install, const char *options));
int kmod_module_remove_module(struct kmod_module *mod, unsigned int flags);
const char *kmod_module_get_name(const struct kmod_module *mod);
const char *kmod_module_get_path(const struct kmod_module *mod);
int kmod_module_get_initstate(const struct kmod_module *mod);
const char *kmod_module_initstate_str(int state);
int kmod_module_get_refcnt(const struct kmod_module *mod);
struct kmod_list *kmod_module_get_holders(const struct kmod_module *mod);
#define KMOD_PROBE_FAIL_ON_LOADED ...
#define KMOD_REMOVE_FORCE ...
#define KMOD_REMOVE_NOWAIT ...
"""

HELPERS_CDEF = """
int gpupin_call(int fd, unsigned long cmd, void *arg);
int gpupin_cover_zero(uint64_t addr, uint64_t len);

/* cache core (see CACHE_SRC) */
struct gpc;
struct gpc *gpc_new(const uint64_t *words, uint64_t nwords, int check_kernel, int check_tag_cuda);
void gpc_free(struct gpc *c);
void gpc_close(struct gpc *c);
int gpc_install(void);
int64_t gpc_lookup(struct gpc *c, uint64_t ptr, uint64_t size);
int gpc_release(struct gpc *c, int64_t id);
int gpc_insert(struct gpc *c, int64_t id, uint64_t start, uint64_t end, uint64_t buffer_id,
               uint64_t slot, uint64_t valid_word);
int gpc_remove(struct gpc *c, int64_t id);
int gpc_use(struct gpc *c, int64_t id);
int64_t gpc_evict_lru(struct gpc *c);
int gpc_refs(struct gpc *c, int64_t id);
void gpc_counts(struct gpc *c, uint64_t *acquires, uint64_t *hits);
int64_t gpc_find(struct gpc *c, uint64_t ptr);
int64_t gpc_overlap(struct gpc *c, uint64_t start, uint64_t stop);

/* CUDA driver, resolved at run time (no link-time dependency) */
int gp_cuda_open(int buffer_id_attr);
int gp_cuda_buffer_id(uint64_t ptr, uint64_t *out);
uint64_t gp_cuda_buffer_id_or_0(uint64_t ptr);
int gp_cuda_attr_u64(uint64_t ptr, int attr, uint64_t *out);
#define GPC_MISS ...
#define GPC_BAD_ARG ...
#define GPC_CLOSED ...
#define GPC_STALE_BASE ...
"""

HELPERS_SRC = r"""
#include <errno.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <linux/types.h>
#include "gpupin.h"
#include "nvp2p_sim.h"
#include "gpupin_netlink.h"
#include "gpupin_peer.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/*
 * In a forked child: the validity map is not inherited (VM_DONTCOPY), so its
 * address range is a hole.  Cover it with zero pages (every word "invalid")
 * so inherited Python objects read zeros instead of faulting, and no later
 * mapping of the child lands where the parent's mmap object will unmap.
 */
static int gpupin_cover_zero(uint64_t addr, uint64_t len)
{
	void *p = mmap((void *)(uintptr_t)addr, len, PROT_READ,
			MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);

	return p == MAP_FAILED ? -errno : 0;
}

/* 0 or -errno, so Python needs no errno bookkeeping. */
static int gpupin_call(int fd, unsigned long cmd, void *arg)
{
	int r;

	do {
		r = ioctl(fd, cmd, arg);
	} while (r < 0 && errno == EINTR);
	return r < 0 ? -errno : r;
}

/*
 * The registration cache's hot path: one call finds the entry covering
 * [ptr, ptr + size), checks its validity word (and, for CUDA memory, the
 * buffer id at ptr), and takes a reference.  Python keeps everything else.
 *
 * Entries are indexed by id (chosen by Python); the index is an array of
 * starts sorted ascending, with no two entries overlapping.  All under one
 * mutex: cffi drops the GIL around these calls.
 */
#define GPC_MISS (-1)
#define GPC_BAD_ARG (-2)
#define GPC_CLOSED (-3)
#define GPC_STALE_BASE 4	/* stale entry id -> -(id + GPC_STALE_BASE) */

struct gpc_ent {
	uint64_t start, end, buffer_id, valid_word, slot, lru;
	int32_t refs;
	int32_t indexed;
};

struct gpc {
	pthread_mutex_t lock;
	const volatile uint64_t *words;
	uint64_t nwords;
	int check_kernel, check_tag_cuda;
	int closed;			/* gpc_close(): every lookup says GPC_CLOSED */
	struct gpc_ent *ents;
	int64_t nents;
	uint64_t *starts;
	int64_t *ids;
	int64_t n, cap;
	uint64_t tick, acquires, hits;
};

typedef int (*gp_cu_getattr_t)(void *data, int attr, uint64_t ptr);
static gp_cu_getattr_t gp_cu_getattr;
static int gp_cu_buffer_id_attr;

static int gp_cuda_open(int buffer_id_attr)
{
	void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);

	if (!h)
		return -1;
	gp_cu_getattr = (gp_cu_getattr_t)dlsym(h, "cuPointerGetAttribute");
	gp_cu_buffer_id_attr = buffer_id_attr;
	return gp_cu_getattr ? 0 : -1;
}

/* CUresult of cuPointerGetAttribute(BUFFER_ID); -1 before gp_cuda_open. */
static int gp_cuda_buffer_id(uint64_t ptr, uint64_t *out)
{
	if (!gp_cu_getattr)
		return -1;
	return gp_cu_getattr(out, gp_cu_buffer_id_attr, ptr);
}

/* Any 64-bit pointer attribute (for those cuda-python does not wrap); CUresult. */
static int gp_cuda_attr_u64(uint64_t ptr, int attr, uint64_t *out)
{
	if (!gp_cu_getattr)
		return -1;
	*out = 0;
	return gp_cu_getattr(out, attr, ptr);
}

/* The buffer id at ptr, or 0 where CUDA says it is not device memory. */
static uint64_t gp_cuda_buffer_id_or_0(uint64_t ptr)
{
	uint64_t bid = 0;

	return gp_cuda_buffer_id(ptr, &bid) == 0 ? bid : 0;
}

static struct gpc *gpc_new(const uint64_t *words, uint64_t nwords, int check_kernel, int check_tag_cuda)
{
	struct gpc *c = calloc(1, sizeof(*c));

	if (!c)
		return NULL;
	pthread_mutex_init(&c->lock, NULL);
	c->words = words;
	c->nwords = nwords;
	c->check_kernel = check_kernel;
	c->check_tag_cuda = check_tag_cuda;
	return c;
}

/*
 * The cache closed: drop the index and stop reading the validity map (which
 * may be unmapped next).  The struct stays until gpc_free, since bound fast
 * paths (gpc_bind) may still be called.
 */
static void gpc_close(struct gpc *c)
{
	pthread_mutex_lock(&c->lock);
	c->closed = 1;
	c->words = NULL;
	c->nwords = 0;
	c->n = c->nents = c->cap = 0;
	free(c->ents);
	free(c->starts);
	free(c->ids);
	c->ents = NULL;
	c->starts = NULL;
	c->ids = NULL;
	pthread_mutex_unlock(&c->lock);
}

static void gpc_free(struct gpc *c)
{
	if (!c)
		return;
	pthread_mutex_destroy(&c->lock);
	free(c->ents);
	free(c->starts);
	free(c->ids);
	free(c);
}

/* Index position of the last entry starting at or before ptr, or -1. */
static int64_t gpc_pos(const struct gpc *c, uint64_t ptr)
{
	int64_t lo = 0, hi = c->n;

	while (lo < hi) {
		int64_t mid = lo + (hi - lo) / 2;

		if (c->starts[mid] <= ptr)
			lo = mid + 1;
		else
			hi = mid;
	}
	return lo - 1;
}

/*
 * >= 0: the id of a valid entry covering the range, now referenced.
 * GPC_MISS: no entry covers it; GPC_BAD_ARG: empty or wrapping range.
 * -(id + GPC_STALE_BASE): an entry covers it but is stale (validity word or
 * buffer id changed); no reference taken.
 */
static int64_t gpc_lookup(struct gpc *c, uint64_t ptr, uint64_t size)
{
	int64_t pos, id, ret = GPC_MISS;
	struct gpc_ent *e;

	if (!size || ptr + size < ptr)
		return GPC_BAD_ARG;
	pthread_mutex_lock(&c->lock);
	if (c->closed) {
		pthread_mutex_unlock(&c->lock);
		return GPC_CLOSED;
	}
	c->acquires++;
	pos = gpc_pos(c, ptr);
	if (pos < 0)
		goto out;
	id = c->ids[pos];
	e = &c->ents[id];
	if (ptr + size > e->end)
		goto out;
	if (c->check_kernel && (e->slot >= c->nwords || c->words[e->slot] != e->valid_word)) {
		ret = -(id + GPC_STALE_BASE);
		goto out;
	}
	if (c->check_tag_cuda) {
		uint64_t bid = 0;

		if (gp_cuda_buffer_id(ptr, &bid) != 0 || bid != e->buffer_id) {
			ret = -(id + GPC_STALE_BASE);
			goto out;
		}
	}
	e->refs++;
	c->hits++;
	ret = id;
out:
	pthread_mutex_unlock(&c->lock);
	return ret;
}

/* Index position of entry id, which starts at start, or -1. */
static int64_t gpc_index_of(const struct gpc *c, int64_t id)
{
	int64_t pos = gpc_pos(c, c->ents[id].start);

	for (; pos >= 0 && c->starts[pos] == c->ents[id].start; pos--)
		if (c->ids[pos] == id)
			return pos;
	return -1;
}

static int gpc_release(struct gpc *c, int64_t id)
{
	int refs;

	pthread_mutex_lock(&c->lock);
	if (id < 0 || id >= c->nents || c->ents[id].refs <= 0) {
		pthread_mutex_unlock(&c->lock);
		return -1;
	}
	refs = --c->ents[id].refs;
	if (!refs)
		c->ents[id].lru = ++c->tick;
	pthread_mutex_unlock(&c->lock);
	return refs;
}

static int gpc_use(struct gpc *c, int64_t id)
{
	int refs = -1;

	pthread_mutex_lock(&c->lock);
	if (id >= 0 && id < c->nents)
		refs = ++c->ents[id].refs;
	pthread_mutex_unlock(&c->lock);
	return refs;
}

static int gpc_refs(struct gpc *c, int64_t id)
{
	int refs = -1;

	pthread_mutex_lock(&c->lock);
	if (id >= 0 && id < c->nents)
		refs = c->ents[id].refs;
	pthread_mutex_unlock(&c->lock);
	return refs;
}

static int gpc_insert(struct gpc *c, int64_t id, uint64_t start, uint64_t end, uint64_t buffer_id,
			uint64_t slot, uint64_t valid_word)
{
	int64_t pos;
	int ret = 0;

	if (id < 0 || end <= start)
		return -1;
	pthread_mutex_lock(&c->lock);
	if (id >= c->nents) {
		int64_t n = id + 1 > 2 * c->nents ? id + 1 : 2 * c->nents;
		struct gpc_ent *ents = realloc(c->ents, n * sizeof(*ents));

		if (!ents) {
			ret = -1;
			goto out;
		}
		memset(ents + c->nents, 0, (n - c->nents) * sizeof(*ents));
		c->ents = ents;
		c->nents = n;
	}
	if (c->n == c->cap) {
		int64_t cap = c->cap ? 2 * c->cap : 64;
		uint64_t *starts = realloc(c->starts, cap * sizeof(*starts));
		int64_t *ids;

		if (!starts) {
			ret = -1;
			goto out;
		}
		c->starts = starts;
		ids = realloc(c->ids, cap * sizeof(*ids));
		if (!ids) {
			ret = -1;
			goto out;
		}
		c->ids = ids;
		c->cap = cap;
	}
	if (c->ents[id].indexed) {
		ret = -1;
		goto out;
	}
	c->ents[id] = (struct gpc_ent){ start, end, buffer_id, valid_word, slot, 0, 0, 1 };
	pos = gpc_pos(c, start) + 1;
	memmove(c->starts + pos + 1, c->starts + pos, (c->n - pos) * sizeof(*c->starts));
	memmove(c->ids + pos + 1, c->ids + pos, (c->n - pos) * sizeof(*c->ids));
	c->starts[pos] = start;
	c->ids[pos] = id;
	c->n++;
out:
	pthread_mutex_unlock(&c->lock);
	return ret;
}

/* Take id out of the index (its refs stay until released). */
static int gpc_remove(struct gpc *c, int64_t id)
{
	int64_t pos;
	int ret = -1;

	pthread_mutex_lock(&c->lock);
	if (id >= 0 && id < c->nents && c->ents[id].indexed) {
		pos = gpc_index_of(c, id);
		if (pos >= 0) {
			memmove(c->starts + pos, c->starts + pos + 1, (c->n - pos - 1) * sizeof(*c->starts));
			memmove(c->ids + pos, c->ids + pos + 1, (c->n - pos - 1) * sizeof(*c->ids));
			c->n--;
			ret = 0;
		}
		c->ents[id].indexed = 0;
	}
	pthread_mutex_unlock(&c->lock);
	return ret;
}

/*
 * Take the indexed, unreferenced entry released longest ago out of the
 * index, atomically with choosing it (no lookup can reference it after);
 * returns its id, or -1 if every indexed entry is in use.
 */
static int64_t gpc_evict_lru(struct gpc *c)
{
	int64_t i, best = -1, best_pos = -1;
	uint64_t best_lru = UINT64_MAX;

	pthread_mutex_lock(&c->lock);
	for (i = 0; i < c->n; i++) {
		struct gpc_ent *e = &c->ents[c->ids[i]];

		if (!e->refs && e->lru < best_lru) {
			best_lru = e->lru;
			best = c->ids[i];
			best_pos = i;
		}
	}
	if (best >= 0) {
		memmove(c->starts + best_pos, c->starts + best_pos + 1,
			(c->n - best_pos - 1) * sizeof(*c->starts));
		memmove(c->ids + best_pos, c->ids + best_pos + 1, (c->n - best_pos - 1) * sizeof(*c->ids));
		c->n--;
		c->ents[best].indexed = 0;
	}
	pthread_mutex_unlock(&c->lock);
	return best;
}

/* The indexed entry whose range holds ptr (for invalidation), or -1. */
static int64_t gpc_find(struct gpc *c, uint64_t ptr)
{
	int64_t pos, id = -1;

	pthread_mutex_lock(&c->lock);
	pos = gpc_pos(c, ptr);
	if (pos >= 0 && ptr < c->ents[c->ids[pos]].end)
		id = c->ids[pos];
	pthread_mutex_unlock(&c->lock);
	return id;
}

/* Some indexed entry overlapping [start, stop), or -1. */
static int64_t gpc_overlap(struct gpc *c, uint64_t start, uint64_t stop)
{
	int64_t pos, id = -1;

	pthread_mutex_lock(&c->lock);
	pos = gpc_pos(c, stop - 1);	/* the last entry starting before stop */
	if (pos >= 0 && c->ents[c->ids[pos]].end > start)
		id = c->ids[pos];
	pthread_mutex_unlock(&c->lock);
	return id;
}

static void gpc_counts(struct gpc *c, uint64_t *acquires, uint64_t *hits)
{
	pthread_mutex_lock(&c->lock);
	*acquires = c->acquires;
	*hits = c->hits;
	pthread_mutex_unlock(&c->lock);
}

/*
 * CPython entry points for the two hot paths, called with the vectorcall
 * protocol (METH_FASTCALL): a cffi call costs ~200 ns (argument conversion,
 * dropping and retaking the GIL), these ~40 ns.  They keep the GIL; the cache
 * mutex still guards against the cffi-called gpc_* functions, which run
 * without it and never wait for the GIL while holding the mutex.
 * gpc_install() puts gpc_bind and cuda_buffer_id on this module once.
 */
static int gp_py_u64(PyObject *o, unsigned long long *out)
{
	*out = PyLong_AsUnsignedLongLong(o);
	return *out == (unsigned long long)-1 && PyErr_Occurred() ? -1 : 0;
}

/* self: (address of struct gpc, its cffi pointer object, exception class) */
static PyObject *gpc_py_hit(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
	struct gpc *c = PyLong_AsVoidPtr(PyTuple_GET_ITEM(self, 0));
	unsigned long long ptr, size;
	int64_t r;

	if (nargs != 2) {
		PyErr_SetString(PyExc_TypeError, "fast_lookup(ptr, size) takes exactly 2 arguments");
		return NULL;
	}
	if (gp_py_u64(args[0], &ptr) || gp_py_u64(args[1], &size))
		return NULL;
	r = gpc_lookup(c, ptr, size);
	if (r == GPC_CLOSED) {
		PyErr_SetString(PyTuple_GET_ITEM(self, 2), "this RegistrationCache is closed");
		return NULL;
	}
	return PyLong_FromLongLong(r);
}

static PyMethodDef gpc_hit_def = {
	"fast_lookup", (PyCFunction)(void (*)(void))gpc_py_hit, METH_FASTCALL,
	"fast_lookup(ptr, size) -> token >= 0 on a hit, or a code < 0 for miss()"
};

static PyObject *gpc_py_bind(PyObject *mod, PyObject *arg)
{
	if (!PyTuple_Check(arg) || PyTuple_GET_SIZE(arg) != 3 || !PyLong_Check(PyTuple_GET_ITEM(arg, 0))) {
		PyErr_SetString(PyExc_TypeError, "gpc_bind((address, cdata, exception class))");
		return NULL;
	}
	return PyCFunction_New(&gpc_hit_def, arg);
}

/* The buffer id at ptr straight from libcuda, 0 where it is not CUDA memory. */
static PyObject *gp_py_cuda_buffer_id(PyObject *mod, PyObject *arg)
{
	unsigned long long ptr;

	if (gp_py_u64(arg, &ptr))
		return NULL;
	return PyLong_FromUnsignedLongLong(gp_cuda_buffer_id_or_0(ptr));
}

static PyMethodDef gp_py_defs[] = {
	{ "gpc_bind", gpc_py_bind, METH_O, "a fast_lookup bound to one cache core" },
	{ "cuda_buffer_id", gp_py_cuda_buffer_id, METH_O, "buffer id at ptr, 0 if not CUDA memory" },
};

static int gpc_install(void)
{
	PyGILState_STATE g = PyGILState_Ensure();
	PyObject *mod = PyImport_ImportModule("gpupin._gpupin_cffi");
	int ret = mod ? 0 : -1;
	size_t i;

	for (i = 0; mod && !ret && i < sizeof(gp_py_defs) / sizeof(gp_py_defs[0]); i++) {
		PyObject *fn = PyCFunction_New(&gp_py_defs[i], NULL);

		ret = fn ? PyObject_SetAttrString(mod, gp_py_defs[i].ml_name, fn) : -1;
		Py_XDECREF(fn);
	}
	Py_XDECREF(mod);
	if (ret)
		PyErr_Clear();
	PyGILState_Release(g);
	return ret;
}
"""


def uapi_cdef() -> str:
    """Structures and constants of the UAPI headers, as cffi declarations."""
    out = [
        "typedef unsigned char __u8;",
        "typedef unsigned int __u32;",
        "typedef int __s32;",
        "typedef unsigned long long __u64;",
    ]
    for name in HEADERS:
        text = (UAPI / name).read_text()
        text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
        for m in _STRUCT.finditer(text):
            out.append(f"struct {m.group(1)} {{\n{m.group(2)}}};")
        for m in _DEFINE.finditer(text):
            out.append(f"#define {m.group(1)} ...")
    return "\n".join(out)


def struct_names() -> list[str]:
    names = []
    for name in HEADERS:
        names += _STRUCT.findall((UAPI / name).read_text())
    return [n for n, _ in names]


ffibuilder = FFI()
ffibuilder.cdef(uapi_cdef() + HELPERS_CDEF)
ffibuilder.set_source(
    "gpupin._gpupin_cffi",
    HELPERS_SRC,
    include_dirs=[str(UAPI)],
    libraries=["dl", "pthread"],
    extra_compile_args=["-O2", "-Wall"],
    # The fast paths use the full C API (tuple macros); built per interpreter anyway.
    py_limited_api=False,
    define_macros=[("_CFFI_NO_LIMITED_API", None)],
)

# libkmod in an extension of its own: hosts without libkmod-dev still get the rest.
kmodbuilder = FFI()
kmodbuilder.cdef(LIBKMOD_CDEF)
kmodbuilder.set_source("gpupin._gpupin_kmod", "#include <libkmod.h>", libraries=["kmod"],
                       extra_compile_args=["-O2", "-Wall"])

# DRM dumb buffers and PRIME export (vgem, a second dma-buf exporter for tests), from
# libdrm's copy of the DRM UAPI; built only where that header is installed.
DRM_HEADER = Path("/usr/include/libdrm/drm.h")
DRM_CDEF = """
struct drm_mode_create_dumb { uint32_t height; uint32_t width; uint32_t bpp; uint32_t flags;
                              uint32_t handle; uint32_t pitch; uint64_t size; ...; };
struct drm_prime_handle { uint32_t handle; uint32_t flags; int32_t fd; ...; };
struct drm_gem_close { uint32_t handle; ...; };
#define DRM_IOCTL_MODE_CREATE_DUMB ...
#define DRM_IOCTL_PRIME_HANDLE_TO_FD ...
#define DRM_IOCTL_GEM_CLOSE ...
#define DRM_CLOEXEC ...
#define DRM_RDWR ...
"""
drmbuilder = FFI()
drmbuilder.cdef(DRM_CDEF)
drmbuilder.set_source("gpupin._gpupin_drm", "#include <fcntl.h>\n#include <drm.h>\n#include <drm_mode.h>",
                      include_dirs=[str(DRM_HEADER.parent)], extra_compile_args=["-O2", "-Wall"])

if __name__ == "__main__":
    import os
    import sys

    os.chdir(HERE.parent)
    ffibuilder.compile(tmpdir=str(HERE.parent), verbose="-v" in sys.argv)
    if "--no-kmod" not in sys.argv:
        kmodbuilder.compile(tmpdir=str(HERE.parent), verbose="-v" in sys.argv)
    if DRM_HEADER.exists():
        drmbuilder.compile(tmpdir=str(HERE.parent), verbose="-v" in sys.argv)
