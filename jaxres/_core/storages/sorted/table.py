"""A sorted array of keys searched by vectorised binary search.

Keys are kept in ascending order of their words (which is ascending key order,
see :mod:`key_specs`) in the prefix ``[0, count)`` of ``capacity`` rows. Removal
clears a ``live`` flag and leaves the key in place as a tombstone, so finds,
updates, removals and re-insertions of removed keys are all
O(batch x log capacity). Only keys that were never present need the array to
make room: they are merged in with one sort of ``capacity + batch`` rows,
which also drops the tombstones. That is the price of a compact, read-mostly
layout; use :class:`OpenAddressingTable` when new keys arrive every step.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxres._core.encoding import key_specs
from jaxres._core.encoding.value_specs import ValueSpec
from jaxres._core.kernels import claims, grouping, native
from jaxres._core.kernels.row_ops import select_rows, take_rows
from jaxres._core.modes import Upsert
from jaxres._core.policies import check_policy
from jaxres._core.pytrees import pytree_dataclass, static_field
from jaxres._core.storages.storage import Storage, empty_fields
from jaxres._core.table import Table, check_capacity


def _less(a: jax.Array, b: jax.Array) -> jax.Array:
  """Lexicographic ``a < b`` over the last axis of uint32 word rows."""
  less = jnp.zeros(a.shape[:-1], bool)
  equal = jnp.ones(a.shape[:-1], bool)
  for j in range(a.shape[-1]):
    less = less | (equal & (a[..., j] < b[..., j]))
    equal = equal & (a[..., j] == b[..., j])
  return less


@pytree_dataclass
class SortedTable(Storage):
  """A compact table of sorted keys for read-mostly workloads.

  Same methods and results as :class:`OpenAddressingTable` (see
  :class:`Table`); lookups cost O(log capacity) per key, storage is exactly
  ``capacity`` rows, and :meth:`export` returns entries in key order.

  Examples:
    >>> import jax.numpy as jnp, jaxres as jr
    >>> t = jr.SortedTable.create(capacity=4096, key=jnp.int32, value=jnp.float32, default=-1.0)
    >>> t = t.insert(jnp.array([30, 10, 20]), jnp.array([3.0, 1.0, 2.0]))
    >>> keys, values, valid = t.export()
    >>> keys[valid].tolist(), values[valid].tolist()
    ([10, 20, 30], [1.0, 2.0, 3.0])
  """

  BATCH_WRITES = False  # a write merges the sorted arrays: O(capacity)

  keys: jax.Array  # uint32[capacity, num_words], sorted on [0, count)
  live: jax.Array  # bool[capacity]: False for tombstones and unused rows
  count: jax.Array  # shape=(), dtype=int32: sorted rows in use, tombstones included
  values: tuple  # leaves [num_rows, *storage_shape]
  default: tuple  # leaves [*storage_shape]
  slot_scores: jax.Array  # uint32[0]: a sorted table does not evict
  row_stamps: jax.Array  # uint32[0]: entries move, a save writes them all
  version: jax.Array  # uint32: calls that changed the table so far (see Storage)
  size: jax.Array  # shape=(), dtype=int32
  dropped: jax.Array  # shape=(), dtype=int32
  clock: jax.Array  # shape=(), dtype=uint32
  evictions: jax.Array  # shape=(), dtype=int32: always 0
  capacity: int = static_field()
  key_spec: key_specs.KeySpec = static_field()
  value_spec: ValueSpec = static_field()
  eviction: None = static_field()

  @classmethod
  def create(cls, capacity: int, key, value, default=0, *, eviction=None) -> SortedTable:
    """An empty table holding up to ``capacity`` entries.

    Args:
      capacity: static number of live entries (>= 1).
      key: key dtype or ``jax.ShapeDtypeStruct`` (composite keys).
      value: a dtype, a ``jax.ShapeDtypeStruct``, or a pytree of them.
      default: value for missing keys; a matching pytree, scalars broadcast.
      eviction: must be ``None``: a sorted table cannot evict.

    Raises:
      ValueError: an eviction policy is given (use :class:`OpenAddressingTable`).
    """
    capacity = check_capacity(capacity)
    if check_policy(eviction) is not None:
      raise ValueError(
        f"eviction: a SortedTable cannot evict; use jr.OpenAddressingTable for eviction={eviction}."
      )
    key_spec, value_spec, default = cls._specs(key, value, default)
    return _empty(capacity, key_spec, value_spec, default)

  @property
  def num_slots(self) -> int:
    """Rows of the sorted arrays: a slot is its value row."""
    return self.capacity

  @property
  def num_rows(self) -> int:
    """Value rows: one per slot (a slot is its value row), ``capacity``."""
    return self.capacity

  def _with_capacity(self, capacity):
    return _empty(capacity, self.key_spec, self.value_spec, self.default)

  def _search(self, words):
    """``(present, position)``: lower bound of each key in ``[0, count)`` (a kernel on CPU)."""
    n = words.shape[0]
    results = (jax.ShapeDtypeStruct((n,), jnp.bool_), jax.ShapeDtypeStruct((n,), jnp.int32))
    reference = lambda keys, count, words: self._bisect(words)
    return native.on_cpu("jaxres_search", reference, results, self.keys, self.count, words)

  def _bisect(self, words):
    last = self.capacity - 1
    low = jnp.zeros(words.shape[0], jnp.int32)
    high = jnp.full(words.shape[0], self.count, jnp.int32)

    def halve(_, bounds):
      low, high = bounds
      mid = (low + high) // 2
      below = _less(self.keys[jnp.minimum(mid, last)], words)
      active = low < high
      return jnp.where(active & below, mid + 1, low), jnp.where(active & ~below, mid, high)

    low, _ = lax.fori_loop(0, self.capacity.bit_length(), halve, (low, high))
    present = (low < self.count) & jnp.all(self.keys[jnp.minimum(low, last)] == words, axis=-1)
    return present, low

  def _locate(self, words):
    present, position = self._search(words)
    return present & self.live[jnp.minimum(position, self.capacity - 1)], position

  def _place(self, groups, admitted, rows):
    """Stores the new keys of the ``admitted`` group heads (sorted rows) with value ``rows``."""
    present, position = self._search(groups.words)
    revive = admitted & present
    table = self._write(position, rows, revive)
    live = table.live.at[jnp.where(revive, position, self.capacity)].set(True, mode="drop")
    table = dataclasses.replace(table, live=live)
    fresh = admitted & ~present
    return lax.cond(jnp.any(fresh), _merge, lambda t, *_: t, table, groups.words, rows, fresh, position)

  def _upsert_rows(self, words, leaves, active, mode, given_scores=None, weights=None):
    del given_scores, weights  # no scores to give
    found, slot = self._locate(words)
    # Updating present keys needs no sorting; only new keys are merged in order.
    update = functools.partial(_update_existing, leaves=leaves, slot=slot, active=active, mode=mode)
    merge = functools.partial(_sorted_upsert, words=words, leaves=leaves, active=active, mode=mode)
    return (*lax.cond(jnp.all(found if active is None else found | ~active), update, merge, self), None)

  def _release(self, words, slot, mask):
    live = self.live.at[jnp.where(mask, slot, self.capacity)].set(False, mode="drop")
    return dataclasses.replace(self, live=live)

  def _slots(self):
    return self.keys, self.live


def _update_existing(table: SortedTable, leaves, slot, active, mode: Upsert) -> tuple[SortedTable, list]:
  """insert / find_or_insert when every active key is present: no grouping by sorting."""
  if not mode.keeps_present:
    active = jnp.ones(slot.shape, bool) if active is None else active
    return table._put_last(table._row_of(slot), leaves, active), []
  return table, take_rows(table.values, slot)


def _sorted_upsert(table: SortedTable, words, leaves, active, mode: Upsert) -> tuple[SortedTable, list]:
  """insert / find_or_insert with new keys: group the batch by sorting, admit in batch order.

  Exact in every case, including a batch that overflows the table (the new
  keys admitted are those a one-at-a-time loop would have inserted).
  """
  groups = grouping.group(words, active)
  rows = take_rows(leaves, groups.perm)
  found, slot = table._locate(groups.words)
  if not mode.keeps_present:
    rows = take_rows(rows, groups.end)
  heads = groups.head & groups.active
  new = heads & ~found
  rank = grouping.first_occurrence_rank(groups, new)
  admitted = new & (rank < table.capacity - table.size)
  num_admitted = jnp.sum(admitted, dtype=jnp.int32)

  out = []
  if mode.keeps_present:
    defaults = [jnp.broadcast_to(d, x.shape) for d, x in zip(table.default, rows)]
    out = select_rows(found, take_rows(table.values, slot), select_rows(admitted, rows, defaults))
    out = grouping.unsort(groups, take_rows(out, groups.start))
  else:
    table = table._write(slot, rows, heads & found)
  table = table._place(groups, admitted, rows)
  table = dataclasses.replace(
    table,
    size=table.size + num_admitted,
    dropped=table.dropped + jnp.sum(new, dtype=jnp.int32) - num_admitted,
  )
  return table, out


def _merge(table: SortedTable, words, rows, fresh, position):
  """Merges the ``fresh`` keys into the sorted prefix, dropping tombstones.

  ``words`` is in ascending key order (the batch was grouped by sorting) and
  ``position`` is each key's lower bound in the prefix, so every entry's new
  index follows from prefix sums: no sort of the table is needed, only one
  O(capacity) pass that moves the entries.
  """
  capacity = table.capacity
  index = jnp.arange(capacity, dtype=jnp.int32)
  dead = ~table.live & (index < table.count)
  dead_before = jnp.concatenate([jnp.zeros(1, jnp.int32), claims.prefix_sum(dead)])
  arrivals = (
    jnp.zeros(capacity + 1, jnp.int32).at[jnp.where(fresh, position, capacity + 1)].add(1, mode="drop")
  )
  fresh_up_to = claims.prefix_sum(arrivals)  # fresh keys placed before entry i, i included
  old_target = jnp.where(table.live, index - dead_before[:-1] + fresh_up_to[:-1], capacity)
  fresh_rank = claims.prefix_sum(fresh) - fresh
  new_target = jnp.where(fresh, position - dead_before[position] + fresh_rank, capacity)

  def moved(old, new):
    out = jnp.zeros_like(old).at[old_target].set(old, mode="drop")
    return out.at[new_target].set(new, mode="drop")

  count = table.count - dead_before[-1] + jnp.sum(fresh, dtype=jnp.int32)
  return dataclasses.replace(
    table,
    keys=moved(table.keys, words),
    live=index < count,
    count=count,
    values=tuple(moved(v, r) for v, r in zip(table.values, rows)),
  )


def read_only(table: Table, capacity: int | None = None) -> SortedTable:
  """The live entries of ``table`` (any storage, sharded or not) in the least room, to be read.

  A sorted table of exactly those entries (its capacity their number, at
  least 1, or ``capacity`` rows: room for entries to come), with the same
  keys, values and default, and no eviction policy, scores or counters: what
  a served model reads. O(capacity), eager.

  Raises:
    ValueError: ``capacity`` is below the number of entries.

  Examples:
    >>> import jax.numpy as jnp, jaxres as jr
    >>> t = jr.OpenAddressingTable.create(1024, key=jnp.int32, value=jnp.float32, default=-1.0)
    >>> small = read_only(t.insert(jnp.array([7, 3]), jnp.array([0.5, 1.5])))
    >>> small.capacity, small.find(jnp.array([3, 4])).tolist()
    (2, [1.5, -1.0])
  """
  keys, values, valid = table.export()
  live = np.asarray(jax.device_get(valid))
  count = int(live.sum())  # live entries come first
  if capacity is not None and capacity < count:
    raise ValueError(f"capacity: {capacity} rows cannot hold the table's {count} entries.")
  empty = read_only_like(table, capacity or max(1, count))
  if not count:
    return empty
  taken = jax.tree.map(lambda x: np.asarray(jax.device_get(x))[:count], (keys, values))
  return empty.import_(*taken)


def read_only_like(table: Table, capacity: int) -> SortedTable:
  """An empty sorted table of ``capacity`` rows with ``table``'s keys, values and default."""
  default = tuple(jnp.asarray(jax.device_get(d)) for d in table.default)
  return _empty(check_capacity(capacity), table.key_spec, table.value_spec, default)


# One program builds an empty table; only ``default`` is an array argument.
@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _empty(capacity, key_spec, value_spec, default):
  return SortedTable(
    keys=jnp.zeros((capacity, key_spec.num_words), jnp.uint32),
    live=jnp.zeros((capacity,), bool),
    count=jnp.zeros((), jnp.int32),
    **empty_fields(capacity, key_spec, value_spec, default, slots=capacity, rows=capacity, eviction=None),
  )
