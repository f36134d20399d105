// SPDX-License-Identifier: MIT OR GPL-2.0
/*
 * HostMemory's buffer-id query in C, for the cache's hit path, as CUDA's is
 * one cuPointerGetAttribute: no Python runs on a validated hit of host memory.
 *
 * ctx: one uint64_t array that HostMemory keeps, the cache holds as long as
 * it lives, and HostMemory's alloc and free write (under its lock):
 *   [GP_HOST_BASE]  the arena's first address
 *   [GP_HOST_SIZE]  its size in bytes (0 once closed: every query says none)
 *   [GP_HOST_SHIFT] log2 of the granule
 *   [GP_HOST_IDS + i] the buffer id of the allocation holding granule i, 0 if
 *   none.
 * A query racing with a free of the same memory sees the old id or 0, as a
 * CUDA query racing with cuMemFree does: the free is the caller's race.
 */
#include <errno.h>

#include "gpupin_py.h"

/* 0 and the buffer id of the allocation holding ptr, or -ENOENT. */
int gp_host_query(void *ctx, uint64_t ptr, uint64_t *out)
{
	const uint64_t *h = ctx;
	uint64_t base = h[GP_HOST_BASE];
	uint64_t size = __atomic_load_n(&h[GP_HOST_SIZE], __ATOMIC_ACQUIRE);
	uint64_t id;

	if (ptr < base || ptr - base >= size)
		return -ENOENT;
	id = __atomic_load_n(&h[GP_HOST_IDS + ((ptr - base) >> h[GP_HOST_SHIFT])], __ATOMIC_ACQUIRE);
	if (!id)
		return -ENOENT;
	*out = id;
	return 0;
}
