#!/bin/bash
# Kernel-side checks: a W=1 build with no warnings (the unicast-events variant too),
# the example peer built on its own, a driver without the persistent API refused, the
# get_pages double free told from the driver's source, sparse (C=2) clean, and
# checkpatch --strict with no errors.  Usage: check-kernel.sh [--matrix] KDIR
# --matrix (a further kernel of make test's matrix): only what depends on the kernel, the W=1
# builds and sparse; the build's refusals and the example's Makefile read gpupin's own files,
# and checkpatch the source, the same against any kernel (make check runs them).
set -uo pipefail
MATRIX=
[ "${1:-}" != --matrix ] || { MATRIX=1; shift; }
[ $# -eq 1 ] || { echo "usage: $0 [--matrix] KDIR" >&2; exit 2; }
KDIR=$1
# shellcheck source=scripts/lib.sh
. "$(dirname "$0")/../lib.sh"
CP="$ROOT/.cache/checkpatch/checkpatch.pl"
LOG=$(mktemp -d)
fail=0

# w1_clean WHAT LOG: say and fail when the build log LOG shows warnings or errors.
# Case-insensitive: modpost says "WARNING: modpost: ..." (a missing export, a section mismatch).
w1_clean() {
	if grep -iE "warning:|error:" "$2"; then
		echo "check: W=1 build of $1 has warnings or errors" >&2
		fail=1
		return 1
	fi
}

make -s -C "$KDIR" M="$ROOT" clean >/dev/null
make -C "$KDIR" M="$ROOT" W=1 modules >"$LOG/w1.txt" 2>&1 || fail=1
w1_clean "the modules" "$LOG/w1.txt" && echo "check: W=1 build clean"

# The unicast-events variant (kernels without GENL_MCAST_CAP_NET_ADMIN) must be clean too.
build_unicast_variant "$LOG/unicast" "$KDIR" W=1 >"$LOG/w1-unicast.txt" 2>&1 || fail=1
w1_clean "the unicast-events variant" "$LOG/w1-unicast.txt"

# sparse_clean: sparse (C=2) over the modules, no finding.
sparse_clean() {
	# Kbuild prints the CHECK lines this looks for only when make is not silent: 'make -s check'
	# must not hide them (nor set V=1 from outside), so the sub-make gets no flags from ours.
	MAKEFLAGS= make -C "$KDIR" M="$ROOT" C=2 CHECK=sparse \
		modules >"$LOG/sparse.txt" 2>&1 || fail=1
	if ! grep -q "CHECK.*kernel/pin.c" "$LOG/sparse.txt"; then
		echo "check: sparse did not run (is it installed?)" >&2
		fail=1
	elif grep -E "^$ROOT/.*: (warning|error):" "$LOG/sparse.txt"; then
		echo "check: sparse reports problems" >&2
		fail=1
	else
		echo "check: sparse clean"
	fi
}
if [ -n "$MATRIX" ]; then
	sparse_clean
	rm -rf "$LOG"
	exit $fail
fi

# The example peer on its own, as its README tells a driver writer to build one: its Makefile
# in a copy of the tree, against the Module.symvers of the build above (KBUILD_EXTRA_SYMBOLS).
SA="$LOG/standalone"
copy_module_sources "$SA" examples/peer/Makefile
make -C "$SA/examples/peer" KDIR="$KDIR" GPUPIN_SYMVERS="$ROOT/Module.symvers" W=1 >"$LOG/w1-peer.txt" 2>&1 || fail=1
if ! w1_clean "examples/peer/Makefile (the peer on its own)" "$LOG/w1-peer.txt"; then
	: # said
elif [ "$(modinfo -F depends "$SA/examples/peer/gpupin_peer.ko" 2>/dev/null)" != gpupin ]; then
	echo "check: examples/peer/Makefile built no gpupin_peer.ko that depends on gpupin" >&2
	cat "$LOG/w1-peer.txt" >&2
	fail=1
else
	echo "check: examples/peer/Makefile builds gpupin_peer.ko on its own, W=1 clean"
fi

# A driver without the persistent API (nv-p2p.h of 515.43.04 or 530.41.03: neither
# NVIDIA_P2P_CAP_GET_PAGES_PERSISTENT_API nor the two calls) is refused with a clear error:
# its nvidia_p2p_put_pages reads the page table before its lock and after freeing it.
OLD="$LOG/no-persistent"
copy_module_sources "$OLD"
mkdir -p "$LOG/nv-old/nvidia"
perl -0pe 's/#define NVIDIA_P2P_CAP_GET_PAGES_PERSISTENT_API\n\n//; s/int nvidia_p2p_(get|put)_pages_persistent\(.*?\);\n\n//gs' \
	"$ROOT/include/nvp2p/nv-p2p.h" >"$LOG/nv-old/nvidia/nv-p2p.h"
if grep -qi persistent "$LOG/nv-old/nvidia/nv-p2p.h"; then
	echo "check: cannot make a header without the persistent API" >&2
	fail=1
fi
if make -C "$KDIR" M="$OLD" W=1 NVIDIA_SRC="$LOG/nv-old" NVIDIA_SYMVERS="$ROOT/Module.symvers" \
	modules >"$LOG/w1-no-persistent.txt" 2>&1; then
	echo "check: a driver without the persistent API (its put_pages reads freed memory) was not refused" >&2
	fail=1
elif ! grep -q "error: #error \"this NVIDIA driver's nvidia_p2p_put_pages reads freed memory" "$LOG/w1-no-persistent.txt"; then
	echo "check: the build without the persistent API failed, but not with gpupin's refusal" >&2
	cat "$LOG/w1-no-persistent.txt" >&2
	fail=1
else
	echo "check: a driver without the persistent API is refused (its put_pages reads freed memory)"
fi

# A driver whose nv_p2p_get_pages double-frees when the memory goes during a pin (it frees
# physical_addresses before registering the callback without clearing it): its source is
# told apart, and gpupin builds with the nv_unsafe_get_pages switch, off; the fixed source
# (physical_addresses = NULL; after that free) builds without it.  A driver tree without
# nv-p2p.c is taken for one that double-frees, unless GPUPIN_NV_P2P_CHECKED=1 says otherwise.
for variant in double-free cleared missing missing-checked; do
	DF="$LOG/nv-$variant"
	copy_module_sources "$DF/mod"
	mkdir -p "$DF/src/nvidia"
	cp "$ROOT/include/nvp2p/nv-p2p.h" "$DF/src/nvidia/"
	checked=()
	case $variant in
	double-free | cleared)
		printf 'static void f(void)\n{\n    os_free_mem(physical_addresses);\n' >"$DF/src/nvidia/nv-p2p.c"
		[ "$variant" = double-free ] || printf '    physical_addresses = NULL;\n' >>"$DF/src/nvidia/nv-p2p.c"
		printf '}\n' >>"$DF/src/nvidia/nv-p2p.c"
		;;
	missing-checked) checked=(GPUPIN_NV_P2P_CHECKED=1) ;;
	esac
	if ! make -C "$KDIR" M="$DF/mod" W=1 NVIDIA_SRC="$DF/src" NVIDIA_SYMVERS="$ROOT/Module.symvers" \
		"${checked[@]}" modules >"$LOG/w1-nv-$variant.txt" 2>&1; then
		echo "check: the build for a driver with a $variant nv_p2p_get_pages failed" >&2
		cat "$LOG/w1-nv-$variant.txt" >&2
		fail=1
	elif modinfo -p "$DF/mod/gpupin.ko" | grep -q '^nv_unsafe_get_pages:'; then
		case $variant in
		double-free | missing) ;;
		*) echo "check: a $variant nv_p2p_get_pages was taken for the double free" >&2; fail=1 ;;
		esac
	elif [ "$variant" = double-free ] || [ "$variant" = missing ]; then
		echo "check: a driver with a $variant nv_p2p_get_pages was not taken for the double free" >&2
		fail=1
	fi
done
[ "$fail" = 1 ] || echo "check: a driver whose get_pages double-frees refuses non-persistent pins by default"

sparse_clean

files=$(cd "$ROOT" && git ls-files 'kernel/*.c' 'kernel/*.h' 'include/*.h' 'examples/*/*.c' 2>/dev/null)
[ -n "$files" ] || files=$(cd "$ROOT" && find kernel include examples -name '*.[ch]')
# checkpatch says 1 for any finding (warnings too), more when it fails itself; a file it
# cannot read it skips silently.  So: its own status, and a canary with a known error that
# it must report, or the "0 errors" below would mean nothing.
cpopts=(--strict --no-tree --terse --show-types --ignore FILE_PATH_CHANGES,SPDX_LICENSE_TAG,LINUX_VERSION_CODE)
printf '// SPDX-License-Identifier: GPL-2.0\nint gpupin_canary(int a )\n{\n\treturn a;\n}\n' >"$LOG/canary.c"
if [ ! -x "$CP" ]; then
	echo "check: no checkpatch.pl at $CP: run scripts/setup.sh" >&2
	fail=1
elif "$CP" "${cpopts[@]}" -f "$LOG/canary.c" >"$LOG/canary.txt" 2>&1; ! grep -q ": ERROR:SPACING:" "$LOG/canary.txt"; then
	echo "check: checkpatch.pl did not find the canary's error: it is not working" >&2
	fail=1
fi
(cd "$ROOT" && "$CP" "${cpopts[@]}" -f $files) >"$LOG/checkpatch.txt" 2>&1
status=$?
if [ "$status" -gt 1 ]; then
	echo "check: checkpatch.pl failed (exit status $status):" >&2
	tail -n 5 "$LOG/checkpatch.txt" >&2
	fail=1
fi
errors=$(grep -c ": ERROR:" "$LOG/checkpatch.txt")
warnings=$(grep -c ": WARNING:\|: CHECK:" "$LOG/checkpatch.txt")
if [ "$status" -gt 1 ]; then
	: # said above: no count from a checkpatch that did not run
elif [ "$errors" -ne 0 ]; then
	grep ": ERROR:" "$LOG/checkpatch.txt"
	echo "check: checkpatch --strict found $errors errors" >&2
	fail=1
else
	echo "check: checkpatch --strict: 0 errors, $warnings warnings/checks"
	grep ": WARNING:\|: CHECK:" "$LOG/checkpatch.txt" | head -n 40
fi
rm -rf "$LOG"
exit $fail
