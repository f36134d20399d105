#!/bin/bash
# Print the build directory of the installed Debian kernel headers to build against: those of
# the newest kernel that also has an image in /boot (the one the VM harness boots), else the
# newest headers.
v=$("$(dirname "$0")/vm-kver.sh")
if [ -n "$v" ]; then
	echo "/usr/src/linux-headers-$v"
else
	ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -n 1
fi
