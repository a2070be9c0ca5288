"""What changed since a version (``Table.changes``): a delta that, applied to the entries at the mark, gives
exactly the entries now, slot by slot (keys, values, scores), whatever the calls in between.

A state machine drives random calls of every kind that changes a table (inserts that fill and evict,
find_or_insert and its rows, insert_or_apply, assign, write_rows, assign_scores, remove, erase_if); at
every step it marks the version and keeps the entries by slot. The invariant composes the entries of
each of the last marks with ``changes(mark)`` (drop the slots no longer live, overwrite the changed
ones) and compares with ``live_entries()``.
"""

import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import jaxres as jr
from jaxres._core.storages.lean import LeanTable

BATCH = 6
# erase_if's predicate is a static argument of its jitted call: one function a threshold, made once, so that
# a machine's steps reuse its program rather than tracing it again for a fresh lambda each time.
BELOW = {t: (lambda keys, values, scores, t=t: values < t) for t in range(-9, 10)}
POOL = (np.arange(40, dtype=np.int64) * 7919 + 2**40) * np.array([1, -1] * 20)  # 64-bit keys, exact


def _by_slot(entries) -> dict:
  """``{slot: (key, value, score)}`` of a table's :class:`LiveEntries` (or changed entries)."""
  scores = entries.scores if entries.scores is not None else np.zeros(len(entries.keys), np.uint32)
  return {
    int(slot): (int(key), float(value), int(score))
    for slot, key, value, score in zip(entries.slots, entries.keys, entries.leaves[0], scores)
  }


def _compose(marked: dict, changes) -> dict:
  """The entries at the mark with a delta applied: what a restore of a chain does."""
  kept = {slot: entry for slot, entry in marked.items() if changes.live[slot]}
  return kept | _by_slot(changes.entries)


def machine_for(eviction, capacity, value=jnp.float32, storage=jr.OpenAddressingTable):
  class ChangesMachine(RuleBasedStateMachine):
    def __init__(self):
      super().__init__()
      self.table = storage.create(capacity, key=jnp.int64, value=value, default=-1, eviction=eviction)
      self.marks = []

    def _batch(self, picks, seed):
      rng = np.random.default_rng(seed)
      keys = POOL[np.asarray(picks)]
      scores = rng.integers(0, 50, len(picks)).astype(np.uint32) if eviction == jr.CustomScore() else None
      return keys, rng.integers(-9, 9, len(picks)).astype(value), scores

    batches = st.lists(st.integers(0, len(POOL) - 1), min_size=BATCH, max_size=BATCH)
    seeds = st.integers(0, 2**16)

    @rule(picks=batches, seed=seeds)
    def insert(self, picks, seed):
      keys, values, scores = self._batch(picks, seed)
      self.table = self.table.insert(keys, values, scores=scores)

    @rule(picks=batches, seed=seeds)
    def find_or_insert(self, picks, seed):
      keys, values, scores = self._batch(picks, seed)
      self.table, _ = self.table.find_or_insert(keys, values, scores=scores)

    @rule(picks=batches, seed=seeds)
    def rows_written(self, picks, seed):
      keys, values, scores = self._batch(picks, seed)
      self.table, handles = self.table.find_or_insert_rows(keys, scores=scores)
      self.table = self.table.write_rows(handles.index, values)

    @rule(picks=batches, seed=seeds)
    def insert_or_apply(self, picks, seed):
      keys, values, scores = self._batch(picks, seed)
      self.table = self.table.insert_or_apply(keys, values, jnp.add, scores=scores)

    @rule(picks=batches, seed=seeds)
    def assign(self, picks, seed):
      keys, values, _ = self._batch(picks, seed)
      self.table = self.table.assign(keys, values)

    @rule(picks=batches, seed=seeds)
    def assign_scores(self, picks, seed):
      if eviction is None:
        return
      keys, _, scores = self._batch(picks, seed)
      self.table = self.table.assign_scores(keys, scores=scores)

    @rule(picks=batches)
    def remove(self, picks):
      self.table = self.table.remove(POOL[np.asarray(picks)])

    @rule(shrink=st.booleans())
    def resize(self, shrink):  # the entries move within the same slot layout (15 or 16 entries)
      if storage is jr.OpenAddressingTable and eviction is None and capacity == 16 and self.table.size < 16:
        self.table = self.table.resize(capacity - 1 if shrink else capacity)
        assert self.table.slot_layout.tolist() == [1, 8, 4]

    @rule(threshold=st.integers(-9, 9))
    def erase_if(self, threshold):
      self.table = self.table.erase_if(BELOW[threshold])

    @invariant()
    def every_mark_composes_to_now(self):
      """Each of the last marks (one after every step) composes with its delta to the entries now."""
      now = _by_slot(self.table.live_entries())
      for version, marked in self.marks[-4:]:
        assert _compose(marked, self.table.changes(version)) == now
      self.marks.append((int(self.table.version), now))

  ChangesMachine.TestCase.settings = settings(
    max_examples=8, stateful_step_count=25, deadline=None, suppress_health_check=list(HealthCheck)
  )
  return ChangesMachine


TestChanges = machine_for(None, 16).TestCase  # 8 buckets of 4 int64 keys
TestChangesIntegers = machine_for(None, 16, jnp.int32).TestCase  # insert_or_apply(jnp.add) by one scatter
TestChangesFull = machine_for(None, 4).TestCase  # full: new keys are dropped
TestChangesLRU = machine_for(jr.LRU(), 8).TestCase  # full: new keys evict
TestChangesLFU = machine_for(jr.LFU(), 8).TestCase
TestChangesCustomScore = machine_for(jr.CustomScore(), 8).TestCase
# The lean storage evicting: a newcomer takes its victim's slot, stamped as changed.
TestLeanChangesLRU = machine_for(jr.LRU(), 8, storage=LeanTable).TestCase
TestLeanChangesLFU = machine_for(jr.LFU(), 8, storage=LeanTable).TestCase
TestLeanChangesCustomScore = machine_for(jr.CustomScore(), 8, storage=LeanTable).TestCase


def test_changes_fetch_only_what_changed():
  table = jr.OpenAddressingTable.create(1 << 12, key=jnp.int32, value=jnp.float32)
  table = table.insert(jnp.arange(1000), jnp.ones(1000))
  mark = int(table.version)
  table = table.insert(jnp.arange(2000, 2010), jnp.ones(10))
  changes = table.changes(mark)
  assert sorted(changes.entries.keys.tolist()) == list(range(2000, 2010))
  assert int(changes.live.sum()) == 1010 and changes.live.shape == (table.num_slots,)
  mark = int(table.version)
  assert table.changes(mark).entries.keys.shape == (0,)
  table = table.assign(jnp.arange(3), jnp.zeros(3))  # no score set: the clock stays, the version not
  assert int(table.clock) == 2 and sorted(table.changes(mark).entries.keys.tolist()) == [0, 1, 2]


def test_a_sorted_table_has_no_changes_to_give():
  table = jr.SortedTable.create(8, key=jnp.int32, value=jnp.float32)
  assert table.insert(jnp.arange(3), jnp.ones(3)).changes(0) is None
