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

# test-vm-6.12 beside test-vm: each guest keeps about one of this machine's cores busy (its
# tests are one Python process at a time, under software emulation), so the two kernels' legs
# side by side take little more than the longer one.  The 6.12 leg runs from a copy of the
# tree (build/matrix: git's files, tracked and untracked, not ignored), where it builds its
# modules, so that neither leg's build overwrites the modules the other's guest loads; the
# venv is this tree's.  What both would share is done first, one at a time: the packages
# (make setup), the 6.12 kernel (its apt install) and the YNL tools (their download).  Its
# output goes to results/legs/test-vm-6.12.log, printed whole when test-vm is over.
# Only with GPUPIN_PARALLEL_LEGS=1: in one of three whole runs so (the machine loaded by other
# tests as well), the 6.12 guest died 23 s after its start, before its script, and its
# diagnostic boot then ran; not understood yet, so one leg after the other is the default.
BESIDE=
BESIDE_PID=
STARTED=
if [ "${GPUPIN_PARALLEL_LEGS:-}" = 1 ] && [[ " ${legs[*]} " == *" test-vm "* ]] &&
	[[ " ${legs[*]} " == *" test-vm-6.12 "* ]] && git -C "$ROOT" rev-parse --git-dir >/dev/null 2>&1; then
	BESIDE=test-vm-6.12
fi

# start_beside: prepare and start the 6.12 leg in the background (BESIDE_PID); its status and
# its seconds go to results/legs/test-vm-6.12.status.
start_beside() {
	local copy=$ROOT/build/matrix log=$LOGS/$BESIDE.log st=$LOGS/$BESIDE.status
	STARTED=1
	rm -f "$st"
	{
		"${MAKE:-make}" --no-print-directory -C "$ROOT" setup pyext &&
			"$ROOT/scripts/ci/kernel-6.12.sh" >/dev/null &&
			"$ROOT/scripts/ynl-fetch.sh" >/dev/null &&
			rm -rf "$copy" && mkdir -p "$copy" &&
			(cd "$ROOT" && git ls-files -z -c -o --exclude-standard | tar --null -T - -cf -) | tar -C "$copy" -xf -
	} >"$log" 2>&1 || { echo "1 0" >"$st"; return 0; }
	(
		t=$SECONDS
		rc=0
		VENV=$VENV RESULTS=$ROOT/results/6.12 "$copy/scripts/ci/test-vm-6.12.sh" >>"$log" 2>&1 || rc=$?
		echo "$rc $((SECONDS - t))" >"$st"
	) &
	BESIDE_PID=$!
	echo "$PROG: $BESIDE runs beside test-vm from a copy of the tree (build/matrix); its output: $log"
}

for leg in "${legs[@]}"; do
	echo "$PROG: ---- $leg ----"
	if [ "$leg" = test-vm ] && [ -n "$BESIDE" ]; then
		start_beside  # (its setup and downloads counted in neither leg's time)
	fi
	t=$SECONDS
	if [ "$leg" = "$BESIDE" ] && [ -n "$STARTED" ]; then
		[ -z "$BESIDE_PID" ] || wait "$BESIDE_PID"
		cat "$LOGS/$leg.log"
		read -r rc secs <"$LOGS/$leg.status" 2>/dev/null || { rc=1; secs=0; }
		if [ "$rc" = 0 ]; then verdict=passed; else verdict=FAILED; failed+=("$leg"); fi
		rows+=("$(row "$leg" "$verdict" "$secs")")
		echo "$PROG: $leg $verdict after ${secs}s (beside test-vm; $((SECONDS - t))s more after it)"
		continue
	fi
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
