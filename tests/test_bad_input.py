"""The bad-input catalogue: every public entry point, fed what it must refuse.

Each bad call raises a ``TypeError``/``ValueError`` naming the argument (or
the path) and leaves its object exactly as it was (compared by export before
and after). Inputs that look odd but are valid (empty batches, NaN values,
very large batches) must work, with results checked against NumPy or a dict.
"""

import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracle import STORAGES, Sharded, entries, exported, mesh_of

import jaxres as jr

TABLES = [*STORAGES, Sharded(jr.OpenAddressingTable, 4)]


@pytest.fixture(params=TABLES, ids=lambda s: s.__name__)
def table(request):
  value = {"emb": jax.ShapeDtypeStruct((2,), jnp.float32), "n": jnp.int32}
  t = request.param.create(8, key=jnp.int32, value=value, default=0)
  return t.insert(jnp.array([1, 2], jnp.int32), {"emb": jnp.ones((2, 2)), "n": jnp.array([1, 2])})


def assert_unchanged(before: dict, after: dict):
  assert before.keys() == after.keys()
  for k in before:
    for a, b in zip(before[k], after[k]):
      np.testing.assert_array_equal(a, b)


# --------------------------------------------------------------------------
# Functional tables (both storages and a sharded table).


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
    TypeError,  # a wrong dtype is a wrong type
    "valid",
  ),
  ("resize to zero", lambda t: t.resize(0), ValueError, "capacity"),
  ("resize below size", lambda t: t.resize(1), ValueError, "capacity"),
  ("resize to float", lambda t: t.resize(8.0), TypeError, "capacity"),
  ("resize absurdly large", lambda t: t.resize(2**40), ValueError, "capacity"),
  ("resize to None", lambda t: t.resize(None), TypeError, "capacity"),
  ("None keys", lambda t: t.find(None), TypeError, "keys"),
  ("NaN keys", lambda t: t.contains(np.array([np.nan])), TypeError, "keys"),
  ("ragged keys", lambda t: t.find([[1, 2], [3]]), ValueError, "keys"),
  ("None values", lambda t: t.insert(np.array([1], np.int32), None), TypeError, "values"),
  (
    "NaN into an int leaf",
    lambda t: t.insert(np.array([1], np.int32), {"emb": np.ones((1, 2)), "n": np.array([np.nan])}),
    TypeError,
    "values",
  ),
  (
    "import keys and values differ",
    lambda t: t.import_(np.array([1, 2, 3], np.int32), GOOD_VALUES),
    ValueError,
    "values",
  ),
  (
    "fn raises",
    lambda t: t.insert_or_apply(
      np.array([1], np.int32), jax.tree.map(lambda x: x[:1], GOOD_VALUES), lambda a, b: 1 / 0
    ),
    TypeError,
    "fn",
  ),
]


@pytest.mark.parametrize("call, error, name", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_call_raises_and_leaves_table_unchanged(table, call, error, name):
  before = exported(table)
  with pytest.raises(error, match=name):
    call(table)
  assert_unchanged(before, exported(table))


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
  ({"capacity": None}, TypeError, "capacity"),
  ({"capacity": math.nan}, TypeError, "capacity"),
  ({"key": None}, TypeError, "key"),
  ({"default": None}, TypeError, "default"),
  ({"value": jnp.int32, "default": math.nan}, TypeError, "default"),
]


@pytest.mark.parametrize("storage", TABLES, ids=lambda s: s.__name__)
@pytest.mark.parametrize("kwargs, error, name", BAD_CREATES, ids=[str(c[0]) for c in BAD_CREATES])
def test_bad_create_raises(storage, kwargs, error, name):
  args = {"capacity": 8, "key": jnp.int32, "value": jnp.float32, "default": 0.0, **kwargs}
  with pytest.raises(error, match=name):
    storage.create(**args)


def test_numpy_integers_are_capacities():
  assert jr.SortedTable.create(np.int64(8), key=jnp.int32, value=jnp.float32).capacity == 8


def test_empty_batches_work_and_change_nothing(table):
  before = exported(table)
  none = np.zeros(0, np.int32)
  no_values = {"emb": np.zeros((0, 2), np.float32), "n": np.zeros(0, np.int32)}
  assert table.find(none)["emb"].shape == (0, 2) and table.contains(none).shape == (0,)
  values, found = table.lookup(none)
  assert values["n"].shape == (0,) and found.shape == (0,)
  for changed in (
    table.insert(none, no_values),
    table.remove(none),
    table.find_or_insert(none, no_values)[0],
    table.insert_or_apply(none, no_values, lambda a, b: b),
  ):
    assert_unchanged(before, exported(changed))
    assert int(changed.dropped) == 0
  assert exported(table.import_(none, no_values)) == {}  # replaces the contents with nothing


def test_nan_values_are_stored_and_nan_defaults_returned(table):
  t = table.insert(
    np.array([5], np.int32), {"emb": np.array([[np.nan, 1.0]], np.float32), "n": np.array([0], np.int32)}
  )
  got = t.find(np.array([5, 6], np.int32), default={"emb": np.array([np.nan, np.nan], np.float32), "n": 0})
  np.testing.assert_array_equal(got["emb"], [[np.nan, 1.0], [np.nan, np.nan]])  # NaN == NaN here


def test_a_batch_far_larger_than_the_table(table):
  n = 1 << 16
  keys = np.arange(n, dtype=np.int32)[::-1].copy()  # 1 and 2 are present and near the end
  t = table.insert(keys, {"emb": np.ones((n, 2), np.float32), "n": keys})
  kept = np.array([k for (k,) in entries(t)])
  assert int(t.size) == kept.size and int(t.dropped) == n - kept.size  # every key placed or counted
  np.testing.assert_array_equal(t.find(keys)["n"], np.where(np.isin(keys, kept), keys, 0))
  if not isinstance(table, jr.ShardedTable):  # (a shard admits keys up to its own capacity)
    # One key at a time: the first 6 new keys in batch order fit, 1 and 2 are updated.
    assert sorted(kept.tolist()) == sorted([int(k) for k in keys[:6]] + [1, 2])


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


# --------------------------------------------------------------------------
# Eviction: policies, scores, expiry and streaming.


def _scored(policy, sharded=False):
  if sharded:
    table = jr.ShardedTable.create(mesh_of(4), "shard", 8, key=jnp.int32, value=jnp.float32, eviction=policy)
  else:
    table = jr.OpenAddressingTable.create(8, key=jnp.int32, value=jnp.float32, eviction=policy)
  scores = {"scores": np.array([5, 6], np.uint32)} if policy.takes_scores else {}
  return table.insert(np.array([1, 2], np.int32), np.array([1.0, 2.0], np.float32), **scores)


def _scored_state(table) -> dict:
  keys = np.array([1, 2, 3], np.int32)
  return {
    **exported(table),
    "scores": table.scores(keys).tolist(),
    "counters": (int(table.clock), int(table.evictions), int(table.size)),
  }


KEYS, VALUES = np.array([3, 4], np.int32), np.array([3.0, 4.0], np.float32)


def _recent(keys, values, scores):
  return scores > 0


BAD_EVICTION_CALLS = [
  ("custom: scores missing", "custom", lambda t: t.insert(KEYS, VALUES), TypeError, "scores"),
  (
    "custom: scores missing (find_or_insert)",
    "custom",
    lambda t: t.find_or_insert(KEYS, VALUES),
    TypeError,
    "scores",
  ),
  (
    "lru: scores given",
    "lru",
    lambda t: t.insert(KEYS, VALUES, scores=np.ones(2, np.uint32)),
    ValueError,
    "scores",
  ),
  (
    "custom: float scores",
    "custom",
    lambda t: t.insert(KEYS, VALUES, scores=np.ones(2)),
    TypeError,
    "scores",
  ),
  (
    "custom: int32 JAX scores",
    "custom",
    lambda t: t.insert_and_evict(KEYS, VALUES, scores=jnp.ones(2, jnp.int32)),
    TypeError,
    "scores",
  ),
  (
    "custom: negative scores",
    "custom",
    lambda t: t.insert(KEYS, VALUES, scores=[-1, 2]),
    ValueError,
    "scores",
  ),
  (
    "custom: scores of another shape",
    "custom",
    lambda t: t.insert_or_apply(KEYS, VALUES, jnp.add, scores=np.ones(3, np.uint32)),
    ValueError,
    "scores",
  ),
  (
    "lru: import scores of another shape",
    "lru",
    lambda t: t.import_(KEYS, VALUES, scores=[1]),
    ValueError,
    "scores",
  ),
  ("erase_if: fn not callable", "lru", lambda t: t.erase_if(3), TypeError, "fn"),
  ("erase_if: fn gives one bool", "lru", lambda t: t.erase_if(lambda k, v, s: True), TypeError, "fn"),
  ("export_batch: size 0", "lru", lambda t: t.export_batch(0, 0), ValueError, "size"),
  ("lru: assign_scores, scores", "lru", lambda t: t.assign_scores(KEYS, scores=[1, 2]), ValueError, "scores"),
  ("custom: assign_scores without scores", "custom", lambda t: t.assign_scores(KEYS), TypeError, "scores"),
  ("export_if: fn not callable", "lru", lambda t: t.export_if(3, 0, 4), TypeError, "fn"),
  ("export_if: fn gives one bool", "lru", lambda t: t.export_if(lambda k, v, s: True, 0, 4), TypeError, "fn"),
  ("export_if: fn gives ints", "lru", lambda t: t.export_if(lambda k, v, s: s, 0, 4), TypeError, "fn"),
  ("export_if: size 0", "lru", lambda t: t.export_if(_recent, 0, 0), ValueError, "size"),
  ("export_if: float offset", "lru", lambda t: t.export_if(_recent, 1.5, 4), TypeError, "offset"),
  ("export_batch: float offset", "lru", lambda t: t.export_batch(1.5, 4), TypeError, "offset"),
]


@pytest.mark.parametrize("sharded", [False, True], ids=["table", "sharded"])
@pytest.mark.parametrize(
  "policy, call, error, name", [c[1:] for c in BAD_EVICTION_CALLS], ids=[c[0] for c in BAD_EVICTION_CALLS]
)
def test_bad_eviction_call_raises_and_leaves_table_unchanged(sharded, policy, call, error, name):
  table = _scored(jr.CustomScore() if policy == "custom" else jr.LRU(), sharded)
  before = _scored_state(table)
  with pytest.raises(error, match=name):
    call(table)
  assert _scored_state(table) == before


@pytest.mark.parametrize(
  "eviction, error",
  [("lru", TypeError), (jr.LRU, TypeError), (object(), TypeError), (3, TypeError)],
  ids=["a string", "the class", "an object", "a number"],
)
def test_a_policy_that_is_not_a_policy_object_is_refused(eviction, error):
  with pytest.raises(error, match="eviction"):
    jr.OpenAddressingTable.create(8, key=jnp.int32, value=jnp.float32, eviction=eviction)
  with pytest.raises(error, match="eviction"):
    jr.MutableHashTable(np.int32, np.float32, 0.0, eviction=eviction)


def test_storages_that_cannot_evict_refuse_a_policy():
  with pytest.raises(ValueError, match="eviction: a SortedTable cannot evict"):
    jr.SortedTable.create(8, key=jnp.int32, value=jnp.float32, eviction=jr.LRU())
  with pytest.raises(ValueError, match="eviction"):
    jr.MutableHashTable(np.int32, np.float32, 0.0, storage="sorted", eviction=jr.LFU())
  with pytest.raises(ValueError, match="eviction"):
    jr.ShardedTable.create(
      mesh_of(4), "shard", 8, jnp.int32, jnp.float32, storage=jr.SortedTable, eviction=jr.LRU()
    )
  with pytest.raises(ValueError, match="capacity: an evicting table over 4 shards"):
    jr.ShardedTable.create(mesh_of(4), "shard", 3, jnp.int32, jnp.float32, eviction=jr.LRU())


def test_empty_batches_change_no_scored_table():
  for policy in (jr.LRU(), jr.LFU(), jr.CustomScore()):
    table = _scored(policy)
    before = _scored_state(table)
    none, no_values = np.zeros(0, np.int32), np.zeros(0, np.float32)
    scores = {"scores": np.zeros(0, np.uint32)} if policy.takes_scores else {}
    table2, evicted = table.insert_and_evict(none, no_values, **scores)
    table3, found, evicted3 = table.find_or_insert_and_evict(none, no_values, **scores)
    for changed in (table2, table3, table.remove(none)):
      assert _scored_state(changed) == before
    assert evicted.keys.shape == evicted3.valid.shape == found.shape == (0,)


# --------------------------------------------------------------------------
# Stateful tables, resources, the manager, checkpoints and key helpers: each
# bad call runs on a fresh subject, whose state is compared before and after.


class Demo(jr.Resource):
  def _create_resource(self):
    return {"count": jnp.array(3), "total": jnp.ones(2)}


def _int64_table():
  t = jr.MutableHashTable(np.int64, np.float32, default_value=-1.0, initial_capacity=8)
  t.insert(np.array([2**40, -5], np.int64), np.array([1.0, 2.0], np.float32))
  return t


def _string_table():
  t = jr.MutableHashTable(str, str, default_value="?", max_key_length=8)
  t.insert(["a", "bb"], ["x", "y"])
  return t


def _static_table():
  init = jr.KeyValueInitializer(np.array([1, 2], np.int32), np.array([10, 20], np.int32))
  return jr.StaticHashTable(init, default_value=-1)


def _vocabulary():
  return jr.StaticVocabularyTable(jr.KeyValueInitializer(["a", "b"], np.array([0, 1], np.int64)), 3)


def _manager():
  mgr = jr.ResourceManager()
  mgr.held = mgr.lookup_or_create("", "demo", Demo)  # entries are weak: keep it alive
  return mgr


def _checkpointed(tmp_path):
  root = jr.AutoTrackable()
  root.step, root.table = jnp.array(4), _int64_table()
  checkpoint = jr.Checkpoint(model=root)
  checkpoint.path = checkpoint.save(tmp_path / "ckpt")
  return checkpoint


def _step_manager(tmp_path):
  root = jr.AutoTrackable()
  root.step = jnp.array(1)
  manager = jr.CheckpointManager(tmp_path / "steps", jr.Checkpoint(model=root))
  manager.save(1)
  return manager


def _state(subject):
  """Everything a bad call must leave as it was."""
  if isinstance(subject, jr.LookupTable):
    keys, values = subject.export()
    return list(keys), np.asarray(values).tolist(), subject.capacity
  if isinstance(subject, jr.StaticVocabularyTable):
    return subject.vocab_size, subject.find(["a", "b", "zz"]).tolist()
  if isinstance(subject, jr.Resource):
    return jax.tree.map(lambda x: np.asarray(x).tolist(), subject.state)
  if isinstance(subject, jr.ResourceManager):
    return subject.names(""), subject.lookup("", "demo") is subject.held
  if isinstance(subject, jr.Checkpoint):
    model = subject.model
    return int(model.step), _state(model.table), sorted(os.listdir(os.path.dirname(subject.path)))
  if isinstance(subject, jr.CheckpointManager):
    return subject.all_steps(), int(subject.checkpoint.model.step)
  return None


SUBJECTS = {
  "int64 table": lambda tmp: _int64_table(),
  "str table": lambda tmp: _string_table(),
  "static table": lambda tmp: _static_table(),
  "vocabulary": lambda tmp: _vocabulary(),
  "resource": lambda tmp: Demo(),
  "manager": lambda tmp: _manager(),
  "checkpoint": _checkpointed,
  "step manager": _step_manager,
  "none": lambda tmp: None,  # constructors and free functions
}

I64 = np.array([1, 2], np.int64)
F32 = np.array([1.0, 2.0], np.float32)
INIT = jr.KeyValueInitializer(["a", "b"], np.array([0, 1], np.int64))


SHELL_CALLS = [
  # jr.MutableHashTable with int64 keys
  ("int64 table", "None keys", lambda t: t.find(None), TypeError, "keys"),
  ("int64 table", "float keys", lambda t: t.insert(np.array([1.5, 2.5]), F32), TypeError, "keys"),
  ("int64 table", "NaN keys", lambda t: t.contains(np.array([np.nan])), TypeError, "keys"),
  (
    "int64 table",
    "int32 keys (maybe truncated)",
    lambda t: t.find(np.array([1], np.int32)),
    TypeError,
    "keys",
  ),
  ("int64 table", "key beyond int64", lambda t: t.find([2**70]), TypeError, "keys"),
  ("int64 table", "ragged keys", lambda t: t.remove([[1, 2], [3]]), ValueError, "keys"),
  ("int64 table", "too few values", lambda t: t.insert(I64, F32[:1]), ValueError, "values"),
  ("int64 table", "None values", lambda t: t.insert(I64, None), TypeError, "values"),
  ("int64 table", "string values", lambda t: t.insert(I64, ["a", "b"]), TypeError, "values"),
  ("int64 table", "find_or_insert None values", lambda t: t.find_or_insert(I64, None), TypeError, "values"),
  ("int64 table", "default of another shape", lambda t: t.find(I64, np.ones(3)), ValueError, "default"),
  ("int64 table", "string default", lambda t: t.find(I64, "x"), TypeError, "default"),
  ("int64 table", "import keys and values differ", lambda t: t.import_(I64, F32[:1]), ValueError, "values"),
  ("int64 table", "reserve 0", lambda t: t.reserve(0), ValueError, "capacity"),
  ("int64 table", "reserve 2**40", lambda t: t.reserve(2**40), ValueError, "capacity"),
  ("int64 table", "reserve 2.5", lambda t: t.reserve(2.5), TypeError, "capacity"),
  ("int64 table", "state: not a table", lambda t: setattr(t, "state", "x"), TypeError, "state"),
  (
    "int64 table",
    "state: a table of other keys",
    lambda t: setattr(t, "state", jr.OpenAddressingTable.create(8, key=jnp.int32, value=jnp.float32)),
    TypeError,
    "state",
  ),
  # jr.MutableHashTable with string keys and values
  (
    "str table",
    "key over max_key_length",
    lambda t: t.insert(["a", "much too long"], ["x", "y"]),
    ValueError,
    "keys",
  ),
  ("str table", "value over max length", lambda t: t.insert(["a"], ["x" * 100]), ValueError, "values"),
  ("str table", "int keys", lambda t: t.find([3]), TypeError, "keys"),
  ("str table", "None among keys", lambda t: t.remove(["a", None]), TypeError, "keys"),
  ("str table", "int values", lambda t: t.insert(["a"], [3]), TypeError, "values"),
  ("str table", "None keys", lambda t: t.contains(None), TypeError, "keys"),
  # jr.StaticHashTable, jr.StaticVocabularyTable
  (
    "static table",
    "insert",
    lambda t: t.insert(np.array([3], np.int32), np.array([1], np.int32)),
    TypeError,
    "immutable",
  ),
  ("static table", "remove", lambda t: t.remove(np.array([1], np.int32)), TypeError, "immutable"),
  ("static table", "string keys", lambda t: t.find(["a"]), TypeError, "keys"),
  ("static table", "None keys", lambda t: t.lookup(None), TypeError, "keys"),
  ("vocabulary", "int keys for a string vocabulary", lambda v: v.lookup([1, 2]), TypeError, "keys"),
  ("vocabulary", "None among keys", lambda v: v.lookup(["a", None]), TypeError, "keys"),
  # jr.Resource, jr.ResourceManager
  ("resource", "state with a string leaf", lambda r: setattr(r, "state", {"count": "x"}), TypeError, "state"),
  ("manager", "container None", lambda m: m.lookup_or_create(None, "x", Demo), TypeError, "container"),
  ("manager", "shared_name not a str", lambda m: m.lookup_or_create("", 3, Demo), TypeError, "shared_name"),
  ("manager", "create_fn None", lambda m: m.lookup_or_create("", "x", None), TypeError, "create_fn"),
  (
    "manager",
    "verify_fn not callable",
    lambda m: m.lookup_or_create("", "x", Demo, verify_fn=3),
    TypeError,
    "verify_fn",
  ),
  (
    "manager",
    "create_fn returns an int",
    lambda m: m.lookup_or_create("", "x", lambda: 3),
    TypeError,
    "create_fn",
  ),
  (
    "manager",
    "verify_fn refuses",
    lambda m: m.lookup_or_create("", "demo", Demo, verify_fn=_refuse),
    ValueError,
    "incompatible",
  ),
  ("manager", "lookup of a missing name", lambda m: m.lookup("", "missing"), KeyError, "missing"),
  ("manager", "delete of a missing name", lambda m: m.delete("", "missing"), KeyError, "missing"),
  # jr.Checkpoint, jr.CheckpointManager, jr.inspect_checkpoint
  ("checkpoint", "save to None", lambda c: c.save(None), TypeError, "path"),
  ("checkpoint", "restore from None", lambda c: c.restore(None), TypeError, "path"),
  (
    "checkpoint",
    "restore from a missing directory",
    lambda c: c.restore(c.path + "-missing"),
    ValueError,
    "not a jaxres checkpoint",
  ),
  (
    "checkpoint",
    "restore from a file",
    lambda c: c.restore(os.path.join(c.path, "manifest", "metadata")),
    ValueError,
    "^path: .*metadata is a file; expected a directory",
  ),
  ("step manager", "save step -1", lambda m: m.save(-1), ValueError, "step"),
  ("step manager", "save step 1.5", lambda m: m.save(1.5), TypeError, "step"),
  ("step manager", "save a saved step", lambda m: m.save(1), ValueError, "already saved"),
  ("step manager", "restore a missing step", lambda m: m.restore(7), ValueError, "step"),
  (
    "none",
    "manager directory None",
    lambda _: jr.CheckpointManager(None, jr.Checkpoint()),
    TypeError,
    "directory",
  ),
  (
    "none",
    "manager of no checkpoint",
    lambda _: jr.CheckpointManager("/tmp/x", None),
    TypeError,
    "checkpoint",
  ),
  (
    "none",
    "max_to_keep 0",
    lambda _: jr.CheckpointManager("/tmp/x", jr.Checkpoint(), max_to_keep=0),
    ValueError,
    "max_to_keep",
  ),
  ("none", "inspect None", lambda _: jr.inspect_checkpoint(None), TypeError, "path"),
  (
    "none",
    "inspect a missing directory",
    lambda _: jr.inspect_checkpoint("/nonexistent/ckpt"),
    ValueError,
    "not a jaxres checkpoint",
  ),
  # constructors
  ("none", "key_dtype None", lambda _: jr.MutableHashTable(None, np.float32, 0.0), TypeError, "key"),
  ("none", "key_dtype float", lambda _: jr.MutableHashTable(np.float32, np.float32, 0.0), TypeError, "key"),
  ("none", "value_dtype None", lambda _: jr.MutableHashTable(np.int32, None, 0.0), TypeError, "value_dtype"),
  (
    "none",
    "default_value None",
    lambda _: jr.MutableHashTable(np.int32, np.float32, None),
    TypeError,
    "default_value",
  ),
  (
    "none",
    "NaN default for int values",
    lambda _: jr.MutableHashTable(np.int32, np.int32, math.nan),
    TypeError,
    "default",
  ),
  (
    "none",
    "str values, int default",
    lambda _: jr.MutableHashTable(np.int32, str, 0),
    TypeError,
    "default_value",
  ),
  (
    "none",
    "initial_capacity 0",
    lambda _: jr.MutableHashTable(np.int32, np.int32, 0, initial_capacity=0),
    ValueError,
    "initial_capacity",
  ),
  (
    "none",
    "initial_capacity 2**40",
    lambda _: jr.MutableHashTable(np.int32, np.int32, 0, initial_capacity=2**40),
    ValueError,
    "initial_capacity",
  ),
  (
    "none",
    "initial_capacity None",
    lambda _: jr.MutableHashTable(np.int32, np.int32, 0, initial_capacity=None),
    TypeError,
    "initial_capacity",
  ),
  (
    "none",
    "unknown storage",
    lambda _: jr.MutableHashTable(np.int32, np.int32, 0, storage="btree"),
    ValueError,
    "storage",
  ),
  (
    "none",
    "max_key_length 0",
    lambda _: jr.MutableHashTable(str, np.int32, 0, max_key_length=0),
    ValueError,
    "max_key_length",
  ),
  (
    "none",
    "max_key_length 2**40",
    lambda _: jr.MutableHashTable(str, np.int32, 0, max_key_length=2**40),
    ValueError,
    "max_key_length",
  ),
  (
    "none",
    "device a string",
    lambda _: jr.MutableHashTable(np.int32, np.int32, 0, device="gpu:7"),
    TypeError,
    "device",
  ),
  ("none", "resource device an int", lambda _: Demo(device=3), TypeError, "device"),
  (
    "none",
    "static table of no initializer",
    lambda _: jr.StaticHashTable(None, -1),
    TypeError,
    "initializer",
  ),
  (
    "none",
    "initializer with a repeated key",
    lambda _: jr.StaticHashTable(jr.KeyValueInitializer([1, 1], [2, 3]), -1),
    ValueError,
    "duplicate",
  ),
  (
    "none",
    "initializer lengths differ",
    lambda _: jr.KeyValueInitializer(np.array([1, 2]), np.array([1])),
    ValueError,
    "keys",
  ),
  ("none", "initializer of None", lambda _: jr.KeyValueInitializer(None, None), TypeError, "keys"),
  (
    "none",
    "initializer of float keys",
    lambda _: jr.StaticHashTable(jr.KeyValueInitializer([1.5], [1]), -1),
    TypeError,
    "key",
  ),
  (
    "none",
    "text file missing",
    lambda _: jr.StaticHashTable(jr.TextFileInitializer("/nonexistent/v.txt", str, -2, np.int64, -1), -1),
    FileNotFoundError,
    "filename",
  ),
  (
    "none",
    "text file column a str",
    lambda _: jr.TextFileInitializer("v.txt", str, "0", np.int64, -1),
    TypeError,
    "key_index",
  ),
  ("none", "num_oov_buckets 0", lambda _: jr.StaticVocabularyTable(INIT, 0), ValueError, "num_oov_buckets"),
  (
    "none",
    "num_oov_buckets 2**40",
    lambda _: jr.StaticVocabularyTable(INIT, 2**40),
    ValueError,
    "num_oov_buckets",
  ),
  (
    "none",
    "num_oov_buckets 1.5",
    lambda _: jr.StaticVocabularyTable(INIT, 1.5),
    TypeError,
    "num_oov_buckets",
  ),
  (
    "none",
    "vocabulary of float ids",
    lambda _: jr.StaticVocabularyTable(jr.KeyValueInitializer(["a"], [0.5]), 1),
    TypeError,
    "initializer",
  ),
  (
    "none",
    "sharded: mesh None",
    lambda _: jr.ShardedTable.create(None, "shard", 16, jnp.int32, jnp.float32),
    TypeError,
    "mesh",
  ),
  (
    "none",
    "sharded: unknown axis",
    lambda _: jr.ShardedTable.create(mesh_of(4), "rows", 16, jnp.int32, jnp.float32),
    ValueError,
    "axis",
  ),
  (
    "none",
    "sharded: shard_capacity 0",
    lambda _: jr.ShardedTable.create(mesh_of(4), "shard", 16, jnp.int32, jnp.float32, shard_capacity=0),
    ValueError,
    "shard_capacity",
  ),
  (
    "none",
    "sharded: storage not a table",
    lambda _: jr.ShardedTable.create(mesh_of(4), "shard", 16, jnp.int32, jnp.float32, storage=dict),
    TypeError,
    "storage",
  ),
  # jr.keys
  ("none", "split64 of floats", lambda _: jr.keys.split64(np.array([1.5])), TypeError, "x"),
  ("none", "join64 of odd rows", lambda _: jr.keys.join64(np.zeros((3, 3), np.uint32)), TypeError, "pairs"),
  (
    "none",
    "join64 to float",
    lambda _: jr.keys.join64(np.zeros((3, 2), np.uint32), dtype=np.float32),
    TypeError,
    "dtype",
  ),
  ("none", "encode_strings of None", lambda _: jr.keys.encode_strings([None]), TypeError, "values"),
  (
    "none",
    "encode_strings over max_length",
    lambda _: jr.keys.encode_strings(["x" * 9], max_length=8),
    ValueError,
    "values",
  ),
  (
    "none",
    "decode_strings of floats",
    lambda _: jr.keys.decode_strings(np.zeros(2, np.float32)),
    TypeError,
    "rows",
  ),
  (
    "none",
    "decode_strings of garbage",
    lambda _: jr.keys.decode_strings(np.array([[0, 99]], np.uint32)),
    ValueError,
    "rows",
  ),
]


def _refuse(existing):
  raise ValueError("incompatible: capacity differs")


@pytest.mark.parametrize(
  "subject, call, error, match",
  [c[:1] + c[2:] for c in SHELL_CALLS],
  ids=[f"{c[0]}: {c[1]}" for c in SHELL_CALLS],
)
def test_bad_call_raises_and_leaves_everything_as_it_was(subject, call, error, match, tmp_path):
  obj = SUBJECTS[subject](tmp_path)
  before = _state(obj)
  with pytest.raises(error, match=match):
    call(obj)
  assert _state(obj) == before


def test_stateful_empty_batches_work():
  table, strings = _int64_table(), _string_table()
  before = _state(table), _state(strings)
  none = np.zeros(0, np.int64)
  table.insert(none, np.zeros(0, np.float32))
  table.remove(none)
  assert table.find(none).shape == (0,) and table.lookup(none)[1].shape == (0,)
  assert table.find_or_insert(none, np.zeros(0, np.float32)).shape == (0,)
  strings.insert([], [])
  strings.remove([])
  assert strings.find([]).shape == (0,) and strings.contains([]).shape == (0,)
  assert (_state(table), _state(strings)) == before
  assert _static_table().find(np.zeros(0, np.int32)).shape == (0,)
  assert _vocabulary().find([]).shape == (0,) and _vocabulary().lookup([])[1].shape == (0,)
  table.import_(none, np.zeros(0, np.float32))  # replaces the contents with nothing
  assert len(table) == 0


def test_a_stateful_table_grows_through_a_large_batch_and_stores_nan():
  table = jr.MutableHashTable(np.int64, np.float32, default_value=np.nan, initial_capacity=8)
  keys = np.random.default_rng(0).permutation(1 << 16).astype(np.int64) * 3 - 2**50
  values = np.arange(keys.size, dtype=np.float32)
  values[::7] = np.nan
  table.insert(keys, values)
  assert len(table) == keys.size and table.capacity >= keys.size
  np.testing.assert_array_equal(table.find(keys), values)  # NaN where NaN was stored
  assert np.isnan(table.find(np.array([1], np.int64))).all()  # the NaN default
  exported_keys, exported_values = table.export()
  order = np.argsort(keys)
  np.testing.assert_array_equal(exported_keys, keys[order])
  np.testing.assert_array_equal(exported_values, values[order])


_DIRECTORY_ENTRY_POINTS = {
  "Checkpoint.save": lambda root, path: jr.Checkpoint(model=root).save(path),
  "Checkpoint.restore": lambda root, path: jr.Checkpoint(model=root).restore(path),
  "CheckpointManager": lambda root, path: jr.CheckpointManager(path, jr.Checkpoint(model=root)),
  "saved_model.save": lambda root, path: jr.saved_model.save(root, path, {}),
  "saved_model.load": lambda root, path: jr.saved_model.load(path),
  "saved_model.save_delta": lambda root, path: jr.saved_model.save_delta(root, path, path, step=1),
}


@pytest.mark.parametrize("below", [False, True], ids=["the path", "a folder above it"])
@pytest.mark.parametrize("entry", _DIRECTORY_ENTRY_POINTS)
def test_a_file_where_a_directory_belongs_is_refused_and_kept(entry, below, tmp_path):
  """A checkpoint or export location that is (or lies under) a file: a ValueError naming the argument
  and the file, before anything is written; the file is left as it was (Checkpoint.save replaced it
  with a checkpoint before)."""
  file = tmp_path / "notes.txt"
  file.write_text("keep me")
  root = jr.AutoTrackable()
  root.table = jr.MutableHashTable(jnp.int32, jnp.float32, default_value=0.0)
  name = "directory" if entry == "CheckpointManager" else "path"
  with pytest.raises(ValueError, match=f"^{name}: {re.escape(str(file))} is a file"):
    _DIRECTORY_ENTRY_POINTS[entry](root, file / "step" if below else file)
  assert file.read_text() == "keep me" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
