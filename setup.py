"""Builds the optional CPU kernels against jaxlib's XLA FFI headers, as one library.

Everything else about the package is in ``pyproject.toml``. The library is
``jaxres._core.kernels._kernels``: its Python module and the kernels every
storage shares sit in ``jaxres/_core/kernels`` (``module.cc``, ``shared.cc``,
the helpers in ``kernels.h``, the kernels' registry in ``registration.h``), and
each storage folder under ``jaxres/_core/storages`` brings its own
``kernels.cc``, found here by its name. The kernels need
only the system C++ compiler and the headers jaxlib ships; when they cannot be
built, jaxres runs its pure-XLA implementation on CPU too. The constants the
kernels share with their Python references come from
``jaxres/_core/constants.py``, written into a generated header here.
"""

import glob
import importlib.util
import os
import runpy
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

CONSTANTS = "jaxres/_core/constants.py"
SHARED = "jaxres/_core/kernels"  # the module, the shared kernels, kernels.h and registration.h
STORAGES = sorted(glob.glob("jaxres/_core/storages/*/kernels.cc"))  # each storage folder's own kernels
SOURCES = [f"{SHARED}/module.cc", f"{SHARED}/shared.cc", *STORAGES]
# After Python's own flags, which include -g: debug information for XLA's FFI templates took a quarter
# of the compile (and 7 of the library's 7.6 MB) and changes no instruction (benchmarks/startup.py --build).
# -O3 stays: -O2 and -O1 compile in 0.8x and 0.6x the time, but their kernels ran 1.5-2x slower.
COMPILE_ARGS = ["-std=c++17", "-O3", "-g0", "-fvisibility=hidden"]


def _jaxlib_include() -> str:
  spec = importlib.util.find_spec("jaxlib")
  return os.path.join(spec.submodule_search_locations[0], "include")


class BuildWithConstants(build_ext):
  """Writes ``jaxres_constants.h`` from :data:`CONSTANTS`, then compiles the sources side by side (one
  per core: each kernel file parses XLA's FFI headers on its own) and links them as one library."""

  def build_extensions(self):
    generated = os.path.join(self.build_temp, "jaxres_generated")
    os.makedirs(generated, exist_ok=True)
    with open(os.path.join(generated, "jaxres_constants.h"), "w", encoding="utf-8") as f:
      f.write(runpy.run_path(CONSTANTS)["header"]())
    for extension in self.extensions:
      extension.include_dirs.append(generated)
    compile_sources = self.compiler.compile

    def compile_each(sources, *args, **kwargs):
      with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        objects = pool.map(lambda source: compile_sources([source], *args, **kwargs), sources)
        return [obj for per_source in objects for obj in per_source]

    self.compiler.compile = compile_each
    super().build_extensions()


setup(
  cmdclass={"build_ext": BuildWithConstants},
  ext_modules=[
    Extension(
      "jaxres._core.kernels._kernels",
      sources=SOURCES,
      depends=[CONSTANTS, f"{SHARED}/kernels.h", f"{SHARED}/registration.h"],
      include_dirs=[SHARED],
      extra_compile_args=[*COMPILE_ARGS, "-isystem", _jaxlib_include()],
      language="c++",
      optional=True,
    )
  ],
)
