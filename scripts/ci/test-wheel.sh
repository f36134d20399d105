#!/bin/bash
# SPDX-License-Identifier: (GPL-2.0 OR MIT)
# The wheel of `make wheel` in a clean virtualenv, used from outside the
# source tree: it must import its compiled cffi extensions from the venv,
# find installed modules by name (modprobe/depmod), and run host-side code.
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "$0")/../lib.sh"
PY=${PYTHON:-python3}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

whl=$(build_wheel 2>"$TMP/build.txt") || { cat "$TMP/build.txt"; die "the wheel does not build"; }
"$PY" -m venv "$TMP/venv"
"$TMP/venv/bin/pip" install -q "$whl" >"$TMP/install.txt" 2>&1 ||
	{ cat "$TMP/install.txt"; die "the wheel does not install into a clean venv"; }
cd "$TMP"
GPUPIN_KO_DIR='' "$TMP/venv/bin/python" - "$TMP/venv" <<'PYEOF' || die "the installed wheel does not work (above)"
import os
import sys
import gpupin, gpupin._gpupin_cffi, gpupin._gpupin_kmod
from gpupin import kmod
from gpupin.cache import RegistrationCache
from gpupin.testing.fake import FakeDevice, FakeMemory

venv = sys.argv[1]
for m in (gpupin, gpupin._gpupin_cffi, gpupin._gpupin_kmod):
    assert m.__file__.startswith(venv), f"{m.__name__} comes from {m.__file__}, not the venv"
# csrc/ is compiled into the extensions; its sources are no use installed.
assert not os.path.exists(os.path.join(os.path.dirname(gpupin.__file__), "csrc")), "the wheel ships csrc/"
# Without a source tree the modules are loaded by name, as modprobe would.
assert kmod.module_file("gpupin") == "gpupin", kmod.module_file("gpupin")
mem = FakeMemory()
dev = FakeDevice(mem)
cache = RegistrationCache(dev, mem)
va = mem.alloc(1 << 20)
cache.acquire(va, 4096).release()
cache.acquire(va, 4096).release()
st = cache.stats()
assert st.hits == 1 and st.misses == 1, st
print("test-wheel: imports from", venv, "- cache hit through FakeDevice ok")
PYEOF
"$TMP/venv/bin/gpupin" --help >/dev/null || die "the gpupin command does not run"
echo "test-wheel: $(basename "$whl") installs into a clean venv and works outside the tree: ok"
