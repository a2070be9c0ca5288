"""``python -m benchmarks.costs``: what a call costs as the table grows, and against TF's eager table.

* **Functional methods under ``jit``, table donated**: microseconds per call of
  a 4096-key batch on tables half full at capacities 2^16 to 2^22 (a new batch
  each call, and one batch again and again: the same work with its memory in
  cache, which separates the cache misses of a larger table from work).
* **Eager stateful calls**: ``jr.MutableHashTable`` ``insert``, ``find``,
  ``find_or_insert`` and ``remove`` of 512 int64 keys at 2^10 to 2^22 entries,
  next to TF's ``tf.lookup.experimental.MutableHashTable`` (its keys given as
  tensors, its own type, converted before timing) when TensorFlow is installed.
* **Wide rows in one call**: ``find`` of 262,144 keys with 64-wide float32
  rows in one call and in batches of 65,536, on a table of 2^20 entries.

Every figure is the median of ``--runs`` separate processes (each the median
of its timed repeats), with the range of the runs; the report states each
goal and whether this run met it. The compiled programs themselves are
checked for capacity-sized work by ``tests/test_costs.py``.

``--xla``: the XLA path (what GPUs and TPUs run) on CPU against the kernels
(:mod:`benchmarks.xla_path`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxres as jr
from benchmarks import run as tables_run
from benchmarks import xla_path
from benchmarks.xla_path import median_us

ROOT = Path(__file__).resolve().parents[1]
BATCH, EAGER_BATCH, CALLS = 4096, 512, 40
WIDE_KEYS, WIDE_BATCH, WIDE_ENTRIES = 262_144, 65_536, 1 << 20


def _blend(old, new):
  return 0.5 * old + new


METHODS = {  # name -> (step(table, keys, values) -> table, whether it inserts new keys)
  "insert": (lambda t, k, v: t.insert(k, v), True),
  "find_or_insert": (lambda t, k, v: t.find_or_insert(k, v)[0], True),
  "insert_or_apply": (lambda t, k, v: t.insert_or_apply(k, v, _blend), True),
  "find_or_insert_rows": (lambda t, k, v: t.find_or_insert_rows(k)[0], True),
  "find": (lambda t, k, v: (t, t.find(k)), False),
  "lookup": (lambda t, k, v: (t, t.lookup(k)), False),
  "contains": (lambda t, k, v: (t, t.contains(k)), False),
  "read and write rows": (lambda t, k, v: t.write_rows(t.find_rows(k), v), False),
  "remove": (lambda t, k, v: t.remove(k), False),
}


def functional(capacities: list[int]) -> dict:
  """``{f"{method} {capacity}": us, f"{method} {capacity} again": us}``.

  Each table holds ``capacity // 2`` keys; an inserting call's batch is half
  new keys, removed again (untimed) after the call.
  """
  rng = np.random.default_rng(0)
  remove = jax.jit(lambda t, k: t.remove(k), donate_argnums=0)
  values = jnp.ones((BATCH, 4), jnp.float32)
  out = {}
  for capacity in capacities:
    live = rng.integers(-(2**62), 2**62, capacity // 2)
    value = jax.ShapeDtypeStruct((4,), jnp.float32)
    base = jr.OpenAddressingTable.create(capacity, key=jnp.int64, value=value)
    base = base.insert(jr.keys.split64(live), np.ones((len(live), 4), np.float32), donate=True)
    for name, (step, inserts) in METHODS.items():
      fn = jax.jit(lambda t, k, v, step=step: step(t, k, v), donate_argnums=0)
      fresh = rng.integers(-(2**62), 2**62, (CALLS + 2, BATCH // 2))
      known = live[rng.integers(0, len(live), (CALLS + 2, BATCH // 2 if inserts else BATCH))]
      batches = [jr.keys.split64(np.concatenate([k, f]) if inserts else k) for k, f in zip(known, fresh)]
      added = [jr.keys.split64(f) for f in fresh]
      holder = [jax.tree.map(jnp.copy, base)]

      def call(i, fn=fn, batches=batches, holder=holder):
        return _keep(holder, fn(holder[0], batches[i], values))

      def take_out(i, added=added, holder=holder):
        holder[0] = remove(holder[0], added[i])
        return holder[0].size

      out[f"{name} {capacity}"] = median_us(call, CALLS, take_out if inserts else None)
      out[f"{name} {capacity} again"] = median_us(
        lambda i, call=call: call(0), CALLS, (lambda i, take_out=take_out: take_out(0)) if inserts else None
      )
      del holder
  return out


def _keep(holder, result):
  holder[0], out = _split(result)
  return out


def _split(result):
  return (result[0], result[1]) if isinstance(result, tuple) else (result, result.size)


def eager(capacities: list[int]) -> dict:
  """``{f"jaxres {method} {capacity}": us}`` and TF's, for eager 512-key calls on tables holding
  ``capacity // 2`` keys (new keys removed again, untimed, after each call that adds them)."""
  rng = np.random.default_rng(1)
  out = {}
  for capacity in capacities:
    live = rng.integers(-(2**62), 2**62, capacity // 2)
    new = rng.integers(-(2**62), 2**62, (CALLS + 2, EAGER_BATCH))
    known = live[rng.integers(0, len(live), (CALLS + 2, EAGER_BATCH))]
    out.update(_jaxres_eager(capacity, live, new, known))
    out.update(_tf_eager(capacity, live, new, known))
  return out


def _jaxres_eager(capacity: int, live, new, known) -> dict:
  values = np.ones(EAGER_BATCH, np.float32)
  table = jr.MutableHashTable(np.int64, np.float32, default_value=-1.0, initial_capacity=capacity)
  for i in range(0, len(live), 65536):
    table.insert(live[i : i + 65536], np.ones(len(live[i : i + 65536]), np.float32))

  def take_out(i):
    table.remove(new[i])
    return table.state

  def put_back(i):
    table.insert(known[i], values)
    return table.state

  calls = {
    "insert": (lambda i: table.insert(new[i], values) or table.state, take_out),
    "find": (lambda i: table.find(known[i]), None),
    "find_or_insert": (lambda i: table.find_or_insert(new[i], values), take_out),
    "remove": (lambda i: table.remove(known[i]) or table.state, put_back),
  }
  out = {}
  for name, (call, after) in calls.items():
    out[f"jaxres {name} {capacity}"] = median_us(call, CALLS, after)
    out[f"jaxres {name} returns {capacity}"] = median_us(call, CALLS, after, wait=False)
  return out


def _tf_eager(capacity: int, live, new, known) -> dict:
  try:
    import tensorflow as tf
  except ImportError:
    return {}
  table = tf.lookup.experimental.MutableHashTable(tf.int64, tf.float32, default_value=-1.0)
  for i in range(0, len(live), 65536):
    table.insert(tf.constant(live[i : i + 65536]), tf.ones(len(live[i : i + 65536])))
  values = tf.ones(EAGER_BATCH)
  new_t, known_t = [tf.constant(x) for x in new], [tf.constant(x) for x in known]
  calls = {
    "insert": (lambda i: table.insert(new_t[i], values), lambda i: table.remove(new_t[i])),
    "find": (lambda i: table.lookup(known_t[i]).numpy(), None),
    "remove": (lambda i: table.remove(known_t[i]), lambda i: table.insert(known_t[i], values[:EAGER_BATCH])),
  }
  return {f"TF {name} {capacity}": median_us(call, CALLS, after) for name, (call, after) in calls.items()}


def wide() -> dict:
  """Million keys per second of a 64-wide find: one call of all keys, and batches of 65,536."""
  rng = np.random.default_rng(2)
  keys = rng.integers(-(2**62), 2**62, WIDE_ENTRIES)
  table = jr.OpenAddressingTable.create(
    WIDE_ENTRIES, key=jnp.int64, value=jax.ShapeDtypeStruct((64,), jnp.float32)
  )
  for i in range(0, WIDE_ENTRIES, 65536):
    table = table.insert(
      jr.keys.split64(keys[i : i + 65536]), jnp.ones((65536, 64), jnp.float32), donate=True
    )
  queries = np.where(rng.random(WIDE_KEYS) < 0.5, keys[:WIDE_KEYS], rng.integers(-(2**62), 2**62, WIDE_KEYS))
  everything = jr.keys.split64(queries)
  parts = [everything[i : i + WIDE_BATCH] for i in range(0, WIDE_KEYS, WIDE_BATCH)]
  find = jax.jit(lambda t, k: t.find(k))

  def batches(i):
    for part in parts:
      out = find(table, part)
    return out

  one = median_us(lambda i: find(table, everything), 7)
  several = median_us(batches, 7)
  return {"one call": WIDE_KEYS / one * 1e6, "batches": WIDE_KEYS / several * 1e6}  # keys per second


def measure_once(scale: float) -> dict:
  full = scale >= 1
  capacities = [1 << k for k in (16, 18, 20, 22)] if full else [1 << 12, 1 << 14]
  eager_capacities = [1 << k for k in (10, 16, 20, 22)] if full else [1 << 10, 1 << 12]
  return {
    "functional": functional(capacities),
    "eager": eager(eager_capacities),
    "wide": wide() if full else {},
  }


def _run_in_process(scale: float) -> dict:
  with tempfile.TemporaryDirectory() as folder:
    out = Path(folder) / "run.json"
    command = [sys.executable, "-m", "benchmarks.costs", "--scale", str(scale), "--once-to", str(out)]
    subprocess.run(command, cwd=ROOT, check=True)
    return json.loads(out.read_text())


def _capacities(figures: dict) -> list[int]:
  return sorted({int(k.split()[-1]) for k in figures if not k.endswith("again")})


def report(runs: list[dict]) -> str:
  parts = {part: tables_run.combine([{"x": run[part]} for run in runs])["x"] for part in runs[0]}
  met = {True: "yes", False: "**no**"}

  def fig(figures, key):
    value, (lo, hi) = figures[key], figures["spread"][key]
    return f"{value:,.0f} ({lo:,.0f}-{hi:,.0f})"

  functional_figs = parts["functional"]
  capacities = _capacities({k: v for k, v in functional_figs.items() if k != "spread"})
  columns = [f"2^{c.bit_length() - 1}" for c in capacities]
  lines = [
    f"## Functional methods under jit, table donated: us per call of {BATCH} keys",
    "",
    "| method | " + " | ".join(columns) + " | slowest / fastest | same batch again: slowest / fastest |",
    "|---|" + "---|" * (len(columns) + 2),
  ]
  for name in METHODS:
    new = [functional_figs[f"{name} {c}"] for c in capacities]
    again = [functional_figs[f"{name} {c} again"] for c in capacities]
    cells = [fig(functional_figs, f"{name} {c}") for c in capacities]
    lines.append(
      f"| {name} | " + " | ".join(cells) + f" | {max(new) / min(new):.2f} | {max(again) / min(again):.2f} |"
    )
  eager_figs = parts["eager"]
  eager_caps = sorted({int(k.split()[-1]) for k in eager_figs if k != "spread"})
  columns = [f"2^{c.bit_length() - 1}" for c in eager_caps]
  lines += [
    "",
    f"## Eager calls of {EAGER_BATCH} int64 keys: us per call",
    "",
    "| table, call | " + " | ".join(columns) + " |",
    "|---|" + "---|" * len(columns),
  ]
  for who, label in (("jaxres", "jr.MutableHashTable"), ("TF", "TF MutableHashTable")):
    for name in ("insert", "find", "find_or_insert", "remove"):
      for kind, suffix in (("done", ""), ("returned", " returns")):
        keys = [f"{who} {name}{suffix} {c}" for c in eager_caps]
        if all(k in eager_figs for k in keys):
          lines.append(f"| {label} {name} ({kind}) | " + " | ".join(fig(eager_figs, k) for k in keys) + " |")
  goals = []
  inserts = [eager_figs[f"jaxres insert {c}"] for c in eager_caps]
  flat = inserts[-1] / inserts[0]
  goals.append(
    (f"eager insert: 2^{eager_caps[-1].bit_length() - 1} / 2^10 within 1.5x", f"{flat:.2f}", flat <= 1.5)
  )
  big = 1 << 20
  if f"TF insert {big}" in eager_figs and big in eager_caps:
    ratio = eager_figs[f"TF insert {big}"] / eager_figs[f"jaxres insert {big}"]
    goals.append(
      ("eager insert >= 2x faster than TF's MutableHashTable at 2^20", f"{ratio:.2f}x", ratio >= 2)
    )
  wide_figs = parts.get("wide") or {}
  if "one call" in wide_figs:
    ratio = wide_figs["one call"] / wide_figs["batches"]
    lines += [
      "",
      f"## 64-wide rows, {WIDE_ENTRIES:,} entries: find of {WIDE_KEYS:,} keys, million keys per second",
      "",
      "| one call | batches of 65,536 |",
      "|---|---|",
      f"| {wide_figs['one call'] / 1e6:.2f} | {wide_figs['batches'] / 1e6:.2f} |",
    ]
    goals.append(("64-wide rows: one call at least as fast per key as batches", f"{ratio:.2f}x", ratio >= 1))
  lines += ["", "| goal | measured | met |", "|---|---|---|"]
  lines += [f"| {goal} | {value} | {met[ok]} |" for goal, value, ok in goals]
  lines += [
    "",
    f"Medians of {len(runs)} runs (separate processes), each the median of {CALLS} timed calls (7 for the "
    "wide rows) after two untimed ones; in parentheses the range of the runs. A call is timed until its "
    "work is done (done), or, for the eager jaxres calls, also until it returns to Python (returned: JAX "
    "dispatches the work and returns; TF's calls return when done). Tables half full; keys a call adds "
    "are taken out again, untimed, after it.",
  ]
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--scale", type=float, default=1.0, help="1.0: the sizes of the report")
  parser.add_argument("--runs", type=int, default=3)
  parser.add_argument("--out", type=Path, help="the report (results/costs.md; with --xla, xla-path.md)")
  parser.add_argument("--once-to", type=Path, help=argparse.SUPPRESS)
  parser.add_argument(
    "--xla", action="store_true", help="the XLA path against the kernels instead (results/xla-path.md)"
  )
  parser.add_argument(
    "--before", type=Path, help="with --xla: a checkout of earlier code, measured in the same run first"
  )
  args = parser.parse_args(argv)
  if args.xla:
    xla_path.main(args.scale, args.runs, args.before, args.out or xla_path.RESULT)
    return
  if args.once_to is not None:
    args.once_to.write_text(json.dumps(measure_once(args.scale)))
    return
  runs = [_run_in_process(args.scale) for _ in range(args.runs)]
  text = report(runs)
  print(text)
  if args.scale >= 1:
    (args.out or ROOT / "benchmarks" / "results" / "costs.md").write_text(text + "\n")


if __name__ == "__main__":
  main()
