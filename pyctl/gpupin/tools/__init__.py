"""The tools built on the gpupin library: the ``gpupin`` command and what it runs.

``main`` is the command's entry point (``gpupin``, ``python -m gpupin``); ``cli`` its
subcommands, parser and output, ``shell`` the interactive shell over them; ``doctor``,
``selftest`` and ``report`` the host checks and their tables; ``bench`` and ``vmscale``
the benchmarks (``python -m gpupin.tools.bench``); ``demo`` the narrated walk-through
(``python -m gpupin.tools.demo``).  Nothing here is library API: import from ``gpupin``.
"""
