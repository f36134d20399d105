#!/bin/bash
# SPDX-License-Identifier: (GPL-2.0 OR MIT)
# Build gpupin.ko against the NVIDIA driver installed for one kernel: what
# DKMS runs (packaging/gpupin.dkms.conf, installed as dkms.conf), usable by
# hand.  Usage: dkms-build.sh KVER KDIR
#
# gpupin must import nvidia_p2p_* with the CRCs of the nvidia.ko it will load
# next to, and Kbuild needs them at modpost time.  In order of preference:
#  1. NVIDIA_SYMVERS=<file>: a Module.symvers given by the caller;
#  2. the nvidia.ko installed for KVER (or NVIDIA_KO=<file>): its exported
#     __crc_nvidia_p2p_* values are read out of the module itself;
#  3. NVIDIA_SRC/Module.symvers, where NVIDIA's installer leaves one;
#  4. last resort, only with GPUPIN_ALLOW_UNVERSIONED=1: unversioned imports
#     (modpost warns; the kernel loads the module with "no symbol version"
#     warnings) - said loudly.  Without it the build fails and says why.
# The header comes from NVIDIA_SRC (the dir holding nvidia/nv-p2p.h), by
# default the /usr/src/nvidia-* tree of the installed driver's version.
# The simulator is never built here: see packaging/ for gpupin-sim-dkms.
# Standalone on purpose (no scripts/lib.sh): it ships in the gpupin-dkms
# package and runs on users' hosts from /usr/src/gpupin-<version>/, where
# only the module sources and this script are installed.
set -euo pipefail
KVER=${1:?usage: dkms-build.sh KVER KDIR}
KDIR=${2:?usage: dkms-build.sh KVER KDIR}
HERE=$(cd "$(dirname "$0")/.." && pwd)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
say() { echo "gpupin-dkms: $*" >&2; }

# The nvidia.ko of KVER: modinfo resolves Debian's renamed modules
# (nvidia-current-open.ko) through their aliases; else search updates/.
ko=${NVIDIA_KO:-}
[ -z "$ko" ] || [ "$ko" = none ] || [ -f "$ko" ] || { say "NVIDIA_KO=$ko: no such file"; exit 1; }
if [ -z "$ko" ]; then
	ko=$(modinfo -k "$KVER" -n nvidia 2>/dev/null || true)
	case "$ko" in /*) ;; *) ko= ;; esac
fi
if [ -z "$ko" ]; then
	while read -r f; do
		if [ "$(modinfo -F name "$f" 2>/dev/null)" = nvidia ]; then ko=$f; break; fi
	done < <(find "/lib/modules/$KVER" -name 'nvidia*.ko*' 2>/dev/null | sort)
fi
[ "$ko" != none ] || ko=
ver=
[ -n "$ko" ] && ver=$(modinfo -F version "$ko" 2>/dev/null || true)

# The header must be the installed driver's own: the CRCs come from its
# nvidia.ko whichever header is compiled in, so a wrong one would load.
src=${NVIDIA_SRC:-}
if [ -z "$src" ] && [ -n "$ver" ]; then
	for d in /usr/src/nvidia*-"$ver"; do
		if [ -e "$d/nvidia/nv-p2p.h" ]; then src=$d; break; fi
	done
	if [ -z "$src" ]; then
		say "nvidia.ko for $KVER is driver $ver, but no /usr/src/nvidia*-$ver/nvidia/nv-p2p.h is installed."
		say "Install that driver's kernel sources (Debian: nvidia-open-kernel-dkms $ver) or set NVIDIA_SRC=."
		exit 1
	fi
elif [ -z "$src" ]; then
	src=$(ls -d /usr/src/nvidia-*/nvidia/nv-p2p.h 2>/dev/null | sort -rV | head -n 1 || true)
	src=${src%/nvidia/nv-p2p.h}
fi
if [ -z "$src" ] || [ ! -e "$src/nvidia/nv-p2p.h" ]; then
	say "no NVIDIA driver sources with nvidia/nv-p2p.h found under /usr/src${ver:+ for driver $ver}."
	say "Install NVIDIA's open kernel modules (Debian: nvidia-open-kernel-dkms) or set NVIDIA_SRC=."
	say "A host without a GPU wants the simulator package instead: gpupin-sim-dkms."
	exit 1
fi

# Each __crc_<sym> symbol sits in __kcrctab or __kcrctab_gpl; its value is the
# offset of the 32-bit CRC in that section.
crcs_from_ko() {
	local f=$1 plain="$TMP/nvidia.ko" sec idx type crc
	case "$f" in
	*.xz | *.zst | *.gz)
		local tool
		case "$f" in *.xz) tool=xz ;; *.zst) tool=zstd ;; *) tool=gzip ;; esac
		command -v "$tool" >/dev/null || { say "$f is compressed: install $tool to read its CRCs"; exit 1; }
		;;
	esac
	case "$f" in
	*.xz) xz -dc "$f" >"$plain" ;;
	*.zst) zstd -qdc "$f" >"$plain" ;;
	*.gz) gzip -dc "$f" >"$plain" ;;
	*) cp "$f" "$plain" ;;
	esac
	for sec in __kcrctab __kcrctab_gpl; do
		idx=$(readelf -SW "$plain" | awk -v s="$sec" '{sub(/^ *\[ */, ""); sub(/\]/, "")} $2 == s {print $1}')
		[ -n "$idx" ] || continue
		type=EXPORT_SYMBOL; [ "$sec" = __kcrctab_gpl ] && type=EXPORT_SYMBOL_GPL
		objcopy -O binary --only-section="$sec" "$plain" "$TMP/$sec.bin"
		readelf -sW "$plain" | awk -v i="$idx" '$7 == i && $8 ~ /^__crc_nvidia_p2p_/ {print $2, $8}' |
		while read -r off name; do
			crc=$(od -An -tx4 -j $((16#$off)) -N4 "$TMP/$sec.bin" | tr -d ' ')
			printf '0x%s\t%s\tnvidia\t%s\t\n' "$crc" "${name#__crc_}" "$type"
		done
	done
}

symvers=${NVIDIA_SYMVERS:-}
how="given by NVIDIA_SYMVERS"
if [ -z "$symvers" ] && [ -n "$ko" ]; then
	crcs_from_ko "$ko" >"$TMP/Module.symvers"
	if grep -q nvidia_p2p_get_pages "$TMP/Module.symvers"; then
		symvers=$TMP/Module.symvers
		how="read from $ko"
	fi
fi
if [ -z "$symvers" ] && grep -qs nvidia_p2p_get_pages "$src/Module.symvers"; then
	symvers=$src/Module.symvers
	how="from $src/Module.symvers"
fi
extra=()
if [ -z "$symvers" ]; then
	# Typically DKMS building for a new kernel before NVIDIA's module is there:
	# fail, so that a later `dkms autoinstall` builds it right.
	if [ "${GPUPIN_ALLOW_UNVERSIONED:-}" != 1 ]; then
		say "no nvidia.ko for $KVER and no Module.symvers in $src: the nvidia_p2p_* CRCs are unknown."
		say "Install the NVIDIA driver for $KVER first, then: dkms install gpupin/<version> -k $KVER"
		say "(GPUPIN_ALLOW_UNVERSIONED=1 builds unversioned imports instead, as a last resort)"
		exit 1
	fi
	say "WARNING: no nvidia.ko for $KVER and no Module.symvers in $src: building with"
	say "WARNING: unversioned nvidia_p2p_* imports (modprobe will warn 'no symbol version')."
	extra=(KBUILD_MODPOST_WARN=1)
else
	say "building against NVIDIA ${ver:-(version unknown)} sources in $src; CRCs $how"
fi
make -C "$KDIR" M="$HERE" NVIDIA_SRC="$src" NVIDIA_SYMVERS="$symvers" "${extra[@]}" modules
