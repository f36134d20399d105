#!/bin/bash
# Print the build directory of the newest installed Debian kernel headers.
ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -n 1
