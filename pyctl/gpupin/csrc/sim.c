// SPDX-License-Identifier: MIT OR GPL-2.0
/*
 * The simulator's buffer-id query in C, for the cache's hit path: one
 * NVP2P_SIM_IOC_QUERY on the simulated context's fd, as CUDA's is one
 * cuPointerGetAttribute.  No Python runs on a validated hit.
 */
#include <errno.h>
#include <linux/types.h>

#include "nvp2p_sim.h"
#include "gpupin_py.h"

/*
 * ctx: the int holding SimMemory's fd, -1 once it is closed (a hit then says
 * stale and the cache's Python path reports the closed context).  0 and the
 * buffer id of the allocation holding ptr, or -errno (-ENOENT: none there).
 */
int gp_sim_query(void *ctx, uint64_t ptr, uint64_t *out)
{
	struct nvp2p_sim_query q = { .va = ptr };
	int fd = *(const volatile int *)ctx;
	int ret;

	if (fd < 0)
		return -EBADF;
	ret = gpupin_call(fd, NVP2P_SIM_IOC_QUERY, &q);
	if (ret < 0)
		return ret;
	*out = q.buffer_id;
	return 0;
}
