/* SPDX-License-Identifier: MIT OR GPL-2.0 */
/*
 * The C side of the gpupin Python package (built into gpupin._gpupin_cffi by
 * cffi from pyctl/gpupin/_build.py): ioctl helpers, the registration cache's
 * core, the CUDA, simulator and host memory buffer-id queries and CPython
 * fast paths.
 *
 * The block between "cffi cdef begin" and "cffi cdef end" is also what
 * _build.py hands to cffi as its declarations: it must stay plain C that
 * cffi's parser reads (no macros with values there).
 */
#ifndef GPUPIN_PY_H
#define GPUPIN_PY_H

#include <stdint.h>

#define GPC_MISS (-1)
#define GPC_BAD_ARG (-2)
#define GPC_CLOSED (-3)
#define GPC_TOO_MANY_REFS (-4)
#define GPC_NO_GENERATION (-5)	/* gpc_insert: every generation was given out (no wrap) */
#define GPC_STALE_BASE 8	/* stale entry's token -> -(token + GPC_STALE_BASE) */

/* gp_host_query's context: the words of HostMemory's id table (host.c) */
#define GP_HOST_BASE 0
#define GP_HOST_SIZE 1
#define GP_HOST_SHIFT 2
#define GP_HOST_IDS 3

/* cffi cdef begin */
int gpupin_call(int fd, unsigned long cmd, void *arg);
int gpupin_cover_zero(uint64_t addr, uint64_t len);

struct gpc;
/*
 * A provider's buffer-id query, as the hit path calls it: 0 and the buffer id
 * of the allocation holding ptr in *out, or non-zero when there is none (the
 * entry is then stale).  ctx is what the provider set with the query.
 */
typedef int (*gpc_buffer_id_query_t)(void *ctx, uint64_t ptr, uint64_t *out);
struct gpc *gpc_new(const uint64_t *words, uint64_t nwords, int check_kernel, int check_buffer_id);
void gpc_free(struct gpc *c);
int64_t gpc_close(struct gpc *c, int force);
void gpc_quiesce(struct gpc *c, int on);
void gpc_reset_in_child(struct gpc *c);
int gpc_set_words(struct gpc *c, const uint64_t *words, uint64_t nwords);
void gpc_set_max_refs(struct gpc *c, int32_t max_refs);
void gpc_set_gen(struct gpc *c, uint32_t gen);
int gpc_install(void);
int64_t gpc_lookup(struct gpc *c, uint64_t ptr, uint64_t size);
int gpc_release(struct gpc *c, int64_t tok);
int64_t gpc_insert(struct gpc *c, int64_t id, uint64_t start, uint64_t end, uint64_t buffer_id,
		   uint64_t slot, uint64_t valid_word);
int64_t gpc_stage(struct gpc *c, int64_t id, uint64_t start, uint64_t end, uint64_t buffer_id,
		  uint64_t slot, uint64_t valid_word);
int gpc_publish(struct gpc *c, int64_t tok);
void gpc_set_buffer_id_query(struct gpc *c, gpc_buffer_id_query_t query, void *ctx);
uint64_t gpc_query_loop(gpc_buffer_id_query_t query, void *ctx, const uint64_t *ptrs, uint64_t nptrs,
			uint64_t n);
int gpc_remove(struct gpc *c, int64_t tok);
int gpc_use(struct gpc *c, int64_t tok);
int gpc_retire(struct gpc *c, int64_t tok);
int64_t gpc_evict_lru(struct gpc *c);
int64_t gpc_evict_unused(struct gpc *c, int64_t *out, int64_t max);
int gpc_refs(struct gpc *c, int64_t tok);
int64_t gpc_held(struct gpc *c);
int gpc_trylock(struct gpc *c);
void gpc_lock(struct gpc *c);
void gpc_unlock(struct gpc *c);
void gpc_counts(struct gpc *c, uint64_t *acquires, uint64_t *hits);
int64_t gpc_find(struct gpc *c, uint64_t ptr);
int64_t gpc_overlap(struct gpc *c, uint64_t start, uint64_t stop);

int gp_cuda_open(int buffer_id_attr);
int gp_cuda_buffer_id(uint64_t ptr, uint64_t *out);
int gp_cuda_query(void *ctx, uint64_t ptr, uint64_t *out);
uint64_t gp_cuda_buffer_id_or_0(uint64_t ptr);

int gp_sim_query(void *ctx, uint64_t ptr, uint64_t *out);
int gp_host_query(void *ctx, uint64_t ptr, uint64_t *out);
int gp_cuda_attr_u64(uint64_t ptr, int attr, uint64_t *out);
/* cffi cdef end */

/* For the CPython entry points (python.c) only. */
int gpc_release_ex(struct gpc *c, int64_t tok, int *unindexed);
int64_t gpc_lookup_locked(struct gpc *c, uint64_t ptr, uint64_t size);
int gpc_release_locked(struct gpc *c, int64_t tok, int *unindexed);

#endif
