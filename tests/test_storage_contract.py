"""The storage contract, held by every storage kind the registry names (a new kind runs it by registering).

A storage declares its value rows (``num_rows``, static): its value arrays have that many rows,
every row handle a call returns lies below it, and a write that is dropped (an invalid or masked
row, a ``-1`` handle, a new key of a full table) changes no row. Checked against a dict on tables of
the oracle suites' shapes (``CAPACITY`` entries, batches of ``BATCH`` int32 keys), so the programs
are few and shared with them.
"""

import re

import jax.numpy as jnp
import numpy as np
import pytest
from oracle import BATCH, CAPACITY, same_bits

import jaxres as jr
from jaxres._core.storages import registry

KINDS = list(registry.STORAGES)
DEFAULT_VALUE = -1.0


def _create(name: str):
  return registry.storage(name).create(CAPACITY, key=jnp.int32, value=jnp.float32, default=DEFAULT_VALUE)


def _contents(table) -> dict:
  keys, values, valid = (np.asarray(x) for x in table.export())
  return dict(zip(keys[valid].tolist(), values[valid].tolist(), strict=True))


def _values(table) -> list:
  return [np.asarray(x) for x in table.values]


def _assert_rows_unchanged(before, after):
  for a, b in zip(_values(before), _values(after), strict=True):
    same_bits(a, b)


def test_the_registry_names_the_storages_and_the_default():
  assert registry.DEFAULT in registry.STORAGES and registry.READ_ONLY in registry.STORAGES
  assert registry.default() is registry.storage(registry.DEFAULT)
  assert registry.storage("open_addressing") is jr.OpenAddressingTable
  assert registry.storage("sorted") is jr.SortedTable
  for name, table in registry.STORAGES.items():
    assert issubclass(table, registry.Storage) and issubclass(table, jr.Table), name
  # The default storage serves tables that evict (embeddings, admission counts).
  evicting = registry.default().create(4, key=jnp.int32, value=jnp.float32, eviction=jr.LRU())
  assert evicting.eviction is not None


def test_an_unknown_name_is_a_value_error_naming_the_argument():
  known = re.escape(str(sorted(registry.STORAGES)))  # every registered kind, by name
  with pytest.raises(ValueError, match=rf"^storage: expected one of {known}, got 'btree'\.$"):
    registry.storage("btree")
  with pytest.raises(ValueError, match=r"^kind: expected one of .*, got 'btree'\.$"):
    registry.storage("btree", argument="kind")
  with pytest.raises(ValueError, match=rf"^storage: expected one of {known}, got 'btree'\.$"):
    jr.MutableHashTable(np.int32, np.float32, 0.0, storage="btree")


@pytest.mark.parametrize("name", KINDS)
def test_rows_lie_below_num_rows_and_dropped_writes_change_nothing(name):
  table = _create(name)
  num_rows = table.num_rows
  assert isinstance(num_rows, int) and num_rows >= table.capacity
  assert all(x.shape[0] == num_rows for x in table.values)
  rng = np.random.default_rng(KINDS.index(name))
  model: dict[int, float] = {}
  for step in range(4):
    # 20 distinct keys for 10 entries: the table fills, then drops new keys.
    keys = rng.integers(0, 20, BATCH).astype(np.int32)
    values = (rng.integers(-100, 100, BATCH) / 4).astype(np.float32)
    valid = rng.random(BATCH) < 0.75
    table, handles = table.find_or_insert_rows(keys, valid=valid)
    index, inserted = np.asarray(handles.index), np.asarray(handles.inserted)
    assert ((index >= -1) & (index < num_rows)).all(), (step, index)
    table = table.write_rows(handles.index, values, valid=handles.inserted)
    new = set()
    for key, ok in zip(keys.tolist(), valid.tolist(), strict=True):
      if ok and key not in model and len(model) + len(new) < CAPACITY:
        new.add(key)  # the first valid row of a new key inserts it
    for key, value, ok in zip(keys.tolist(), values.tolist(), valid.tolist(), strict=True):
      if ok and key in new:
        model[key] = value  # every row of the key writes its row: the last wins
    assert _contents(table) == model, step
    # Every key's row: -1 where absent, distinct rows below num_rows for distinct live keys.
    rows = np.asarray(table.find_rows(np.arange(20, dtype=np.int32)))
    live = np.isin(np.arange(20), list(model))
    assert (rows[~live] == -1).all() and ((rows[live] >= 0) & (rows[live] < num_rows)).all(), rows
    assert len(set(rows[live].tolist())) == live.sum()
    assert np.asarray(table.read_rows(jnp.asarray(rows))).tolist() == [
      model.get(k, DEFAULT_VALUE) for k in range(20)
    ]
    assert inserted.sum() <= CAPACITY

  # Dropped writes: masked rows and -1 handles, masked inserts, new keys of a full table.
  assert len(model) == CAPACITY, "the draws above fill the table"
  new = np.array([k for k in range(20) if k not in model][:BATCH], np.int32)
  everything = np.full(BATCH, 99.0, np.float32)
  for dropped in (
    table.write_rows(np.full(BATCH, -1, np.int32), everything),
    table.write_rows(np.asarray(rows[:BATCH]), everything, valid=np.zeros(BATCH, bool)),
    table.insert(new, everything, valid=np.zeros(BATCH, bool)),
    table.insert(new, everything),
    table.insert_or_apply(new, everything, jnp.add),
    table.find_or_insert_rows(new)[0],
  ):
    assert _contents(dropped) == model
    _assert_rows_unchanged(table, dropped)
  assert int(table.insert(new, everything).dropped) == int(table.dropped) + len(new)


@pytest.mark.parametrize("name", KINDS)
def test_saved_slots_name_the_storage_kind_that_placed_them(name):
  table = _create(name)
  assert table.slot_kind == (None if table.slot_layout is None else name)


@pytest.mark.parametrize("name", KINDS)
def test_check_slots_takes_distinct_slots_of_distinct_keys(name):
  table = _create(name)
  table = table.insert(np.arange(CAPACITY, dtype=np.int32), np.zeros(CAPACITY, np.float32))
  entries = table.live_entries()
  words = np.asarray(table.key_spec.encode(entries.keys, "keys")[0]).reshape(CAPACITY, -1)
  slots = np.arange(CAPACITY) if entries.slots is None else entries.slots
  table.check_slots(words, slots)  # a table's own entries pass
  for bad_words, bad_slots in (
    (words, np.zeros(CAPACITY, np.int64)),  # repeated slots
    (words, np.full(CAPACITY, table.num_slots)),  # out of range
    (np.zeros_like(words), slots),  # repeated keys
    (words, slots[:-1]),  # a slot missing
  ):
    with pytest.raises(ValueError, match=r"^slots: "):
      table.check_slots(bad_words, bad_slots)
