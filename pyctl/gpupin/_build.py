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
HEADERS = ("gpupin.h", "nvp2p_sim.h", "gpupin_netlink.h")

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
"""

HELPERS_SRC = r"""
#include <errno.h>
#include <sys/ioctl.h>
#include <linux/types.h>
#include <libkmod.h>
#include "gpupin.h"
#include "nvp2p_sim.h"
#include "gpupin_netlink.h"

/* 0 or -errno, so Python needs no errno bookkeeping. */
static int gpupin_call(int fd, unsigned long cmd, void *arg)
{
	int r;

	do {
		r = ioctl(fd, cmd, arg);
	} while (r < 0 && errno == EINTR);
	return r < 0 ? -errno : r;
}
"""


def uapi_cdef() -> str:
    """Structures and constants of the UAPI headers, as cffi declarations."""
    out = [
        "typedef unsigned char __u8;",
        "typedef unsigned int __u32;",
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
ffibuilder.cdef(uapi_cdef() + LIBKMOD_CDEF + HELPERS_CDEF)
ffibuilder.set_source(
    "gpupin._gpupin_cffi",
    HELPERS_SRC,
    include_dirs=[str(UAPI)],
    libraries=["kmod"],
    extra_compile_args=["-O2", "-Wall"],
)

if __name__ == "__main__":
    import os
    import sys

    os.chdir(HERE.parent)
    ffibuilder.compile(tmpdir=str(HERE.parent), verbose="-v" in sys.argv)
