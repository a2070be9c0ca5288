"""Suite-wide set-up (tests and doctests alike).

XLA:CPU maps about three pages per kernel it JIT-compiles, and a table
operation such as ``insert_or_apply`` has some 140 kernels: one executable
costs about 400 of the process's memory mappings. A worker that keeps ~150 of
them alive reaches Linux's ``vm.max_map_count`` (65530 by default); the next
compile then fails inside LLVM ("Cannot allocate memory") and the worker dies
with a segmentation fault. The suite compiles far more shapes than a real
program, so a worker drops JAX's caches (freeing the executables) when it has
used three quarters of the limit (the largest test adds fewer than 10,000).

Tests marked ``slow`` start first, and XLA compiles with fewer optimisations
(see below).
"""

from __future__ import annotations

import os
import tempfile

# Most of the suite's time is XLA compiling small programs. The tests check
# results, not speed: compile with fewer optimisations, and share compiled
# programs between the xdist workers and the subprocesses they start through
# JAX's persistent cache (keyed by program, flags and JAX version). Set before
# JAX starts; subprocesses inherit the environment.
_FLAGS = os.environ.get("XLA_FLAGS", "").split()
for _flag in ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"):
  if _flag not in _FLAGS:
    _FLAGS.append(_flag)
os.environ["XLA_FLAGS"] = " ".join(_FLAGS)
os.environ.setdefault(
  "JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"jaxres-tests-{os.getuid()}")
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

# Sharded tables are tested on 8 CPU devices (set before any backend starts).
jax.config.update("jax_num_cpu_devices", 8)


def _read_limit() -> int | None:
  try:
    with open("/proc/sys/vm/max_map_count") as f:
      return int(f.read())
  except (OSError, ValueError):  # not Linux
    return None


_MAP_LIMIT = _read_limit()


def _mapped_regions() -> int:
  with open("/proc/self/maps", "rb") as f:
    return sum(1 for _ in f)


def pytest_runtest_teardown(item):
  if _MAP_LIMIT is not None and _mapped_regions() > _MAP_LIMIT * 3 // 4:
    jax.clear_caches()


COPY_IS_AN_ERROR = "error::jaxres.TableCopyWarning"


def pytest_collection_modifyitems(items):
  """Tests marked ``slow`` first: under xdist, a long test started last would run alone.

  A jitted call that copies a table because it was not donated warns
  (``jr.TableCopyWarning``). The suite's own tests jit without donating where
  they test semantics, so the warning is ignored there (``pyproject.toml``);
  but every docstring example, like every page and notebook, is one a user
  copies, and must donate: there it is an error.
  """
  items.sort(key=lambda item: item.get_closest_marker("slow") is None)
  for item in items:
    if isinstance(item, pytest.DoctestItem):
      item.add_marker(pytest.mark.filterwarnings(COPY_IS_AN_ERROR))
