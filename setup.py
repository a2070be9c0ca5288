"""Builds the optional CPU kernels (``jaxres/_core/kernels/kernels.cc``) against jaxlib's XLA FFI headers.

Everything else about the package is in ``pyproject.toml``. The kernels need
only the system C++ compiler and the headers jaxlib ships; when they cannot be
built, jaxres runs its pure-XLA implementation on CPU too. The constants the
kernels share with their Python references come from
``jaxres/_core/constants.py``, written into a generated header here.
"""

import importlib.util
import os
import runpy

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

CONSTANTS = "jaxres/_core/constants.py"
# After Python's own flags, which include -g: debug information for XLA's FFI templates took a quarter
# of the compile (and 7 of the library's 7.6 MB) and changes no instruction (benchmarks/startup.py --build).
# -O3 stays: -O2 and -O1 compile in 0.8x and 0.6x the time, but their kernels ran 1.5-2x slower.
COMPILE_ARGS = ["-std=c++17", "-O3", "-g0", "-fvisibility=hidden"]


def _jaxlib_include() -> str:
  spec = importlib.util.find_spec("jaxlib")
  return os.path.join(spec.submodule_search_locations[0], "include")


class BuildWithConstants(build_ext):
  """Writes ``jaxres_constants.h`` from :data:`CONSTANTS` before compiling."""

  def build_extensions(self):
    generated = os.path.join(self.build_temp, "jaxres_generated")
    os.makedirs(generated, exist_ok=True)
    with open(os.path.join(generated, "jaxres_constants.h"), "w", encoding="utf-8") as f:
      f.write(runpy.run_path(CONSTANTS)["header"]())
    for extension in self.extensions:
      extension.include_dirs.append(generated)
    super().build_extensions()


setup(
  cmdclass={"build_ext": BuildWithConstants},
  ext_modules=[
    Extension(
      "jaxres._core.kernels._kernels",
      sources=["jaxres/_core/kernels/kernels.cc"],
      depends=[CONSTANTS],
      extra_compile_args=[*COMPILE_ARGS, "-isystem", _jaxlib_include()],
      language="c++",
      optional=True,
    )
  ],
)
