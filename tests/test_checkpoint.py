"""jr.Checkpoint: round trips, deferred restore, load status, mismatches, paths, sizes."""

import fnmatch
import gc
import json
import os
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxres as jr
from jaxres._persistence import files


class Counter(jr.Resource):
  def _create_resource(self):
    return {"count": jnp.zeros((), jnp.int32), "total": jnp.zeros(3)}


class Model(nnx.Module):
  def __init__(self, seed=0):
    self.dense = nnx.Linear(2, 3, rngs=nnx.Rngs(seed))
    self.ids = jr.MutableHashTable(np.int64, np.int32, default_value=-1, initial_capacity=8)


def _table():
  return jr.MutableHashTable(str, np.float32, default_value=0.0, initial_capacity=4)


def _build(seed=0):
  root = jr.AutoTrackable()
  root.words = _table()
  root.words.insert(["a", "bb", "ccc"], np.array([1.0, 2.0, 3.0], np.float32))
  root.step = jnp.array(7)
  root.opt = {"mu": jnp.ones(2), "nu": [jnp.zeros(1), jnp.full((2,), 3.0)]}
  root.child = jr.AutoTrackable()
  root.child.counter = Counter()
  root.child.counter.state = {"count": jnp.array(5, jnp.int32), "total": jnp.arange(3.0)}
  root.model = Model(seed)
  root.model.ids.insert(np.array([2**40, -1], np.int64), np.array([10, 20], np.int32))
  return root


def _assert_restored(root):
  assert root.words.find(["a", "ccc", "zz"]).tolist() == [1.0, 3.0, 0.0]
  assert int(root.step) == 7
  assert root.opt["nu"][1].tolist() == [3.0, 3.0]
  assert int(root.child.counter.state["count"]) == 5
  assert root.model.ids.find(np.array([2**40, 5], np.int64)).tolist() == [10, -1]


def test_round_trip_restores_existing_objects(tmp_path):
  original = _build(seed=0)
  path = jr.Checkpoint(model=original).save(tmp_path / "ckpt")
  fresh = _build(seed=1)
  fresh.words.remove(["a"])
  fresh.step = jnp.array(0)
  fresh.child.counter.state = {"count": jnp.array(0, jnp.int32), "total": jnp.zeros(3)}
  fresh.model.ids.insert(np.array([99], np.int64), np.array([1], np.int32))
  status = jr.Checkpoint(model=fresh).restore(path)
  status.assert_consumed().assert_existing_objects_matched().assert_nontrivial_match()
  assert status.pending == []
  _assert_restored(fresh)
  np.testing.assert_array_equal(fresh.model.dense.kernel.get_value(), original.model.dense.kernel.get_value())
  assert len(fresh.model.ids) == 2  # contents replaced, not merged


def test_deferred_restore_for_every_kind_of_child(tmp_path):
  path = jr.Checkpoint(model=_build()).save(tmp_path / "ckpt")
  fresh = jr.Checkpoint(model=jr.AutoTrackable())
  status = fresh.restore(path)
  assert status.pending == ["model/child", "model/model", "model/opt", "model/step", "model/words"]
  with pytest.raises(AssertionError, match="no object"):
    status.assert_consumed()
  fresh.model.step = jnp.array(0)  # an array attribute takes the checkpointed value
  fresh.model.opt = {"mu": jnp.zeros(2), "nu": [jnp.zeros(1), jnp.zeros(2)]}
  fresh.model.words = _table()
  fresh.model.child = jr.AutoTrackable()
  assert status.pending == ["model/child/counter", "model/model"]
  fresh.model.child.counter = Counter()
  fresh.model.model = Model(seed=3)
  assert status.pending == []
  status.assert_consumed()
  _assert_restored(fresh.model)


def test_unmatched_paths_say_how_to_accept_a_partial_restore(tmp_path):
  root = jr.AutoTrackable()
  root.step, root.seen = jnp.array(3), jnp.array(4)
  path = jr.Checkpoint(model=root).save(tmp_path / "ckpt")
  fewer = jr.AutoTrackable()
  fewer.step = jnp.array(0)
  status = jr.Checkpoint(model=fewer).restore(path)
  with pytest.raises(AssertionError) as missing:
    status.assert_consumed()
  assert "['model/seen']" in str(missing.value) and "expect_partial()" in str(missing.value)
  assert status.expect_partial() is status
  more = jr.AutoTrackable()
  more.step, more.seen, more.extra = jnp.array(0), jnp.array(0), jnp.array(0)
  status = jr.Checkpoint(model=more).restore(path)
  for check in (status.assert_consumed, status.assert_existing_objects_matched):
    with pytest.raises(AssertionError) as extra:
      check()
    assert "['model/extra']" in str(extra.value) and "expect_partial()" in str(extra.value)
  assert int(more.step) == 3 and int(more.seen) == 4


def test_later_restore_wins(tmp_path):
  first, second = _build(), _build()
  second.step = jnp.array(8)
  path1 = jr.Checkpoint(model=first).save(tmp_path / "one")
  path2 = jr.Checkpoint(model=second).save(tmp_path / "two")
  fresh = jr.Checkpoint(model=jr.AutoTrackable())
  fresh.restore(path1)
  status = fresh.restore(path2)
  fresh.model.step = jnp.array(0)
  assert int(fresh.model.step) == 8
  assert "model/step" not in status.pending


def test_wrong_kind_or_shape_raises_and_changes_nothing(tmp_path):
  path = jr.Checkpoint(model=_build()).save(tmp_path / "ckpt")
  fresh = jr.Checkpoint(model=jr.AutoTrackable())
  status = fresh.restore(path)
  with pytest.raises(TypeError, match="model/words"):
    fresh.model.words = jnp.zeros(3)  # an array where a table was saved
  assert not hasattr(fresh.model, "words") and "model/words" in status.pending
  with pytest.raises(ValueError, match="model/step"):
    fresh.model.step = jnp.zeros(2)
  assert not hasattr(fresh.model, "step")
  fresh.model.step = jnp.array(1)
  assert int(fresh.model.step) == 7
  # An eager restore checks everything before it changes anything.
  existing = _build()
  existing.words.remove(["a"])
  existing.opt = {"mu": jnp.ones(5), "nu": [jnp.zeros(1), jnp.zeros(2)]}
  with pytest.raises(ValueError, match="model/opt"):
    jr.Checkpoint(model=existing).restore(path)
  assert existing.words.find(["a"]).tolist() == [0.0]


def test_names_with_dots_and_slashes_never_collide(tmp_path):
  root = jr.AutoTrackable()
  setattr(root, "a.b", jnp.array(1))
  root.a = jr.AutoTrackable()
  root.a.b = jnp.array(2)
  setattr(root, "a/b", jnp.array(3))
  root.tree = {"a.b": jnp.array(4), "a": {"b": jnp.array(5)}}
  path = jr.Checkpoint(model=root).save(tmp_path / "ckpt")
  nodes = json.loads((tmp_path / "ckpt" / "manifest" / "metadata").read_text())["nodes"]
  assert {"model/a%2Eb", "model/a/b", "model/a%2Fb"} <= set(nodes)
  fresh = jr.AutoTrackable()
  for name in ("a.b", "a/b"):
    setattr(fresh, name, jnp.array(0))
  fresh.a = jr.AutoTrackable()
  fresh.a.b = jnp.array(0)
  fresh.tree = {"a.b": jnp.array(0), "a": {"b": jnp.array(0)}}
  jr.Checkpoint(model=fresh).restore(path).assert_consumed()
  values = [int(getattr(fresh, "a.b")), int(fresh.a.b), int(getattr(fresh, "a/b"))]
  assert values == [1, 2, 3] and int(fresh.tree["a.b"]) == 4 and int(fresh.tree["a"]["b"]) == 5


def test_shared_objects_are_saved_once(tmp_path):
  root = jr.AutoTrackable()
  root.first = root.second = _table()
  root.first.insert(["x"], np.array([1.0], np.float32))
  path = jr.Checkpoint(model=root).save(tmp_path / "ckpt")
  nodes = json.loads((tmp_path / "ckpt" / "manifest" / "metadata").read_text())["nodes"]
  assert nodes["model/second"] == {"alias": "model/first"}
  same = jr.AutoTrackable()
  same.first = same.second = _table()
  jr.Checkpoint(model=same).restore(path).assert_consumed()
  assert same.second.find(["x"]).tolist() == [1.0]
  split = jr.AutoTrackable()
  split.first, split.second = _table(), _table()
  status = jr.Checkpoint(model=split).restore(path)
  assert split.second.find(["x"]).tolist() == [1.0]
  with pytest.raises(AssertionError, match="shared differently"):
    status.assert_existing_objects_matched()


def test_tables_store_live_entries_only(tmp_path):
  root = jr.AutoTrackable()
  root.table = jr.MutableHashTable(np.int64, np.float32, default_value=0.0, initial_capacity=1 << 20)
  root.table.insert(np.arange(10, dtype=np.int64), np.ones(10, np.float32))
  path = jr.Checkpoint(model=root).save(tmp_path / "ckpt")
  size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)
  assert size < 1 << 20, f"{size} bytes"
  small = jr.AutoTrackable()
  small.table = jr.MutableHashTable(np.int64, np.float32, default_value=0.0, initial_capacity=2)
  jr.Checkpoint(model=small).restore(path).assert_consumed()
  assert len(small.table) == 10 and small.table.capacity >= 10


def test_bad_checkpoints_are_clear_errors(tmp_path):
  with pytest.raises(ValueError, match="not a jaxres checkpoint"):
    jr.Checkpoint(model=jr.AutoTrackable()).restore(tmp_path)
  path = jr.Checkpoint(model=_build()).save(tmp_path / "ckpt")
  manifest = tmp_path / "ckpt" / "manifest" / "metadata"
  data = json.loads(manifest.read_text())
  for version, match in ((99, "newer"), (1, "format version 1 was written by an earlier jaxres")):
    data["version"] = version
    manifest.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=match):
      jr.Checkpoint(model=jr.AutoTrackable()).restore(path)
  manifest.write_text("{not json")
  with pytest.raises(ValueError, match="corrupted"):
    jr.Checkpoint(model=jr.AutoTrackable()).restore(path)


def test_the_seal_cannot_be_switched_off(tmp_path):
  """Format 3 is always sealed: a manifest without its checksum, or whose checksum field's name lost a
  bit, is refused as damaged, as is one whose version went back to 2 (the seal covers it); the
  model is left as it was. (Unsealed version-2 checkpoints of earlier releases restore:
  test_old_checkpoints.)"""
  root = _build()
  path = jr.Checkpoint(model=root).save(tmp_path / "ckpt")
  manifest = tmp_path / "ckpt" / "manifest" / "metadata"
  written = json.loads(manifest.read_text())
  assert written["version"] == 3 and files.SEAL in written
  flipped = chr(ord(files.SEAL[-1]) ^ 1)
  for edit, match in (
    (lambda d: {k: v for k, v in d.items() if k != files.SEAL}, "its checksum is missing"),
    (lambda d: {(files.SEAL[:-1] + flipped if k == files.SEAL else k): v for k, v in d.items()}, "a field"),
    (lambda d: d | {"version": 2}, "its checksum differs"),
  ):
    manifest.write_text(json.dumps(edit(written)))
    target = _build(seed=1)
    target.step = jnp.array(-1)
    with pytest.raises(ValueError, match=f"corrupted manifest \\({match}"):
      jr.Checkpoint(model=target).restore(path)
    assert int(target.step) == -1 and len(target.words) == 3


def test_save_replaces_atomically(tmp_path):
  root = jr.AutoTrackable()
  root.step = jnp.array(1)
  path = jr.Checkpoint(model=root).save(tmp_path / "ckpt")
  root.step = jnp.array(2)
  jr.Checkpoint(model=root).save(path)
  assert sorted(os.listdir(tmp_path)) == ["ckpt"]
  fresh = jr.AutoTrackable()
  fresh.step = jnp.array(0)
  jr.Checkpoint(model=fresh).restore(path)
  assert int(fresh.step) == 2


def test_root_argument_is_the_graph_root(tmp_path):
  root = jr.AutoTrackable()
  root.step = jnp.array(4)
  checkpoint = jr.Checkpoint(root=root, extra=jnp.array(1))
  assert int(root.extra) == 1 and int(checkpoint.step) == 4
  path = checkpoint.save(tmp_path / "ckpt")
  assert [e["path"] for e in jr.inspect_checkpoint(path)] == ["", "extra", "step"]
  fresh = jr.AutoTrackable()
  status = jr.Checkpoint(root=fresh).restore(path)
  assert status.pending == ["extra", "step"]
  fresh.step = jnp.array(0)
  assert int(fresh.step) == 4


def test_repeated_saves_and_restores_keep_nothing(tmp_path):
  """Saves and restores to new paths keep no Python objects alive: TensorStore's ``to_json``, which Orbax
  calls per array, leaked every key and value it returned (about 35 KB a cycle), and ``glob`` kept a
  compiled pattern per checkpoint path."""
  root = _build()
  checkpoint = jr.Checkpoint(root=root)

  def cycle(i):
    checkpoint.save(tmp_path / f"c{i}")
    jr.Checkpoint(root=_build(seed=1)).restore(tmp_path / f"c{i}").assert_consumed()

  for i in range(3):
    cycle(i)
  patterns = getattr(fnmatch, "_compile_pattern", None)  # private: where a Python renames it, not checked
  patterns = patterns.cache_info().currsize if patterns is not None else None
  gc.collect()
  objects = len(gc.get_objects())
  for i in range(3, 13):
    cycle(i)
  gc.collect()
  assert len(gc.get_objects()) - objects < 200  # about 1,500 before
  if patterns is not None:
    assert fnmatch._compile_pattern.cache_info().currsize == patterns


def test_tensorstore_specs_turned_to_json_are_whole_and_freed():
  """What the wrapped ``to_json`` returns is TensorStore's JSON, nested dicts and lists included, and
  nothing of it outlives the result (TensorStore 0.1.86 leaked every dict key and value)."""
  import tensorstore as ts

  from jaxres._tracking import tensorstore_json

  tensorstore_json.install()
  spec = ts.Spec(
    {"driver": "zarr", "kvstore": {"driver": "memory", "path": "a/"}, "metadata": {"shape": [3, 4]}}
  )
  first, second = spec.to_json(), spec.to_json()
  assert first == second and first["kvstore"] == {"driver": "memory", "path": "a/"}
  assert first["metadata"]["shape"] == [3, 4]
  path = first["kvstore"]["path"]  # held by its dict and here (and getrefcount's argument): nothing more
  assert sys.getrefcount(path) == 3
  gc.collect()
  before = len(gc.get_objects())
  for _ in range(100):
    spec.to_json()
    ts.KvStore.Spec({"driver": "memory", "path": "b/"}).to_json()
  gc.collect()
  assert len(gc.get_objects()) - before < 20  # 100 x 2 dicts (and more) before
