"""``python -m benchmarks.deltas``: what an incremental save writes against a whole one.

A ``jr.DynamicEmbedding`` (``--rows`` live ids of 32 features, Adam: the row and
its ``mu`` and ``nu`` per id, with scores) is trained until every id has a row,
saved whole by a ``jr.CheckpointManager(incremental=True)``, then trained on 1 %,
10 % and 50 % of its ids (distinct, drawn at random) and saved again: an
incremental step. For each share, in a process of its own (``--runs`` times):

* the bytes of the incremental step's directory, against the whole step's, and
  against the touched rows' own bytes (the whole step's bytes per live id,
  times the ids touched): the goal is at most 1.5x;
* the time of each save (until written), and of restoring each step into a
  fresh model (the incremental one reads the whole step too), after an
  untimed round of each (a whole save, an incremental one, a restore) that
  compiles what they run;
* serving: the model is also exported with ``updatable=True`` before the
  ids are touched and loaded (a lookup signature); after them, the time to
  write the delta (``jr.saved_model.save_delta``), its bytes, and the time
  to apply it to the loaded model (``LoadedModel.update``) and answer a
  batch, against exporting the model whole, loading it and answering the
  same batch (which compiles its program again).

Figures are medians over the runs, with their range. No peer is measured: none
of the systems installed here (TF Recommenders-Addons, TorchRec on CPU) writes
incremental checkpoints.
"""

from __future__ import annotations

import argparse
import functools
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
SHARES = (0.01, 0.1, 0.5)
FEATURES, BATCH = 32, 4096


def _size(path: str) -> int:
  return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def measure(rows: int, share: float, seed: int) -> dict:
  """One process's figures for one share of the ids touched."""
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx

  import jaxres as jr

  class Model(nnx.Module):
    def __init__(self):
      self.emb = jr.DynamicEmbedding(
        2 * rows, FEATURES, optimizer=optax.adam(0.01), eviction=jr.LRU(), rngs=nnx.Rngs(0)
      )

  @nnx.jit
  def train(model, ids, grads):
    model.emb(ids)
    model.emb.apply_gradients(ids, grads)

  rng = np.random.default_rng(seed)

  def step(batch):  # random gradients: rows and optimizer state as incompressible as trained ones
    train(model, jr.keys.split64(batch), rng.normal(size=(len(batch), FEATURES)).astype(np.float32))

  ids = (np.arange(rows, dtype=np.int64) * 7919 + 2**40).reshape(-1, BATCH)
  model = Model()
  for batch in ids:
    step(batch)
  touched = rng.choice(ids.reshape(-1), int(rows * share), replace=False)
  touched = touched[: len(touched) // BATCH * BATCH or len(touched)].reshape(-1, min(BATCH, len(touched)))
  lookup = {
    "rows": jr.saved_model.Signature(lambda m, ids: m.emb(ids), ids=jax.ShapeDtypeStruct(("n",), jnp.int64))
  }
  query = ids[0]

  def timed(fn):
    begin = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - begin

  def saved(manager, number, full=None):
    manager.save(number, full=full)
    manager.wait_until_finished()

  with tempfile.TemporaryDirectory() as folder:
    jr.saved_model.save(model, f"{folder}/export", lookup, updatable=True)
    served = jr.saved_model.load(f"{folder}/export")
    served.signatures["rows"](ids=query)  # compiles
    manager = jr.CheckpointManager(folder, jr.Checkpoint(model=model), incremental=True)
    # A first round of each kind compiles what saves and deltas run; the second is timed.
    saved(manager, 0)
    for batch in touched:
      step(batch)
    saved(manager, 1)
    jr.saved_model.save_delta(model, f"{folder}/serving_1", since=f"{folder}/export", step=1)
    served.update(f"{folder}/serving_1")
    _, whole_s = timed(lambda: saved(manager, 2, full=True))
    for batch in touched:
      step(batch)
    _, delta_s = timed(lambda: saved(manager, 3))
    whole_bytes, delta_bytes = _size(manager.step_path(2)), _size(manager.step_path(3))
    delta = f"{folder}/serving_2"
    _, write_s = timed(lambda: jr.saved_model.save_delta(model, delta, since=f"{folder}/serving_1", step=2))
    serving_bytes = _size(delta)
    updated, apply_s = timed(
      lambda: (served.update(delta), jax.block_until_ready(served.signatures["rows"](ids=query)))[1]
    )

    def export_and_load():
      jr.saved_model.save(model, f"{folder}/again", lookup)
      return jax.block_until_ready(jr.saved_model.load(f"{folder}/again").signatures["rows"](ids=query))

    fresh, reexport_s = timed(export_and_load)
    if not np.array_equal(updated["output"], fresh["output"]):
      raise AssertionError("the updated model does not answer as the one exported again")
    restores = {}
    for number in (2, 2, 3):  # the first restore compiles: untimed
      reader = jr.CheckpointManager(folder, jr.Checkpoint(model=Model()))
      status, restores[number] = timed(functools.partial(reader.restore, number))
      status.assert_consumed()
      reader.close()
    manager.close()
  live = int(model.emb.size())
  return {
    "live": live,
    "touched": int(touched.size),
    "whole bytes": whole_bytes,
    "delta bytes": delta_bytes,
    "touched bytes": whole_bytes / live * touched.size,
    "whole save s": whole_s,
    "delta save s": delta_s,
    "whole restore s": restores[2],
    "delta restore s": restores[3],
    "serving delta bytes": serving_bytes,
    "serving delta write s": write_s,
    "serving delta apply s": apply_s,
    "export and load s": reexport_s,
  }


def _run(rows: int, share: float, seed: int) -> dict:
  command = [sys.executable, "-m", "benchmarks.deltas", "--measure", str(rows), str(share), str(seed)]
  done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True, env=os.environ)
  return json.loads(done.stdout.strip().splitlines()[-1])


def _median(runs: list[dict], key: str) -> tuple[float, float, float]:
  values = [r[key] for r in runs]
  return statistics.median(values), min(values), max(values)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, default=1 << 17, help="live ids (a multiple of 4096)")
  parser.add_argument("--runs", type=int, default=3)
  parser.add_argument(
    "--shares", default=",".join(map(str, SHARES)), help="shares of the ids touched (comma-separated)"
  )
  parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "deltas.md")
  parser.add_argument("--measure", nargs=3, help=argparse.SUPPRESS)  # rows, share, seed
  args = parser.parse_args(argv)
  if args.measure:
    rows, share, seed = int(args.measure[0]), float(args.measure[1]), int(args.measure[2])
    print(json.dumps(measure(rows, share, seed)))
    return
  lines = [
    f"## Incremental saves of a DynamicEmbedding: {args.rows:,} ids, {FEATURES} features, Adam",
    "",
    "| ids touched | incremental step, MB | / whole step | / touched rows' bytes (goal <= 1.5) "
    "| save s: whole, incremental | restore s: whole, incremental |",
    "|---|---|---|---|---|---|",
  ]
  serving = [
    "",
    f"## Deltas to a served model: its lookup signature, {args.rows:,} ids",
    "",
    "| ids touched | delta, MB | write s | apply and answer s | export, load and answer s (instead) |",
    "|---|---|---|---|---|",
  ]
  for share in (float(x) for x in args.shares.split(",")):
    runs = [_run(args.rows, share, seed) for seed in range(args.runs)]
    serving.append(
      f"| {share:.0%} | {_median(runs, 'serving delta bytes')[0] / 1e6:,.2f} "
      f"| {_median(runs, 'serving delta write s')[0]:.3f} | {_median(runs, 'serving delta apply s')[0]:.3f} "
      f"| {_median(runs, 'export and load s')[0]:.3f} |"
    )
    delta, lo, hi = _median(runs, "delta bytes")
    whole = _median(runs, "whole bytes")[0]
    touched = _median(runs, "touched bytes")[0]
    saves = [_median(runs, k)[0] for k in ("whole save s", "delta save s")]
    restores = [_median(runs, k)[0] for k in ("whole restore s", "delta restore s")]
    lines.append(
      f"| {share:.0%} ({runs[0]['touched']:,}) | {delta / 1e6:,.2f} ({lo / 1e6:,.2f}-{hi / 1e6:,.2f}) "
      f"| {delta / whole:.3f} | {delta / touched:.2f} | {saves[0]:.2f}, {saves[1]:.2f} "
      f"| {restores[0]:.2f}, {restores[1]:.2f} |"
    )
  lines += [
    "",
    f"Whole step: {whole / 1e6:,.1f} MB ({whole / runs[0]['live']:,.0f} bytes per live id: key, row, Adam's "
    "mu and nu, score, slot; random gradients). Medians over "
    f"{args.runs} processes (each its own ids touched); times until the step is written, on this machine's "
    "disk. The incremental step also holds the live slots (1 bit per slot) and the dense arrays that "
    "changed.",
    *serving,
    "",
    "A served delta holds the rows the signature reads (not the optimizer's) and 1 bit per slot; "
    "applying it rebuilds the served table on the host and hands it to the programs already compiled; "
    "the alternative exports, loads and compiles anew. Each run checks the two answer alike.",
  ]
  text = "\n".join(lines)
  print(text)
  args.out.write_text(text + "\n")


if __name__ == "__main__":
  main()
