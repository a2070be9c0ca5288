"""jr.MutableHashTable against a dict oracle, the seed's scenarios, threads and NNX."""

import functools
import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from oracle import stateful_step

import jaxres as jr
from jaxres._core.storages import registry

STORAGES = list(registry.STORAGES)  # every registered storage kind, by name


@pytest.mark.parametrize("storage", STORAGES)
def test_seed_find_insert_find_with_strings(storage):
  table = jr.MutableHashTable(str, np.float32, default_value=-999.0, storage=storage)
  assert table.find(["one"]).tolist() == [-999.0]
  table.insert(["one"], np.array([100.0], np.float32))
  assert table.find(["one", "two"]).tolist() == [100.0, -999.0]
  assert table.find(["two"], default=np.float32(-1.0)).tolist() == [-1.0]


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("key_dtype, value_dtype", [(np.int32, np.float32), (np.int64, np.int32)])
def test_seed_find_insert_remove_find_under_jit(storage, key_dtype, value_dtype):
  table = jr.MutableHashTable(key_dtype, value_dtype, default_value=-1, storage=storage)
  keys = np.array([3, 7], key_dtype)
  arg = jr.keys.split64(keys) if np.dtype(key_dtype).itemsize == 8 else jnp.asarray(keys)

  @nnx.jit
  def scenario(table, keys):
    before = table.find(keys)
    table.insert(keys, jnp.array([10, 20], value_dtype))
    inserted = table.find(keys)
    table.remove(keys[:1])
    return before, inserted, table.find(keys)

  before, inserted, after = scenario(table, arg)
  assert before.tolist() == [-1, -1] and inserted.tolist() == [10, 20] and after.tolist() == [-1, 20]
  assert len(table) == 1 and table.find(keys).tolist() == [-1, 20]


@pytest.mark.parametrize("storage", STORAGES)
def test_grows_and_never_loses_a_key(storage):
  table = jr.MutableHashTable(np.int64, np.int64, default_value=0, initial_capacity=4, storage=storage)
  keys = np.arange(3000, dtype=np.int64) * (2**33 + 1)
  for chunk in np.array_split(keys, 7):
    table.insert(chunk, -chunk)
  assert len(table) == 3000 and table.capacity >= 3000
  np.testing.assert_array_equal(table.find(keys), -keys)


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("key_dtype", [np.int32, np.uint64, str])
def test_random_operations_match_dict(storage, key_dtype):
  rng = np.random.default_rng(0)
  table = jr.MutableHashTable(key_dtype, np.int32, default_value=-1, initial_capacity=4, storage=storage)
  model = {}

  def draw(n):
    raw = rng.integers(0, 40, size=n)
    if key_dtype is str:
      return np.array([f"key-{k}-é" for k in raw], dtype=object)
    return raw.astype(key_dtype)

  for _ in range(25):
    keys, values = draw(6), rng.integers(-100, 100, size=6).astype(np.int32)
    op = rng.choice(["insert", "remove", "find"])
    stateful_step(table, model, op, keys, values, default=-1)
    if op == "find":
      assert np.asarray(table.contains(keys)).tolist() == [k in model for k in keys.tolist()]
    exported_keys, exported_values = table.export()
    assert list(exported_keys) == sorted(model)
    assert np.asarray(exported_values).tolist() == [model[k] for k in sorted(model)]
    assert len(table) == len(model)


def test_import_replaces_contents():
  table = jr.MutableHashTable(np.int32, np.float32, default_value=0.0, initial_capacity=2)
  table.insert(np.array([1, 2], np.int32), np.array([1.0, 2.0], np.float32))
  table.import_(np.arange(10, 20, dtype=np.int32), np.arange(10, dtype=np.float32))
  keys, values = table.export()
  assert keys.tolist() == list(range(10, 20)) and values.tolist() == list(range(10))
  assert table.find(np.array([1], np.int32)).tolist() == [0.0]


def test_pytree_values_and_lookup():
  default = {"emb": np.zeros(3, np.float32), "count": np.int32(0)}
  table = jr.MutableHashTable(np.int32, {"emb": np.float32, "count": np.int32}, default_value=default)
  table.insert(
    np.array([5], np.int32), {"emb": np.ones((1, 3), np.float32), "count": np.array([2], np.int32)}
  )
  values, found = table.lookup(np.array([5, 6], np.int32))
  assert values["emb"].tolist() == [[1.0] * 3, [0.0] * 3] and values["count"].tolist() == [2, 0]
  assert found.tolist() == [True, False]


def test_repr_shows_a_few_entries_and_truncates():
  table = jr.MutableHashTable(str, str, default_value="", initial_capacity=4)
  assert repr(table) == "MutableHashTable(key=str, value=str, size=0, {})"
  table.insert(["b", "a", "c", "d"], ["x" * 60, "y", "z", "w"])
  text = str(table)
  assert text.startswith("MutableHashTable(key=str, value=str, size=4, {'a': 'y', 'b': 'xxx")
  assert " ..." in text and text.endswith(", ...})") and "'d'" not in text


def test_html_repr_lists_entries_in_key_order_escaped():
  table = jr.MutableHashTable(str, np.int32, default_value=0)
  empty = jr.MutableHashTable(np.int32, np.int32, 0, initial_capacity=2)._repr_html_()
  assert "size <code>0</code>" in empty and "<table>" not in empty
  table.insert([f"k{i:02d}" for i in range(12)] + ["<b>"], np.arange(13, dtype=np.int32))
  html = table._repr_html_()
  assert html.count("<tr>") == 1 + 10 + 1  # header, ten entries, "... 3 more"
  assert "&lt;b&gt;" in html and "<b>" not in html.replace("<b>MutableHashTable</b>", "")
  assert html.index("k00") < html.index("k01") and "3 more" in html and "size <code>13</code>" in html
  core = table.state
  core_html = core._repr_html_()
  assert "load <code>0.01</code>" in core_html and core_html.count("<tr>") == 1 + 10 + 1


def test_find_or_insert_returns_existing_values_and_inserts_new_ones():
  table = jr.MutableHashTable(np.int64, np.int32, default_value=-1, initial_capacity=2)
  oracle = {}
  rng = np.random.default_rng(3)
  for _ in range(5):
    keys = rng.integers(-6, 6, size=7) * 2**35
    values = rng.integers(0, 100, size=7).astype(np.int32)
    expected = [oracle.setdefault(k, v) for k, v in zip(keys.tolist(), values.tolist())]
    assert table.find_or_insert(keys, values).tolist() == expected  # grows as needed
  keys, values = table.export()
  assert dict(zip(keys.tolist(), values.tolist())) == oracle
  with pytest.raises(TypeError, match="keys"):
    table.find_or_insert(jnp.array([1], jnp.int32), np.array([1], np.int32))


def test_find_or_insert_inside_jit_counts_what_does_not_fit():
  model = Counter(4)

  @nnx.jit
  def step(model, keys):
    return model.table.find_or_insert(keys, keys * 10)

  rows = step(model, jnp.array([1, 2, 1, 3, 4, 5, 6], jnp.int32))
  assert rows.tolist() == [10, 20, 10, 30, 40, 0, 0]  # 5 and 6 do not fit: the default
  with pytest.raises(ValueError, match="2 key\\(s\\) were lost"):
    len(model.table)


def test_bad_input_is_rejected_and_changes_nothing():
  table = jr.MutableHashTable(str, np.int32, default_value=0, max_key_length=8)
  table.insert(["ok"], np.array([1], np.int32))
  with pytest.raises(ValueError, match="keys: 'much too long'"):
    table.insert(["fine", "much too long"], np.array([2, 3], np.int32))
  with pytest.raises(TypeError, match="keys"):
    table.insert([3], np.array([1], np.int32))
  with pytest.raises(ValueError, match="values"):
    table.insert(["a", "b"], np.array([1, 2, 3], np.int32))
  assert table.export()[0].tolist() == ["ok"]
  with pytest.raises(ValueError, match="storage"):
    jr.MutableHashTable(np.int32, np.int32, 0, storage="btree")
  with pytest.raises(TypeError, match="key"):
    jr.MutableHashTable(np.float32, np.int32, 0)
  with pytest.raises(TypeError, match="default_value"):
    jr.MutableHashTable(np.int32, str, 0)


class Counter(nnx.Module):
  def __init__(self, capacity):
    self.table = jr.MutableHashTable(np.int32, np.int32, default_value=0, initial_capacity=capacity)


def test_nnx_jit_updates_persist_without_retracing():
  model = Counter(64)
  traces = []

  @nnx.jit
  def step(model, keys):
    traces.append(1)
    model.table.insert(keys, model.table.find(keys) + 1)
    return model.table.size()

  for batch in ([1, 2, 3], [2, 3, 4], [3, 4, 5]):
    step(model, jnp.array(batch, jnp.int32))
  assert len(traces) == 1
  keys, values = model.table.export()
  assert dict(zip(keys.tolist(), values.tolist())) == {1: 1, 2: 2, 3: 3, 4: 2, 5: 1}


def test_jit_cache_hits_leave_each_table_its_own_lifecycle():
  """NNX copies cached static attributes onto later arguments; lifecycles must not travel."""
  models = [Counter(8), Counter(8)]
  traces = []

  @nnx.jit
  def step(model, keys):
    traces.append(1)
    model.table.insert(keys, keys)

  for i, model in enumerate(models):
    step(model, jnp.arange(3, dtype=jnp.int32) + i)
  assert len(traces) == 1  # alike tables share the compiled step
  survivor = models.pop()
  del models  # the first table is garbage collected and destroyed
  gc.collect()
  assert survivor.table.export()[0].tolist() == [1, 2, 3]
  survivor.table.destroy()
  with pytest.raises(ValueError, match="destroyed"):
    survivor.table.size()


def test_overflow_inside_jit_is_reported_on_next_eager_use():
  model = Counter(4)

  @nnx.jit
  def step(model, keys):
    model.table.insert(keys, keys)

  step(model, jnp.arange(10, dtype=jnp.int32))  # 4 fit, 6 cannot: no growth inside jit
  assert "size=4" in repr(model.table) and "lost inside jit <code>6</code>" in model.table._repr_html_()
  with pytest.raises(ValueError, match="6 key\\(s\\) were lost"):
    model.table.find(jnp.array([0], jnp.int32))
  assert len(model.table) == 4  # reported once; the table is usable again
  model.table.reserve(32)
  step(model, jnp.arange(10, dtype=jnp.int32))
  assert len(model.table) == 10


# The seed's 15 key/value dtype combinations, with jax_enable_x64 off.
COMBINATIONS = [(np.int32, v) for v in (np.float64, np.float32, np.int32, str)]
COMBINATIONS += [(np.int64, v) for v in (np.float64, np.float32, np.int32, np.int64, str)]
COMBINATIONS += [(str, v) for v in (np.bool_, np.float64, np.float32, np.int32, np.int64, str)]


def _name(t):
  return "str" if t is str else np.dtype(t).name


@pytest.mark.parametrize(
  "key_dtype, value_dtype", COMBINATIONS, ids=[f"{_name(k)}-{_name(v)}" for k, v in COMBINATIONS]
)
def test_seed_dtype_combinations(key_dtype, value_dtype):
  if key_dtype is str:
    keys = np.array(["", "ζ", "long key " * 5], dtype=object)
  else:
    info = np.iinfo(key_dtype)
    keys = np.array([info.min, -1, info.max], key_dtype)
  if value_dtype is str:
    values, default = np.array(["a", "", "ü" * 20], dtype=object), "?"
  elif value_dtype is np.bool_:
    values, default = np.array([True, False, True]), False
  else:
    info = np.iinfo(value_dtype) if np.dtype(value_dtype).kind == "i" else np.finfo(np.float32)
    values, default = np.array([info.min, 0, info.max], value_dtype), value_dtype(7)
  table = jr.MutableHashTable(key_dtype, value_dtype, default_value=default)
  table.insert(keys, values)
  found = table.find(keys)
  np.testing.assert_array_equal(np.asarray(found), values)
  exported_keys, exported_values = table.export()
  order = np.argsort(keys, kind="stable")
  np.testing.assert_array_equal(exported_keys, keys[order])
  np.testing.assert_array_equal(np.asarray(exported_values), values[order])
  if value_dtype is np.int64 or key_dtype is np.int64:
    assert np.asarray(exported_keys).dtype == np.asarray(keys).dtype  # 64-bit stays exact
  if value_dtype is np.float64 and not jax.config.read("jax_enable_x64"):
    assert np.asarray(found).dtype == np.float32  # documented: float64 values are stored as float32


def test_string_keys_travel_encoded_inside_nnx_jit():
  table = jr.MutableHashTable(str, np.int32, default_value=-1, max_key_length=16)

  @nnx.jit
  def step(table, rows, values):
    table.insert(rows, values)
    return table.find(rows)

  rows = jr.keys.encode_strings(["ab", "ζeta", ""], max_length=16)
  assert step(table, rows, jnp.array([1, 2, 3], jnp.int32)).tolist() == [1, 2, 3]
  assert table.find(["", "ab", "zz"]).tolist() == [3, 1, -1]
  assert table.export()[0].tolist() == ["", "ab", "ζeta"]


def test_device_placement_of_the_state():
  device = jax.devices()[-1]
  table = jr.MutableHashTable(np.int32, np.float32, default_value=0.0, device=device)
  table.insert(np.array([1], np.int32), np.array([2.0], np.float32))
  assert {d for leaf in jax.tree.leaves(table.state) for d in leaf.devices()} == {device}


@pytest.mark.parametrize("storage", STORAGES)
def test_composite_keys_match_a_dict_of_tuples(storage, tmp_path):
  pair = jax.ShapeDtypeStruct((2,), np.int64)
  table = jr.MutableHashTable(pair, np.int32, default_value=-1, initial_capacity=4, storage=storage)
  assert repr(table).startswith("MutableHashTable(key=int64[2], value=int32")
  rng = np.random.default_rng(3)
  model = {}
  for _ in range(20):
    keys = rng.integers(-2, 3, size=(6, 2)) * np.array([1, 2**40])  # the second element needs 64 bits
    values = rng.integers(-100, 100, size=6).astype(np.int32)
    rows = [tuple(row) for row in keys.tolist()]
    op = rng.choice(["insert", "remove", "find"])
    if op == "insert":
      table.insert(keys, values)
      model.update(zip(rows, values.tolist()))
    elif op == "remove":
      table.remove(keys)
      for row in rows:
        model.pop(row, None)
    else:
      assert table.find(keys).tolist() == [model.get(row, -1) for row in rows]
      assert table[keys].tolist() == table.find(keys).tolist()
    exported_keys, exported_values = table.export()
    assert [tuple(row) for row in exported_keys.tolist()] == sorted(model)
    assert exported_values.tolist() == [model[row] for row in sorted(model)]
  path = jr.Checkpoint(model=table).save(tmp_path / "ckpt")
  fresh = jr.MutableHashTable(pair, np.int32, default_value=-1, initial_capacity=2, storage=storage)
  jr.Checkpoint(model=fresh).restore(path).assert_consumed()
  assert [tuple(row) for row in fresh.export()[0].tolist()] == sorted(model)


def test_a_composite_key_is_one_entry_never_two_scalars():
  """Issue 13, defect 7: a (2,) key spec became a scalar-key table; [[0, 1]] -> [[7, 8]] made two entries."""
  table = jr.MutableHashTable(
    jax.ShapeDtypeStruct((2,), jnp.int32), jnp.int32, default_value=np.zeros(2, np.int32)
  )
  table.insert(np.array([[0, 1]], np.int32), np.array([[7, 8]], np.int32))
  assert len(table) == 1 and table.find(np.array([[0, 1], [1, 0]], np.int32)).tolist() == [[7, 8], [0, 0]]
  assert table.find(np.array([0, 1], np.int32)).tolist() == [7, 8]  # one key without a batch axis
  with pytest.raises(ValueError, match=r"keys: expected shape \(\*batch, 2\)"):
    table.find(np.array([0, 1, 2], np.int32))
  scalar_values = jr.MutableHashTable(jax.ShapeDtypeStruct((2,), jnp.int32), jnp.int32, default_value=-1)
  with pytest.raises(ValueError, match="values"):
    scalar_values.insert(np.array([[0, 1]], np.int32), np.array([[7, 8]], np.int32))
  assert len(scalar_values) == 0


@pytest.mark.parametrize(
  ("spec", "error"),
  [
    (jax.ShapeDtypeStruct((2,), jnp.float32), TypeError),
    (jax.ShapeDtypeStruct((0,), jnp.int32), ValueError),
    (jax.ShapeDtypeStruct((2,), jnp.bool_), TypeError),
  ],
)
def test_a_key_spec_the_table_cannot_honour_is_refused(spec, error):
  with pytest.raises(error, match="key"):
    jr.MutableHashTable(spec, jnp.int32, default_value=-1)


def test_indexing_is_find_for_every_stateful_table():
  table = jr.MutableHashTable(str, np.int32, default_value=-1)
  table.insert(["a"], np.array([4], np.int32))
  static = jr.StaticHashTable(jr.KeyValueInitializer(["a", "b"], [1, 2]), default_value=0)
  for t in (table, static):
    assert t[["a", "zz"]].tolist() == t.find(["a", "zz"]).tolist()


def test_keys_lost_inside_jit_are_reported_by_their_own_error_type():
  model = Counter(4)

  @nnx.jit
  def step(model, keys):
    model.table.insert(keys, keys)

  step(model, jnp.arange(6, dtype=jnp.int32))
  with pytest.raises(jr.KeysLostError, match="2 key\\(s\\) were lost") as caught:
    model.table.insert(jnp.array([0], jnp.int32), jnp.array([0], jnp.int32))
  assert isinstance(caught.value, ValueError)  # the contract's error, of a type of its own
  assert len(model.table) == 4  # reported once, and the failed insert changed nothing


def test_size_is_an_int_that_outlives_the_next_write():
  """``size()`` gave the table's own counter array, which the next write donates: reading it after
  ``insert`` raised "Array has been deleted". Eagerly an int; inside ``nnx.jit`` a traced scalar."""
  table = jr.MutableHashTable(np.int64, np.float32, default_value=0.0)
  table.insert(np.array([1, 2, 3]), np.ones(3, np.float32))
  before = table.size()
  table.insert(np.array([4, 2**40]), np.ones(2, np.float32))
  assert type(before) is int and before == 3 and table.size() == 5

  @functools.partial(nnx.jit, donate_argnums=0)
  def grow(table, keys):
    table.insert(keys, jnp.ones(keys.shape[:1], jnp.float32))
    return table.size()

  assert int(grow(table, jr.keys.split64(np.array([7, 8, 9])))) == 8 and table.size() == 8 and before == 3
