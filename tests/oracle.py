"""A Python-dict model of jr.Table semantics, and the table configurations tests share."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxres as jr
from jaxres._core.storages import registry

# Every registered storage kind's table class (the default first): the storage-parametrised suites run each.
STORAGES = list(registry.STORAGES.values())

# The shapes the oracle suites agree on (test_table, test_stateful): a table of CAPACITY entries
# (below the keys they draw, so tables fill and drop keys) and batches of BATCH rows. Each
# program is compiled once for all of them (in a worker, and through JAX's persistent cache in
# the others); the XLA-path programs take seconds each.
CAPACITY = 10
BATCH = 8


def same_bits(a, b):
  """Asserts that two arrays are equal bit for bit (dtype, shape and bytes)."""
  a, b = np.asarray(a), np.asarray(b)
  assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
  assert a.tobytes() == b.tobytes()


def mesh_of(num_devices: int, axis: str = "shard"):
  return jax.make_mesh((num_devices,), (axis,), devices=jax.devices()[:num_devices])


class Sharded:
  """Builds ShardedTables like a storage class builds tables, with shards that never fill
  before the whole table does (so the dict model's capacity holds exactly)."""

  def __init__(self, storage, num_devices: int = 8):
    self.storage, self.num_devices = storage, num_devices
    self.__name__ = f"Sharded{num_devices}{storage.__name__}"

  def create(self, capacity, key, value, default=0):
    return jr.ShardedTable.create(
      mesh_of(self.num_devices),
      "shard",
      capacity,
      key,
      value,
      default,
      storage=self.storage,
      shard_capacity=capacity,
    )


@dataclasses.dataclass(frozen=True)
class Kind:
  """A key/value configuration: how to build a table and random batches for it."""

  name: str
  key: Any
  value: Any
  default: Any

  @property
  def key_dtype(self) -> np.dtype:
    return np.dtype(self.key.dtype if isinstance(self.key, jax.ShapeDtypeStruct) else self.key)

  @property
  def key_shape(self) -> tuple:
    return tuple(self.key.shape) if isinstance(self.key, jax.ShapeDtypeStruct) else ()

  def create(self, storage, capacity):
    return storage.create(capacity, key=self.key, value=self.value, default=self.default)

  def keys(self, rng: np.random.Generator, n: int, pool: int = 12) -> np.ndarray:
    """n keys drawn from a small pool (so batches repeat keys), spread over the dtype's range."""
    info = np.iinfo(self.key_dtype)
    extremes = np.array([info.min, info.max, 0, 1, info.max - 1], dtype=self.key_dtype)
    spread = rng.integers(info.min, info.max, size=pool, dtype=self.key_dtype, endpoint=True)
    pool_keys = np.concatenate([extremes, spread])
    shape = (n, *self.key_shape)
    return pool_keys[rng.integers(0, pool_keys.size, size=shape)]

  def values(self, rng: np.random.Generator, n: int):
    def leaf(spec):
      spec = spec if isinstance(spec, jax.ShapeDtypeStruct) else jax.ShapeDtypeStruct((), spec)
      shape = (n, *tuple(spec.shape))
      dtype = np.dtype(spec.dtype)
      if dtype.kind == "f":
        return rng.integers(-100, 100, size=shape).astype(dtype) / 4
      return rng.integers(-1000, 1000, size=shape).astype(dtype)

    return jax.tree.map(leaf, self.value, is_leaf=lambda x: not isinstance(x, dict))


KINDS = [
  Kind("int32", jnp.int32, jnp.float32, -1.0),
  Kind("uint32", jnp.uint32, jnp.int32, 7),
  Kind("int64", jnp.int64, jnp.int32, -5),
  Kind("uint64", jnp.uint64, jax.ShapeDtypeStruct((3,), jnp.float32), 0.5),
  Kind(
    "pair_int32",
    jax.ShapeDtypeStruct((2,), jnp.int32),
    {"emb": jax.ShapeDtypeStruct((2,), jnp.float32), "n": jnp.int32},
    0,
  ),
  Kind("pair_int64", jax.ShapeDtypeStruct((2,), jnp.int64), jnp.float32, 0.0),
]
KIND_IDS = [k.name for k in KINDS]


def _key(row) -> Any:
  return tuple(np.asarray(row).reshape(-1).tolist())


def _rows(values, n):
  leaves = [np.asarray(x) for x in jax.tree.leaves(values)]
  return [tuple(leaf[i] for leaf in leaves) for i in range(n)]


class DictTable:
  """Sequential reference: processes a batch one key at a time."""

  def __init__(self, kind: Kind, capacity: int):
    self.kind, self.capacity = kind, capacity
    self.data: dict[Any, tuple] = {}
    self.dropped = 0
    probe = kind.values(np.random.default_rng(0), 1)
    default = jax.tree.map(
      lambda d, x: np.broadcast_to(np.asarray(d, x.dtype), x.shape[1:]), _default_tree(kind), probe
    )
    self.default = tuple(np.asarray(x) for x in jax.tree.leaves(default))

  def _keys(self, keys):
    arr = np.asarray(keys).reshape((-1, *self.kind.key_shape))
    return [tuple(row) for row in arr.reshape(arr.shape[0], -1).tolist()]

  def insert(self, keys, values):
    ks = self._keys(keys)
    lost = set()
    for k, v in zip(ks, _rows(values, len(ks))):
      if k in self.data or len(self.data) < self.capacity:
        self.data[k] = v
      else:
        lost.add(k)
    self.dropped += len(lost)

  def find_or_insert(self, keys, values):
    ks = self._keys(keys)
    out, lost = [], set()
    for k, v in zip(ks, _rows(values, len(ks))):
      if k not in self.data and len(self.data) < self.capacity:
        self.data[k] = v
      if k not in self.data:
        lost.add(k)
      out.append(self.data.get(k, self.default))
    self.dropped += len(lost)
    return out

  def insert_or_apply(self, keys, values, fn):
    ks = self._keys(keys)
    lost = set()
    for k, v in zip(ks, _rows(values, len(ks))):
      if k in self.data:
        self.data[k] = fn(self.data[k], v)
      elif len(self.data) < self.capacity:
        self.data[k] = v
      else:
        lost.add(k)
    self.dropped += len(lost)

  def remove(self, keys):
    for k in self._keys(keys):
      self.data.pop(k, None)

  def find(self, keys):
    return [self.data.get(k, self.default) for k in self._keys(keys)]

  def contains(self, keys):
    return [k in self.data for k in self._keys(keys)]

  def import_(self, keys, values, valid):
    self.data, self.dropped = {}, 0
    keep = np.asarray(valid).reshape(-1)
    ks = self._keys(keys)
    rows = _rows(values, len(ks))
    self.insert_rows([(k, v) for k, v, ok in zip(ks, rows, keep) if ok])

  def insert_rows(self, pairs):
    lost = set()
    for k, v in pairs:
      if k in self.data or len(self.data) < self.capacity:
        self.data[k] = v
      else:
        lost.add(k)
    self.dropped += len(lost)


def _default_tree(kind: Kind):
  leaves, treedef = jax.tree.flatten(kind.value, is_leaf=lambda x: not isinstance(x, dict))
  default = kind.default
  if jax.tree.structure(default).num_leaves == 1:
    return jax.tree.unflatten(treedef, [default] * len(leaves))
  return default


def table_rows(result, n):
  """Batched table output (a value pytree) -> list of per-row tuples."""
  return _rows(result, n)


def assert_rows_equal(got, want):
  assert len(got) == len(want)
  for i, (g, w) in enumerate(zip(got, want)):
    for a, b in zip(g, w):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"row {i}")


def exported(table) -> dict:
  """A table's live contents as {key tuple: row tuple}, via export()."""
  keys, values, valid = table.export()
  valid = np.asarray(valid)
  n = int(valid.sum())
  assert valid[:n].all() and not valid[n:].any(), "live entries must come first"
  keys = np.asarray(keys)[:n]
  rows = _rows(jax.tree.map(lambda x: np.asarray(x)[:n], values), n)
  out = {_key(k): r for k, r in zip(keys, rows)}
  assert len(out) == n, "export returned a key twice"
  return out


def entries(table) -> dict:
  """A table's live contents as {key tuple: value lists}: comparable with ``==``."""
  return {k: [np.asarray(x).tolist() for x in row] for k, row in exported(table).items()}


def assert_matches(table, model: DictTable):
  got = exported(table)
  assert set(got) == set(model.data)
  assert_rows_equal([got[k] for k in model.data], list(model.data.values()))
  assert int(table.size) == len(model.data)
  assert int(table.dropped) == model.dropped


def twice_plus(old, new):
  return jax.tree.map(lambda a, b: a * 2 + b, old, new)


def twice_plus_rows(old, new):
  return tuple(a * 2 + b for a, b in zip(old, new))


def stateful_step(table, model: dict, op: str, keys, values, default) -> None:
  """``insert``, ``remove`` or ``find`` on a stateful table and its dict model (keys as
  Python scalars); ``find`` is checked against the model."""
  if op == "insert":
    table.insert(keys, values)
    model.update(zip(keys.tolist(), np.asarray(values).tolist()))
  elif op == "remove":
    table.remove(keys)
    for k in keys.tolist():
      model.pop(k, None)
  else:
    assert table.find(keys).tolist() == [model.get(k, default) for k in keys.tolist()]


def run_random_operations(
  table, model: DictTable, rng: np.random.Generator, steps: int = 40, batch: int = BATCH
):
  """Random batches of every operation on ``table`` and ``model``; they must agree at each step."""
  kind = model.kind
  for step in range(steps):
    op = rng.choice(
      ["insert", "find_or_insert", "apply", "remove", "find", "import"], p=[0.3, 0.2, 0.2, 0.15, 0.1, 0.05]
    )
    keys, values = kind.keys(rng, batch, pool=16), kind.values(rng, batch)
    if op == "insert":
      table = table.insert(keys, values)
      model.insert(keys, values)
    elif op == "find_or_insert":
      table, got = table.find_or_insert(keys, values)
      assert_rows_equal(table_rows(got, batch), model.find_or_insert(keys, values))
    elif op == "apply":
      table = table.insert_or_apply(keys, values, twice_plus)
      model.insert_or_apply(keys, values, twice_plus_rows)
    elif op == "remove":
      table = table.remove(keys)
      model.remove(keys)
    elif op == "find":
      assert_rows_equal(table_rows(table.find(keys), batch), model.find(keys))
      found, present = table.lookup(keys)
      assert_rows_equal(table_rows(found, batch), model.find(keys))
      np.testing.assert_array_equal(present, model.contains(keys))
      np.testing.assert_array_equal(table.contains(keys), model.contains(keys))
    else:
      valid = rng.random(batch) < 0.7
      table = table.import_(keys, values, valid)
      model.import_(keys, values, valid)
    assert_matches(table, model), f"diverged after step {step} ({op})"
  return table


@contextlib.contextmanager
def compilations():
  """The list of XLA programs loaded in the block (compiled, or read from JAX's persistent cache)."""
  seen = []

  def listen(event, duration, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
      seen.append(duration)

  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    yield seen
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
