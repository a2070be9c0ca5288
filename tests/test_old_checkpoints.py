"""Checkpoints written by an earlier jaxres restore unchanged.

``tests/data/written_by_182ee53`` was written by commit 182ee53 (before the core's
modules moved into sub-packages, so its manifests name the old module paths) with
:func:`build` and the updates of ``write`` below: a ``jr.Checkpoint`` (``ckpt``), a
``jr.CheckpointManager`` step (``steps/1``), and the embedding's rows after the
updates (``rows.npy``).
"""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxres as jr
from tests import old_layout

DATA = Path(__file__).parent / "data" / "written_by_182ee53"


class Model(nnx.Module):
  def __init__(self):
    self.emb = jr.DynamicEmbedding(256, 4, optimizer=optax.adam(1e-2), rngs=nnx.Rngs(0), min_count=1)


def build() -> jr.AutoTrackable:
  root = jr.AutoTrackable()
  root.table = jr.MutableHashTable(np.int64, np.float32, default_value=0.0)
  root.strings = jr.MutableHashTable(str, np.int32, default_value=-1)
  root.functional = jr.OpenAddressingTable.create(64, key=jnp.int64, value=jnp.float32, eviction=jr.LRU())
  root.model = Model()
  return root


def write(root: jr.AutoTrackable, directory: str) -> None:
  """What wrote the data (run by 182ee53), and what writes the same graph today."""
  root.table.insert(np.array([1, 2**40], np.int64), np.array([1.5, 2.5], np.float32))
  root.strings.insert(["a", "bb"], np.array([1, 2], np.int32))
  root.functional = root.functional.insert(jr.keys.split64(np.arange(10, dtype=np.int64)), jnp.arange(10.0))
  root.model.emb(np.arange(20, dtype=np.int64))
  jr.Checkpoint(root=root).save(directory + "/ckpt")
  manager = jr.CheckpointManager(directory + "/steps", jr.Checkpoint(root=root))
  manager.save(1)
  manager.close()


def check(root: jr.AutoTrackable) -> None:
  assert root.table.find(np.array([1, 2**40, 3], np.int64)).tolist() == [1.5, 2.5, 0.0]
  assert root.strings.find(["a", "bb", "c"]).tolist() == [1, 2, -1]
  keys = jr.keys.split64(np.arange(12, dtype=np.int64))
  assert root.functional.find(keys).tolist() == [*range(10), 0, 0]
  root.model.eval()
  rows = np.asarray(root.model.emb(np.arange(20, dtype=np.int64)))
  assert np.array_equal(rows, np.load(DATA / "rows.npy"))


def test_a_checkpoint_from_before_the_core_moved_restores():
  root = build()
  jr.Checkpoint(root=root).restore(str(DATA / "ckpt")).assert_consumed()
  check(root)


def test_a_manager_step_from_before_the_core_moved_restores():
  root = build()
  manager = jr.CheckpointManager(str(DATA / "steps"), jr.Checkpoint(root=root))
  manager.restore(1).assert_consumed()
  manager.close()
  check(root)


def test_the_same_graph_written_today_restores_to_the_same_rows(tmp_path):
  write(build(), str(tmp_path))
  root = build()
  jr.Checkpoint(root=root).restore(str(tmp_path / "ckpt")).assert_consumed()
  check(root)


# Checkpoints of the bucket layout before the slot became the row (written by 1711f00 with
# tests/old_layout.py): every table restores exactly, onto 1, 2 and 4 devices.
LAYOUT = Path(__file__).parent / "data" / "written_by_1711f00"


def _expected(name: str) -> dict:
  with open(LAYOUT / f"entries-{name}.json", encoding="utf-8") as f:
    return json.load(f)


def _unordered(entries: dict) -> dict:
  """``entries`` with each stateful table's and embedding's (keys, values) as sorted pairs: a table of
  another storage kind holds the same entries in another order."""
  pairs = lambda keys, values: sorted(map(list, zip(keys, values, strict=True)))
  tables = [name for name in entries if name in ("table", "emb") or name.startswith("collection/")]
  return entries | {name: pairs(*entries[name]) for name in tables}


# Onto open addressing they go back to their slots; onto the lean layout they are inserted anew.
@pytest.mark.parametrize("storage", ["open_addressing", "lean"])
@pytest.mark.parametrize("devices", [1, 2, 4])
def test_a_checkpoint_of_the_bucket_layout_restores_exactly(devices, storage):
  root = old_layout.build(devices, storage)
  jr.Checkpoint(root=root).restore(str(LAYOUT / "ckpt")).assert_consumed()
  expected = _expected("ckpt")
  if storage == "open_addressing":  # in the order of the slots they were saved from
    assert old_layout.entries(root) == expected
  assert _unordered(old_layout.entries(root)) == _unordered(expected)


@pytest.mark.parametrize("storage", ["open_addressing", "lean"])
@pytest.mark.parametrize("step", [1, 2])
def test_full_and_incremental_steps_of_the_bucket_layout_restore_exactly(step, storage):
  root = old_layout.build(2, storage)
  manager = jr.CheckpointManager(str(LAYOUT / "steps"), jr.Checkpoint(root=root), incremental=True)
  manager.restore(step).assert_consumed()
  manager.close()
  expected = _expected(str(step))
  if storage == "open_addressing":
    assert old_layout.entries(root) == expected
  assert _unordered(old_layout.entries(root)) == _unordered(expected)


def test_admission_counts_of_the_bucket_layout_restore_as_todays_counts():
  """The checkpoint's counts are int32 in an open-addressing table; today's are one byte, stopping at
  ``min_count``, in a lean one: restored, they equal the counts of the same steps replayed."""
  root = old_layout.build(1)
  jr.Checkpoint(root=root).restore(str(LAYOUT / "ckpt")).assert_consumed()
  replayed = old_layout.build(1)
  for batch in range(3):
    old_layout._step(replayed.model, batch)  # what wrote the checkpoint, after its three steps

  def counts(model) -> dict:
    keys, values, valid = jax.device_get(model.emb.counts.get_value().export())
    return dict(zip(np.asarray(keys)[valid].tolist(), np.asarray(values)[valid].tolist()))

  restored = counts(root.model)
  assert restored == counts(replayed.model) and restored and set(restored.values()) == {1}
