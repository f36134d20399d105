"""Load and unload kernel modules through libkmod (bound with cffi).

The PyPI ``kmod`` package no longer builds, so gpupin binds the few libkmod
calls it needs.  Errors say what went wrong and what to do.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ModuleError

try:
    from . import _gpupin_kmod as _ext  # type: ignore[attr-defined]
except ImportError as exc:  # pragma: no cover - depends on the build
    raise ModuleError(f"the libkmod binding is not built (needs libkmod-dev): run 'make pyext' ({exc})") from exc

ffi: Any = _ext.ffi
lib: Any = _ext.lib

_REQUIRED_SYMBOLS = ("nvidia_p2p_get_pages", "nvidia_p2p_put_pages")

# Modules of this package that another imports from.  Loaded by name, modprobe finds them
# (depmod); a .ko loaded by path gets no such help, so load() puts them in first.
# gpupin_cb: the free callback's entry point, which stays loaded (kernel/cb/tramp.c).
_DEPENDENCIES = {"gpupin": ("gpupin_cb",)}


def ko_dir() -> Path | None:
    """Where the built modules are: $GPUPIN_KO_DIR, else the source tree holding this package
    (pyctl/gpupin/ with the Kbuild file two levels up); None for an installed package, whose
    modules are the installed ones, loaded by name (a stray gpupin.ko in site-packages' parent
    must not be loaded)."""
    env = os.environ.get("GPUPIN_KO_DIR")
    if env:
        return Path(env)
    tree = Path(__file__).resolve().parents[2]
    return tree if (tree / "Kbuild").is_file() else None


def module_file(name: str) -> str:
    """The built ``name.ko`` if there is one, else ``name`` (installed modules, loaded by name)."""
    where = ko_dir()
    ko = where / f"{name}.ko" if where is not None else None
    return str(ko) if ko is not None and ko.exists() else name


@dataclass(frozen=True)
class ModuleInfo:
    name: str
    state: str  # "live", "coming", "going", "builtin" or "absent"
    refcount: int
    holders: list[str]
    parameters: dict[str, str]


@contextmanager
def _context() -> Iterator[Any]:
    ctx = lib.kmod_new(ffi.NULL, ffi.NULL)
    if ctx == ffi.NULL:
        raise ModuleError("libkmod: kmod_new failed (out of memory?)")
    try:
        yield ctx
    finally:
        lib.kmod_unref(ctx)


@contextmanager
def _module(ctx: Any, name_or_path: str) -> Iterator[Any]:
    mod = ffi.new("struct kmod_module **")
    if "/" in name_or_path or name_or_path.endswith(".ko"):
        if not os.path.exists(name_or_path):
            raise ModuleError(f"module file {name_or_path} does not exist: run 'make modules'", errno.ENOENT)
        ret = lib.kmod_module_new_from_path(ctx, os.fsencode(os.path.abspath(name_or_path)), mod)
    else:
        ret = lib.kmod_module_new_from_name(ctx, name_or_path.encode(), mod)
    if ret < 0:
        raise ModuleError(f"libkmod cannot open module {name_or_path}: {os.strerror(-ret)}", -ret)
    try:
        yield mod[0]
    finally:
        lib.kmod_module_unref(mod[0])


def _missing_symbols() -> list[str]:
    try:
        with open("/proc/kallsyms") as f:
            present = {line.split()[2] for line in f if "nvidia_p2p_" in line}
    except OSError:
        return []
    return [s for s in _REQUIRED_SYMBOLS if s not in present]


def _load_error(target: str, err: int) -> ModuleError:
    if err == errno.EEXIST:
        return ModuleError(f"{target} is already loaded", err)
    if err == errno.ENOENT and target.rstrip("/").endswith(("gpupin", "gpupin.ko")):
        missing = _missing_symbols() or list(_REQUIRED_SYMBOLS)
        return ModuleError(
            f"loading {target} failed: unknown symbol {missing[0]}: "
            "load nvidia (open kernel modules) or nvp2p_sim first ('gpupin load --sim')",
            err,
        )
    if err == errno.ENOENT:
        return ModuleError(
            f"loading {target} failed: module not found or unknown symbol "
            "(see dmesg): run 'make modules' or load its dependencies first",
            err,
        )
    if err == errno.EPERM:
        return ModuleError(
            f"loading {target} failed: not permitted (root, and module loading "
            "enabled; unsigned modules need Secure Boot off)",
            err,
        )
    if err == errno.ENOEXEC:
        return ModuleError(
            f"loading {target} failed: invalid module format: it was built for "
            "another kernel; rebuild with 'make modules'",
            err,
        )
    if err == errno.EINVAL:
        return ModuleError(f"loading {target} failed: invalid parameters (see dmesg)", err)
    return ModuleError(f"loading {target} failed: {os.strerror(err)}", err)


def _load_dependencies(path: str) -> None:
    """Before the module file ``path``: load this package's modules it imports from that are
    not loaded, from beside it where built there, else as ``module_file`` finds them."""
    for dep in _DEPENDENCIES.get(os.path.basename(path).removesuffix(".ko"), ()):
        if is_loaded(dep):
            continue
        beside = os.path.join(os.path.dirname(path), f"{dep}.ko")
        load(beside if os.path.exists(beside) else module_file(dep))


def load(name_or_path: str, params: Mapping[str, object] | None = None) -> None:
    """Insert a module from a .ko path (this package's modules it needs first) or by name
    (modprobe: dependencies through depmod), with parameters."""
    opts = " ".join(f"{k}={_param(v)}" for k, v in (params or {}).items())
    if ("/" in name_or_path or name_or_path.endswith(".ko")) and os.path.exists(name_or_path):
        _load_dependencies(name_or_path)
    with _context() as ctx, _module(ctx, name_or_path) as mod:
        if "/" in name_or_path or name_or_path.endswith(".ko"):
            ret = lib.kmod_module_insert_module(mod, 0, opts.encode())
        else:
            ret = lib.kmod_module_probe_insert_module(
                mod, lib.KMOD_PROBE_FAIL_ON_LOADED, opts.encode(), ffi.NULL, ffi.NULL, ffi.NULL
            )
            if ret > 0:  # blacklisted or install command refused
                ret = -errno.EPERM
    if ret < 0:
        raise _load_error(name_or_path, -ret)


def unload(name: str) -> None:
    """Remove a module; refused while it is in use."""
    name = os.path.basename(name).removesuffix(".ko")
    with _context() as ctx, _module(ctx, name) as mod:
        if lib.kmod_module_get_initstate(mod) < 0:
            raise ModuleError(f"{name} is not loaded", errno.ENOENT)
        ret = lib.kmod_module_remove_module(mod, lib.KMOD_REMOVE_NOWAIT)
    if ret == -errno.EAGAIN or ret == -errno.EBUSY:
        holders = info(name).holders
        who = f" (held by {', '.join(holders)})" if holders else " (a file is open)"
        raise ModuleError(f"{name} is in use{who}: close its users or unload them first", -ret)
    if ret < 0:
        raise ModuleError(f"unloading {name} failed: {os.strerror(-ret)}", -ret)


def info(name: str) -> ModuleInfo:
    """Init state, reference count, holders and parameters of a module."""
    with _context() as ctx, _module(ctx, name) as mod:
        st = lib.kmod_module_get_initstate(mod)
        state = "absent" if st < 0 else ffi.string(lib.kmod_module_initstate_str(st)).decode()
        refcnt = lib.kmod_module_get_refcnt(mod) if st >= 0 else 0
        holders: list[str] = []
        lst = lib.kmod_module_get_holders(mod) if st >= 0 else ffi.NULL
        it = lst
        while it != ffi.NULL:
            h = lib.kmod_module_get_module(it)
            holders.append(ffi.string(lib.kmod_module_get_name(h)).decode())
            lib.kmod_module_unref(h)
            it = lib.kmod_list_next(lst, it)
        if lst != ffi.NULL:
            lib.kmod_module_unref_list(lst)
    return ModuleInfo(name, state, max(refcnt, 0), holders, parameters(name))


def is_loaded(name: str) -> bool:
    return os.path.isdir(f"/sys/module/{name}/parameters") or os.path.exists(f"/sys/module/{name}/initstate")


def parameters(name: str) -> dict[str, str]:
    base = f"/sys/module/{name}/parameters"
    out: dict[str, str] = {}
    try:
        entries = sorted(os.listdir(base))
    except OSError:
        return out
    for p in entries:
        try:
            with open(os.path.join(base, p)) as f:
                out[p] = f.read().strip()
        except OSError:
            out[p] = "(unreadable)"
    return out


def _param(v: object) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    s = str(v)
    if any(c.isspace() for c in s):
        raise ModuleError(f"module parameter value {s!r} contains whitespace")
    return s
