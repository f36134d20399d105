#!/bin/bash
# Runs on a lent GPU machine (CUDA user space, Python 3.12, no registry): installs the
# carried wheels (.wheels/), builds the cffi extension, runs tests/gpu and the GPU
# benchmark.  Results go to $OUT (or ./results).
set -uo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "$0")/../lib.sh"
OUT=${OUT:-$ROOT/results}
mkdir -p "$OUT"
cd "$ROOT"
python3 -m pip install -q --no-index --find-links .wheels --target /tmp/gpupin-deps cffi pycparser pyroute2 \
	>"$OUT/pip.txt" 2>&1 || { cat "$OUT/pip.txt"; exit 1; }
# libcufile for the GDS tests (gpupin.gds finds it in site-packages); optional.
python3 -m pip install -q --no-index --find-links .wheels --target /tmp/gpupin-deps nvidia-cufile \
	>>"$OUT/pip.txt" 2>&1 || echo "gpu-run: no nvidia-cufile wheel in .wheels: the GDS tests will skip"
# NVIDIA's NVML bindings for the BAR1 figures of doctor and selftest; optional.
python3 -m pip install -q --no-index --find-links .wheels --target /tmp/gpupin-deps nvidia-ml-py \
	>>"$OUT/pip.txt" 2>&1 || echo "gpu-run: no nvidia-ml-py wheel in .wheels: the BAR1 checks will say so"
# cuFile registers a file only if udev describes its block device (ID_FS_USAGE).  The lent
# machines are containers without udev: describe the work tree's file system the way udev
# would, so that the read path can be tested (GPUDIRECT_NO_UDEV_FIX=1 leaves it missing).
dev=$(stat -c '%Hd:%Ld' .)
if [ "${GPUDIRECT_NO_UDEV_FIX:-0}" != 1 ] && [ "$(id -u)" = 0 ] && [ "${dev%%:*}" != 0 ] \
	&& [ ! -e "/run/udev/data/b$dev" ]; then
	mkdir -p /run/udev/data
	printf 'E:ID_FS_USAGE=filesystem\nE:ID_FS_TYPE=%s\n' "$(stat -f -c %T .)" >"/run/udev/data/b$dev"
	echo "gpu-run: wrote /run/udev/data/b$dev (no udev here) so that cuFile can register files"
fi
# NIXL for tests/gpu/test_nixl.py and 'bench --nixl'; optional.  Carry the nixl-cu13 wheel (its
# declared torch dependency is already there; numpy too), e.g. without the 27 MiB nixl_ep_cu13
# package gpupin does not use, to stay under the 64 MiB a call may carry.
python3 -m pip install -q --no-index --no-deps --find-links .wheels --target /tmp/gpupin-deps nixl-cu13 \
	>>"$OUT/pip.txt" 2>&1 || echo "gpu-run: no nixl-cu13 wheel in .wheels: the NIXL tests will skip"
export NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-WARN}
export PYTHONPATH=/tmp/gpupin-deps:$ROOT/pyctl
(cd pyctl && python3 gpupin/_build.py --no-kmod) >"$OUT/build.txt" 2>&1 || { cat "$OUT/build.txt"; exit 1; }
# Every step's own status counts (a pipe through tee would hide it): the script exits with the
# first failure's, after running the rest.
rc=0
step() {
	local log=$1 append=()
	shift
	if [ "$log" = -a ]; then
		append=(-a)
		log=$1
		shift
	fi
	"$@" 2>&1 | tee "${append[@]}" "$log"
	local st=${PIPESTATUS[0]}
	if [ "$st" -ne 0 ]; then
		echo "gpu-run: '$*' failed with status $st" >&2
		[ "$rc" -ne 0 ] || rc=$st
	fi
}
step "$OUT/gpu.txt" nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
step -a "$OUT/gpu.txt" python3 -c "import cuda.bindings, sys; print('cuda-bindings', cuda.bindings.__version__, 'python', sys.version.split()[0])"
# GPUPIN_COVERAGE=1: the suite under coverage.py (needs a coverage wheel in .wheels); the data
# goes to $OUT/coverage-gpu/, which 'make coverage' combines when it is copied to
# results/coverage-gpu/ with the commit it measured (scripts/ci/coverage.sh says how).
runner=(python3)
if [ "${GPUPIN_COVERAGE:-0}" = 1 ]; then
	python3 -m pip install -q --no-index --find-links .wheels --target /tmp/gpupin-deps coverage \
		>>"$OUT/pip.txt" 2>&1 || { echo "gpu-run: GPUPIN_COVERAGE=1 needs a coverage wheel in .wheels"; exit 1; }
	mkdir -p "$OUT/coverage-gpu"
	runner=(python3 -m coverage run --rcfile="$ROOT/pyproject.toml" --data-file="$OUT/coverage-gpu/.coverage")
fi
# GPUPIN_GPU_K: only the GPU tests that pytest's -k selects (one test in one command).
select=()
[ -z "${GPUPIN_GPU_K:-}" ] || select=(-k "$GPUPIN_GPU_K")
step "$OUT/gpu-tests.txt" "${runner[@]}" -m pytest -q -p no:cacheprovider -rsP tests/gpu "${select[@]}"
# The command a user runs: here (no module loading) the module checks say why they cannot
# run, and the CUDA checks must pass.
step "$OUT/selftest.txt" python3 -m gpupin selftest
export PYTHONUNBUFFERED=1
# GPUPIN_GPU_BENCH=none: the tests only.
[ "${GPUPIN_GPU_BENCH:-all}" = none ] && exit "$rc"
# GPUPIN_GPU_BENCH=nixl: NIXL's status and its figures, three runs (the goals are per run).
if [ "${GPUPIN_GPU_BENCH:-all}" = nixl ]; then
	step "$OUT/nixl-status.txt" python3 -m gpupin nixl status
	for i in 1 2 3; do
		step "$OUT/bench-nixl-$i.txt" python3 -m gpupin.tools.bench --nixl --seed "$i" --out "$OUT/bench-nixl-$i.json"
	done
	exit "$rc"
fi
step "$OUT/gds-status.txt" python3 -m gpupin gds status
step "$OUT/bench-gds.txt" python3 -m gpupin.tools.bench --gds --out "$OUT/bench-gds.json"
# GPUPIN_GPU_BENCH=gds: only the GDS figures (the CUDA buffer-id query figures take minutes)
[ "${GPUPIN_GPU_BENCH:-all}" = gds ] ||
	step "$OUT/bench-gpu.txt" python3 -m gpupin.tools.bench --only-cuda --out "$OUT/bench-gpu.json"
exit "$rc"
