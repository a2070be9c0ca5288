"""Builds the optional CPU kernels (``jaxres/_core/kernels.cc``) against jaxlib's XLA FFI headers.

Everything else about the package is in ``pyproject.toml``. The kernels need
only the system C++ compiler and the headers jaxlib ships; when they cannot be
built, jaxres runs its pure-XLA implementation on CPU too.
"""

import importlib.util
import os

from setuptools import Extension, setup


def _jaxlib_include() -> str:
  spec = importlib.util.find_spec("jaxlib")
  return os.path.join(spec.submodule_search_locations[0], "include")


setup(
  ext_modules=[
    Extension(
      "jaxres._core._kernels",
      sources=["jaxres/_core/kernels.cc"],
      extra_compile_args=["-std=c++17", "-O3", "-fvisibility=hidden", "-isystem", _jaxlib_include()],
      language="c++",
      optional=True,
    )
  ],
)
