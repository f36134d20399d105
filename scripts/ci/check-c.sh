#!/bin/bash
# SPDX-License-Identifier: (GPL-2.0 OR MIT)
# The Python package's C (pyctl/gpupin/csrc): built the way _build.py builds it
# (-Wall -Wextra -Werror) and run through GCC's static analyser (-fanalyzer:
# leaks, double frees, NULL dereferences, use of uninitialised values).
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "$0")/../lib.sh"
PY=$(venv_python)
pyinc=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
[ -f "$pyinc/Python.h" ] || { echo "check-c: no Python.h in $pyinc: apt-get install python3-dev" >&2; exit 1; }
rc=0
for f in "$ROOT"/pyctl/gpupin/csrc/*.c; do
	gcc -std=gnu11 -O1 -fanalyzer -Wall -Wextra -Werror -I"$ROOT/include/uapi" \
		-I"$ROOT/pyctl/gpupin/csrc" -I"$pyinc" -c "$f" -o /dev/null || rc=1
done
[ $rc = 0 ] && echo "check-c: $(ls "$ROOT"/pyctl/gpupin/csrc/*.c | wc -l) files clean (gcc -fanalyzer -Wall -Wextra -Werror)"
exit $rc
