#!/bin/bash
# make test-vm-6.12: the second kernel of the matrix, the newest Debian 12 6.12 installed
# (kernel-6.12.sh installs one where none is): the checks that depend on the kernel (check-kernel.sh --matrix: the W=1
# builds, sparse), then the whole VM suite booting it, its races, fuzzer and thread races at a
# quarter of their CI counts (GPUPIN_STRESS_SCALE=0.25; make test-vm runs them whole on 6.1).
# Results in RESULTS (default results/6.12).  Builds in the tree it runs from: test-all.sh
# runs it from a copy of the tree beside make test-vm.
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "$0")/../lib.sh"
kver=$("$ROOT/scripts/ci/kernel-6.12.sh")
"$ROOT/scripts/ci/check-kernel.sh" --matrix "/usr/src/linux-headers-$kver"
GPUPIN_STRESS_SCALE=${GPUPIN_STRESS_SCALE:-0.25} VM_KVER=$kver RESULTS=${RESULTS:-$ROOT/results/6.12} \
	exec "$ROOT/scripts/vm-run.sh" test
