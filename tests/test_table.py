"""Both storages against the Python-dict oracle, for every key and value kind."""

import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracle import (
  BATCH,
  CAPACITY,
  KIND_IDS,
  KINDS,
  STORAGES,
  DictTable,
  assert_matches,
  assert_rows_equal,
  compilations,
  entries,
  mesh_of,
  run_random_operations,
  table_rows,
  twice_plus,
  twice_plus_rows,
)

import jaxres as jr
from jaxres._core import row_protocol
from jaxres._core.kernels import native

# Every test runs with the CPU kernels and on their XLA references (see conftest.kernels).
pytestmark = pytest.mark.usefixtures("kernels")


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_random_operations_match_dict(storage, kind):
  # CAPACITY is below the 21 distinct keys drawn: full tables drop keys
  table, model = kind.create(storage, CAPACITY), DictTable(kind, CAPACITY)
  run_random_operations(table, model, np.random.default_rng(KIND_IDS.index(kind.name)))


@pytest.mark.parametrize("storage", STORAGES)
def test_last_duplicate_wins_and_first_inserts(storage):
  t = storage.create(8, key=jnp.int32, value=jnp.int32, default=-1)
  t = t.insert(jnp.array([5, 5, 6, 5]), jnp.array([1, 2, 3, 4]))
  assert t.find(jnp.array([5, 6])).tolist() == [4, 3]
  t, got = t.find_or_insert(jnp.array([7, 5, 7]), jnp.array([10, 11, 12]))
  assert got.tolist() == [10, 4, 10]
  assert int(t.size) == 3


@pytest.mark.parametrize("storage", STORAGES)
def test_insert_or_apply_folds_in_batch_order(storage):
  t = storage.create(8, key=jnp.int32, value=jnp.float32)
  t = t.insert(jnp.array([1]), jnp.array([1.0]))
  # fn(old, new) = 10 * old + new is order-sensitive: ((1*10+2)*10+3) = 123.
  t = t.insert_or_apply(jnp.array([1, 1, 9, 9]), jnp.array([2.0, 3.0, 4.0, 5.0]), lambda a, b: 10 * a + b)
  assert t.find(jnp.array([1, 9])).tolist() == [123.0, 45.0]


@pytest.mark.parametrize("storage", STORAGES)
def test_full_table_counts_dropped_exactly_in_batch_order(storage):
  t = storage.create(3, key=jnp.int32, value=jnp.int32, default=-1)
  t = t.insert(jnp.array([1, 2]), jnp.array([1, 2]))
  # Room for one: 9 comes first in batch order and wins; 7 (twice) and 8 are lost; 1 updates.
  t = t.insert(jnp.array([9, 7, 1, 8, 7]), jnp.array([9, 7, 10, 8, 70]))
  assert int(t.size) == 3 and int(t.dropped) == 2
  assert t.find(jnp.array([9, 7, 1, 8])).tolist() == [9, -1, 10, -1]
  t, got = t.find_or_insert(jnp.array([4, 1]), jnp.array([4, 0]))
  assert got.tolist() == [-1, 10] and int(t.dropped) == 3
  t = t.remove(jnp.array([2]))
  t = t.insert(jnp.array([4]), jnp.array([4]))
  assert int(t.size) == 3 and int(t.dropped) == 3, "dropped is sticky"
  t = t.resize(8)
  assert int(t.dropped) == 0 and int(t.size) == 3


@pytest.mark.parametrize("storage", STORAGES)
def test_fills_to_capacity_exactly(storage):
  capacity = 100
  t = storage.create(capacity, key=jnp.int32, value=jnp.int32)
  keys = np.random.default_rng(1).permutation(1000)[:150].astype(np.int32)
  t = t.insert(keys, keys)
  assert int(t.size) == capacity and int(t.dropped) == 50
  np.testing.assert_array_equal(t.find(keys[:capacity]), keys[:capacity])
  assert not np.asarray(t.contains(keys[capacity:])).any()


# Both storages, and open addressing with tiny buckets, where most keys
# overflow their home bucket and every probe chain must be followed.
REACHABILITY_TABLES = {
  **{storage.__name__: storage.create for storage in STORAGES},
  **{
    f"OpenAddressingTable-bucket{size}": functools.partial(jr.OpenAddressingTable.create, bucket_size=size)
    for size in (1, 2)
  },
}


@pytest.mark.parametrize("create", REACHABILITY_TABLES.values(), ids=REACHABILITY_TABLES.keys())
def test_remove_then_reinsert_keeps_every_key_reachable(create):
  rng = np.random.default_rng(2)
  t = create(64, key=jnp.uint32, value=jnp.int32, default=-1)
  model = {}
  for _ in range(30):
    keys = rng.integers(0, 100, size=16).astype(np.uint32)
    if rng.random() < 0.5:
      t = t.insert(keys, keys.astype(np.int32))
      for k in keys.tolist():
        if k in model or len(model) < 64:
          model[k] = k
    else:
      t = t.remove(keys)
      for k in keys.tolist():
        model.pop(k, None)
    probe = np.arange(100, dtype=np.uint32)
    np.testing.assert_array_equal(t.find(probe), [model.get(k, -1) for k in probe.tolist()])
    assert int(t.size) == len(model)


@pytest.mark.parametrize("storage", STORAGES)
def test_batch_shapes_scalars_and_empty_batches(storage):
  t = storage.create(16, key=jnp.int32, value=jax.ShapeDtypeStruct((2,), jnp.float32), default=-1.0)
  keys = jnp.arange(6, dtype=jnp.int32).reshape(2, 3)
  t = t.insert(keys, jnp.ones((2, 3, 2)))
  assert t.find(keys).shape == (2, 3, 2)
  assert t.contains(keys).shape == (2, 3)
  t = t.insert(10, jnp.array([5.0, 6.0]))
  assert t.find(10).tolist() == [5.0, 6.0] and t.contains(10).shape == ()
  values, found = t.lookup(11)
  assert values.tolist() == [-1.0, -1.0] and not bool(found)
  empty = jnp.zeros((0,), jnp.int32)
  assert t.insert(empty, jnp.zeros((0, 2))) is t
  assert t.remove(empty) is t
  assert t.find(empty).shape == (0, 2) and t.contains(empty).shape == (0,)
  t2, got = t.find_or_insert(empty, jnp.zeros((0, 2)))
  assert t2 is t and got.shape == (0, 2)
  assert int(t.size) == 7


@pytest.mark.parametrize("storage", STORAGES)
def test_dynamic_default(storage):
  t = storage.create(
    8, key=jnp.int32, value={"a": jnp.float32, "b": jax.ShapeDtypeStruct((2,), jnp.int32)}, default=0
  )
  t = t.insert(jnp.array([1]), {"a": jnp.array([1.5]), "b": jnp.array([[1, 2]])})
  got = t.find(jnp.array([1, 2, 3]), default={"a": jnp.array([7.0, 8.0, 9.0]), "b": -1})
  assert got["a"].tolist() == [1.5, 8.0, 9.0]
  assert got["b"].tolist() == [[1, 2], [-1, -1], [-1, -1]]
  assert t.find(jnp.array([3]))["b"].tolist() == [[0, 0]]


@pytest.mark.parametrize("storage", STORAGES)
def test_export_import_and_resize_round_trip(storage):
  rng = np.random.default_rng(3)
  keys = rng.choice(2**31, size=40, replace=False).astype(np.int32)
  t = storage.create(64, key=jnp.int32, value=jnp.float32).insert(keys, keys.astype(np.float32))
  k, v, valid = t.export()
  assert k.shape == (64,) and int(valid.sum()) == 40
  back = storage.create(40, key=jnp.int32, value=jnp.float32).import_(k, v, valid)
  np.testing.assert_array_equal(back.find(keys), keys.astype(np.float32))
  for capacity in (40, 1000):
    resized = t.resize(capacity)
    assert resized.capacity == capacity and int(resized.size) == 40
    np.testing.assert_array_equal(resized.find(keys), keys.astype(np.float32))
  with pytest.raises(ValueError, match="capacity"):
    t.resize(39)


def test_sorted_table_exports_in_key_order():
  keys = np.array([5, -3, 2**31 - 1, -(2**31), 0], np.int32)
  t = jr.SortedTable.create(8, key=jnp.int32, value=jnp.int32).insert(keys, np.arange(5, dtype=np.int32))
  k, _v, valid = t.export()
  assert k[valid].tolist() == sorted(keys.tolist())
  pair = jr.SortedTable.create(4, key=jax.ShapeDtypeStruct((2,), jnp.uint64), value=jnp.int32)
  rows = np.array([[2, 1], [1, 2**64 - 1], [1, 0]], np.uint64)
  k, _, valid = pair.insert(rows, np.zeros(3, np.int32)).export()
  assert np.asarray(k)[np.asarray(valid)].tolist() == sorted(rows.tolist())


@pytest.mark.parametrize("storage", STORAGES)
def test_same_inputs_same_layout(storage):
  keys = np.random.default_rng(4).integers(0, 50, size=64).astype(np.int32)

  def build():
    t = storage.create(40, key=jnp.int32, value=jnp.int32)
    t = t.insert(keys, np.arange(64, dtype=np.int32))
    return t.remove(keys[::3])

  a, b = build(), build()
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize(
  "fn", [jnp.add, jnp.maximum, jnp.minimum, jnp.multiply, operator.add], ids=lambda f: f.__name__
)
def test_order_free_integer_reductions_equal_the_fold(storage, fn):
  rng = np.random.default_rng(5)
  keys = rng.integers(0, 6, size=64).astype(np.int32)  # every key many times
  values = rng.integers(-3, 4, size=64).astype(np.int32)
  t = storage.create(16, key=jnp.int32, value=jnp.int32, default=0).insert(
    np.array([1, 2], np.int32), np.array([5, -5], np.int32)
  )
  model = {1: np.int32(5), 2: np.int32(-5)}
  for k, v in zip(keys.tolist(), values):
    model[k] = np.int32(fn(model[k], v)) if k in model else v
  t = t.insert_or_apply(keys, values, fn)
  probe = np.arange(6, dtype=np.int32)
  np.testing.assert_array_equal(t.find(probe), [model.get(k, 0) for k in probe.tolist()])


@pytest.mark.parametrize("storage", STORAGES)
def test_float_accumulation_is_the_sequential_fold(storage):
  values = np.random.default_rng(6).standard_normal(200).astype(np.float32) * np.float32(1e4)
  keys = np.zeros(200, np.int32)
  t = storage.create(4, key=jnp.int32, value=jnp.float32).insert_or_apply(keys, values, jnp.add)
  expected = values[0]
  for v in values[1:]:
    expected = np.float32(expected + v)
  assert np.float32(t.find(np.int32(0))) == expected


def _masked(keys, values, valid):
  keep = np.asarray(valid)
  return np.asarray(keys)[keep], jax.tree.map(lambda v: np.asarray(v)[keep], values)


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("kind", KINDS[:3] + KINDS[-1:], ids=KIND_IDS[:3] + KIND_IDS[-1:])
def test_valid_masks_skip_rows_like_padding(storage, kind):
  """Rows marked invalid behave as if absent from the batch; masked find_or_insert rows get the default."""
  rng = np.random.default_rng(7)
  table, model = kind.create(storage, CAPACITY), DictTable(kind, CAPACITY)
  for step in range(24):
    op = ["insert", "find_or_insert", "apply", "remove"][step % 4]
    keys, values = kind.keys(rng, BATCH, pool=14), kind.values(rng, BATCH)
    valid = jnp.asarray(rng.random(BATCH) < 0.6)
    kept_keys, kept_values = _masked(keys, values, valid)
    if op == "insert":
      table = table.insert(keys, values, valid=valid)
      model.insert(kept_keys, kept_values)
    elif op == "find_or_insert":
      table, got = table.find_or_insert(keys, values, valid=valid)
      expected = iter(model.find_or_insert(kept_keys, kept_values))
      want = [next(expected) if ok else model.default for ok in np.asarray(valid).tolist()]
      assert_rows_equal(table_rows(got, BATCH), want)
    elif op == "apply":
      table = table.insert_or_apply(keys, values, twice_plus, valid=valid)
      model.insert_or_apply(kept_keys, kept_values, twice_plus_rows)
    else:
      table = table.remove(keys, valid=valid)
      model.remove(kept_keys)
    assert_matches(table, model), f"diverged after step {step} ({op})"
  with pytest.raises(ValueError, match="valid"):
    table.insert(keys, values, valid=jnp.ones(BATCH + 1, bool))


@pytest.mark.parametrize("storage", STORAGES)
def test_eager_batches_share_one_compiled_shape(storage):
  table = storage.create(64, key=jnp.uint32, value=jnp.int32, default=-1)
  compiled = row_protocol.upsert._cache_size()
  model = {}
  for n in (3, 5, 7, 8):  # all padded to 8 rows
    keys = np.arange(10 * n, 11 * n, dtype=np.uint32)
    table = table.insert(keys, keys.astype(np.int32))
    model.update(zip(keys.tolist(), keys.tolist()))
  assert row_protocol.upsert._cache_size() - compiled <= 1
  keys = np.array(sorted(model), np.uint32)
  assert table.find(keys).tolist() == [model[k] for k in keys.tolist()]
  assert int(table.size) == len(model)


@pytest.mark.parametrize("storage", STORAGES)
def test_an_import_shares_the_program_of_an_insert_of_its_shape(storage):
  """``import_words`` leaves ``report`` to its default and ``insert`` passes it: one program, not two
  (jit keys its cache by the keywords as given; ``row_protocol`` passes every static argument)."""
  table = storage.create(64, key=jnp.uint32, value=jnp.int32, default=-1)
  keys = np.arange(8, dtype=np.uint32)
  inserted = table.insert(keys, keys.astype(np.int32))
  compiled = row_protocol.upsert._cache_size()
  words, _ = table.key_spec.encode(keys)  # host rows, as insert hands them to its program
  imported = table.import_words(words, [keys.astype(np.int32)], np.ones(8, bool))
  assert row_protocol.upsert._cache_size() == compiled
  assert entries(imported) == entries(inserted) == {(k,): [k] for k in range(8)}


@pytest.mark.parametrize("storage", STORAGES)
def test_large_batches_with_many_repeats_insert_each_key_once(storage):
  # 1,000 rows of ~630 distinct keys: the claims that lose in the first round
  # are retried a chunk at a time, and equal keys can land in different
  # chunks; the later one must find the key the earlier one placed.
  rng = np.random.default_rng(0)
  for _ in range(3):
    pool = rng.integers(-(2**31), 2**31 - 1, 1000).astype(np.int32)
    keys = pool[rng.integers(0, pool.size, 1000)]
    values = np.arange(1000, dtype=np.int32)
    t = storage.create(1024, key=jnp.int32, value=jnp.int32)
    inserted = t.insert(keys, values)
    assert entries(inserted) == {(k,): [v] for k, v in zip(keys.tolist(), values.tolist())}  # last wins
    t, got = t.find_or_insert(keys, values)
    first = {}
    for k, v in zip(keys.tolist(), values.tolist()):
      first.setdefault(k, v)
    assert entries(t) == {(k,): [v] for k, v in first.items()}
    assert got.tolist() == [first[k] for k in keys.tolist()]


@pytest.mark.parametrize(
  ("kind", "policy"),
  [("open_addressing", None), ("open_addressing", jr.LFU()), ("sorted", None), ("sharded", jr.LFU())],
)
def test_assign_replaces_present_values_only_and_keeps_scores(kind, policy):
  """assign: present keys take their last active row's value; nothing is inserted, scored or ticked."""
  rng = np.random.default_rng(21)
  options = {"key": jnp.int64, "value": jnp.int32, "default": -1, "eviction": policy}
  if kind == "sharded":
    table = jr.ShardedTable.create(mesh_of(4), "shard", 64, **options)
  elif kind == "sorted":
    table = jr.SortedTable.create(64, **options)
  else:
    table = jr.OpenAddressingTable.create(64, **options)
  pool = np.arange(20, dtype=np.int64) * (2**33 + 7)
  table = table.insert(pool[:12], np.arange(12, dtype=np.int32))
  model = dict(zip(pool[:12].tolist(), range(12)))
  keys = pool[rng.integers(0, 20, 16)]
  values = rng.integers(100, 200, 16).astype(np.int32)
  valid = rng.random(16) < 0.75
  before = (int(table.size), int(table.clock), table.scores(pool).tolist())
  table = table.assign(keys, values, valid=valid)
  for key, value, ok in zip(keys.tolist(), values.tolist(), valid.tolist()):
    if ok and key in model:
      model[key] = value  # the last active row wins
  assert (int(table.size), int(table.clock), table.scores(pool).tolist()) == before
  assert table.find(pool).tolist() == [model.get(k, -1) for k in pool.tolist()]


@pytest.mark.parametrize("storage", STORAGES)
def test_live_entries_and_placed_give_back_the_same_table(storage):
  """Entries out (live_entries) and back in at their slots (placed): the same slots, scores, counters."""
  keys = np.array([7, -3, 2**40, 11, 5], np.int64)
  values = np.arange(5, dtype=np.float32)
  table = storage.create(capacity=16, key=np.int64, value=np.float32, default=0.0)
  table = table.insert(keys, values).remove(np.array([11], np.int64))
  if storage is jr.OpenAddressingTable:
    table = jr.OpenAddressingTable.create(
      capacity=16, key=np.int64, value=np.float32, default=0.0, eviction=jr.LFU()
    ).insert(keys, values)
  live = table.live_entries()
  want = {int(k): float(v) for k, v in zip(keys, values) if storage is jr.OpenAddressingTable or k != 11}
  assert live.keys.dtype == np.int64
  assert dict(zip(live.keys.tolist(), live.leaves[0].tolist())) == want
  assert (live.scores is not None) == (table.eviction is not None)
  assert (live.slots is not None) == (table.slot_layout is not None)
  fewer = table.remove(keys[:2])  # decoded on the host: another count of entries loads no program
  with compilations() as loaded:
    rest = fewer.live_entries()
  assert loaded == [] and dict(zip(rest.keys.tolist(), rest.leaves[0].tolist())) == {
    k: v for k, v in want.items() if k not in (7, -3)
  }
  empty = table.import_(np.zeros(0, np.int64), np.zeros(0, np.float32))
  back = empty.placed(live.keys, live.leaves[0], live.scores, live.slots).with_counters(table.clock, 0)
  assert entries(back) == entries(table)
  if table.slot_layout is not None:  # each entry in its slot, with its score
    for a, b in zip(
      jax.tree.leaves(back.export_batch(0, table.num_slots)),
      jax.tree.leaves(table.export_batch(0, table.num_slots)),
    ):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert int(back.clock) == int(table.clock)


def test_placed_refuses_slots_that_cannot_hold_the_keys():
  table = jr.OpenAddressingTable.create(capacity=16, key=np.int32, value=np.float32, default=0.0)
  live = table.insert(np.array([1, 2], np.int32), np.ones(2, np.float32)).live_entries()
  for slots in (np.zeros(2, np.int32), live.slots + 10**6):
    with pytest.raises(ValueError, match="slots"):
      table.placed(live.keys, live.leaves[0], None, slots)


def test_import_words_matches_import():
  keys = np.array([2**33 + 1, 5, -(2**40)], np.int64)
  values = np.arange(3, dtype=np.float32)
  table = jr.OpenAddressingTable.create(capacity=8, key=np.int64, value=np.float32, default=0.0)
  words, _ = table.key_spec.encode(keys, "keys")
  imported = table.import_words(jnp.asarray(words).reshape(3, -1), [jnp.asarray(values)], jnp.ones(3, bool))
  assert entries(imported) == entries(table.import_(keys, values))


def test_each_mode_of_the_kernels_fixture_traces_what_it_names(request):
  """The ``references`` runs of this module trace no kernel; the ``kernels`` runs use them on CPU."""
  table = jr.OpenAddressingTable.create(8, key=jnp.int32, value=jnp.float32)
  keys, values = np.arange(4, dtype=np.int32), np.ones(4, np.float32)
  text = jax.jit(lambda t, k, v: t.insert(k, v)).lower(table, keys, values).as_text()
  mode = request.node.callspec.params["kernels"]
  assert ("custom_call" in text) == (mode == "kernels" and native.ENABLED)
