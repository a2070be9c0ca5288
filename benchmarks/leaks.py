"""``python -m benchmarks.leaks``: what a long-running process keeps of repeated saves, restores and requests.

Three workloads, each in a process of its own, ``--n`` times (1,000 by default):

* ``checkpoint``: a ``jr.Checkpoint`` of a ``jr.MutableHashTable`` (100 entries)
  and a scalar saved to a new directory, restored into fresh objects, the
  directory removed (an evaluator reading every checkpoint a trainer writes);
* ``manager``: a ``jr.CheckpointManager`` (``max_to_keep=3``) saving step ``i``
  and restoring it (pruning as it goes);
* ``requests``: an export of the table's lookup with a named batch dimension,
  loaded with the defaults and called with every batch size from 1 to ``n``
  (each size compiles a program; the loaded model keeps the 32 last used).

Every ``n // 20`` iterations, after a garbage collection: the resident memory,
open files, threads and Python objects the collector tracks. The goal (issue
56): none grows without bound. The report gives each at the first reading and
at the last, and the growth per iteration over the second half of the run.

What ``requests`` keeps per new size (about 13 KB and 40 objects) is held by
JAX's own caches of what it traced and lowered per argument shape
(``jax._src.pjit`` and ``jax._src.util.cache``), each bounded at 4,096 entries;
``jr.saved_model.load(path, batch_sizes=...)`` pads requests to a few sizes
and keeps it flat.

Examples:
  ``python -m benchmarks.leaks`` (about 8 minutes on a 2-core machine; writes
  ``benchmarks/results/leaks.md``); ``--n 20`` checks the harness.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = ("checkpoint", "manager", "requests")


def _reading(iteration: int) -> dict:
  gc.collect()
  with open("/proc/self/status") as f:
    status = dict(line.split(":", 1) for line in f)
  return {
    "iteration": iteration,
    "rss_mb": int(status["VmRSS"].split()[0]) / 1024,
    "fds": len(os.listdir("/proc/self/fd")),
    "threads": int(status["Threads"]),  # the native ones too (XLA's, TensorStore's)
    "objects": len(gc.get_objects()),
  }


def _table():
  import numpy as np

  import jaxres as jr

  root = jr.AutoTrackable()
  root.table = jr.MutableHashTable(np.int32, np.float32, default_value=-1.0)
  root.table.insert(np.arange(100, dtype=np.int32), np.arange(100, dtype=np.float32))
  return root


def measure(workload: str, n: int) -> list[dict]:
  """The readings of ``workload`` run ``n`` times in this process (see the module's description)."""
  import numpy as np

  import jaxres as jr

  if workload not in WORKLOADS:
    raise ValueError(f"workload: one of {WORKLOADS}, not {workload!r}")
  every = max(1, n // 20)
  folder = tempfile.mkdtemp(prefix="jaxres-leaks-")
  root = _table()
  root.step = np.int64(7)
  checkpoint = jr.Checkpoint(model=root)
  if workload == "manager":
    manager = jr.CheckpointManager(os.path.join(folder, "run"), checkpoint, max_to_keep=3)

    def once(i):
      manager.save(i)
      manager.restore(i)

  elif workload == "checkpoint":

    def once(i):
      path = checkpoint.save(os.path.join(folder, f"ckpt-{i}"))
      fresh = jr.AutoTrackable()
      fresh.table = jr.MutableHashTable(np.int32, np.float32, default_value=-1.0)
      fresh.step = np.int64(0)
      jr.Checkpoint(model=fresh).restore(path).assert_consumed()
      shutil.rmtree(path)

  else:  # requests
    import jax

    batch = jax.ShapeDtypeStruct(("batch",), np.int32)
    lookup = jr.saved_model.Signature(lambda r, ids: r.table.find(ids), ids=batch)
    jr.saved_model.save(root, os.path.join(folder, "export"), {"score": lookup})
    score = jr.saved_model.load(os.path.join(folder, "export")).signatures["score"]

    def once(i):
      out = np.asarray(score(ids=np.arange(i, dtype=np.int32) % 150)["output"])
      assert out.shape == (i,) and out[min(i, 100) - 1] == min(i, 100) - 1, out

  readings = []
  try:
    for i in range(1, n + 1):
      once(i)
      if i % every == 0:
        readings.append(_reading(i))
  finally:
    if workload == "manager":
      manager.close()
    shutil.rmtree(folder, ignore_errors=True)
  return readings


def _run_in_process(workload: str, n: int) -> list[dict]:
  command = [sys.executable, "-m", "benchmarks.leaks", "--measure", workload, str(n)]
  out = subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True).stdout
  return json.loads(out.strip().splitlines()[-1])


def report(runs: dict) -> str:
  """The markdown report of ``{workload: readings}``."""
  lines = [
    "## What a process keeps of repeated saves, restores and requests",
    "",
    "| workload | iterations | RSS MB, first reading -> last | KB a iteration, second half "
    "| Python objects: first -> last | open files | threads |",
    "|---|---|---|---|---|---|---|",
  ]
  for workload, readings in runs.items():
    first, middle, last = readings[0], readings[len(readings) // 2], readings[-1]
    span = max(1, last["iteration"] - middle["iteration"])
    per = (last["rss_mb"] - middle["rss_mb"]) * 1024 / span
    lines.append(
      f"| {workload} | {last['iteration']:,} | {first['rss_mb']:.1f} -> {last['rss_mb']:.1f} | {per:.1f} "
      f"| {first['objects']:,} -> {last['objects']:,} | {first['fds']} -> {last['fds']} "
      f"| {first['threads']} -> {last['threads']} |"
    )
  return "\n".join(lines) + "\n"


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--n", type=int, default=1000, help="iterations of each workload")
  parser.add_argument("--workloads", default=",".join(WORKLOADS))
  parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "leaks.md")
  parser.add_argument("--measure", nargs=2, help=argparse.SUPPRESS)  # workload, n
  args = parser.parse_args(argv)
  if args.measure:
    print(json.dumps(measure(args.measure[0], int(args.measure[1]))))
    return
  import platform

  import jax

  runs = {w: _run_in_process(w, args.n) for w in args.workloads.split(",")}
  machine = f"{platform.machine()}, {os.cpu_count()} cores; Python {platform.python_version()}"
  machine += f", JAX {jax.__version__}"
  text = report(runs) + f"\nMachine: {machine}; load average after: {os.getloadavg()[0]:.2f}.\n"
  print(text)
  args.out.write_text(text)


if __name__ == "__main__":
  main()
