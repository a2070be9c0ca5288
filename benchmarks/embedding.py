"""``python -m benchmarks.embedding``: the dynamic-embedding training step against its peers, same run.

* **The step against capacity**: one training step of 4096 ids (Zipf(1.05)
  over 10^6 int64 ids), 32 features, Adam, a linear head, at capacities 2^16
  to 2^22, after 80 warm-up steps (a 2^16 table is then full and evicting),
  for every peer of :mod:`benchmarks.step_peers`: ``jr.DynamicEmbedding``,
  the same step written directly in XLA (the floor), a dense ``nnx.Embed``,
  TF Recommenders-Addons (with and without its restrict policy), PyTorch
  ``SparseAdam`` and TorchRec (sharded with a fused optimizer, and managed
  collisions). Each peer runs in a process of its own, ``--runs`` times (each
  run starting with another peer); every figure is the median of the runs,
  with their range.
Model quality at equal memory is :mod:`benchmarks.quality`'s.

The peers need their own packages, never jaxres's: PyTorch and TorchRec come
with the ``bench-torch`` extra (``pip install -e '.[bench,bench-torch]'``);
TF Recommenders-Addons pins TensorFlow 2.16 and NumPy < 2, so it runs from an
environment of its own (``benchmarks/tfra-requirements.txt``, passed as
``--tfra-python``). ``--torch-python`` runs the PyTorch peers from another
environment the same way. A peer that cannot run shows why in the report. Options: ``--scale`` (1.0: the
sizes above; smaller for a quick run), ``--steps`` (timed steps per run),
``--runs``, ``--peers``, ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks import run as tables_run
from benchmarks.eviction import zipf_stream

ROOT = Path(__file__).resolve().parents[1]
IDS = 4096
WARMUP = 80
OURS = "jaxres"
PEERS = {  # name -> (label, environment)
  "jaxres": ("jr.DynamicEmbedding (LRU)", "jax"),
  "xla": ("the same step in plain XLA (hashed rows, lazy Adam)", "jax"),
  "dense": ("nnx.Embed + optax.adam (hashed rows)", "jax"),
  "tfra": ("TFRA dynamic_embedding", "tfra"),
  "tfra-restrict": ("TFRA dynamic_embedding + TimestampRestrictPolicy", "tfra"),
  "torch-sparse-adam": ("PyTorch nn.Embedding(sparse) + SparseAdam (hashed rows)", "torch"),
  "torchrec-sharded": ("TorchRec sharded EmbeddingCollection, fused row-wise Adagrad (hashed rows)", "torch"),
  "torchrec-managed": ("TorchRec managed-collision EmbeddingCollection + Adam", "torch"),
}


def run_peer(python: str, module: str, *args) -> dict:
  """``python -m module *args`` in a process of its own: the JSON of its last line, or ``{"error": why}``."""
  command = [python, "-m", module, *map(str, args)]
  env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
  done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
  lines = done.stdout.strip().splitlines()
  if done.returncode or not lines:
    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": f"exit {done.returncode}: {last[:200]}"}
  return json.loads(lines[-1])


def measure(peer: str, python: str, stream: Path, capacities: list[int], warmup: int, steps: int) -> dict:
  """One process of :mod:`benchmarks.step_peers`: ``{capacity: us}`` or ``{"error": why}``."""
  capacities = ",".join(map(str, capacities))
  args = (peer, "--stream", stream, "--capacities", capacities, "--warmup", warmup, "--steps", steps)
  figures = run_peer(python, "benchmarks.step_peers", *args)
  return {int(k) if k.isdigit() else k: v for k, v in figures.items()}


def step_times(
  pythons: dict,
  peers: list[str],
  capacities: list[int],
  steps: int,
  runs: int,
  warmup: int = WARMUP,
  one_process: bool = False,
) -> dict:
  """``{peer: {capacity: us, "spread": {capacity: (lo, hi)}}}`` (or ``{"error": ...}``) over ``runs`` runs.

  Each peer measures each capacity in a process of its own, so that no table
  of one capacity shares a process (its memory, its caches, a framework's
  global state) with another; with ``one_process`` (a check of the harness),
  all of them in one.
  """
  groups = [capacities] if one_process else [[c] for c in capacities]
  accesses = (warmup + steps) * IDS
  ids = zipf_stream(np.random.default_rng(0), accesses, 1_000_000, a=1.05).reshape(-1, IDS)
  results = [{} for _ in range(runs)]
  with tempfile.TemporaryDirectory() as folder:
    stream = Path(folder) / "ids.npy"
    np.save(stream, ids)
    for r in range(runs):
      for peer in peers[r % len(peers) :] + peers[: r % len(peers)]:
        figures = {}
        for group in groups:
          figures.update(measure(peer, pythons[PEERS[peer][1]], stream, group, warmup, steps))
          if "error" in figures:
            break
        results[r][peer] = figures
  combined = {}
  for peer in peers:
    errors = [run[peer]["error"] for run in results if "error" in run[peer]]
    if errors:
      combined[peer] = {"error": errors[0]}
    else:
      combined[peer] = tables_run.combine([{peer: run[peer]} for run in results])[peer]
  return combined


def _us(figures: dict, capacity: int) -> str:
  value, (lo, hi) = figures[capacity], figures["spread"][capacity]
  return f"{value:,.0f} ({lo:,.0f}-{hi:,.0f})"


def _flatness(figures: dict, capacities: list[int]) -> float:
  return max(figures[c] for c in capacities) / min(figures[c] for c in capacities)


def goals(times: dict, capacities: list[int]) -> list[tuple[str, str, bool]]:
  """``(goal, measured, met)`` for each goal the step has against its peers."""
  ours = times[OURS]
  rows = []

  def against(peer: str, label: str, factor: float):
    theirs = times.get(peer, {})
    if "error" in theirs or not theirs:
      rows.append((label, f"not measured ({theirs.get('error', 'not run')})", False))
      return
    ratios = [theirs[c] / ours[c] for c in capacities]
    measured = ", ".join(f"{r:.2f}x" for r in ratios)
    rows.append((label, measured, min(ratios) >= factor))

  tfra = [p for p in ("tfra", "tfra-restrict") if "error" not in times.get(p, {"error": ""})]
  if tfra:  # the faster TFRA configuration at each capacity
    times["tfra-best"] = {c: min(times[p][c] for p in tfra) for c in capacities}
  else:
    times["tfra-best"] = {"error": times.get("tfra", {}).get("error", "not run")}
  against("tfra-best", ">= 2x faster than TFRA (its faster configuration) at every capacity", 2.0)
  against("torch-sparse-adam", "faster than PyTorch SparseAdam at every capacity", 1.0)
  flat = _flatness(ours, capacities)
  rows.append(("slowest / fastest capacity <= 1.2", f"{flat:.2f}", flat <= 1.2))
  if "error" not in times.get("xla", {"error": ""}):
    worst = max(ours[c] / times["xla"][c] for c in capacities)
    rows.append(("within 2x of the same step in plain XLA", f"{worst:.2f}x at worst", worst <= 2.0))
  times.pop("tfra-best")
  return rows


def report(times: dict, capacities: list[int], steps: int, runs: int, warmup: int = WARMUP) -> str:
  columns = [f"2^{c.bit_length() - 1}" for c in capacities]
  lines = [
    f"## Training steps of {IDS} ids x 32 features, Adam: us per step",
    "",
    "| peer | " + " | ".join(columns) + " |",
    "|---|" + "---|" * len(columns),
  ]
  for peer, figures in times.items():
    label = PEERS[peer][0]
    if "error" in figures:
      lines.append(f"| {label} | " + " | ".join(["n/a"] * len(columns)) + " |")
    else:
      lines.append(f"| {label} | " + " | ".join(_us(figures, c) for c in capacities) + " |")
  met = {True: "yes", False: "**no**"}
  lines += ["", "| goal | measured | met |", "|---|---|---|"]
  lines += [f"| {goal} | {measured} | {met[ok]} |" for goal, measured, ok in goals(times, capacities)]
  errors = [f"{PEERS[p][0]}: {f['error']}" for p, f in times.items() if "error" in f]
  lines += [
    "",
    f"Each figure: the median over {runs} runs (separate processes, each starting with another peer) of "
    f"the median of {steps} timed steps after {warmup} warm-up steps; in parentheses the range of the "
    "runs. Zipf(1.05) ids over 10^6 distinct int64 ids, a linear head, squared error; a step ends when "
    "its loss is on the host. Hashed rows: ids taken modulo the capacity (collisions share a row).",
  ]
  if errors:
    lines += ["", "Not measured: " + "; ".join(errors) + "."]
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--scale", type=float, default=1.0, help="1.0: the sizes of the report")
  parser.add_argument("--steps", type=int, default=100, help="timed steps per run")
  parser.add_argument("--runs", type=int, default=3, help="runs, each peer in its own process")
  parser.add_argument("--peers", default=",".join(PEERS), help="comma-separated, of: " + ", ".join(PEERS))
  parser.add_argument("--tfra-python", default=os.environ.get("JAXRES_BENCH_TFRA_PYTHON", sys.executable))
  parser.add_argument("--torch-python", default=os.environ.get("JAXRES_BENCH_TORCH_PYTHON", sys.executable))
  parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "embedding.md")
  args = parser.parse_args(argv)
  full = args.scale >= 1
  capacities = [1 << k for k in (16, 18, 20, 22)] if full else [1 << 10, 1 << 12]
  peers = [p.strip() for p in args.peers.split(",") if p.strip()]
  unknown = sorted(set(peers) - set(PEERS))
  if unknown or OURS not in peers:
    parser.error(f"--peers: expected jaxres and any of {sorted(PEERS)}, got {peers}")
  pythons = {"jax": sys.executable, "tfra": args.tfra_python, "torch": args.torch_python}
  warmup = WARMUP if full else 4  # below full scale a check of the harness: its table is full after one step
  times = step_times(pythons, peers, capacities, args.steps, args.runs, warmup, one_process=not full)
  text = report(times, capacities, args.steps, args.runs, warmup)
  print(text)
  if full:
    args.out.write_text(text + "\n")


if __name__ == "__main__":
  main()
