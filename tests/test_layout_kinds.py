"""Saved slots go back only into a table of the storage kind that placed them (issue 67, stage 1).

Open addressing and the lean layout number their slots alike (``[shards, buckets, slots per
bucket]``) but place keys by different hashes: entries placed at another kind's slots would sit
where lookups never search. Checkpoints and deltas record the kind (``layout_kind``); a table of
another kind has the entries inserted anew.
"""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from oracle import mesh_of

import jaxres as jr
from jaxres._core.storages.lean import LeanTable
from jaxres._core.storages.lean.layout import geometry
from jaxres._persistence import saved_entries, table_arrays

OPTIONS = {"key": jnp.int32, "value": jnp.float32, "default": -1.0, "bucket_size": 8}


def _tables_of_one_layout():
  """An open addressing and a lean table whose slot layouts have the same numbers."""
  oa = jr.OpenAddressingTable.create(64, **OPTIONS)
  _, buckets, size = oa.slot_layout.tolist()
  capacity = next(c for c in range(1, 4096) if geometry(c, bucket_size=size) == (buckets, size))
  lean = LeanTable.create(capacity, **OPTIONS)
  assert lean.slot_layout.tolist() == oa.slot_layout.tolist()
  return {"open_addressing": oa, "lean": lean}


def _filled(table, n=40, seed=0):
  rng = np.random.default_rng(seed)
  keys = rng.choice(np.iinfo(np.int32).max, n, replace=False).astype(np.int32)
  values = rng.normal(size=n).astype(np.float32)
  return table.insert(keys, values), dict(zip(keys.tolist(), values.tolist()))


def _assert_holds(table, expected: dict):
  keys = np.array(sorted(expected), np.int32)
  assert int(table.size) == len(expected)
  np.testing.assert_array_equal(np.asarray(table.find(keys)), [expected[k] for k in keys.tolist()])
  live = table.live_entries()
  assert dict(zip(live.keys.tolist(), live.leaves[0].tolist())) == expected


@pytest.mark.parametrize("source, target", [("open_addressing", "lean"), ("lean", "open_addressing")])
def test_slots_of_another_kind_are_inserted_anew_where_the_layout_numbers_agree(source, target):
  tables = _tables_of_one_layout()
  saved, expected = _filled(tables[source])
  arrays = table_arrays.to_arrays(saved)
  assert bytes(arrays["layout_kind"]).decode() == source
  _assert_holds(table_arrays.from_arrays(tables[target], arrays), expected)


@pytest.mark.parametrize("kind", ["open_addressing", "lean"])
def test_slots_of_the_same_kind_go_back_where_they_were(kind):
  saved, expected = _filled(_tables_of_one_layout()[kind])
  restored = table_arrays.from_arrays(_tables_of_one_layout()[kind], table_arrays.to_arrays(saved))
  _assert_holds(restored, expected)
  np.testing.assert_array_equal(restored.live_entries().slots, saved.live_entries().slots)


def test_a_checkpoint_without_the_kind_is_one_of_open_addressing():
  """Checkpoints written before the kind was kept: placed into open addressing, inserted into lean."""
  tables = _tables_of_one_layout()
  saved, expected = _filled(tables["open_addressing"])
  arrays = table_arrays.to_arrays(saved)
  del arrays["layout_kind"]
  placed = table_arrays.from_arrays(tables["open_addressing"], arrays)
  np.testing.assert_array_equal(placed.live_entries().slots, saved.live_entries().slots)
  _assert_holds(table_arrays.from_arrays(tables["lean"], arrays), expected)


def test_a_delta_of_another_kind_than_the_save_it_follows_is_refused():
  tables = _tables_of_one_layout()
  earlier, _ = _filled(tables["open_addressing"])
  mark, _ = table_arrays.changes(earlier, None)
  later = earlier.insert(np.array([5], np.int32), np.array([2.5], np.float32))
  _, delta = table_arrays.changes(later, mark)
  assert mark.kind == "open_addressing" and delta is not None
  whole = table_arrays.to_arrays(earlier)
  assert saved_entries.compose(whole, delta)["keys"].size == 41
  other = whole | {"layout_kind": np.frombuffer(b"lean", np.uint8).copy()}
  with pytest.raises(ValueError, match="another slot layout"):
    saved_entries.compose(other, delta)
  lean_mark = mark._replace(kind="lean")
  assert table_arrays.changes(later, lean_mark)[1] is None  # saved whole: the mark is another kind's


@pytest.mark.parametrize(
  "bad", [np.array([0xFF, 0x41], np.uint8), np.zeros((2, 2), np.uint8), np.zeros(0, np.uint8)]
)
def test_a_damaged_kind_is_a_value_error_naming_it(bad):
  tables = _tables_of_one_layout()
  saved, _ = _filled(tables["lean"])
  arrays = table_arrays.to_arrays(saved) | {"layout_kind": bad}
  with pytest.raises(ValueError, match="layout_kind"):
    table_arrays.from_arrays(tables["lean"], arrays)


@pytest.mark.parametrize("source, target", [("open_addressing", "lean"), ("lean", "open_addressing")])
def test_a_stateful_table_restores_into_another_storage(tmp_path, source, target):
  table = jr.MutableHashTable(np.int64, np.float32, -1.0, initial_capacity=64, storage=source)
  keys = np.array([3, 2**40, -7, 11], np.int64)
  table.insert(keys, np.array([1.0, 2.0, 3.0, 4.0], np.float32))
  path = jr.Checkpoint(model=table).save(tmp_path / "ckpt")
  fresh = jr.MutableHashTable(np.int64, np.float32, -1.0, initial_capacity=64, storage=target)
  jr.Checkpoint(model=fresh).restore(path).assert_consumed()
  assert fresh.find(np.array([2**40, 3, 11, -7, 5], np.int64)).tolist() == [2.0, 1.0, 4.0, 3.0, -1.0]


def _embedding(storage, *, mesh=None, eviction=None, capacity=256):
  options = {"mesh": mesh, "axis": None if mesh is None else "shard"}
  return jr.DynamicEmbedding(
    capacity, 4, optimizer=optax.adam(0.1), rngs=nnx.Rngs(0), eviction=eviction, storage=storage, **options
  )


def _trained(emb, steps=12, seed=0):
  rng = np.random.default_rng(seed)
  for _ in range(steps):
    ids = rng.integers(-75, 75, 24) * 2**33 + 1  # 64-bit ids, repeated
    emb(ids)
    emb.apply_gradients(ids, rng.normal(size=(24, 4)).astype(np.float32))
  return emb


def _rows(emb) -> dict:
  ids, rows = emb.export()[:2]
  return dict(zip(np.asarray(ids).tolist(), np.asarray(rows).tolist()))


@pytest.mark.parametrize("sharded", [False, True], ids=["one device", "two shards"])
def test_an_embedding_on_the_lean_layout_trains_as_on_open_addressing(sharded):
  mesh = mesh_of(2) if sharded else None
  lean, reference = (_trained(_embedding(kind, mesh=mesh)) for kind in ("lean", "open_addressing"))
  assert _rows(lean) == _rows(reference) and len(_rows(lean)) > 100
  leaf = lean.table.get_value().shards if sharded else lean.table.get_value()
  assert isinstance(leaf, LeanTable)
  assert sum(lean.memory().values()) < sum(reference.memory().values())


@pytest.mark.parametrize("source, target", [("open_addressing", "lean"), ("lean", "open_addressing")])
def test_an_embedding_checkpoint_restores_into_the_other_storage(tmp_path, source, target):
  trained = _trained(_embedding(source, eviction=jr.LRU(), capacity=64), steps=20)
  path = jr.Checkpoint(model=trained).save(tmp_path / "ckpt")
  fresh = _embedding(target, eviction=jr.LRU(), capacity=64)
  jr.Checkpoint(model=fresh).restore(path).assert_consumed()
  assert _rows(fresh) == _rows(trained) and len(_rows(fresh)) == 64


@pytest.mark.parametrize(
  "storage, match", [("sorted", "writes in time of its capacity"), ("btree", "expected one of")]
)
def test_a_storage_an_embedding_cannot_use_is_a_value_error_naming_it(storage, match):
  with pytest.raises(ValueError, match=f"storage: .*{match}"):
    _embedding(storage)
  with pytest.raises(ValueError, match=f"storage: .*{match}"):
    jr.TableConfig(64, 4, optimizer=optax.sgd(0.1), storage=storage)


def test_a_collection_builds_each_table_on_its_configured_storage():
  tables = {
    "lean": jr.TableConfig(64, 4, optimizer=optax.sgd(0.1), storage="lean"),
    "plain": jr.TableConfig(64, 4, optimizer=optax.sgd(0.1)),
  }
  features = {name: jr.FeatureConfig(table=name) for name in tables}
  collection = jr.EmbeddingCollection(tables, features, rngs=nnx.Rngs(0))
  kinds = {name: type(emb.table.get_value()) for name, emb in collection.tables.items()}
  assert kinds == {"lean": LeanTable, "plain": jr.OpenAddressingTable}


def _lean_graph():
  root = jr.AutoTrackable()
  root.emb = _embedding("lean", mesh=mesh_of(2), eviction=jr.LRU(), capacity=32)
  root.vocab = jr.MutableHashTable(
    np.int64, np.float32, default_value=0.0, initial_capacity=256, storage="lean"
  )
  return root


def _state(root) -> tuple:
  keys, values = root.vocab.export()
  shards = root.emb.table.get_value()
  return _rows(root.emb), keys.tolist(), values.tolist(), np.asarray(shards.live_entries().slots).tolist()


def test_incremental_steps_of_lean_tables_hold_their_changes_and_restore_exactly(tmp_path):
  root = _lean_graph()
  manager = jr.CheckpointManager(tmp_path, jr.Checkpoint(model=root), incremental=True)
  states = []
  for step in range(3):
    _trained(root.emb, steps=4, seed=step)  # a full table: rows evicted between steps
    root.vocab.insert(np.arange(40, dtype=np.int64) * 2**35 + step, np.full(40, float(step), np.float32))
    manager.save(step)
    states.append(_state(root))
  (vocab,) = [e for e in jr.inspect_checkpoint(manager.step_path(2)) if e["path"] == "model/vocab"]
  assert vocab["delta"] and {a["name"]: a["shape"] for a in vocab["arrays"]}["keys"] == [40]
  manager.close()
  for step in (1, 2):
    restored = _lean_graph()
    reader = jr.CheckpointManager(tmp_path, jr.Checkpoint(model=restored))
    reader.restore(step).assert_consumed()
    reader.close()
    assert _state(restored) == states[step]  # the same slots: placed where they were
