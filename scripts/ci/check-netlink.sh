#!/bin/bash
# SPDX-License-Identifier: (GPL-2.0 OR MIT)
# The netlink UAPI header is generated from the family's YNL spec: generate it
# again into a temporary file and fail, showing the difference and the command
# that fixes it, while the committed header is not what the spec gives.
# Run by make check.  Usage: check-netlink.sh [SPEC HEADER]
# (default: the tree's spec and header; given paths are taken as they are,
# relative to the current directory, and the spec's path is what the header's
# do-not-edit line names).  PY: a Python with PyYAML (default: the venv's,
# else python3).
set -uo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "$0")/../lib.sh"
if [ $# -eq 0 ]; then
	cd "$ROOT" || die "cannot enter $ROOT"
	set -- Documentation/netlink/specs/gpupin.yaml include/uapi/gpupin_netlink.h
fi
[ $# -eq 2 ] || die "usage: check-netlink.sh [SPEC HEADER]"
spec=$1 header=$2
py=$(venv_python)
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
"$py" "$ROOT/scripts/gen-netlink-header.py" "$spec" -o "$tmp" || die "cannot generate the header from $spec"
if ! diff -u --label "$header (committed)" --label "$header (generated from $spec)" "$header" "$tmp"; then
	echo "$PROG: $header is not what $spec generates (above); it is generated, not edited:" >&2
	die "change the spec if needed, then run 'make netlink-header' and commit both"
fi
echo "$PROG: $header is what $spec generates"
