#!/bin/bash
# Runs on a lent GPU machine (CUDA user space, Python 3.12, no registry): installs the
# carried wheels (.wheels/), builds the cffi extension, runs tests/gpu and the GPU
# benchmark.  Results go to $OUT (or ./results).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/results}
mkdir -p "$OUT"
cd "$ROOT"
python3 -m pip install -q --no-index --find-links .wheels --target /tmp/gpupin-deps cffi pycparser pyroute2 \
	>"$OUT/pip.txt" 2>&1 || { cat "$OUT/pip.txt"; exit 1; }
export PYTHONPATH=/tmp/gpupin-deps:$ROOT/pyctl
(cd pyctl && python3 gpupin/_build.py --no-kmod) >"$OUT/build.txt" 2>&1 || { cat "$OUT/build.txt"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import cuda.bindings, sys; print('cuda-bindings', cuda.bindings.__version__, 'python', sys.version.split()[0])" \
	| tee -a "$OUT/gpu.txt"
python3 -m pytest -q -p no:cacheprovider -rsP tests/gpu 2>&1 | tee "$OUT/gpu-tests.txt"
rc=${PIPESTATUS[0]}
python3 -m gpupin.bench --only-cuda --out "$OUT/bench-gpu.json" 2>&1 | tee "$OUT/bench-gpu.txt"
exit "$rc"
