#!/bin/bash
# SPDX-License-Identifier: (GPL-2.0 OR MIT)
# A fresh Debian 12: debootstrap's minbase (fewer packages than any real
# install) in a chroot, the source tree copied in, then `scripts/setup.sh
# --profile demo` (what `make demo` runs first), `--verify`, the modules and
# the package built there; then `setup.sh` (make test's profile) and
# `--verify`.  Catches the next package setup.sh forgets.
# GPUPIN_FRESH_DEMO=1 also runs `make demo` in the chroot (boots the VM) on the
# demo profile alone, before the test profile's setup.
# Usage: check-fresh.sh   (root; ~5 min, the base system cached)
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "$0")/../lib.sh"
CACHE=$GPUPIN_CACHE/fresh
BASE=$CACHE/bookworm-minbase.tar
need_root "debootstrap, chroot"

R=$(mktemp -d /var/tmp/gpupin-fresh.XXXXXX)
trap 'chroot_remove "$R"' EXIT
cached_chroot "$R" "$BASE" bookworm http://deb.debian.org/debian "$CACHE/debootstrap.log"
# Reuse the machine's downloaded .debs (the installs are what is tested, not the downloads).
chroot_enter "$R" /var/cache/apt/archives
# The machine's apt sources (a pinned snapshot, mirrors), as a fresh install of it would have.
rm -f "$R/etc/apt/sources.list"
cp -r /etc/apt/sources.list* "$R/etc/apt/" 2>/dev/null || true
# This workplace's network trust (a TLS-inspecting proxy's CA for PyPI) is the machine's, not
# something setup.sh could install: carry the CA bundle and pip's configuration over.
mkdir -p "$R/etc/ssl"
cp /etc/ssl/certs/ca-certificates.crt "$R/etc/ssl/host-ca.crt"
[ ! -f /etc/pip.conf ] || cp /etc/pip.conf "$R/etc/pip.conf"
mkdir -p "$R/src/gpupin"
(cd "$ROOT" && git ls-files -z -co --exclude-standard | tar --null -T - -cf -) | tar -C "$R/src/gpupin" -xf -

start=$(date +%s)
# make demo's profile first (what a newcomer's first command installs: enough to build the
# modules and the package), then the rest (make test's).
cmd='set -e; cd /src/gpupin; export DEBIAN_FRONTEND=noninteractive
scripts/setup.sh --profile demo --verify >/dev/null 2>&1 && { echo "check-fresh: --verify passed before setup: it checks nothing"; exit 1; }
scripts/setup.sh --profile demo
scripts/setup.sh --profile demo --verify
make modules >/dev/null
make pyext SETUP_PROFILE=demo >/dev/null
test -f gpupin.ko -a -f gpupin_cb.ko -a -f nvp2p_sim.ko
.venv/bin/python -c "import gpupin.tools.demo"'
# GPUPIN_FRESH_DEMO=1: make demo itself, on what its profile installed (the VM boots).
[ "${GPUPIN_FRESH_DEMO:-}" = 1 ] && cmd="$cmd
make demo"
cmd="$cmd"'
scripts/setup.sh --verify >/dev/null 2>&1 && { echo "check-fresh: the test profile --verify passed after the demo profile setup: it checks nothing more"; exit 1; }
scripts/setup.sh
scripts/setup.sh --verify'
chroot "$R" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root TERM=dumb \
	PIP_CERT=/etc/ssl/host-ca.crt SSL_CERT_FILE=/etc/ssl/host-ca.crt REQUESTS_CA_BUNDLE=/etc/ssl/host-ca.crt \
	/bin/bash -c "$cmd" ||
	die "the README's setup does not work on a fresh Debian 12 (above)"
echo "check-fresh: fresh Debian 12 (minbase): setup.sh, --verify, the module build$([ "${GPUPIN_FRESH_DEMO:-}" = 1 ] && echo " and make demo") passed in $(($(date +%s) - start)) s"
