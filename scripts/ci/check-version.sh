#!/bin/bash
# SPDX-License-Identifier: (GPL-2.0 OR MIT)
# gpupin's version has one source, pyproject.toml (the wheel's version); the
# files that must repeat it (the DKMS configurations, the kernel module's
# GPUPIN_VERSION, the Python package's __version__) are checked against it.
# Run by make check and make deb.  Usage: check-version.sh
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "$0")/../lib.sh"
want=$(project_version)
[ -n "$want" ] || die "no 'version = \"...\"' line in pyproject.toml"
# FILE and the sed expression that prints the version written there.
checks=(
	'packaging/gpupin.dkms.conf' 's/^PACKAGE_VERSION="\(.*\)"$/\1/p'
	'packaging/gpupin-sim.dkms.conf' 's/^PACKAGE_VERSION="\(.*\)"$/\1/p'
	'kernel/gpupin.h' 's/^#define GPUPIN_VERSION "\(.*\)"$/\1/p'
	'pyctl/gpupin/__init__.py' 's/^__version__ = "\(.*\)"$/\1/p'
)
bad=0
for ((i = 0; i < ${#checks[@]}; i += 2)); do
	f=${checks[i]}
	got=$(sed -n "${checks[i + 1]}" "$ROOT/$f")
	if [ "$got" != "$want" ]; then
		echo "$PROG: $f says '${got:-(no version found)}', pyproject.toml says '$want'" >&2
		bad=1
	fi
done
[ "$bad" -eq 0 ] || die "the versions disagree (above): pyproject.toml is the source, change the others to match"
echo "$PROG: $want in pyproject.toml and the $((${#checks[@]} / 2)) files that repeat it"
