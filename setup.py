# Builds the cffi extension for non-editable installs; see pyctl/gpupin/_build.py.
from setuptools import setup

setup(cffi_modules=["pyctl/gpupin/_build.py:ffibuilder", "pyctl/gpupin/_build.py:kmodbuilder"])
