// SPDX-License-Identifier: MIT OR GPL-2.0
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "gpupin_py.h"

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
	(void)mod;
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

	(void)mod;
	if (gp_py_u64(arg, &ptr))
		return NULL;
	return PyLong_FromUnsignedLongLong(gp_cuda_buffer_id_or_0(ptr));
}

static PyMethodDef gp_py_defs[] = {
	{ "gpc_bind", gpc_py_bind, METH_O, "a fast_lookup bound to one cache core" },
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
