#!/bin/bash
# Install what gpupin's build and tests need on Debian 12 (as root), and the
# Python virtualenv.  Idempotent: does nothing that is already done.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${VENV:-$ROOT/.venv}

PKGS=(build-essential python3 python3-venv python3-dev libkmod-dev libffi-dev kmod
      qemu-system-x86 linux-image-amd64 linux-headers-amd64 sparse linux-source-6.1
      pciutils xz-utils libdrm-dev busybox-static)
missing=()
for p in "${PKGS[@]}"; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
	if [ "$(id -u)" -ne 0 ]; then
		echo "setup: missing Debian packages: ${missing[*]} (run as root, or install them)" >&2
		exit 1
	fi
	echo "setup: installing ${missing[*]}"
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -qq
	apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

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
stamp="$VENV/.gpupin-deps"
if [ ! -f "$stamp" ] || [ "$ROOT/pyproject.toml" -nt "$stamp" ]; then
	log="$VENV/pip-install.log"
	if ! { "$VENV/bin/pip" install --upgrade pip && "$VENV/bin/pip" install -e "$ROOT[test,dev]"; } >"$log" 2>&1; then
		tail -n 40 "$log" >&2
		echo "setup: pip install failed (whole log: $log)" >&2
		exit 1
	fi
	touch "$stamp"
fi
