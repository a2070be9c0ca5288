"""``insert_or_apply`` with ``jnp.add`` and the other known operations on 64-bit integer values (issue 46,
item 4): exact with ``jax_enable_x64`` off (the values held as uint32 word pairs) and on, against
Python integers wrapped as NumPy's ``int64`` and ``uint64`` wrap, eagerly and under ``jit``, in the
functional, sharded and stateful tables. The table tests run with the CPU kernels and on the XLA
references alone (the ``kernels`` fixture).
"""

import operator

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from oracle import STORAGES, mesh_of

import jaxres as jr
from jaxres._core import folds
from jaxres._core.encoding.key_specs import join64_host, split64_host
from jaxres._core.encoding.value_specs import ValueSpec
from jaxres._core.modes import Carry

# Each known operation as Python integers compute it (the result then wrapped to the dtype).
OPS = {
  jnp.add: operator.add,
  jnp.subtract: operator.sub,
  jnp.multiply: operator.mul,
  jnp.maximum: max,
  jnp.minimum: min,
  jnp.bitwise_and: operator.and_,
  jnp.bitwise_or: operator.or_,
  jnp.bitwise_xor: operator.xor,
}
_IDS = [op.__name__ for op in OPS]
EDGES = {
  np.int64: [0, 1, -1, 7, -(2**31), 2**31, 2**32 - 1, 2**32, -(2**32) - 1, 2**62, 2**63 - 1, -(2**63)],
  np.uint64: [0, 1, 7, 2**31, 2**32 - 1, 2**32, 2**33 + 5, 2**63 - 1, 2**63, 2**64 - 1],
}


@pytest.fixture(scope="module", autouse=True)
def x64_off():
  """Every test runs with x64 off (JAX's default) unless it turns it on itself, whatever the process's
  setting."""
  with jax.enable_x64(False):
    yield


def wrap(x: int, dtype) -> int:
  """The Python int ``x`` as NumPy's ``dtype`` holds it (modulo 2**64, signed for int64)."""
  x %= 2**64
  return x - 2**64 if np.dtype(dtype).kind == "i" and x >= 2**63 else x


def fold_into(want: dict, keys, values, op, dtype) -> None:
  """The dict oracle: a new key takes its value, a present one ``op(old, new)``, row by row."""
  for k, v in zip(keys, values):
    want[k] = wrap(OPS[op](want[k], v), dtype) if k in want else v


def batches(dtype, seed: int, count: int = 3, size: int = 8):
  """``count`` batches of ``size`` rows over 4 keys (repeated within and across batches), their
  values mostly the dtype's edges (around 2**32 and 2**63), the rest drawn from its whole range."""
  rng = np.random.default_rng(seed)
  info = np.iinfo(dtype)
  for _ in range(count):
    keys = rng.integers(0, 4, size).astype(np.int32)
    edges = [EDGES[dtype][i] for i in rng.integers(0, len(EDGES[dtype]), size)]
    drawn = rng.integers(info.min, info.max, size, dtype=dtype, endpoint=True).tolist()
    yield keys, np.array([e if rng.random() < 0.6 else d for e, d in zip(edges, drawn)], dtype)


def check_against_oracle(storage, op, dtype, seed: int) -> None:
  table, want = storage.create(16, key=np.int32, value=dtype), {}
  for keys, values in batches(dtype, seed):
    table = table.insert_or_apply(keys, values, op)
    fold_into(want, keys.tolist(), values.tolist(), op, dtype)
  keys = np.array(sorted(want), np.int32)
  got = np.asarray(table.find(keys))
  assert got.dtype == dtype
  assert got.tolist() == [want[k] for k in keys.tolist()]


# --------------------------------------------------------------- the operations on word pairs


@pytest.mark.parametrize("dtype", [np.int64, np.uint64])
@pytest.mark.parametrize("op", list(OPS), ids=_IDS)
def test_each_operation_on_word_pairs_equals_numpy(op, dtype):
  """Every pair of the dtype's edges and some random values, against NumPy's own wrapping arrays."""
  rng = np.random.default_rng(0)
  info = np.iinfo(dtype)
  values = np.concatenate([np.array(EDGES[dtype], dtype), rng.integers(info.min, info.max, 20, dtype=dtype)])
  a, b = (x.ravel() for x in np.meshgrid(values, values))
  spec = ValueSpec.parse(dtype)
  assert spec.leaves[0].wide  # x64 off: held as word pairs
  got = join64_host(np.asarray(folds.fold(op, spec)(split64_host(a), split64_host(b))), dtype)
  np.testing.assert_array_equal(got, getattr(np, op.__name__)(a, b))


def test_aliases_are_known_and_other_functions_are_not():
  for fn in (jnp.add, jax.numpy.add, jax.lax.add, operator.add, jax.lax.sub, operator.xor, jax.lax.max):
    assert folds.is_exact(fn)
  for fn in (lambda a, b: a + b, jnp.divide, np.add, jnp.power, print):
    assert not folds.is_exact(fn)
  spec = ValueSpec.parse(np.int64)
  assert folds.fold(jnp.add, spec) == folds.fold(jnp.add, spec)  # equal: one compile for both calls
  assert folds.fold(operator.add, spec) != folds.fold(jnp.subtract, spec)
  # One scatter where the fold's order cannot matter (integers held natively); word pairs fold in order.
  assert folds.reduction(folds.fold(operator.add, ValueSpec.parse(np.int32))) is Carry.ADD
  assert folds.reduction(folds.fold(jnp.maximum, ValueSpec.parse(np.uint32))) is Carry.MAX
  for value, fn in [(spec, jnp.add), (ValueSpec.parse(np.float32), jnp.add), (spec, lambda a, b: a + b)]:
    assert folds.reduction(folds.fold(fn, value)) is None


# --------------------------------------------------------------- tables


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("dtype", [np.int64, np.uint64])
@pytest.mark.parametrize("op", list(OPS), ids=_IDS)
def test_tables_fold_64_bit_values_exactly_with_x64_off(op, dtype):
  seed = list(OPS).index(op) + 10 * (dtype is np.uint64)
  check_against_oracle(STORAGES[seed % len(STORAGES)], op, dtype, seed)  # the seeds cycle through every kind


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize(
  ("op", "dtype"),
  [(jnp.add, np.int64), (jnp.multiply, np.uint64), (jnp.minimum, np.int64), (jnp.bitwise_xor, np.uint64)],
  ids=["add", "multiply", "minimum", "bitwise_xor"],
)
def test_tables_fold_with_the_real_64_bit_operations_with_x64_on(op, dtype):
  seed = list(OPS).index(op)
  with jax.enable_x64(True):
    check_against_oracle(STORAGES[seed % len(STORAGES)], op, dtype, seed)


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("x64", [False, True], ids=["x64_off", "x64_on"])
def test_pytree_values_fold_leaf_by_leaf(x64):
  """A known operation on a pytree: exact on its 64-bit leaf, the operation itself on the others."""
  value = {"count": np.int64, "total": np.float32, "small": np.int32}
  with jax.enable_x64(x64):
    table = jr.OpenAddressingTable.create(8, key=np.int32, value=value)
    keys = np.array([1, 1, 2, 1], np.int32)
    counts = np.array([2**32 - 1, 2, -(2**63), 2**63 - 1])
    values = {"count": counts, "total": np.array([0.5, 0.25, 1.0, 2.0], np.float32), "small": np.arange(4)}
    table = table.insert_or_apply(keys, values, jnp.add)
    table = table.insert_or_apply(keys[:2], {k: v[:2] for k, v in values.items()}, jnp.maximum)
    got = jax.tree.map(np.asarray, table.find(np.array([1, 2], np.int32)))
  want = {}
  fold_into(want, keys.tolist(), counts.tolist(), jnp.add, np.int64)  # key 1 wraps past 2**63 ...
  fold_into(want, keys[:2].tolist(), counts[:2].tolist(), jnp.maximum, np.int64)  # ... below 2**32 - 1
  assert got["count"].tolist() == [want[1], want[2]] == [2**32 - 1, -(2**63)]
  assert got["total"].tolist() == [2.75, 1.0] and got["small"].tolist() == [4, 2]


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("x64", [False, True], ids=["x64_off", "x64_on"])
def test_under_jit(x64):
  """Inside jit with x64 off, 64-bit keys and values travel as word pairs; the sums stay exact."""
  keys = np.array([2**40, 2**40, 3, 2**40, 3])
  values = np.array([2**32 - 1, 1, -5, 2**63 - 1, -(2**40)])
  with jax.enable_x64(x64):
    step = jax.jit(lambda t, k, v: t.insert_or_apply(k, v, jnp.subtract))
    table = jr.SortedTable.create(8, key=np.int64, value=np.int64)
    args = (jnp.asarray(keys), jnp.asarray(values)) if x64 else (split64_host(keys), split64_host(values))
    table = step(step(table, *args), *args)
    got = np.asarray(table.find(np.array([2**40, 3])))
  want = {}
  for _ in range(2):
    fold_into(want, keys.tolist(), values.tolist(), jnp.subtract, np.int64)
  assert got.tolist() == [want[2**40], want[3]]


@pytest.mark.usefixtures("kernels")
def test_a_sharded_table_folds_word_pairs_in_batch_order():
  keys = np.array([5, 9, 5, 5, 9, 2**40])
  values = np.array([2**32 - 1, -1, 1, -(2**63), 2**63 - 1, 7])
  table = jr.ShardedTable.create(mesh_of(2), "shard", 16, key=np.int64, value=np.int64)
  want = {}
  for op in (jnp.add, jnp.minimum):
    table = table.insert_or_apply(keys, values, op)
    fold_into(want, keys.tolist(), values.tolist(), op, np.int64)
  query = np.array(sorted(want))
  assert np.asarray(table.find(query)).tolist() == [want[k] for k in query.tolist()]


def test_any_other_fn_gets_word_pairs_in_a_functional_table():
  """The documented behaviour for a function that is none of the known operations: it is given the
  (high, low) uint32 words of each 64-bit leaf (here it keeps the larger low word)."""
  seen = []

  def fn(old, new):
    seen.append((old.dtype, old.shape))
    return jnp.where(new[1] > old[1], new, old)

  table = jr.OpenAddressingTable.create(8, key=np.int32, value=np.int64)
  table = table.insert_or_apply(np.array([1, 1], np.int32), np.array([2**40 + 3, 2]), fn)
  assert seen[0] == (jnp.uint32, (2,))
  assert np.asarray(table.find(np.array([1], np.int32))).tolist() == [2**40 + 3]


# --------------------------------------------------------------- the stateful table


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("x64", [False, True], ids=["x64_off", "x64_on"])
@hypothesis.settings(max_examples=15, deadline=None)
@hypothesis.given(data=st.data())
def test_mutable_table_counts_int64_like_a_dict(x64, data):
  """String keys counted in int64 (TensorFlow's habit): batches of one shape with repeats and masked rows."""
  words = ["a", "b", "c", "d"]
  number = st.integers(-(2**63), 2**63 - 1) | st.sampled_from(EDGES[np.int64])
  batch = st.lists(st.tuples(st.sampled_from(words), number, st.booleans()), min_size=6, max_size=6)
  with jax.enable_x64(x64):
    counts, want = jr.MutableHashTable(str, np.int64, 0, initial_capacity=8), {}
    for rows in data.draw(st.lists(batch, min_size=1, max_size=3)):
      keys, values, valid = zip(*rows)
      counts.insert_or_apply(list(keys), np.array(values, np.int64), jnp.add, valid=np.array(valid))
      kept = [(k, v) for k, v, ok in rows if ok]
      fold_into(want, [k for k, _ in kept], [v for _, v in kept], jnp.add, np.int64)
    got = np.asarray(counts.find(words))
  assert got.dtype == np.int64
  assert got.tolist() == [want.get(w, 0) for w in words]


@pytest.mark.usefixtures("kernels")
def test_mutable_table_counts_inside_nnx_jit():
  class Counter(nnx.Module):
    def __init__(self):
      self.counts = jr.MutableHashTable(np.int64, np.int64, default_value=0)

  @nnx.jit
  def count(model, ids, amounts):
    model.counts.insert_or_apply(ids, amounts, jnp.add)

  model = Counter()
  ids, amounts = np.array([2**40, 1, 2**40]), np.array([2**32 - 1, -2, 2**32 + 1])
  for _ in range(2):  # inside jit with x64 off, 64-bit ids and amounts travel as word pairs
    count(model, split64_host(ids), split64_host(amounts))
  assert model.counts.find(np.array([2**40, 1])).tolist() == [2 * 2**33, -4]


def test_mutable_table_refuses_other_fns_on_64_bit_values():
  counts = jr.MutableHashTable(str, np.int64, default_value=0)
  counts.insert_or_apply(["a"], np.array([2**40]), jnp.add)
  before = [x.tolist() for x in counts.export()]
  for fn in (lambda old, new: old + new, jnp.divide):
    with pytest.raises(TypeError, match=r"fn: .*jnp\.add, jnp\.subtract.*word pairs"):
      counts.insert_or_apply(["a", "b"], np.array([1, 2]), fn)
    assert [x.tolist() for x in counts.export()] == before
