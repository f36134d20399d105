#!/bin/bash
# Boot Debian's kernel under QEMU (virtme-ng, software emulation), load the
# modules and run MODE inside: test | installed | bench | demo | shell.  The guest's
# kernel log comes back in results/ and fails the run on any BUG, WARNING,
# Oops, list or refcount corruption, or taint beyond O|E.
set -euo pipefail
MODE=${1:-test}
# shellcheck source=scripts/lib.sh
. "$(dirname "$0")/lib.sh"
RESULTS=${RESULTS:-$ROOT/results}
VM_KVER=${VM_KVER:-$("$ROOT/scripts/vm-kver.sh")}
# VM_KIMAGE/VM_KDIR boot another kernel (make test-debug: a KASAN/lockdep build).
VM_KIMAGE=${VM_KIMAGE:-/boot/vmlinuz-$VM_KVER}
VM_KDIR=${VM_KDIR:-/usr/src/linux-headers-$VM_KVER}
[ -f "$VM_KIMAGE" ] && [ -d "$VM_KDIR" ] || {
	echo "vm-run: no kernel image and headers ($VM_KIMAGE, $VM_KDIR): run 'make setup'" >&2; exit 1; }
VM_MEM=${VM_MEM:-2560M}   # q35 keeps all RAM below 4 GiB up to 2.75 GiB: no bounce buffers

# VM_SELECT=1 (make vm-test T=...): MODE test runs only the tests its pytest arguments select,
# and prepares the unicast variant and the YNL tools only where the selection collects the
# tests that use them (tests/vm/test_netlink.py, test_ynl.py; collected on the host, ~3 s).
EXTRAS=1
VM_FILES=
if [ "$MODE" = test ] && [ -n "${VM_SELECT:-}" ]; then
	# --verbosity after the selection: one node id a line whatever -q/-v it carries.
	# shellcheck disable=SC2046  # (one word, or none)
	sel=$("$VENV/bin/python" -m pytest --collect-only -p no:cacheprovider $(suite_args tests/vm "${@:2}") "${@:2}" \
		--verbosity=-1 2>&1) ||
		die "pytest selects no test of tests/vm with: ${*:2}"$'\n'"$sel"
	grep -qE '^tests/vm/test_(netlink|ynl)\.py::' <<<"$sel" || EXTRAS=
	echo "vm-run: $(grep -cE '^tests/vm/.*::' <<<"$sel") test(s) selected${EXTRAS:+ (with the netlink extras)}"
	# The guest imports only these files (tests/vm/conftest.py: pytest_ignore_collect).
	VM_FILES=$(grep -oE '^tests/vm/test_[A-Za-z0-9_]+\.py::' <<<"$sel" | sed 's|^tests/vm/||; s|::$||' | sort -u | tr '\n' ' ')
fi

echo "vm-run: building modules against $VM_KDIR"
# NVIDIA_SRC=none: the guest has no NVIDIA driver, only the simulator, also where this host has
# NVIDIA's driver sources (which the modules target would build against).
make -s -C "$ROOT" modules KDIR="$VM_KDIR" NVIDIA_SRC=none >/dev/null
# A variant with unicast events (the path for kernels without GENL_MCAST_CAP_NET_ADMIN).
[ -z "$EXTRAS" ] || build_unicast_variant "$ROOT/build/unicast" "$VM_KDIR" -s >/dev/null

# vgem (a second dma-buf exporter for the tests): from a kernel tree's build when booting one,
# copied into the source tree (the guest does not see the host's /var).
VGEM_KO=
if [ -f "$VM_KDIR/drivers/gpu/drm/vgem/vgem.ko" ]; then
	mkdir -p "$ROOT/build"
	cp "$VM_KDIR/drivers/gpu/drm/vgem/vgem.ko" "$ROOT/build/vgem.ko"
	VGEM_KO="$ROOT/build/vgem.ko"
fi

# The kernel's YNL client and schemas for tests/vm/test_ynl.py (copied in, like vgem): only
# for the mode that runs it (ynl-fetch.sh downloads linux-source the first time, ~150 MB).
YNL_DIR=
if [ "$MODE" != test ] || [ -z "$EXTRAS" ]; then
	:
elif ynl=$("$ROOT/scripts/ynl-fetch.sh"); then
	rm -rf "$ROOT/build/ynl" && mkdir -p "$ROOT/build/ynl/tools/net" "$ROOT/build/ynl/Documentation"
	cp -r "$ynl/tools/net/ynl" "$ROOT/build/ynl/tools/net/"
	cp -r "$ynl/Documentation/netlink" "$ROOT/build/ynl/Documentation/"
	YNL_DIR="$ROOT/build/ynl"
else
	echo "vm-run: no YNL tools (above): tests/vm/test_ynl.py will fail" >&2
fi

TTY_SIZE="24 80"
if [ "$MODE" = shell ]; then
	[ -t 0 ] || { echo "vm-run: 'shell' needs a terminal on stdin" >&2; exit 1; }
	TTY_SIZE=$(stty size)
fi
# Only what this run writes: results/ also keeps make coverage's reports, a GPU host's
# coverage data and the VM benchmark's JSON, which other modes must not delete.
mkdir -p "$RESULTS"
rm -rf "$RESULTS"/{dmesg.txt,taint.txt,pytest.txt,junit.xml,kmemleak.txt,gcov,console.txt,guest.env}
[ "$MODE" = bench ] && rm -f "$RESULTS/bench-vm.json"
start=$(date +%s)
set +e
# timeout runs vng in a process group of its own: an interactive one must stay in the
# terminal's foreground group, or the terminal stops it (SIGTTIN/SIGTTOU) at once.
TMO=(timeout)
[ "$MODE" = shell ] && TMO+=(--foreground)
# An ivshmem device: a PCI device with a 64 MiB memory BAR, into which the simulator's
# bar_device parameter points page tables, as a GPU's BAR1 pages are (MMIO, not RAM).
BAR_DEV="-object memory-backend-ram,id=gpupinbar,size=64M -device ivshmem-plain,memdev=gpupinbar"
# The host's root again, read-only, for what the guest only reads (Python, the venv, the
# package and the tests): vm-guest.sh mounts it with the page and dentry caches on
# (cache=loose) over those directories.  virtme-ng's root goes uncached to the host for every
# stat and read, which under software emulation makes each Python start take seconds.
RO_SHARE="-fsdev local,id=gpupinro,path=/,security_model=none,readonly=on -device virtio-9p-pci,fsdev=gpupinro,mount_tag=gpupinro"
# The package directory is the one the venv imports gpupin from (its editable install: this
# tree's pyctl/, or the main tree's for a copy such as make test's build/matrix).
RO_DIRS="$("$VENV/bin/python" -c '
import importlib.util, os, sys
spec = importlib.util.find_spec("gpupin")
pkg = spec.submodule_search_locations[0] if spec and spec.submodule_search_locations else ""
print(sys.base_prefix, os.path.dirname(os.path.realpath(pkg)) if pkg else "")
') $VENV $ROOT/tests"
# modprobe.blacklist: udev's coldplug would load drivers for emulated hardware that no test
# uses (KVM, the q35 machine's AHCI and DVD-ROM, watchdogs, SMBus, CPU frequency, crypto
# accelerators), each costing seconds under emulation, before the script may start.
BLACKLIST=kvm,kvm_amd,kvm_intel,ahci,sr_mod,cdrom,powernow_k8,acpi_cpufreq,pcc_cpufreq
BLACKLIST+=,iTCO_wdt,iTCO_vendor_support,i6300esb,lpc_ich,i2c_i801,pcspkr,serio_raw,joydev,psmouse
BLACKLIST+=,aesni_intel,ghash_clmulni_intel,crc32_pclmul,sha256_ssse3,sha1_ssse3,polyval_clmulni
# What the guest needs, in a file of $RESULTS (shared read-write) that vm-guest.sh sources:
# the kernel command line carries only its path.  x86 keeps 2047 bytes of a command line and
# drops the rest silently; virtme-ng puts init= last, so a longer one boots without init and
# panics before the script starts (a clone at a longer path than ours did, in CI).
GUEST_ENV="$RESULTS/guest.env"
{
	echo "# Written by scripts/vm-run.sh for scripts/vm-guest.sh; rewritten by every run."
	for v in "GPUPIN_LONG=${GPUPIN_LONG:-}" "GPUPIN_TEST_TIMEOUT=${GPUPIN_TEST_TIMEOUT:-600}" \
		"GPUPIN_CYCLES=${GPUPIN_CYCLES:-20}" "GPUPIN_CACHE_STRESS_S=${GPUPIN_CACHE_STRESS_S:-}" \
		"GPUPIN_KMEMLEAK=${GPUPIN_KMEMLEAK:-}" "GPUPIN_FUZZ_CALLS=${GPUPIN_FUZZ_CALLS:-}" \
		"GPUPIN_STRESS_SCALE=${GPUPIN_STRESS_SCALE:-}" \
		"GPUPIN_FUZZ_SEED=${GPUPIN_FUZZ_SEED:-}" "GPUPIN_REQUIRE_DMEM=${GPUPIN_REQUIRE_DMEM:-}" \
		"GPUPIN_GCOV=${GPUPIN_GCOV:-}" "COVERAGE_PROCESS_START=${COVERAGE_PROCESS_START:-}" \
		"COVERAGE_FILE=${COVERAGE_FILE:-}" "GPUPIN_EXPECT_FAULT_ATTR=${GPUPIN_EXPECT_FAULT_ATTR:-}" \
		"GPUPIN_VGEM_KO=$VGEM_KO" "GPUPIN_YNL_DIR=$YNL_DIR" "GPUPIN_TTY_SIZE=$TTY_SIZE" "GPUPIN_TERM=${TERM:-xterm}" \
		"VENV=$VENV" "GPUPIN_VM_FILES=$VM_FILES" "GPUPIN_RO_DIRS=$RO_DIRS"; do
		printf 'export %s=%q\n' "${v%%=*}" "${v#*=}"
	done
	printf 'GUEST_MODE=%q\nGUEST_RESULTS=%q\nGUEST_ARGS=(' "$MODE" "$RESULTS"
	[ $# -lt 2 ] || printf ' %q' "${@:2}"
	printf ' )\n'
} >"$GUEST_ENV"
GUEST=(vng -r "$VM_KIMAGE" --disable-kvm
	--cpus 2 --memory "$VM_MEM" --append "slub_debug=FZPU panic_on_warn=0 modprobe.blacklist=$BLACKLIST"
	"--qemu-opts=$BAR_DEV $RO_SHARE" --rwdir "$RESULTS" --cwd "$ROOT"
	--exec "$(printf '%q ' "$ROOT/scripts/vm-guest.sh" "$GUEST_ENV")")
VNG=(env PATH="$VENV/bin:$PATH" "${TMO[@]}" "${VM_TIMEOUT:-3000}" "${GUEST[@]}")
# Refuse, before booting, a command line the kernel would cut (see GUEST_ENV above).
cmdline=$("${VNG[@]}" --dry-run 2>&1 | "$VENV/bin/python" -c '
import shlex, sys
for line in sys.stdin:
    if "qemu-system" in line:
        args = shlex.split(line)
        print(args[args.index("-append") + 1])
        break
')
[ -n "$cmdline" ] || die "vng --dry-run printed no QEMU command line (run it with --dry-run by hand to see why)"
[ ${#cmdline} -lt 2048 ] ||
	die "the guest's kernel command line is ${#cmdline} bytes, past x86's 2047: the kernel would cut it and boot without init.  Shorten what vm-run.sh puts on it (paths: $ROOT, $RESULTS, $VM_KIMAGE)"$'\n'"$cmdline"
if [ "$MODE" = shell ]; then
	# Interactive: the terminal stays the guest's stdin, in raw mode so every key (Ctrl-C
	# included) reaches the guest's pseudo-terminal; restored however vng ends.
	saved=$(stty -g)
	trap 'stty "$saved"' EXIT
	stty raw -echo
	"${VNG[@]}"
	rc=$?
	stty "$saved"
	echo
else
	# Through a pipe: QEMU reopens /proc/self/fd/1 for the guest's output, which truncates (and
	# then overwrites from offset 0) a regular file, so 'make test > log' would lose what came before.
	"${VNG[@]}" </dev/null 2>&1 | cat
	rc=${PIPESTATUS[0]}
fi
set -e
echo "vm-run: guest finished with status $rc after $(( $(date +%s) - start )) s"
if [ "$rc" = 124 ]; then
	echo "vm-run: the guest ran past VM_TIMEOUT=${VM_TIMEOUT:-3000} s and was stopped; its kernel log" \
		"until then is in $RESULTS/dmesg.txt, the tests' output in $RESULTS/pytest.txt" >&2
fi

if [ ! -f "$RESULTS/dmesg.txt" ]; then
	echo "vm-run: the guest left no kernel log: it died before its script started" >&2
	# virtme-ng boots quietly: boot it once more the same way, its console shown (--verbose),
	# so that the log says why.  The verdict stays a failure whatever this boot does.
	if [ "$MODE" != shell ]; then
		echo "vm-run: booting it again with its console shown (all of it: $RESULTS/console.txt)" >&2
		st=0
		env PATH="$VENV/bin:$PATH" timeout 300 "${GUEST[@]}" --verbose </dev/null 2>&1 |
			cat >"$RESULTS/console.txt" || st=${PIPESTATUS[0]}
		echo "vm-run: that boot ended with status $st; its last 40 lines:" >&2
		tail -n 40 "$RESULTS/console.txt" >&2
	fi
	exit 1
fi
# virtme-ng-init's own messages (a tool missing in the guest, say) are not the kernel's.
if grep -v 'virtme-ng-init: ' "$RESULTS/dmesg.txt" |
	grep -nE 'BUG:|WARNING:|Oops|general protection|list_add corruption|list_del corruption|refcount_t:|kernel BUG|Call Trace:|INFO: task .* blocked|slab error|Redzone|Poison overwritten'; then
	echo "vm-run: the kernel log shows a problem (above); whole log in $RESULTS/dmesg.txt" >&2
	exit 1
fi
if [ -s "$RESULTS/kmemleak.txt" ]; then
	head -n 60 "$RESULTS/kmemleak.txt"
	echo "vm-run: kmemleak reports leaks (above; all in $RESULTS/kmemleak.txt)" >&2
	exit 1
fi
taint=$(cat "$RESULTS/taint.txt" 2>/dev/null || echo missing)
if [ "$taint" = missing ] || [ $(( taint & ~12288 )) -ne 0 ]; then
	echo "vm-run: kernel taint $taint has bits beyond O|E (12288)" >&2
	exit 1
fi
echo "vm-run: kernel log clean, taint $taint"
exit "$rc"
