#!/bin/bash
# SPDX-License-Identifier: (GPL-2.0 OR MIT)
# The kernel's YNL tools (tools/net/ynl and the Documentation/netlink schemas
# and specs) from Debian's linux-source package of a newer kernel, fetched
# through a private apt configuration (the machine's apt setup is not touched)
# and cached under $GPUPIN_CACHE/ynl.  Prints the directory holding
# tools/net/ynl.  Used by the VM suite's tests/vm/test_ynl.py.
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "$0")/lib.sh"
CACHE=$GPUPIN_CACHE/ynl
SUITE=${YNL_SUITE:-trixie}
PKG=${YNL_PACKAGE:-linux-source-6.12}

tree="$CACHE/${PKG}"
if [ -e "$tree/.unpacked" ]; then
	echo "$tree"
	exit 0
fi
need apt-get dpkg-deb tar xz
mkdir -p "$CACHE/dl"
private_apt "$CACHE/apt" \
	"deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian $SUITE main"
apt-get "${APTO[@]}" update || die "apt-get update of the private $SUITE source list failed"
echo "ynl-fetch: downloading $PKG from $SUITE (about 150 MB, once)" >&2
rm -f "$CACHE/dl/${PKG}"_*.deb
(cd "$CACHE/dl" && apt-get "${APTO[@]}" download "$PKG") || die "download of $PKG failed"
work=$(mktemp -d "$CACHE/x.XXXXXX")
trap 'rm -rf "$work"' EXIT
dpkg-deb --fsys-tarfile "$CACHE/dl/${PKG}"_*.deb | tar -x -C "$work" --wildcards "./usr/src/${PKG}.tar.xz" ||
	die "no ${PKG}.tar.xz in the package"
rm -rf "$tree"
tar -xJf "$work/usr/src/${PKG}.tar.xz" -C "$CACHE" --wildcards \
	"${PKG}/tools/net/ynl/*" "${PKG}/Documentation/netlink/*" || die "cannot unpack the YNL tools"
rm -f "$CACHE/dl/${PKG}"_*.deb
touch "$tree/.unpacked"
echo "$tree"
