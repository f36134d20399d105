#!/bin/bash
# Print the build directory of the installed Debian kernel headers to build against: those of
# the kernel the VM harness boots (scripts/vm-kver.sh: Debian 12's own where its image and
# headers are installed, else the newest kernel with both), else the newest headers.
v=$("$(dirname "$0")/vm-kver.sh")
if [ -n "$v" ]; then
	echo "/usr/src/linux-headers-$v"
else
	ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -n 1
fi
