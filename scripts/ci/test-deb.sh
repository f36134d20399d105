#!/bin/bash
# SPDX-License-Identifier: (GPL-2.0 OR MIT)
# Install the way users install, then test what got installed (make test-deb):
#  1. make-deb builds gpupin-dkms and gpupin-sim-dkms;
#  2. on a host without NVIDIA's driver, gpupin-dkms installs and says why
#     DKMS cannot build (no nv-p2p.h), without failing dpkg; it is purged;
#  3. gpupin-sim-dkms installs; DKMS builds for the VM's kernel;
#  4. the VM boots, `modprobe gpupin` loads the DKMS modules (checked by path
#     and srcversion) and a smoke suite runs against them;
#  5. the package is purged and DKMS's modules are gone again.
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "$0")/../lib.sh"
VM_KVER=${VM_KVER:-$("$ROOT/scripts/vm-kver.sh")}
LOG=$(mktemp -d)
trap 'dpkg -P gpupin-sim-dkms gpupin-dkms >/dev/null 2>&1 || true; rm -rf "$LOG"' EXIT
need_root "dpkg -i"
command -v dkms >/dev/null || die "dkms is missing (make setup installs it)"

"$ROOT/packaging/make-deb.sh"
VER=$(project_version)
for name in gpupin-dkms gpupin-sim-dkms; do
	# Read whole, then searched: grep -q leaving a pipe early kills tar with SIGPIPE, which
	# pipefail reports as this check failing.
	copyright=$(dpkg-deb --fsys-tarfile "$ROOT/dist/${name}_${VER}_all.deb" | tar -xO "./usr/share/doc/$name/copyright") ||
		die "$name ships no copyright file"
	grep -q "^License: GPL-2 or Expat" <<<"$copyright" || die "$name's copyright file names no GPL-2 or Expat license"
done

if ! ls /usr/src/nvidia-*/nvidia/nv-p2p.h >/dev/null 2>&1; then
	dpkg -i "$ROOT/dist/gpupin-dkms_${VER}_all.deb" >"$LOG/dkms.txt" 2>&1 ||
		{ cat "$LOG/dkms.txt"; die "gpupin-dkms does not install on a host without NVIDIA's driver"; }
	grep -q "no NVIDIA driver sources" "$LOG/dkms.txt" ||
		{ cat "$LOG/dkms.txt"; die "gpupin-dkms did not say why it cannot build here"; }
	[ ! -e "/lib/modules/$VM_KVER/updates/dkms/gpupin.ko" ] || die "gpupin-dkms installed a module without a driver"
	dpkg -P gpupin-dkms >/dev/null
	echo "test-deb: gpupin-dkms installs without NVIDIA's driver and says why it cannot build: ok"
fi

t0=$(date +%s)
dpkg -i "$ROOT/dist/gpupin-sim-dkms_${VER}_all.deb" >"$LOG/sim.txt" 2>&1 ||
	{ cat "$LOG/sim.txt"; die "gpupin-sim-dkms does not install"; }
for m in gpupin gpupin_cb nvp2p_sim gpupin_peer; do
	f=/lib/modules/$VM_KVER/updates/dkms/$m.ko
	[ -e "$f" ] || [ -e "$f.xz" ] || [ -e "$f.zst" ] ||
		{ cat "$LOG/sim.txt"; die "DKMS left no $m.ko for $VM_KVER"; }
done
deps=$(modinfo -k "$VM_KVER" -F depends gpupin | tr , '\n' | sort | paste -sd,)
[ "$deps" = gpupin_cb,nvp2p_sim ] || die "the installed gpupin.ko depends on '$deps', not on gpupin_cb and nvp2p_sim"
getent group gpupin >/dev/null || die "the package did not create the gpupin group"
echo "test-deb: gpupin-sim-dkms installed, DKMS built for $VM_KVER in $(($(date +%s) - t0)) s"

"$ROOT/scripts/vm-run.sh" installed

dpkg -P gpupin-sim-dkms >/dev/null
[ ! -e "/lib/modules/$VM_KVER/updates/dkms/gpupin.ko" ] || die "purging left gpupin.ko behind"
[ ! -e "/usr/src/gpupin-sim-$VER" ] || die "purging left /usr/src/gpupin-sim-$VER behind"
echo "test-deb: install, DKMS build, modprobe in the VM, smoke suite and purge: ok"
