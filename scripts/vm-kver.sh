#!/bin/bash
# The Debian kernel the VM harness boots by default: Debian 12's own (the one the
# linux-image-amd64 package depends on) when its image and headers are installed, else
# the newest kernel that has both.  A second kernel (make test-vm-6.12) is chosen with
# VM_KVER and never becomes the default.
# shellcheck source=scripts/lib.sh
. "$(dirname "$0")/lib.sh"
has() { [ -f "/boot/vmlinuz-$1" ] && [ -d "/usr/src/linux-headers-$1" ]; }
dep=$(dpkg-query -W -f='${Depends}' linux-image-amd64 2>/dev/null | sed -n 's/^linux-image-\([^ ,]*\).*/\1/p')
if [ -n "$dep" ] && has "$dep"; then
	echo "$dep"
	exit 0
fi
# None: nothing printed, status 0; the callers say what is missing.
newest_kernel '*' || true
