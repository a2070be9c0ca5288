"""Incremental saves of a ``CheckpointManager``: each step restores exactly what a whole save restores.

A state machine trains a model (a ``DynamicEmbedding`` that evicts, a dense layer, a functional table and
a sharded one in variables) and a bounded stateful table through random steps (embedding steps, inserts,
removals, ``erase_if``, a resize, a table replaced by another), saving incremental steps (``full_every``,
``max_to_keep``) and, beside them, a whole ``jr.Checkpoint`` of every step as the reference. At each
save it restores every kept step into fresh objects, and the reference of that step into others, and
compares what the two would save, array by array (entries, slots, scores, counters, optimizer state).
"""

import os
import shutil
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule

import jaxres as jr
from jaxres._tracking.checkpoint import collect

# erase_if's predicate is a static argument of its jitted call: one function a limit, made once (a fresh
# lambda each step would trace the program again).
BELOW = {limit: (lambda keys, values, scores, limit=limit: values < limit) for limit in (1, 2, 3)}
IDS = np.arange(48, dtype=np.int64) * 7919 + 2**40  # 64-bit ids, exact


class Model(nnx.Module):
  def __init__(self):
    self.emb = jr.DynamicEmbedding(
      16, 4, optimizer=optax.adam(0.1), eviction=jr.LRU(), rngs=nnx.Rngs(0)
    )  # small: ids get evicted
    self.head = nnx.Linear(4, 1, rngs=nnx.Rngs(1))
    self.counts = nnx.Variable(
      jr.OpenAddressingTable.create(32, key=jnp.int64, value=jnp.int32, eviction=jr.LFU())
    )
    mesh = jax.make_mesh((4,), ("shard",), devices=jax.devices()[:4])
    shards = jr.ShardedTable.create(mesh, "shard", 16, key=jnp.int64, value=jnp.float32, eviction=jr.LRU())
    self.sharded = nnx.Variable(shards)  # 4 shards of 4 entries: they evict


def _vocab():
  return jr.MutableHashTable(np.int64, np.float32, default_value=0.0, initial_capacity=8, eviction=jr.LRU())


def _root():
  root = jr.AutoTrackable()
  root.model = Model()
  root.vocab = _vocab()
  root.step = jnp.array(0)
  return root


@nnx.jit
def _train(model, ids, labels):
  rows = model.emb(ids)

  def loss_fn(model, rows):
    return jnp.mean((model.head(rows)[:, 0] - labels) ** 2)

  loss, (grads, row_grads) = nnx.value_and_grad(loss_fn, argnums=(0, 1))(model, rows)
  model.head.kernel.set_value(model.head.kernel.get_value() - 0.1 * grads.head.kernel.get_value())
  model.emb.apply_gradients(ids, row_grads)
  return loss


def _saved(root) -> dict:
  """What a save of ``root`` holds: ``{(path, array name): array}``."""
  contents, arrays = collect(root)
  return {
    (path, name): np.asarray(arrays[key])
    for path, node in contents["nodes"].items()
    for name, key in node.get("arrays", {}).items()
  }


def _assert_same(got: dict, want: dict) -> None:
  assert sorted(got) == sorted(want)
  for name, array in want.items():
    np.testing.assert_array_equal(got[name], array, err_msg=str(name))


class IncrementalMachine(RuleBasedStateMachine):
  def __init__(self):
    super().__init__()
    self.directory = _tmp()
    self.root = _root()
    self.manager = jr.CheckpointManager(
      os.path.join(self.directory, "steps"),
      jr.Checkpoint(model=self.root),
      max_to_keep=2,
      incremental=True,
      full_every=3,
    )
    self.step = 0

  @rule(picks=st.lists(st.integers(0, len(IDS) - 1), min_size=8, max_size=8), seed=st.integers(0, 99))
  def train(self, picks, seed):
    labels = np.random.default_rng(seed).normal(size=8).astype(np.float32)
    _train(self.root.model, jr.keys.split64(IDS[np.asarray(picks)]), labels)

  @rule(picks=st.lists(st.integers(0, len(IDS) - 1), min_size=4, max_size=4), value=st.integers(-5, 5))
  def vocab_insert(self, picks, value):
    self.root.vocab.insert(IDS[np.asarray(picks)], np.full(4, value, np.float32))

  @rule(picks=st.lists(st.integers(0, len(IDS) - 1), min_size=2, max_size=2))
  def vocab_remove(self, picks):
    self.root.vocab.remove(IDS[np.asarray(picks)])

  @rule(picks=st.lists(st.integers(0, len(IDS) - 1), min_size=4, max_size=4))
  def count(self, picks):
    counts = self.root.model.counts
    counts.set_value(
      counts.get_value().insert_or_apply(IDS[np.asarray(picks)], np.ones(4, np.int32), jnp.add)
    )

  @rule(picks=st.lists(st.integers(0, len(IDS) - 1), min_size=4, max_size=4), drop=st.booleans())
  def sharded(self, picks, drop):
    sharded = self.root.model.sharded
    table = sharded.get_value().insert(IDS[np.asarray(picks)], np.asarray(picks, np.float32))
    sharded.set_value(table.remove(IDS[np.asarray(picks[:1])]) if drop else table)

  @rule(limit=st.integers(1, 3))
  def expire(self, limit):
    counts = self.root.model.counts
    counts.set_value(counts.get_value().erase_if(BELOW[limit]))

  @rule()
  def regrow(self):  # another layout: saved whole
    counts = self.root.model.counts
    table = counts.get_value()
    counts.set_value(table.resize(64 if table.capacity == 32 else 32))

  @rule()
  def replace_vocab(self):  # another table at the same path, of the same layout: saved whole
    old = self.root.vocab
    self.root.vocab = _vocab()
    keys, values = old.export()
    for _ in range(int(old.state.version) + 1):  # its version ahead: only its identity tells them apart
      self.root.vocab.insert(keys[:3], values[:3] + 1)

  @rule(full=st.sampled_from([None, None, None, True]))
  def save(self, full):
    self._save(full)

  @rule()
  def save_as_due(self):  # saves as often as the other rules together
    self._save(None)

  def _save(self, full):
    self.step += 1
    self.root.step = jnp.array(self.step)
    self.manager.save(self.step, full=full)
    jr.Checkpoint(model=self.root).save(os.path.join(self.directory, "whole", str(self.step)))
    steps = self.manager.all_steps()
    # The newest (each step is checked when it is), and the oldest kept: later saves left it whole.
    for step in sorted({steps[0], steps[-1]}):
      restored, reference = _root(), _root()
      jr.CheckpointManager(os.path.join(self.directory, "steps"), jr.Checkpoint(model=restored)).restore(
        step
      ).assert_consumed()
      jr.Checkpoint(model=reference).restore(
        os.path.join(self.directory, "whole", str(step))
      ).assert_consumed()
      _assert_same(_saved(restored), _saved(reference))
      assert int(restored.step) == step

  def teardown(self):
    self.manager.close()
    shutil.rmtree(self.directory)


def _tmp():
  return tempfile.mkdtemp(prefix="jaxres-incremental-")


IncrementalMachine.TestCase.settings = settings(
  max_examples=4, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck)
)
TestIncremental = pytest.mark.slow(IncrementalMachine.TestCase)


def _table_node(manager, step, path):
  (entry,) = [e for e in jr.inspect_checkpoint(manager.step_path(step)) if e["path"] == path]
  return entry


def test_a_step_after_a_whole_one_holds_only_what_changed(tmp_path):
  def root_with_vocab():
    root = _root()
    root.vocab = jr.MutableHashTable(np.int64, np.float32, default_value=0.0, initial_capacity=4096)
    return root

  root = root_with_vocab()
  manager = jr.CheckpointManager(tmp_path, jr.Checkpoint(model=root), incremental=True)
  root.vocab.insert(IDS[:40], np.ones(40, np.float32))
  manager.save(0)
  root.vocab.insert(IDS[40:42], np.full(2, 2.0, np.float32))  # two new
  root.vocab.assign(IDS[:1], np.full(1, 3.0, np.float32))  # one changed
  root.vocab.remove(IDS[5:7])  # two gone: their slots are no longer live
  manager.save(1)
  entry = _table_node(manager, 1, "model/vocab")
  assert entry["delta"] and {a["name"]: a["shape"] for a in entry["arrays"]}["keys"] == [3]
  head = _table_node(manager, 1, "model/model/head/kernel")
  assert [a["step"] for a in head["arrays"]] == [0]  # unchanged: kept in step 0, not written again
  manager.close()
  restored = root_with_vocab()
  reader = jr.CheckpointManager(tmp_path, jr.Checkpoint(model=restored))
  reader.restore(1).assert_consumed()
  keys, values = root.vocab.export()
  assert len(keys) == 40 and sorted(set(values.tolist())) == [1.0, 2.0, 3.0]
  got_keys, got_values = restored.vocab.export()
  assert got_keys.tolist() == keys.tolist() and got_values.tolist() == values.tolist()
  reader.close()


def test_a_table_replaced_by_another_is_saved_whole(tmp_path):
  root = _root()
  manager = jr.CheckpointManager(tmp_path, jr.Checkpoint(model=root), incremental=True)
  root.vocab.insert(IDS[:6], np.ones(6, np.float32))
  manager.save(0)
  old = root.vocab
  root.vocab = _vocab()
  for _ in range(int(old.state.version) + 1):  # its version ahead: only its identity tells them apart
    root.vocab.insert(IDS[:2], np.full(2, 5.0, np.float32))
  manager.save(1)
  assert not _table_node(manager, 1, "model/vocab").get("delta")
  restored = _root()
  jr.CheckpointManager(tmp_path, jr.Checkpoint(model=restored)).restore(1).assert_consumed()
  assert restored.vocab.export()[0].tolist() == root.vocab.export()[0].tolist()
  manager.close()


@pytest.mark.parametrize(("full_every", "kept"), [(None, [0, 1, 2, 3, 4, 5]), (2, [4, 5]), (3, [3, 4, 5])])
def test_max_to_keep_keeps_the_steps_a_kept_step_needs(tmp_path, full_every, kept):
  root = _root()
  manager = jr.CheckpointManager(
    tmp_path, jr.Checkpoint(model=root), max_to_keep=1, incremental=True, full_every=full_every
  )
  for step in range(6):
    root.vocab.insert(IDS[step : step + 1], np.full(1, step, np.float32))
    manager.save(step)
  assert manager.all_steps() == kept
  manager.close()
  restored = _root()
  jr.CheckpointManager(tmp_path, jr.Checkpoint(model=restored)).restore(5).assert_consumed()
  assert restored.vocab.export()[0].tolist() == root.vocab.export()[0].tolist()


def test_an_incremental_step_is_restored_by_its_manager_only_and_deferred_alike(tmp_path):
  root = _root()
  manager = jr.CheckpointManager(tmp_path, jr.Checkpoint(model=root), incremental=True)
  root.vocab.insert(IDS[:4], np.ones(4, np.float32))
  manager.save(0)
  root.vocab.insert(IDS[4:5], np.full(1, 2.0, np.float32))
  manager.save(1, full=False)
  with pytest.raises(ValueError, match=r"an incremental step of a jr.CheckpointManager.*restore it with"):
    jr.Checkpoint(model=_root()).restore(manager.step_path(1))
  later = jr.AutoTrackable()
  status = jr.CheckpointManager(tmp_path, jr.Checkpoint(model=later)).restore(1)
  assert "model/vocab" in status.pending
  later.vocab = _vocab()  # restored here, on attach, from the composed step
  assert later.vocab.export()[0].tolist() == root.vocab.export()[0].tolist()
  with pytest.raises(ValueError, match="step: 7 is not among the saved steps"):
    manager.step_path(7)
  manager.close()


@pytest.mark.parametrize(
  ("options", "error", "match"),
  [
    ({"incremental": 1}, TypeError, "incremental"),
    ({"full_every": 2}, ValueError, "full_every: only incremental saves"),
    ({"incremental": True, "full_every": 0}, ValueError, "full_every"),
  ],
)
def test_bad_incremental_options_are_named(tmp_path, options, error, match):
  with pytest.raises(error, match=match):
    jr.CheckpointManager(tmp_path, jr.Checkpoint(model=_root()), **options)


def test_full_must_be_a_bool(tmp_path):
  manager = jr.CheckpointManager(tmp_path, jr.Checkpoint(model=_root()), incremental=True)
  with pytest.raises(TypeError, match="full"):
    manager.save(0, full=1)
  assert manager.all_steps() == []
  manager.close()


def test_a_stateful_table_rebuilt_by_import_or_restore_is_saved_whole(tmp_path):
  root = _root()
  manager = jr.CheckpointManager(tmp_path / "steps", jr.Checkpoint(model=root), incremental=True)
  root.vocab.insert(IDS[:2], np.array([10.0, 20.0], np.float32))
  manager.save(0)
  root.vocab.import_(IDS[:2], np.array([11.0, 22.0], np.float32))  # rebuilt: a version from 0 again
  manager.save(1)
  other = _root()
  other.vocab.insert(IDS[:5], np.arange(5, dtype=np.float32))
  whole = jr.Checkpoint(model=other).save(tmp_path / "other")
  jr.Checkpoint(model=root).restore(whole)  # rebuilt again, outside the manager
  root.vocab.insert(IDS[:1], np.array([7.0], np.float32))
  manager.save(2)
  for step in (1, 2):
    assert not _table_node(manager, step, "model/vocab").get("delta")
  restored = _root()
  jr.CheckpointManager(tmp_path / "steps", jr.Checkpoint(model=restored)).restore(2).assert_consumed()
  assert restored.vocab.export()[1].tolist() == root.vocab.export()[1].tolist() == [7.0, 1.0, 2.0, 3.0, 4.0]
  manager.close()


def test_steps_only_go_up(tmp_path):
  root = _root()
  manager = jr.CheckpointManager(tmp_path, jr.Checkpoint(model=root), incremental=True)
  manager.save(0)
  manager.save(2)
  with pytest.raises(ValueError, match="step: 1 is below the latest saved step 2"):
    manager.save(1)
  manager.save(3)
  assert manager.all_steps() == [0, 2, 3]
  jr.CheckpointManager(tmp_path, jr.Checkpoint(model=_root())).restore(3).assert_consumed()
  manager.close()


def test_a_manager_of_whole_steps_keeps_the_steps_incremental_ones_need(tmp_path):
  root = _root()
  manager = jr.CheckpointManager(tmp_path, jr.Checkpoint(model=root), incremental=True)
  for step in range(4):
    root.vocab.insert(IDS[step : step + 1], np.ones(1, np.float32))
    manager.save(step)
  manager.close()
  plain = jr.CheckpointManager(tmp_path, jr.Checkpoint(model=root), max_to_keep=2)
  plain.save(4)
  assert plain.all_steps() == [0, 1, 2, 3, 4]  # 3 needs 0-2
  plain.save(5)
  assert plain.all_steps() == [4, 5]
  plain.close()


def test_a_table_resharded_between_steps_restores_exactly(tmp_path):
  """A sharded table restored onto a mesh of another size between steps: saved whole once (another
  slot layout), then in deltas again; every step restores the entries, scores and clock saved."""
  mesh4, mesh2 = (jax.make_mesh((n,), ("shard",), devices=jax.devices()[:n]) for n in (4, 2))

  def table(mesh):
    return jr.ShardedTable.create(mesh, "shard", 64, key=jnp.int64, value=jnp.float32, eviction=jr.LRU())

  root = jr.AutoTrackable()
  root.table = table(mesh4)
  manager = jr.CheckpointManager(tmp_path / "steps", jr.Checkpoint(model=root), incremental=True)
  rng = np.random.default_rng(0)
  reference = {}
  for step in range(6):
    picks = IDS[rng.choice(len(IDS), 6, replace=False)]
    root.table = root.table.insert(picks, rng.normal(size=6).astype(np.float32)).remove(picks[:1])
    if step == 3:  # re-sharded: a whole save restored onto 2 devices
      jr.Checkpoint(model=root).save(tmp_path / "moved")
      root.table = table(mesh2)
      jr.Checkpoint(model=root).restore(tmp_path / "moved").assert_consumed()
    manager.save(step)
    reference[step] = (root.table.export(), np.asarray(root.table.scores(IDS)), int(root.table.clock))
  manager.wait_until_finished()
  kinds = [
    next(e for e in jr.inspect_checkpoint(manager.step_path(s)) if e["path"] == "model/table").get("delta")
    for s in range(6)
  ]
  assert kinds == [None, True, True, None, True, True]  # whole after the move, deltas again
  for step, ((keys, values, valid), scores, clock) in reference.items():
    for mesh in (mesh2, mesh4):
      fresh = jr.AutoTrackable()
      fresh.table = table(mesh)
      jr.CheckpointManager(tmp_path / "steps", jr.Checkpoint(model=fresh)).restore(step).assert_consumed()
      got_keys, got_values, got_valid = fresh.table.export()
      want = dict(
        zip(np.asarray(keys)[np.asarray(valid)].tolist(), np.asarray(values)[np.asarray(valid)].tolist())
      )
      got = dict(
        zip(
          np.asarray(got_keys)[np.asarray(got_valid)].tolist(),
          np.asarray(got_values)[np.asarray(got_valid)].tolist(),
        )
      )
      assert got == want, (step, mesh.size)
      np.testing.assert_array_equal(fresh.table.scores(IDS), scores)
      assert int(fresh.table.clock) == clock
