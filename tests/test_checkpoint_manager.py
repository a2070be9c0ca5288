"""jr.CheckpointManager and jr.inspect_checkpoint."""

import jax.numpy as jnp
import numpy as np
import pytest

import jaxres as jr


def _graph():
  root = jr.AutoTrackable()
  root.table = jr.MutableHashTable(str, np.int32, default_value=-1, initial_capacity=4)
  root.step = jnp.array(0)
  return root


def test_steps_latest_restore_and_pruning(tmp_path):
  root = _graph()
  manager = jr.CheckpointManager(tmp_path, jr.Checkpoint(model=root), max_to_keep=2)
  assert manager.latest_step() is None and manager.all_steps() == []
  for step in range(4):
    root.step = jnp.array(step)
    root.table.insert([f"id{step}"], np.array([step], np.int32))
    manager.save(step)
  assert manager.all_steps() == [2, 3] and manager.latest_step() == 3
  with pytest.raises(ValueError, match="already saved"):
    manager.save(3)
  fresh = _graph()
  other = jr.CheckpointManager(tmp_path, jr.Checkpoint(model=fresh))
  other.restore(2).assert_consumed()
  assert int(fresh.step) == 2 and fresh.table.find(["id2", "id3"]).tolist() == [2, -1]
  other.restore().assert_consumed()
  assert int(fresh.step) == 3 and len(fresh.table) == 4
  with pytest.raises(ValueError, match="not among the saved steps"):
    other.restore(0)
  manager.close()
  other.close()


def test_deferred_restore_through_the_manager(tmp_path):
  root = _graph()
  root.table.insert(["x"], np.array([9], np.int32))
  manager = jr.CheckpointManager(tmp_path, jr.Checkpoint(model=root))
  manager.save(0)
  manager.close()
  empty = jr.AutoTrackable()
  restored = jr.CheckpointManager(tmp_path, jr.Checkpoint(model=empty))
  status = restored.restore()
  assert status.pending == ["model/step", "model/table"]
  empty.table = jr.MutableHashTable(str, np.int32, default_value=-1)
  assert empty.table.find(["x"]).tolist() == [9]
  restored.close()


def test_manager_errors(tmp_path):
  with pytest.raises(TypeError, match="checkpoint"):
    jr.CheckpointManager(tmp_path, jr.AutoTrackable())
  with pytest.raises(ValueError, match="max_to_keep"):
    jr.CheckpointManager(tmp_path, jr.Checkpoint(), max_to_keep=0)
  manager = jr.CheckpointManager(tmp_path, jr.Checkpoint(model=_graph()))
  with pytest.raises(ValueError, match="no checkpoint"):
    manager.restore()
  with pytest.raises(ValueError, match="step"):
    manager.save(-1)
  manager.close()


def test_inspect_checkpoint_lists_the_graph_without_loading(tmp_path):
  root = _graph()
  root.table.insert(["a", "b"], np.array([1, 2], np.int32))
  root.alias = root.table
  path = jr.Checkpoint(model=root).save(tmp_path / "ckpt")
  entries = {e["path"]: e for e in jr.inspect_checkpoint(path)}
  assert entries["model/table"]["kind"] == "table"
  assert entries["model/table"]["arrays"][0] == {"name": "keys", "shape": [2, 17], "dtype": "uint32"}
  assert entries["model/alias"] == {
    "path": "model/alias",
    "kind": "alias",
    "type": "jaxres._shell.mutable_table.MutableHashTable",
    "of": "model/table",
    "arrays": [],
  }
  assert entries["model/step"]["arrays"] == [{"name": "value", "shape": [], "dtype": "int32"}]
