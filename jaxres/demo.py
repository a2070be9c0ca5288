"""The jaxres demo: a click-through model with a dynamic embedding table, end to end.

Run ``python -m jaxres.demo``. On built-in synthetic data (Zipf-distributed
64-bit ids, clicks from a hidden rule), it trains
:class:`jaxres.examples.ClickModel` with Adam inside ``nnx.jit``: every new id
gets an embedding row from a ``jr.MutableHashTable`` on the fly. It checkpoints
with ``jr.CheckpointManager`` as it goes, prints a summary, then restarts from
the next-to-last checkpoint into a freshly built model (deferred restore) and
checks that the resumed losses are bitwise those of the uninterrupted run.
Exit status 1 if they are not.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
import time

import jax
import numpy as np

from jaxres.examples import Run, RunConfig


class ProgressBar:
  """A one-line progress bar on a terminal; a line per tenth of the work elsewhere."""

  def __init__(self, label: str, first: int, last: int, stream=sys.stderr, width: int = 30):
    self.label, self.first, self.last, self.stream, self.width = label, first, last, stream, width
    self.start = time.perf_counter()
    self.tty = stream.isatty()
    total = last - first
    self.every = max(1, total // 100) if self.tty else max(1, total // 10)

  def update(self, step: int, loss) -> None:
    """Shows training step ``step`` (of ``first + 1 .. last``) and its loss."""
    done, total = step - self.first, self.last - self.first
    if done % self.every and step != self.last:
      return
    rate = done / max(time.perf_counter() - self.start, 1e-9)
    filled = self.width * done // total
    bar = "#" * filled + "-" * (self.width - filled)
    line = f"{self.label} [{bar}] step {step:>{len(str(self.last))}}/{self.last}"
    line += f"  loss {float(loss):.4f}  {rate:6.1f} steps/s"
    if self.tty:
      line = "\r" + line + ("\n" if step == self.last else "")
    else:
      line += "\n"
    self.stream.write(line)
    self.stream.flush()


def binary_entropy(p: np.ndarray) -> float:
  """Mean cross-entropy of predicting ``p`` for labels drawn with probability ``p``."""
  p = np.clip(p.astype(np.float64), 1e-7, 1 - 1e-7)
  return float(np.mean(-(p * np.log(p) + (1 - p) * np.log1p(-p))))


def directory_size(path: str) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def train_and_checkpoint(
  config: RunConfig, workdir: str, steps: int, every: int
) -> tuple[np.ndarray, float, Run]:
  run = Run(config, workdir, checkpoint_every=every)
  bar = ProgressBar("train ", 0, steps)
  start = time.perf_counter()
  first = run.train(1, bar.update)  # compiles the step
  compile_seconds = time.perf_counter() - start
  losses = np.concatenate([first, run.train(steps - 1, bar.update)])
  if run.step not in run.manager.all_steps():
    run.manager.save(run.step)  # the final state too
  run.close()
  return losses, compile_seconds, run


def summarize(run: Run, losses: np.ndarray, seconds: float, compile_seconds: float) -> None:
  steps, window = len(losses), max(1, min(100, len(losses) // 5))
  table, embedding = run.model.embedding.ids, run.model.embedding
  recent = [run.stream.batch(s) for s in range(steps - window, steps)]
  best = binary_entropy(np.concatenate([b.probabilities for b in recent]))
  constant = binary_entropy(np.array([np.concatenate([b.labels for b in recent]).mean()]))
  steady = (steps - 1) / max(seconds - compile_seconds, 1e-9)
  directory, oov = run.manager.directory, int(embedding.oov_lookups.get_value())
  first, last = losses[:window].mean(), losses[-window:].mean()
  megabytes = directory_size(directory) / 2**20
  lines = {
    "steps/s": f"{steady:,.1f} ({steps} steps in {seconds:.1f} s, {compile_seconds:.1f} s of it compiling)",
    "table": f"{len(table):,} ids in {table.capacity:,} rows, load factor {len(table) / table.capacity:.2f}",
    "shared rows": f"{oov:,} lookups of ids that came once the table was full",
    "loss": f"first {window} steps {first:.4f} -> last {window} {last:.4f} "
    f"(best possible {best:.4f}, constant guess {constant:.4f})",
    "checkpoints": f"steps {run.manager.all_steps()} in {directory} ({megabytes:.1f} MiB)",
    "table repr": repr(table),
  }
  print("summary")
  for label, line in lines.items():
    print(f"  {label:<13s}{line}")


def resume_and_compare(config: RunConfig, workdir: str, step: int, losses: np.ndarray) -> bool:
  restart = Run(config, workdir, checkpoint_every=None, restore_step=step)
  print(
    f"restart from step {step}: restored {restart.deferred} into a freshly built model"
    " (deferred: queued by restore, filled in on attach)"
  )
  resumed = restart.train(len(losses) - step, ProgressBar("resume", step, len(losses)).update)
  restart.close()
  equal = np.array_equal(resumed.view(np.uint32), losses[step:].view(np.uint32))
  print(f"  {len(resumed)} resumed losses bitwise equal to the uninterrupted run: {'yes' if equal else 'NO'}")
  return equal


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=1500, help="training steps (default 1500)")
  parser.add_argument(
    "--capacity", type=int, default=1 << 18, help="embedding rows ids can take (default 262144)"
  )
  parser.add_argument("--workdir", help="checkpoint directory, empty or absent (default: a temporary one)")
  args = parser.parse_args(argv)
  if args.steps < 2:
    parser.error("--steps: expected at least 2 (the demo restarts from a checkpoint in the middle).")
  if args.workdir and os.path.isdir(args.workdir) and os.listdir(args.workdir):
    parser.error(f"--workdir: {args.workdir} is not empty.")
  workdir = args.workdir or tempfile.mkdtemp(prefix="jaxres-demo-")
  config = RunConfig(capacity=args.capacity)
  every = max(1, math.ceil(args.steps / 3))
  print(
    f"jaxres demo on {jax.devices()[0].platform}: a click-through model whose embedding rows are "
    f"assigned to ids on the fly, trained in nnx.jit\n"
    f"  data   {args.steps} steps x {config.batch_size} examples x {config.num_fields} ids "
    f"(64-bit, Zipf over {config.vocab_size:,} per field)\n"
    f"  model  {config.capacity:,} rows x {config.features} + MLP {config.hidden}, "
    f"Adam {config.learning_rate}; checkpoint every {every} steps"
  )
  start = time.perf_counter()
  try:
    losses, compile_seconds, run = train_and_checkpoint(config, workdir, args.steps, every)
    summarize(run, losses, time.perf_counter() - start, compile_seconds)
    equal = resume_and_compare(config, workdir, run.manager.all_steps()[-2], losses)
  finally:
    if not args.workdir:
      shutil.rmtree(workdir, ignore_errors=True)
  print(f"done in {time.perf_counter() - start:.1f} s")
  return 0 if equal else 1


if __name__ == "__main__":
  sys.exit(main())
