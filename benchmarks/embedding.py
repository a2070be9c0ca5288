"""``python -m benchmarks.embedding``: jr.DynamicEmbedding against a dense embedding, same run.

* **Step time against capacity**: one jitted training step of 4096 ids
  (Zipf over 10^6 int64 ids), 32 features, row-wise Adam, LRU eviction, at
  capacities 2^16 to 2^22 (goal: slowest / fastest <= 1.5).
* **Against what a JAX user writes today**: an ``nnx.Embed`` of the same
  capacity (ids hashed to rows) trained with ``optax.adam`` through
  ``nnx.Optimizer``, the same step otherwise (goal: >= 10x faster at 2^20),
  and the bytes each takes per row.
* **Quality** on the click task of ``jaxres.examples``: the loss after N
  steps of the same model with a ``jr.DynamicEmbedding`` and with a dense
  hashed embedding of equal capacity, both trained with Adam.

Both steps donate their model and optimizer, so neither copies its tables.
Options: ``--scale`` (1.0: the sizes above; smaller for a quick run),
``--steps`` (timed steps per run), ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxres as jr
from benchmarks.eviction import zipf_stream
from jaxres.examples import ClickStream, Run, RunConfig

IDS, FEATURES = 4096, 32
ADAM = optax.adam(1e-3)


class Sparse(nnx.Module):
  def __init__(self, capacity: int):
    self.emb = jr.DynamicEmbedding(capacity, FEATURES, optimizer=ADAM, eviction=jr.LRU(), rngs=nnx.Rngs(0))
    self.head = nnx.Linear(FEATURES, 1, rngs=nnx.Rngs(1))


class Dense(nnx.Module):
  def __init__(self, capacity: int):
    self.capacity = capacity
    self.emb = nnx.Embed(capacity, FEATURES, rngs=nnx.Rngs(0))
    self.head = nnx.Linear(FEATURES, 1, rngs=nnx.Rngs(1))

  def rows(self, ids):
    return self.emb(hashed(ids, self.capacity))


def hashed(ids, capacity: int) -> jax.Array:
  """Dense baseline: word-pair ids hashed to ``[0, capacity)`` rows (collisions share a row)."""
  return (jr.keys.hash(ids, jnp.int64) % jnp.uint32(capacity)).astype(jnp.int32)


def _loss(head, rows, labels):
  return jnp.mean((head(rows)[..., 0] - labels) ** 2)


@functools.partial(nnx.jit, donate_argnums=(0, 1))
def sparse_step(model: Sparse, optimizer, ids, labels):
  rows = model.emb(ids)
  loss, (grads, row_grads) = nnx.value_and_grad(lambda m, r: _loss(m.head, r, labels), argnums=(0, 1))(
    model, rows
  )
  optimizer.update(model, grads)
  model.emb.apply_gradients(ids, row_grads)
  return loss


@functools.partial(nnx.jit, donate_argnums=(0, 1))
def dense_step(model: Dense, optimizer, ids, labels):
  loss, grads = nnx.value_and_grad(lambda m: _loss(m.head, m.rows(ids), labels))(model)
  optimizer.update(model, grads)
  return loss


def step_time(kind: str, capacity: int, stream: np.ndarray, steps: int, repeats: int = 3) -> dict:
  """Median step time (us) over ``repeats`` runs, after warm-up steps; bytes per row."""
  model = Sparse(capacity) if kind == "sparse" else Dense(capacity)
  optimizer = nnx.Optimizer(model, ADAM, wrt=nnx.Param)
  step = sparse_step if kind == "sparse" else dense_step
  batches = [jr.keys.split64(stream[i : i + IDS]) for i in range(0, stream.size - IDS + 1, IDS)]
  labels = jnp.ones(IDS, jnp.float32)
  warm = min(len(batches) // 2, 8)
  for ids in batches[:warm]:
    step(model, optimizer, ids, labels).block_until_ready()
  runs = []
  for r in range(repeats):
    times = []
    for i in range(steps):
      ids = batches[(warm + r * steps + i) % len(batches)]
      start = time.perf_counter()
      step(model, optimizer, ids, labels).block_until_ready()
      times.append(time.perf_counter() - start)
    runs.append(statistics.median(times) * 1e6)
  held = nnx.state(model, nnx.Not(nnx.Param)) if kind == "sparse" else nnx.state(model.emb)
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(held))
  if kind == "dense":
    state_bytes += sum(x.nbytes for x in jax.tree.leaves(nnx.state(optimizer.opt_state)) if x.ndim == 2)
  return {
    "us": statistics.median(runs),
    "spread": (min(runs), max(runs)),
    "bytes_per_row": state_bytes / capacity,
  }


class DenseClickModel(nnx.Module):
  """The click model with a dense embedding: ids hashed to rows of an ``nnx.Embed``."""

  def __init__(self, config: RunConfig):
    rngs = nnx.Rngs(config.seed)
    self.capacity = config.capacity
    self.emb = nnx.Embed(
      config.capacity, config.features, embedding_init=nnx.initializers.normal(0.05), rngs=rngs
    )
    self.hidden = nnx.Linear(config.num_fields * config.features, config.hidden, rngs=rngs)
    self.output = nnx.Linear(config.hidden, 1, rngs=rngs)

  def __call__(self, ids):
    x = self.emb(hashed(ids, self.capacity))
    return self.output(nnx.relu(self.hidden(x.reshape(x.shape[0], -1))))[:, 0]


@functools.partial(nnx.jit, donate_argnums=(0, 1))
def dense_click_step(model, optimizer, ids, labels):
  def loss(m):
    return optax.sigmoid_binary_cross_entropy(m(ids), labels).mean()

  value, grads = nnx.value_and_grad(loss)(model)
  optimizer.update(model, grads)
  return value


def quality(config: RunConfig, steps: int) -> dict:
  """Mean loss over the last tenth of ``steps`` for the dynamic and the dense click models."""
  import tempfile

  with tempfile.TemporaryDirectory() as workdir:
    run = Run(config, workdir, checkpoint_every=None)
    sparse = run.train(steps)
  stream = ClickStream(
    batch_size=config.batch_size, num_fields=config.num_fields, vocab_size=config.vocab_size
  )
  model = DenseClickModel(config)
  optimizer = nnx.Optimizer(model, optax.adam(config.learning_rate), wrt=nnx.Param)
  dense = []
  for step in range(steps):
    batch = stream.batch(step)
    dense.append(dense_click_step(model, optimizer, jr.keys.split64(batch.ids), batch.labels))
  dense = np.asarray(jax.device_get(dense))
  tail = max(1, steps // 10)
  return {"sparse": float(sparse[-tail:].mean()), "dense": float(dense[-tail:].mean()), "tail": tail}


def report(scale: float, steps: int) -> str:
  capacities = [1 << k for k in (16, 18, 20, 22)] if scale >= 1 else [1 << 10, 1 << 12]
  stream = zipf_stream(
    np.random.default_rng(0), max(IDS * 64, int(IDS * 400 * scale)), int(1_000_000 * scale) or 1000
  )
  sparse = {c: step_time("sparse", c, stream, steps) for c in capacities}
  dense = {c: step_time("dense", c, stream, steps) for c in capacities}
  config = RunConfig() if scale >= 1 else RunConfig(capacity=1024, batch_size=64, vocab_size=4000)
  click_steps = 1500 if scale >= 1 else 30
  losses = quality(config, click_steps)

  def us(m):
    return f"{m['us']:,.0f} us ({m['spread'][0]:,.0f}-{m['spread'][1]:,.0f})"

  flat = max(m["us"] for m in sparse.values()) / min(m["us"] for m in sparse.values())
  big = 1 << 20 if scale >= 1 else max(capacities)
  speedup = dense[big]["us"] / sparse[big]["us"]
  lines = [
    f"## jr.DynamicEmbedding: training steps of {IDS} ids x {FEATURES} features, Adam, LRU",
    "",
    "| capacity | DynamicEmbedding step | nnx.Embed + adam step | speedup | bytes/row (ours, dense) |",
    "|---|---|---|---|---|",
  ]
  for c in capacities:
    d = dense[c]
    lines.append(
      f"| 2^{c.bit_length() - 1} | {us(sparse[c])} | {us(d)} | {d['us'] / sparse[c]['us']:,.1f}x | "
      f"{sparse[c]['bytes_per_row']:,.0f} / {d['bytes_per_row']:,.0f} |"
    )
  met = {True: "yes", False: "**no**"}
  lines += [
    "",
    "| goal | measured | met |",
    "|---|---|---|",
    f"| step time flat in capacity: slowest / fastest <= 1.5 | {flat:.2f} | {met[flat <= 1.5]} |",
    f"| >= 10x faster than the dense step at 2^{big.bit_length() - 1} | {speedup:,.1f}x "
    f"| {met[speedup >= 10]} |",
    "",
    f"Quality, click task ({click_steps} steps of {config.batch_size} examples x {config.num_fields} ids, "
    f"{config.vocab_size * config.num_fields:,} distinct ids, {config.capacity:,} rows): mean loss of "
    f"the last {losses['tail']} steps, jr.DynamicEmbedding (LRU, min_count={config.min_count}) "
    f"{losses['sparse']:.4f}, dense hashed nnx.Embed {losses['dense']:.4f}.",
    "",
    f"Step times: medians of 3 runs of {steps} steps (range of the run medians), after warm-up steps "
    "that compile and fill the table; model and optimizer donated.",
  ]
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--scale", type=float, default=1.0)
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "embedding.md")
  args = parser.parse_args(argv)
  text = report(args.scale, args.steps)
  print(text)
  if args.scale == 1.0:
    args.out.write_text(text + "\n")


if __name__ == "__main__":
  main()
