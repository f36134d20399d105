#!/bin/bash
# SPDX-License-Identifier: (GPL-2.0 OR MIT)
# The netlink UAPI header and the kernel's request policies and ops are
# generated from the family's YNL spec: generate them again into a temporary
# directory and fail, showing each difference and the command that fixes it,
# while any committed file is not what the spec gives.
# Run by make check.  Usage: check-netlink.sh [SPEC HEADER KERNEL-C KERNEL-H]
# (default: the tree's spec and files; given paths are taken as they are,
# relative to the current directory, and the spec's path is what the files'
# do-not-edit lines name).  PY: a Python with PyYAML (default: the venv's,
# else python3).
set -uo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "$0")/../lib.sh"
if [ $# -eq 0 ]; then
	cd "$ROOT" || die "cannot enter $ROOT"
	set -- Documentation/netlink/specs/gpupin.yaml include/uapi/gpupin_netlink.h \
		kernel/netlink-gen.c kernel/netlink-gen.h
fi
[ $# -eq 4 ] || die "usage: check-netlink.sh [SPEC HEADER KERNEL-C KERNEL-H]"
spec=$1 header=$2 ksrc=$3 khdr=$4
py=$(venv_python)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# --into: each file under $tmp at its absolute path, its #include lines those of the real one.
"$py" "$ROOT/scripts/gen-netlink-header.py" "$spec" -o "$header" --kernel-source "$ksrc" --kernel-header "$khdr" \
	--into "$tmp" || die "cannot generate the netlink files from $spec"
differ=()
for f in "$header" "$ksrc" "$khdr"; do
	if ! diff -u --label "$f (committed)" --label "$f (generated from $spec)" "$f" "$tmp$(realpath -m "$f")"; then
		differ+=("$f")
	fi
done
if [ ${#differ[@]} -gt 0 ]; then
	echo "$PROG: ${differ[*]}: not what $spec generates (above); generated, not edited:" >&2
	die "change the spec if needed, then run 'make netlink-header' and commit them together"
fi
echo "$PROG: $header, $ksrc and $khdr are what $spec generates"
