#!/bin/bash
# SPDX-License-Identifier: (GPL-2.0 OR MIT)
# Build gpupin.ko against NVIDIA's real open kernel module sources and check
# that it would load on that driver.  Usage: check-nvidia.sh KDIR [SUITE...]
#
# For each Debian suite (default: bookworm trixie) it
#  1. downloads that suite's nvidia-open-kernel-dkms through a private apt
#     configuration (its own sources list, lists and cache under
#     $GPUPIN_CACHE/nvidia; the machine's apt setup is not touched),
#  2. unpacks it and builds nvidia.ko for KDIR's kernel (cached by driver and
#     kernel version; 4-5 min on 2 cores the first time),
#  3. builds gpupin.ko against it with W=1 (no warnings allowed) the way DKMS
#     does on a user's host (packaging/dkms-build.sh: Debian's layout has no
#     Module.symvers, so the CRCs are read out of that nvidia.ko), and
#  4. checks every nvidia_p2p_* CRC gpupin.ko imports against the driver's
#     Module.symvers, and that modinfo says `depends: gpupin_cb,nvidia` (with a
#     gpupin_cb.ko that depends on nothing, and no fault-injection code built in).
set -uo pipefail
KDIR=${1:?usage: check-nvidia.sh KDIR [SUITE...]}
shift
SUITES=("$@")
[ ${#SUITES[@]} -gt 0 ] || SUITES=(bookworm trixie)
# shellcheck source=scripts/lib.sh
. "$(dirname "$0")/../lib.sh"
CACHE=$GPUPIN_CACHE/nvidia
KDIR=${KDIR%/}
KVER=$(kver_of_kdir "$KDIR")
JOBS=$(nproc)

need apt-get dpkg-deb modprobe modinfo make gcc
[ -e "/lib/modules/$KVER/build" ] ||
	die "/lib/modules/$KVER/build is missing: install linux-headers-$KVER (make setup)"

APT="$CACHE/apt"
private_apt "$APT" \
	"deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bookworm contrib" \
	"deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie contrib"

# Refresh the private lists at most once a day.
if [ -z "$(find "$APT/lists" -maxdepth 1 -name '*Packages*' -mtime -1 2>/dev/null)" ]; then
	apt-get "${APTO[@]}" update || die "apt-get update of the private NVIDIA source list failed"
fi

# crc_check KO SYMVERS: print each nvidia_p2p_* import of KO with its CRC;
# fail unless all 8 are there and each equals the one nvidia exports.
crc_check() {
	local imports n sym crc want wcrc wmod wexp rc=0
	imports=$(modprobe --dump-modversions "$1" | awk '$2 ~ /^nvidia_p2p_/ {print $2, $1}' | sort)
	n=$(echo "$imports" | grep -c .)
	[ "$n" -ge 8 ] || { echo "  $1 imports $n nvidia_p2p_* symbols, expected 8"; rc=1; }
	while read -r sym crc; do
		[ -n "$sym" ] || continue
		want=$(awk -v s="$sym" '$2 == s {print $1, $3, $4}' "$2")
		read -r wcrc wmod wexp <<<"$want"
		if [ -z "$want" ] || [ $((crc)) -ne $((wcrc)) ] || [ "${wmod##*/}" != nvidia ]; then
			printf '  %-36s %s  MISMATCH (driver: %s)\n' "$sym" "$crc" "${want:-not exported}"
			rc=1
		else
			printf '  %-36s %s  %s\n' "$sym" "$crc" "$wexp"
		fi
	done <<<"$imports"
	return $rc
}

fail=0
summary=()
for suite in "${SUITES[@]}"; do
	t0=$(date +%s)
	ver=$(apt-cache "${APTO[@]}" madison nvidia-open-kernel-dkms |
		awk -v s="$suite" '$0 ~ s"/contrib" {print $3; exit}')
	[ -n "$ver" ] || die "no nvidia-open-kernel-dkms in $suite/contrib"
	dir="$CACHE/$ver"
	src="$dir/src"
	if [ ! -e "$src/.unpacked" ]; then
		rm -rf "$dir" && mkdir -p "$dir"
		(cd "$dir" && apt-get "${APTO[@]}" download "nvidia-open-kernel-dkms=$ver") ||
			die "download of nvidia-open-kernel-dkms $ver failed"
		mkdir -p "$dir/x"
		dpkg-deb -x "$dir"/nvidia-open-kernel-dkms_*.deb "$dir/x" || die "cannot unpack $ver"
		mv "$dir"/x/usr/src/nvidia-*-"${ver%%-*}" "$src" || die "unexpected layout in $ver"
		rm -rf "$dir/x"
		touch "$src/.unpacked"
	fi
	# Stable 6.1.y gave pci_resize_resource() an exclude_bars argument that
	# these releases predate; BAR resizing is not what is checked here.
	# The cached tree serves every kernel: patch or unpatch for this one.
	if grep -q "int __must_check pci_resize_resource(.*int size,$" \
		"/lib/modules/$KVER/source/include/linux/pci.h" "$KDIR/include/linux/pci.h" 2>/dev/null; then
		sed -i 's/pci_resize_resource(pci_dev, NV_GPU_BAR1, requested_size);/pci_resize_resource(pci_dev, NV_GPU_BAR1, requested_size, 0);/' \
			"$src/nvidia/nv-pci.c"
	else
		sed -i 's/pci_resize_resource(pci_dev, NV_GPU_BAR1, requested_size, 0);/pci_resize_resource(pci_dev, NV_GPU_BAR1, requested_size);/' \
			"$src/nvidia/nv-pci.c"
	fi
	out="$dir/built-$KVER"
	if [ ! -e "$out/Module.symvers" ]; then
		echo "check-nvidia: building NVIDIA $ver's nvidia.ko for $KVER (a few minutes)"
		if ! make -C "$src" -j"$JOBS" modules KERNEL_UNAME="$KVER" NV_KERNEL_MODULES=nvidia \
			>"$dir/nvidia-build.log" 2>&1; then
			tail -n 20 "$dir/nvidia-build.log"
			echo "check-nvidia: NVIDIA $ver does not build on $KVER (log: $dir/nvidia-build.log)" >&2
			fail=1
			summary+=("$suite $ver: nvidia.ko does not build on $KVER")
			continue
		fi
		mkdir -p "$out"
		cp "$src/Module.symvers" "$src/nvidia.ko" "$out/"
	fi

	# gpupin against it, in a private copy so the tree's simulator build stays.
	b="$dir/gpupin"
	rm -rf "$b" && mkdir -p "$b"
	copy_module_sources "$b" packaging/dkms-build.sh
	# As DKMS builds it on a user's host: Debian's layout (the header, no
	# Module.symvers), CRCs read out of the nvidia.ko built above.
	rm -f "$src/Module.symvers"
	if ! KBUILD_EXTRA_WARN=1 NVIDIA_SRC="$src" NVIDIA_KO="$out/nvidia.ko" \
		"$b/packaging/dkms-build.sh" "$KVER" "$KDIR" >"$dir/gpupin-build.log" 2>&1; then
		tail -n 20 "$dir/gpupin-build.log"
		fail=1
		summary+=("$suite $ver: gpupin.ko does not build")
		continue
	fi
	if grep -E "warning:|error:" "$dir/gpupin-build.log"; then
		echo "check-nvidia: W=1 build against NVIDIA $ver has warnings" >&2
		fail=1
	fi
	[ -e "$b/nvp2p_sim.ko" ] && { echo "check-nvidia: the simulator was built next to NVIDIA $ver" >&2; fail=1; }

	# Every nv-p2p import must carry the driver's CRC.
	echo "check-nvidia: NVIDIA $ver on $KVER: nvidia_p2p_* CRCs (gpupin.ko = nvidia Module.symvers)"
	bad=0
	crc_check "$b/gpupin.ko" "$out/Module.symvers" || bad=1
	# The check must be able to fail: a simulator build's CRCs never match.
	if [ -e "$ROOT/gpupin.ko" ] && modinfo -F depends "$ROOT/gpupin.ko" | grep -qw nvp2p_sim &&
		crc_check "$ROOT/gpupin.ko" "$out/Module.symvers" >/dev/null; then
		echo "check-nvidia: the simulator build's CRCs match NVIDIA $ver: the CRC check is broken" >&2
		bad=1
	fi
	deps=$(modinfo -F depends "$b/gpupin.ko" | tr , '\n' | sort | paste -sd,)
	[ "$deps" = gpupin_cb,nvidia ] ||
		{ echo "check-nvidia: gpupin.ko depends on '$deps', expected 'gpupin_cb,nvidia'" >&2; bad=1; }
	# The free callback's entry point stays loaded whatever the driver does: it needs nothing of it.
	if [ ! -e "$b/gpupin_cb.ko" ] || [ -n "$(modinfo -F depends "$b/gpupin_cb.ko")" ]; then
		echo "check-nvidia: no gpupin_cb.ko built next to NVIDIA $ver, or it depends on a module" >&2
		bad=1
	fi
	# A production build carries no fault injection (only simulator and GPUPIN_TESTING=1 builds do).
	if modinfo -F parm "$b/gpupin.ko" | grep -q fail_alloc_nth; then
		echo "check-nvidia: the production gpupin.ko has the fail_alloc_nth test parameter" >&2
		bad=1
	fi
	if nm "$b/gpupin.ko" | grep -Eqw 'gpupin_fail_alloc|should_fail|fault_create_debugfs_attr'; then
		echo "check-nvidia: the production gpupin.ko carries fault-injection code (kernel/fault.c)" >&2
		bad=1
	fi
	# Last, as they overwrite gpupin.ko: no nvidia.ko and no Module.symvers
	# is a clear failure, and only with GPUPIN_ALLOW_UNVERSIONED=1 the last
	# resort, unversioned imports said loudly, with a softdep so modprobe
	# still loads nvidia first.
	if NVIDIA_SRC="$src" NVIDIA_KO=none "$b/packaging/dkms-build.sh" "$KVER" "$KDIR" >"$dir/gpupin-unversioned.log" 2>&1 ||
		! grep -q "CRCs are unknown" "$dir/gpupin-unversioned.log"; then
		echo "check-nvidia: dkms-build.sh built without CRCs unasked ($dir/gpupin-unversioned.log)" >&2
		bad=1
	fi
	if ! GPUPIN_ALLOW_UNVERSIONED=1 NVIDIA_SRC="$src" NVIDIA_KO=none "$b/packaging/dkms-build.sh" "$KVER" "$KDIR" \
		>"$dir/gpupin-unversioned.log" 2>&1 ||
		! grep -q "WARNING: unversioned nvidia_p2p_" "$dir/gpupin-unversioned.log" ||
		[ "$(modinfo -F softdep "$b/gpupin.ko")" != "pre: nvidia" ]; then
		echo "check-nvidia: the unversioned last-resort build of dkms-build.sh misbehaves ($dir/gpupin-unversioned.log)" >&2
		bad=1
	fi
	[ $bad -eq 0 ] || fail=1
	summary+=("$suite $ver: $([ $bad -eq 0 ] && echo ok || echo FAILED), nvidia_p2p_* CRCs checked, depends: $deps, $(($(date +%s) - t0)) s")
done
echo "check-nvidia summary:"
printf '  %s\n' "${summary[@]}"
exit $fail
