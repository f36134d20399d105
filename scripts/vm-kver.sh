#!/bin/bash
# The newest Debian kernel that has both an image in /boot and headers.
for h in $(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -rV); do
	v=${h#/usr/src/linux-headers-}
	if [ -f "/boot/vmlinuz-$v" ]; then echo "$v"; exit 0; fi
done
