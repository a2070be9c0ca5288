"""``python -m benchmarks.serving``: serving latency of the click model, exported against in place.

A ``ClickModel`` (2^16 embedding rows, 4 fields) is trained, then exported
with ``jr.saved_model`` in both formats. Each way of answering a request of
64 examples is then timed in a process of its own (``--runs`` times each):

* **in place, kernels**: the model rebuilt from the export's ``variables/``,
  ``nnx.jit(predict)`` on it in inference mode (through ``nnx.cached_partial``),
  with jaxres's CPU kernels;
* **in place, XLA references**: the same with ``JAXRES_KERNELS=0``;
* **exported**: ``jr.saved_model.load(path).signatures["serving_default"]``;
* **TensorFlow SavedModel**: ``tf.saved_model.load`` of the ``format="tf"``
  export (when TensorFlow is installed).

Each figure is the median over the runs of the median of 200 requests (ids
to answer converted before timing; the answer on the host). Also reported:
bytes per live id of the serving state and of the training checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
REQUEST, REQUESTS = 64, 200
WAYS = {
  "kernels": "in place, jaxres CPU kernels",
  "references": "in place, XLA references (JAXRES_KERNELS=0)",
  "exported": "exported, jr.saved_model.load",
  "tf": "TensorFlow SavedModel (format='tf'), tf.saved_model.load",
}


def build(folder: Path, steps: int) -> dict:
  """Trains the model, exports it both ways, saves the requests; sizes of what was written."""
  from jaxres.examples import ClickStream, Run, RunConfig, export

  config = RunConfig()
  run = Run(config, str(folder / "run"), checkpoint_every=None)
  run.train(steps)
  export(run.model, folder / "export", config.num_fields)
  sizes = {"live ids": run.model.embedding.size()}
  try:
    export(run.model, folder / "tf", config.num_fields, format="tf")
  except ImportError:
    pass
  stream = ClickStream(batch_size=REQUEST, num_fields=config.num_fields, vocab_size=config.vocab_size, seed=3)
  np.save(folder / "requests.npy", np.stack([stream.batch(i).ids for i in range(REQUESTS + 5)]))

  def size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())

  sizes["serving state"] = size(folder / "export" / "state")
  sizes["checkpoint"] = size(folder / "export" / "variables")
  return sizes


def _time(answer, requests) -> float:
  for ids in requests[:5]:
    answer(ids)
  times = []
  for ids in requests[5:]:
    start = time.perf_counter()
    answer(ids)
    times.append(time.perf_counter() - start)
  return statistics.median(times) * 1e6


def measure(way: str, folder: Path) -> float:
  """Microseconds per 64-example request, answered ``way``."""
  requests = np.load(folder / "requests.npy")
  if way == "tf":
    import tensorflow as tf

    signature = tf.saved_model.load(str(folder / "tf")).signatures["serving_default"]
    return _time(lambda ids: signature(ids=ids)["probability"].numpy(), [tf.constant(r) for r in requests])
  import jax

  import jaxres as jr

  if way == "exported":
    signature = jr.saved_model.load(folder / "export").signatures["serving_default"]
    return _time(lambda ids: np.asarray(signature(ids=ids)["probability"]), requests)
  from flax import nnx

  from jaxres.examples import RunConfig, predict

  model = RunConfig().model()
  jr.Checkpoint(model=model).restore(folder / "export" / "variables").assert_consumed()
  model.eval()
  cached = nnx.cached_partial(nnx.jit(predict), model)  # no walk over the model's graph per call
  pairs = [jax.device_put(jr.keys.split64(r)) for r in requests]
  return _time(lambda ids: np.asarray(cached(ids)["probability"]), pairs)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=300, help="training steps before the export")
  parser.add_argument("--runs", type=int, default=3)
  parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "serving.md")
  parser.add_argument("--measure", nargs=2, help=argparse.SUPPRESS)  # way, folder: one process's figure
  args = parser.parse_args(argv)
  if args.measure:
    print(json.dumps(measure(args.measure[0], Path(args.measure[1]))))
    return
  with tempfile.TemporaryDirectory() as folder:
    folder = Path(folder)
    sizes = build(folder, args.steps)
    figures = {}
    for way in WAYS:
      if way == "tf" and not (folder / "tf").exists():
        continue
      env = {
        **os.environ,
        "JAXRES_KERNELS": "0" if way == "references" else os.environ.get("JAXRES_KERNELS", "1"),
      }
      runs = []
      for _ in range(args.runs):
        command = [sys.executable, "-m", "benchmarks.serving", "--measure", way, str(folder)]
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
      figures[way] = runs
  lines = [
    f"## Serving the click model: us per request of {REQUEST} examples (4 int64 ids each)",
    "",
    "| answered by | median (range of runs) |",
    "|---|---|",
  ]
  for way, runs in figures.items():
    lines.append(f"| {WAYS[way]} | {statistics.median(runs):,.0f} ({min(runs):,.0f}-{max(runs):,.0f}) |")
  live = sizes["live ids"]
  lines += [
    "",
    f"Bytes per live id ({live:,} ids hold rows): serving state {sizes['serving state'] / live:,.1f}, "
    f"training checkpoint {sizes['checkpoint'] / live:,.1f}.",
    "",
    f"Medians over {args.runs} runs (separate processes) of the median of {REQUESTS} requests, after 5 "
    f"untimed ones; the answer on the host. Model: jaxres.examples.ClickModel, 2^16 embedding rows, "
    f"trained {args.steps} steps.",
  ]
  text = "\n".join(lines)
  print(text)
  args.out.write_text(text + "\n")


if __name__ == "__main__":
  main()
