#!/bin/bash
# SPDX-License-Identifier: (GPL-2.0 OR MIT)
# Build the Debian packages into dist/ (dpkg-deb only; no debhelper needed):
#   gpupin-dkms      gpupin.ko (+ gpupin_cb.ko) sources, built by DKMS against the installed
#                    NVIDIA driver; udev rule, modprobe config, gpupin group
#   gpupin-sim-dkms  gpupin.ko + gpupin_cb.ko + nvp2p_sim.ko + gpupin_peer.ko for test and
#                    demo hosts without an NVIDIA GPU (conflicts with the above
#                    and with NVIDIA's kernel module packages)
# The Python package is the wheel of `make wheel`.
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "$0")/../scripts/lib.sh"
OUT=${OUT:-$ROOT/dist}
# The version is pyproject.toml's; the DKMS configurations repeat it (checked).
"$ROOT/scripts/ci/check-version.sh" >/dev/null
VER=$(project_version)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUT"

# The machine-readable copyright file of Debian policy 12.5, from LICENSE and LICENSES/.
deb_copyright() {
	cat <<HEAD
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: gpupin
Comment: the whole project: $(sed -n 's/^SPDX-License-Identifier: //p' "$ROOT/LICENSE")

Files: *
Copyright: 2026 The gpupin developers
License: GPL-2 or Expat

License: GPL-2
 On Debian systems, the complete text of the GNU General Public License
 version 2 can be found in /usr/share/common-licenses/GPL-2.

License: Expat
HEAD
	sed -e 's/^$/./' -e 's/^/ /' "$ROOT/LICENSES/MIT"
}

# pkg NAME DKMSNAME DKMSCONF WITH_SIM DESCRIPTION CONFLICTS
pkg() {
	local name=$1 dname=$2 conf=$3 sim=$4 desc=$5 conflicts=$6
	local r="$WORK/$name" src
	src="$r/usr/src/$dname-$VER"
	mkdir -p "$src" "$r/DEBIAN" "$r/usr/lib/udev/rules.d" "$r/etc/modprobe.d" "$r/usr/share/doc/$name"
	copy_module_sources "$src" packaging/dkms-build.sh kernel/sim/FIDELITY.md
	[ "$sim" = 1 ] || rm -r "$src/kernel/sim"
	install -m 644 "$conf" "$src/dkms.conf"
	install -m 644 "$ROOT/packaging/99-gpupin.rules" "$r/usr/lib/udev/rules.d/99-gpupin.rules"
	install -m 644 "$ROOT/packaging/gpupin.modprobe.conf" "$r/etc/modprobe.d/gpupin.conf"
	echo /etc/modprobe.d/gpupin.conf >"$r/DEBIAN/conffiles"
	install -m 644 "$ROOT/README.md" "$r/usr/share/doc/$name/README.md"
	deb_copyright >"$r/usr/share/doc/$name/copyright"
	# The README links into Documentation/: ship the pages it links to beside it.
	mkdir -p "$r/usr/share/doc/$name/Documentation"
	install -m 644 "$ROOT"/Documentation/*.md "$r/usr/share/doc/$name/Documentation/"
	cat >"$r/DEBIAN/control" <<CTRL
Package: $name
Version: $VER
Architecture: all
Maintainer: gpupin developers <gpupin@localhost>
Section: kernel
Priority: optional
Depends: dkms (>= 3.0), make, gcc, adduser
Recommends: linux-headers-amd64
Conflicts: $conflicts
Description: $desc
 gpupin pins NVIDIA GPU memory for third-party devices through NVIDIA's
 nv-p2p kernel API, behind /dev/gpupin and a generic-netlink family.
 The Python control plane (gpupin command, cache, bindings) is the wheel.
CTRL
	cat >"$r/DEBIAN/postinst" <<POST
#!/bin/sh
set -e
[ "\$1" = configure ] || exit 0
getent group gpupin >/dev/null || addgroup --system gpupin
dkms status -m $dname -v $VER | grep -q . || dkms add -m $dname -v $VER
# Every kernel with headers: a failed build is reported, not fatal (install
# the missing piece, then: dkms install $dname/$VER -k <kernel>).
for b in /lib/modules/*/build; do
	[ -d "\$b" ] || continue
	k=\$(basename "\$(dirname "\$b")")
	if ! dkms install -m $dname -v $VER -k "\$k"; then
		grep -s '^gpupin-dkms:' /var/lib/dkms/$dname/$VER/build/make.log >&2 || true
		echo "$name: DKMS could not build for \$k; see /var/lib/dkms/$dname/$VER/build/make.log" >&2
	fi
done
udevadm control --reload-rules 2>/dev/null || true
POST
	cat >"$r/DEBIAN/prerm" <<PRERM
#!/bin/sh
set -e
dkms remove -m $dname -v $VER --all >/dev/null 2>&1 || true
PRERM
	chmod 755 "$r/DEBIAN/postinst" "$r/DEBIAN/prerm"
	dpkg-deb --build --root-owner-group "$r" "$OUT/${name}_${VER}_all.deb" >/dev/null
	echo "make-deb: $OUT/${name}_${VER}_all.deb"
}

pkg gpupin-dkms gpupin "$ROOT/packaging/gpupin.dkms.conf" 0 \
	"pin NVIDIA GPU memory for third-party devices (DKMS kernel module)" \
	"gpupin-sim-dkms"
pkg gpupin-sim-dkms gpupin-sim "$ROOT/packaging/gpupin-sim.dkms.conf" 1 \
	"gpupin with the nv-p2p simulator for hosts without an NVIDIA GPU (DKMS)" \
	"gpupin-dkms, nvidia-open-kernel-dkms, nvidia-kernel-dkms, nvidia-tesla-kernel-dkms"
