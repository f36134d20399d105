// SPDX-License-Identifier: MIT OR GPL-2.0
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "gpupin_py.h"

/*
 * CPython entry points for the hot paths, called with the vectorcall protocol
 * (METH_FASTCALL): a cffi call costs ~200 ns (argument conversion, dropping
 * and retaking the GIL), these ~40 ns.  They keep the GIL while the cache's
 * mutex is free, so threads hitting the cache do not hand the GIL over on
 * every call; a busy mutex (a miss or eviction in a cffi call, which runs
 * without the GIL) is waited for without the GIL.  Nobody waits for the GIL
 * while holding the mutex.  gpc_install() puts gpc_bind and cuda_buffer_id
 * on this module once.
 */
/*
 * PyLong_AsUnsignedLong, not ...LongLong: CPython converts an int of more
 * than one digit (any address) to long long through the generic byte-array
 * path, to long with a short loop (~20 ns less per argument here).
 */
_Static_assert(sizeof(unsigned long) == sizeof(uint64_t), "gpupin's fast paths need 64-bit longs");

static int gp_py_u64(PyObject *o, unsigned long long *out)
{
	PyObject *i;

	if (PyLong_CheckExact(o)) {
		*out = PyLong_AsUnsignedLong(o);
		return *out == (unsigned long)-1 && PyErr_Occurred() ? -1 : 0;
	}
	/* numpy integers and other __index__ types, as lookup() takes them */
	i = PyNumber_Index(o);
	if (!i)
		return -1;
	*out = PyLong_AsUnsignedLong(i);
	Py_DECREF(i);
	return *out == (unsigned long)-1 && PyErr_Occurred() ? -1 : 0;
}

/*
 * Take the core's mutex.  A busy one (a miss or eviction in a cffi call) is
 * waited for without the GIL, so other threads run meanwhile; the GIL is
 * taken back before the mutex is tried again, never while holding it (a
 * cffi caller would wait for the mutex a whole GIL switch interval).
 */
static void gpc_py_lock(struct gpc *c)
{
	while (gpc_trylock(c)) {
		Py_BEGIN_ALLOW_THREADS
		gpc_lock(c);
		gpc_unlock(c);
		Py_END_ALLOW_THREADS
	}
}

/*
 * What a capsule holds: the core, and each slot's token as an int object.  A
 * token is over 2^32, so a new int per hit would be an allocation (~10 ns of
 * a ~40 ns hit); while a slot holds the same entry, its hits return the same
 * object.  Touched only with the GIL held.
 */
struct gpc_py_tok {
	PyObject *obj;
	int64_t val;		/* the token obj is */
};

struct gpc_py {
	struct gpc *c;
	struct gpc_py_tok *toks;	/* by slot */
	Py_ssize_t n;
};

static PyObject *gpc_py_token(struct gpc_py *p, int64_t tok)
{
	Py_ssize_t id = (Py_ssize_t)(tok & 0xffffffff), n, i;
	struct gpc_py_tok *toks;
	PyObject *obj;

	if (id < p->n && p->toks[id].obj && p->toks[id].val == tok) {
		Py_INCREF(p->toks[id].obj);
		return p->toks[id].obj;
	}
	obj = PyLong_FromLongLong(tok);
	if (!obj)
		return NULL;
	if (id >= p->n) {
		n = id + 1 > 2 * p->n ? id + 1 : 2 * p->n;
		n = n < 64 ? 64 : n;
		toks = PyMem_Realloc(p->toks, n * sizeof(*toks));
		if (!toks)
			return obj;	/* uncached, still the token */
		for (i = p->n; i < n; i++)
			toks[i] = (struct gpc_py_tok){ NULL, -1 };
		p->toks = toks;
		p->n = n;
	}
	Py_INCREF(obj);
	Py_XSETREF(p->toks[id].obj, obj);
	p->toks[id].val = tok;
	return obj;
}

/*
 * self: a capsule holding a struct gpc_py; its context is the tuple given to
 * gpc_bind: (address, the cffi pointer object, which keeps the core alive,
 * the exception class for misuse, the callable that unpins a stale entry
 * whose last reference was released).  Capsules are not tracked by the
 * garbage collector: nothing in the tuple may refer back to the cache
 * strongly, or cache, core and validity map are never freed (cache/_hits.py
 * passes a callable holding a weak proxy).  The core never reads a validity map
 * that is gone: the cache closes it first, also when dropped unclosed.
 */
static PyObject *gpc_py_hit(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
	struct gpc_py *p = PyCapsule_GetPointer(self, NULL);
	unsigned long long ptr, size;
	int64_t r;

	if (nargs != 2) {
		PyErr_SetString(PyExc_TypeError, "fast_lookup(ptr, size) takes exactly 2 arguments");
		return NULL;
	}
	if (!p)
		return NULL;
	if (gp_py_u64(args[0], &ptr) || gp_py_u64(args[1], &size)) {
		/* Negative or past 64 bits: the cache's own error, as lookup() raises it */
		if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
			PyObject *ctx = PyCapsule_GetContext(self);

			PyErr_Clear();
			PyErr_Format(PyTuple_GET_ITEM(ctx, 2),
				     "fast_lookup(ptr=%R, size=%R): out of range: ptr takes 0 to 2**64 - 1, "
				     "size 1 to 2**64 - 1", args[0], args[1]);
		}
		return NULL;
	}
	if (!size || ptr + size < ptr)
		return PyLong_FromLong(GPC_BAD_ARG);
	gpc_py_lock(p->c);
	r = gpc_lookup_locked(p->c, ptr, size);
	gpc_unlock(p->c);
	if (r == GPC_CLOSED) {
		PyObject *ctx = PyCapsule_GetContext(self);

		PyErr_SetString(PyTuple_GET_ITEM(ctx, 2), "this RegistrationCache is closed (or was dropped)");
		return NULL;
	}
	return r >= 0 ? gpc_py_token(p, r) : PyLong_FromLongLong(r);
}

static PyMethodDef gpc_hit_def = {
	"fast_lookup", (PyCFunction)(void (*)(void))gpc_py_hit, METH_FASTCALL,
	"fast_lookup(ptr, size) -> token >= 0 on a hit, or a code < 0 for miss()"
};

static PyObject *gpc_py_release(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
	struct gpc_py *p = PyCapsule_GetPointer(self, NULL);
	PyObject *ctx;
	int refs, unindexed;
	long tok;

	if (nargs != 1) {
		PyErr_SetString(PyExc_TypeError, "release_token(token) takes exactly 1 argument");
		return NULL;
	}
	if (!p)
		return NULL;
	tok = PyLong_AsLong(args[0]);	/* not ...LongLong: see gp_py_u64 */
	if (tok == -1 && PyErr_Occurred()) {
		if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
			PyErr_Clear();
			ctx = PyCapsule_GetContext(self);
			PyErr_Format(PyTuple_GET_ITEM(ctx, 2),
				     "release_token(%R): not a token (tokens are 0 to 2**62 - 1, as lookup or "
				     "fast_lookup returned them)", args[0]);
		}
		return NULL;
	}
	gpc_py_lock(p->c);
	refs = gpc_release_locked(p->c, tok, &unindexed);
	gpc_unlock(p->c);
	if (refs > 0 || (refs == 0 && !unindexed))
		Py_RETURN_NONE;
	ctx = PyCapsule_GetContext(self);
	if (refs == GPC_CLOSED) {
		PyErr_Format(PyTuple_GET_ITEM(ctx, 2),
			     "release_token(%ld): this RegistrationCache is closed (or was dropped)", tok);
		return NULL;
	}
	if (refs < 0) {
		PyErr_Format(PyTuple_GET_ITEM(ctx, 2),
			     "release_token(%ld): not a held token (released already, or of another cache or process)",
			     tok);
		return NULL;
	}
	/* The last reference to a stale entry: Python unpins it. */
	return PyObject_CallOneArg(PyTuple_GET_ITEM(ctx, 3), args[0]);
}

static PyMethodDef gpc_release_def = {
	"release_token", (PyCFunction)(void (*)(void))gpc_py_release, METH_FASTCALL,
	"release_token(token): drop the reference fast_lookup (or lookup) took"
};

static void gpc_py_capsule_free(PyObject *cap)
{
	struct gpc_py *p = PyCapsule_GetPointer(cap, NULL);
	Py_ssize_t i;

	if (p) {
		for (i = 0; i < p->n; i++)
			Py_XDECREF(p->toks[i].obj);
		PyMem_Free(p->toks);
		PyMem_Free(p);
	}
	Py_XDECREF((PyObject *)PyCapsule_GetContext(cap));
}

/* gpc_bind((address, cdata, exception class, on_stale)) -> (fast_lookup, release_token) */
static PyObject *gpc_py_bind(PyObject *mod, PyObject *arg)
{
	PyObject *cap, *hit, *rel;
	struct gpc_py *p;
	void *c;

	(void)mod;
	if (!PyTuple_Check(arg) || PyTuple_GET_SIZE(arg) != 4 || !PyLong_Check(PyTuple_GET_ITEM(arg, 0)) ||
	    !PyExceptionClass_Check(PyTuple_GET_ITEM(arg, 2)) || !PyCallable_Check(PyTuple_GET_ITEM(arg, 3))) {
		PyErr_SetString(PyExc_TypeError, "gpc_bind((address, cdata, exception class, on_stale))");
		return NULL;
	}
	c = PyLong_AsVoidPtr(PyTuple_GET_ITEM(arg, 0));
	if (!c) {
		if (!PyErr_Occurred())
			PyErr_SetString(PyExc_ValueError, "gpc_bind: a NULL cache core");
		return NULL;
	}
	p = PyMem_Calloc(1, sizeof(*p));
	if (!p)
		return PyErr_NoMemory();
	p->c = c;
	cap = PyCapsule_New(p, NULL, gpc_py_capsule_free);
	if (!cap) {
		PyMem_Free(p);
		return NULL;
	}
	Py_INCREF(arg);
	if (PyCapsule_SetContext(cap, arg)) {
		Py_DECREF(arg);
		Py_DECREF(cap);
		return NULL;
	}
	hit = PyCFunction_New(&gpc_hit_def, cap);
	if (!hit) {
		Py_DECREF(cap);
		return NULL;
	}
	rel = PyCFunction_New(&gpc_release_def, cap);
	Py_DECREF(cap);
	if (!rel) {
		Py_DECREF(hit);
		return NULL;
	}
	return Py_BuildValue("(NN)", hit, rel);
}

/* The buffer id at ptr straight from libcuda, 0 where it is not CUDA memory. */
static PyObject *gp_py_cuda_buffer_id(PyObject *mod, PyObject *arg)
{
	unsigned long long ptr;

	(void)mod;
	if (gp_py_u64(arg, &ptr))
		return NULL;
	return PyLong_FromUnsignedLongLong(gp_cuda_buffer_id_or_0(ptr));
}

/*
 * The cost of calling C from Python with one address and getting an int back,
 * as cuda_buffer_id does, without the query: the benchmark's Python floor.
 */
static PyObject *gp_py_call_floor(PyObject *mod, PyObject *arg)
{
	unsigned long long ptr;

	(void)mod;
	if (gp_py_u64(arg, &ptr))
		return NULL;
	return PyLong_FromUnsignedLongLong(ptr >> 48);
}

static PyMethodDef gp_py_defs[] = {
	{ "gpc_bind", gpc_py_bind, METH_O, "(fast_lookup, release_token) bound to one cache core" },
	{ "cuda_buffer_id", gp_py_cuda_buffer_id, METH_O, "buffer id at ptr, 0 if not CUDA memory" },
	{ "call_floor", gp_py_call_floor, METH_O, "cuda_buffer_id's call without the query (benchmarks)" },
};

int gpc_install(void)
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
