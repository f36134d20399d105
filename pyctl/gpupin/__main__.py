"""``python -m gpupin``: the ``gpupin`` command (gpupin.tools.main)."""

import sys

from .tools.main import main

if __name__ == "__main__":
    sys.exit(main())
