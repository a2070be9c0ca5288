"""``python -m benchmarks``: jaxres against tf.lookup and a dict, side by side.

Runs every workload of :mod:`benchmarks.workloads` on every peer of
:mod:`benchmarks.peers`, on the same data, with ``jax_enable_x64`` on (int64
keys as JAX sees them natively), in ``--runs`` separate processes (3 by
default; each process measures every peer, starting with a different one).
Every figure is the median of the runs, with their range. Prints a markdown
report (throughputs, ratios to TF ``MutableHashTable`` against the targets,
per-call cost against capacity), saves it with the machine's description
under ``benchmarks/results/`` and plots throughput against capacity. Needs the
``bench`` extra (``pip install -e '.[bench]'``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np

jax.config.update("jax_enable_x64", True)

from benchmarks import peers, workloads  # noqa: E402  (after the x64 switch)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
REFERENCE = "TF MutableHashTable"
DENSE = "TF DenseHashTable"
OURS = "jaxres OpenAddressingTable"
MAIN_PEERS = ["jaxres-oa", "jaxres-sorted", "tf-mutable", "tf-dense", "tf-static", "dict"]
WIDE_PEERS = ["jaxres-oa", "jaxres-sorted", "tf-mutable", "tf-dense"]
SWEEP_PEERS = ["jaxres-oa", "tf-mutable", "tf-dense"]
# (label, peer, metric, reference peer, goal as a ratio to the reference); "@64": the 64-wide rows
TARGETS = [
  ("4096-key find per call", OURS, "find_us", REFERENCE, 2.0),
  ("4096-key insert+find step", OURS, "step_us", REFERENCE, 2.0),
  ("4096-key step against DenseHashTable", OURS, "step_us", DENSE, 1.0),
  ("find, batches of 65,536", OURS, "find", REFERENCE, 3.0),
  ("find, one call of all keys", OURS, "find_1call", REFERENCE, 3.0),
  ("insert", OURS, "insert", REFERENCE, 3.0),
  ("remove", OURS, "remove", REFERENCE, 3.0),
  ("64-wide find", OURS, "find@64", REFERENCE, 5.0),
  ("64-wide insert", OURS, "insert@64", REFERENCE, 3.0),
  ("64-wide bytes per entry", OURS, "bytes/entry@64", REFERENCE, 1.0),
  ("SortedTable find", "jaxres SortedTable", "find", REFERENCE, 1.0),
]
LOWER_IS_BETTER = {"step_us", "find_us", "bytes/entry"}
MICROSECONDS = {"step_us", "find_us"}


def machine() -> str:
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
  except (OSError, StopIteration):
    pass
  try:
    import tensorflow as tf

    peers_version = f"TensorFlow {tf.__version__}"
  except ImportError:
    peers_version = "no TensorFlow"
  return (
    f"{cpu}, {os.cpu_count()} cores; Python {platform.python_version()}, JAX {jax.__version__} "
    f"({jax.devices()[0].platform}, x64 on), {peers_version}"
  )


def _table(rows: list[list[str]]) -> str:
  lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
  return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows[1:]])


def _fmt(metric: str, value) -> str:
  if value is None:
    return "n/a"
  if metric in MICROSECONDS or metric == "bytes/entry":
    return f"{value:,.1f}"
  return f"{value / 1e6:,.2f}"


def _with_spread(metric: str, result: dict) -> str:
  """The median, and the range of the runs where there were several."""
  value, spread = result.get(metric), result.get("spread", {}).get(metric)
  if value is None or spread is None or spread[0] == spread[1]:
    return _fmt(metric, value)
  return f"{_fmt(metric, value)} ({_fmt(metric, spread[0])} to {_fmt(metric, spread[1])})"


def _metrics(name: str, results: dict, wide: dict) -> dict:
  """A peer's metrics, the 64-wide ones suffixed with "@64"."""
  return {**results.get(name, {}), **{f"{k}@64": v for k, v in wide.get(name, {}).items()}}


def _method(n: int, runs: int) -> str:
  """How the figures of the report were measured."""
  return " ".join(
    [
      f"Medians of {runs} runs (separate processes, each the median of {workloads.RUNS} timed repeats),",
      "with the range of the runs; throughputs in million keys per second.",
      f"The step inserts then finds 4096 keys (half known, half new) on a table holding {n:,} keys;",
      "the 4096-key find looks up 4096 queries (half hits) per call.",
      "Bytes per entry: jaxres counts the arrays of a table created with capacity for exactly its",
      "entries (the timed tables have room for the step's new keys too); TF and dict count the growth",
      "of the process's resident memory.",
    ]
  )


def report(results: dict, wide: dict, sweep: dict, n: int, title: str, runs: int = 1) -> str:
  columns = [("insert", "insert M/s"), ("find", "find M/s"), ("find_1call", "find, one call M/s")]
  columns += [("remove", "remove M/s"), ("find_us", "4096-key find µs"), ("step_us", "4096-key step µs")]
  columns += [("bytes/entry", "bytes/entry")]
  main = [["table", *(label for _, label in columns)]]
  main += [[name, *(_with_spread(m, r) for m, _ in columns)] for name, r in results.items()]
  wide_columns = ("insert", "find", "bytes/entry")
  wide_rows = [["table", "insert M/s", "find M/s", "bytes/entry"]]
  wide_rows += [[name, *(_with_spread(m, r) for m in wide_columns)] for name, r in wide.items()]

  target_rows = [["target", "jaxres", "peer", "ratio", "goal", "met"]]
  for label, name, metric, peer, goal in TARGETS:
    ours, theirs = _metrics(name, results, wide)[metric], _metrics(peer, results, wide)[metric]
    plain = metric.split("@")[0]
    ratio = theirs / ours if plain in LOWER_IS_BETTER else ours / theirs
    verdict = "yes" if ratio >= goal else "**no**"
    row = [
      label,
      _fmt(plain, ours),
      f"{_fmt(plain, theirs)} ({peer[3:]})",
      f"{ratio:.2f}x",
      f">= {goal:g}x",
      verdict,
    ]
    target_rows.append(row)

  names = list(next(iter(sweep.values())))
  kinds = {"find_us": "find", "find_again_us": "find, one batch again", "step_us": "step"}
  sweep_rows = [["capacity", *(f"{name} {kind} µs" for name in names for kind in kinds.values())]]
  for capacity, by_peer in sweep.items():
    sweep_rows.append(
      [
        f"2^{capacity.bit_length() - 1}",
        *(_fmt("step_us", by_peer[p].get(metric)) for p in names for metric in kinds),
      ]
    )
  return "\n\n".join(
    [
      f"# {title}",
      f"Machine: {machine()}.",
      f"## {n:,} int64 keys → float32, batches of {workloads.BATCH:,}",
      _method(n, runs),
      _table(main),
      f"## {n:,} int64 keys → float32[64]",
      _table(wide_rows),
      "## Targets: ratios of the medians to TF's",
      _table(target_rows),
      "## Per-call cost against capacity (4096-key batch, table half full)",
      "Each call takes a new batch of known keys, except in the columns 'one batch again', where one "
      "batch is found over and over with its memory in cache: the work of a call without its cache misses.",
      _table(sweep_rows),
    ]
  )


def plot(sweep: dict, path: Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
  capacities = list(sweep)
  for ax, what in zip(axes, ("find_us", "step_us")):
    for name in next(iter(sweep.values())):
      ys = [workloads.STEP_BATCH / sweep[c][name][what] for c in capacities if what in sweep[c][name]]
      if ys:
        ax.plot(capacities[: len(ys)], ys, marker="o", label=name)
    ax.set(xscale="log", xlabel="capacity", title={"find_us": "find", "step_us": "insert + find step"}[what])
    ax.set_xscale("log", base=2)
    ax.grid(True, alpha=0.3)
  axes[0].set_ylabel("M keys/s (4096-key batches)")
  axes[0].legend()
  axes[1].set_ylim(bottom=0)
  axes[0].set_ylim(bottom=0)
  fig.suptitle(
    "Per-call throughput against capacity, 4096-key batches (the fall is cache misses, not more work)"
  )
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def measure_once(keys: int, max_capacity_log2: int, first: int = 0) -> dict:
  """One run in this process: every peer's figures, the peers taken from the ``first``-th on (in turn)."""
  turn = lambda names: names[first % len(names) :] + names[: first % len(names)]
  results = {}
  for name in turn(MAIN_PEERS):
    peer = peers.make(name, width=1)
    results[peer.name] = workloads.measure(peer, workloads.Data(keys, 1))
    if results[peer.name]["bytes/entry"] is None:
      results[peer.name]["bytes/entry"] = workloads.resident_bytes_per_entry(name, keys, 1)
    print(f"measured {peer.name}: {results[peer.name]}", flush=True)
  wide_data = workloads.Data(keys, 64)
  wide = {}
  for name in turn(WIDE_PEERS):
    peer = peers.make(name, width=64)
    wide[peer.name] = workloads.measure(peer, wide_data)
    if wide[peer.name]["bytes/entry"] is None:
      wide[peer.name]["bytes/entry"] = workloads.resident_bytes_per_entry(name, keys, 64)
    print(f"measured {peer.name} (64-wide): {wide[peer.name]}", flush=True)
  del wide_data
  sweep = {}
  for log2 in range(16, max_capacity_log2 + 1, 2):
    capacity = 1 << log2
    sweep[capacity] = {}
    for name in turn(SWEEP_PEERS):
      peer = peers.make(name, width=1)
      sweep[capacity][peer.name] = workloads.per_call(peer, capacity)
    print(f"capacity 2^{log2}: {sweep[capacity]}", flush=True)
  return {"results": results, "wide": wide, "sweep": sweep}


def combine(runs: list[dict]) -> dict:
  """Per peer and metric, the median of the runs' figures, with their range as its spread.

  ``runs``: figures by peer (``{peer: {metric: value}}``), one per run; peers
  come in the order of the first run.

  Example:
    >>> combine([{"a": {"find": 1.0}}, {"a": {"find": 3.0}}, {"a": {"find": 2.0}}])
    {'a': {'find': 2.0, 'spread': {'find': (1.0, 3.0)}}}
  """
  combined = {}
  for name, figures in runs[0].items():
    metrics = {}
    for metric in figures:
      if metric == "spread":
        continue
      values = [run[name][metric] for run in runs if run[name].get(metric) is not None]
      metrics[metric] = float(np.median(values)) if values else None
      if values:
        metrics.setdefault("spread", {})[metric] = (min(values), max(values))
    combined[name] = metrics
  return combined


def _run_in_process(keys: int, max_capacity_log2: int, first: int) -> dict:
  """:func:`measure_once` in a fresh Python process (``python -m benchmarks --once-to``)."""
  with tempfile.TemporaryDirectory() as folder:
    out = Path(folder) / "run.json"
    command = [sys.executable, "-m", "benchmarks", "--keys", str(keys)]
    command += ["--max-capacity-log2", str(max_capacity_log2), "--first", str(first), "--once-to", str(out)]
    subprocess.run(command, cwd=ROOT, check=True)
    figures = json.loads(out.read_text())
  figures["sweep"] = {int(c): by_peer for c, by_peer in figures["sweep"].items()}
  return figures


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--keys", type=int, default=1 << 20, help="entries (default 1M)")
  parser.add_argument(
    "--max-capacity-log2", type=int, default=24, help="largest capacity of the sweep (2^24)"
  )
  parser.add_argument("--runs", type=int, default=3, help="runs, each a separate process (default 3)")
  parser.add_argument("--out", type=Path, default=RESULTS, help="where the report and plot go")
  parser.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)  # a run's first peer
  parser.add_argument("--once-to", type=Path, help=argparse.SUPPRESS)  # one run here, its figures to a file
  args = parser.parse_args(argv)
  if args.once_to is not None:
    args.once_to.write_text(json.dumps(measure_once(args.keys, args.max_capacity_log2, args.first)))
    return

  runs = [_run_in_process(args.keys, args.max_capacity_log2, first) for first in range(args.runs)]
  results, wide = (combine([run[part] for run in runs]) for part in ("results", "wide"))
  sweep = {c: combine([run["sweep"][c] for run in runs]) for c in runs[0]["sweep"]}
  today = datetime.date.today().isoformat()
  text = report(results, wide, sweep, args.keys, f"jaxres benchmarks, {today}", runs=args.runs)
  args.out.mkdir(parents=True, exist_ok=True)
  for name in ("latest.md", f"{today}-{platform.node() or 'machine'}.md"):
    (args.out / name).write_text(text + "\n")
  plot(sweep, args.out / "capacity.png")
  print(text)
  print(f"\nsaved {args.out / 'latest.md'} and {args.out / 'capacity.png'}")
