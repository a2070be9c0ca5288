"""One training run of every variant that a bitwise promise compares, for ``test_compiler_flags.py``.

Run as a script, in a process whose ``XLA_FLAGS`` the test chose (the suite's own
processes compile with fewer optimisations: see ``conftest.py``). Prints one JSON
object: for each variant, each table's exported ids and the bits of its rows, and
the answers of the served export and of the model.

The variants: an :class:`jr.EmbeddingCollection` (Adam rows, LRU eviction: more
ids than rows, pooled multi-hot features) trained unsharded on the CPU kernels,
unsharded on their XLA references (what GPUs and TPUs run), and resumed from a
checkpoint halfway; and with room for every id (each shard of a sharded table
evicts its own entries, so only a table that evicts nothing can equal one of
another sharding), unsharded and sharded over 2 and over 8 devices.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxres as jr
from jaxres._core.kernels import native

STEPS, BATCH, HISTORY = 6, 16, 4
FEATURES = {"item": 4, "history": 4, "user": 3}  # the rows of each feature's table
POOL = np.arange(1, 97, dtype=np.int64) * 7919 + 2**40  # 96 ids: 48 + 24 rows evict on every step


class Model(nnx.Module):
  def __init__(self, devices: int = 1, room: int = 1):
    mesh = None if devices == 1 else jax.make_mesh((devices,), ("shard",), devices=jax.devices()[:devices])
    self.emb = jr.EmbeddingCollection(
      {
        "items": jr.TableConfig(48 * room, 4, optimizer=optax.adam(0.05), eviction=jr.LRU()),
        "users": jr.TableConfig(24 * room, 3, optimizer=optax.adam(0.05), eviction=jr.LRU()),
      },
      {
        "item": jr.FeatureConfig("items"),
        "history": jr.FeatureConfig("items", combiner="mean"),
        "user": jr.FeatureConfig("users", combiner="sqrtn"),
      },
      rngs=nnx.Rngs(0),
      mesh=mesh,
      axis=None if mesh is None else "shard",
    )


def batches():
  rng = np.random.default_rng(0)
  for _ in range(STEPS):
    weights = rng.choice([0.0, 0.5, 1.0, 2.0], (BATCH, HISTORY)).astype(np.float32)
    history = np.where(weights > 0, rng.choice(POOL, (BATCH, HISTORY)), 0)
    batch = {
      "item": jr.keys.split64(rng.choice(POOL, BATCH)),
      "history": (jr.keys.split64(history), weights),
      "user": (jr.keys.split64(rng.choice(POOL[:40], BATCH)), rng.random(BATCH).astype(np.float32)),
    }
    yield batch, {name: rng.normal(size=(BATCH, n)).astype(np.float32) for name, n in FEATURES.items()}


def loss_fn(model, batch, g):
  out = model.emb(batch)
  return sum(jnp.sum(out[name] * g[name]) for name in g)


@nnx.jit
def train_step(model, batch, g):
  return jr.value_and_grad(loss_fn)(model, batch, g)[0]


def predict(model, item, history, weights):
  out = model.emb({"item": item, "history": (history, weights)})
  return {"score": jnp.sum(out["item"] * out["history"], axis=-1), "history": out["history"]}


def trained(model, resume_at=None):
  for step, (batch, g) in enumerate(batches()):
    if step == resume_at:
      path = tempfile.mkdtemp()
      jr.Checkpoint(model=model).save(path + "/ckpt")
      model = Model()
      jr.Checkpoint(model=model).restore(path + "/ckpt").assert_consumed()
    train_step(model, batch, g)
  return model


def bits(x) -> str:
  return np.ascontiguousarray(np.asarray(x)).tobytes().hex()


def tables(model) -> dict:
  out = {}
  for name, table in model.emb.tables.items():
    ids, rows = table.export()
    order = np.argsort(np.asarray(ids), kind="stable")  # sharded tables export shard by shard
    out[name] = {"ids": np.asarray(ids)[order].tolist(), "rows": bits(np.asarray(rows)[order])}
  return out


def served_and_in_process(model) -> dict:
  signature = jr.saved_model.Signature(
    predict,
    item=jax.ShapeDtypeStruct(("batch",), jnp.int64),
    history=jax.ShapeDtypeStruct(("batch", HISTORY), jnp.int64),
    weights=jax.ShapeDtypeStruct(("batch", HISTORY), jnp.float32),
  )
  path = tempfile.mkdtemp() + "/export"
  jr.saved_model.save(model, path, {"serving_default": signature}, platforms=("cpu",))
  served = jr.saved_model.load(path)
  rng = np.random.default_rng(1)
  item, history = rng.choice(POOL, 64), rng.choice(POOL, (64, HISTORY))
  weights = rng.random((64, HISTORY)).astype(np.float32)
  model.eval()
  want = nnx.jit(predict)(model, jr.keys.split64(item), jr.keys.split64(history), weights)
  got = served.signatures["serving_default"](item=item, history=history, weights=weights)
  return {"served": {k: bits(v) for k, v in got.items()}, "in_process": {k: bits(v) for k, v in want.items()}}


def main() -> None:
  jax.config.update("jax_num_cpu_devices", 8)
  out = {"flags": os.environ.get("XLA_FLAGS", "")}
  out["kernels"] = tables(trained(Model()))
  with native.references():
    out["references"] = tables(trained(Model()))
  for name, devices in (("roomy", 1), ("two_shards", 2), ("eight_shards", 8)):
    out[name] = tables(trained(Model(devices, room=4)))
  out["resumed"] = tables(trained(Model(), resume_at=STEPS // 2))
  out["serving"] = served_and_in_process(trained(Model()))
  json.dump(out, sys.stdout)


if __name__ == "__main__":
  main()
