"""Hypothesis drives random operation sequences against the dict oracle, with the CPU kernels and
on their XLA references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from oracle import (
  BATCH,
  CAPACITY,
  KINDS,
  STORAGES,
  DictTable,
  Sharded,
  assert_matches,
  assert_rows_equal,
  table_rows,
)

import jaxres as jr
from jaxres._core.kernels import native

CAPACITIES = (6, CAPACITY)  # the second, and the batches, shared with test_table's programs


def _add(old, new):  # many folds of one key stay in range (test_table folds an order-sensitive function)
  return jax.tree.map(jnp.add, old, new)


def _add_rows(old, new):
  return tuple(a + b for a, b in zip(old, new))


def machine_for(storage, kind, capacities=CAPACITIES, max_examples=10, references=False):
  """The state machine of ``storage`` tables of ``kind``; ``references``: each run traces the XLA
  references of the CPU kernels alone (what a GPU or TPU runs)."""

  class TableMachine(RuleBasedStateMachine):
    def __init__(self):
      super().__init__()
      self.capacity = capacities[0]
      self.table = kind.create(storage, self.capacity)
      self.model = DictTable(kind, self.capacity)
      self.pool = kind.keys(np.random.default_rng(0), 10, pool=10)

    def _batch(self, picks, seed):
      keys = self.pool[np.asarray(picks)]
      return keys, kind.values(np.random.default_rng(seed), BATCH)

    batches = st.lists(st.integers(0, 9), min_size=BATCH, max_size=BATCH)
    seeds = st.integers(0, 2**16)

    @rule(picks=batches, seed=seeds)
    def insert(self, picks, seed):
      keys, values = self._batch(picks, seed)
      self.table = self.table.insert(keys, values)
      self.model.insert(keys, values)

    @rule(picks=batches, seed=seeds)
    def find_or_insert(self, picks, seed):
      keys, values = self._batch(picks, seed)
      self.table, got = self.table.find_or_insert(keys, values)
      assert_rows_equal(table_rows(got, BATCH), self.model.find_or_insert(keys, values))

    @rule(picks=batches, seed=seeds)
    def insert_or_apply(self, picks, seed):
      keys, values = self._batch(picks, seed)
      self.table = self.table.insert_or_apply(keys, values, _add)
      self.model.insert_or_apply(keys, values, _add_rows)

    @rule(picks=batches)
    def remove(self, picks):
      keys, _ = self._batch(picks, 0)
      self.table = self.table.remove(keys)
      self.model.remove(keys)

    @rule(picks=batches)
    def find(self, picks):
      keys, _ = self._batch(picks, 0)
      values, found = self.table.lookup(keys)
      assert_rows_equal(table_rows(values, BATCH), self.model.find(keys))
      np.testing.assert_array_equal(found, self.model.contains(keys))

    @rule(mask_seed=seeds)
    def reimport_export(self, mask_seed):
      keys, values, valid = self.table.export()
      keep = np.asarray(valid) & (np.random.default_rng(mask_seed).random(valid.shape[0]) < 0.8)
      self.table = self.table.import_(keys, values, keep)
      self.model.import_(keys, values, keep)

    @rule()
    def resize(self):
      capacity = capacities[1] if self.capacity == capacities[0] else capacities[0]
      if len(self.model.data) > capacity:
        with pytest.raises(ValueError, match="capacity"):
          self.table.resize(capacity)
        return
      self.table, self.capacity = self.table.resize(capacity), capacity
      self.model.capacity, self.model.dropped = capacity, 0

    @invariant()
    def matches_model(self):
      assert_matches(self.table, self.model)

  TableMachine.TestCase.settings = settings(
    max_examples=max_examples, stateful_step_count=25, deadline=None, suppress_health_check=list(HealthCheck)
  )
  if references:  # the whole test case on the references

    class OnReferences(TableMachine.TestCase):
      @classmethod
      def setUpClass(cls):
        cls._tracing = native.references()
        cls._tracing.__enter__()

      @classmethod
      def tearDownClass(cls):
        cls._tracing.__exit__(None, None, None)

    TableMachine.TestCase = OnReferences
  return TableMachine


_KINDS = {k.name: k for k in KINDS}
for _storage in STORAGES:
  for _kind in ("int64", "pair_int32", "uint64"):
    for _references in (False, True):
      _name = f"Test{_storage.__name__}_{_kind}" + ("_references" * _references)
      globals()[_name] = machine_for(_storage, _KINDS[_kind], references=_references).TestCase

# Sharded over 8 devices; the capacities exceed the 10 keys drawn, so no shard fills.
TestShardedOpenAddressingTable_int64 = pytest.mark.slow(
  machine_for(Sharded(jr.OpenAddressingTable), _KINDS["int64"], capacities=(12, 16), max_examples=3).TestCase
)
TestShardedOpenAddressingTable_int64_references = pytest.mark.slow(
  machine_for(
    Sharded(jr.OpenAddressingTable), _KINDS["int64"], capacities=(12, 16), max_examples=3, references=True
  ).TestCase
)
