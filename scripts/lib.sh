# SPDX-License-Identifier: (GPL-2.0 OR MIT)
# Sourced by the shell scripts of this tree (not run): what more than one of
# them needs, written once.  Sets ROOT (the tree's top), PROG (the script's
# name, the prefix of its messages), and unless given VENV (the virtualenv of
# `make setup`) and GPUPIN_CACHE (where the caches live); defines die, need,
# need_root, apt_install_missing, copy_module_sources, build_unicast_variant,
# private_apt, cached_chroot, chroot_enter, chroot_leave, chroot_remove,
# newest_kernel, kver_of_kdir, venv_python, build_wheel, project_version and
# suite_args.  It sets no shell options: each script keeps its own.
# packaging/dkms-build.sh does not source it (it runs on users' hosts from the
# DKMS source dir, where lib.sh is not installed).
# shellcheck shell=bash

ROOT=$(CDPATH='' cd -- "$(dirname "${BASH_SOURCE[0]}")/.." >/dev/null && pwd)
PROG=$(basename "$0" .sh)
VENV=${VENV:-$ROOT/.venv}
GPUPIN_CACHE=${GPUPIN_CACHE:-/var/cache/gpupin}

# die MESSAGE...: say it on stderr, prefixed with the script's name, and exit 1.
die() {
	echo "$PROG: $*" >&2
	exit 1
}

# need TOOL...: die naming the first TOOL that is not on PATH.
need() {
	local tool
	for tool in "$@"; do
		command -v "$tool" >/dev/null || die "'$tool' is missing (run 'make setup')"
	done
}

# need_root WHY: die unless running as root, saying WHY root is needed.
need_root() {
	[ "$(id -u)" -eq 0 ] || die "needs root ($1)"
}

# apt_install_missing PACKAGE...: those of the Debian PACKAGEs not installed,
# installed (apt-get update first); as root only, else die naming them.
apt_install_missing() {
	local p missing=()
	for p in "$@"; do
		dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
	done
	[ ${#missing[@]} -gt 0 ] || return 0
	[ "$(id -u)" -eq 0 ] || die "missing Debian packages: ${missing[*]} (run as root, or install them)"
	echo "$PROG: installing ${missing[*]}" >&2
	DEBIAN_FRONTEND=noninteractive apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# copy_module_sources DEST [FILE...]: what Kbuild builds from (Kbuild and the
# *.c/*.h files under kernel/, include/ and examples/), and each FILE (paths
# relative to ROOT), into DEST with their paths relative to ROOT kept.  The
# copy is a separate kbuild M= dir (another configuration, another kernel, a
# chroot, a package) that leaves the tree's own build alone.
copy_module_sources() {
	local dest=$1
	shift
	mkdir -p "$dest"
	(cd "$ROOT" && { find kernel include examples -name '*.[ch]' -print0 && printf '%s\0' Kbuild "$@"; } |
		tar --null -T - -cf -) | tar -C "$dest" -xf -
}

# build_unicast_variant DEST KDIR [MAKE-ARG...]: the modules over the simulator
# with netlink events by SUBSCRIBE and unicast (GPUPIN_NL_EVENTS=unicast, the
# path for kernels without GENL_MCAST_CAP_NET_ADMIN), built in DEST (emptied
# first, then a copy of the sources) against KDIR; MAKE-ARGs go to make.
build_unicast_variant() {
	local dest=$1 kdir=$2
	shift 2
	rm -rf "$dest"
	copy_module_sources "$dest"
	make -C "$kdir" M="$dest" GPUPIN_NL_EVENTS=unicast NVIDIA_SRC=none "$@" modules
}

# private_apt DIR SOURCES-LINE...: an apt configuration of its own in DIR (the
# sources list, lists and package cache), leaving the machine's apt setup
# alone; sets the array APTO, the options to pass apt-get and apt-cache.
private_apt() {
	local dir=$1
	shift
	mkdir -p "$dir/lists/partial" "$dir/archives/partial"
	printf '%s\n' "$@" >"$dir/sources.list"
	# shellcheck disable=SC2034 # the caller's
	APTO=(-o "Dir::Etc::SourceList=$dir/sources.list" -o Dir::Etc::SourceParts=/dev/null
		-o "Dir::State::Lists=$dir/lists" -o "Dir::Cache=$dir" -o Debug::NoLocking=1
		-o APT::Sandbox::User=root -qq)
}

# cached_chroot DIR TARBALL SUITE MIRROR LOG [COMMAND...]: fill the empty DIR
# with a minimal Debian SUITE (debootstrap --variant=minbase): unpacked from
# TARBALL when that is less than a week old, else debootstrapped from MIRROR
# (its output in LOG), COMMAND run (to add packages; it says its own errors),
# and TARBALL written again.  Needs root.
cached_chroot() {
	local dir=$1 tarball=$2 suite=$3 mirror=$4 log=$5
	shift 5
	if [ -s "$tarball" ] && [ -z "$(find "$tarball" -mtime +7)" ]; then
		tar -C "$dir" -xf "$tarball"
		return
	fi
	apt_install_missing debootstrap
	mkdir -p "$(dirname "$tarball")" "$(dirname "$log")"
	echo "$PROG: debootstrap --variant=minbase $suite (once a week)"
	debootstrap --variant=minbase --keyring=/usr/share/keyrings/debian-archive-keyring.gpg \
		"$suite" "$dir" "$mirror" >"$log" 2>&1 || { tail -n 20 "$log" >&2; die "debootstrap failed ($log)"; }
	[ $# -eq 0 ] || "$@"
	tar -C "$dir" -cf "$tarball.new" . && mv "$tarball.new" "$tarball"
}

# chroot_enter DIR [HOSTDIR...]: make the chroot DIR ready to run commands in:
# proc and sysfs mounted, the host's /dev, /dev/pts and each HOSTDIR bound at
# the same paths inside, the host's resolv.conf copied in.
chroot_enter() {
	local dir=$1 d
	shift
	mount -t proc proc "$dir/proc"
	mount -t sysfs sys "$dir/sys"
	for d in /dev /dev/pts "$@"; do
		mkdir -p "$dir$d"
		mount --bind "$d" "$dir$d"
	done
	cp /etc/resolv.conf "$dir/etc/resolv.conf"
}

# chroot_leave DIR: unmount everything mounted below DIR, the deepest first
# (lazily: a process still inside does not keep it).  DIR must be a chroot's
# own directory: an empty one or / would mean every mount of the host.
chroot_leave() {
	local m
	case $1 in "" | /) die "chroot_leave: '$1' is not a chroot's directory" ;; esac
	awk -v d="$1/" 'index($2, d) == 1 {print $2}' /proc/mounts | sort -r | while read -r m; do
		umount -l "$m"
	done
}

# chroot_remove DIR: chroot_leave, then delete DIR, never crossing into a file
# system still mounted below it.  For an EXIT trap.
chroot_remove() {
	chroot_leave "$1"
	rm -rf --one-file-system "$1"
}

# newest_kernel [PATTERN]: print the release of the newest Debian kernel (the
# newest whose release matches the glob PATTERN-amd64, default *-amd64) with
# both its headers (/usr/src/linux-headers-*) and its image (/boot/vmlinuz-*)
# installed; fail, printing nothing, when there is none.
newest_kernel() {
	local h v
	# shellcheck disable=SC2086 # the pattern is meant to glob
	for h in $(printf '%s\n' /usr/src/linux-headers-${1:-*}-amd64 | sort -rV); do
		v=${h#/usr/src/linux-headers-}
		if [ -d "$h" ] && [ -f "/boot/vmlinuz-$v" ]; then
			echo "$v"
			return 0
		fi
	done
	return 1
}

# kver_of_kdir KDIR: the kernel release a build dir is for, read from its
# path: /lib/modules/<release>/build or /usr/src/linux-headers-<release>.
# (The Makefile's KDIR_KVER calls it.)
kver_of_kdir() {
	local d=${1%/}
	d=$(basename "${d%/build}")
	echo "${d#linux-headers-}"
}

# venv_python: print the Python to run the tree's tools with: $PY when given,
# else the virtualenv's; python3 when that is not there.
venv_python() {
	local py=${PY:-$VENV/bin/python}
	[ -x "$py" ] || py=python3
	echo "$py"
}

# build_wheel: the Python wheel in ROOT/dist (an older one removed first), built
# with the virtualenv's pip (its output on stderr); prints the wheel's path.
# setuptools never prunes build/lib, so what an earlier build left there would
# ship: it goes too.
build_wheel() {
	rm -f "$ROOT"/dist/gpupin-*.whl
	rm -rf "$ROOT"/build/lib.*/gpupin
	"$VENV/bin/python" -m pip wheel -q --no-deps -w "$ROOT/dist" "$ROOT" >&2 || return 1
	ls "$ROOT"/dist/gpupin-*.whl
}

# project_version: the version of gpupin, from its one source, pyproject.toml
# (scripts/ci/check-version.sh checks the files that repeat it).
project_version() {
	sed -n 's/^version = "\(.*\)"$/\1/p' "$ROOT/pyproject.toml"
}

# suite_args DIR ARGS...: DIR, unless ARGS name tests themselves (a path under tests/): pytest
# given both would run the whole of DIR.
suite_args() {
	local dir=$1 a
	shift
	for a in "$@"; do
		case "$a" in tests/*) return 0 ;; esac
	done
	echo "$dir"
}
