"""``python -m benchmarks.costs --xla``: the XLA path (what GPUs and TPUs run) on CPU, against the kernels.

On CPU jaxres runs C++ kernels; every other platform runs their XLA
references (:func:`jaxres._core.kernels.native.references` traces those alone
here). For each path this times, per call of 4096 int64 keys (4 float32 per
row) under ``jit`` with the table donated, at capacities 2^16 to 2^22:

* ``find``, ``insert`` and ``find_or_insert`` on a table half full (an
  inserting call's batch half new keys, taken out again untimed);
* ``find_or_insert`` of new keys on a full ``jr.LRU()`` table (every new key
  evicts);
* the training step of a ``jr.DynamicEmbedding`` (LRU, Adam, 4096 ids of a
  Zipf stream, the plain NNX step with ``jr.value_and_grad``, model donated).

It also counts, per method, what the compiled XLA program is made of
(instructions, fusions, loops, sorts, scatters, gathers) at one capacity: on a
GPU each fusion is a kernel launch and each loop a sequence of them. Every
figure is the median of ``--runs`` processes; the report states the issue's
goals and whether this run met them.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "xla-path.md"
BATCH, CALLS, WIDTH = 4096, 20, 4
PATHS = ("kernels", "xla")
METHODS = ("find", "insert", "find_or_insert", "evicting find_or_insert", "embedding step")
RATIO_GOAL = {"find": 4, "insert": 4, "find_or_insert": 4, "embedding step": 4}  # XLA / kernels
FLAT_GOAL = 1.3  # slowest / fastest capacity


def median_us(call, calls: int, after=None, wait: bool = True) -> float:
  """Median microseconds of ``calls`` timed calls after two untimed ones: until each call's
  work is done (``wait``), or until it returns (JAX dispatches work and returns first).

  ``after(i)``, untimed and waited for, follows call ``i`` (to take out the keys it added).
  """
  times = []
  for i in range(calls + 2):
    start = time.perf_counter()
    result = call(i)
    if wait:
      jax.block_until_ready(result)
    if i >= 2:
      times.append(time.perf_counter() - start)
    jax.block_until_ready(result if after is None else after(i))
  return statistics.median(times) * 1e6


def _filled(capacity: int, live: np.ndarray, storage: str = "open_addressing", **options):
  import jaxres as jr
  from jaxres._core.storages import registry

  value = jax.ShapeDtypeStruct((WIDTH,), jnp.float32)
  table = registry.storage(storage).create(capacity, key=jnp.int64, value=value, **options)
  for i in range(0, len(live), 1 << 16):
    part = live[i : i + (1 << 16)]
    table = table.insert(jr.keys.split64(part), np.ones((len(part), WIDTH), np.float32), donate=True)
  return table


def table_calls(capacity: int, calls: int = CALLS, storage: str = "open_addressing") -> dict:
  """``{method: us}`` for the table methods at ``capacity``, on the path being traced, of a table of the
  storage kind registered as ``storage``."""
  import jaxres as jr

  rng = np.random.default_rng(capacity)
  values = jnp.ones((BATCH, WIDTH), jnp.float32)
  live = rng.integers(-(2**62), 2**62, capacity // 2)
  out = {}
  steps = {
    "find": (lambda t, k: (t, t.find(k)), False),
    "insert": (lambda t, k: (t.insert(k, values), t.size), True),
    "find_or_insert": (lambda t, k: t.find_or_insert(k, values), True),
  }
  remove = jax.jit(lambda t, k: t.remove(k), donate_argnums=0)
  holder = [_filled(capacity, live, storage)]
  for name, (step, inserts) in steps.items():
    fn = jax.jit(step, donate_argnums=0)
    fresh = rng.integers(-(2**62), 2**62, (calls + 2, BATCH // 2))
    known = live[rng.integers(0, len(live), (calls + 2, BATCH // 2 if inserts else BATCH))]
    batches = [jr.keys.split64(np.concatenate([k, f]) if inserts else k) for k, f in zip(known, fresh)]

    def call(i, fn=fn, batches=batches):
      holder[0], result = fn(holder[0], batches[i])
      return result

    def take_out(i, fresh=fresh):
      holder[0] = remove(holder[0], jr.keys.split64(fresh[i]))
      return holder[0].size

    out[name] = median_us(call, calls, take_out if inserts else None)
  holder.clear()  # the half-full table's memory back before the full one's
  # filled, unless a batch fills it (a check of the harness): the first, untimed call then does
  filling = rng.integers(-(2**62), 2**62, capacity if capacity > BATCH else 0)
  full = [_filled(capacity, filling, storage, eviction=jr.LRU())]
  evicting = jax.jit(lambda t, k: t.find_or_insert(k, values), donate_argnums=0)
  new = [jr.keys.split64(rng.integers(-(2**62), 2**62, BATCH)) for _ in range(calls + 2)]

  def evict(i):
    full[0], result = evicting(full[0], new[i])
    return result

  out["evicting find_or_insert"] = median_us(evict, calls)
  return out


def embedding_step(capacity: int, calls: int = CALLS, batch: int = BATCH, warm: int = 40) -> float:
  """Microseconds per training step of ``batch`` ids on a ``jr.DynamicEmbedding`` of ``capacity`` rows,
  after ``warm`` untimed steps."""
  import optax
  from flax import nnx

  import jaxres as jr

  class Model(nnx.Module):
    def __init__(self):
      self.emb = jr.DynamicEmbedding(
        capacity, 32, optimizer=optax.adam(0.01), eviction=jr.LRU(), rngs=nnx.Rngs(0)
      )
      self.head = nnx.Linear(32, 1, rngs=nnx.Rngs(1))

  def loss(model, ids):
    return jnp.mean((model.head(model.emb(ids))[:, 0] - 1.0) ** 2)

  @functools.partial(nnx.jit, donate_argnums=(0, 1))
  def step(model, optimizer, ids):
    value, grads = jr.value_and_grad(loss)(model, ids)
    optimizer.update(model, grads)
    return value

  model = Model()
  optimizer = nnx.Optimizer(model, optax.adam(0.01), wrt=nnx.Param)
  ranks = np.random.default_rng(0).zipf(1.05, batch * (calls + 2 + warm)) % 10**6  # Zipf(1.05) ids
  stream = (ranks.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)).view(np.int64)
  batches = [jr.keys.split64(b) for b in stream.reshape(-1, batch)]
  for ids in batches[:warm]:  # warm: rows taken, a small table full and evicting
    step(model, optimizer, ids)
  return median_us(lambda i: step(model, optimizer, batches[warm + i]), calls)


_COUNTED = {"instructions": None, "fusions": "fusion", "loops": "while", "sorts": "sort"}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%\S+ = (.+?) ([a-z][a-z\-]*)\(")
ANATOMY_CAPACITY = 3 << 15  # not a power of two: no size of the batch's arrays is one of the table's


def program_counts(capacity: int = ANATOMY_CAPACITY) -> dict:
  """``{method: {what: count}}``: the compiled program of each table method on the path being traced,
  and its copies of a capacity-sized array (whose shape has a size of one of the table's arrays)."""
  import jaxres as jr

  values = jnp.ones((BATCH, WIDTH), jnp.float32)
  keys = jr.keys.split64(np.arange(BATCH, dtype=np.int64) * 7919)
  value = jax.ShapeDtypeStruct((WIDTH,), jnp.float32)
  half = jr.OpenAddressingTable.create(capacity, key=jnp.int64, value=value)
  lru = jr.OpenAddressingTable.create(capacity, key=jnp.int64, value=value, eviction=jr.LRU())
  programs = {
    "find": (lambda t, k: (t, t.find(k)), half),
    "insert": (lambda t, k: t.insert(k, values), half),
    "find_or_insert": (lambda t, k: t.find_or_insert(k, values), half),
    "evicting find_or_insert": (lambda t, k: t.find_or_insert(k, values), lru),
  }
  out = {}
  for name, (fn, table) in programs.items():
    shapes = [x.shape for x in jax.tree.leaves(table)]
    sizes = {n for shape in shapes for i in range(len(shape)) for n in (shape[i], math.prod(shape[i:]))}
    sizes = {n for n in sizes if n >= capacity // 2}
    text = jax.jit(fn, donate_argnums=0).lower(table, keys).compile().as_text()
    ops = [m.groups() for m in map(_INSTRUCTION.match, text.splitlines()) if m]
    counts = {what: sum(op == kind or kind is None for _, op in ops) for what, kind in _COUNTED.items()}
    counts["scatters"] = len(re.findall(r"\bscatter\(", text))
    counts["gathers"] = len(re.findall(r"\bgather\(", text))
    counts["table copies"] = sum(op == "copy" and _sized(shape, sizes) for shape, op in ops)
    out[name] = counts
  return out


def _sized(shape: str, sizes: set[int]) -> bool:
  return any(int(d) in sizes for d in re.findall(r"\d+", shape.split("{")[0]))


def measure_once(
  path: str, capacities: list[int], calls: int, warm: int = 40, anatomy: int = ANATOMY_CAPACITY
) -> dict:
  from jaxres._core.kernels import native

  def measure():
    times = {}
    for capacity in capacities:
      for name, us in table_calls(capacity, calls).items():
        times[f"{name} {capacity}"] = us
      times[f"embedding step {capacity}"] = embedding_step(capacity, calls, warm=warm)
    return {"times": times, "programs": program_counts(anatomy)}

  if path == "kernels":
    return measure()
  with native.references():
    return measure()


def _run_in_process(path: str, scale: float, checkout: Path) -> dict:
  """One measurement in a process of its own, of the ``jaxres`` in ``checkout``."""
  with tempfile.TemporaryDirectory() as folder:
    out = Path(folder) / "run.json"
    command = [sys.executable, str(Path(__file__).resolve()), path, str(scale), str(out)]
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    subprocess.run(command, cwd=checkout, env=env, check=True)
    return json.loads(out.read_text())


def capacities_for(scale: float) -> list[int]:
  """The report's capacities; below full scale (a check of the harness) one small one: the XLA path's
  programs take seconds each to compile, once per capacity."""
  return [1 << k for k in (16, 18, 20, 22)] if scale >= 1 else [1 << 10]


def anatomy_for(scale: float) -> int:
  """The capacity of the programs counted; below full scale the one measured, whose programs are then
  compiled already (when JAX's persistent cache keeps them all, as the test suite's does)."""
  return ANATOMY_CAPACITY if scale >= 1 else capacities_for(scale)[0]


def measure(scale: float, runs: int, checkout: Path = ROOT) -> dict:
  """``{path: [run, ...]}``: ``runs`` processes per path, the paths alternating."""
  out = {path: [] for path in PATHS}
  for _ in range(runs):
    for path in PATHS:
      out[path].append(_run_in_process(path, scale, checkout))
  return out


def report(runs: dict, label: str = "", anatomy: int = ANATOMY_CAPACITY) -> str:
  """The report of :func:`measure`'s runs (``label``: the code measured, e.g. a commit; ``anatomy``:
  the capacity of the programs counted)."""
  times = {
    path: {k: statistics.median(r["times"][k] for r in path_runs) for k in path_runs[0]["times"]}
    for path, path_runs in runs.items()
  }
  capacities = sorted({int(k.split()[-1]) for k in times["xla"]})
  columns = [f"2^{c.bit_length() - 1}" for c in capacities]
  lines = [
    f"## us per call of {BATCH} int64 keys{f' ({label})' if label else ''}",
    "",
    "| method | path | " + " | ".join(columns) + " | slowest / fastest | XLA / kernels |",
    "|---|---|" + "---|" * (len(columns) + 2),
  ]
  goals = []
  for method in METHODS:
    ratio_cells = []
    for path in PATHS:
      row = [times[path][f"{method} {c}"] for c in capacities]
      flat = max(row) / min(row)
      ratio = statistics.median(
        times["xla"][f"{method} {c}"] / times["kernels"][f"{method} {c}"] for c in capacities
      )
      ratio_cells.append(ratio)
      cells = " | ".join(f"{x:,.0f}" for x in row)
      lines.append(
        f"| {method} | {path} | {cells} | {flat:.2f} | {f'{ratio:.1f}x' if path == 'xla' else ''} |"
      )
      if path == "xla":
        goals.append(
          (f"XLA path {method}: slowest / fastest capacity <= {FLAT_GOAL}", f"{flat:.2f}", flat <= FLAT_GOAL)
        )
    if method in RATIO_GOAL:
      ratio = ratio_cells[-1]
      goals.append(
        (
          f"XLA path {method} within {RATIO_GOAL[method]}x of the kernels",
          f"{ratio:.1f}x",
          ratio <= RATIO_GOAL[method],
        )
      )
  programs = runs["xla"][0]["programs"]
  kernel_programs = runs["kernels"][0]["programs"]
  what = list(next(iter(programs.values())))
  lines += [
    "",
    f"## What each compiled program is made of ({anatomy:,} entries, {BATCH} keys): "
    "XLA path (kernels' program)",
    "",
    "| method | " + " | ".join(what) + " |",
    "|---|" + "---|" * len(what),
  ]
  for method, counts in programs.items():
    lines.append(
      f"| {method} | " + " | ".join(f"{counts[w]} ({kernel_programs[method][w]})" for w in what) + " |"
    )
  met = {True: "yes", False: "**no**"}
  lines += ["", "| goal | measured | met |", "|---|---|---|"]
  lines += [f"| {goal} | {value} | {met[ok]} |" for goal, value, ok in goals]
  n = len(runs["xla"])
  lines += [
    "",
    f"Medians of {n} processes per path, each the median of its timed calls after two untimed ones; the "
    "XLA/kernels ratio is the median over the capacities. Loops in the counts are the program's `while` "
    "instructions: each runs its body (its fusions) once per round.",
  ]
  return "\n".join(lines)


def _commit(checkout: Path) -> str:
  done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=checkout, capture_output=True, text=True)
  return done.stdout.strip() or str(checkout)


def main(scale: float, runs: int, before: Path | None = None, out: Path = RESULT) -> None:
  """Measures (``before``'s checkout first, if given), prints the report and, at full scale, writes it
  to ``out``."""
  measured = {}
  if before is not None:
    measured[f"before: {_commit(before)}"] = measure(scale, runs, before)
  measured[f"after: {_commit(ROOT)}" if before is not None else _commit(ROOT)] = measure(scale, runs)
  parts = [report(runs, label, anatomy_for(scale)) for label, runs in measured.items()]
  text = "# The XLA path on CPU against the kernels\n\n" + "\n\n".join(parts)
  print(text)
  if scale >= 1:
    out.write_text(text + "\n")
    out.with_suffix(".json").write_text(json.dumps(measured))  # every run's figures


if __name__ == "__main__":
  path, scale, out = sys.argv[1], float(sys.argv[2]), Path(sys.argv[3])
  calls, warm = (CALLS, 40) if scale >= 1 else (3, 2)
  out.write_text(json.dumps(measure_once(path, capacities_for(scale), calls, warm, anatomy_for(scale))))
