"""The benchmark harness runs (without TensorFlow, on tiny sizes), so it cannot rot."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from children import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
from benchmarks import peers, run, workloads

data = workloads.Data(4096, 1)
results = {}
for name in ("jaxres-oa", "dict"):
  peer = peers.make(name, 1)
  results[peer.name] = workloads.measure(peer, data, repeats=1)
  for metric in ("insert", "find", "find_1call", "find_us", "remove", "step_us"):
    assert results[peer.name][metric] > 0, (name, metric, results[peer.name])
  # half of the keys removed, the new ids of the warm-up step and of the timed steps added
  assert peer.size() == 4096 // 2 + (workloads.STEPS + 1) * workloads.STEP_BATCH // 2
OA = "jaxres OpenAddressingTable"
reference = results["Python dict"] | {"bytes/entry": 48.0}  # formatting only
wide = {OA: results[OA], "TF MutableHashTable": reference}
sweep = {1 << 12: {OA: workloads.per_call(peers.make("jaxres-oa", 1), 1 << 12, calls=3)}}
results["TF MutableHashTable"] = results["Python dict"] | {"bytes/entry": 48.0}
results["TF DenseHashTable"] = results["Python dict"] | {"bytes/entry": 55.0}
results["jaxres SortedTable"] = results[OA]
text = run.report(results, wide, sweep, 4096, "smoke")
assert "| find, batches of 65,536 | " in text and "2^12" in text, text
lo, hi = results[OA]["spread"]["step_us"]
assert lo <= results[OA]["step_us"] <= hi, results[OA]
assert {"find_us", "find_again_us", "step_us"} <= set(sweep[1 << 12][OA]), sweep
# three runs: the median of each figure, and the runs' range
slower = {name: {**figures, "find": figures["find"] / 2} for name, figures in results.items()}
combined = run.combine([results, slower, slower])
assert combined[OA]["find"] == slower[OA]["find"], combined[OA]
assert combined[OA]["spread"]["find"] == (slower[OA]["find"], results[OA]["find"]), combined[OA]
print("ok")
"""


def test_benchmark_harness_runs_on_tiny_sizes():
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  result = subprocess.run(
    [sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S
  )
  assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stdout + result.stderr


@pytest.mark.parametrize(
  ("module", "args", "rows"),
  [
    (
      "device",
      ["--scale", str(2**-12), "--calls", "1"],
      [
        "Checked against NumPy on the device: find, insert, find_or_insert, remove, insert_and_evict, "
        "embedding step.",
        "| 4,096 | 0.5 | 8 | ",
        "| 16,384 | 0.9 | 64 | ",
        "## Evicting find_or_insert on a full LRU table",
        "| rows | DynamicEmbedding | 26-feature collection |",
      ],
    ),
    (
      "costs",
      ["--xla", "--scale", "0.01", "--runs", "1"],
      [
        "| find | xla | ",
        "| evicting find_or_insert | kernels | ",
        "| embedding step | xla | ",
        "| XLA path find_or_insert within 4x of the kernels | ",
        "| XLA path embedding step: slowest / fastest capacity <= 1.3 | ",
      ],
    ),
    (
      "memory",
      ["--capacity", "1024", "--features", "4"],
      [
        "| `optax.adam` | int64 | jr.LRU() | ",
        "| `admission_capacity` ids | int32 | ",
        "| open_addressing | int64 | jr.LRU() | 1.000 | ",
        "| lean | int32 | jr.LRU() | ",
      ],
    ),
    (
      "deltas",
      ["--rows", "4096", "--runs", "1", "--shares", "0.01,0.5"],
      ["| 1% (40) | ", "| 50% (2,048) | ", "/ touched rows' bytes (goal <= 1.5)"],
    ),
    (
      "eviction",
      ["--scale", "0.003", "--calls", "3"],
      [
        "LRU hit ratio",
        "LFU: top-1,000 ids kept",
        "8 shards",
        "full LRU table",
        "bytes of scores per slot",
        "HKV customized correct rate",
        "HKV eviction quality at full load",
      ],
    ),
    (
      "models",
      ["--scale", "0.01", "--warmup", "2", "--steps", "2", "--runs", "1", "--systems", "jaxres"],
      ["3 sparse features", "| jr.EmbeddingCollection (LRU", ">= 2x faster per example than TorchRec"],
    ),
    (
      "embedding",
      [
        "--scale",
        "0.01",
        "--steps",
        "2",
        "--runs",
        "1",
        "--peers",
        "jaxres,xla,torch-sparse-adam",
      ],
      [
        "| 2^10 | 2^12 |",
        "| jr.DynamicEmbedding (LRU) | ",
        "| the same step in plain XLA",
        "slowest / fastest capacity <= 1.2",
        "within 2x of the same step in plain XLA",
      ],
    ),
    (
      "startup",
      ["--runs", "1", "--capacity", "256", "--batch", "8", "--formats", "jaxres", "--quick"],
      [
        "| `import jaxres` | ",
        "| jaxres's own share (the difference with the first row, per run) | ",
        "| on, filled (later processes) | ",
        '| `format="jaxres"` | ',
      ],
    ),
    (
      "quality",
      ["--scale", "0.01", "--tasks", "drift", "--peers", "jaxres,dense", "--seeds", "1"],
      [
        "### drift task (synthetic, ids come and go): 0.20 MB",
        "| jr.DynamicEmbedding, defaults (LRFU; jr.CatchUpAdam rows) | ",
        "| nnx.Embed + optax.adam (hashed rows) | ",
        "- test: jaxres (defaults) ",
      ],
    ),
  ],
)
def test_benchmark_runs_on_tiny_sizes(module, args, rows):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  cmd = [sys.executable, "-m", f"benchmarks.{module}", *args, "--out", os.devnull]
  result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
  assert result.returncode == 0, result.stdout + result.stderr
  for row in rows:
    assert row in result.stdout, result.stdout


def test_the_layouts_benchmark_runs_on_tiny_sizes(tmp_path):
  """``benchmarks.layouts`` in this process (its programs are the suite's): each (path, storage) measured
  through the entry point of its child processes, then the report."""
  from benchmarks import layouts

  runs = {}
  for path in layouts.PATHS:
    for storage in layouts.STORAGES:
      out = tmp_path / f"{path}-{storage}.json"
      layouts.main(["--measure", path, storage, "0.01", str(out)])
      runs[path, storage] = [json.loads(out.read_text())]
  for run in runs.values():
    assert all(us > 0 for us in run[0]["times"].values()), run
  index = {s: runs["kernels", s][0]["index bytes a slot"]["1024"] for s in layouts.STORAGES}
  assert index["lean"] < index["open_addressing"], index
  text = layouts.report(runs)
  for row in (
    "| open_addressing | ",
    "| find | kernels | lean | ",
    "| evicting find_or_insert | xla | lean / open addressing | ",
    "| insert, xla: lean no slower at any capacity | ",
    "| find, kernels: lean slowest / fastest <= 1.2 | ",
  ):
    assert row in text, text


def test_the_leaks_benchmark_runs_on_tiny_sizes():
  """``benchmarks.leaks`` in this process, each workload three times, then the report."""
  from benchmarks import leaks

  runs = {workload: leaks.measure(workload, 3) for workload in leaks.WORKLOADS}
  assert [r["iteration"] for r in runs["requests"]] == [1, 2, 3], runs
  assert all(r["rss_mb"] > 0 and r["fds"] > 0 and r["threads"] >= 1 for rs in runs.values() for r in rs), runs
  text = leaks.report(runs)
  for workload in leaks.WORKLOADS:
    assert f"| {workload} | 3 | " in text, text
