"""``python -m benchmarks.models``: a DLRM-shaped model's training step, jaxres against TorchRec and TFRA.

Every system of :mod:`benchmarks.model_peers` trains the same model on the
same batches (26 sparse features with the Criteo display-advertising
challenge's cardinalities, four of them multi-hot and mean-pooled, 13 dense
inputs, two MLPs; batches of 4096) with its embedding tables in the same
bytes: ``jr.EmbeddingCollection`` in the plain NNX step (``jr.value_and_grad``),
TorchRec's sharded ``EmbeddingBagCollection`` with a fused row-wise
optimizer, TF Recommenders-Addons' ``dynamic_embedding``. Each system runs in
a process of its own, ``--runs`` times (each run starting with another
system); every figure is the median of the runs, with their range.

The systems need their own packages, never jaxres's: TorchRec comes with the
``bench-torch`` extra, TF Recommenders-Addons from an environment of its own
(``benchmarks/tfra-requirements.txt``): pass their interpreters as
``--torch-python`` and ``--tfra-python``. A system that cannot run shows why
in the report. Options: ``--scale`` (1.0: the sizes above; smaller for a
quick run of the first three features), ``--warmup``, ``--steps``, ``--runs``,
``--systems``, ``--out``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
from pathlib import Path

from benchmarks.embedding import run_peer

ROOT = Path(__file__).resolve().parents[1]
OURS = "jaxres"
SYSTEMS = {  # name -> (label, environment)
  "jaxres": ("jr.EmbeddingCollection (LRU, row-wise optax.adam), jr.value_and_grad", "jax"),
  "torchrec": ("TorchRec sharded EmbeddingBagCollection, fused row-wise Adagrad (hashed rows)", "torch"),
  "tfra": ("TF Recommenders-Addons dynamic_embedding + Adam", "tfra"),
}
GOAL = 2.0  # jaxres's speed per example over each peer's, at least


def measure(pythons: dict, systems: list[str], args, sizes: list[str]) -> dict:
  """``{system: [figures of each run]}`` (or ``{"error": why}``), systems rotating their order by run."""
  runs = {system: [] for system in systems}
  for r in range(args.runs):
    for system in systems[r % len(systems) :] + systems[: r % len(systems)]:
      command = ("--warmup", args.warmup, "--steps", args.steps, "--seed", 0, *sizes)
      runs[system].append(run_peer(pythons[SYSTEMS[system][1]], "benchmarks.model_peers", system, *command))
  combined = {}
  for system, results in runs.items():
    errors = [r["error"] for r in results if "error" in r]
    if errors:
      combined[system] = {"error": errors[0]}
      continue
    per_example = [r["us_per_example"] for r in results]
    combined[system] = {
      "us_per_example": statistics.median(per_example),
      "spread": (min(per_example), max(per_example)),
      "us_per_step": statistics.median(r["us_per_step"] for r in results),
      "bytes": max(r["bytes"] for r in results),
      "rows": results[0]["rows"],
      "versions": results[0].get("versions", ""),
      "loss": statistics.median(statistics.fmean(r["losses"][-10:]) for r in results),
    }
  return combined


def goals(figures: dict) -> list[tuple[str, str, bool]]:
  """``(goal, measured, met)``: jaxres at least :data:`GOAL` times faster per example than each peer."""
  ours = figures.get(OURS, {})
  rows = []
  for peer in (p for p in SYSTEMS if p != OURS):
    label = f">= {GOAL:g}x faster per example than {SYSTEMS[peer][0].split(',')[0]}"
    theirs = figures.get(peer, {"error": "not run"})
    if "error" in theirs or "error" in ours:
      rows.append((label, f"not measured ({theirs.get('error') or ours.get('error')})", False))
      continue
    ratio = theirs["us_per_example"] / ours["us_per_example"]
    rows.append((label, f"{ratio:.2f}x", ratio >= GOAL))
  return rows


def report(figures: dict, args, batch: int, features: int) -> str:
  lines = [
    f"## A DLRM-shaped training step: {features} sparse features, batches of {batch:,}",
    "",
    f"{_cpu()}, {os.cpu_count()} cores; Python {platform.python_version()}; "
    + "; ".join(f["versions"] for f in figures.values() if f.get("versions")),
    "",
    "| system | embedding rows | embedding MB | us per example (range) | ms per step | examples/s | loss |",
    "|---|---|---|---|---|---|---|",
  ]
  for system, f in figures.items():
    label = SYSTEMS[system][0]
    if "error" in f:
      lines.append(f"| {label} | n/a | n/a | not measured: {f['error']} | | | |")
      continue
    lo, hi = f["spread"]
    lines.append(
      f"| {label} | {f['rows']:,} | {f['bytes'] / 1e6:.1f} | {f['us_per_example']:.1f} ({lo:.1f}-{hi:.1f}) "
      f"| {f['us_per_step'] / 1e3:.1f} | {1e6 / f['us_per_example']:,.0f} | {f['loss']:.4f} |"
    )
  met = {True: "yes", False: "**no**"}
  lines += ["", "| goal | measured | met |", "|---|---|---|"]
  lines += [f"| {goal} | {measured} | {met[ok]} |" for goal, measured, ok in goals(figures)]
  lines += [
    "",
    f"Each figure: the median over {args.runs} runs (separate processes, each starting with another "
    f"system) of the median of {args.steps} timed steps after {args.warmup} warm-up steps; in "
    "parentheses the range of the runs. A step ends when its loss is on the host. The embedding "
    "tables of every system hold the same bytes as TorchRec's hashed tables (at most "
    f"{args.rows:,} rows of 16 floats and their row-wise Adagrad state each; TFRA's start there and "
    "grow); the figure given is what each holds after the run. Loss: the mean of the last 10 steps. "
    "Model and data: `benchmarks/model_peers.py`.",
  ]
  return "\n".join(lines)


def _cpu() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
  except (OSError, StopIteration):
    return platform.processor() or platform.machine()


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--scale", type=float, default=1.0, help="1.0: the sizes of the report")
  parser.add_argument("--warmup", type=int, default=20)
  parser.add_argument("--steps", type=int, default=30, help="timed steps per run")
  parser.add_argument("--runs", type=int, default=3, help="runs, each system in its own process")
  parser.add_argument(
    "--systems", default=",".join(SYSTEMS), help="comma-separated, of: " + ", ".join(SYSTEMS)
  )
  parser.add_argument("--tfra-python", default=os.environ.get("JAXRES_BENCH_TFRA_PYTHON", sys.executable))
  parser.add_argument("--torch-python", default=os.environ.get("JAXRES_BENCH_TORCH_PYTHON", sys.executable))
  parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "models.md")
  args = parser.parse_args(argv)
  systems = [s.strip() for s in args.systems.split(",") if s.strip()]
  if sorted(set(systems) - set(SYSTEMS)) or OURS not in systems:
    parser.error(f"--systems: expected jaxres and any of {sorted(SYSTEMS)}, got {systems}")
  full = args.scale >= 1
  batch = 4096 if full else max(16, int(4096 * args.scale))
  args.rows = 1 << 17 if full else max(64, int((1 << 17) * args.scale))
  features = 26 if full else 3  # a quick run checks the harness: the first three (one multi-hot)
  pythons = {"jax": sys.executable, "torch": args.torch_python, "tfra": args.tfra_python}
  figures = measure(pythons, systems, args, ["--batch", batch, "--rows", args.rows, "--features", features])
  text = report(figures, args, batch, features)
  print(text)
  if full:
    args.out.write_text(text + "\n")


if __name__ == "__main__":
  main()
