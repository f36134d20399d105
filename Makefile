# SPDX-License-Identifier: (GPL-2.0 OR MIT)
# gpupin - see README.md.  `make help` lists the targets.

SHELL := /bin/bash
KVER ?= $(shell uname -r)
# Running kernel's build dir, else the headers of the kernel the VM boots (scripts/kdir.sh).
KDIR ?= $(or $(wildcard /lib/modules/$(KVER)/build),$(shell scripts/kdir.sh))
# NVIDIA driver sources (dir with nvidia/nv-p2p.h): found under /usr/src when empty; 'none' = simulator.
NVIDIA_SRC ?=
# The kernel release KDIR builds for (/usr/src/linux-headers-<kver> or /lib/modules/<kver>/build).
KDIR_KVER = $(shell . scripts/lib.sh && kver_of_kdir "$(KDIR)")
VENV ?= $(CURDIR)/.venv
PY := $(VENV)/bin/python
KMAKE = $(MAKE) -C $(KDIR) M=$(CURDIR) $(if $(NVIDIA_SRC),NVIDIA_SRC=$(NVIDIA_SRC))

.PHONY: all modules clean setup pyext check check-version check-netlink netlink-header check-kernel check-py test test-host test-vm \
	test-gpu test-vm-6.12 test-vm-dmem test-native test-long test-debug coverage check-newest check-nvidia deb wheel test-deb check-fresh bench demo install help \
	host-test vm-test

all: modules

help:
	@echo "make [modules]   build against KDIR=$(KDIR)"
	@echo "                 gpupin.ko and gpupin_cb.ko (the free callback's entry point, never unloaded);"
	@echo "                 over the simulator also nvp2p_sim.ko and the example peer gpupin_peer.ko;"
	@echo "                 with NVIDIA's sources (/usr/src/nvidia-* or NVIDIA_SRC=): those two alone"
	@echo "                 (+ gpupin_peer.ko with GPUPIN_EXAMPLES=1 on the command line)"
	@echo "make clean       remove the build outputs and the compiled Python extensions"
	@echo "make setup       Debian packages and the virtualenv .venv (scripts/setup.sh; idempotent);"
	@echo "                 SETUP_PROFILE=demo|check|test (the default) installs what those commands need"
	@echo "make pyext       compile the Python package's cffi extensions into the tree"
	@echo "make demo        build, load (in a VM if needed) and show pinning end to end"
	@echo "make test        check, check-nvidia, check-newest, test-host, test-vm, test-vm-6.12, test-vm-dmem, test-deb,"
	@echo "                 check-fresh (+ test-gpu):"
	@echo "                 every leg runs even after one failed; a table of them ends the run"
	@echo "make check       check-version, check-netlink, check-kernel, check-py"
	@echo "make check-version  the DKMS configurations, gpupin.h and __init__.py carry pyproject.toml's version"
	@echo "make check-netlink  the committed netlink header and kernel policies/ops are what the YNL spec generates"
	@echo "make check-kernel   W=1 (+ unicast variant, examples/peer alone, drivers gpupin refuses), sparse, checkpatch --strict"
	@echo "make check-py       ruff (lint, format), mypy, gcc -fanalyzer on the package's C"
	@echo "make netlink-header generate include/uapi/gpupin_netlink.h and kernel/netlink-gen.[ch] from"
	@echo "                    Documentation/netlink/specs/gpupin.yaml"
	@echo "make check-nvidia  build against NVIDIA's 535 and 550 open driver sources, check CRCs"
	@echo "make deb | wheel   Debian packages (gpupin-dkms, gpupin-sim-dkms) / the Python wheel in dist/"
	@echo "make test-deb      install the .deb, DKMS, modprobe in the VM, smoke suite; the wheel in a clean venv"
	@echo "make check-fresh   setup.sh on a fresh Debian 12 (debootstrap chroot)"
	@echo "make check-newest  W=1 -Werror against Debian unstable's newest kernel headers (chroot)"
	@echo "make coverage      kernel (gcov) and Python coverage of the host and VM suites: results/coverage/"
	@echo "make install       modules_install (for NVIDIA: gpupin.ko, gpupin_cb.ko), depmod, udev rule, gpupin group"
	@echo "make test-host | test-vm | test-vm-6.12 | test-vm-dmem | test-gpu | test-native | test-long | test-debug | bench"
	@echo "make vm-test T='-k NAME'   the VM tests pytest selects with T (host-test T=... likewise)"

# With NVIDIA's driver sources under /usr/src (and no NVIDIA_SRC=), build the way DKMS does:
# against the installed driver, with the CRCs of its nvidia.ko.
modules:
	@test -n "$(KDIR)" || { echo "no kernel headers: run 'make setup' (or set KDIR=)"; exit 1; }
	@if [ -z "$(NVIDIA_SRC)" ] && ls /usr/src/nvidia-*/nvidia/nv-p2p.h >/dev/null 2>&1; then \
		packaging/dkms-build.sh "$(KDIR_KVER)" "$(KDIR)"; \
	else $(KMAKE) modules; fi

clean:
	-$(MAKE) -C $(KDIR) M=$(CURDIR) NVIDIA_SRC=none clean
	rm -rf build pyctl/gpupin/_gpupin_cffi.* pyctl/gpupin/_gpupin_kmod.* pyctl/gpupin/_gpupin_drm.*

# Installs apt packages and the virtualenv; idempotent.  SETUP_PROFILE: what to install for
# (demo, check or test: see scripts/setup.sh); demo and the check targets ask for their own.
SETUP_PROFILE ?= test
setup:
	scripts/setup.sh --profile $(SETUP_PROFILE)

# Rebuilt only when what the extensions are made of changed, the venv was made again
# (pyvenv.cfg), or the main one is missing: a rebuild takes seconds, which one test in one
# command should not pay.
PYEXT_STAMP := build/pyext.stamp
PYEXT_SRC := pyctl/gpupin/_build.py $(wildcard include/uapi/*.h pyctl/gpupin/csrc/*.[ch])
pyext: setup $(PYEXT_STAMP)
$(PYEXT_STAMP): $(PYEXT_SRC) $(wildcard $(VENV)/pyvenv.cfg) $(if $(wildcard pyctl/gpupin/_gpupin_cffi.*.so),,FORCE) | setup
	cd pyctl && $(PY) gpupin/_build.py
	@mkdir -p $(@D) && touch $@
FORCE:

# Target-specific: the profile goes to the prerequisites (setup) of these targets too.
check check-version check-netlink check-kernel check-py netlink-header: SETUP_PROFILE = check
demo: SETUP_PROFILE = demo
check: setup check-version check-netlink check-kernel check-py

# One version source, pyproject.toml: the DKMS configurations, gpupin.h and __init__.py agree with it.
check-version:
	scripts/ci/check-version.sh

# The netlink UAPI header and the kernel's request policies and ops are generated from the YNL
# spec (scripts/gen-netlink-header.py) and committed: netlink-header writes them, check-netlink
# fails while any differs from what the spec gives.
NETLINK_SPEC := Documentation/netlink/specs/gpupin.yaml
NETLINK_HEADER := include/uapi/gpupin_netlink.h
NETLINK_KERNEL := kernel/netlink-gen.c kernel/netlink-gen.h

netlink-header:
	$(PY) scripts/gen-netlink-header.py $(NETLINK_SPEC) -o $(NETLINK_HEADER) \
		--kernel-source $(word 1,$(NETLINK_KERNEL)) --kernel-header $(word 2,$(NETLINK_KERNEL))

check-netlink:
	PY=$(PY) scripts/ci/check-netlink.sh $(NETLINK_SPEC) $(NETLINK_HEADER) $(NETLINK_KERNEL)

check-kernel: setup
	$(MAKE) modules KDIR=$(KDIR) >/dev/null
	scripts/ci/check-kernel.sh "$(KDIR)"

check-py: pyext
	$(VENV)/bin/ruff check pyctl tests scripts
	$(VENV)/bin/ruff format --check pyctl tests scripts
	$(VENV)/bin/mypy pyctl/gpupin
	scripts/ci/check-c.sh

test-host: pyext
	$(VENV)/bin/pytest -q tests/host

# One test, one command: T is what pytest gets after the suite's directory, e.g.
# make vm-test T='-k test_pin_unpin'  (the VM boots, only the selection runs: 48 s for one
# test on a quiet 2-core machine, the build already done)
# make host-test T='-k shell -x'
host-test: pyext
	$(VENV)/bin/pytest -q $(if $(filter tests/%,$(T)),,tests/host) $(T)

vm-test: setup pyext
	VM_SELECT=1 scripts/vm-run.sh test $(T)

test-vm: setup pyext
	scripts/vm-run.sh test
	$(VENV)/bin/pytest -q -p no:cacheprovider tests/pty

# The second kernel of the matrix, Debian 12's 6.12: the checks that depend on the kernel and
# the whole VM suite booting it (scripts/ci/test-vm-6.12.sh says what and how).
test-vm-6.12: setup pyext
	RESULTS=$(CURDIR)/results/6.12 scripts/ci/test-vm-6.12.sh

# The budget leg: Debian's newest kernel built with the dmem cgroup controller, which Debian's
# own builds leave out (scripts/debug-kernel.sh dmem: 20-30 min once on 2 cores, cached in /var/cache/gpupin);
# the modules W=1 -Werror against it (the dmem calls compile only there; Debian 12's sparse is
# too old for its headers), then the per-cgroup budget tests, which fail there rather than
# skip, and the fallback limits.
DMEM_TESTS := tests/vm/test_dmem.py tests/vm/test_limits.py tests/vm/test_cache_vm.py::test_file_budget_smaller_than_working_set
test-vm-dmem: setup pyext
	tree=$$(scripts/debug-kernel.sh dmem) && \
		$(MAKE) -s -C $$tree M=$(CURDIR) W=1 KCFLAGS=-Werror modules >/dev/null && \
		VM_KIMAGE=$$tree/arch/x86/boot/bzImage VM_KDIR=$$tree RESULTS=$(CURDIR)/results/dmem \
		GPUPIN_REQUIRE_DMEM=1 VM_SELECT=1 scripts/vm-run.sh test $(DMEM_TESTS)

test-gpu: pyext
	$(VENV)/bin/pytest -q -m gpu tests/gpu

# On a GPU host where modules load: gpupin selftest (loads nvidia, gpupin and the example peer
# for PEER_PCI, prints the table, keeps them loaded), then the VM suite against them.  A build
# for NVIDIA's driver leaves the example peer out unless GPUPIN_EXAMPLES=1 asks for it.
test-native: pyext
	$(MAKE) modules GPUPIN_EXAMPLES=1
	$(VENV)/bin/python -m gpupin selftest --native --keep --require-modules $(if $(PEER_PCI),--pci $(PEER_PCI))
	GPUPIN_NATIVE=1 GPUPIN_PEER_PCI=$(PEER_PCI) $(VENV)/bin/pytest -q tests/vm

# The guest may run 80 min: on a 2-core machine it took 37 (test_sigkill_during_pin's 10,000
# kills 14 of them, the cache's thread stress 10), after the host's 10 min of thread stress.
test-long: setup pyext
	GPUPIN_LONG=1 $(VENV)/bin/pytest -q tests/host/test_cache_threads.py
	GPUPIN_LONG=1 GPUPIN_CYCLES=20 GPUPIN_TEST_TIMEOUT=1800 VM_TIMEOUT=$${VM_TIMEOUT:-4800} scripts/vm-run.sh test

# A 6.1 kernel with KASAN, lockdep, DEBUG_ATOMIC_SLEEP and kmemleak, built once (~13 min,
# cached in /var/cache/gpupin); the VM suites and campaigns under it at CI counts (KASAN makes
# the full counts of test-long take hours).  Not part of 'make test'.
test-debug: setup pyext
	tree=$$(scripts/debug-kernel.sh) && VM_KIMAGE=$$tree/arch/x86/boot/bzImage VM_KDIR=$$tree \
		GPUPIN_KMEMLEAK=1 GPUPIN_TEST_TIMEOUT=1800 VM_TIMEOUT=$${VM_TIMEOUT:-14400} scripts/vm-run.sh test

# Cache figures on this host (FakeDevice), then real ioctl pin/unpin times in the VM.
bench: setup pyext
	$(PY) -m gpupin.tools.bench --out bench.json
	scripts/vm-run.sh bench
	@echo "bench: bench.json (host) and results/bench-vm.json (VM)"

demo: setup pyext
	scripts/demo.sh

# Build gpupin.ko against NVIDIA's real open driver sources (535 from bookworm, 550 from trixie;
# downloaded through a private apt configuration, built once and cached in /var/cache/gpupin)
# and check its nvidia_p2p_* CRCs against the driver's Module.symvers.
check-nvidia: setup
	scripts/ci/check-nvidia.sh "$(KDIR)"

# Debian packages (gpupin-dkms, gpupin-sim-dkms) in dist/; see packaging/make-deb.sh.
deb:
	packaging/make-deb.sh

# The Python package as a wheel in dist/ (the cffi extensions compiled in).  setuptools
# never prunes build/lib: a file left there by an earlier build would ship, so it goes first.
wheel: setup
	. scripts/lib.sh && VENV=$(VENV) build_wheel

# Install the .deb, let DKMS build for the VM's kernel, modprobe there, run a smoke suite,
# purge; then the wheel in a clean venv, used from outside the source tree.
test-deb: setup
	scripts/ci/test-deb.sh
	scripts/ci/test-wheel.sh

# A fresh Debian 12 (debootstrap minbase chroot): setup.sh installs everything, --verify finds
# every tool, the modules build.  GPUPIN_FRESH_DEMO=1 also runs 'make demo' there.
check-fresh:
	scripts/ci/check-fresh.sh

# Every leg runs whatever the others did; a table of them (results/test-legs.txt) ends the run.
TEST_LEGS := check check-nvidia check-newest test-host test-vm test-vm-6.12 test-vm-dmem test-deb check-fresh

test:
	MAKE="$(MAKE)" scripts/ci/test-all.sh $(TEST_LEGS)

# W=1 -Werror against unstable's newest linux-headers-amd64, in a cached Debian unstable chroot.
check-newest:
	scripts/ci/check-newest.sh

# Kernel (gcov kernel built once, ~13 min, cached) and Python line/branch coverage of the
# host and VM suites: results/coverage/. Not part of 'make test' (it prints the last summary).
coverage: setup pyext
	scripts/ci/coverage.sh

# Built for NVIDIA's driver, that is gpupin.ko and gpupin_cb.ko (Kbuild leaves the example peer
# out); over the simulator, nvp2p_sim.ko and gpupin_peer.ko too.  depmod for KDIR's kernel, so
# that modprobe gpupin loads gpupin_cb first.
install: modules
	$(KMAKE) modules_install
	depmod -a $(KDIR_KVER)
	install -D -m 0644 packaging/99-gpupin.rules /etc/udev/rules.d/99-gpupin.rules
	getent group gpupin >/dev/null || groupadd --system gpupin
