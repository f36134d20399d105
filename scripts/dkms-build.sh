#!/bin/bash
# SPDX-License-Identifier: (GPL-2.0 OR MIT)
# Build gpupin.ko against the NVIDIA driver installed for one kernel: what
# DKMS runs (dkms.conf), usable by hand.  Usage: dkms-build.sh KVER KDIR
#
# gpupin must import nvidia_p2p_* with the CRCs of the nvidia.ko it will load
# next to, and Kbuild needs them at modpost time.  In order of preference:
#  1. NVIDIA_SYMVERS=<file>: a Module.symvers given by the caller;
#  2. the nvidia.ko installed for KVER (or NVIDIA_KO=<file>): its exported
#     __crc_nvidia_p2p_* values are read out of the module itself;
#  3. NVIDIA_SRC/Module.symvers, where NVIDIA's installer leaves one;
#  4. last resort: unversioned imports (modpost warns; the kernel loads the
#     module with "no symbol version" warnings) - said loudly.
# The header comes from NVIDIA_SRC (the dir holding nvidia/nv-p2p.h), by
# default the /usr/src/nvidia-* tree of the installed driver's version.
# The simulator is never built here: see packaging/ for gpupin-sim-dkms.
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
[ -z "$ko" ] || [ -f "$ko" ] || { say "NVIDIA_KO=$ko: no such file"; exit 1; }
if [ -z "$ko" ]; then
	ko=$(modinfo -k "$KVER" -n nvidia 2>/dev/null || true)
	case "$ko" in /*) ;; *) ko= ;; esac
fi
if [ -z "$ko" ]; then
	while read -r f; do
		if [ "$(modinfo -F name "$f" 2>/dev/null)" = nvidia ]; then ko=$f; break; fi
	done < <(find "/lib/modules/$KVER" -name 'nvidia*.ko*' 2>/dev/null | sort)
fi
ver=
[ -n "$ko" ] && ver=$(modinfo -F version "$ko" 2>/dev/null || true)

src=${NVIDIA_SRC:-}
if [ -z "$src" ]; then
	cands=()
	[ -z "$ver" ] || cands+=(/usr/src/nvidia*-"$ver")
	mapfile -t -O ${#cands[@]} cands < <(ls -d /usr/src/nvidia-* 2>/dev/null | sort -rV)
	for d in "${cands[@]}"; do
		if [ -e "$d/nvidia/nv-p2p.h" ]; then src=$d; break; fi
	done
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
	say "WARNING: no nvidia.ko for $KVER and no Module.symvers in $src: building with"
	say "WARNING: unversioned nvidia_p2p_* imports (modprobe will warn 'no symbol version')."
	say "WARNING: install the NVIDIA driver for $KVER first, then: dkms install gpupin/<version> -k $KVER"
	extra=(KBUILD_MODPOST_WARN=1)
else
	say "building against NVIDIA ${ver:-(version unknown)} sources in $src; CRCs $how"
fi
make -C "$KDIR" M="$HERE" NVIDIA_SRC="$src" NVIDIA_SYMVERS="$symvers" "${extra[@]}" modules
