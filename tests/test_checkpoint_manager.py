"""jr.CheckpointManager and jr.inspect_checkpoint."""

import subprocess
import sys
import textwrap
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from children import progress

import jaxres as jr
from jaxres._tracking import orbax_io

ROOT = Path(__file__).resolve().parents[1]


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


_UNCLOSED = textwrap.dedent(
  """
  import sys
  import jax.numpy as jnp, numpy as np
  import jaxres as jr

  def graph():
    root = jr.AutoTrackable()
    root.table = jr.MutableHashTable(np.int64, np.float32, default_value=0.0, initial_capacity=64)
    root.step = jnp.array(0)
    return root

  def train(manager, root):
    for step in range(4):
      root.table.insert(np.arange(10 * step, 10 * step + 10), np.full(10, step + 0.5, np.float32))
      root.step = jnp.array(step)
      manager.save(step)

  kept = graph()  # a manager still referenced at exit
  manager = jr.CheckpointManager(sys.argv[1] + "/kept", jr.Checkpoint(model=kept), max_to_keep=2)
  train(manager, kept)

  def dropped():  # a manager dropped with its last (incremental) save in flight
    root = graph()
    train(jr.CheckpointManager(sys.argv[1] + "/dropped", jr.Checkpoint(model=root), incremental=True), root)

  dropped()
  """
)


def test_unclosed_managers_commit_their_saves_quietly_at_exit(tmp_path):
  """Before: each exit printed tracebacks of Orbax's background commit, and the last step was lost."""
  result = subprocess.run(
    [sys.executable, "-c", _UNCLOSED, str(tmp_path)], cwd=ROOT, capture_output=True, text=True
  )
  assert result.returncode == 0, result.stderr
  assert "Traceback" not in result.stderr and "ERROR" not in result.stderr, result.stderr
  assert not [p.name for p in tmp_path.rglob("*") if "tmp" in p.name]  # no uncommitted step is left
  for name, steps in (("kept", [2, 3]), ("dropped", [0, 1, 2, 3])):
    root = jr.AutoTrackable()
    root.table = jr.MutableHashTable(np.int64, np.float32, default_value=0.0)
    root.step = jnp.array(-1)
    manager = jr.CheckpointManager(tmp_path / name, jr.Checkpoint(model=root))
    assert manager.all_steps() == steps  # pruned to max_to_keep at exit, as close() does
    manager.restore(3).assert_consumed()
    manager.close()
    keys, values = root.table.export()
    assert int(root.step) == 3
    assert dict(zip(keys.tolist(), values.tolist())) == {k: k // 10 + 0.5 for k in range(40)}


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


_TRAINER = textwrap.dedent(
  """
  import sys
  import jax.numpy as jnp, numpy as np
  import jaxres as jr

  root = jr.AutoTrackable()
  root.table = jr.MutableHashTable(np.int64, np.float32, default_value=-1.0, initial_capacity=64)
  manager = jr.CheckpointManager(sys.argv[1], jr.Checkpoint(model=root), max_to_keep=2)
  for step in range(int(sys.argv[2])):
    root.step = jnp.array(step)
    root.table.insert(np.arange(32), np.full(32, step, np.float32))
    manager.save(step)
    manager.wait_until_finished()  # committed, and the steps below the two newest pruned
    print("saved", step, flush=True)
  manager.close()
  """
)


def test_a_reading_manager_sees_the_steps_another_process_saves_and_prunes(tmp_path):
  """Before: a manager made when steps [0, 1] existed kept that list: latest_step() stayed 1 while a
  trainer in another process saved 2.., restore(5) said 5 was not saved, and restore() read the pruned
  step 1 as "corrupted"."""
  steps = 12
  root = jr.AutoTrackable()
  root.table = jr.MutableHashTable(np.int64, np.float32, default_value=-1.0, initial_capacity=64)
  root.step = jnp.array(-1)
  reader, restored = None, []
  command = [sys.executable, "-c", _TRAINER, str(tmp_path), str(steps)]
  with subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, text=True) as trainer:
    for _, saved in progress(trainer.stdout):
      if saved < 1:
        continue
      if reader is None:  # made when steps [0, 1] exist
        reader = jr.CheckpointManager(tmp_path, jr.Checkpoint(model=root))
      assert reader.latest_step() >= saved  # committed before the trainer said so; steps only go up
      reader.restore()  # the latest, or a newer one where the trainer prunes it meanwhile
      step = int(root.step)
      assert step >= saved
      _, values = root.table.export()
      assert values.tolist() == [float(step)] * 32, "the arrays of the step the manifest names"
      restored.append(step)
  assert trainer.returncode == 0
  assert reader.all_steps() == [steps - 2, steps - 1]
  reader.restore(steps - 1).assert_consumed()
  assert int(root.step) == steps - 1 and len(restored) == steps - 1
  with pytest.raises(ValueError, match=r"step: 3 is not among the saved steps \[10, 11\]"):
    reader.restore(3)
  reader.close()
  assert reader.all_steps() == [steps - 2, steps - 1], "a reader deletes nothing"


@pytest.mark.parametrize("asked", [None, 1])
def test_a_step_pruned_while_a_reader_reads_it(tmp_path, monkeypatch, asked):
  """The writer prunes the step a reader listed before the reader opens it: the latest is read again,
  and a step asked for by number is said to be deleted (never "corrupted")."""
  root = jr.AutoTrackable()
  root.step = jnp.array(0)
  writer = jr.CheckpointManager(tmp_path, jr.Checkpoint(model=root), max_to_keep=2)
  for step in (0, 1):
    root.step = jnp.array(step)
    writer.save(step)
  writer.wait_until_finished()
  copy = jr.AutoTrackable()
  copy.step = jnp.array(-1)
  reader = jr.CheckpointManager(tmp_path, jr.Checkpoint(model=copy))
  load = orbax_io.StepStore.load

  def load_after_the_writer_prunes(store, step, check):
    if writer.latest_step() == 1:
      for later in (2, 3):
        root.step = jnp.array(later)
        writer.save(later)
      writer.wait_until_finished()  # steps 0 and 1 deleted
    return load(store, step, check)

  monkeypatch.setattr(orbax_io.StepStore, "load", load_after_the_writer_prunes)
  if asked is None:
    reader.restore().assert_consumed()
    assert int(copy.step) == 3
  else:
    with pytest.raises(ValueError, match=r"step: 1 was deleted by another manager .* now \[2, 3\]"):
      reader.restore(asked)
    assert int(copy.step) == -1
  reader.close()
  writer.close()


def test_a_pruning_killed_after_its_rename_leaves_no_half_deleted_step(tmp_path, monkeypatch):
  """Before: a step was removed file by file where it stood, so a trainer killed meanwhile left a step
  listed as complete with files missing ("corrupted"). Now the step leaves the listing in one rename
  and only then is removed; the next pruning removes what a killed one left."""
  root = jr.AutoTrackable()
  root.table = jr.MutableHashTable(np.int64, np.float32, default_value=-1.0)
  root.table.insert(np.arange(100), np.ones(100, np.float32))
  killed = jr.CheckpointManager(tmp_path, jr.Checkpoint(model=root), max_to_keep=1)
  monkeypatch.setattr(orbax_io.shutil, "rmtree", lambda *args, **kwargs: None)  # killed before it ran
  killed.save(0)
  killed.save(1)
  killed.wait_until_finished()  # prunes step 0: renamed into the trash, never removed
  trash = tmp_path / orbax_io.TRASH
  assert sorted(p.name for p in tmp_path.iterdir() if p.name != orbax_io.TRASH) == ["1"]
  assert sorted(p.name for p in trash.iterdir()) == ["0"] and any((trash / "0").rglob("*"))
  monkeypatch.undo()
  reader = jr.CheckpointManager(tmp_path, jr.Checkpoint(model=root))
  assert reader.all_steps() == [1]
  reader.restore().assert_consumed()
  restarted = jr.CheckpointManager(tmp_path, jr.Checkpoint(model=root), max_to_keep=1)
  restarted.save(2)
  restarted.wait_until_finished()  # prunes step 1, and the trash with it
  assert sorted(p.name for p in tmp_path.iterdir()) == ["2"]
  for manager in (killed, reader, restarted):
    manager.close()


def test_a_writer_removes_the_unfinished_saves_a_killed_writer_left(tmp_path):
  """Before: a save that never committed (a full disk, a killed trainer) left its Orbax temporary
  directory through later saves, pruning and new managers."""
  left = tmp_path / f"7{orbax_io.TEMPORARY_SUFFIX}-1700000000"
  (left / "arrays").mkdir(parents=True)
  root = jr.AutoTrackable()
  root.step = jnp.array(0)
  reader = jr.CheckpointManager(tmp_path, jr.Checkpoint(model=root))
  assert reader.all_steps() == [] and left.exists(), "a reader removes nothing"
  writer = jr.CheckpointManager(tmp_path, jr.Checkpoint(model=root))
  writer.save(8)
  writer.close()
  assert sorted(p.name for p in tmp_path.iterdir()) == ["8"]
  reader.close()
