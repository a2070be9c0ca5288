"""One peer's embedding training step, timed in a process of its own.

``python -m benchmarks.step_peers PEER --stream IDS.npy --capacities 65536,... --warmup 80 --steps 40``
prints one JSON line: ``{capacity: microseconds per step}`` (the median of
the timed steps), or ``{"error": ...}`` when the peer cannot run here.

Every peer trains the same model on the same ids: ``int64`` ids (a row of
``IDS.npy`` per step), an embedding of ``FEATURES`` floats per id, Adam
(learning rate 1e-3) on the rows a step uses, a linear head, a mean squared
error against a label of 1. A step ends when its loss is on the host. Each
peer runs in its fastest idiomatic form (see each builder). This module
imports only NumPy and the peer's own framework: TF Recommenders-Addons pins
its TensorFlow, so it runs from an environment of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import numpy as np

FEATURES = 32
LEARNING_RATE = 1e-3


def jaxres(capacity: int):
  """``jr.DynamicEmbedding`` with row-wise Adam and LRU eviction, in an ``nnx.jit`` step (model donated).

  The step is called through ``nnx.cached_partial``, as Flax's performance
  guide advises for training loops: it saves the Python walk over the model's
  graph at each call.
  """
  import functools

  import jax.numpy as jnp
  import optax
  from flax import nnx

  import jaxres as jr

  adam = optax.adam(LEARNING_RATE)

  class Model(nnx.Module):
    def __init__(self):
      self.emb = jr.DynamicEmbedding(capacity, FEATURES, optimizer=adam, eviction=jr.LRU(), rngs=nnx.Rngs(0))
      self.head = nnx.Linear(FEATURES, 1, rngs=nnx.Rngs(1))

  @functools.partial(nnx.jit, donate_argnums=(0, 1))
  def step(model, optimizer, ids):
    rows = model.emb(ids)

    def loss_fn(model, rows):
      return jnp.mean((model.head(rows)[:, 0] - 1.0) ** 2)

    loss, (grads, row_grads) = nnx.value_and_grad(loss_fn, argnums=(0, 1))(model, rows)
    optimizer.update(model, grads)
    model.emb.apply_gradients(ids, row_grads)
    return loss

  model = Model()
  optimizer = nnx.Optimizer(model, adam, wrt=nnx.Param)
  cached = nnx.cached_partial(step, model, optimizer)
  return jr.keys.split64, lambda ids: float(cached(ids))


def xla(capacity: int):
  """The floor in JAX: one fused lookup and row update written directly in XLA.

  Ids hashed to rows of dense arrays (no keys kept, collisions share a row),
  the rows gathered, the gradients of repeated ids summed (sorted segments),
  Adam applied to the rows used and scattered back; arrays donated.
  """
  import functools

  import jax
  import jax.numpy as jnp

  import jaxres as jr

  b1, b2, eps = 0.9, 0.999, 1e-8

  @functools.partial(jax.jit, donate_argnums=0)
  def step(state, ids):
    rows_of = (jr.keys.hash(ids, jnp.int64) % jnp.uint32(capacity)).astype(jnp.int32)
    n = rows_of.shape[0]

    def loss_fn(head, rows):
      return jnp.mean((rows @ head["w"] + head["b"] - 1.0) ** 2)

    rows = state["row"][rows_of]
    loss, (head_grads, row_grads) = jax.value_and_grad(loss_fn, argnums=(0, 1))(state["head"], rows)
    order = jnp.argsort(rows_of)
    sorted_rows = rows_of[order]
    first = jnp.concatenate([jnp.ones(1, bool), sorted_rows[1:] != sorted_rows[:-1]])
    segment = jnp.cumsum(first) - 1
    grads = jax.ops.segment_sum(row_grads[order], segment, n, indices_are_sorted=True)
    target = jnp.full(n, capacity, jnp.int32).at[segment].set(sorted_rows)  # one row per segment
    used = jnp.minimum(target, capacity - 1)
    count = state["count"][used] + 1
    mu = b1 * state["mu"][used] + (1 - b1) * grads
    nu = b2 * state["nu"][used] + (1 - b2) * grads * grads
    scale = (jnp.sqrt(1 - b2**count) / (1 - b1**count))[:, None]
    new_rows = state["row"][used] - LEARNING_RATE * scale * mu / (jnp.sqrt(nu) + eps)
    updated = {
      name: state[name].at[target].set(value, mode="drop", unique_indices=True)
      for name, value in (("row", new_rows), ("mu", mu), ("nu", nu), ("count", count))
    }
    head = jax.tree.map(lambda p, g: p - LEARNING_RATE * g, state["head"], head_grads)
    return {**updated, "head": head}, loss

  state = {
    "row": 0.01 * jax.random.normal(jax.random.key(0), (capacity, FEATURES)),
    "mu": jnp.zeros((capacity, FEATURES)),
    "nu": jnp.zeros((capacity, FEATURES)),
    "count": jnp.zeros(capacity, jnp.float32),
    "head": {"w": jnp.zeros(FEATURES), "b": jnp.zeros(())},
  }
  holder = [state]

  def run(ids):
    holder[0], loss = step(holder[0], ids)
    return float(loss)

  return jr.keys.split64, run


def dense(capacity: int):
  """What a JAX user writes today: an ``nnx.Embed`` over ids hashed to rows, trained by ``optax.adam``.

  Its gradient and Adam's moments cover every row, so the step grows with
  the capacity.
  """
  import functools

  import jax.numpy as jnp
  import optax
  from flax import nnx

  import jaxres as jr

  adam = optax.adam(LEARNING_RATE)

  class Model(nnx.Module):
    def __init__(self):
      self.emb = nnx.Embed(capacity, FEATURES, rngs=nnx.Rngs(0))
      self.head = nnx.Linear(FEATURES, 1, rngs=nnx.Rngs(1))

  @functools.partial(nnx.jit, donate_argnums=(0, 1))
  def step(model, optimizer, ids):
    rows_of = (jr.keys.hash(ids, jnp.int64) % jnp.uint32(capacity)).astype(jnp.int32)

    def loss_fn(model):
      return jnp.mean((model.head(model.emb(rows_of))[:, 0] - 1.0) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  model = Model()
  optimizer = nnx.Optimizer(model, adam, wrt=nnx.Param)
  cached = nnx.cached_partial(step, model, optimizer)
  return jr.keys.split64, lambda ids: float(cached(ids))


def _tfra(capacity: int, restrict: bool):
  """TF Recommenders-Addons ``dynamic_embedding`` (CPU cuckoo table) with its Adam, in a ``tf.function``.

  With ``restrict``, a ``TimestampRestrictPolicy`` keeps the table at
  ``capacity`` ids: after each step, the oldest ids beyond it are dropped once
  the table holds a step's worth of ids more (4096).
  """
  os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  import tensorflow as tf
  import tensorflow_recommenders_addons.dynamic_embedding as de

  emb = de.keras.layers.Embedding(
    FEATURES,
    key_dtype=tf.int64,
    value_dtype=tf.float32,
    initializer=tf.keras.initializers.RandomNormal(0.0, 0.01, seed=0),
    devices=["/CPU:0"],
    init_capacity=capacity,
    restrict_policy=de.TimestampRestrictPolicy if restrict else None,
    name="emb",
  )
  head = tf.keras.layers.Dense(1)
  optimizer = de.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(LEARNING_RATE))

  @tf.function
  def step(ids):
    with tf.GradientTape() as tape:
      rows = emb(ids)
      loss = tf.reduce_mean((head(rows)[:, 0] - 1.0) ** 2)
    variables = emb.trainable_variables + head.trainable_variables
    optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
    return loss

  @tf.function
  def restricted(ids):
    loss = step(ids)
    with tf.control_dependencies([loss]):
      emb.params.restrict(capacity, trigger=capacity + 4096)
    return loss

  return tf.constant, lambda ids: float((restricted if restrict else step)(ids))


def tfra(capacity: int):
  return _tfra(capacity, restrict=False)


def tfra_restrict(capacity: int):
  return _tfra(capacity, restrict=True)


def torch_sparse_adam(capacity: int):
  """PyTorch ``nn.Embedding(sparse=True)`` over ids hashed to rows, trained by ``SparseAdam``."""
  import torch

  torch.manual_seed(0)
  emb = torch.nn.Embedding(capacity, FEATURES, sparse=True)
  torch.nn.init.normal_(emb.weight, 0.0, 0.01)
  head = torch.nn.Linear(FEATURES, 1)
  sparse = torch.optim.SparseAdam(emb.parameters(), lr=LEARNING_RATE)
  dense = torch.optim.Adam(head.parameters(), lr=LEARNING_RATE)

  def step(ids):
    rows = emb(torch.remainder(ids, capacity))
    loss = ((head(rows)[:, 0] - 1.0) ** 2).mean()
    sparse.zero_grad()
    dense.zero_grad()
    loss.backward()
    sparse.step()
    dense.step()
    return loss.item()

  return torch.from_numpy, step


def process_group():
  """A one-process gloo group, which TorchRec's sharded modules need."""
  import torch.distributed as dist

  if not dist.is_initialized():
    with socket.socket() as s:
      s.bind(("localhost", 0))
      port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)


def torchrec_sharded(capacity: int):
  """TorchRec's sharded ``EmbeddingCollection`` over ids hashed to rows, fused row-wise Adagrad.

  FBGEMM's CPU kernels fuse only Adagrad-family optimizers into the backward
  pass (no Adam on CPU), so this peer runs exact row-wise Adagrad.
  """
  import torch
  import torchrec
  from torchrec.distributed.model_parallel import DistributedModelParallel
  from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

  process_group()
  torch.manual_seed(0)
  config = torchrec.EmbeddingConfig(
    name="table", embedding_dim=FEATURES, num_embeddings=capacity, feature_names=["ids"]
  )
  collection = torchrec.EmbeddingCollection(tables=[config], device=torch.device("meta"))
  apply_optimizer_in_backward(torchrec.optim.RowWiseAdagrad, collection.parameters(), {"lr": LEARNING_RATE})
  sharded = DistributedModelParallel(collection, device=torch.device("cpu"))
  head = torch.nn.Linear(FEATURES, 1)
  dense = torch.optim.Adam(head.parameters(), lr=LEARNING_RATE)

  def prepare(ids):
    ids = torch.remainder(torch.from_numpy(ids), capacity)
    lengths = torch.ones(ids.shape[0], dtype=torch.int32)
    return torchrec.KeyedJaggedTensor.from_lengths_sync(keys=["ids"], values=ids, lengths=lengths)

  def step(features):
    rows = sharded(features)["ids"].values()
    loss = ((head(rows)[:, 0] - 1.0) ** 2).mean()
    dense.zero_grad()
    loss.backward()
    dense.step()
    return loss.item()

  return prepare, step


def torchrec_managed(capacity: int):
  """TorchRec's managed-collision ``EmbeddingCollection`` (ids remapped to rows, LFU eviction) + Adam.

  Unsharded, as its CPU path allows: the embedding's gradient is dense, and
  ``torch.optim.Adam`` updates every row.
  """
  import torch
  import torchrec
  from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection
  from torchrec.modules.mc_modules import (
    DistanceLFU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
  )

  torch.manual_seed(0)
  config = torchrec.EmbeddingConfig(
    name="table", embedding_dim=FEATURES, num_embeddings=capacity, feature_names=["ids"]
  )
  collection = torchrec.EmbeddingCollection(tables=[config], device=torch.device("cpu"))
  remap = MCHManagedCollisionModule(
    zch_size=capacity,
    device=torch.device("cpu"),
    eviction_policy=DistanceLFU_EvictionPolicy(),
    eviction_interval=1,
  )
  managed = ManagedCollisionEmbeddingCollection(
    collection, ManagedCollisionCollection({"table": remap}, [config]), return_remapped_features=False
  )
  head = torch.nn.Linear(FEATURES, 1)
  optimizer = torch.optim.Adam([*managed.parameters(), *head.parameters()], lr=LEARNING_RATE)

  def prepare(ids):
    ids = torch.from_numpy(ids) & ((1 << 62) - 1)  # the module's input range is [0, 2^63 - 1)
    lengths = torch.ones(ids.shape[0], dtype=torch.int32)
    return torchrec.KeyedJaggedTensor.from_lengths_sync(keys=["ids"], values=ids, lengths=lengths)

  def step(features):
    out = managed(features)
    rows = (out[0] if isinstance(out, tuple) else out)["ids"].values()
    loss = ((head(rows)[:, 0] - 1.0) ** 2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()

  return prepare, step


PEERS = {
  "jaxres": jaxres,
  "xla": xla,
  "dense": dense,
  "tfra": tfra,
  "tfra-restrict": tfra_restrict,
  "torch-sparse-adam": torch_sparse_adam,
  "torchrec-sharded": torchrec_sharded,
  "torchrec-managed": torchrec_managed,
}


def measure(peer: str, stream: np.ndarray, capacities: list[int], warmup: int, steps: int) -> dict:
  """Microseconds per step at each capacity: the median of ``steps`` steps after ``warmup`` untimed ones."""
  result = {}
  for capacity in capacities:
    prepare, step = PEERS[peer](capacity)
    batches = [prepare(ids) for ids in stream[: warmup + steps]]
    for batch in batches[:warmup]:
      step(batch)
    times = []
    for batch in batches[warmup:]:
      start = time.perf_counter()
      loss = step(batch)
      times.append(time.perf_counter() - start)
    if not np.isfinite(loss):
      raise RuntimeError(f"{peer}: the loss is {loss} at capacity {capacity}")
    result[str(capacity)] = statistics.median(times) * 1e6
  return result


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("peer", choices=sorted(PEERS))
  parser.add_argument("--stream", required=True, help="int64[steps, batch] ids, .npy")
  parser.add_argument("--capacities", required=True, help="comma-separated")
  parser.add_argument("--warmup", type=int, default=80)
  parser.add_argument("--steps", type=int, default=40)
  args = parser.parse_args()
  stream = np.load(args.stream)
  capacities = [int(c) for c in args.capacities.split(",")]
  try:
    result = measure(args.peer, stream, capacities, args.warmup, args.steps)
  except ImportError as err:
    result = {"error": f"not installed here ({err})"}
  print(json.dumps(result))


if __name__ == "__main__":
  main()
