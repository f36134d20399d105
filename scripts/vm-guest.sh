#!/bin/bash
# Runs inside the VM (see vm-run.sh) as 'vm-guest.sh ENV_FILE'.  Loads the modules, runs
# MODE, and leaves the kernel log and taint in RESULTS.  ENV_FILE (vm-run.sh writes it) sets
# the environment, GUEST_MODE, GUEST_RESULTS and the arguments GUEST_ARGS: the kernel's
# command line, which x86 cuts at 2047 bytes, carries only its path.
# shellcheck source=/dev/null
. "${1:?usage: vm-guest.sh ENV_FILE}" || exit 1
MODE=$GUEST_MODE
RESULTS=$GUEST_RESULTS
set -- "${GUEST_ARGS[@]}"
# shellcheck source=scripts/lib.sh
. "$(dirname "$0")/lib.sh"
# PYTHONUNBUFFERED: pytest's progress reaches results/pytest.txt as it happens (long runs).
export PATH="$VENV/bin:$PATH" GPUPIN_KO_DIR="$ROOT" GPUPIN_REQUIRE_VM=1 PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
# The directories the guest only reads, from vm-run.sh's cached read-only share of the host's
# root (a Python start takes a third of the time; without it, the same files, uncached).
if [ -n "${GPUPIN_RO_DIRS:-}" ] && mkdir -p /run/gpupin-ro &&
	mount -t 9p -o trans=virtio,version=9p2000.L,cache=loose,msize=512000,ro gpupinro /run/gpupin-ro; then
	for d in $GPUPIN_RO_DIRS; do
		[ -d "/run/gpupin-ro$d" ] && mount --bind "/run/gpupin-ro$d" "$d" || echo "vm-guest: $d stays uncached" >&2
	done
fi
cd "$ROOT" || exit 1
rc=0
# The kernel log streams into RESULTS from the start, so that a run the host stops at
# VM_TIMEOUT still leaves what the kernel said until then; rewritten whole at the end.
dmesg -w >"$RESULTS/dmesg.txt" 2>&1 &
DMESG_PID=$!
KML=/sys/kernel/debug/kmemleak
if [ "${GPUPIN_KMEMLEAK:-}" = 1 ]; then
	[ -w "$KML" ] || { echo "vm-guest: GPUPIN_KMEMLEAK=1 but $KML is missing" >&2; exit 1; }
	echo clear > "$KML"
fi
# make coverage sets COVERAGE_PROCESS_START: every Python started here runs under coverage.py
# (the venv's gpupin-coverage.pth, written by scripts/ci/coverage.sh).
case "$MODE" in
test)
	# shellcheck disable=SC2046  # (one word, or none)
	python -m pytest -q -rP -p no:cacheprovider -o junit_family=xunit2 --timeout="${GPUPIN_TEST_TIMEOUT:-600}" \
		--junitxml="$RESULTS/junit.xml" $(suite_args tests/vm "$@") "$@" 2>&1 | tee "$RESULTS/pytest.txt"
	rc=${PIPESTATUS[0]}
	;;
installed)
	# Against the DKMS-installed modules (make test-deb): modprobe by name, and the
	# fixtures load by name too (nothing from the tree: GPUPIN_KO_DIR points nowhere).
	export GPUPIN_KO_DIR=/nonexistent
	# modprobe brings what gpupin imports from: the simulator and gpupin_cb (depmod).
	modprobe gpupin && [ -d /sys/module/nvp2p_sim ] && [ -d /sys/module/gpupin_cb ] && {
		f=$(modinfo -n gpupin)
		echo "vm-guest: gpupin loaded from $f"
		case "$f" in */updates/dkms/*) ;; *) echo "vm-guest: not the DKMS module" >&2; false ;; esac
	} && [ "$(cat /sys/module/gpupin/srcversion)" = "$(modinfo -F srcversion gpupin)" ] &&
	# The smoke suite: the pin lifecycle and the command's load and status against them (the
	# rest of the command's tests, ~2 min under emulation, run in make test-vm).
	python -m pytest -q -p no:cacheprovider --timeout="${GPUPIN_TEST_TIMEOUT:-600}" \
		tests/vm/test_pin.py tests/vm/test_cli_vm.py::test_status_and_load "$@" 2>&1 | tee "$RESULTS/pytest.txt"
	rc=${PIPESTATUS[0]}
	;;
bench)
	python -m gpupin load --sim && python -m gpupin.tools.bench --only-vm --out "$RESULTS/bench-vm.json" "$@"
	rc=$?
	;;
demo)
	python -m gpupin.tools.demo "$@"
	rc=$?
	;;
shell)
	# The console reaching us is not a terminal (no job control, no echo): give the shell a
	# pseudo-terminal of its own with script(1), sized like the host's terminal.  The host
	# side (vm-run.sh) puts its terminal in raw mode, so Ctrl-C, Ctrl-Z and Ctrl-D arrive
	# here as bytes and the pty turns them into signals and end-of-file.
	# --norc: a login .bashrc (pyenv and the like) would put another python first on PATH.
	size=${GPUPIN_TTY_SIZE:-24 80}
	python -m gpupin load --sim &&
		TERM=${GPUPIN_TERM:-xterm} script -qefc "stty rows ${size% *} cols ${size#* }; exec bash --norc -i" /dev/null
	;;
*)
	echo "vm-guest: unknown mode $MODE" >&2
	rc=2
	;;
esac
# Unload what is still loaded: catches leaks and unload bugs too.  Not gpupin_cb: it has no
# exit on purpose (NVIDIA may run a callback it holds at any time), so rmmod refuses it.
for m in gpupin_peer gpupin nvp2p_sim vgem; do
	if [ -d "/sys/module/$m" ] && ! rmmod "$m"; then
		echo "vm-guest: rmmod $m failed" >&2
		rc=1
	fi
done
if [ "${GPUPIN_KMEMLEAK:-}" = 1 ]; then
	# Two scans: kmemleak reports an object only once it has looked unreferenced twice.
	echo scan > "$KML"; sleep 2; echo scan > "$KML"
	cat "$KML" > "$RESULTS/kmemleak.txt"
fi
if [ "${GPUPIN_GCOV:-}" = 1 ]; then
	# gcov data of the (now unloaded: gcov_persist keeps it) modules, by absolute object path.
	n=0
	while IFS= read -r f; do
		mkdir -p "$RESULTS/gcov/$(dirname "$f")" && cat "/sys/kernel/debug/gcov/$f" > "$RESULTS/gcov/$f" && n=$((n + 1))
	done < <(cd /sys/kernel/debug/gcov && find . -name '*.gcda')
	echo "vm-guest: copied $n gcov data files"
	[ "$n" -gt 0 ] || rc=1
fi
kill "$DMESG_PID" 2>/dev/null
wait "$DMESG_PID" 2>/dev/null
dmesg > "$RESULTS/dmesg.txt"
cat /proc/sys/kernel/tainted > "$RESULTS/taint.txt"
exit "$rc"
