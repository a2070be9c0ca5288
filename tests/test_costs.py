"""O(batch) guards: no compiled program of a hot path copies or makes a capacity-sized array.

Each test compiles a path as users run it (under ``jit`` with the table or
model donated, or an eager stateful call) and reads the optimised HLO: every
instruction whose result has a capacity-sized dimension must be an in-place
update (a scatter, a dynamic-update-slice, a kernel that aliases its input)
or plumbing (parameters, tuples, loops). A ``copy`` of the table, a fresh
zero-filled array, a pass producing a new capacity-sized array all fail.
Capacities are chosen so that no batch-sized dimension reaches ``_LARGE``.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from oracle import mesh_of

import jaxres as jr
from jaxres._core.kernels import native
from jaxres._core.storages.registry import STORAGES

LeanTable = STORAGES["lean"]  # issue 66's layout, beside today's until it becomes the default

# Not a power of two: no size derived from the batch (rows x windows x slots, scratch cells) equals a
# size derived from the capacity (rows, buckets, slots, words), which is how the guard tells them apart.
CAPACITY = 3000
BATCH = 32
_LARGE = 256  # capacity-derived sizes below this (a row's width, a record's words) are not told apart
_TABLE_LEAF = 1024  # leaves of a model's state from this many elements are its tables' (CAPACITY // 2 and up)
_PLUMBING = {
  "parameter",
  "get-tuple-element",
  "tuple",
  "bitcast",
  "while",
  "conditional",
  "call",
  "opt-barrier",
}
_IN_PLACE = {"scatter", "dynamic-update-slice"}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.+?) ([a-z][a-z\-]*)\(")

# Every test here runs twice: with the CPU kernels, and on the XLA references alone (what GPUs and
# TPUs run, and what any program exported for them holds).
pytestmark = pytest.mark.usefixtures("kernels")


def capacity_sizes(*trees) -> set[int]:
  """The sizes an array derived from the capacity has: each dimension of the table-sized leaves of
  ``trees``, and each product of their trailing dimensions (a leaf flattened, or one shard of it),
  from ``_LARGE`` up."""
  sizes = set()
  for leaf in jax.tree.leaves(trees):
    shape = np.shape(leaf)
    if np.prod(shape) < _TABLE_LEAF:
      continue  # a dense layer, a few shared rows, a scalar
    for i in range(len(shape)):
      sizes.update({int(shape[i]), int(np.prod(shape[i:]))})
  return {s for s in sizes if s >= _LARGE}


def capacity_sized(compiled, sizes) -> list[str]:
  """The instructions of ``compiled`` that make an array of one of ``sizes`` other than in place."""
  computations = _fusion_roots(compiled.as_text())
  bad = []
  for line in compiled.as_text().splitlines():
    match = _INSTRUCTION.match(line)
    if not match:
      continue
    _, shape, op = match.groups()
    for array in re.findall(r"\[([\d,]*)\]", shape):
      dims = [int(d) for d in array.split(",") if d]
      if any(d in sizes for d in dims) or int(np.prod(dims)) in sizes:
        break
    else:
      continue
    if op in _PLUMBING or op in _IN_PLACE:
      continue
    if op == "custom-call" and "output_to_operand_aliasing" in line:
      continue
    if op == "fusion" and computations.get(re.search(r"calls=%([^,\s]+)", line).group(1)) in _IN_PLACE:
      continue
    bad.append(line.strip()[:200])
  return bad


def _fusion_roots(text: str) -> dict[str, str]:
  """Each computation's root instruction opcode."""
  roots, name = {}, None
  for line in text.splitlines():
    header = re.match(r"^(?:ENTRY )?%(\S+) ", line)
    if header and line.rstrip().endswith("{"):
      name = header.group(1)
    root = re.match(r"^\s*ROOT %\S+ = .+? ([a-z][a-z\-]*)\(", line)
    if root and name is not None:
      roots[name] = root.group(1)
  return roots


def assert_o_batch(compiled, *state):
  """No instruction of ``compiled`` makes an array the size of one derived from ``state``, but in place."""
  assert capacity_sized(compiled, capacity_sizes(*state)) == []


def test_the_guard_sees_a_copy_and_a_fresh_array():
  table = jr.OpenAddressingTable.create(CAPACITY, key=jnp.int32, value=jnp.float32)
  keys = jnp.arange(BATCH)
  copied = jax.jit(lambda t, k: t.insert(k, jnp.ones(BATCH))).lower(table, keys).compile()  # not donated
  assert any(" copy(" in line for line in capacity_sized(copied, capacity_sizes(table)))
  zeroed = jax.jit(lambda t: jnp.zeros_like(t.values[0]) + 1, donate_argnums=0).lower(table).compile()
  assert capacity_sized(zeroed, capacity_sizes(table))
  flattened = jax.jit(lambda t: t.buckets.reshape(-1) + 1, donate_argnums=0).lower(table).compile()
  assert capacity_sized(flattened, capacity_sizes(table))
  for name, each in {"int32": table, **_tables()}.items():
    assert capacity_sizes(each).isdisjoint({BATCH * 2**k for k in range(12)}), f"another CAPACITY: {name}"


def _tables():
  int64 = dict(key=jnp.int64, value=jax.ShapeDtypeStruct((4,), jnp.float32))
  return {
    "open addressing": jr.OpenAddressingTable.create(CAPACITY, **int64),
    "LRU": jr.OpenAddressingTable.create(CAPACITY, eviction=jr.LRU(), **int64),
    "LFU": jr.OpenAddressingTable.create(CAPACITY, eviction=jr.LFU(), **int64),
    "lean": LeanTable.create(CAPACITY, **int64),
    "lean LRU": LeanTable.create(CAPACITY, eviction=jr.LRU(), **int64),
  }


def _sharded_tables():
  int64 = dict(key=jnp.int64, value=jax.ShapeDtypeStruct((4,), jnp.float32))
  return {
    "sharded": jr.ShardedTable.create(mesh_of(2), "shard", CAPACITY, **int64),
    "sharded LRU": jr.ShardedTable.create(mesh_of(2), "shard", CAPACITY, eviction=jr.LRU(), **int64),
  }


_METHODS = {
  "insert": lambda t, k, v: t.insert(k, v),
  "insert_and_evict": lambda t, k, v: t.insert_and_evict(k, v),
  "find_or_insert": lambda t, k, v: t.find_or_insert(k, v),
  "find_or_insert_and_evict": lambda t, k, v: t.find_or_insert_and_evict(k, v),
  "insert_or_apply add": lambda t, k, v: t.insert_or_apply(k, v, jnp.add),
  "insert_or_apply fold": lambda t, k, v: t.insert_or_apply(k, v, _blend),
  "assign": lambda t, k, v: t.assign(k, v),
  "remove": lambda t, k, v: t.remove(k),
  "assign_scores": lambda t, k, v: t.assign_scores(k) if t.eviction is not None else t,
  "find": lambda t, k, v: (t, t.find(k)),
  "lookup": lambda t, k, v: (t, t.lookup(k)),
  "contains": lambda t, k, v: (t, t.contains(k)),
  "find_rows": lambda t, k, v: (t, t.find_rows(k)),
  "find_or_insert_rows": lambda t, k, v: t.find_or_insert_rows(k),
  "read and write rows": lambda t, k, v: t.write_rows(t.find_rows(k), v),
  "scores": lambda t, k, v: (t, t.scores(k)),
  "export_batch": lambda t, k, v: (t, t.export_batch(k.shape[0], k.shape[0])),
  "export_if": lambda t, k, v: (t, t.export_if(_recent, k.shape[0], k.shape[0])),
  "insert with valid": lambda t, k, v: t.insert(k, v, valid=jnp.arange(k.shape[0]) % 2 == 0),
  "find with a default": lambda t, k, v: (t, t.find(k, default=jnp.full((4,), -1.0, jnp.float32))),
}


def _recent(keys, values, scores):
  return scores > 1


def _blend(old, new):
  return 0.5 * old + new


def _check_methods(method, tables):
  keys = jr.keys.split64(np.arange(BATCH) * 7919)
  values = jnp.ones((BATCH, 4), jnp.float32)
  for name, table in tables.items():
    compiled = jax.jit(_METHODS[method], donate_argnums=0).lower(table, keys, values).compile()
    assert capacity_sized(compiled, capacity_sizes(table)) == [], name


@pytest.mark.parametrize("method", sorted(_METHODS))
def test_functional_methods_under_jit_with_the_table_donated(method):
  _check_methods(method, _tables())


@pytest.mark.parametrize("capacity", [2**16, 2**20], ids=["2^16", "2^20"])
def test_evicting_find_or_insert_at_the_benchmarks_capacities(capacity):
  """The guard holds at the capacities the layouts are timed at, not only at ``CAPACITY`` (issue 66: an
  evicting ``find_or_insert`` once copied its table four times at 2^16 on the XLA path). Lowered
  from the tables' shapes: nothing of their size is made."""
  int64 = dict(key=jnp.int64, value=jax.ShapeDtypeStruct((4,), jnp.float32), eviction=jr.LRU())
  keys = jr.keys.split64(np.arange(BATCH) * 7919)
  values = jnp.ones((BATCH, 4), jnp.float32)
  for storage in ("open_addressing", "lean"):
    table = jax.eval_shape(functools.partial(STORAGES[storage].create, capacity, **int64))
    sizes = capacity_sizes(table)
    assert sizes.isdisjoint({BATCH * 2**k for k in range(8)}), storage  # batch-derived sizes told apart
    compiled = jax.jit(_METHODS["find_or_insert"], donate_argnums=0).lower(table, keys, values).compile()
    assert capacity_sized(compiled, sizes) == [], storage


_SHARDED_METHODS = [
  "insert",
  "find",
  "remove",
  "assign_scores",
  "insert_or_apply add",
  "find_or_insert_rows",
  "scores",
]


@pytest.mark.parametrize("method", [*_SHARDED_METHODS, "read and write rows", "export_batch", "export_if"])
def test_sharded_methods_under_jit_with_the_table_donated(method):
  _check_methods(method, _sharded_tables())


def test_sorted_table_reads_and_updates_of_present_keys():
  """A sorted table moves entries when new keys arrive (documented O(capacity)); the rest is O(batch)."""
  table = jr.SortedTable.create(CAPACITY, key=jnp.int32, value=jnp.float32)
  keys, values = jnp.arange(BATCH), jnp.ones(BATCH)
  for method in ("find", "lookup", "contains", "assign", "remove", "find_rows", "read and write rows"):
    compiled = jax.jit(_METHODS[method], donate_argnums=0).lower(table, keys, values).compile()
    assert capacity_sized(compiled, capacity_sizes(table)) == [], method


class _Model(nnx.Module):
  def __init__(self, **options):
    options = {"optimizer": optax.adam(0.01), **options}
    self.emb = jr.DynamicEmbedding(CAPACITY, 8, rngs=nnx.Rngs(0), **options)
    self.head = nnx.Linear(8, 1, rngs=nnx.Rngs(1))


@functools.partial(nnx.jit, donate_argnums=(0, 1))
def _train_step(model, optimizer, ids, labels):
  rows = model.emb(ids)

  def loss_fn(model, rows):
    return jnp.mean((model.head(rows)[..., 0] - labels) ** 2)

  loss, (grads, row_grads) = nnx.value_and_grad(loss_fn, argnums=(0, 1))(model, rows)
  optimizer.update(model, grads)
  model.emb.apply_gradients(ids, row_grads)
  return loss


_EMBEDDINGS = {
  "refusing": {},
  "LRU": {"eviction": jr.LRU()},
  "LFU, min_count=2": {"eviction": jr.LFU(), "min_count": 2},
  "min_count=3": {"min_count": 3},
  "LRU, min_count=2, shared rows": {"eviction": jr.LRU(), "min_count": 2, "oov_buckets": 64},
  "LRU, shared rows, CatchUpAdam": {
    "eviction": jr.LRU(),
    "oov_buckets": 64,
    "optimizer": jr.CatchUpAdam(0.01),
  },
}


@pytest.mark.parametrize("options", list(_EMBEDDINGS), ids=list(_EMBEDDINGS))
def test_the_training_step_with_the_model_donated(options):
  _check_step(_Model(**_EMBEDDINGS[options]))


def test_the_sharded_training_step_with_the_model_donated():
  _check_step(_Model(eviction=jr.LRU(), mesh=mesh_of(2), axis="shard"))
  _check_step(_Model(eviction=jr.LRU(), mesh=mesh_of(2), axis="shard", min_count=2))  # counts on every device
  catching_up = jr.CatchUpAdam(0.01)
  _check_step(_Model(eviction=jr.LRU(), mesh=mesh_of(2), axis="shard", oov_buckets=64, optimizer=catching_up))


def _check_step(model):
  optimizer = nnx.Optimizer(model, optax.adam(0.01), wrt=nnx.Param)
  ids = jr.keys.split64(np.arange(BATCH * 2).reshape(BATCH, 2))
  labels = jnp.ones((BATCH, 2), jnp.float32)
  assert_o_batch(_train_step.lower(model, optimizer, ids, labels).compile(), nnx.state(model))


def test_eager_stateful_updates_are_made_in_place():
  """Each eager update donates the state: the old arrays are gone, the program the update ran is O(batch)."""
  table = jr.MutableHashTable(np.int64, np.float32, default_value=-1.0, initial_capacity=CAPACITY)
  keys = np.arange(BATCH, dtype=np.int64) * (2**33 + 1)
  for update in (
    lambda: table.insert(keys, np.ones(BATCH, np.float32)),
    lambda: table.find_or_insert(keys + 1, np.ones(BATCH, np.float32)),
    lambda: table.remove(keys[:3]),
  ):
    before = table.state
    update()
    assert all(x.is_deleted() for x in jax.tree.leaves(before)), "the update copied the table"
  assert table.capacity == CAPACITY and len(table) == 2 * BATCH - 3
  assert table.find(keys[:4]).tolist() == [-1.0, -1.0, -1.0, 1.0]


def test_the_rest_of_the_stateful_vocabulary_updates_in_place():
  """insert_or_apply, assign and the evicting forms donate the state too (a bounded table evicts)."""
  table = jr.MutableHashTable(np.int64, np.float32, 0.0, initial_capacity=CAPACITY, eviction=jr.LRU())
  keys = np.arange(BATCH, dtype=np.int64) * (2**33 + 1)
  ones = np.ones(BATCH, np.float32)
  for update in (
    lambda: table.insert_or_apply(keys, ones, jnp.add),
    lambda: table.assign(keys, 2 * ones),
    lambda: table.insert_and_evict(keys + 1, ones),
    lambda: table.find_or_insert_and_evict(keys + 2, ones),
  ):
    before = table.state
    update()
    assert all(x.is_deleted() for x in jax.tree.leaves(before)), "the update copied the table"
  assert table.find(keys[:2]).tolist() == [2.0, 2.0] and len(table) == 3 * BATCH


def test_eager_embedding_calls_are_made_in_place():
  emb = jr.DynamicEmbedding(CAPACITY, 8, optimizer=optax.sgd(0.1), eviction=jr.LRU(), rngs=nnx.Rngs(0))
  ids = np.arange(BATCH, dtype=np.int64)
  before = emb.table.get_value()
  rows = emb(ids)
  assert all(x.is_deleted() for x in jax.tree.leaves(before))
  before = emb.table.get_value()
  emb.apply_gradients(ids, np.ones((BATCH, 8), np.float32))
  assert all(x.is_deleted() for x in jax.tree.leaves(before))
  np.testing.assert_allclose(emb(ids), rows - 0.1, rtol=1e-6)


def _loss(model, ids, labels):
  return jnp.mean((model.head(model.emb(ids))[..., 0] - labels) ** 2)


@functools.partial(nnx.jit, donate_argnums=(0, 1))
def _plain_step(model, optimizer, ids, labels):
  loss, grads = jr.value_and_grad(_loss)(model, ids, labels)
  optimizer.update(model, grads)
  return loss


@pytest.mark.parametrize("options", ["LRU", "LRU, min_count=2, shared rows"])
def test_the_plain_nnx_step_with_the_model_donated(options):
  model = _Model(**_EMBEDDINGS[options])
  optimizer = nnx.Optimizer(model, optax.adam(0.01), wrt=nnx.Param)
  ids = jr.keys.split64(np.arange(BATCH * 2).reshape(BATCH, 2))
  compiled = _plain_step.lower(model, optimizer, ids, jnp.ones((BATCH, 2), jnp.float32)).compile()
  assert_o_batch(compiled, nnx.state(model))


class _Collection(nnx.Module):
  """Two tables: items read by three features (one id, mean-pooled, unpooled), users by one."""

  HISTORY, TAGS = 4, 2

  def __init__(self, mesh=None):
    tables = {
      "items": jr.TableConfig(CAPACITY, 8, optimizer=optax.adam(0.01), eviction=jr.LRU()),
      "users": jr.TableConfig(
        2 * CAPACITY,
        4,
        optimizer=jr.CatchUpAdam(0.01),
        eviction=jr.LFU(),
        min_count=2,
        oov_buckets=64,
        admission_capacity=1580,  # 13 x 124 slots: no batch-shaped array of a step has as many elements
      ),
    }
    features = {
      "item": jr.FeatureConfig("items"),
      "history": jr.FeatureConfig("items", combiner="mean"),
      "tags": jr.FeatureConfig("items", combiner=None),
      "user": jr.FeatureConfig("users"),
    }
    axis = None if mesh is None else "shard"
    self.emb = jr.EmbeddingCollection(tables, features, rngs=nnx.Rngs(0), mesh=mesh, axis=axis)
    self.head = nnx.Linear(8 * 3 + 4, 1, rngs=nnx.Rngs(1))

  def __call__(self, batch):
    out = self.emb(batch)
    x = jnp.concatenate([out["item"], out["history"], out["tags"].sum(axis=1), out["user"]], axis=-1)
    return self.head(x)[:, 0]


def _collection_loss(model, batch, labels):
  return jnp.mean((model(batch) - labels) ** 2)


@functools.partial(nnx.jit, donate_argnums=(0, 1))
def _collection_step(model, optimizer, batch, labels):
  loss, grads = jr.value_and_grad(_collection_loss)(model, batch, labels)
  optimizer.update(model, grads)
  return loss


def _compiled_collection_step(model):
  optimizer = nnx.Optimizer(model, optax.adam(0.01), wrt=nnx.Param)
  ids = lambda *shape: jr.keys.split64(np.arange(np.prod(shape)).reshape(shape) * 7919)
  padded = lambda *shape: jnp.asarray(np.arange(np.prod(shape)).reshape(shape) % 3 > 0, jnp.float32)
  batch = {
    "item": ids(BATCH),
    "history": (ids(BATCH, _Collection.HISTORY), padded(BATCH, _Collection.HISTORY)),
    "tags": (ids(BATCH, _Collection.TAGS), padded(BATCH, _Collection.TAGS)),
    "user": ids(BATCH),
  }
  return _collection_step.lower(model, optimizer, batch, jnp.ones(BATCH, jnp.float32)).compile()


# An upsert kernel's call: its first output (the table's first array, which tells the tables apart), the
# first bool[N] (the rows it took) and the kernel (open addressing's, or the lean layout's).
_UPSERT = re.compile(
  r"= \((u32\[[\d,]+\])\{[^}]*\}.*?pred\[(\d+)\].*custom_call_target=\"(jaxres_(?:lean_)?upsert)\""
)


def test_the_collection_step_locates_each_table_once_with_the_model_donated():
  """One upsert per table, of the ids of all its features (and one of the users' admission counts)."""
  model = _Collection()
  compiled = _compiled_collection_step(model)
  assert_o_batch(compiled, nnx.state(model))
  if not native.kernels_traced():
    return  # the same calls, made of XLA operations: nothing names them in the program
  upserts = sorted(m.groups() for m in map(_UPSERT.search, compiled.as_text().splitlines()) if m)
  first = lambda array: "u32[{}]".format(",".join(map(str, array.shape)))
  items, users = model.emb.tables["items"], model.emb.tables["users"]
  expected = [
    (
      first(items.table.get_value().buckets),
      str(BATCH * (1 + _Collection.HISTORY + _Collection.TAGS)),
      "jaxres_upsert",
    ),
    (first(users.table.get_value().buckets), str(BATCH), "jaxres_upsert"),
    (first(users.counts.get_value().digests), str(BATCH), "jaxres_lean_upsert"),  # the admission counts
  ]
  assert len({shape for shape, *_ in expected}) == 3, "the tables' first arrays must differ in shape"
  assert upserts == sorted(expected)


def test_the_sharded_collection_step_with_the_model_donated():
  model = _Collection(mesh=mesh_of(2))
  assert_o_batch(_compiled_collection_step(model), nnx.state(model))
