#!/bin/bash
# Install what gpupin's build and tests need on Debian 12 (as root), and the
# Python virtualenv.  Idempotent: does nothing that is already done.
#
#   setup.sh [--profile demo|check|test] [--verify]
#
# A profile installs what its commands need (what an earlier run installed stays):
#   demo   make demo: the module build, the Python package, the VM (QEMU, virtme-ng)
#   check  make check: demo's and sparse, checkpatch.pl, ruff, mypy, pytest (mypy reads its types)
#   test   make test and everything else (the default): check's and DKMS, NIXL (and the GPU
#          extras where nvidia-smi lists a GPU)
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "$0")/lib.sh"

PROFILE=test
VERIFY=0
while [ $# -gt 0 ]; do
	case $1 in
	--profile) PROFILE=${2:-}; shift 2 ;;
	--profile=*) PROFILE=${1#--profile=}; shift ;;
	--verify) VERIFY=1; shift ;;
	*) die "unknown argument '$1' (usage: setup.sh [--profile demo|check|test] [--verify])" ;;
	esac
done
case $PROFILE in
demo | check | test) ;;
*) die "unknown profile '$PROFILE': demo, check or test" ;;
esac

# Per profile: the Debian packages; the tools the commands run and the files they read, each
# with the package that provides it (checked after the install, and by --verify, so a missing
# one is named instead of failing later); the Python extras.
PKGS=(build-essential python3 python3-venv python3-dev libkmod-dev libffi-dev kmod
      qemu-system-x86 linux-image-amd64 linux-headers-amd64 pciutils xz-utils libdrm-dev
      busybox-static ca-certificates iproute2 file)
TOOLS=(make:make gcc:gcc python3:python3 qemu-system-x86_64:qemu-system-x86
       busybox:busybox-static modinfo:kmod depmod:kmod xz:xz-utils lspci:pciutils
       timeout:coreutils tar:tar ip:iproute2 file:file)
FILES=(/usr/include/libkmod.h:libkmod-dev "/usr/include/*-linux-gnu/ffi.h:libffi-dev"
       /usr/include/libdrm/drm.h:libdrm-dev "/usr/include/python3*/Python.h:python3-dev"
       "/usr/lib/python3*/venv/__init__.py:python3-venv" "/boot/vmlinuz-*-amd64:linux-image-amd64"
       "/usr/src/linux-headers-*-amd64/Makefile:linux-headers-amd64")
EXTRAS=vm
if [ "$PROFILE" != demo ]; then
	PKGS+=(sparse linux-source-6.1 git perl)
	TOOLS+=(sparse:sparse git:git perl:perl)
	FILES+=("/usr/src/linux-source-6.1.tar.*:linux-source-6.1")
	EXTRAS=test,dev  # mypy reads pytest's types (gpupin.testing); check-netlink reads YAML
fi
if [ "$PROFILE" = test ]; then
	PKGS+=(dkms binutils)
	TOOLS+=(dkms:dkms readelf:binutils objcopy:binutils dpkg-deb:dpkg apt-get:apt script:bsdutils)
	FILES+=(/usr/share/keyrings/debian-archive-keyring.gpg:debian-archive-keyring)
fi

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
if [ "$VERIFY" = 1 ]; then
	verify && echo "setup: every tool and file the $PROFILE profile's commands need is here"
	exit
fi
apt_install_missing "${PKGS[@]}"

verify

# checkpatch.pl and its data files are not packaged alone: take them from
# Debian's kernel source tarball once.
CP="$ROOT/.cache/checkpatch"
if [ "$PROFILE" != demo ] && [ ! -x "$CP/checkpatch.pl" ]; then
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
extras=$EXTRAS
if [ "$PROFILE" = test ] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
	extras=$extras,cuda,nvml,gds
	echo "setup: nvidia-smi lists a GPU: installing the extras $extras (cuda-python, nvidia-ml-py, nvidia-cufile)"
fi
stamp="$VENV/.gpupin-deps"
# The stamp names the extras installed (an empty one, from before, meant test,dev).  What an
# earlier profile installed stays: pip installs the union, only when something is missing.
extras_set() {  # a comma-separated list of extras, sorted, each once
	# shellcheck disable=SC2086 # split on the commas turned to spaces
	printf '%s\n' ${1//,/ } | sort -u | paste -sd, -
}
if [ -f "$stamp" ]; then had=$(extras_set "$(cat "$stamp")"); had=${had:-dev,test}; else had=; fi
want=$(extras_set "$had,$extras")
if [ ! -f "$stamp" ] || [ "$ROOT/pyproject.toml" -nt "$stamp" ] || [ "$had" != "$want" ]; then
	extras=$want
	log="$VENV/pip-install.log"
	if ! { "$VENV/bin/pip" install --upgrade pip && "$VENV/bin/pip" install -e "$ROOT[$extras]"; } >"$log" 2>&1; then
		tail -n 40 "$log" >&2
		echo "setup: pip install failed (whole log: $log)" >&2
		exit 1
	fi
	echo "$extras" >"$stamp"
fi
# NIXL (gpupin.nixl's optional engine) for its host tests, without its declared torch
# dependency (gigabytes, unused): numpy is what it imports.
if [ "$PROFILE" = test ] && ! "$VENV/bin/python" -c 'import nixl_cu13' 2>/dev/null; then
	log="$VENV/pip-install-nixl.log"
	if ! { "$VENV/bin/pip" install numpy && "$VENV/bin/pip" install --no-deps nixl-cu13; } >"$log" 2>&1; then
		tail -n 20 "$log" >&2
		echo "setup: pip install of nixl-cu13 failed (whole log: $log)" >&2
		exit 1
	fi
fi
