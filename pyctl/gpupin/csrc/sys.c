// SPDX-License-Identifier: MIT OR GPL-2.0
/* System-call helpers: ioctl without errno bookkeeping, zero pages over a hole. */
#include <errno.h>
#include <sys/ioctl.h>
#include <sys/mman.h>

#include "gpupin_py.h"

/*
 * In a forked child: the validity map is not inherited (VM_DONTCOPY), so its
 * address range is a hole.  Cover it with zero pages (every word "invalid")
 * so inherited Python objects read zeros instead of faulting, and no later
 * mapping of the child lands where the parent's mmap object will unmap.
 */
int gpupin_cover_zero(uint64_t addr, uint64_t len)
{
	void *p = mmap((void *)(uintptr_t)addr, len, PROT_READ,
			MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);

	return p == MAP_FAILED ? -errno : 0;
}

/* 0 or -errno, so Python needs no errno bookkeeping. */
int gpupin_call(int fd, unsigned long cmd, void *arg)
{
	int r;

	do {
		r = ioctl(fd, cmd, arg);
	} while (r < 0 && errno == EINTR);
	return r < 0 ? -errno : r;
}
