#!/bin/bash
# Build (once, cached in $GPUPIN_DEBUG_CACHE, default /var/cache/gpupin) a 6.1
# kernel from Debian's linux-source-6.1 with KASAN, lockdep, DEBUG_ATOMIC_SLEEP
# and kmemleak, for 'make test-debug'.  About 13 minutes on 2 cores; prints the
# tree's path.  The cache lives outside the source tree: 'make clean' of an
# external module deletes every object file below the module's directory.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${VENV:-$ROOT/.venv}
CACHE=${GPUPIN_DEBUG_CACHE:-/var/cache/gpupin}
TREE="$CACHE/linux-debug"
STAMP="$TREE/.gpupin-debug-config-v1"
if [ -f "$STAMP" ] && [ -f "$TREE/arch/x86/boot/bzImage" ]; then
	echo "$TREE"
	exit 0
fi
for p in flex bison bc libelf-dev libssl-dev dwarves; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing="${missing:-} $p"
done
if [ -n "${missing:-}" ]; then
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi
if [ ! -f "$TREE/Makefile" ]; then
	rm -rf "$TREE" "$CACHE/linux-source-6.1"
	mkdir -p "$CACHE"
	tar -xf /usr/src/linux-source-6.1.tar.xz -C "$CACHE"
	mv "$CACHE/linux-source-6.1" "$TREE"
fi
cd "$TREE"
"$VENV/bin/virtme-configkernel" --defconfig >/dev/null
./scripts/config -e KASAN -e KASAN_GENERIC -e PROVE_LOCKING -e DEBUG_ATOMIC_SLEEP \
	-e DEBUG_KMEMLEAK -d DEBUG_KMEMLEAK_AUTO_SCAN -e DEBUG_KMEMLEAK_DEFAULT_OFF -d DEBUG_KMEMLEAK_DEFAULT_OFF \
	-e DEBUG_INFO_NONE -d DEBUG_INFO_DWARF5 -d DEBUG_INFO_DWARF_TOOLCHAIN_DEFAULT -d DEBUG_INFO_BTF \
	-m DRM_VGEM -e MODULES -e MODULE_UNLOAD -e PCI -e DEBUG_FS -e SLUB_DEBUG -e DEBUG_LIST
make olddefconfig >/dev/null
make -j"$(nproc)" bzImage modules >"$TREE/build.log" 2>&1 || { tail -n 40 "$TREE/build.log" >&2; exit 1; }
touch "$STAMP"
echo "$TREE"
