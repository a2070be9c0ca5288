"""``python -m benchmarks.layouts``: the lean layout against open addressing, per call, on both paths.

The two registered storage kinds of a changing table side by side (issue 66:
the slot is the row, 17 B a slot, against today's 48 B an entry), timed as
:mod:`benchmarks.xla_path` times one: per call of 4096 int64 keys (4 float32
per row) under ``jit`` with the table donated, at capacities 2^16 to 2^22,
with the CPU kernels and on their XLA references (what GPUs and TPUs run):

* ``find``, ``insert`` and ``find_or_insert`` on a table half full (an
  inserting call's batch half new keys, taken out again untimed);
* ``find_or_insert`` of new keys on a full ``jr.LRU()`` table (every new key
  evicts).

Each (path, storage) runs in a process of its own, ``--runs`` of each (3 by
default), alternating; every figure is the median of the runs. The report
gives the bytes of the index a slot beside the times, and the issue's goals:
the lean layout no slower than open addressing at any capacity on either path,
and its slowest over fastest capacity at most 1.2 on the kernels.

Examples:
  ``python -m benchmarks.layouts`` (about 20 minutes on a 2-core machine;
  writes ``benchmarks/results/layouts.md``); ``--scale 0.01`` checks the
  harness at one small capacity.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "layouts.md"
STORAGES = ("open_addressing", "lean")
PATHS = ("kernels", "xla")
METHODS = ("find", "insert", "find_or_insert", "evicting find_or_insert")
FLAT_GOAL = 1.2  # slowest / fastest capacity of the lean layout on the kernels


def measure_once(path: str, storage: str, capacities: list[int], calls: int) -> dict:
  """``{"times": {"method capacity": us}, "index bytes a slot": {capacity: bytes}}`` in this process."""
  import jax
  import jax.numpy as jnp

  from benchmarks import xla_path
  from jaxres._core.kernels import native
  from jaxres._core.storages import registry

  def measure():
    times, index = {}, {}
    for capacity in capacities:
      for name, us in xla_path.table_calls(capacity, calls, storage).items():
        times[f"{name} {capacity}"] = us
      value = jax.ShapeDtypeStruct((xla_path.WIDTH,), jnp.float32)
      table = registry.storage(storage).create(capacity, key=jnp.int64, value=value, eviction=None)
      index[capacity] = table.memory()["index"] / capacity
    return {"times": times, "index bytes a slot": index}

  if path == "kernels":
    return measure()
  with native.references():
    return measure()


def capacities_for(scale: float) -> list[int]:
  """The report's capacities; below full scale (a check of the harness) one small one."""
  return [1 << k for k in (16, 18, 20, 22)] if scale >= 1 else [1 << 10]


def _run_in_process(path: str, storage: str, scale: float) -> dict:
  with tempfile.TemporaryDirectory() as folder:
    out = Path(folder) / "run.json"
    command = [sys.executable, "-m", "benchmarks.layouts", "--measure", path, storage, str(scale), str(out)]
    subprocess.run(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
    return json.loads(out.read_text())


def measure(scale: float, runs: int) -> dict:
  """``{(path, storage): [run, ...]}``: ``runs`` processes of each, the storages alternating first."""
  out = {(path, storage): [] for path in PATHS for storage in STORAGES}
  for run in range(runs):
    order = STORAGES if run % 2 == 0 else STORAGES[::-1]
    for path in PATHS:
      for storage in order:
        out[path, storage].append(_run_in_process(path, storage, scale))
  return out


def report(runs: dict, machine: str = "") -> str:
  """The markdown report of :func:`measure`'s runs."""
  times = {
    key: {k: statistics.median(r["times"][k] for r in key_runs) for k in key_runs[0]["times"]}
    for key, key_runs in runs.items()
  }
  capacities = sorted({int(k.split()[-1]) for k in next(iter(times.values()))})
  columns = [f"2^{c.bit_length() - 1}" for c in capacities]
  lines = [
    "# The lean layout against open addressing",
    "",
    *([f"Machine: {machine}.", ""] if machine else []),
    "## Bytes of the index a slot (int64 keys, no eviction)",
    "",
    "| storage | " + " | ".join(columns) + " |",
    "|---|" + "---|" * len(columns),
  ]
  for storage in STORAGES:
    index = runs["kernels", storage][0]["index bytes a slot"]
    lines.append(f"| {storage} | " + " | ".join(f"{index[str(c)]:.2f}" for c in capacities) + " |")
  lines += [
    "",
    f"## us per call of 4096 int64 keys (medians of {len(runs['kernels', STORAGES[0]])} processes)",
    "",
    "| method | path | storage | " + " | ".join(columns) + " | slowest / fastest |",
    "|---|---|---|" + "---|" * (len(columns) + 1),
  ]
  goals = []
  for method in METHODS:
    for path in PATHS:
      rows = {s: [times[path, s][f"{method} {c}"] for c in capacities] for s in STORAGES}
      for storage, row in rows.items():
        cells = " | ".join(f"{x:,.0f}" for x in row)
        lines.append(f"| {method} | {path} | {storage} | {cells} | {max(row) / min(row):.2f} |")
      ratios = [lean / today for lean, today in zip(rows["lean"], rows["open_addressing"], strict=True)]
      cells = " | ".join(f"{r:.2f}x" for r in ratios)
      lines.append(f"| {method} | {path} | lean / open addressing | {cells} | |")
      worst = max(ratios)
      goals.append((f"{method}, {path}: lean no slower at any capacity", f"{worst:.2f}x", worst <= 1.0))
      if path == "kernels":
        flat = max(rows["lean"]) / min(rows["lean"])
        goal = f"{method}, kernels: lean slowest / fastest <= {FLAT_GOAL}"
        goals.append((goal, f"{flat:.2f}", flat <= FLAT_GOAL))
  met = {True: "yes", False: "**no**"}
  lines += ["", "| goal | measured | met |", "|---|---|---|"]
  lines += [f"| {goal} | {value} | {met[ok]} |" for goal, value, ok in goals]
  lines += [
    "",
    "Each figure: the median over the processes of each one's median of its timed calls after two "
    "untimed ones (`benchmarks.xla_path.table_calls`); each (path, storage) in processes of its own, "
    "the storages alternating which runs first.",
  ]
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--scale", type=float, default=1.0, help="below 1: one small capacity, 3 calls")
  parser.add_argument("--runs", type=int, default=3, help="processes per (path, storage)")
  parser.add_argument("--out", type=Path, default=RESULT, help="the report (at full scale)")
  parser.add_argument("--measure", nargs=4, help=argparse.SUPPRESS)  # path storage scale out: one process
  args = parser.parse_args(argv)
  if args.measure:
    path, storage, scale, out = args.measure
    calls = 20 if float(scale) >= 1 else 3
    Path(out).write_text(json.dumps(measure_once(path, storage, capacities_for(float(scale)), calls)))
    return
  load = os.getloadavg()
  machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
  text = report(measure(args.scale, args.runs), machine)
  text += f"\n\nLoad average before the run: {load[0]:.2f}; after: {os.getloadavg()[0]:.2f}.\n"
  print(text)
  if args.scale >= 1 or args.out != RESULT:
    args.out.write_text(text)


if __name__ == "__main__":
  main()
