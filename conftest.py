"""Suite-wide set-up (tests and doctests alike).

XLA:CPU maps about three pages per kernel it JIT-compiles, and a table
operation such as ``insert_or_apply`` has some 140 kernels: one executable
costs about 400 of the process's memory mappings. A worker that keeps ~150 of
them alive reaches Linux's ``vm.max_map_count`` (65530 by default); the next
compile then fails inside LLVM ("Cannot allocate memory") and the worker dies
with a segmentation fault. The suite compiles far more shapes than a real
program, so a worker drops JAX's caches (freeing the executables) when it has
used three quarters of the limit (the largest test adds fewer than 10,000).

Tests marked ``slow`` start first, XLA compiles with fewer optimisations and
the cyclic garbage collector runs less often (see below).
"""

from __future__ import annotations

import atexit
import collections
import gc
import os
import shutil
import tempfile
import threading

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

# Tracing allocates millions of short-lived objects, and JAX's caches keep millions more alive: with
# Python's default thresholds (700, 10, 10) a worker spent a tenth of its time in the cyclic collector,
# mostly in full collections walking those caches. Young collections every 50,000 allocations rather
# than 700 leave a full one rare (measured in docs/architecture.md, "Where the time goes"). Memory is
# bounded as before: what the caches hold is dropped near the memory-map limit (below).
gc.set_threshold(50_000, 20, 20)

# What the suite writes to the temporary directory outside pytest's tmp_path (the examples of the
# docstrings, pages and notebooks call tempfile.mkdtemp(), as users do; tests that make folders of
# their own; the processes they start) goes to one folder of this process, removed when it exits.
# pytest's own tmp_path folders stay where they were (the last three runs' kept for debugging).
os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
_SCRATCH = tempfile.mkdtemp(prefix="jaxres-suite-")
os.environ["TMPDIR"] = tempfile.tempdir = _SCRATCH
atexit.register(shutil.rmtree, _SCRATCH, ignore_errors=True)

import jax  # noqa: E402
import jax.monitoring  # noqa: E402
import pytest  # noqa: E402
from jax._src.interpreters import mlir as _mlir  # noqa: E402

# pytest imports jaxres, and with it JAX, before this file (for the warning filters of
# pyproject.toml): JAX has read its environment already, so the cache is set here too. (Without
# xdist, this process would otherwise compile every program afresh; xdist's workers inherit the
# environment set above.)
for _option, _read in (
  ("jax_compilation_cache_dir", str),
  ("jax_persistent_cache_min_compile_time_secs", float),
  ("jax_persistent_cache_min_entry_size_bytes", int),
):
  jax.config.update(_option, _read(os.environ[_option.upper()]))
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
    return f.read().count(b"\n")


# Only a new executable (compiled or read from the persistent cache) adds mappings; the kernel writes
# /proc/self/maps out line by line (40 ms at 30,000 regions), so it is read only after a test loaded one.
_loaded = {"executables": 0, "at_last_check": 0}


def _drop_caches_near_the_map_limit():
  if _MAP_LIMIT is None or _loaded["executables"] == _loaded["at_last_check"]:
    return
  _loaded["at_last_check"] = _loaded["executables"]
  if _mapped_regions() > _MAP_LIMIT * 3 // 4:
    jax.clear_caches()
    if _contexts is not None:
      _contexts.drop()


class _OneContextAThread:
  """``make_ir_context`` that returns one context a thread, made anew after :meth:`drop`.

  JAX lowers every program in a new MLIR context and loads every dialect into it: 5-8 ms of the
  15-25 ms a small program takes to lower, and the suite lowers some 11,000 programs (reading one
  from the persistent cache lowers it first, for its key). A context is not thread-safe to share;
  each thread keeps its own. What it uniques (types, attributes, constants) lives as long as it
  does, so it is dropped with JAX's caches. Programs, their text and their cache keys are the same
  in any context: nothing the tests check changes. Tests only, never the library.
  """

  def __init__(self, make_ir_context):
    self._make = make_ir_context
    self._local = threading.local()
    self._generation = 0

  def __call__(self):
    local = self._local
    if getattr(local, "generation", None) != self._generation:
      local.context, local.generation = self._make(), self._generation
    return local.context

  def drop(self):
    self._generation += 1


# A JAX private: where a JAX release renames it, the suite runs as before, only slower.
_contexts = None
if callable(getattr(_mlir, "make_ir_context", None)):
  _contexts = _mlir.make_ir_context = _OneContextAThread(_mlir.make_ir_context)


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


# Where the suite's time goes: beside pytest's --durations (the README's command prints the 15
# slowest tests), the seconds each test spent tracing, lowering and compiling JAX programs, from
# jax.monitoring's events. A test's tear-down report carries them to the xdist controller, which
# prints the total and the tests that compiled the most. A compile that JAX's persistent cache
# answers counts only its trace, lowering and cache read ("read"); "compile" is XLA compiling (a
# warm run that still compiles meets programs the cache does not hold: shapes drawn anew each run).
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # a compile or a persistent-cache read
_CACHE_READ = "/jax/compilation_cache/cache_retrieval_time_sec"  # a hit's read, inside _BACKEND_COMPILE
_COMPILE_EVENTS = {
  "/jax/core/compile/jaxpr_trace_duration": "trace",
  "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
  _BACKEND_COMPILE: "compile",
}
_PHASES = ("trace", "lower", "read", "compile")  # seconds; beside them, counts of programs compiled and read
_compile_seconds = collections.Counter()
_COMPILE_PROPERTY = "jax_compile_s"


def _on_duration(event: str, duration: float, **_) -> None:
  if event in _COMPILE_EVENTS:
    _compile_seconds[_COMPILE_EVENTS[event]] += duration
  if event == _BACKEND_COMPILE:
    _loaded["executables"] += 1
    _compile_seconds["programs compiled"] += 1
  elif event == _CACHE_READ:  # a hit, reported before its _BACKEND_COMPILE event: a read, not a compile
    _compile_seconds["read"] += duration
    _compile_seconds["compile"] -= duration
    _compile_seconds["programs read"] += 1
    _compile_seconds["programs compiled"] -= 1


jax.monitoring.register_event_duration_secs_listener(_on_duration)


_compile_start = pytest.StashKey[collections.Counter]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
  item.stash[_compile_start] = collections.Counter(_compile_seconds)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
  try:
    return (yield)
  finally:
    _drop_caches_near_the_map_limit()
    spent = collections.Counter(_compile_seconds)
    spent.subtract(item.stash.get(_compile_start, collections.Counter()))
    item.user_properties.append((_COMPILE_PROPERTY, {k: round(v, 3) for k, v in spent.items() if v > 0.0005}))


def pytest_terminal_summary(terminalreporter):
  per_test = collections.defaultdict(collections.Counter)
  for reports in terminalreporter.stats.values():
    for report in reports:
      for name, value in getattr(report, "user_properties", ()):
        if name == _COMPILE_PROPERTY:
          per_test[report.nodeid].update(value)
  if not per_test:
    return
  total = collections.Counter()
  for spent in per_test.values():
    total.update(spent)
  phases = ", ".join(f"{phase} {total[phase]:.0f} s" for phase in _PHASES)
  seconds = sum(total[phase] for phase in _PHASES)
  terminalreporter.write_sep(
    "=",
    f"JAX compile time: {seconds:.0f} s in tests ({phases}); programs compiled "
    f"{total['programs compiled']:.0f}, read from the cache {total['programs read']:.0f}",
  )
  ranked = sorted(per_test.items(), key=lambda kv: -sum(kv[1][phase] for phase in _PHASES))[:15]
  for nodeid, spent in ranked:
    detail = ", ".join(f"{phase} {spent[phase]:.1f}" for phase in _PHASES if spent[phase] >= 0.05)
    terminalreporter.write_line(f"{sum(spent[p] for p in _PHASES):8.2f}s {nodeid} ({detail})")
