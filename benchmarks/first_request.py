"""``python -m benchmarks.first_request``: load time and the first request of each batch size, served.

The click model of ``benchmarks.serving`` is exported in both formats, with
and without batch-size padding. Each way is then served in fresh processes
(``--runs`` each): the time ``load`` takes (after the imports), then the
first request of each of the sizes 5, 7, 64 and 1000, in that order (the
answer on the host). Unpadded, every new size compiles a program; padded
(``jr.saved_model.load``'s default batch sizes 1, 4, 16, 64, 256, 1024),
the programs are compiled at load. A TensorFlow SavedModel compiles each
batch size on its first request; "warmed up" calls each once after loading.
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
SIZES = (5, 7, 64, 1000)
WAYS = {
  "unpadded": "jr.saved_model.load(path) (the default: each request at its own size)",
  "padded": "jr.saved_model.load(path, batch_sizes=BATCH_SIZES) (compiled at load)",
  "tf-unpadded": 'TensorFlow SavedModel, save(..., format="tf") (the default: unpadded)',
  "tf": 'TensorFlow SavedModel, save(..., format="tf", batch_sizes=BATCH_SIZES)',
  "tf-warm": "TensorFlow SavedModel, padded, warmed up with one request per batch size",
}


def build(folder: Path, steps: int) -> None:
  """Trains the click model and exports it three ways; saves 1000 requests' ids."""
  from jaxres.examples import ClickStream, Run, RunConfig, export
  from jaxres.saved_model import BATCH_SIZES

  config = RunConfig()
  run = Run(config, str(folder / "run"), checkpoint_every=None)
  run.train(steps)
  export(run.model, folder / "export", config.num_fields)
  export(run.model, folder / "tf", config.num_fields, format="tf", batch_sizes=BATCH_SIZES)
  export(run.model, folder / "tf-unpadded", config.num_fields, format="tf")
  stream = ClickStream(batch_size=max(SIZES), num_fields=config.num_fields, vocab_size=config.vocab_size)
  np.save(folder / "requests.npy", stream.batch(0).ids)


def measure(way: str, folder: Path) -> dict:
  """Seconds: ``load``, then the first request of each size."""
  ids = np.load(folder / "requests.npy")
  if way.startswith("tf"):
    import tensorflow as tf

    start = time.perf_counter()
    signature = tf.saved_model.load(str(folder / ("tf-unpadded" if way == "tf-unpadded" else "tf")))
    signature = signature.signatures["serving_default"]
    if way == "tf-warm":
      from jaxres.saved_model import BATCH_SIZES

      for size in BATCH_SIZES:
        signature(ids=tf.zeros((size, ids.shape[1]), tf.int64))
    answer = lambda x: signature(ids=tf.constant(x))["probability"].numpy()
  else:
    import jaxres as jr
    from jaxres.saved_model import BATCH_SIZES

    start = time.perf_counter()
    options = {} if way == "unpadded" else {"batch_sizes": BATCH_SIZES}
    signature = jr.saved_model.load(folder / "export", **options).signatures["serving_default"]
    answer = lambda x: np.asarray(signature(ids=x)["probability"])
  figures = {"load": time.perf_counter() - start}
  for size in SIZES:
    start = time.perf_counter()
    answer(ids[:size])
    figures[str(size)] = time.perf_counter() - start
  return figures


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=50, help="training steps before the export")
  parser.add_argument("--runs", type=int, default=3)
  parser.add_argument("--ways", default=",".join(WAYS))
  parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "first_request.md")
  parser.add_argument("--measure", nargs=2, help=argparse.SUPPRESS)  # way, folder: one process's figures
  args = parser.parse_args(argv)
  if args.measure:
    print(json.dumps(measure(args.measure[0], Path(args.measure[1]))))
    return
  lines = [
    "## Served click model: load, then the first request of each size (seconds)",
    "",
    "| served by | load | " + " | ".join(f"first {n}" for n in SIZES) + " |",
    "|---|---|" + "---|" * len(SIZES),
  ]
  with tempfile.TemporaryDirectory() as folder:
    folder = Path(folder)
    build(folder, args.steps)
    for way in args.ways.split(","):
      runs = []
      for _ in range(args.runs):
        command = [sys.executable, "-m", "benchmarks.first_request", "--measure", way, str(folder)]
        done = subprocess.run(command, cwd=ROOT, env=os.environ, capture_output=True, text=True, check=True)
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
      cells = [statistics.median(r[k] for r in runs) for k in ["load", *map(str, SIZES)]]
      lines.append(f"| {WAYS[way]} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
  lines += [
    "",
    f"Medians of {args.runs} processes each (imports not timed). Model: jaxres.examples.ClickModel, "
    f"2^16 embedding rows, trained {args.steps} steps; requests of 4 int64 ids per example.",
  ]
  text = "\n".join(lines)
  print(text)
  args.out.write_text(text + "\n")


if __name__ == "__main__":
  main()
