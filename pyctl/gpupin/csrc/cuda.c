// SPDX-License-Identifier: MIT OR GPL-2.0
/*
 * CUDA pointer attributes straight from libcuda, resolved at run time (no
 * link-time dependency): the buffer-id query of the cache's hot path.
 */
#include <dlfcn.h>

#include "gpupin_py.h"

typedef int (*gp_cu_getattr_t)(void *data, int attr, uint64_t ptr);
static gp_cu_getattr_t gp_cu_getattr;
static int gp_cu_buffer_id_attr;

int gp_cuda_open(int buffer_id_attr)
{
	void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);

	if (!h)
		return -1;
	gp_cu_getattr = (gp_cu_getattr_t)dlsym(h, "cuPointerGetAttribute");
	gp_cu_buffer_id_attr = buffer_id_attr;
	return gp_cu_getattr ? 0 : -1;
}

/* CUresult of cuPointerGetAttribute(BUFFER_ID); -1 before gp_cuda_open. */
int gp_cuda_buffer_id(uint64_t ptr, uint64_t *out)
{
	if (!gp_cu_getattr)
		return -1;
	return gp_cu_getattr(out, gp_cu_buffer_id_attr, ptr);
}

/* gp_cuda_buffer_id as the cache's buffer-id query (gpc_buffer_id_query_t): no context. */
int gp_cuda_query(void *ctx, uint64_t ptr, uint64_t *out)
{
	(void)ctx;
	return gp_cuda_buffer_id(ptr, out);
}

/* Any 64-bit pointer attribute (for those cuda-python does not wrap); CUresult. */
int gp_cuda_attr_u64(uint64_t ptr, int attr, uint64_t *out)
{
	if (!gp_cu_getattr)
		return -1;
	*out = 0;
	return gp_cu_getattr(out, attr, ptr);
}

/* The buffer id at ptr, or 0 where CUDA says it is not device memory. */
uint64_t gp_cuda_buffer_id_or_0(uint64_t ptr)
{
	uint64_t bid = 0;

	return gp_cuda_buffer_id(ptr, &bid) == 0 ? bid : 0;
}
