#!/bin/bash
# Build (once, cached in $GPUPIN_CACHE, default /var/cache/gpupin) a 6.1
# kernel from Debian's linux-source-6.1 for the VM harness; prints the tree's
# path.  Variants:
#   debug (default)  KASAN, lockdep, DEBUG_ATOMIC_SLEEP, kmemleak: 'make test-debug'
#   gcov             CONFIG_GCOV_KERNEL and the fault-injection framework
#                    (FAULT_INJECTION_DEBUG_FS), no KASAN: 'make coverage'
# About 13 minutes each on 2 cores.  The caches live outside the source tree:
# 'make clean' of an external module deletes every object file below the
# module's directory.
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "$0")/lib.sh"
CACHE=$GPUPIN_CACHE
VARIANT=${1:-debug}
case "$VARIANT" in
debug)
	TREE="$CACHE/linux-debug"
	STAMP="$TREE/.gpupin-debug-config-v1"
	OPTS=(-e KASAN -e KASAN_GENERIC -e PROVE_LOCKING -e DEBUG_ATOMIC_SLEEP
		-e DEBUG_KMEMLEAK -d DEBUG_KMEMLEAK_AUTO_SCAN
		-d DEBUG_KMEMLEAK_DEFAULT_OFF -e SLUB_DEBUG -e DEBUG_LIST)
	;;
gcov)
	TREE="$CACHE/linux-gcov"
	STAMP="$TREE/.gpupin-gcov-config-v1"
	# GCOV_KERNEL without GCOV_PROFILE_ALL: only modules built with
	# GCOV_PROFILE=y are instrumented.
	OPTS=(-e GCOV_KERNEL -d GCOV_PROFILE_ALL -e FAULT_INJECTION -e FAULT_INJECTION_DEBUG_FS
		-e SLUB_DEBUG -e DEBUG_LIST)
	;;
*)
	echo "debug-kernel.sh: unknown variant '$VARIANT' (debug or gcov)" >&2
	exit 2
	;;
esac
if [ -f "$STAMP" ] && [ -f "$TREE/arch/x86/boot/bzImage" ]; then
	echo "$TREE"
	exit 0
fi
apt_install_missing flex bison bc libelf-dev libssl-dev dwarves
if [ ! -f "$TREE/Makefile" ]; then
	rm -rf "$TREE" "$CACHE/linux-source-6.1"
	mkdir -p "$CACHE"
	tar -xf /usr/src/linux-source-6.1.tar.xz -C "$CACHE"
	mv "$CACHE/linux-source-6.1" "$TREE"
fi
cd "$TREE"
echo "debug-kernel.sh: building the $VARIANT kernel in $TREE (log: $TREE/build.log)" >&2
"$VENV/bin/virtme-configkernel" --defconfig >/dev/null
./scripts/config "${OPTS[@]}" \
	-e DEBUG_INFO_NONE -d DEBUG_INFO_DWARF5 -d DEBUG_INFO_DWARF_TOOLCHAIN_DEFAULT -d DEBUG_INFO_BTF \
	-m DRM_VGEM -e MODULES -e MODULE_UNLOAD -e PCI -e DEBUG_FS
make olddefconfig >/dev/null
for o in "${OPTS[@]}"; do
	case "$o" in -e) want=y ;; -d) want=n ;; *)
		if [ "$want" = y ] && ! grep -q "^CONFIG_$o=y" .config; then
			echo "debug-kernel.sh: CONFIG_$o did not survive olddefconfig" >&2
			exit 1
		fi ;;
	esac
done
make -j"$(nproc)" bzImage modules >"$TREE/build.log" 2>&1 || { tail -n 40 "$TREE/build.log" >&2; exit 1; }
touch "$STAMP"
echo "$TREE"
