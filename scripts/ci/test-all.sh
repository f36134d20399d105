#!/bin/bash
# make test: run every leg named on the command line (make targets), each to its end
# whatever the others did, then test-gpu where a GPU answers, then one line per leg
# (passed/FAILED, minutes:seconds) and the exit status 1 if any leg failed.  A red leg
# must not hide the ones after it: a user's first 'make test' reports every failure.
# The table is also written to results/test-legs.txt, each leg's output to
# results/legs/LEG.log, and the end of a failed leg's log is printed again above the
# table: a CI system that keeps only a run's last lines still shows why a leg failed.
set -uo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "$0")/../lib.sh"

[ $# -gt 0 ] || die "usage: $0 LEG..."
legs=("$@")
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
	legs+=(test-gpu)
else
	echo "$PROG: test-gpu skipped: no NVIDIA driver answers on this host (nvidia-smi -L)"
fi

# row NAME VERDICT SECONDS: one line of the table.
row() {
	printf '%-14s %-7s %3d:%02d\n' "$1" "$2" $(($3 / 60)) $(($3 % 60))
}

TAIL_LINES=${GPUPIN_FAILED_TAIL:-60}
LOGS=$ROOT/results/legs
mkdir -p "$LOGS"
rows=()
failed=()
t0=$SECONDS
for leg in "${legs[@]}"; do
	echo "$PROG: ---- $leg ----"
	t=$SECONDS
	# pipefail: the verdict is make's status, not tee's.
	if "${MAKE:-make}" --no-print-directory -C "$ROOT" "$leg" 2>&1 | tee "$LOGS/$leg.log"; then
		verdict=passed
	else
		verdict=FAILED
		failed+=("$leg")
	fi
	d=$((SECONDS - t))
	rows+=("$(row "$leg" "$verdict" "$d")")
	echo "$PROG: $leg $verdict after ${d}s"
done
d=$((SECONDS - t0))
for leg in "${failed[@]}"; do
	echo "$PROG: ---- the last $TAIL_LINES lines of $leg (all of it: results/legs/$leg.log) ----"
	tail -n "$TAIL_LINES" "$LOGS/$leg.log"
done
{
	printf '%s\n' "${rows[@]}"
	row total "$([ ${#failed[@]} -eq 0 ] && echo passed || echo FAILED)" "$d"
} | tee "$ROOT/results/test-legs.txt"
"$ROOT/scripts/ci/coverage.sh" --summary
if [ ${#failed[@]} -gt 0 ]; then
	echo "$PROG: ${#failed[@]} of ${#legs[@]} legs failed: ${failed[*]}" >&2
	exit 1
fi
