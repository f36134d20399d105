#!/bin/bash
# make demo: the simulator's demo, on this host if it can load modules into its own kernel
# (root, headers for the running kernel, loading enabled, no NVIDIA driver loaded: the
# simulator provides nv-p2p's symbols, which nvidia.ko exports), else inside a VM.
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "$0")/lib.sh"
if [ -d /sys/module/nvidia ]; then
	echo "demo: nvidia.ko is loaded here, and the simulator cannot load beside it: running in a VM (about a minute)"
	exec "$ROOT/scripts/vm-run.sh" demo
fi
if [ "$(id -u)" -eq 0 ] && [ -d "/lib/modules/$(uname -r)/build" ] && \
   [ "$(cat /proc/sys/kernel/modules_disabled 2>/dev/null || echo 1)" = 0 ] && [ "${GPUPIN_DEMO_VM:-0}" != 1 ]; then
	echo "demo: loading the modules into this host's kernel $(uname -r)"
	# NVIDIA_SRC=none: over the simulator, also where NVIDIA's driver sources are installed.
	make -s -C "$ROOT" modules KDIR="/lib/modules/$(uname -r)/build" NVIDIA_SRC=none
	GPUPIN_KO_DIR="$ROOT" exec "$VENV/bin/python" -m gpupin.tools.demo
fi
echo "demo: this host cannot load modules into its own kernel: running in a VM (about a minute)"
exec "$ROOT/scripts/vm-run.sh" demo
