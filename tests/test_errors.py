"""Bad input gets a TypeError/ValueError naming the argument, and changes nothing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracle import STORAGES, exported

import jaxres as jr


@pytest.fixture(params=STORAGES, ids=lambda s: s.__name__)
def table(request):
  value = {"emb": jax.ShapeDtypeStruct((2,), jnp.float32), "n": jnp.int32}
  t = request.param.create(8, key=jnp.int32, value=value, default=0)
  return t.insert(jnp.array([1, 2], jnp.int32), {"emb": jnp.ones((2, 2)), "n": jnp.array([1, 2])})


GOOD_VALUES = {"emb": np.ones((2, 2), np.float32), "n": np.array([3, 4], np.int32)}

BAD_CALLS = [
  ("float keys", lambda t: t.insert(np.array([1.0, 2.0]), GOOD_VALUES), TypeError, "keys"),
  ("bool keys", lambda t: t.find(np.array([True])), TypeError, "keys"),
  ("int64 keys for int32 table", lambda t: t.find(np.array([1, 2], np.int64)), TypeError, "keys"),
  ("uint32 keys for int32 table", lambda t: t.remove(jnp.array([1], jnp.uint32)), TypeError, "keys"),
  ("key out of range", lambda t: t.find([2**31]), ValueError, "keys"),
  ("strings as keys", lambda t: t.find(["a"]), TypeError, "keys"),
  (
    "values batch mismatch",
    lambda t: t.insert(np.array([1, 2, 3], np.int32), GOOD_VALUES),
    ValueError,
    "values",
  ),
  (
    "missing value leaf",
    lambda t: t.insert(np.array([1, 2], np.int32), {"emb": np.ones((2, 2))}),
    TypeError,
    "values",
  ),
  (
    "wrong value row shape",
    lambda t: t.insert(np.array([1, 2], np.int32), {"emb": np.ones((2, 3)), "n": np.array([1, 2])}),
    ValueError,
    "values",
  ),
  (
    "float into int leaf",
    lambda t: t.insert(np.array([1, 2], np.int32), {"emb": np.ones((2, 2)), "n": np.array([1.5, 2.0])}),
    TypeError,
    "values",
  ),
  (
    "default shape",
    lambda t: t.find(np.array([1, 2], np.int32), default={"emb": np.ones(3), "n": 0}),
    ValueError,
    "default",
  ),
  (
    "fn not callable",
    lambda t: t.insert_or_apply(np.array([1], np.int32), jax.tree.map(lambda x: x[:1], GOOD_VALUES), 3),
    TypeError,
    "fn",
  ),
  (
    "fn changes the entry",
    lambda t: t.insert_or_apply(
      np.array([1], np.int32),
      jax.tree.map(lambda x: x[:1], GOOD_VALUES),
      lambda a, b: {"emb": a["emb"][0], "n": b["n"]},
    ),
    TypeError,
    "fn",
  ),
  (
    "valid dtype",
    lambda t: t.import_(np.array([1, 2], np.int32), GOOD_VALUES, valid=np.array([1, 0])),
    ValueError,
    "valid",
  ),
  ("resize to zero", lambda t: t.resize(0), ValueError, "capacity"),
  ("resize below size", lambda t: t.resize(1), ValueError, "capacity"),
  ("resize to float", lambda t: t.resize(8.0), TypeError, "capacity"),
]


@pytest.mark.parametrize("call, error, name", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_call_raises_and_leaves_table_unchanged(table, call, error, name):
  before = exported(table)
  with pytest.raises(error, match=name):
    call(table)
  after = exported(table)
  assert before.keys() == after.keys()
  for k in before:
    for a, b in zip(before[k], after[k]):
      np.testing.assert_array_equal(a, b)


BAD_CREATES = [
  ({"capacity": 0}, ValueError, "capacity"),
  ({"capacity": -3}, ValueError, "capacity"),
  ({"capacity": 2**40}, ValueError, "capacity"),
  ({"capacity": 4.0}, TypeError, "capacity"),
  ({"capacity": True}, TypeError, "capacity"),
  ({"key": jnp.float32}, TypeError, "key"),
  ({"key": "not a dtype"}, TypeError, "key"),
  ({"key": jax.ShapeDtypeStruct((0,), jnp.int32)}, ValueError, "key"),
  ({"value": None}, TypeError, "value"),
  ({"value": "string"}, TypeError, "value"),
  ({"default": np.ones(3)}, ValueError, "default"),
  ({"default": "x"}, TypeError, "default"),
]


@pytest.mark.parametrize("storage", STORAGES, ids=lambda s: s.__name__)
@pytest.mark.parametrize("kwargs, error, name", BAD_CREATES, ids=[str(c[0]) for c in BAD_CREATES])
def test_bad_create_raises(storage, kwargs, error, name):
  args = {"capacity": 8, "key": jnp.int32, "value": jnp.float32, "default": 0.0, **kwargs}
  with pytest.raises(error, match=name):
    storage.create(**args)


def test_bad_bucket_size():
  with pytest.raises(ValueError, match="bucket_size"):
    jr.OpenAddressingTable.create(8, key=jnp.int32, value=jnp.float32, bucket_size=0)


def test_wide_key_errors():
  t = jr.OpenAddressingTable.create(8, key=jnp.int64, value=jnp.float32)
  with pytest.raises(TypeError, match="keys: expected int64"):
    t.insert(jnp.array([1, 2], jnp.int32), jnp.ones(2))
  with pytest.raises(TypeError, match="keys"):
    t.find(jnp.zeros((3, 3), jnp.uint32))  # word pairs need a trailing 2
  with pytest.raises(TypeError, match="keys"):
    jax.jit(lambda t, k: t.find(k))(t, jnp.array([1], jnp.int32))
  pair = jr.OpenAddressingTable.create(8, key=jax.ShapeDtypeStruct((2,), jnp.int32), value=jnp.float32)
  with pytest.raises(ValueError, match="keys"):
    pair.find(np.zeros((4, 3), np.int32))
