#!/bin/bash
# The second kernel of the test matrix: Debian 12's newest 6.12 (bookworm carries
# linux-image-6.12.*+deb12-amd64 next to its 6.1).  Installs its image and headers
# (as root, once) and prints its version.  make test-vm-6.12 boots it.
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "$0")/../lib.sh"
if v=$(newest_kernel '6.12.*'); then
	echo "$v"
	exit 0
fi
[ "$(id -u)" = 0 ] || die "no 6.12 kernel with headers installed; run as root to install one"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq || die "apt-get update failed"
v=$(apt-cache search --names-only '^linux-headers-6\.12\.[0-9]+\+deb12-amd64$' | awk '{print $1}' |
	sed 's/^linux-headers-//' | sort -rV | head -n 1)
[ -n "$v" ] || die "Debian 12 offers no linux-headers-6.12.*+deb12-amd64"
echo "kernel-6.12: installing linux-image-$v and linux-headers-$v" >&2
apt-get install -y -qq --no-install-recommends "linux-image-$v" "linux-headers-$v" >/dev/null ||
	die "apt-get install linux-image-$v linux-headers-$v failed"
newest_kernel '6.12.*' || die "linux-image-$v installed but no image and headers found"
