"""The graph whose checkpoints ``tests/data/written_by_1711f00`` holds: tables of the bucket layout
before the slot became the row (commit 1711f00), written by that commit with :func:`write`.

Run as ``python tests/old_layout.py DIRECTORY`` (with 8 CPU devices) to write them again.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxres as jr
from jaxres._core.storages import registry

KEYS = (np.arange(60, dtype=np.int64) * 7919 - 2**40) * np.array([1, -1] * 30)  # exact 64-bit keys


def mesh_of(num_devices: int):
  return jax.make_mesh((num_devices,), ("shard",), devices=jax.devices()[:num_devices])


class Model(nnx.Module):
  def __init__(self, devices: int, storage: str = registry.DEFAULT):
    room = 2 if devices > 2 else 1  # more shards than written: room for keys the shards share unevenly
    mesh = mesh_of(devices) if devices > 1 else None
    sharding = dict(mesh=mesh, axis="shard") if mesh is not None else {}
    self.emb = jr.DynamicEmbedding(
      40,
      4,
      optimizer=optax.adam(1e-2),
      eviction=jr.LRU(),
      min_count=2,
      rngs=nnx.Rngs(0),
      storage=storage,
      **sharding,
    )
    items = jr.TableConfig(24 * room, 4, optimizer=optax.adagrad(0.1), eviction=jr.LFU(), storage=storage)
    tables = {
      "items": items,
      "users": jr.TableConfig(32, 2, optimizer=optax.sgd(0.1), key=jnp.int32, storage=storage),
    }
    features = {
      "item": jr.FeatureConfig("items"),
      "history": jr.FeatureConfig("items", combiner="mean"),
      "user": jr.FeatureConfig("users"),
    }
    self.collection = jr.EmbeddingCollection(tables, features, rngs=nnx.Rngs(1), **sharding)


def build(devices: int, storage: str = registry.DEFAULT) -> jr.AutoTrackable:
  """The graph, its sharded parts over ``devices`` devices (written with 2; restored onto 1, 2 and 4,
  where full evicting tables are made twice as large: 4 shards do not share their keys evenly), every
  table of the ``storage`` kind (written with open addressing)."""
  room = 2 if devices > 2 else 1
  kind = registry.storage(storage)
  root = jr.AutoTrackable()
  value = {"a": jnp.float32, "b": jax.ShapeDtypeStruct((2,), jnp.int32)}
  root.lru = kind.create(24, key=jnp.int64, value=value, eviction=jr.LRU())
  root.plain = kind.create(100, key=jnp.int32, value=jnp.float32, default=-1.0)
  if devices > 1:
    root.sharded = jr.ShardedTable.create(
      mesh_of(devices), "shard", 64 * room, key=jnp.int64, value=jnp.float32, storage=kind, eviction=jr.LFU()
    )
  else:
    root.sharded = kind.create(64, key=jnp.int64, value=jnp.float32, eviction=jr.LFU())
  root.table = jr.MutableHashTable(np.int64, np.float32, default_value=0.0, storage=storage)
  root.model = Model(devices, storage)
  return root


def _step(model: Model, batch: int) -> None:
  ids = KEYS[(np.arange(12) * 5 + batch * 7) % 50]
  rows = model.emb(ids)
  model.emb.apply_gradients(ids, np.asarray(rows) + 1.0)
  item = KEYS[(np.arange(6) + batch * 3) % 40]
  history = KEYS[(np.arange(18).reshape(6, 3) * 11 + batch) % 45]
  features = {"item": item, "history": history, "user": np.arange(6, dtype=np.int32) + batch}
  jr.value_and_grad(lambda m: sum(jnp.sum(x) for x in m.collection(features).values()))(model)


def write(root: jr.AutoTrackable, directory: str) -> None:
  """What wrote the data: a checkpoint after three steps (``ckpt``), a manager's full step 1 and
  incremental step 2 (``steps``), and every table's live entries at each (``entries-*.json``)."""
  manager = jr.CheckpointManager(directory + "/steps", jr.Checkpoint(root=root), incremental=True)
  for step in range(3):
    leaves = {"a": np.arange(12, dtype=np.float32) + step, "b": np.ones((12, 2), np.int32) * step}
    root.lru = root.lru.insert(jr.keys.split64(KEYS[step * 8 : step * 8 + 12]), leaves)
    root.plain = root.plain.insert(np.arange(step * 20, step * 20 + 30, dtype=np.int32), np.float32(step))
    root.sharded = root.sharded.insert(jr.keys.split64(KEYS[step * 4 : step * 4 + 40]), np.float32(step))
    root.table.insert(KEYS[step * 5 : step * 5 + 10], np.arange(10, dtype=np.float32) * step)
    _step(root.model, step)
    if step >= 1:
      manager.save(step)
      _save_entries(root, f"{directory}/entries-{step}.json")
  manager.close()
  jr.Checkpoint(root=root).save(directory + "/ckpt")
  _save_entries(root, f"{directory}/entries-ckpt.json")


def entries(root: jr.AutoTrackable) -> dict:
  """Every table's live entries, sorted by key, as JSON-able lists (the oracle of a restore)."""

  def table(t) -> list:
    keys, values, valid = jax.device_get(t.export())
    live = np.asarray(valid)
    keys = np.asarray(keys)[live]
    leaves = [np.asarray(x)[live] for x in jax.tree.leaves(values)]
    order = np.lexsort(keys.reshape(len(keys), -1).T[::-1])
    return [[keys[i].tolist(), *(x[i].tolist() for x in leaves)] for i in order]

  out = {name: table(getattr(root, name)) for name in ("lru", "plain", "sharded")}
  keys, values = root.table.export()
  out["table"] = [keys.tolist(), values.tolist()]
  ids, rows = root.model.emb.export()
  out["emb"] = [ids.tolist(), rows.tolist()]
  for name, view in root.model.collection.tables.items():
    ids, rows = view.export()
    out[f"collection/{name}"] = [ids.tolist(), rows.tolist()]
  out["scores"] = {
    "lru": np.asarray(root.lru.scores(jr.keys.split64(KEYS))).tolist(),
    "sharded": np.asarray(root.sharded.scores(jr.keys.split64(KEYS))).tolist(),
    "lru_clock": int(root.lru.clock),
    "lru_evictions": int(root.lru.evictions),
  }
  return out


def _save_entries(root, path: str) -> None:
  with open(path, "w", encoding="utf-8") as f:
    json.dump(entries(root), f)


if __name__ == "__main__":
  jax.config.update("jax_num_cpu_devices", 8)
  write(build(2), sys.argv[1])
