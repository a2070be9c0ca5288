"""``python -m benchmarks.startup``: the time to a first result, each figure in fresh processes.

What a new user waits for before anything is computed, each figure the median
of ``--runs`` processes of its own:

* **import**: ``import jaxres`` against its dependencies alone (``jax``,
  ``flax``, ``flax.nnx``, ``optax``, ``orbax.checkpoint``, ``numpy``), timed
  inside the process (the interpreter's own start left out), with every
  module's bytecode cached (as after a first import); and what compiling
  jaxres's own modules to bytecode adds once (an editable install writes none);
* **first training step** of a two-feature model (a ``jr.EmbeddingCollection``
  of two tables, LRU, row-wise Adam, under a linear head; the plain NNX step
  with ``jr.value_and_grad``, donated): building the model, the first step
  (tracing, compiling, running) and a later step;
* **export** with ``jr.saved_model.save`` of that model after one step,
  ``format="jaxres"`` and, when TensorFlow imports, ``format="tf"``;
* **first request** in a fresh process: ``jr.saved_model.load``, the first
  request (compiling) and a later one.

The compiling figures (building the model, first step, first request) are taken
four ways: without JAX's persistent compilation cache, with an empty one (the
first process on a machine, which fills it), with that filled cache (every later
process), and with a cache filled with every program, however quickly it
compiled (``jax_persistent_cache_min_compile_time_secs=0``; JAX's default caches
those that took a second or more). The cache is on when
``jax_compilation_cache_dir`` is set, as docs/getting-started.md says.

``--build`` also times the build of the CPU kernels as ``pip install`` does it
(``setup.py build_ext``, into a temporary folder): minutes.

``--quick`` (the test suite's check of the harness) starts each kind of process
once and no untimed one, and none without the cache (the empty cache's process
compiles the same programs): no warm-up imports (the first timed imports write the
bytecode), no untimed process filling the every-program cache (the timed one
adds the quick programs to the cache the first step filled, so it compiles
only those), and the export reads that cache too. Its figures are not those
of the report.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "startup.md"
DEPENDENCIES = "import jax, flax, flax.nnx, optax, orbax.checkpoint, numpy"
WITHOUT_NNX = "import jax, flax, optax, orbax.checkpoint, numpy"  # as issue 46 measured the dependencies
CACHES = {  # the persistent compilation cache: how each run used it, as the report says it
  "off": "off",
  "empty": "on, empty (the first process)",
  "filled": "on, filled (later processes)",
  "filled, every program": "on, filled, every program cached (later processes)",
}
_CACHE_VARIABLES = (  # the test suite sets these; each measurement sets its own
  "JAX_COMPILATION_CACHE_DIR",
  "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
  "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES",
)


# ----------------------------------------------------------- in the measured process


def _import(statement: str) -> dict:
  start, cpu = time.perf_counter(), time.process_time()
  exec(statement, {})
  return {"seconds": time.perf_counter() - start, "cpu": time.process_time() - cpu}


def _bytecode() -> dict:
  """Seconds to compile every module of jaxres that ``import jaxres`` loads (an editable install
  writes no bytecode: the first import compiles them, later ones read what it wrote)."""
  import jaxres

  sources = [Path(m.__file__) for name, m in list(sys.modules.items()) if name.split(".")[0] == "jaxres"]
  sources = [path for path in sources if path.suffix == ".py"]
  start = time.perf_counter()
  for path in sources:
    compile(path.read_bytes(), str(path), "exec")
  return {"seconds": time.perf_counter() - start, "modules": len(sources), "version": jaxres.__version__}


def _model(capacity: int):
  import jax.numpy as jnp
  import optax
  from flax import nnx

  import jaxres as jr

  class TwoFeatures(nnx.Module):
    def __init__(self):
      adam = optax.adam(1e-2)
      tables = {
        name: jr.TableConfig(capacity, 16, optimizer=adam, eviction=jr.LRU()) for name in ("users", "items")
      }
      features = {"user": jr.FeatureConfig("users"), "item": jr.FeatureConfig("items")}
      self.emb = jr.EmbeddingCollection(tables, features, rngs=nnx.Rngs(0))
      self.head = nnx.Linear(32, 1, rngs=nnx.Rngs(1))

    def __call__(self, batch):
      out = self.emb(batch)
      return self.head(jnp.concatenate([out["user"], out["item"]], axis=-1))[:, 0]

  return TwoFeatures()


def _batches(batch: int, count: int) -> list[tuple[dict, object]]:
  """``count`` batches of ``batch`` examples: int64 user and item ids (as word pairs), labels."""
  import numpy as np

  import jaxres as jr

  rng = np.random.default_rng(0)
  out = []
  for _ in range(count):
    ids = {name: jr.keys.split64(rng.integers(-(2**62), 2**62, batch)) for name in ("user", "item")}
    out.append((ids, rng.integers(0, 2, batch).astype(np.float32)))
  return out


def _trained(capacity: int, batch: int, steps: int):
  """The model, its dense optimizer, and ``[(seconds, loss)]`` of each of ``steps`` steps."""
  import functools

  import jax
  import optax
  from flax import nnx

  import jaxres as jr

  def loss_fn(model, batch, labels):
    return optax.sigmoid_binary_cross_entropy(model(batch), labels).mean()

  @functools.partial(nnx.jit, donate_argnums=(0, 1))
  def train_step(model, optimizer, batch, labels):
    loss, grads = jr.value_and_grad(loss_fn)(model, batch, labels)
    optimizer.update(model, grads)
    return loss

  start = time.perf_counter()
  model = _model(capacity)
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  jax.block_until_ready(nnx.state(model))
  built = time.perf_counter() - start
  times = []
  for ids, labels in _batches(batch, steps):
    start = time.perf_counter()
    loss = float(train_step(model, optimizer, ids, labels))
    times.append(time.perf_counter() - start)
  return model, {"build": built, "steps": times, "loss": loss}


def _signatures():
  import jax
  import jax.numpy as jnp
  from flax import nnx

  import jaxres as jr

  ids = jax.ShapeDtypeStruct(("batch",), jnp.int64)
  predict = lambda model, user, item: {"probability": nnx.sigmoid(model({"user": user, "item": item}))}
  return {"serving_default": jr.saved_model.Signature(predict, user=ids, item=ids)}


def _train(capacity: int, batch: int) -> dict:
  _, figures = _trained(capacity, batch, 3)
  steps = figures.pop("steps")
  return figures | {"first step": steps[0], "later step": statistics.median(steps[1:])}


def _export(capacity: int, batch: int, folder: str, formats: list[str]) -> dict:
  import jaxres as jr

  model, _ = _trained(capacity, batch, 1)
  out = {}
  for fmt in formats:
    if fmt == "tf":
      try:
        import tensorflow  # noqa: F401  (imported before timing: its import is not the export's)
      except ImportError:
        continue
    start = time.perf_counter()
    jr.saved_model.save(model, os.path.join(folder, fmt), _signatures(), format=fmt)
    out[fmt] = time.perf_counter() - start
  return out


def _serve(folder: str, batch: int) -> dict:
  import numpy as np

  start = time.perf_counter()
  import jaxres as jr

  imported = time.perf_counter() - start
  start = time.perf_counter()
  signature = jr.saved_model.load(os.path.join(folder, "jaxres")).signatures["serving_default"]
  loaded = time.perf_counter() - start
  rng = np.random.default_rng(1)
  times = []
  for _ in range(3):
    user, item = (rng.integers(-(2**62), 2**62, batch) for _ in range(2))
    start = time.perf_counter()
    np.asarray(signature(user=user, item=item)["probability"])
    times.append(time.perf_counter() - start)
  return {"import": imported, "load": loaded, "first request": times[0], "later request": min(times[1:])}


def _measure(stage: str, options: dict) -> dict:
  if stage == "import":
    return _import(options["statement"])
  if stage == "bytecode":
    return _bytecode()
  if stage == "train":
    return _train(options["capacity"], options["batch"])
  if stage == "export":
    return _export(options["capacity"], options["batch"], options["folder"], options["formats"])
  return _serve(options["folder"], options["batch"])


# ----------------------------------------------------------- the harness


def _environment(bytecode: str, cache: str | None = None, every_program: bool = False) -> dict:
  """The child's environment: ``bytecode``, where bytecode goes; ``cache``, a folder for the persistent
  compilation cache (the user's recipe: only ``jax_compilation_cache_dir`` set), and with
  ``every_program`` ``jax_persistent_cache_min_compile_time_secs=0`` too."""
  env = {k: v for k, v in os.environ.items() if k not in _CACHE_VARIABLES and k != "PYTHONDONTWRITEBYTECODE"}
  env["PYTHONPATH"] = str(ROOT)
  env["PYTHONPYCACHEPREFIX"] = bytecode
  if cache is not None:
    env["JAX_COMPILATION_CACHE_DIR"] = cache
  if every_program:
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  return env


def _child(stage: str, env: dict, **options) -> dict:
  """One figure, measured in a fresh process."""
  command = [sys.executable, "-m", "benchmarks.startup", "--measure", stage, json.dumps(options)]
  done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
  if done.returncode:
    raise RuntimeError(f"benchmarks.startup {stage} failed:\n{done.stderr[-3000:]}")
  return json.loads(done.stdout.strip().splitlines()[-1])


def _with_caches(stage: str, cache: str, bytecode: str, quick: bool = False, **options) -> dict:
  """``{kind: figure}`` of :data:`CACHES`: ``stage`` without the persistent cache, with ``cache``
  empty, then filled by that run; and with a cache that a process (untimed) filled with every program
  (``quick``: no process without the cache, whose compiles the empty cache's repeats, and the figure of
  the process that adds the quick programs to ``cache``)."""
  figures = {} if quick else {"off": _child(stage, _environment(bytecode), **options)}
  for kind in ("empty", "filled"):
    figures[kind] = _child(stage, _environment(bytecode, cache), **options)
  every = _environment(bytecode, cache if quick else cache + "-every", every_program=True)
  if not quick:
    _child(stage, every, **options)
  figures["filled, every program"] = _child(stage, every, **options)
  return figures


def measure(runs: int, capacity: int, batch: int, formats: list[str], quick: bool = False) -> dict:
  """``{what: [one figure per run]}``, the runs alternating between what is compared (``quick``: see
  ``--quick`` in the module's description)."""
  out: dict[str, list] = {}
  add = lambda key, value: out.setdefault(key, []).append(value)
  with tempfile.TemporaryDirectory() as scratch:
    bytecode = os.path.join(scratch, "bytecode")  # every module's bytecode, written by the warm-up
    imports = {"dependencies": DEPENDENCIES, "without nnx": WITHOUT_NNX, "jaxres": "import jaxres"}
    if not quick:
      for statement in imports.values():
        _child("import", _environment(bytecode), statement=statement)
    for _ in range(runs):
      for what, statement in imports.items():
        add(f"import {what}", _child("import", _environment(bytecode), statement=statement))
      # the figure is compile() alone; quick, the import before it reads the bytecode written above
      elsewhere = bytecode if quick else os.path.join(scratch, "unused")
      add("bytecode", _child("bytecode", _environment(elsewhere)))
    for run in range(runs):
      cache = os.path.join(scratch, f"cache-{run}")
      trained = _with_caches("train", cache, bytecode, quick, capacity=capacity, batch=batch)
      for kind, figure in trained.items():
        add(f"train {kind}", figure)
      export = os.path.join(scratch, f"export-{run}")
      options = {"capacity": capacity, "batch": batch, "folder": export, "formats": formats}
      add("export", _child("export", _environment(bytecode, cache if quick else None), **options))
      serving = _with_caches(
        "serve", os.path.join(scratch, f"serving-cache-{run}"), bytecode, quick, folder=export, batch=batch
      )
      for kind, figure in serving.items():
        add(f"serve {kind}", figure)
      shutil.rmtree(export)
  return out


def build_seconds() -> dict:
  """Seconds of ``setup.py build_ext`` (the kernels, as ``pip install`` builds them) into a temporary
  folder: wall clock, and the compiler's CPU time."""
  with tempfile.TemporaryDirectory() as folder:
    command = [sys.executable, "setup.py", "-q", "build_ext", "--build-temp", folder, "--build-lib", folder]
    before = os.times()
    start = time.perf_counter()
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True)
    wall = time.perf_counter() - start
    after = os.times()
  return {
    "wall": wall,
    "cpu": (after.children_user - before.children_user) + (after.children_system - before.children_system),
  }


def _cell(values: list[float]) -> str:
  middle = statistics.median(values)
  return f"{middle:.2f} ({min(values):.2f}-{max(values):.2f})" if len(values) > 1 else f"{middle:.2f}"


def report(figures: dict, capacity: int, batch: int, build: dict | None = None, machine: str = "") -> str:
  """The report of :func:`measure`'s figures, in seconds (``machine``: where they were taken)."""
  runs = len(figures["import jaxres"])
  imports = {
    f"`{DEPENDENCIES}`": figures["import dependencies"],
    f"`{WITHOUT_NNX}` (`flax.nnx` left out)": figures["import without nnx"],
    "`import jaxres`": figures["import jaxres"],
  }
  lines = [
    f"## Seconds{f' ({machine})' if machine else ''}",
    "",
    "| import | wall clock | CPU time |",
    "|---|---|---|",
  ]
  for what, measured in imports.items():
    lines.append(
      f"| {what} | {_cell([r['seconds'] for r in measured])} | {_cell([r['cpu'] for r in measured])} |"
    )
  gap = {
    kind: [b[kind] - a[kind] for a, b in zip(figures["import dependencies"], figures["import jaxres"])]
    for kind in ("seconds", "cpu")
  }
  bytecode = figures["bytecode"]
  lines += [
    f"| jaxres's own share (the difference with the first row, per run) | {_cell(gap['seconds'])} | "
    f"{_cell(gap['cpu'])} |",
    f"| compiling jaxres's {bytecode[0]['modules']} modules to bytecode (once, at the first import) | "
    f"{_cell([b['seconds'] for b in bytecode])} | |",
  ]
  lines += [
    "",
    f"### A two-feature model (`jr.EmbeddingCollection`, 2 x {capacity:,} rows of 16, LRU, row-wise Adam, "
    f"a linear head; batches of {batch})",
    "",
    "| persistent compilation cache | build the model | first step | later step |",
    "|---|---|---|---|",
  ]
  for kind in (kind for kind in CACHES if f"train {kind}" in figures):  # --quick leaves "off" out
    train = figures[f"train {kind}"]
    cells = [_cell([t[k] for t in train]) for k in ("build", "first step")]
    cells.append(f"{statistics.median(t['later step'] for t in train) * 1e3:.1f} ms")
    lines.append(f"| {CACHES[kind]} | " + " | ".join(cells) + " |")
  exports = figures["export"]
  lines += ["", "| `jr.saved_model.save` of the model | seconds |", "|---|---|"]
  for fmt in exports[0]:
    lines.append(f'| `format="{fmt}"` | {_cell([e[fmt] for e in exports])} |')
  lines += [
    "",
    "| persistent compilation cache | `import jaxres` | `jr.saved_model.load` | first request "
    "| later request |",
    "|---|---|---|---|---|",
  ]
  for kind in (kind for kind in CACHES if f"serve {kind}" in figures):  # --quick leaves "off" out
    serve = figures[f"serve {kind}"]
    cells = [_cell([s[k] for s in serve]) for k in ("import", "load", "first request")]
    cells.append(f"{statistics.median(s['later request'] for s in serve) * 1e3:.1f} ms")
    lines.append(f"| {CACHES[kind]} | " + " | ".join(cells) + " |")
  if build is not None:
    lines += [
      "",
      f"Building the CPU kernels (`setup.py build_ext`, as `pip install -e .` does): {build['wall']:.0f} s "
      f"wall clock, {build['cpu']:.0f} s of compiler CPU time.",
    ]
  lines += [
    "",
    f"Medians of {runs} runs, each figure from a fresh process (imports timed inside it, bytecode cached "
    "unless said; the interpreter's start left out). The cache is JAX's persistent compilation cache "
    "with `jax_compilation_cache_dir` set (and `jax_persistent_cache_min_compile_time_secs=0` for every "
    "program); a filled cache is the one the run's first process wrote. "
    "A request is one batch of int64 user and item ids, answered on the host.",
  ]
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--runs", type=int, default=3, help="processes per figure (the median is reported)")
  parser.add_argument("--capacity", type=int, default=1 << 16, help="rows of each of the model's two tables")
  parser.add_argument("--batch", type=int, default=256, help="examples per step and per request")
  parser.add_argument("--formats", default="jaxres,tf", help="export formats (tf: when TensorFlow imports)")
  parser.add_argument("--build", action="store_true", help="also time the kernels' build (minutes)")
  parser.add_argument(
    "--quick", action="store_true", help="each kind of process once, none untimed (a check of the harness)"
  )
  parser.add_argument("--out", type=Path, default=RESULT)
  parser.add_argument("--measure", nargs=2, help=argparse.SUPPRESS)  # stage, options: one process's figure
  args = parser.parse_args(argv)
  if args.measure:
    print(json.dumps(_measure(args.measure[0], json.loads(args.measure[1]))))
    return
  load = os.getloadavg()[0]
  figures = measure(args.runs, args.capacity, args.batch, args.formats.split(","), args.quick)
  build = build_seconds() if args.build else None
  machine = f"{os.cpu_count()} CPUs, load average {load:.1f} before and {os.getloadavg()[0]:.1f} after"
  text = "# Time to a first result\n\n" + report(figures, args.capacity, args.batch, build, machine)
  print(text)
  args.out.write_text(text + "\n")


if __name__ == "__main__":
  main()
