#!/bin/bash
# SPDX-License-Identifier: (GPL-2.0 OR MIT)
# The modules built W=1 (warnings are errors) against the newest kernel headers
# Debian carries (unstable's linux-headers-amd64), with the compiler they were
# made for, in a Debian unstable chroot: a private apt configuration like any
# other build input, nothing installed on this machine.  The chroot (minbase +
# headers + compiler) is cached for a week in $GPUPIN_CACHE/newest-sid.tar.
# Usage: check-newest.sh   (root; ~6 min the first time, ~1 min cached)
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "$0")/../lib.sh"
CACHE=$GPUPIN_CACHE
BASE=$CACHE/newest-sid.tar
SUITE=${GPUPIN_NEWEST_SUITE:-sid}
MIRROR=${GPUPIN_NEWEST_MIRROR:-http://deb.debian.org/debian}
need_root "debootstrap, chroot"

R=$(mktemp -d /var/tmp/gpupin-newest.XXXXXX)
trap 'chroot_remove "$R"' EXIT

# The headers depend on the compiler their kernel was built with (linux-compiler-gcc-N-x86).
# Check-Valid-Until off: the registry here may serve a snapshot older than its Valid-Until
# (the signatures are still checked).
add_headers() {
	echo "check-newest: then $SUITE's linux-headers-amd64"
	chroot_enter "$R"
	chroot "$R" /bin/sh -c 'export DEBIAN_FRONTEND=noninteractive
		apt-get -o Acquire::Check-Valid-Until=false update -qq &&
		apt-get install -y -qq --no-install-recommends linux-headers-amd64 make libc6-dev && apt-get clean' \
		>>"$log" 2>&1 || { tail -n 20 "$log" >&2; die "installing the headers failed ($log)"; }
	chroot_leave "$R"
}
log=$CACHE/newest-sid.log
cached_chroot "$R" "$BASE" "$SUITE" "$MIRROR" "$log" add_headers
chroot_enter "$R"

kdir=$(ls -d "$R"/usr/src/linux-headers-*-amd64 | sort -V | tail -n 1)
kdir=${kdir#"$R"}
cc=$(sed -n 's/^CONFIG_CC_VERSION_TEXT="\(.*\)"/\1/p' "$R$kdir/.config")
echo "check-newest: building against ${kdir#/usr/src/linux-headers-} ($cc)"
copy_module_sources "$R/src/gpupin"
log=$(mktemp /var/tmp/gpupin-newest-build.XXXXXX)
if ! chroot "$R" make -C "$kdir" M=/src/gpupin W=1 NVIDIA_SRC=none KCFLAGS=-Werror modules >"$log" 2>&1; then
	cat "$log" >&2
	die "the W=1 build against $kdir failed (above)"
fi
# W=1 warnings that -Werror does not cover (modpost, objtool) still fail the check.
if grep -E 'warning:|WARNING:' "$log"; then
	die "the W=1 build against $kdir warns (above)"
fi
n=$(find "$R/src/gpupin" -name '*.ko' | wc -l)
[ "$n" -eq 4 ] || { cat "$log" >&2; die "expected gpupin.ko, gpupin_cb.ko, nvp2p_sim.ko and gpupin_peer.ko, found $n modules"; }
rm -f "$log"
echo "check-newest: W=1 clean against ${kdir#/usr/src/linux-headers-}: gpupin.ko, gpupin_cb.ko, nvp2p_sim.ko, gpupin_peer.ko"
