"""One system's click model, trained on a stream of batches in a process of its own: its losses.

``python -m benchmarks.quality_peers PEER --data BATCHES.npz --budget BYTES --seed S``
prints one JSON line: ``{"losses": [...], "bytes": ..., "rows": ...}``, or
``{"error": ...}`` when the peer cannot run here.

Every peer trains the same model on the same examples: ``FIELDS`` ``int64``
ids per example (``ids[step]`` of ``BATCHES.npz``), an embedding of
``FEATURES`` floats per id, the concatenated rows through a hidden layer of
``HIDDEN`` (ReLU) to one logit, binary cross-entropy against ``labels[step]``,
Adam (learning rate ``LEARNING_RATE``) on every parameter, embedding rows
initialised from ``normal(0.05)``. Each peer gets ``BYTES`` of embedding
state, optimizer state included, and takes as many rows as fit (its own
accounting, in its builder's docstring). This module imports only NumPy and
the peer's own framework (TF Recommenders-Addons pins its TensorFlow and
runs from an environment of its own).
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

FEATURES = 16
HIDDEN = 64
LEARNING_RATE = 0.01
INIT = 0.05
ADAM_BYTES = FEATURES * 4 * 3  # a hashed row and its Adam moments


def jaxres(budget: int, seed: int, fields: int, lazy: bool = False):
  """``jr.DynamicEmbedding`` (LRU, ``min_count=2``, ``jr.CatchUpAdam``) of :mod:`jaxres.examples`.

  Its bytes are those of every array of the embedding (the table with its
  keys, rows, moments, scores and change stamps; the admission counts of
  half as many ids; the step), measured on the module, so the capacity is
  the largest that fits. (Counts of half as many ids as rows measured best:
  a quarter loses ids' first occurrences, as many costs rows.)
  """
  import jax
  from flax import nnx

  import jaxres as jr
  from jaxres.examples import ClickModel, train_step
  from jaxres.examples.training import adam

  optimizer = adam(LEARNING_RATE) if lazy else jr.CatchUpAdam(LEARNING_RATE)

  def build(capacity):
    return ClickModel(
      capacity,
      num_fields=fields,
      optimizer=optimizer,
      features=FEATURES,
      hidden=HIDDEN,
      admission_capacity=max(1, capacity // 2),
      rngs=nnx.Rngs(seed),
    )

  def size(capacity):
    return sum(x.nbytes for x in jax.tree.leaves(nnx.state(build(capacity).embedding)))

  per_row = size(1 << 12) / (1 << 12)
  capacity = int(budget // per_row)
  while size(capacity) > budget:
    capacity -= 64
  model = build(capacity)
  dense = nnx.Optimizer(model, adam(LEARNING_RATE), wrt=nnx.Param)

  def step(ids, labels):
    return train_step(model, dense, jr.keys.split64(ids), labels)

  def finish(losses):
    return [float(x) for x in jax.device_get(losses)]

  return step, finish, size(capacity), capacity


def jaxres_lazy(budget: int, seed: int, fields: int):
  """As ``jaxres``, with lazy row-wise Adam (``optax.adam``) instead of ``jr.CatchUpAdam``."""
  return jaxres(budget, seed, fields, lazy=True)


def dense(budget: int, seed: int, fields: int):
  """What a JAX user writes today: an ``nnx.Embed`` over ids hashed to rows, ``optax.adam``.

  Bytes: a row and its two moments per row (``budget // (FEATURES * 12)`` rows).
  """
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx

  import jaxres as jr

  rows = budget // ADAM_BYTES

  class Model(nnx.Module):
    def __init__(self):
      rngs = nnx.Rngs(seed)
      self.emb = nnx.Embed(rows, FEATURES, embedding_init=nnx.initializers.normal(INIT), rngs=rngs)
      self.hidden = nnx.Linear(fields * FEATURES, HIDDEN, rngs=rngs)
      self.output = nnx.Linear(HIDDEN, 1, rngs=rngs)

    def __call__(self, ids):
      x = self.emb((jr.keys.hash(ids, jnp.int64) % jnp.uint32(rows)).astype(jnp.int32))
      return self.output(nnx.relu(self.hidden(x.reshape(x.shape[0], -1))))[:, 0]

  @nnx.jit(donate_argnums=(0, 1))
  def train(model, optimizer, ids, labels):
    def loss(m):
      return optax.sigmoid_binary_cross_entropy(m(ids), labels).mean()

    value, grads = nnx.value_and_grad(loss)(model)
    optimizer.update(model, grads)
    return value

  model = Model()
  optimizer = nnx.Optimizer(model, optax.adam(LEARNING_RATE), wrt=nnx.Param)

  def step(ids, labels):
    return train(model, optimizer, jr.keys.split64(ids), labels)

  return step, lambda losses: [float(x) for x in jax.device_get(losses)], rows * ADAM_BYTES, rows


def _torch_head(fields: int):
  import torch

  return torch.nn.Sequential(
    torch.nn.Linear(fields * FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 1)
  )


def _torch_step(lookup, parameters, head):
  import torch

  optimizer = torch.optim.Adam([*parameters, *head.parameters()], lr=LEARNING_RATE)
  loss_fn = torch.nn.BCEWithLogitsLoss()

  def step(ids, labels):
    rows = lookup(ids)
    loss = loss_fn(head(rows.reshape(rows.shape[0], -1))[:, 0], torch.from_numpy(labels))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()

  return step


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
  step = _torch_step(
    lambda ids: emb(torch.from_numpy(_hashed(ids, rows))), emb.parameters(), _torch_head(fields)
  )
  return step, list, rows * ADAM_BYTES, rows


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

  return _torch_step(lookup, collection.parameters(), _torch_head(fields)), list, rows * ADAM_BYTES, rows


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

  return _torch_step(lookup, managed.parameters(), _torch_head(fields)), list, used, rows


def tfra_restrict(budget: int, seed: int, fields: int):
  """TF Recommenders-Addons ``dynamic_embedding`` with Adam and a ``TimestampRestrictPolicy``.

  The policy keeps the table at ``rows`` ids: after each step the oldest ids
  beyond it go once it holds a step's ids more. Bytes: each id is a key (8)
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
  slack = 4096
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

  @tf.function
  def train(ids, labels):
    with tf.GradientTape() as tape:
      x = tf.reshape(emb(ids), [tf.shape(ids)[0], fields * FEATURES])
      logits = output(hidden(x))[:, 0]
      loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits))
    variables = emb.trainable_variables + hidden.trainable_variables + output.trainable_variables
    optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
    return loss

  @tf.function
  def restricted(ids, labels):  # a function of its own: train's first call creates the slots
    loss = train(ids, labels)
    with tf.control_dependencies([loss]):
      emb.params.restrict(rows, trigger=rows + slack)
    return loss

  def step(ids, labels):
    return float(restricted(tf.constant(ids), tf.constant(labels)))

  return step, list, (rows + slack) * per_id, rows


PEERS = {
  "jaxres": jaxres,
  "jaxres-lazy": jaxres_lazy,
  "dense": dense,
  "torch-hashed": torch_hashed,
  "torchrec-hashed": torchrec_hashed,
  "torchrec-managed": torchrec_managed,
  "tfra-restrict": tfra_restrict,
}


def train(peer: str, ids: np.ndarray, labels: np.ndarray, budget: int, seed: int) -> dict:
  """The peer's loss at each step of the stream, its bytes and rows."""
  step, finish, used, rows = PEERS[peer](budget, seed, ids.shape[-1])
  losses = finish([step(ids[t], labels[t]) for t in range(ids.shape[0])])
  return {"losses": losses, "bytes": int(used), "rows": int(rows)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("peer", choices=sorted(PEERS))
  parser.add_argument("--data", required=True, help=".npz of ids int64[steps, batch, fields], labels")
  parser.add_argument("--budget", type=int, required=True, help="bytes of embedding state")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  data = np.load(args.data)
  try:
    result = train(args.peer, data["ids"], data["labels"].astype(np.float32), args.budget, args.seed)
  except ImportError as err:
    result = {"error": f"not installed here ({err})"}
  print(json.dumps(result))


if __name__ == "__main__":
  main()
