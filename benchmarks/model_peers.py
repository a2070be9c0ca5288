"""One system's DLRM-shaped training step, timed in a process of its own.

``python -m benchmarks.model_peers SYSTEM --warmup 20 --steps 30 --seed 0 [--batch 4096 --rows 131072]``
prints one JSON line: ``{"us_per_step", "us_per_example", "bytes", "rows", "losses"}``,
or ``{"error": ...}`` when the system cannot run here.

The model: 26 sparse features with the cardinalities of the Criteo display
advertising challenge's categorical columns (Kaggle), each its own table of
16 floats; four of them multi-hot (a padded row of up to 10 or 20 ids per
example, mean-pooled); 13 dense inputs through a bottom MLP (13-64-16); the
16 + 26 x 16 features through a top MLP (432-256-64-1); binary
cross-entropy, batches of 4096 (:class:`Sizes`). Ids are Zipf(1.1) ranks per feature,
scrambled over the int64 range. Every system sees the same batches and
keeps its embedding tables in the same bytes (:meth:`Sizes.budgets`); each runs in
its fastest idiomatic CPU form (see each builder). A step ends when its loss
is on the host. This module imports only NumPy and the system's own
framework: TF Recommenders-Addons pins its TensorFlow, so it runs from an
environment of its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import numpy as np

from benchmarks.step_peers import process_group

CARDINALITIES = (
  1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
  27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
MULTI_HOT = {2: 20, 11: 10, 15: 10, 20: 20}  # feature -> ids per example at most (mean-pooled)
WIDTH = 16
DENSE = 13
LEARNING_RATE = 0.01
ZIPF = 1.1
_MIX = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)


def _mix64(x: np.ndarray) -> np.ndarray:
  with np.errstate(over="ignore"):
    x = (x ^ (x >> np.uint64(30))) * np.uint64(_MIX[0])
    x = (x ^ (x >> np.uint64(27))) * np.uint64(_MIX[1])
    return x ^ (x >> np.uint64(31))


def zipf_ranks(rng, shape, n: int) -> np.ndarray:
  """Ranks ``0 .. n - 1`` drawn from Zipf(:data:`ZIPF`) truncated to ``n`` values (by inverting the
  continuous power law's distribution function: exact to within a rank)."""
  u = rng.random(shape)
  top = float(n) ** (1.0 - ZIPF)
  ranks = np.floor((1.0 + u * (top - 1.0)) ** (1.0 / (1.0 - ZIPF))) - 1.0
  return np.clip(ranks, 0, n - 1).astype(np.uint64)


@dataclasses.dataclass(frozen=True)
class Sizes:
  """The batch, and the rows of a table at most in the hashed systems (which sets every budget)."""

  batch: int = 4096
  rows: int = 1 << 17
  features: int = len(CARDINALITIES)  # the first ones (fewer: a quick check of the harness)

  def hashed_rows(self, f: int) -> int:
    return min(CARDINALITIES[f], self.rows)

  def budgets(self) -> list[int]:
    """Bytes of each table: a hashed table's rows with TorchRec's fused row-wise Adagrad state
    (16 floats and one per row)."""
    return [self.hashed_rows(f) * (WIDTH + 1) * 4 for f in range(self.features)]

  def examples(self, seed: int, step: int) -> dict:
    """The examples of ``step``: ``dense`` (float32[B, 13]), ``labels`` (float32[B]) and per feature
    ``f<i>``, ids (int64[B], or int64[B, L] padded with 0), and for a multi-hot one ``w<i>``, weights
    (float32[B, L]: 1 for an id, 0 for padding)."""
    rng = np.random.default_rng([seed, step])
    out = {"dense": rng.normal(size=(self.batch, DENSE)).astype(np.float32)}
    for f, cardinality in enumerate(CARDINALITIES[: self.features]):
      width = MULTI_HOT.get(f)
      shape = (self.batch,) if width is None else (self.batch, width)
      ids = _mix64((np.uint64(f + 1) << np.uint64(40)) + zipf_ranks(rng, shape, cardinality)).view(np.int64)
      if width is not None:
        lengths = rng.integers(1, width + 1, self.batch)
        weights = (np.arange(width) < lengths[:, None]).astype(np.float32)
        ids = np.where(weights > 0, ids, 0)
        out[f"w{f}"] = weights
      out[f"f{f}"] = ids
    out["labels"] = (rng.random(self.batch) < 0.25).astype(np.float32)
    return out


def jaxres(sizes: Sizes):
  """``jr.EmbeddingCollection`` (a table per feature, LRU eviction, row-wise ``optax.adam``), the plain
  NNX step with ``jr.value_and_grad`` in ``nnx.jit`` (model donated), called through
  ``nnx.cached_partial`` (as Flax's performance guide advises for training loops).

  Each table holds as many rows as its budget buys at its bytes per row
  (measured: the module's state over its capacity).
  """
  import functools

  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx

  import jaxres as jr

  adam = optax.adam(LEARNING_RATE)
  probe = jr.DynamicEmbedding(1 << 14, WIDTH, optimizer=adam, eviction=jr.LRU(), rngs=nnx.Rngs(0))
  per_row = sum(x.nbytes for x in jax.tree.leaves(nnx.state(probe))) / (1 << 14)
  capacities = [max(min(CARDINALITIES[f], 64), int(b // per_row)) for f, b in enumerate(sizes.budgets())]
  tables = {
    f"t{f}": jr.TableConfig(c, WIDTH, optimizer=adam, eviction=jr.LRU()) for f, c in enumerate(capacities)
  }
  features = {f"f{f}": jr.FeatureConfig(f"t{f}", combiner="mean") for f in range(sizes.features)}

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.emb = jr.EmbeddingCollection(tables, features, rngs=rngs)
      self.bottom = nnx.Sequential(
        nnx.Linear(DENSE, 64, rngs=rngs), nnx.relu, nnx.Linear(64, WIDTH, rngs=rngs)
      )
      width = WIDTH * (1 + sizes.features)
      self.top = nnx.Sequential(
        nnx.Linear(width, 256, rngs=rngs), nnx.relu, nnx.Linear(256, 64, rngs=rngs), nnx.relu,
        nnx.Linear(64, 1, rngs=rngs),
      )  # fmt: skip

    def __call__(self, dense, sparse):
      rows = self.emb(sparse)
      x = jnp.concatenate([nnx.relu(self.bottom(dense)), *(rows[f"f{f}"] for f in range(sizes.features))], -1)
      return self.top(x)[:, 0]

  def loss_fn(model, dense, sparse, labels):
    return optax.sigmoid_binary_cross_entropy(model(dense, sparse), labels).mean()

  @functools.partial(nnx.jit, donate_argnums=(0, 1))
  def step(model, optimizer, dense, sparse, labels):
    loss, grads = jr.value_and_grad(loss_fn)(model, dense, sparse, labels)
    optimizer.update(model, grads)
    return loss

  model = Model(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, adam, wrt=nnx.Param)
  cached = nnx.cached_partial(step, model, optimizer)

  def prepare(examples):
    sparse = {}
    for f in range(sizes.features):
      ids = jax.device_put(jr.keys.split64(examples[f"f{f}"]))
      sparse[f"f{f}"] = (ids, jax.device_put(examples[f"w{f}"])) if f in MULTI_HOT else ids
    return jax.device_put(examples["dense"]), sparse, jax.device_put(examples["labels"])

  def run(prepared):
    return float(cached(*prepared))

  import flax

  state = sum(x.nbytes for t in model.emb.tables.values() for x in jax.tree.leaves(nnx.state(t)))
  versions = f"JAX {jax.__version__}, Flax {flax.__version__}"
  return prepare, run, {"bytes": state, "rows": sum(capacities), "versions": versions}


def torchrec(sizes: Sizes):
  """TorchRec's sharded ``EmbeddingBagCollection`` (``DistributedModelParallel``, FBGEMM's CPU kernels)
  over ids hashed to rows, mean pooling of jagged ids (``KeyedJaggedTensor``: no padding), row-wise
  Adagrad fused into the backward pass (FBGEMM's CPU kernels fuse only the Adagrad family), the MLPs
  by ``torch.optim.Adam``."""
  import torch
  import torchrec as tr
  from torchrec.distributed.model_parallel import DistributedModelParallel
  from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

  process_group()
  torch.manual_seed(0)
  configs = [
    tr.EmbeddingBagConfig(
      name=f"t{f}",
      embedding_dim=WIDTH,
      num_embeddings=sizes.hashed_rows(f),
      feature_names=[f"f{f}"],
      pooling=tr.PoolingType.MEAN,
    )
    for f in range(sizes.features)
  ]
  collection = tr.EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
  apply_optimizer_in_backward(tr.optim.RowWiseAdagrad, collection.parameters(), {"lr": LEARNING_RATE})
  sharded = DistributedModelParallel(collection, device=torch.device("cpu"))
  bottom = torch.nn.Sequential(torch.nn.Linear(DENSE, 64), torch.nn.ReLU(), torch.nn.Linear(64, WIDTH))
  top = torch.nn.Sequential(
    torch.nn.Linear(WIDTH * (1 + sizes.features), 256), torch.nn.ReLU(), torch.nn.Linear(256, 64),
    torch.nn.ReLU(), torch.nn.Linear(64, 1),
  )  # fmt: skip
  dense_optimizer = torch.optim.Adam([*bottom.parameters(), *top.parameters()], lr=LEARNING_RATE)
  keys = [f"f{f}" for f in range(sizes.features)]

  def prepare(examples):
    values, lengths = [], []
    for f in range(sizes.features):
      ids = np.remainder(examples[f"f{f}"], sizes.hashed_rows(f))
      if f in MULTI_HOT:
        weights = examples[f"w{f}"]
        values.append(ids[weights > 0])  # row-major: each example's ids in turn
        lengths.append(weights.sum(axis=1).astype(np.int32))
      else:
        values.append(ids)
        lengths.append(np.ones(sizes.batch, np.int32))
    features = tr.KeyedJaggedTensor.from_lengths_sync(
      keys=keys,
      values=torch.from_numpy(np.concatenate(values)),
      lengths=torch.from_numpy(np.concatenate(lengths)),
    )
    return torch.from_numpy(examples["dense"]), features, torch.from_numpy(examples["labels"])

  loss_fn = torch.nn.BCEWithLogitsLoss()

  def run(prepared):
    dense, features, labels = prepared
    pooled = sharded(features).to_dict()
    x = torch.cat([torch.relu(bottom(dense)), *(pooled[k] for k in keys)], dim=1)
    loss = loss_fn(top(x)[:, 0], labels)
    dense_optimizer.zero_grad()
    loss.backward()
    dense_optimizer.step()
    return loss.item()

  rows = sum(sizes.hashed_rows(f) for f in range(sizes.features))
  versions = f"PyTorch {torch.__version__}, TorchRec {tr.__version__}"
  return prepare, run, {"bytes": sum(sizes.budgets()), "rows": rows, "versions": versions}


def tfra(sizes: Sizes):
  """TF Recommenders-Addons: a ``de.keras.layers.Embedding`` (CPU cuckoo table) per feature, the
  multi-hot ones mean-pooled over their weights, ``de.DynamicEmbeddingOptimizer(Adam)``, in a
  ``tf.function``. Each table starts with room for the rows jaxres holds in its budget (its own
  bytes per row: key, row, Adam's two moments) and grows as ids arrive (no restrict policy: its
  faster configuration)."""
  os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  import tensorflow as tf
  import tensorflow_recommenders_addons.dynamic_embedding as de

  per_row = 8 + 3 * WIDTH * 4
  layers = [
    de.keras.layers.Embedding(
      WIDTH,
      key_dtype=tf.int64,
      value_dtype=tf.float32,
      initializer=tf.keras.initializers.RandomNormal(0.0, 0.01, seed=f),
      devices=["/CPU:0"],
      init_capacity=max(64, budget // per_row),
      name=f"t{f}",
    )
    for f, budget in enumerate(sizes.budgets())
  ]
  bottom = tf.keras.Sequential([tf.keras.layers.Dense(64, activation="relu"), tf.keras.layers.Dense(WIDTH)])
  top = tf.keras.Sequential(
    [
      tf.keras.layers.Dense(256, activation="relu"),
      tf.keras.layers.Dense(64, activation="relu"),
      tf.keras.layers.Dense(1),
    ]
  )
  optimizer = de.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(LEARNING_RATE))

  def forward(dense, sparse, weights):
    pooled = []
    for f, layer in enumerate(layers):
      rows = layer(sparse[f])
      if f in MULTI_HOT:
        w = weights[f][..., None]
        rows = tf.reduce_sum(rows * w, axis=1) / tf.reduce_sum(w, axis=1)
      pooled.append(rows)
    return top(tf.concat([tf.nn.relu(bottom(dense)), *pooled], axis=1))[:, 0]

  @tf.function
  def step(dense, sparse, weights, labels):
    with tf.GradientTape() as tape:
      logits = forward(dense, sparse, weights)
      loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits))
    variables = [v for layer in layers for v in layer.trainable_variables]
    variables += bottom.trainable_variables + top.trainable_variables
    optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
    return loss

  def prepare(examples):
    sparse = [tf.constant(examples[f"f{f}"]) for f in range(sizes.features)]
    weights = {f: tf.constant(examples[f"w{f}"]) for f in MULTI_HOT}
    return tf.constant(examples["dense"]), sparse, weights, tf.constant(examples["labels"])

  def run(prepared):
    return float(step(*prepared))

  def info():
    import tensorflow_recommenders_addons as tfra

    rows = sum(int(layer.params.size()) for layer in layers)
    versions = f"TensorFlow {tf.__version__}, TFRA {tfra.__version__}"
    return {"bytes": rows * per_row, "rows": rows, "versions": versions}

  return prepare, run, info


SYSTEMS = {"jaxres": jaxres, "torchrec": torchrec, "tfra": tfra}


def measure(system: str, warmup: int, steps: int, seed: int, sizes: Sizes) -> dict:
  """Microseconds per step (the median of ``steps`` after ``warmup`` untimed ones), per example, the
  bytes and rows of the embedding tables, and the losses."""
  prepare, run, info = SYSTEMS[system](sizes)
  losses, times = [], []
  for step in range(warmup + steps):
    prepared = prepare(sizes.examples(seed, step))
    start = time.perf_counter()
    losses.append(run(prepared))
    if step >= warmup:
      times.append(time.perf_counter() - start)
  if not np.all(np.isfinite(losses)):
    raise RuntimeError(f"{system}: a loss is not finite: {losses}")
  us = statistics.median(times) * 1e6
  held = info() if callable(info) else info
  return {"us_per_step": us, "us_per_example": us / sizes.batch, **held, "losses": losses}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("system", choices=sorted(SYSTEMS))
  parser.add_argument("--warmup", type=int, default=20)
  parser.add_argument("--steps", type=int, default=30)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--batch", type=int, default=Sizes.batch)
  parser.add_argument("--rows", type=int, default=Sizes.rows, help="a hashed table's rows at most")
  parser.add_argument("--features", type=int, default=Sizes.features, help="the first features only")
  args = parser.parse_args()
  try:
    result = measure(
      args.system, args.warmup, args.steps, args.seed, Sizes(args.batch, args.rows, args.features)
    )
  except ImportError as err:
    result = {"error": f"not installed here ({err})"}
  print(json.dumps(result))


if __name__ == "__main__":
  main()
