"""Test support: the pytest plugin, and the stand-ins that tests and tools run over.

- This package is the pytest plugin ``gpupin`` (the ``pytest11`` entry point): the fixtures
  ``device``, ``memory``, ``sim``, ``peer``, ``leakcheck`` and ``sim_params``, the markers, and
  helpers for tests (``ensure_loaded``, ``in_child``, ``PausedThread``, ``ShellOnPty``,
  ``NATIVE``).  Its code is in ``plugin.py``.
- ``fake``: FakeDevice, FakeMemory and FakeCuFile, in-process stand-ins for gpupin.ko,
  device memory and cuFile.
- ``vgem``: dma-bufs from the kernel's vgem driver, a second exporter.
- ``stress``: a thread stress of one RegistrationCache over any provider (the host and VM
  suites run it over FakeMemory and SimMemory).

fake, vgem and stress need no pytest (``gpupin bench`` runs over the fakes), so the plugin's names
are read in only where pytest is installed.  The tools (gpupin.tools) may import test support, which
sits below them; the library never does.  The example peer driver's Python side, which the self-test
and the demo drive, is the library's ``gpupin.peer``.
"""

try:
    import pytest  # noqa: F401 - only whether it is installed
except ImportError:
    pass
else:
    from .plugin import *  # noqa: F403 - this package is the plugin pytest registers
