/* SPDX-License-Identifier: (GPL-2.0 OR MIT) */
/*
 * gpupin_cb.ko: the nv-p2p free callback's permanent entry point, and the
 * callback ids (kernel/cb/tramp.c).  gpupin.ko hands NVIDIA
 * gpupin_cb_free_callback, never a function of its own, so a callback that
 * NVIDIA keeps armed after gpupin.ko was unloaded lands in code that is
 * still there.
 */
#ifndef _GPUPIN_CB_H
#define _GPUPIN_CB_H

#include <linux/types.h>

struct module;

/* What the trampoline calls: one at a time registered (gpupin.ko's). */
struct gpupin_cb_handler {
	struct module *owner;		/* held by the trampoline across free_callback */
	void (*free_callback)(void *data);
};

void gpupin_cb_free_callback(void *data);
u64 gpupin_cb_new_id(void);
int gpupin_cb_register(const struct gpupin_cb_handler *h);
void gpupin_cb_unregister(const struct gpupin_cb_handler *h);

#endif /* _GPUPIN_CB_H */
