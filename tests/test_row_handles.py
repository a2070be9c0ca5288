"""Row handles (find_rows, find_or_insert_rows, read_rows, write_rows) against a dict oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracle import STORAGES, Sharded

import jaxres as jr
from jaxres._core.kernels import grouping

KINDS = [*STORAGES, Sharded(jr.OpenAddressingTable, 4)]


def _create(kind, capacity):
  return kind.create(capacity, key=jnp.int64, value=jax.ShapeDtypeStruct((2,), jnp.float32), default=-1.0)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
def test_random_batches_match_a_dict(kind):
  """find_or_insert_rows, then a write of the new keys' values and a read: a dict's find_or_insert."""
  rng = np.random.default_rng(7)
  capacity = 24 if kind in STORAGES else 64  # a sharded table's shards each hold `capacity`: no drops
  table, model, dropped = _create(kind, capacity), {}, 0
  for step in range(12):
    keys = rng.integers(-20, 20, 10) * (2**35 + 3)  # 64-bit keys, exact with x64 off
    table, handles = table.find_or_insert_rows(keys)
    values = np.stack([keys % 97, np.full(10, step)], axis=1).astype(np.float32)
    table = table.write_rows(handles.index, values, valid=handles.inserted)
    got = np.asarray(table.read_rows(handles.index))
    expected, lost = [], set()
    for key, row, found, inserted in zip(keys.tolist(), values, handles.found, handles.inserted):
      assert bool(found) == (key in model and not inserted)
      if key not in model and len(model) < capacity:
        model[key] = row
        assert inserted
      if key not in model:
        lost.add(key)
      expected.append(model.get(key, np.full(2, -1.0, np.float32)))
    dropped += len(lost)
    np.testing.assert_array_equal(got, np.stack(expected))
    assert int(table.dropped) == dropped and int(table.size) == len(model)
    rows = np.asarray(table.find_rows(keys))
    assert ((rows >= 0) == np.array([k in model for k in keys.tolist()])).all()


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
def test_write_rows_last_duplicate_wins_and_skips_missing_rows(kind):
  table = _create(kind, 8).insert(np.array([3, 4]), np.zeros((2, 2), np.float32))
  rows = table.find_rows(np.array([3, 3, 9, 4]))
  assert int(rows[2]) == -1 and int(rows[0]) == int(rows[1])
  table = table.write_rows(
    rows, np.arange(8.0, dtype=np.float32).reshape(4, 2), valid=np.array([1, 1, 1, 0], bool)
  )
  assert table.find(np.array([3, 4])).tolist() == [[2.0, 3.0], [0.0, 0.0]]
  assert table.read_rows(jnp.array([-1]), default=5.0).tolist() == [[5.0, 5.0]]


def test_jit_and_eviction_report():
  table = jr.OpenAddressingTable.create(4, key=jnp.int32, value=jnp.float32, eviction=jr.LRU())
  table = table.insert(jnp.arange(4), jnp.arange(4.0))
  claim = jax.jit(lambda t, k: t.find_or_insert_rows(k))
  table, handles = claim(table, jnp.array([1, 2, 3, 10]))  # 0 is the least recent: 10 replaces it
  assert handles.found.tolist() == [True, True, True, False] and handles.inserted.tolist()[3]
  assert handles.evicted.valid.tolist() == [False, False, False, True]
  assert int(handles.evicted.keys[3]) == 0 and float(handles.evicted.values[3]) == 0.0
  assert int(handles.index[3]) >= 0 and not table.contains(jnp.array([0])).item()


def test_empty_batches_and_bad_rows():
  table = _create(jr.OpenAddressingTable, 8)
  same, handles = table.find_or_insert_rows(np.zeros(0, np.int64))
  assert same is table and handles.index.shape == (0,)
  assert table.write_rows(jnp.zeros(0, jnp.int32), np.zeros((0, 2), np.float32)) is table
  with pytest.raises(TypeError, match="index"):
    table.read_rows(jnp.array([0.5]))
  with pytest.raises(ValueError, match="values"):
    table.write_rows(jnp.array([0, 1]), np.zeros((3, 2), np.float32))


def test_donated_calls_reuse_the_table():
  table = _create(jr.OpenAddressingTable, 64)
  new, handles = table.find_or_insert_rows(np.arange(5), donate=True)
  assert all(x.is_deleted() for x in jax.tree.leaves(table))
  kept = new.write_rows(handles.index, np.ones((5, 2), np.float32))  # not donated: `new` stays
  assert not any(x.is_deleted() for x in jax.tree.leaves(new))
  assert (
    kept.find(np.arange(5)).sum() == 10.0 and new.find(np.arange(5)).sum() == 0.0
  )  # unwritten rows: zeros


def test_group_sums_depend_on_each_group_alone():
  """A group's sum has the same bits whatever number names the group (a table's row numbering)."""
  rng = np.random.default_rng(0)
  x = jnp.asarray((rng.normal(size=(64, 3)) * 10.0 ** rng.integers(-3, 4, (64, 1))).astype(np.float32))
  groups = rng.integers(0, 6, 64)
  names = np.array([50, 3, 17, 9, 1, 33])
  first_groups, first = grouping.group_sums(jnp.asarray(groups), x)
  renamed_groups, renamed = grouping.group_sums(jnp.asarray(names[groups]), x)
  assert first_groups.tolist() == list(range(6)) + [-1] * 58
  assert renamed_groups.tolist() == sorted(names.tolist()) + [-1] * 58
  by_name = {int(g): np.asarray(row) for g, row in zip(renamed_groups[:6], renamed[:6])}
  for g in range(6):
    assert by_name[int(names[g])].tobytes() == np.asarray(first[g]).tobytes()
    np.testing.assert_allclose(first[g], x[groups == g].sum(0), rtol=1e-5)
  assert not np.asarray(first[6:]).any()
