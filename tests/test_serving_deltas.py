"""Deltas to a served model: ``save(..., updatable=True)``, ``save_delta``, ``LoadedModel.update``.

The oracle is a model exported whole at the same step: after each delta the
updated model's outputs must equal that one's, bit for bit, for ids in its
tables, evicted, removed and never seen.
"""

import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from oracle import mesh_of
from tower import ADAM, FEATURES, IDS, Model, predict, train_step

import jaxres as jr

POOL = (np.arange(300, dtype=np.int64) * 7919 + 2**40) * np.where(np.arange(300) % 2, 1, -1)
QUERY = np.concatenate([POOL, [3, -5, 2**62, 0]]).reshape(-1, 2)  # every id seen, and some never


class Trainer:
  """A model, its optimizer and a stream of batches drawn from ``POOL`` (more ids than rows)."""

  def __init__(self, model, seed=0, batch=16):
    self.model = model
    self.optimizer = nnx.Optimizer(model, ADAM, wrt=nnx.Param)
    self.rng = np.random.default_rng(seed)
    self.batch = batch

  def train(self, steps):
    self.model.train()
    for _ in range(steps):
      ids = self.rng.choice(POOL, (self.batch, 2))
      labels = jnp.asarray(self.rng.normal(size=self.batch), jnp.float32)
      train_step(self.model, self.optimizer, jr.keys.split64(ids), labels)


SIGNATURES = {"serving_default": jr.saved_model.Signature(predict, ids=IDS)}
CPU = ("cpu",)  # lowering for CUDA too is tested in test_saved_model.py


def _answers(served, ids=QUERY):
  return {k: np.asarray(v) for k, v in served.signatures["serving_default"](ids=ids).items()}


def _same_answers(a, b):
  assert sorted(a) == sorted(b)
  for name in a:
    assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
    assert a[name].tobytes() == b[name].tobytes(), name


def _kinds(delta):
  """How the delta at ``delta`` sends each table: ``"same"``, ``"changes"`` or ``"whole"``."""
  return json.loads((delta / "delta.json").read_text())["kinds"]


def _whole_export(obj, path, signatures=SIGNATURES):
  jr.saved_model.save(obj, path, signatures, platforms=CPU)
  return jr.saved_model.load(path)


@pytest.mark.parametrize(
  "sharded, storage",
  [(False, "open_addressing"), (True, "open_addressing"), (False, "lean")],
  ids=["one_table", "sharded", "lean"],
)
def test_a_model_updated_by_deltas_answers_as_one_exported_at_that_step(sharded, storage, tmp_path):
  options = {"mesh": mesh_of(4), "axis": "shard"} if sharded else {}
  trainer = Trainer(Model(capacity=64, storage=storage, **options))
  trainer.train(3)
  jr.saved_model.save(trainer.model, tmp_path / "export", SIGNATURES, updatable=True, step=3, platforms=CPU)
  served = jr.saved_model.load(tmp_path / "export")
  assert served.step == 3
  _same_answers(_answers(served), _answers(_whole_export(trainer.model, tmp_path / "whole_3")))
  since = tmp_path / "export"
  for step in (4, 9, 10):  # one step (a few rows), then more: evictions of a full table
    if step == 10 and sharded:  # re-sharded: restored onto a mesh of 2 (the table comes whole)
      jr.Checkpoint(model=trainer.model).save(tmp_path / "ckpt")
      model = Model(capacity=64, mesh=mesh_of(2), axis="shard")
      jr.Checkpoint(model=model).restore(tmp_path / "ckpt")
      trainer.model, trainer.optimizer = model, nnx.Optimizer(model, ADAM, wrt=nnx.Param)
    trainer.train(step - served.step)
    jr.saved_model.save_delta(trainer.model, tmp_path / f"delta_{step}", since=since, step=step)
    served.update(tmp_path / f"delta_{step}")
    since = tmp_path / f"delta_{step}"
    assert served.step == step
    assert _kinds(since) == ["whole" if step == 10 and sharded else "changes"]
    _same_answers(_answers(served), _answers(_whole_export(trainer.model, tmp_path / f"whole_{step}")))
  assert int(trainer.model.emb.table.evictions) > 0  # entries left the table between deltas


def test_removals_resizes_and_replaced_tables_reach_the_served_model(tmp_path):
  """An AutoTrackable of a stateful table (grown between deltas), a functional table (entries
  removed and erased) and a sorted table (no change stamps: sent whole)."""
  rng = np.random.default_rng(1)
  root = jr.AutoTrackable()
  root.stateful = jr.MutableHashTable(jnp.int64, jnp.float32, default_value=-1.0, initial_capacity=32)
  root.functional = jr.OpenAddressingTable.create(256, key=jnp.int32, value=jnp.float32, default=0.0)
  root.vocab = jr.SortedTable.create(64, key=jnp.int32, value=jnp.int32, default=-1)
  root.scale = jnp.float32(2.0)

  def lookup(obj, ids, small):
    return {
      "stateful": obj.stateful.lookup(ids)[0] * obj.scale,
      "functional": obj.functional.find(small),
      "vocab": obj.vocab.find(small),
    }

  signatures = {
    "lookup": jr.saved_model.Signature(
      lookup, ids=jax.ShapeDtypeStruct(("n",), jnp.int64), small=jax.ShapeDtypeStruct(("n",), jnp.int32)
    )
  }
  big_ids = POOL[:150]
  small_ids = np.arange(150, dtype=np.int32)

  def query(served):
    out = served.signatures["lookup"](ids=big_ids, small=small_ids)
    return {k: np.asarray(v) for k, v in out.items()}

  def mutate(step):
    keys = rng.choice(big_ids, 20, replace=False)
    root.stateful.insert(keys, rng.normal(size=20).astype(np.float32))
    root.stateful.remove(rng.choice(big_ids, 5, replace=False))
    small = rng.choice(small_ids, 30, replace=False)
    root.functional = root.functional.insert(small, rng.normal(size=30).astype(np.float32))
    root.functional = root.functional.remove(rng.choice(small_ids, 10, replace=False))
    if step % 2:
      root.functional = root.functional.erase_if(lambda k, v, s: v > 1.0)
      root.vocab = root.vocab.insert(small[:5], np.full(5, step, np.int32))

  mutate(0)
  # Room for the stateful table's growth: it is served at the capacity it has when exported.
  root.stateful.insert(big_ids, np.zeros(150, np.float32))
  root.stateful.remove(big_ids)
  jr.saved_model.save(root, tmp_path / "export", signatures, updatable=True, platforms=CPU)
  served = jr.saved_model.load(tmp_path / "export")
  since = tmp_path / "export"
  capacity = root.stateful.capacity
  for step in range(1, 5):
    mutate(step)
    if step == 3:
      root.scale = jnp.float32(3.0)  # an array that is not a table: sent whole
    if step == 2:  # the stateful table grows (new slots: it comes whole), then shrinks back to fit
      extra = np.arange(1000, 1300, dtype=np.int64)
      root.stateful.insert(extra, np.ones(300, np.float32))
      root.stateful.remove(extra)
      assert root.stateful.capacity > capacity
    jr.saved_model.save_delta(root, tmp_path / f"d{step}", since=since, step=step)
    served.update(tmp_path / f"d{step}")
    since = tmp_path / f"d{step}"
    stateful, functional, vocab = _kinds(since)
    assert (stateful, functional) == ("whole" if step == 2 else "changes", "changes")
    assert vocab == ("whole" if step % 2 else "same")  # a sorted table gives no changes
    _same_answers(query(served), query(_whole_export(root, tmp_path / f"w{step}", signatures)))


def test_a_delta_holds_only_what_changed(tmp_path):
  trainer = Trainer(Model(capacity=256), batch=2)
  trainer.train(40)
  jr.saved_model.save(trainer.model, tmp_path / "export", SIGNATURES, updatable=True, platforms=CPU)
  table = trainer.model.emb.table
  before = int(table.version)
  trainer.train(1)  # 4 ids: at most 4 rows changed, plus the dense head
  jr.saved_model.save_delta(trainer.model, tmp_path / "delta", since=tmp_path / "export", step=1)
  words = np.load(tmp_path / "delta" / "tables" / "0" / "words.npy")
  assert 1 <= len(words) <= 4
  assert len(words) == len(trainer.model.emb.table.changes(before).entries.keys)
  # A row holds the served leaf only (the embedding rows, not the optimizer's slots).
  values = sorted(p.name for p in (tmp_path / "delta" / "tables" / "0" / "values").iterdir())
  assert values == ["0.npy"]
  assert np.load(tmp_path / "delta" / "tables" / "0" / "values" / "0.npy").shape == (len(words), FEATURES)
  # Nothing changed: nothing but the lineage.
  jr.saved_model.save_delta(trainer.model, tmp_path / "empty", since=tmp_path / "delta", step=2)
  assert sorted(p.name for p in (tmp_path / "empty").iterdir()) == ["delta.json"]


def test_the_programs_are_not_compiled_again(tmp_path, caplog):
  trainer = Trainer(Model(capacity=64))
  trainer.train(2)
  jr.saved_model.save(trainer.model, tmp_path / "export", SIGNATURES, updatable=True, platforms=CPU)
  served = jr.saved_model.load(tmp_path / "export")
  before = _answers(served)
  trainer.train(3)
  jr.saved_model.save_delta(trainer.model, tmp_path / "delta", since=tmp_path / "export", step=1)
  with caplog.at_level(logging.WARNING), jax.log_compiles(True):
    served.update(tmp_path / "delta")
    after = _answers(served)
  compiled = [r.getMessage() for r in caplog.records if "Compiling jit(call)" in r.getMessage()]
  assert not compiled, compiled
  assert any(not np.array_equal(before[k], after[k]) for k in before)


def test_deltas_of_another_model_or_step_are_refused_and_change_nothing(tmp_path):
  a, b = Trainer(Model(64), seed=0), Trainer(Model(64), seed=1)
  a.train(2)
  b.train(2)
  jr.saved_model.save(a.model, tmp_path / "a", SIGNATURES, updatable=True, step=2, platforms=CPU)
  jr.saved_model.save(b.model, tmp_path / "b", SIGNATURES, updatable=True, step=2, platforms=CPU)
  served = jr.saved_model.load(tmp_path / "a")
  a.train(1)
  b.train(1)
  jr.saved_model.save_delta(a.model, tmp_path / "a3", since=tmp_path / "a", step=3)
  jr.saved_model.save_delta(b.model, tmp_path / "b3", since=tmp_path / "b", step=3)
  a.train(1)
  jr.saved_model.save_delta(a.model, tmp_path / "a4", since=tmp_path / "a3", step=4)
  original = _answers(served)
  with pytest.raises(ValueError, match="another model"):
    served.update(tmp_path / "b3")
  with pytest.raises(ValueError, match="apply the deltas in between"):
    served.update(tmp_path / "a4")
  _same_answers(_answers(served), original)
  served.update(tmp_path / "a3")
  with pytest.raises(ValueError, match="serves step 3"):
    served.update(tmp_path / "a3")  # older than (here: equal to) the step served
  served.update(tmp_path / "a4")
  assert served.step == 4
  # Damaged: a changed byte in an array is caught before anything changes.
  updated = _answers(served)
  a.train(1)
  jr.saved_model.save_delta(a.model, tmp_path / "a5", since=tmp_path / "a4", step=5)
  file = tmp_path / "a5" / "tables" / "0" / "values" / "0.npy"
  data = bytearray(file.read_bytes())
  data[-1] ^= 1
  file.write_bytes(bytes(data))
  with pytest.raises(ValueError, match="a5"):
    served.update(tmp_path / "a5")
  with pytest.raises(ValueError, match="not a jaxres saved-model delta"):
    served.update(tmp_path / "a")
  with pytest.raises(TypeError, match="delta"):
    served.update(3)
  _same_answers(_answers(served), updated)


def test_bad_exports_and_deltas_are_refused(tmp_path):
  trainer = Trainer(Model(64))
  trainer.train(1)
  jr.saved_model.save(trainer.model, tmp_path / "plain", SIGNATURES, platforms=CPU)
  with pytest.raises(ValueError, match="updatable=True"):
    jr.saved_model.load(tmp_path / "plain").update(tmp_path / "plain")
  with pytest.raises(ValueError, match="updatable=True"):
    jr.saved_model.save_delta(trainer.model, tmp_path / "d", since=tmp_path / "plain", step=1)
  with pytest.raises(ValueError, match="format"):
    jr.saved_model.save(trainer.model, tmp_path / "tf", SIGNATURES, format="tf", updatable=True)
  with pytest.raises(TypeError, match="updatable"):
    jr.saved_model.save(trainer.model, tmp_path / "x", SIGNATURES, updatable="yes")
  with pytest.raises(TypeError, match="step"):
    jr.saved_model.save(trainer.model, tmp_path / "x", SIGNATURES, updatable=True, step=-1, platforms=CPU)
  with pytest.raises(ValueError, match="updatable=True"):
    jr.saved_model.save(trainer.model, tmp_path / "x", SIGNATURES, step=3, platforms=CPU)
  jr.saved_model.save(trainer.model, tmp_path / "export", SIGNATURES, updatable=True, step=5, platforms=CPU)
  with pytest.raises(ValueError, match="step: 5 is not after step 5"):
    jr.saved_model.save_delta(trainer.model, tmp_path / "d", since=tmp_path / "export", step=5)
  with pytest.raises(ValueError, match="another model"):
    jr.saved_model.save_delta(jr.AutoTrackable(), tmp_path / "d", since=tmp_path / "export", step=6)
  with pytest.raises(TypeError, match="since"):
    jr.saved_model.save_delta(trainer.model, tmp_path / "d", since=None, step=6)
  assert not (tmp_path / "d").exists() and not (tmp_path / "x").exists()
  with pytest.raises(ValueError, match="not a delta"):  # never over the export (or anything else)
    jr.saved_model.save_delta(trainer.model, tmp_path / "export", since=tmp_path / "export", step=6)
  assert jr.saved_model.load(tmp_path / "export").step == 5
  jr.saved_model.save_delta(trainer.model, tmp_path / "d", since=tmp_path / "export", step=6)
  trainer.train(1)
  jr.saved_model.save_delta(trainer.model, tmp_path / "d", since=tmp_path / "export", step=7)  # replaced
  with pytest.raises(ValueError, match="is the export or delta the new one follows"):
    jr.saved_model.save_delta(trainer.model, tmp_path / "d", since=tmp_path / "d", step=8)
  served = jr.saved_model.load(tmp_path / "export")
  served.update(tmp_path / "d")
  _same_answers(_answers(served), _answers(_whole_export(trainer.model, tmp_path / "whole")))


def test_a_table_outgrowing_its_room_asks_for_a_new_export(tmp_path):
  table = jr.MutableHashTable(jnp.int32, jnp.float32, default_value=0.0, initial_capacity=8)
  table.insert(np.arange(4, dtype=np.int32), np.ones(4, np.float32))
  find = jr.saved_model.Signature(lambda t, k: t.lookup(k)[0], k=jax.ShapeDtypeStruct(("n",), jnp.int32))
  jr.saved_model.save(table, tmp_path / "export", {"find": find}, updatable=True, platforms=CPU)
  table.insert(np.arange(100, dtype=np.int32), np.ones(100, np.float32))  # grows past its capacity
  with pytest.raises(ValueError, match="Export the model again"):
    jr.saved_model.save_delta(table, tmp_path / "d", since=tmp_path / "export", step=1)
  assert not (tmp_path / "d").exists()


def test_an_updatable_export_stores_only_live_rows(tmp_path):
  table = jr.OpenAddressingTable.create(1 << 12, key=jnp.int32, value=jnp.float32, default=0.0)
  table = table.insert(np.arange(10, dtype=np.int32), np.ones(10, np.float32))
  find = jr.saved_model.Signature(lambda t, k: t.find(k), k=jax.ShapeDtypeStruct(("n",), jnp.int32))
  jr.saved_model.save(table, tmp_path / "export", {"find": find}, updatable=True, platforms=CPU)
  stored = [np.load(p) for p in (tmp_path / "export" / "state").iterdir()]
  assert max(len(x) for x in stored if x.ndim) == 10
  served = jr.saved_model.load(tmp_path / "export")
  assert served.signatures["find"](k=np.array([3, 11], np.int32))["output"].tolist() == [1.0, 0.0]


def test_a_delta_follows_the_very_export_or_delta_it_was_written_against(tmp_path):
  """Two deltas written against the same export (a branch): a model serving one refuses what follows
  the other, although the steps line up."""
  trainer = Trainer(Model(64))
  trainer.train(2)
  jr.saved_model.save(trainer.model, tmp_path / "export", SIGNATURES, updatable=True, step=10, platforms=CPU)
  served = jr.saved_model.load(tmp_path / "export")
  trainer.train(1)
  jr.saved_model.save_delta(trainer.model, tmp_path / "a", since=tmp_path / "export", step=11)
  trainer.train(1)
  jr.saved_model.save_delta(trainer.model, tmp_path / "b", since=tmp_path / "export", step=11)
  trainer.train(1)
  jr.saved_model.save_delta(trainer.model, tmp_path / "after_b", since=tmp_path / "b", step=12)
  served.update(tmp_path / "a")
  with pytest.raises(ValueError, match="does not follow what this model serves"):
    served.update(tmp_path / "after_b")
  other = jr.saved_model.load(tmp_path / "export")
  other.update(tmp_path / "b")
  other.update(tmp_path / "after_b")
  _same_answers(_answers(other), _answers(_whole_export(trainer.model, tmp_path / "whole")))


def test_rebuilt_and_restarted_tables_reach_the_served_model_whole(tmp_path):
  """A stateful table rebuilt by import_ (its version otherwise as before) and a trainer restarted
  from a checkpoint (another object, whose versions say nothing of the served ones) send every entry."""
  table = jr.MutableHashTable(jnp.int64, jnp.float32, default_value=-1.0, initial_capacity=64)
  table.insert(np.array([1, 2]), np.array([0.5, 1.5], np.float32))
  find = jr.saved_model.Signature(lambda t, k: t.lookup(k)[0], k=jax.ShapeDtypeStruct(("n",), jnp.int64))
  jr.saved_model.save(table, tmp_path / "export", {"find": find}, updatable=True, platforms=CPU)
  served = jr.saved_model.load(tmp_path / "export")
  version = int(table.state.version)
  table.import_(np.array([7]), np.array([9.0], np.float32))
  assert int(table.state.version) > version  # the rebuilt state goes on from the one it replaces
  jr.saved_model.save_delta(table, tmp_path / "d1", since=tmp_path / "export", step=1)
  served.update(tmp_path / "d1")
  assert served.signatures["find"](k=np.array([1, 2, 7]))["output"].tolist() == [-1.0, -1.0, 9.0]

  jr.Checkpoint(table=table).save(tmp_path / "ckpt")
  restarted = jr.MutableHashTable(jnp.int64, jnp.float32, default_value=-1.0, initial_capacity=64)
  jr.Checkpoint(table=restarted).restore(tmp_path / "ckpt").assert_consumed()
  for _ in range(5):  # its versions pass the served ones, on another history
    restarted.insert(np.array([3]), np.array([3.0], np.float32))
  jr.saved_model.save_delta(restarted, tmp_path / "d2", since=tmp_path / "d1", step=2)
  assert _kinds(tmp_path / "d2") == ["whole"]
  served.update(tmp_path / "d2")
  assert served.signatures["find"](k=np.array([1, 3, 7]))["output"].tolist() == [-1.0, 3.0, 9.0]
