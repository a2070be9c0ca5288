"""One system's click model, trained on a stream of batches in a process of its own: its losses.

``python -m benchmarks.quality_peers PEER --data BATCHES.npz --budget BYTES --seed S [--train-steps N]``
prints one JSON line: ``{"losses": [...], "test": [...], "bytes": ..., "rows": ...}``, or
``{"error": ...}`` when the peer cannot run here.

Every peer trains the same model on the same examples: ``fields`` ``int64``
ids per example (``ids[step]`` of ``BATCHES.npz``), an embedding of
``FEATURES`` floats per id, the concatenated rows through a hidden layer of
``HIDDEN`` (ReLU) to one logit, binary cross-entropy against ``labels[step]``,
Adam (learning rate ``LEARNING_RATE``) on every parameter. ``losses[t]`` is
the loss of batch ``t`` before the step trains on it (progressive
validation), for the first ``N`` batches; the later ones are the test: the
model only predicts them (inference mode, nothing inserted or trained), and
``test`` holds each test example's loss. Each peer gets ``BYTES`` of
embedding state, optimizer state included, and takes as many rows as fit (its
own accounting, in its builder's docstring). This module imports only NumPy
and the peer's own framework (TF Recommenders-Addons pins its TensorFlow and
runs from an environment of its own).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

FEATURES = 16
HIDDEN = 64
LEARNING_RATE = 0.01
INIT = 0.05  # the peers' rows start at normal(INIT); jaxres's at its own default unless told
ADAM_BYTES = FEATURES * 4 * 3  # a hashed row and its Adam moments


class Peer(NamedTuple):
  step: Callable  # (ids int64[B, F], labels float32[B]) -> the batch's loss before the step
  evaluate: Callable  # (ids, labels) -> float32[B]: each example's loss, nothing changed
  bytes: int
  rows: int


def _nnx_peer(embedding, seed: int, fields: int, value_and_grad, used: int, rows: int) -> Peer:
  """The click model over ``embedding(rngs)`` (ids -> rows) in NNX, trained by ``value_and_grad(loss)``
  and Adam (``nnx.jit``, model donated); the test calls ``model.eval()`` first (inference mode)."""
  import optax
  from flax import nnx

  import jaxres as jr

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.emb = embedding(rngs)
      self.hidden = nnx.Linear(fields * FEATURES, HIDDEN, rngs=rngs)
      self.output = nnx.Linear(HIDDEN, 1, rngs=rngs)

    def __call__(self, ids):
      x = self.emb(ids)
      return self.output(nnx.relu(self.hidden(x.reshape(x.shape[0], -1))))[:, 0]

  def losses(model, ids, labels):
    return optax.sigmoid_binary_cross_entropy(model(ids), labels)

  @nnx.jit(donate_argnums=(0, 1))
  def train(model, optimizer, ids, labels):
    loss, grads = value_and_grad(lambda m: losses(m, ids, labels).mean())(model)
    optimizer.update(model, grads)
    return loss

  model = Model(nnx.Rngs(seed))
  optimizer = nnx.Optimizer(model, optax.adam(LEARNING_RATE), wrt=nnx.Param)
  predict = nnx.jit(losses)

  def step(ids, labels):
    return train(model, optimizer, jr.keys.split64(ids), labels)

  def evaluate(ids, labels):
    model.eval()  # a jaxres embedding then only reads: nothing inserted, counted or trained
    return np.asarray(predict(model, jr.keys.split64(ids), labels))

  return Peer(step, evaluate, used, rows)


def jaxres(budget: int, seed: int, fields: int, *, row_optimizer: str = "catch_up", **options):
  """``jr.DynamicEmbedding`` with its defaults but ``options`` (``eviction`` by name: ``"lru"``,
  ``"lfu"``, ``"lrfu"``, ``"lrfu-<half life>"`` or ``None``), trained with the plain NNX step
  (``jr.value_and_grad``).

  ``row_optimizer``: ``"catch_up"`` (``jr.CatchUpAdam``, the one the guide
  recommends first) or ``"lazy"`` (``optax.adam`` row by row). Its bytes are
  ``memory()``'s (the table with its keys, rows, moments, scores and change
  stamps; the admission counts; the step): the capacity is
  ``jr.DynamicEmbedding.capacity_for(budget, ...)``, the largest that fits.
  """
  import optax
  from flax import nnx

  import jaxres as jr

  rows_adam = jr.CatchUpAdam(LEARNING_RATE) if row_optimizer == "catch_up" else optax.adam(LEARNING_RATE)
  if "eviction" in options:  # given by name: the policies are made here, where jaxres is imported
    name, _, half_life = (options["eviction"] or "none").partition("-")  # "lrfu-256": half_life=256
    policies = {"lru": jr.LRU, "lfu": jr.LFU, "lrfu": jr.LRFU, "none": lambda: None}
    options["eviction"] = policies[name](int(half_life)) if half_life else policies[name]()
  capacity = jr.DynamicEmbedding.capacity_for(budget, FEATURES, optimizer=rows_adam, **options)
  embedding = lambda rngs: jr.DynamicEmbedding(capacity, FEATURES, optimizer=rows_adam, rngs=rngs, **options)
  used = sum(jr.DynamicEmbedding.memory(nnx.eval_shape(lambda: embedding(nnx.Rngs(0)))).values())
  return _nnx_peer(embedding, seed, fields, jr.value_and_grad, used, capacity)


def dense(budget: int, seed: int, fields: int):
  """What a JAX user writes today: an ``nnx.Embed`` over ids hashed to rows, ``optax.adam``
  (``nnx.value_and_grad``).

  Bytes: a row and its two moments per row (``budget // (FEATURES * 12)`` rows).
  """
  import jax.numpy as jnp
  from flax import nnx

  import jaxres as jr

  rows = budget // ADAM_BYTES

  class Hashed(nnx.Module):
    def __init__(self, rngs):
      self.table = nnx.Embed(rows, FEATURES, embedding_init=nnx.initializers.normal(INIT), rngs=rngs)

    def __call__(self, ids):
      return self.table((jr.keys.hash(ids, jnp.int64) % jnp.uint32(rows)).astype(jnp.int32))

  return _nnx_peer(Hashed, seed, fields, nnx.value_and_grad, rows * ADAM_BYTES, rows)


def _torch_head(fields: int):
  import torch

  return torch.nn.Sequential(
    torch.nn.Linear(fields * FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 1)
  )


def _torch_peer(lookup, modules, head, used: int, rows: int) -> Peer:
  """``lookup(ids) -> rows`` and the head, trained by ``torch.optim.Adam`` on every parameter; the
  test runs them in eval mode without gradients (a managed collision module then remaps nothing)."""
  import torch

  parameters = [p for m in (*modules, head) for p in m.parameters()]
  optimizer = torch.optim.Adam(parameters, lr=LEARNING_RATE)
  loss_fn = torch.nn.BCEWithLogitsLoss(reduction="none")

  def losses(ids, labels):
    rows = lookup(ids)
    return loss_fn(head(rows.reshape(rows.shape[0], -1))[:, 0], torch.from_numpy(labels))

  def step(ids, labels):
    loss = losses(ids, labels).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()

  def evaluate(ids, labels):
    for module in (*modules, head):
      module.eval()
    with torch.no_grad():
      return losses(ids, labels).numpy()

  return Peer(step, evaluate, used, rows)


def _hashed(ids: np.ndarray, rows: int) -> np.ndarray:
  """Ids to rows of a hashed table: a 64-bit mix of the id, modulo ``rows`` (no structure kept)."""
  x = ids.view(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
  return ((x ^ (x >> np.uint64(29))) % np.uint64(rows)).astype(np.int64)


def torch_hashed(budget: int, seed: int, fields: int):
  """PyTorch ``nn.Embedding`` over ids hashed to rows, ``torch.optim.Adam`` (dense: every row).

  Bytes: a row and its two moments per row.
  """
  import torch

  torch.manual_seed(seed)
  rows = budget // ADAM_BYTES
  emb = torch.nn.Embedding(rows, FEATURES)
  torch.nn.init.normal_(emb.weight, 0.0, INIT)
  lookup = lambda ids: emb(torch.from_numpy(_hashed(ids, rows)))
  return _torch_peer(lookup, [emb], _torch_head(fields), rows * ADAM_BYTES, rows)


def torchrec_hashed(budget: int, seed: int, fields: int):
  """TorchRec ``EmbeddingCollection`` (one table shared by the fields) over hashed ids, Adam.

  Unsharded, as on one CPU: its weights are a parameter ``torch.optim.Adam``
  updates whole. Bytes: a row and its two moments per row.
  """
  import torch
  import torchrec

  torch.manual_seed(seed)
  rows = budget // ADAM_BYTES
  names = [f"f{i}" for i in range(fields)]
  config = torchrec.EmbeddingConfig(
    name="table", embedding_dim=FEATURES, num_embeddings=rows, feature_names=names
  )
  collection = torchrec.EmbeddingCollection(tables=[config], device=torch.device("cpu"))
  for weight in collection.parameters():
    torch.nn.init.normal_(weight, 0.0, INIT)

  def lookup(ids):
    values = torch.from_numpy(_hashed(ids.T.reshape(-1).copy(), rows))
    lengths = torch.ones(values.shape[0], dtype=torch.int32)
    features = torchrec.KeyedJaggedTensor.from_lengths_sync(keys=names, values=values, lengths=lengths)
    out = collection(features)
    return torch.stack([out[name].values() for name in names], dim=1)

  return _torch_peer(lookup, [collection], _torch_head(fields), rows * ADAM_BYTES, rows)


def torchrec_managed(budget: int, seed: int, fields: int):
  """TorchRec's managed-collision ``EmbeddingCollection``: ids remapped to rows, LFU eviction, Adam.

  Bytes: a row and its two moments per row, plus the remapping module's
  buffers (its sorted ids and their counts), measured on the module.
  """
  import torch
  import torchrec
  from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection
  from torchrec.modules.mc_modules import (
    DistanceLFU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
  )

  names = [f"f{i}" for i in range(fields)]

  def build(rows):
    torch.manual_seed(seed)
    config = torchrec.EmbeddingConfig(
      name="table", embedding_dim=FEATURES, num_embeddings=rows, feature_names=names
    )
    collection = torchrec.EmbeddingCollection(tables=[config], device=torch.device("cpu"))
    for weight in collection.parameters():
      torch.nn.init.normal_(weight, 0.0, INIT)
    remap = MCHManagedCollisionModule(
      zch_size=rows,
      device=torch.device("cpu"),
      eviction_policy=DistanceLFU_EvictionPolicy(),
      eviction_interval=1,
    )
    managed = ManagedCollisionEmbeddingCollection(
      collection, ManagedCollisionCollection({"table": remap}, [config]), return_remapped_features=False
    )
    extra = sum(b.numel() * b.element_size() for b in managed.buffers())
    return managed, rows * ADAM_BYTES + extra

  _, probe = build(4096)
  rows = int(budget // (probe / 4096))
  managed, used = build(rows)
  while used > budget:
    rows -= 64
    managed, used = build(rows)

  def lookup(ids):
    values = torch.from_numpy(ids.T.reshape(-1).copy()) & ((1 << 62) - 1)  # its range: [0, 2^63 - 1)
    lengths = torch.ones(values.shape[0], dtype=torch.int32)
    out = managed(torchrec.KeyedJaggedTensor.from_lengths_sync(keys=names, values=values, lengths=lengths))
    out = out[0] if isinstance(out, tuple) else out
    return torch.stack([out[name].values() for name in names], dim=1)

  return _torch_peer(lookup, [managed], _torch_head(fields), used, rows)


def tfra_restrict(budget: int, seed: int, fields: int):
  """TF Recommenders-Addons ``dynamic_embedding`` with Adam and a ``TimestampRestrictPolicy``.

  The policy keeps the table at ``rows`` ids: after each step the oldest ids
  beyond it go once it holds ``slack`` ids more (4096, or a quarter of what
  the budget holds if less; a step brings at most 2048 new ids here). Bytes: each id is a key (8)
  and a row in the embedding's table and in each of Adam's two slot tables,
  and a timestamp (4, with its key) in the policy's: ``3 * (8 + 64) + 12``
  per id, at the ``rows + trigger`` ids the table can reach.
  """
  os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  import tensorflow as tf
  import tensorflow_recommenders_addons.dynamic_embedding as de

  tf.random.set_seed(seed)
  per_id = 3 * (8 + FEATURES * 4) + 12
  slack = min(4096, budget // per_id // 4)  # at least a step's new ids on every task here
  rows = budget // per_id - slack
  emb = de.keras.layers.Embedding(
    FEATURES,
    key_dtype=tf.int64,
    value_dtype=tf.float32,
    initializer=tf.keras.initializers.RandomNormal(0.0, INIT, seed=seed),
    devices=["/CPU:0"],
    init_capacity=rows,
    restrict_policy=de.TimestampRestrictPolicy,
    name="emb",
  )
  hidden, output = tf.keras.layers.Dense(HIDDEN, activation="relu"), tf.keras.layers.Dense(1)
  optimizer = de.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(LEARNING_RATE))

  def losses(ids, labels):
    x = tf.reshape(emb(ids), [tf.shape(ids)[0], fields * FEATURES])
    return tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=output(hidden(x))[:, 0])

  @tf.function
  def train(ids, labels):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(losses(ids, labels))
    variables = emb.trainable_variables + hidden.trainable_variables + output.trainable_variables
    optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
    return loss

  @tf.function
  def restricted(ids, labels):  # a function of its own: train's first call creates the slots
    loss = train(ids, labels)
    with tf.control_dependencies([loss]):
      emb.params.restrict(rows, trigger=rows + slack)
    return loss

  predict = tf.function(losses)  # a lookup inserts nothing: ids are placed by the optimizer's step

  def step(ids, labels):
    return float(restricted(tf.constant(ids), tf.constant(labels)))

  def evaluate(ids, labels):
    return predict(tf.constant(ids), tf.constant(labels)).numpy()

  return Peer(step, evaluate, (rows + slack) * per_id, rows)


PEERS = {
  "jaxres": functools.partial(jaxres),
  "jaxres-lazy": functools.partial(jaxres, row_optimizer="lazy"),
  "jaxres-lru": functools.partial(jaxres, eviction="lru"),
  "jaxres-admission": functools.partial(jaxres, min_count=2),
  "dense": dense,
  "torch-hashed": torch_hashed,
  "torchrec-hashed": torchrec_hashed,
  "torchrec-managed": torchrec_managed,
  "tfra-restrict": tfra_restrict,
}


def train(peer: str, ids: np.ndarray, labels: np.ndarray, budget: int, seed: int, train_steps: int) -> dict:
  """The peer's progressive loss on the first ``train_steps`` batches, the test losses of each
  example of the others, its bytes and rows."""
  built = PEERS[peer](budget, seed, ids.shape[-1])
  losses = [built.step(ids[t], labels[t]) for t in range(train_steps)]
  test = [built.evaluate(ids[t], labels[t]) for t in range(train_steps, ids.shape[0])]
  return {
    "losses": [float(x) for x in np.asarray(losses, np.float32)],
    "test": [float(x) for x in np.concatenate(test)] if test else [],
    "bytes": int(built.bytes),
    "rows": int(built.rows),
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("peer", choices=sorted(PEERS))
  parser.add_argument("--data", required=True, help=".npz of ids int64[steps, batch, fields], labels")
  parser.add_argument("--budget", type=int, required=True, help="bytes of embedding state")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--train-steps", type=int, help="batches trained on (default: all); the rest test")
  args = parser.parse_args()
  data = np.load(args.data)
  ids, labels = data["ids"], data["labels"].astype(np.float32)
  steps = ids.shape[0] if args.train_steps is None else args.train_steps
  try:
    result = train(args.peer, ids, labels, args.budget, args.seed, steps)
  except ImportError as err:
    result = {"error": f"not installed here ({err})"}
  print(json.dumps(result))


if __name__ == "__main__":
  main()
