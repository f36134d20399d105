#!/bin/bash
# make coverage: what the tests reach.
#   kernel  the VM suite on a CONFIG_GCOV_KERNEL 6.1 kernel (scripts/debug-kernel.sh gcov,
#           built once and cached) with the modules built GCOV_PROFILE=y; the guest copies
#           the .gcda files out of debugfs, gcovr reports lines and branches of
#           kernel/*.c (gpupin.ko), kernel/cb/*.c (gpupin_cb.ko), kernel/sim/*.c (nvp2p_sim.ko)
#           and examples/peer/peer.c.
#   python  coverage.py over the host suite and the VM suite, every Python process they
#           start included (a .pth in the venv starts it where COVERAGE_PROCESS_START is set).
# Reports: results/coverage/{kernel,python}/index.html, summary.txt (one line per file and
# the totals against the goals in coverage-summary.py); a goal missed fails the run.  'coverage.sh
# --summary' prints the last summary, saying so first where it was measured at another commit
# than HEAD (make test does; it measures nothing, so neither staleness nor goals fail it).
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "$0")/../lib.sh"
OUT=${COVERAGE_OUT:-$ROOT/results/coverage}
head=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)
git -C "$ROOT" diff --quiet HEAD -- kernel include tests pyctl Kbuild 2>/dev/null || head="$head+changes"

if [ "${1:-}" = --summary ]; then
	if [ ! -f "$OUT/summary.txt" ]; then
		echo "coverage: never measured here (make coverage: 18-20 minutes on 2 cores, and ~13 more the first time for its kernel)"
		exit 0
	fi
	was=$(sed -n 's/^commit: //p' "$OUT/summary.txt")
	if [ "$was" != "$head" ]; then
		echo "coverage: STALE: measured at ${was:-an unknown commit}; HEAD is $head: run make coverage"
		echo "coverage: the last summary, of $was:"
	elif [ "$was" != "${was%+changes}" ]; then
		echo "coverage: measured with uncommitted changes, which may differ from the tree's now"
	fi
	cat "$OUT/summary.txt"
	exit 0
fi

start=$(date +%s)
tree=$("$ROOT/scripts/debug-kernel.sh" gcov)
"$VENV/bin/python" -c 'import coverage, gcovr' 2>/dev/null ||
	"$VENV/bin/pip" install -q 'coverage>=7' 'gcovr>=7'
# Every Python started with COVERAGE_PROCESS_START set measures itself (and nothing else does).
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo 'import os; os.environ.get("COVERAGE_PROCESS_START") and __import__("coverage").process_startup()' \
	>"$site/gpupin-coverage.pth"
export COVERAGE_PROCESS_START="$ROOT/pyproject.toml"

rm -rf "$OUT"
mkdir -p "$OUT/host"
find "$ROOT/kernel" "$ROOT/examples" "$ROOT/build" -name '*.gcda' -delete 2>/dev/null || true

rc=0
echo "coverage: host suite under coverage.py" >&2
COVERAGE_FILE="$OUT/host/.coverage" "$VENV/bin/pytest" -q -p no:cacheprovider "$ROOT/tests/host" || rc=1

echo "coverage: VM suite on the gcov kernel ($tree)" >&2
GCOV_PROFILE=y GPUPIN_GCOV=1 GPUPIN_EXPECT_FAULT_ATTR=1 VM_KIMAGE="$tree/arch/x86/boot/bzImage" VM_KDIR="$tree" \
	RESULTS="$OUT/vm" COVERAGE_FILE="$OUT/vm/.coverage" VM_TIMEOUT=5400 "$ROOT/scripts/vm-run.sh" test || rc=1

# The guest saw the tree at the same absolute path: its .gcda files go next to the .gcno files.
n=0
if [ -d "$OUT/vm/gcov" ]; then
	while IFS= read -r f; do
		cp "$OUT/vm/gcov/$f" "/$f" && n=$((n + 1))
	done < <(cd "$OUT/vm/gcov" && find . -name '*.gcda' | sed 's|^\./||')
fi
echo "coverage: $n kernel data files from the guest" >&2
[ "$n" -gt 0 ] || { echo "coverage: no kernel coverage data came back" >&2; rc=1; }

# gcov runs in the kernel tree: the objects name the kernel's headers relative to it, which
# gcovr cannot resolve from our tree; it then reads the .gcov files gcov wrote.
mkdir -p "$OUT/kernel" "$OUT/gcov-files"
for f in "$ROOT"/kernel/*.gcda "$ROOT"/kernel/cb/*.gcda "$ROOT"/kernel/sim/*.gcda "$ROOT"/examples/peer/*.gcda; do
	[ -f "$f" ] || continue
	(cd "$tree" && gcov -b -c -p -o "$(dirname "$f")" "$f" >/dev/null 2>&1 && mv ./*.gcov "$OUT/gcov-files/") || rc=1
done
(cd "$ROOT" && "$VENV/bin/gcovr" --root "$ROOT" --use-gcov-files --gcov-ignore-errors=no_working_dir_found \
	--filter 'kernel/' --filter 'examples/' --exclude 'build/' \
	--html-details "$OUT/kernel/index.html" --json-summary "$OUT/kernel.json" \
	--txt "$OUT/kernel-uncovered.txt" "$OUT/gcov-files") >/dev/null 2>"$OUT/gcovr.log" || rc=1

# Python started by a test with its own environment writes .coverage.* into the tree.
# The GPU suite runs on a lent GPU host, not here: its data is combined when a run of
# 'GPUPIN_COVERAGE=1 scripts/gpu/gpu-run.sh' was copied to results/coverage-gpu/ (with a file
# 'commit' naming what it measured) and neither pyctl/ nor tests/gpu/ has changed since.
gpu=()
GPU_COV=$ROOT/results/coverage-gpu
if [ -f "$GPU_COV/commit" ] && ls "$GPU_COV"/.coverage.* >/dev/null 2>&1; then
	was=$(cat "$GPU_COV/commit")
	if git -C "$ROOT" diff --quiet "$was" -- pyctl tests/gpu 2>/dev/null; then
		mkdir -p "$OUT/gpu" && cp "$GPU_COV"/.coverage.* "$OUT/gpu/" && gpu=("$OUT/gpu")
		echo "coverage: the GPU suite's data from commit $was is combined" >&2
	else
		echo "coverage: results/coverage-gpu measured $was; pyctl or tests/gpu changed since: not combined" >&2
	fi
else
	echo "coverage: no GPU suite data (results/coverage-gpu): cuda.py is measured on a GPU host only" >&2
fi
cd "$ROOT"
"$VENV/bin/coverage" combine -q --data-file="$OUT/.coverage" "$OUT/host" "$OUT/vm" "${gpu[@]}" "$ROOT" || rc=1
"$VENV/bin/coverage" html -q --data-file="$OUT/.coverage" -d "$OUT/python" || rc=1
"$VENV/bin/coverage" json -q --data-file="$OUT/.coverage" -o "$OUT/python.json" || rc=1
"$VENV/bin/coverage" report --data-file="$OUT/.coverage" >"$OUT/python-report.txt" || rc=1

goals=0
"$VENV/bin/python" "$ROOT/scripts/ci/coverage-summary.py" "$OUT" "$head" "$(( $(date +%s) - start ))" \
	>"$OUT/summary.txt" || goals=$?
cat "$OUT/summary.txt"
if [ "$goals" -ne 0 ]; then
	echo "coverage: FAILED: under a goal, or no summary (coverage-summary.py exit status $goals)" >&2
	rc=1
fi
echo "coverage: reports in $OUT/kernel/index.html and $OUT/python/index.html" >&2
exit "$rc"
