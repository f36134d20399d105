#!/bin/bash
# Build (once, cached in $GPUPIN_CACHE, default /var/cache/gpupin) a kernel
# for the VM harness from Debian's source; prints the tree's path.  Variants:
#   debug (default)  6.1 (linux-source-6.1): KASAN, lockdep, DEBUG_ATOMIC_SLEEP,
#                    kmemleak: 'make test-debug'
#   gcov             6.1: CONFIG_GCOV_KERNEL and the fault-injection framework
#                    (FAULT_INJECTION_DEBUG_FS), no KASAN: 'make coverage'
#   dmem             Debian's newest (unstable's linux-source-X.Y, 6.14 or
#                    later) with the dmem cgroup controller, which Debian's own
#                    builds leave out: 'make test-vm-dmem'
# About 13 minutes each on 2 cores (dmem: 20 to 30).  The caches live outside the
# source tree: 'make clean' of an external module deletes every object file
# below the module's directory.
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
dmem)
	TREE="$CACHE/linux-dmem"
	STAMP="$TREE/.gpupin-dmem-config-v1"
	OPTS=(-e CGROUPS -e CGROUP_DMEM -e MEMCG -e SLUB_DEBUG -e DEBUG_LIST)
	;;
*)
	echo "debug-kernel.sh: unknown variant '$VARIANT' (debug, gcov or dmem)" >&2
	exit 2
	;;
esac
if [ -f "$STAMP" ] && [ -f "$TREE/arch/x86/boot/bzImage" ]; then
	echo "$TREE"
	exit 0
fi
apt_install_missing flex bison bc libelf-dev libssl-dev dwarves
# newest_source DIR: download unstable's newest linux-source-X.Y (a private apt
# configuration in DIR, nothing installed here) and print its tarball's path.
newest_source() {
	local dir=$1 pkg
	local -a o=(-o "Dir::Etc::sourcelist=$dir/sources.list" -o Dir::Etc::sourceparts=-
		-o "Dir::State::Lists=$dir/lists" -o "Dir::Cache=$dir" -o APT::Architecture=amd64)
	mkdir -p "$dir/lists/partial" "$dir/archives/partial"
	echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] ${GPUPIN_NEWEST_MIRROR:-http://deb.debian.org/debian} sid main" >"$dir/sources.list"
	apt-get "${o[@]}" update -qq >&2 || die "apt-get update (unstable) failed"
	pkg=$(apt-cache "${o[@]}" search --names-only '^linux-source-[0-9]+\.[0-9]+$' | awk '{print $1}' | sort -V | tail -n 1)
	[ -n "$pkg" ] || die "Debian unstable offers no linux-source-X.Y"
	rm -f "$dir"/*.deb
	(cd "$dir" && apt-get "${o[@]}" download "$pkg" >&2 2>/dev/null) || die "apt-get download $pkg failed"
	rm -rf "$dir/x"
	dpkg-deb -x "$dir/$pkg"_*.deb "$dir/x"
	ls "$dir/x/usr/src/$pkg.tar.xz"
}
if [ ! -f "$TREE/Makefile" ]; then
	rm -rf "$TREE" "$CACHE/linux-source-"*/
	mkdir -p "$CACHE"
	if [ "$VARIANT" = dmem ]; then
		tarball=$(newest_source "$CACHE/dmem-src")
	else
		tarball=/usr/src/linux-source-6.1.tar.xz
	fi
	echo "debug-kernel.sh: unpacking $tarball" >&2
	tar -xf "$tarball" -C "$CACHE"
	mv "$CACHE/$(basename "$tarball" .tar.xz)" "$TREE"
	[ "$VARIANT" != dmem ] || rm -rf "$CACHE/dmem-src"
fi
cd "$TREE"
echo "debug-kernel.sh: building the $VARIANT kernel in $TREE (log: $TREE/build.log)" >&2
"$VENV/bin/virtme-configkernel" --defconfig >"$TREE/config.log" 2>&1 || { tail -n 20 "$TREE/config.log" >&2; exit 1; }
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
