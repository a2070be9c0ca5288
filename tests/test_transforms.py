"""Every operation under jit and vmap, and no retracing on a second call."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracle import CAPACITY, STORAGES

import jaxres as jr
from jaxres._core import row_protocol

# Every test runs with the CPU kernels and on their XLA references (see conftest.kernels).
pytestmark = pytest.mark.usefixtures("kernels")

OPS = {
  "insert": lambda t, k, v: t.insert(k, v),
  "find": lambda t, k, v: t.find(k),
  "find_default": lambda t, k, v: t.find(k, default=v),
  "lookup": lambda t, k, v: t.lookup(k),
  "contains": lambda t, k, v: t.contains(k),
  "remove": lambda t, k, v: t.remove(k),
  "find_or_insert": lambda t, k, v: t.find_or_insert(k, v),
  "insert_or_apply": lambda t, k, v: t.insert_or_apply(k, v, jnp.add),
  "export": lambda t, k, v: t.export(),
  "import_": lambda t, k, v: t.import_(k, v),
  "size": lambda t, k, v: (t.size, t.dropped),
}


def _table(storage):
  # test_table's int32 kind at the shared capacity: the eager calls reuse its compiled programs
  t = storage.create(CAPACITY, key=jnp.int32, value=jnp.float32, default=-1.0)
  return t.insert(jnp.array([1, 2, 3], jnp.int32), jnp.array([10.0, 20.0, 30.0]))


def _assert_same(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("op", sorted(OPS))
def test_jit_matches_eager_without_retracing(storage, op):
  t = _table(storage)
  keys, values = jnp.array([3, 4, 3, 9], jnp.int32), jnp.array([1.0, 2.0, 3.0, 4.0])
  fn, traces = OPS[op], []

  def traced(*args):
    traces.append(1)
    return fn(*args)

  jitted = jax.jit(traced)
  _assert_same(jitted(t, keys, values), fn(t, keys, values))
  _assert_same(
    jitted(t.insert(keys, values), keys + 1, values * 2), fn(t.insert(keys, values), keys + 1, values * 2)
  )
  assert len(traces) == 1


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize(
  "op", ["find", "lookup", "contains", "insert", "find_or_insert", "remove", "insert_or_apply"]
)
def test_vmap_over_keys_matches_loop(storage, op):
  t = _table(storage)
  keys = jnp.array([[1, 4, 4], [2, 2, 5], [7, 3, 1]], jnp.int32)
  values = jnp.arange(9, dtype=jnp.float32).reshape(3, 3)
  batched = jax.vmap(lambda k, v: OPS[op](t, k, v))(keys, values)
  looped = [OPS[op](t, k, v) for k, v in zip(keys, values)]
  _assert_same(batched, jax.tree.map(lambda *xs: jnp.stack(xs), *looped))


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("op", ["find", "insert", "find_or_insert", "remove", "insert_or_apply", "export"])
def test_vmap_over_stacked_tables_matches_loop(storage, op):
  base = _table(storage)
  tables = [
    base,
    base.insert(jnp.array([4, 5], jnp.int32), jnp.array([4.0, 5.0])),
    base.remove(jnp.array([1, 2])),
  ]
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *tables)
  keys = jnp.array([[1, 4, 6], [5, 5, 2], [3, 1, 1]], jnp.int32)
  values = jnp.arange(9, dtype=jnp.float32).reshape(3, 3)
  batched = jax.jit(jax.vmap(OPS[op]))(stacked, keys, values)
  looped = [OPS[op](t, k, v) for t, k, v in zip(tables, keys, values)]
  _assert_same(batched, jax.tree.map(lambda *xs: jnp.stack(xs), *looped))


def test_tables_are_pytrees_with_static_config():
  t = jr.OpenAddressingTable.create(16, key=jnp.int32, value=jnp.float32)
  leaves, treedef = jax.tree.flatten(t)
  rebuilt = jax.tree.unflatten(treedef, leaves)
  assert isinstance(rebuilt, jr.Table) and rebuilt.capacity == 16
  assert all(isinstance(x, jax.Array) for x in leaves)


def test_resize_under_jit_with_static_capacity():
  t = _table(jr.OpenAddressingTable)
  resized = jax.jit(lambda t: t.resize(64))(t)
  assert resized.capacity == 64 and int(resized.size) == 3
  assert resized.find(jnp.array([2], jnp.int32)).tolist() == [20.0]


@pytest.mark.parametrize("storage", STORAGES)
def test_eager_calls_compile_once_per_shape(storage):
  compiled = [
    row_protocol.lookup,
    row_protocol.upsert,
    row_protocol.remove,
    row_protocol.apply,
    row_protocol.contains,
  ]
  t = _table(storage)

  def work(t, keys):
    t = t.insert(keys, jnp.ones(3)).insert_or_apply(keys, jnp.ones(3), jnp.add)
    t, _ = t.find_or_insert(keys + 1, jnp.ones(3))
    t.find(keys), t.lookup(keys), t.contains(keys)
    return t.remove(keys)

  t = work(t, jnp.array([1, 5, 9], jnp.int32))
  sizes = [k._cache_size() for k in compiled]
  for start in (20, 40):
    t = work(t, jnp.arange(start, start + 3, dtype=jnp.int32))
  assert [k._cache_size() for k in compiled] == sizes
