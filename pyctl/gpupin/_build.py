"""Build the gpupin cffi extension (out-of-line API mode).

The cdef is generated from the UAPI headers, so the C compiler checks every
structure layout against Python's view and evaluates every ioctl number; no
offset or magic number is written by hand.  Run directly to build in place.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
UAPI = ROOT / "include" / "uapi"
HEADERS = ("gpupin.h", "nvp2p_sim.h", "gpupin_netlink.h", "gpupin_peer.h")

_STRUCT = re.compile(r"^struct (\w+) \{\n(.*?)^\};", re.M | re.S)
_DEFINE = re.compile(r"^#define ((?:GPUPIN|NVP2P_SIM)_\w+)\s+[^\s\"]", re.M)
_ENUM = re.compile(r"^enum \w+ \{\n(.*?)^\};", re.M | re.S)
_ENUMERATOR = re.compile(r"^\s+((?:GPUPIN|NVP2P_SIM)_\w+)\b", re.M)

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

# The package's own C (csrc/): ioctl helpers, the cache core, the CUDA, simulator and host
# memory buffer-id queries, the CPython fast paths.  Its declarations for cffi are the marked block of the header.
CSRC = HERE / "csrc"
C_SOURCES = ("sys.c", "gpc.c", "cuda.c", "sim.c", "host.c", "python.c")
# -Werror: the package's C stays warning-free (make check also runs gcc -fanalyzer on it);
# GPUPIN_NO_WERROR=1 builds anyway with a compiler newer than this code knows.
C_FLAGS = ["-O2", "-Wall", "-Wextra"] + ([] if os.environ.get("GPUPIN_NO_WERROR") == "1" else ["-Werror"])


def helpers_cdef() -> str:
    text = (CSRC / "gpupin_py.h").read_text()
    block = text.split("/* cffi cdef begin */", 1)[1].split("/* cffi cdef end */", 1)[0]
    consts = re.findall(r"^#define (GPC?_\w+)", text, re.M)
    return block + "".join(f"#define {c} ...\n" for c in consts)


HELPERS_SRC = """
#include <linux/types.h>
#include "gpupin.h"
#include "nvp2p_sim.h"
#include "gpupin_netlink.h"
#include "gpupin_peer.h"
#include "gpupin_py.h"
"""


def uapi_cdef() -> str:
    """Structures and constants of the UAPI headers, as cffi declarations."""
    out = [
        "typedef unsigned char __u8;",
        "typedef unsigned int __u32;",
        "typedef int __s32;",
        "typedef unsigned long long __u64;",
    ]
    for name in HEADERS:
        text = (UAPI / name).read_text()
        text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
        for m in _STRUCT.finditer(text):
            out.append(f"struct {m.group(1)} {{\n{m.group(2)}}};")
        for m in _DEFINE.finditer(text):
            out.append(f"#define {m.group(1)} ...")
        for m in _ENUM.finditer(text):  # enumerators, as integer constants
            out += [f"#define {n} ..." for n in _ENUMERATOR.findall(m.group(1))]
    return "\n".join(out)


def struct_names() -> list[str]:
    names = []
    for name in HEADERS:
        names += _STRUCT.findall((UAPI / name).read_text())
    return [n for n, _ in names]


def make_ffibuilder() -> FFI:
    """The main extension.  setuptools wants source paths relative to the working directory
    (the project root under pip, pyctl/ when this file is run), so they are made here."""
    b = FFI()
    b.cdef(uapi_cdef() + helpers_cdef())
    b.set_source(
        "gpupin._gpupin_cffi",
        HELPERS_SRC,
        sources=[os.path.relpath(CSRC / f) for f in C_SOURCES],
        include_dirs=[str(UAPI), str(CSRC)],
        libraries=["dl", "pthread"],
        extra_compile_args=C_FLAGS,
        # The fast paths use the full C API (tuple macros); built per interpreter anyway.
        py_limited_api=False,
        define_macros=[("_CFFI_NO_LIMITED_API", None)],
    )
    return b


ffibuilder = make_ffibuilder()

# libkmod in an extension of its own: hosts without libkmod-dev still get the rest.
kmodbuilder = FFI()
kmodbuilder.cdef(LIBKMOD_CDEF)
kmodbuilder.set_source("gpupin._gpupin_kmod", "#include <libkmod.h>", libraries=["kmod"], extra_compile_args=C_FLAGS)

# DRM dumb buffers and PRIME export (vgem, a second dma-buf exporter for tests), from
# libdrm's copy of the DRM UAPI; built only where that header is installed.
DRM_HEADER = Path("/usr/include/libdrm/drm.h")
DRM_CDEF = """
struct drm_mode_create_dumb { uint32_t height; uint32_t width; uint32_t bpp; uint32_t flags;
                              uint32_t handle; uint32_t pitch; uint64_t size; ...; };
struct drm_prime_handle { uint32_t handle; uint32_t flags; int32_t fd; ...; };
struct drm_gem_close { uint32_t handle; ...; };
#define DRM_IOCTL_MODE_CREATE_DUMB ...
#define DRM_IOCTL_PRIME_HANDLE_TO_FD ...
#define DRM_IOCTL_GEM_CLOSE ...
#define DRM_CLOEXEC ...
#define DRM_RDWR ...
"""
drmbuilder = FFI()
drmbuilder.cdef(DRM_CDEF)
drmbuilder.set_source(
    "gpupin._gpupin_drm",
    "#include <fcntl.h>\n#include <drm.h>\n#include <drm_mode.h>",
    include_dirs=[str(DRM_HEADER.parent)],
    extra_compile_args=C_FLAGS,
)

if __name__ == "__main__":
    import sys

    os.chdir(HERE.parent)
    ffibuilder = make_ffibuilder()
    ffibuilder.compile(tmpdir=str(HERE.parent), verbose="-v" in sys.argv)
    if "--no-kmod" not in sys.argv:
        kmodbuilder.compile(tmpdir=str(HERE.parent), verbose="-v" in sys.argv)
    if DRM_HEADER.exists():
        drmbuilder.compile(tmpdir=str(HERE.parent), verbose="-v" in sys.argv)
