"""What a new user met (issue 30), one test (or a few) per item: each failed before its fix.

Item numbers are the issue's: 1 the stateful tables' vocabulary, 4 a
CheckpointManager step opened as a checkpoint, 5 opaque errors, 8 small
surprises (a checkpoint keyword replacing an attribute, ``assign`` on a
``CustomScore`` table, defaults and values of narrow integer dtypes).
"""

import operator
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxres as jr

# ------------------------------------------------- 1. the stateful vocabulary


def _table(**kwargs):
  return jr.MutableHashTable(np.int64, np.float32, default_value=-1.0, **kwargs)


def test_1_stateful_insert_or_apply_folds_like_a_dict():
  table, want = _table(initial_capacity=2), {}
  rng = np.random.default_rng(0)
  for _ in range(5):
    keys = rng.integers(-(2**40), 2**40, 6) // 2**36 * 2**36  # repeats within and across calls
    values = rng.standard_normal(6).astype(np.float32)
    table.insert_or_apply(keys, values, jnp.add)
    for k, v in zip(keys.tolist(), values.tolist()):
      want[k] = np.float32(want[k] + np.float32(v)) if k in want else np.float32(v)
  keys, values = table.export()
  assert isinstance(keys, np.ndarray) and isinstance(values, np.ndarray)  # NumPy throughout
  assert dict(zip(keys.tolist(), values.tolist())) == pytest.approx(want)
  table.insert_or_apply(np.array([1]), np.array([1.0], np.float32), operator.add)  # a builtin works too
  assert table.find(np.array([1])).tolist() == [1.0]


def test_1_stateful_assign_valid_and_remove():
  table = _table()
  table.insert(
    np.array([1, 2, 3]), np.array([1.0, 2.0, 3.0], np.float32), valid=np.array([True, False, True])
  )
  assert table.export()[0].tolist() == [1, 3]
  table.assign(np.array([1, 2]), np.array([10.0, 20.0], np.float32))  # 2 is absent: not inserted
  assert dict(zip(*(x.tolist() for x in table.export()))) == {1: 10.0, 3: 3.0}
  table.remove(np.array([1, 3]), valid=np.array([False, True]))
  assert table.export()[0].tolist() == [1]
  found = table.find_or_insert(
    np.array([1, 5, 6]), np.array([0.0, 5.0, 6.0], np.float32), valid=np.array([True, True, False])
  )
  assert found.tolist() == [10.0, 5.0, -1.0] and table.export()[0].tolist() == [1, 5]


def test_1_stateful_evicting_forms_say_what_left():
  table = _table(initial_capacity=2, eviction=jr.LRU())
  table.insert(np.array([1, 2]), np.array([1.0, 2.0], np.float32))
  table.find(np.array([2]))  # a read is no use: 1 stays the least recently inserted
  evicted = table.insert_and_evict(np.array([3]), np.array([3.0], np.float32))
  assert isinstance(evicted.keys, np.ndarray) and evicted.keys.dtype == np.int64
  assert (
    evicted.valid.tolist() == [True] and evicted.keys.tolist() == [1] and evicted.values.tolist() == [1.0]
  )
  found, evicted = table.find_or_insert_and_evict(np.array([3, 4]), np.array([0.0, 4.0], np.float32))
  assert found.tolist() == [3.0, 4.0] and evicted.valid.tolist() == [False, True] and evicted.keys[1] == 2
  assert sorted(table.export()[0].tolist()) == [3, 4]
  growing = _table(initial_capacity=1)  # a growing table never evicts
  assert not growing.insert_and_evict(np.arange(5), np.zeros(5, np.float32)).valid.any()
  assert len(growing) == 5


def test_1_string_keys_come_back_as_strings_when_evicted():
  table = jr.MutableHashTable(str, np.int32, -1, initial_capacity=1, eviction=jr.LRU())
  table.insert(["ada"], np.array([1], np.int32))
  evicted = table.insert_and_evict(["grace"], np.array([2], np.int32))
  assert evicted.keys.tolist() == ["ada"] and evicted.values.tolist() == [1]


def test_1_custom_score_tables_take_scores_statefully():
  table = _table(initial_capacity=1, eviction=jr.CustomScore())
  table.insert(np.array([1]), np.array([1.0], np.float32), scores=np.array([5], np.uint32))
  evicted = table.insert_and_evict(
    np.array([2]), np.array([2.0], np.float32), scores=np.array([1], np.uint32)
  )
  assert evicted.keys.tolist() == [2] and evicted.valid.tolist() == [True]  # refused: lower score
  table.assign(np.array([1]), np.array([7.0], np.float32))  # assign takes no scores
  assert table.find(np.array([1])).tolist() == [7.0]


# ---------------------------------------- 4. a manager step is a checkpoint too


def test_4_a_checkpoint_manager_step_opens_as_a_checkpoint(tmp_path):
  root = jr.AutoTrackable()
  root.table, root.step = _table(), jnp.array(7)
  root.table.insert(np.array([2**40]), np.array([1.5], np.float32))
  manager = jr.CheckpointManager(tmp_path, jr.Checkpoint(model=root))
  manager.save(3)
  manager.close()
  entries = {e["path"]: e["kind"] for e in jr.inspect_checkpoint(tmp_path / "3")}
  assert entries == {"": "trackable", "model": "trackable", "model/step": "array", "model/table": "table"}
  fresh = jr.AutoTrackable()
  fresh.table, fresh.step = _table(), jnp.array(0)
  jr.Checkpoint(model=fresh).restore(tmp_path / "3").assert_consumed()
  assert fresh.table.find(np.array([2**40])).tolist() == [1.5] and int(fresh.step) == 7


# --------------------------------------------------------- 5. opaque errors


def test_5_a_numpy_ufunc_as_fn_is_a_clear_error():
  table = jr.OpenAddressingTable.create(8, key=jnp.int32, value=jnp.float32)
  with pytest.raises(TypeError, match=r"np.add is a NumPy ufunc.*pass jnp.add"):
    table.insert_or_apply(np.array([1], np.int32), np.ones(1, np.float32), np.add)
  with pytest.raises(TypeError, match=r"jnp\.add"):
    _table().insert_or_apply(np.array([1]), np.ones(1, np.float32), np.add)


# ----------------------------------------------------- 8. small surprises


def test_8_a_checkpoint_keyword_does_not_replace_what_the_root_holds():
  root = jr.AutoTrackable()
  root.v = jnp.array(1)
  with pytest.raises(ValueError, match=r"root.v already exists"):
    jr.Checkpoint(root, w=jnp.array(3), v=jnp.array(2))
  assert int(root.v) == 1 and not hasattr(root, "w")  # nothing set
  jr.Checkpoint(root, w=jnp.array(3))
  assert int(root.w) == 3


def test_8_assign_on_a_custom_score_table_needs_no_scores():
  table = jr.OpenAddressingTable.create(8, key=jnp.int32, value=jnp.float32, eviction=jr.CustomScore())
  table = table.insert(np.array([1], np.int32), np.ones(1, np.float32), scores=np.array([9], np.uint32))
  table = table.assign(np.array([1, 2], np.int32), np.array([4.0, 5.0], np.float32))
  assert table.find(np.array([1, 2], np.int32)).tolist() == [4.0, 0.0]
  assert table.scores(np.array([1], np.int32)).tolist() == [9]


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.int8, np.int16])
def test_8_narrow_integer_values_take_the_default_default(dtype):
  table = jr.OpenAddressingTable.create(8, key=jnp.int32, value=dtype)
  assert table.find(np.array([3], np.int32)).dtype == dtype
  assert table.find(np.array([3], np.int32)).tolist() == [0]
  stateful = jr.MutableHashTable(np.int64, dtype, default_value=7)
  assert stateful.find(np.array([3])).tolist() == [7]


@pytest.mark.parametrize("value, match", [(300, "300 does not fit int8"), (-129, "-129 does not fit int8")])
def test_8_integers_out_of_the_value_range_are_refused_not_wrapped(value, match):
  table = jr.OpenAddressingTable.create(8, key=jnp.int32, value=jnp.int8)
  with pytest.raises(ValueError, match=match):
    table.insert(np.array([1], np.int32), np.array([value], np.int64))
  with pytest.raises(ValueError, match=match):
    jr.MutableHashTable(np.int64, np.int8, default_value=value)
  stateful = jr.MutableHashTable(np.int64, np.int8, default_value=0)
  with pytest.raises(ValueError, match=match):
    stateful.insert(np.array([1]), np.array([value]))
  assert len(stateful) == 0
  fits = table.insert(np.array([1], np.int32), np.array([127], np.int64))  # in range: cast
  assert fits.find(np.array([1], np.int32)).tolist() == [127]


def test_8_a_python_float_default_for_an_integer_table_is_a_type_error():
  with pytest.raises(TypeError, match=r"default: expected values of dtype int32, got the Python float 1\.5"):
    jr.OpenAddressingTable.create(8, key=jnp.int32, value=jnp.int32, default=1.5)


def test_8_traced_values_of_a_wider_integer_dtype_still_cast():
  table = jr.OpenAddressingTable.create(8, key=jnp.int32, value=jnp.int8)

  @jax.jit
  def put(table, values):
    return table.insert(jnp.array([1], jnp.int32), values)

  assert put(table, jnp.array([5], jnp.int32)).find(np.array([1], np.int32)).tolist() == [5]


# ------------------------------------ 2. vocabulary ids inside jit, to an nnx.Embed


def test_2_vocabulary_ids_inside_jit_feed_an_embedding_as_int32():
  from flax import nnx

  class Model(nnx.Module):
    def __init__(self):
      words = ["the", "quick", "fox"]
      self.vocab = jr.StaticVocabularyTable(jr.KeyValueInitializer(words, np.arange(3)), num_oov_buckets=2)
      self.embed = nnx.Embed(5, 4, rngs=nnx.Rngs(0))

  model = Model()
  rows = jr.keys.encode_strings(["fox", "zebra", "the"])
  ids = nnx.jit(lambda m, rows: jr.keys.to_int32(m.vocab.find(rows)))(model, rows)
  eager = model.vocab.find(["fox", "zebra", "the"])
  assert ids.dtype == jnp.int32 and ids.tolist() == eager.tolist()
  out = nnx.jit(lambda m, rows: m.embed(jr.keys.to_int32(m.vocab.find(rows))))(model, rows)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(model.embed.embedding[...])[eager])


@pytest.mark.parametrize("ids", [np.array([0, 5, 2**31 - 1]), np.array([0, 5, 2**31 - 1], np.uint64)])
def test_2_to_int32_matches_numpy_eagerly_and_inside_jit(ids):
  want = ids.astype(np.int32).tolist()
  assert jr.keys.to_int32(ids).tolist() == want
  assert jax.jit(jr.keys.to_int32)(jr.keys.split64(ids)).tolist() == want
  assert jax.jit(jr.keys.to_int32)(jr.keys.split64(np.array([-1, 2**31, 2**40]))).tolist() == [-1, -1, -1]
  with pytest.raises(ValueError, match=r"ids: 2147483648 is outside \[0, 2\*\*31\)"):
    jr.keys.to_int32(np.array([1, 2**31]))
  with pytest.raises(ValueError, match="ids: -1 is outside"):
    jr.keys.to_int32(np.array([-1]))
  with pytest.raises(TypeError, match="ids: expected int64"):
    jr.keys.to_int32(np.array([1], np.int32))


def test_2_joining_traced_pairs_points_to_to_int32():
  with pytest.raises(TypeError, match=r"jr\.keys\.to_int32"):
    jax.jit(jr.keys.join64)(jr.keys.split64(np.array([1])))


# -------------------------------------------------------------- 5. errors, cont.


def test_5_int64_ids_truncated_at_the_jit_boundary_are_named_as_such():
  from flax import nnx

  class Model(nnx.Module):
    def __init__(self):
      self.table = _table()

  model = Model()
  with pytest.raises(TypeError, match=r"got a JAX int32 array.*dropping their high bits.*jr.keys.split64"):
    nnx.jit(lambda m, ids: m.table.find(ids))(model, np.array([2**40], np.int64))
  assert nnx.jit(lambda m, ids: m.table.find(ids))(model, jr.keys.split64(np.array([2**40]))).tolist() == [
    -1.0
  ]


def test_5_string_rows_of_another_width_inside_jit_are_a_clear_error():
  from flax import nnx

  class Model(nnx.Module):
    def __init__(self):
      self.table = jr.MutableHashTable(str, np.float32, 0.0, max_key_length=16)

  model = Model()
  model.table.insert(["ab"], np.ones(1, np.float32))
  find = nnx.jit(lambda m, rows: m.table.find(rows))
  assert find(model, jr.keys.encode_strings(["ab"], max_length=8)).tolist() == [1.0]  # narrower: widened
  with pytest.raises(ValueError, match=r"max_length <= 16 \(rows of width <= 5\); got uint32\[1, 9\]"):
    find(model, jr.keys.encode_strings(["ab"], max_length=32))


# ------------------------------------------------ 6. equal optimizers share a compile


def test_6_a_new_but_equal_optimizer_reuses_the_compiled_step():
  import optax
  from flax import nnx

  from jaxres._nn.rowwise import structure_key

  traces = []

  class Model(nnx.Module):
    def __init__(self, optimizer):
      self.emb = jr.DynamicEmbedding(64, 4, optimizer=optimizer, rngs=nnx.Rngs(0))

  @nnx.jit
  def step(model, ids):
    traces.append(1)
    rows = model.emb(ids)
    model.emb.apply_gradients(ids, 2 * rows)  # the gradient of sum(rows ** 2)
    return rows

  ids = jr.keys.split64(np.array([3, 9, 3]))
  results = []
  for optimizer in (optax.adam(0.01), optax.adam(0.01), optax.adam(0.02)):
    model = Model(optimizer)
    step(model, ids)
    step(model, ids)
    results.append(np.asarray(model.emb(ids)))
  assert len(traces) == 2  # the second adam(0.01) reused the first one's step; adam(0.02) did not
  np.testing.assert_array_equal(results[0], results[1])
  assert not np.array_equal(results[0], results[2])
  chain = lambda: optax.chain(optax.clip(1.0), optax.adam(optax.exponential_decay(0.1, 10, 0.5)))
  assert structure_key(chain()) == structure_key(chain())
  assert structure_key(optax.sgd(0.1)) != structure_key(optax.adagrad(0.1))


# ----------------------------- 3. an embedding restored into another row optimizer


def _trained_embedding(optimizer, mesh=None, **kwargs):
  import optax  # noqa: F401
  from flax import nnx

  class Model(nnx.Module):
    def __init__(self):
      axis = None if mesh is None else "shard"
      self.emb = jr.DynamicEmbedding(
        64, 4, optimizer=optimizer, rngs=nnx.Rngs(0), eviction=jr.LRU(), mesh=mesh, axis=axis, **kwargs
      )

  return Model()


@pytest.mark.parametrize(
  "before, after, sharded",
  [
    *[
      (*pair, sharded)
      for pair in [("adam", "sgd"), ("sgd", "adam"), ("adam", "adagrad")]
      for sharded in (0, 1)
    ],
    ("adam", "catch_up", False),
    ("catch_up", "adam", True),
  ],
)
def test_3_an_embedding_trained_with_another_optimizer_restores_its_rows(tmp_path, sharded, before, after):
  import optax
  from oracle import mesh_of

  mesh = mesh_of(8) if sharded else None
  make = {
    "adam": lambda: optax.adam(0.1),
    "sgd": lambda: optax.sgd(0.1),
    "adagrad": lambda: optax.adagrad(0.1),
    "catch_up": lambda: jr.CatchUpAdam(0.1),
  }
  trained = _trained_embedding(make[before](), mesh)
  ids = np.array([3, 9, 2**40, 3])
  for _ in range(2):
    trained.emb(ids)
    trained.emb.apply_gradients(ids, np.ones((4, 4), np.float32))
  path = jr.Checkpoint(model=trained).save(tmp_path / "ckpt")

  strict = _trained_embedding(make[after](), mesh)
  with pytest.raises(TypeError, match=r"model/emb/table: .*another row optimizer.*restore_rows_only=True"):
    jr.Checkpoint(model=strict).restore(path)
  assert strict.emb.size() == 0  # nothing restored

  fresh = _trained_embedding(make[after](), mesh, restore_rows_only=True)
  status = jr.Checkpoint(model=fresh).restore(path)
  if before == "catch_up":  # its step count, which the other optimizer has no use for, stays unused
    with pytest.raises(AssertionError, match="model/emb/step"):
      status.assert_consumed()
  status.assert_existing_objects_matched()
  want_ids, want_rows = trained.emb.export()
  got_ids, got_rows = fresh.emb.export()
  np.testing.assert_array_equal(got_ids, want_ids)
  np.testing.assert_array_equal(got_rows, want_rows)
  table, old = fresh.emb.table.get_value(), trained.emb.table.get_value()
  np.testing.assert_array_equal(np.asarray(table.scores(ids)), np.asarray(old.scores(ids)))
  # every row's optimizer state is the new optimizer's initial state: a step from it equals one of a
  # new embedding holding the same rows
  reference = _trained_embedding(make[after](), mesh)
  reference.emb.table.set_value(
    reference.emb.table.get_value().import_(
      got_ids, {"row": got_rows, "slots": tuple(reference.emb._spec.optimizer.init(jnp.asarray(got_rows)))}
    )
  )
  for emb in (fresh.emb, reference.emb):
    emb(ids)
    emb.apply_gradients(ids, np.ones((4, 4), np.float32))
  np.testing.assert_allclose(fresh.emb.export()[1], reference.emb.export()[1], rtol=1e-6)


def test_3_the_same_optimizer_restores_its_state_with_or_without_the_option(tmp_path):
  import optax

  trained = _trained_embedding(optax.adam(0.1))
  ids = np.array([1, 2])
  trained.emb(ids)
  trained.emb.apply_gradients(ids, np.ones((2, 4), np.float32))
  path = jr.Checkpoint(model=trained).save(tmp_path / "ckpt")
  for option in (False, True):
    fresh = _trained_embedding(optax.adam(0.1), restore_rows_only=option)
    jr.Checkpoint(model=fresh).restore(path).assert_consumed()
    want = jax.device_get(trained.emb.table.get_value().export())
    got = jax.device_get(fresh.emb.table.get_value().export())
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_array_equal(a, b)  # the optimizer state too


# ------------------------------------------------- 7. several tables in a module


def test_7_tables_in_an_nnx_module_go_in_an_nnx_list(tmp_path):
  """A plain list of tables is refused by Flax (a static attribute holding data); nnx.List works,
  inside nnx.jit and in checkpoints, as the stateful-tables guide says."""
  from flax import nnx

  class Plain(nnx.Module):
    def __init__(self):
      self.tables = [_table()]

  with pytest.raises(ValueError, match="static attribute"):
    Plain()

  class Model(nnx.Module):
    def __init__(self):
      self.tables = nnx.List([_table() for _ in range(2)])

  model = Model()

  @nnx.jit
  def insert(model, ids):
    for i, table in enumerate(model.tables):
      table.insert(ids, jnp.full(ids.shape[:-1], i, jnp.float32))

  insert(model, jr.keys.split64(np.array([1, 2**40])))
  assert [t.find(np.array([2**40])).tolist() for t in model.tables] == [[0.0], [1.0]]
  path = jr.Checkpoint(model=model).save(tmp_path / "ckpt")
  fresh = Model()
  jr.Checkpoint(model=fresh).restore(path).assert_consumed()
  assert [t.find(np.array([1])).tolist() for t in fresh.tables] == [[0.0], [1.0]]


# ------------------------------------------------------- found in review


def test_6_an_optimizer_closing_over_an_unhashable_object_still_compiles():
  import optax
  from flax import nnx

  class Box:
    __hash__ = None  # unhashable, compared by identity

    def __init__(self, rate):
      self.rate = rate

  box = Box(0.1)

  def scaled():
    return optax.GradientTransformation(
      lambda params: optax.EmptyState(), lambda updates, state, params=None: (-box.rate * updates, state)
    )

  emb = jr.DynamicEmbedding(16, 2, optimizer=scaled(), rngs=nnx.Rngs(0))
  ids = jr.keys.split64(np.array([1, 2]))

  @nnx.jit
  def step(emb, ids):
    rows = emb(ids)
    emb.apply_gradients(ids, jnp.ones_like(rows))
    return rows

  before = step(emb, ids)
  np.testing.assert_allclose(np.asarray(emb(ids)), np.asarray(before) - 0.1, rtol=1e-6)


def test_3_rows_of_another_width_are_not_blamed_on_the_optimizer(tmp_path):
  import optax
  from flax import nnx

  def model(features, **kwargs):
    module = nnx.Module()
    module.emb = jr.DynamicEmbedding(16, features, optimizer=optax.adam(0.1), rngs=nnx.Rngs(0), **kwargs)
    return module

  trained = model(4)
  trained.emb(np.array([1, 2]))
  path = jr.Checkpoint(model=trained).save(tmp_path / "ckpt")
  for option in (False, True):
    with pytest.raises((TypeError, ValueError)) as err:
      jr.Checkpoint(model=model(8, restore_rows_only=option)).restore(path)
    assert "another row optimizer" not in str(err.value) and "model/emb/table" in str(err.value)


@pytest.mark.skipif(
  jax.config.read("jax_enable_x64"), reason="64-bit values are exact JAX values with x64 on"
)
def test_1_stateful_insert_or_apply_refuses_fns_that_would_get_64_bit_values_as_word_pairs():
  """jnp.add is exact on them (issue 46); a function it does not know still gets a clear error."""
  counts = jr.MutableHashTable(np.int64, np.int64, default_value=0)
  counts.insert(np.array([1]), np.array([-1]))
  counts.insert_or_apply(np.array([1]), np.array([2**32]), jnp.add)
  with pytest.raises(TypeError, match="word pairs"):
    counts.insert_or_apply(np.array([1]), np.array([1]), lambda old, new: old + new)
  assert counts.find(np.array([1])).tolist() == [2**32 - 1]


def test_8_a_failed_save_removes_only_its_own_directories(tmp_path, monkeypatch):
  """Another save of the same path (a longer staging name) keeps its directory."""
  others = []

  def failing_write(directory, manifest, arrays):
    others.append(directory + "7")  # the staging directory of another save of the same path
    os.makedirs(others[-1])
    os.makedirs(directory + jr._tracking.orbax_io.TEMPORARY_SUFFIX)  # what Orbax began
    raise ValueError("OUT_OF_RANGE: File too large")

  monkeypatch.setattr(jr._tracking.orbax_io, "write", failing_write)
  root = jr.AutoTrackable()
  root.step = jnp.array(1)
  with pytest.raises(OSError, match="could not write the checkpoint"):
    jr.Checkpoint(model=root).save(tmp_path / "ckpt")
  assert sorted(os.listdir(tmp_path)) == [os.path.basename(others[0])]
