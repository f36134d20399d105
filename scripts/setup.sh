#!/bin/bash
# Install what gpupin's build and tests need on Debian 12 (as root), and the
# Python virtualenv.  Idempotent: does nothing that is already done.
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "$0")/lib.sh"

PKGS=(build-essential python3 python3-venv python3-dev libkmod-dev libffi-dev kmod
      qemu-system-x86 linux-image-amd64 linux-headers-amd64 sparse linux-source-6.1
      pciutils xz-utils libdrm-dev busybox-static dkms git perl binutils ca-certificates file iproute2)

# What the README's commands run, and the Debian package that provides it: checked after the
# install (and by `setup.sh --verify`), so a missing one is named instead of failing later.
TOOLS=(make:make gcc:gcc python3:python3 git:git perl:perl qemu-system-x86_64:qemu-system-x86
       busybox:busybox-static sparse:sparse modinfo:kmod depmod:kmod xz:xz-utils lspci:pciutils
       dkms:dkms readelf:binutils objcopy:binutils dpkg-deb:dpkg apt-get:apt script:bsdutils
       timeout:coreutils tar:tar file:file ip:iproute2)
FILES=(/usr/include/libkmod.h:libkmod-dev "/usr/include/*-linux-gnu/ffi.h:libffi-dev"
       /usr/include/libdrm/drm.h:libdrm-dev "/usr/include/python3*/Python.h:python3-dev"
       "/usr/lib/python3*/venv/__init__.py:python3-venv" "/boot/vmlinuz-*-amd64:linux-image-amd64"
       "/usr/src/linux-headers-*-amd64/Makefile:linux-headers-amd64"
       "/usr/src/linux-source-6.1.tar.*:linux-source-6.1"
       /usr/share/keyrings/debian-archive-keyring.gpg:debian-archive-keyring)

verify() {
	local t f bad=()
	for t in "${TOOLS[@]}"; do
		command -v "${t%%:*}" >/dev/null 2>&1 || bad+=("command '${t%%:*}' (Debian package ${t##*:})")
	done
	for f in "${FILES[@]}"; do
		# shellcheck disable=SC2086 # the pattern is meant to glob
		compgen -G "${f%%:*}" >/dev/null || bad+=("${f%%:*} (Debian package ${f##*:})")
	done
	if [ ${#bad[@]} -gt 0 ]; then
		printf 'setup: missing %s\n' "${bad[@]}" >&2
		echo "setup: install those packages (apt-get install ...), or run 'make setup' as root" >&2
		return 1
	fi
}
if [ "${1:-}" = --verify ]; then
	verify && echo "setup: every tool and file the README's commands need is here"
	exit
fi
apt_install_missing "${PKGS[@]}"

verify

# checkpatch.pl and its data files are not packaged alone: take them from
# Debian's kernel source tarball once.
CP="$ROOT/.cache/checkpatch"
if [ ! -x "$CP/checkpatch.pl" ]; then
	tarball=$(ls /usr/src/linux-source-6.1.tar.* | head -n 1)
	mkdir -p "$CP"
	tar -xf "$tarball" -C "$CP" --strip-components=2 --wildcards \
		'*/scripts/checkpatch.pl' '*/scripts/spelling.txt' '*/scripts/const_structs.checkpatch'
	chmod +x "$CP/checkpatch.pl"
fi

PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
	"$PY" -m venv "$VENV"
fi
# Where nvidia-smi lists a GPU, the GPU suite (make test-gpu) runs and fails without CUDA from
# Python: the cuda extra (cuda-python), the nvml extra (NVIDIA's nvidia-ml-py, for doctor's BAR1
# figures; the cuda extra pulls it too) and the gds extra (cuFile's wheel, nvidia-cufile).
extras=test,dev
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
	extras=test,dev,cuda,nvml,gds
fi
stamp="$VENV/.gpupin-deps"
# The stamp names the extras installed (an empty one, from before, meant test,dev).
if [ -f "$stamp" ]; then had=$(cat "$stamp"); else had=; fi
if [ ! -f "$stamp" ] || [ "$ROOT/pyproject.toml" -nt "$stamp" ] || [ "${had:-test,dev}" != "$extras" ]; then
	log="$VENV/pip-install.log"
	[ "$extras" = test,dev ] || echo "setup: nvidia-smi lists a GPU: installing the extras $extras (cuda-python, nvidia-ml-py, nvidia-cufile)"
	if ! { "$VENV/bin/pip" install --upgrade pip && "$VENV/bin/pip" install -e "$ROOT[$extras]"; } >"$log" 2>&1; then
		tail -n 40 "$log" >&2
		echo "setup: pip install failed (whole log: $log)" >&2
		exit 1
	fi
	echo "$extras" >"$stamp"
fi
# NIXL (gpupin.nixl's optional engine) for its host tests, without its declared torch
# dependency (gigabytes, unused): numpy is what it imports.
if ! "$VENV/bin/python" -c 'import nixl_cu13' 2>/dev/null; then
	log="$VENV/pip-install-nixl.log"
	if ! { "$VENV/bin/pip" install numpy && "$VENV/bin/pip" install --no-deps nixl-cu13; } >"$log" 2>&1; then
		tail -n 20 "$log" >&2
		echo "setup: pip install of nixl-cu13 failed (whole log: $log)" >&2
		exit 1
	fi
fi
