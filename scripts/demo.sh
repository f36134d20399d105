#!/bin/bash
# make demo: on this host if it can load modules into its own kernel (root,
# headers for the running kernel, loading enabled), else inside a VM.
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "$0")/lib.sh"
if [ "$(id -u)" -eq 0 ] && [ -d "/lib/modules/$(uname -r)/build" ] && \
   [ "$(cat /proc/sys/kernel/modules_disabled 2>/dev/null || echo 1)" = 0 ] && [ "${GPUPIN_DEMO_VM:-0}" != 1 ]; then
	echo "demo: loading the modules into this host's kernel $(uname -r)"
	make -s -C "$ROOT" modules KDIR="/lib/modules/$(uname -r)/build"
	GPUPIN_KO_DIR="$ROOT" exec "$VENV/bin/python" -m gpupin.tools.demo
fi
echo "demo: this host cannot load modules into its own kernel: running in a VM (about a minute)"
exec "$ROOT/scripts/vm-run.sh" demo
