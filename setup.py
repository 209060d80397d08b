"""Builds the optional C helper `kvtier.worker._copyruns`; everything else is in pyproject.toml.

The extension is optional: where it cannot be built (no C compiler, no pthreads), the install
still succeeds and `kvtier.worker.memmove` copies with its ctypes fallback.
"""

import sys

from setuptools import Extension, setup

unix = sys.platform != "win32"
setup(
    ext_modules=[
        Extension(
            "kvtier.worker._copyruns",
            ["src/kvtier/worker/_copyruns.c"],
            extra_compile_args=["-O3", "-pthread"] if unix else [],
            extra_link_args=["-pthread"] if unix else [],
            optional=True,
        )
    ]
)
