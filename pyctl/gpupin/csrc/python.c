// SPDX-License-Identifier: MIT OR GPL-2.0
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "gpupin_py.h"

/*
 * CPython entry points for the hot paths, called with the vectorcall protocol
 * (METH_FASTCALL): a cffi call costs ~200 ns (argument conversion, dropping
 * and retaking the GIL), these ~40 ns.  They keep the GIL, so threads hitting
 * the cache do not hand the GIL over on every call; the cache mutex still
 * guards against the cffi-called gpc_* functions, which run without it and
 * never wait for the GIL while holding the mutex.  gpc_install() puts
 * gpc_bind and cuda_buffer_id on this module once.
 */
/*
 * PyLong_AsUnsignedLong, not ...LongLong: CPython converts an int of more
 * than one digit (any address) to long long through the generic byte-array
 * path, to long with a short loop (~20 ns less per argument here).
 */
_Static_assert(sizeof(unsigned long) == sizeof(uint64_t), "gpupin's fast paths need 64-bit longs");

static int gp_py_u64(PyObject *o, unsigned long long *out)
{
	*out = PyLong_AsUnsignedLong(o);
	return *out == (unsigned long)-1 && PyErr_Occurred() ? -1 : 0;
}

/*
 * self: a capsule holding the struct gpc; its context is the tuple given to
 * gpc_bind: (address, the cffi pointer object, which keeps the core alive,
 * the exception class for misuse, the callable that unpins a stale entry
 * whose last reference was released).  Capsules are not tracked by the
 * garbage collector: nothing in the tuple may refer back to the cache
 * strongly, or cache, core and validity map are never freed (cache.py passes
 * a callable holding a weak proxy).
 */
static PyObject *gpc_py_hit(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
	struct gpc *c = PyCapsule_GetPointer(self, NULL);
	unsigned long long ptr, size;
	int64_t r;

	if (nargs != 2) {
		PyErr_SetString(PyExc_TypeError, "fast_lookup(ptr, size) takes exactly 2 arguments");
		return NULL;
	}
	if (!c || gp_py_u64(args[0], &ptr) || gp_py_u64(args[1], &size))
		return NULL;
	r = gpc_lookup(c, ptr, size);
	if (r == GPC_CLOSED) {
		PyObject *ctx = PyCapsule_GetContext(self);

		PyErr_SetString(PyTuple_GET_ITEM(ctx, 2), "this RegistrationCache is closed");
		return NULL;
	}
	return PyLong_FromLongLong(r);
}

static PyMethodDef gpc_hit_def = {
	"fast_lookup", (PyCFunction)(void (*)(void))gpc_py_hit, METH_FASTCALL,
	"fast_lookup(ptr, size) -> token >= 0 on a hit, or a code < 0 for miss()"
};

static PyObject *gpc_py_release(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
	struct gpc *c = PyCapsule_GetPointer(self, NULL);
	PyObject *ctx;
	long long tok;
	int refs, unindexed;

	if (nargs != 1) {
		PyErr_SetString(PyExc_TypeError, "release_token(token) takes exactly 1 argument");
		return NULL;
	}
	if (!c)
		return NULL;
	tok = PyLong_AsLongLong(args[0]);
	if (tok == -1 && PyErr_Occurred())
		return NULL;
	refs = gpc_release_ex(c, tok, &unindexed);
	if (refs == GPC_CLOSED || (refs > 0 || (refs == 0 && !unindexed)))
		Py_RETURN_NONE;		/* closed: close() unpinned everything */
	ctx = PyCapsule_GetContext(self);
	if (refs < 0) {
		PyErr_Format(PyTuple_GET_ITEM(ctx, 2), "release_token(%lld): not a held token", tok);
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
	Py_XDECREF((PyObject *)PyCapsule_GetContext(cap));
}

/* gpc_bind((address, cdata, exception class, on_stale)) -> (fast_lookup, release_token) */
static PyObject *gpc_py_bind(PyObject *mod, PyObject *arg)
{
	PyObject *cap, *hit, *rel;
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
	cap = PyCapsule_New(c, NULL, gpc_py_capsule_free);
	if (!cap)
		return NULL;
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

static PyMethodDef gp_py_defs[] = {
	{ "gpc_bind", gpc_py_bind, METH_O, "(fast_lookup, release_token) bound to one cache core" },
	{ "cuda_buffer_id", gp_py_cuda_buffer_id, METH_O, "buffer id at ptr, 0 if not CUDA memory" },
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
