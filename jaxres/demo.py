"""The jaxres demo: a click-through model with a dynamic embedding, end to end.

Run ``python -m jaxres.demo``. On built-in synthetic data (Zipf-distributed
64-bit ids, many more distinct ids than embedding rows, clicks from a hidden
rule), it trains :class:`jaxres.examples.ClickModel` inside ``nnx.jit``: a
:class:`jaxres.DynamicEmbedding` gives ids rows at their second occurrence,
evicts the least recently used when full, and updates only the rows of each
batch with a row-wise Adam. It checkpoints with ``jr.CheckpointManager`` as
it goes (incremental steps: what changed since the step before), prints a
summary, then restarts from the next-to-last checkpoint into a freshly built
model (deferred restore) and checks that the resumed
losses are bitwise those of the uninterrupted run. It ends by evaluating the
model on held-out data in inference mode (which changes nothing), exporting
it with ``jr.saved_model`` and serving a few requests from the export, whose
answers must equal the model's bit for bit; then it trains a little more and
keeps the served model fresh with a delta (``save_delta`` and
``LoadedModel.update``, no reload), whose answers must again equal the
model's. Exit status 1 if any check fails.
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
from flax import nnx
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

import jaxres as jr
from jaxres.examples import ClickStream, Run, RunConfig, evaluate, export, predict, train_step


def progress(label: str, first: int, last: int):
  """A rich progress bar of training steps ``first + 1 .. last``; returns ``(bar, update)``."""
  bar = Progress(
    TextColumn(f"{label:<7s}"),
    BarColumn(),
    MofNCompleteColumn(),
    TextColumn("loss {task.fields[loss]}"),
    TextColumn("{task.fields[rate]} steps/s"),
    TimeRemainingColumn(),
    refresh_per_second=4,
  )
  task = bar.add_task(label, total=last - first, loss="-", rate="-")
  start = time.perf_counter()
  every = max(1, (last - first) // 50)

  def update(step: int, loss) -> None:
    done = step - first
    if done % every and step != last:
      return
    rate = done / max(time.perf_counter() - start, 1e-9)
    bar.update(task, completed=done, loss=f"{float(loss):.4f}", rate=f"{rate:,.0f}")

  return bar, update


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
  bar, update = progress("train", 0, steps)
  with bar:
    start = time.perf_counter()
    first = run.train(1, update)  # compiles the step
    compile_seconds = time.perf_counter() - start
    losses = np.concatenate([first, run.train(steps - 1, update)])
  if run.step not in run.manager.all_steps():
    run.manager.save(run.step)  # the final state too
  run.close()
  return losses, compile_seconds, run


def summarize(run: Run, losses: np.ndarray, seconds: float, compile_seconds: float) -> None:
  config, embedding = run.config, run.model.embedding
  steps, window = len(losses), max(1, min(100, len(losses) // 5))
  recent = [run.stream.batch(s) for s in range(steps - window, steps)]
  best = binary_entropy(np.concatenate([b.probabilities for b in recent]))
  constant = binary_entropy(np.array([np.concatenate([b.labels for b in recent]).mean()]))
  steady = (steps - 1) / max(seconds - compile_seconds, 1e-9)
  stats, size = embedding.stats(), embedding.size()
  lookups = steps * config.batch_size * config.num_fields
  hits = lookups - stats["refused"] - stats["admitted"]  # a new id's first lookup is no hit
  distinct = len(np.unique(np.concatenate([run.stream.batch(s).ids.ravel() for s in range(steps)])))
  first, last = losses[:window].mean(), losses[-window:].mean()
  directory = run.manager.directory
  lines = {
    "steps/s": f"{steady:,.1f} ({steps} steps in {seconds:.1f} s, {compile_seconds:.1f} s of it compiling)",
    "ids": f"{lookups:,} lookups of {distinct:,} distinct ids into {embedding.capacity:,} rows",
    "hit ratio": f"{hits / lookups:.3f} of lookups found their id's row",
    "rows": f"{size:,} ids hold rows (load {size / embedding.capacity:.2f}); "
    f"{stats['admitted']:,} admitted, {stats['evictions']:,} evicted (LRU), "
    f"{stats['refused']:,} lookups refused (ids seen fewer than {embedding.min_count} times read zeros)",
    "loss": f"first {window} steps {first:.4f} -> last {window} {last:.4f} "
    f"(best possible {best:.4f}, constant guess {constant:.4f})",
    "checkpoints": f"steps {run.manager.all_steps()} in {directory} "
    f"({directory_size(directory) / 2**20:.1f} MiB)",
    "embedding": repr(embedding),
  }
  print("summary")
  for label, line in lines.items():
    print(f"  {label:<12s}{line}")


def resume_and_compare(config: RunConfig, workdir: str, step: int, losses: np.ndarray) -> bool:
  restart = Run(config, workdir, checkpoint_every=None, restore_step=step)
  print(
    f"restart from step {step}: restored {restart.deferred} into a freshly built model"
    " (deferred: queued by restore, filled in on attach)"
  )
  bar, update = progress("resume", step, len(losses))
  with bar:
    resumed = restart.train(len(losses) - step, update)
  restart.close()
  equal = np.array_equal(resumed.view(np.uint32), losses[step:].view(np.uint32))
  print(f"  {len(resumed)} resumed losses bitwise equal to the uninterrupted run: {'yes' if equal else 'NO'}")
  return equal


def evaluate_and_serve(run: Run, path: str, steps: int) -> bool:
  """Held-out loss in inference mode (nothing in the model changes), then the model exported with
  ``jr.saved_model``, loaded back and asked a few requests; whether the answers match the model's.
  Then 100 more training steps reach the served model as a delta, and the answers are checked again."""
  config, model = run.config, run.model
  held_out = ClickStream(
    batch_size=config.batch_size, num_fields=config.num_fields, vocab_size=config.vocab_size, seed=1
  )
  stats = model.embedding.stats()
  loss = evaluate(model, held_out, range(20))
  unchanged = model.embedding.stats() == stats
  verdict = "yes" if unchanged else "NO"
  print(f"evaluate: held-out loss {loss:.4f} in inference mode; embedding unchanged: {verdict}")
  start = time.perf_counter()
  export(model, path, config.num_fields, updatable=True, step=run.step)
  seconds = time.perf_counter() - start
  served = jr.saved_model.load(path)
  same = _answers_alike(served, model, held_out, steps)
  state = directory_size(os.path.join(path, "state")) / 2**20
  print(
    f"serve: exported to {path} in {seconds:.1f} s (serving state {state:.1f} MiB), loaded, and asked "
    f"requests of 1, 7 and 64 examples: answers bitwise equal to the model's: {'yes' if same else 'NO'}"
  )
  for step in range(run.step, run.step + 100):
    batch = run.stream.batch(step)
    train_step(run.model, run.optimizer, jr.keys.split64(batch.ids), batch.labels)
  delta = os.path.join(tempfile.mkdtemp(prefix="jaxres-demo-delta-"), "delta")
  start = time.perf_counter()
  jr.saved_model.save_delta(model, delta, since=path, step=run.step + 100)
  written = time.perf_counter() - start
  start = time.perf_counter()
  served.update(delta)
  applied = time.perf_counter() - start
  fresh = _answers_alike(served, model, held_out, steps)
  print(
    f"fresh: 100 more training steps sent to the served model as a delta of "
    f"{directory_size(delta) / 2**20:.2f} MiB (written in {written:.2f} s, applied in place in "
    f"{applied:.2f} s, no reload); answers bitwise equal to the model's: {'yes' if fresh else 'NO'}"
  )
  shutil.rmtree(os.path.dirname(delta), ignore_errors=True)
  return unchanged and same and fresh


def _answers_alike(served, model, held_out: ClickStream, steps: int) -> bool:
  """Whether ``served`` answers requests of 1, 7 and 64 held-out examples bit for bit as ``model``
  (on the batch as served: 7 padded with zero rows to the batch size 16)."""
  model.eval()
  same = True
  signature = served.signatures["serving_default"]
  for size in (1, 7, 64):
    ids = held_out.batch(steps + size).ids[:size]
    answer = np.asarray(signature(ids=ids)["probability"])
    padded = min(b for b in signature.batch_sizes if b >= size)
    ids = np.concatenate([ids, np.zeros((padded - size, ids.shape[1]), ids.dtype)])
    expected = np.asarray(_predict(model, jr.keys.split64(ids))["probability"])[:size]
    same &= answer.tobytes() == expected.tobytes()
  model.train()
  return same


_predict = nnx.jit(predict)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=1500, help="training steps (default 1500)")
  parser.add_argument("--capacity", type=int, default=1 << 16, help="embedding rows (default 65536)")
  parser.add_argument("--workdir", help="checkpoint directory, empty or absent (default: a temporary one)")
  parser.add_argument("--export", help="directory to export the model to, absent (default: a temporary one)")
  args = parser.parse_args(argv)
  if args.steps < 2:
    parser.error("--steps: expected at least 2 (the demo restarts from a checkpoint in the middle).")
  if args.capacity < 1:
    parser.error("--capacity: expected at least 1.")
  if args.workdir and os.path.isdir(args.workdir) and os.listdir(args.workdir):
    parser.error(f"--workdir: {args.workdir} is not empty.")
  if args.export and os.path.exists(args.export):
    parser.error(f"--export: {args.export} already exists.")
  workdir = args.workdir or tempfile.mkdtemp(prefix="jaxres-demo-")
  scratch = None if args.export else tempfile.mkdtemp(prefix="jaxres-demo-export-")
  export_path = args.export or os.path.join(scratch, "model")
  config = RunConfig(capacity=args.capacity)
  every = max(1, math.ceil(args.steps / 3))
  print(
    f"jaxres demo on {jax.devices()[0].platform}: a click-through model whose embedding rows are "
    f"given to ids inside nnx.jit\n"
    f"  data   {args.steps} steps x {config.batch_size} examples x {config.num_fields} ids "
    f"(64-bit, Zipf over {config.vocab_size * config.num_fields:,} ids)\n"
    f"  model  jr.DynamicEmbedding of {config.capacity:,} rows x {config.features} (row-wise Adam, LRU, "
    f"min_count={config.min_count}) + MLP {config.hidden}; checkpoint every {every} steps"
  )
  start = time.perf_counter()
  try:
    losses, compile_seconds, run = train_and_checkpoint(config, workdir, args.steps, every)
    summarize(run, losses, time.perf_counter() - start, compile_seconds)
    equal = resume_and_compare(config, workdir, run.manager.all_steps()[-2], losses)
    served = evaluate_and_serve(run, export_path, args.steps)
  finally:
    if not args.workdir:
      shutil.rmtree(workdir, ignore_errors=True)
    if scratch:
      shutil.rmtree(scratch, ignore_errors=True)
  print(f"done in {time.perf_counter() - start:.1f} s")
  return 0 if equal and served else 1


if __name__ == "__main__":
  sys.exit(main())
