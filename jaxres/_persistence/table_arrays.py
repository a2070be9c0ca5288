"""A functional table as named host arrays and back: what a checkpoint holds of a table.

The arrays are those of :mod:`saved_entries`. A table gives and takes its
entries through its public methods (:meth:`~jaxres.Table.live_entries`,
:meth:`~jaxres.Table.placed`, :meth:`~jaxres.Table.import_`, ...); a
:class:`~jaxres.ShardedTable` is written and read shard by shard, each process
its own devices' shards (the functions below are registered for it).

Examples:
  >>> import numpy as np, jaxres as jr
  >>> from jaxres._persistence import table_arrays
  >>> empty = jr.SortedTable.create(8, key=np.int32, value=np.float32, default=0.0)
  >>> arrays = table_arrays.to_arrays(empty.insert(np.array([3, 1], np.int32), np.ones(2, np.float32)))
  >>> sorted(arrays)
  ['keys', 'values']
  >>> table_arrays.from_arrays(empty, arrays).live_entries().keys
  array([1, 3], dtype=int32)
"""

from __future__ import annotations

import functools
import itertools
from typing import NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxres._core import call_args
from jaxres._core.sharding.routing import owner_of
from jaxres._core.sharding.sharded_table import ShardedTable
from jaxres._core.table import Table
from jaxres._persistence import processes, saved_entries
from jaxres._persistence.saved_entries import Saved

KIND = "table"  # the kind saved with a table: stateful and functional tables' checkpoints are interchangeable


@functools.singledispatch
def to_arrays(table: Table) -> dict[str, np.ndarray]:
  """The live entries of ``table`` as named host arrays (:mod:`saved_entries`), keys in their exact dtype."""
  entries, layout, kind = table.live_entries(), table.slot_layout, table.slot_kind
  return saved_entries.to_arrays(entries, table.value_spec, _counters(table), layout, kind)


@to_arrays.register
def _(table: ShardedTable) -> dict:
  """Each shard's live entries as blocks; on several processes global arrays, each process its own shards'."""
  counts = processes.replicated(table.shards.size)
  blocks = table.shard_entries(max(1, int(counts.max())))
  return saved_entries.to_blocks(
    blocks, counts, table.key_spec, table.value_spec, **_placement(table), counters=_counters(table)
  )


def _placement(table: Table) -> dict:
  """What saved slots refer to: the table's ``layout`` and the storage ``kind`` that placed them."""
  return {"layout": table.slot_layout, "kind": table.slot_kind}


@functools.singledispatch
def _counters(table: Table) -> dict | None:
  """The ``clock`` and ``evictions`` of a table with an eviction policy, on the host (else ``None``)."""
  if table.eviction is None:
    return None
  return jax.device_get({"clock": table.clock, "evictions": table.evictions})


@_counters.register
def _(table: ShardedTable) -> dict | None:
  """The shards' clock (the same in each) and their evictions summed."""
  if table.eviction is None:
    return None
  clock, evictions = (processes.replicated(x) for x in (table.shards.clock, table.shards.evictions))
  return {"clock": clock[0], "evictions": np.int32(evictions.sum())}


class Mark(NamedTuple):
  """Where a table stood when it was saved: what a later delta is taken against."""

  version: int
  layout: tuple[int, ...]
  kind: str  # the storage kind whose slots ``layout`` numbers


def changes(table: Table, since: Mark | None) -> tuple[Mark | None, dict[str, np.ndarray] | None]:
  """``(mark, delta)``: the table's mark now (``None`` when it cannot give deltas), and the arrays
  of what changed since ``since`` (:func:`_delta`), or ``None`` when the table must be saved
  whole: no ``since``, another slot layout (the table grew), a version below the mark's (another
  table), or a storage that gives no changes (sorted)."""
  if table.slot_layout is None:
    return None, None
  mark, follows = _marked(table, since)
  if not follows:
    return mark, None
  delta = _delta(table, since.version)
  return (mark, delta) if delta is not None else (None, None)


@functools.singledispatch
def _delta(table: Table, version: int) -> dict[str, np.ndarray] | None:
  """What changed since ``version`` (:func:`saved_entries.delta_to_arrays`); ``None`` for a storage
  that gives no changes."""
  delta = table.changes(version)
  if delta is None:
    return None
  return saved_entries.delta_to_arrays(
    delta.entries, delta.live, table.value_spec, _counters(table), table.slot_layout, table.slot_kind
  )


@_delta.register
def _(table: ShardedTable, version: int) -> dict | None:
  """Each shard's changes as blocks (:func:`saved_entries.delta_to_blocks`); on several processes
  global arrays, each process its own shards'."""
  changed = table.shard_changes(version)
  if changed is None:
    return None
  live, counts = changed
  counts = processes.replicated(counts)
  width = max(1, 1 << max(0, int(counts.max()) - 1).bit_length())
  blocks = table.changed_entries(version, width)
  return saved_entries.delta_to_blocks(
    blocks, counts, live, table.key_spec, table.value_spec, **_placement(table), counters=_counters(table)
  )


def _marked(table: Table, since: Mark | None) -> tuple[Mark, bool]:
  """The table's mark now, and whether it follows ``since``: the same slot layout and kind, and a
  version not below it (a table made anew starts again from 0)."""
  layout = tuple(int(x) for x in table.slot_layout)
  mark = Mark(int(jax.device_get(table.version)), layout, table.slot_kind)
  same = since is not None and (since.layout, since.kind) == (mark.layout, mark.kind)
  return mark, same and since.version <= mark.version


def from_arrays(table: Table, arrays) -> Table:
  """``table`` (its storage, capacity, mesh) emptied and holding exactly the entries of ``arrays``.

  Scores and the clock are restored when both the checkpoint and the table
  keep them; entries saved without scores are scored as inserted now. A
  table of the saved slot layout and storage kind gets each entry back in
  its slot; any other has them inserted.

  Raises:
    TypeError: ``arrays`` are not a table's.
    ValueError: keys or values of other dtypes or shapes, or more entries
      than the capacity holds.
  """
  saved = saved_entries.from_arrays(arrays, table.key_spec, table.value_spec)
  keep = table.eviction is not None
  same = (
    saved.slots is not None
    and set(_local_shards(table)) <= set(saved.shards)
    and (saved.scores is not None) == keep
    and len(saved.keys) <= table.capacity
    and np.array_equal(saved.layout, table.slot_layout)
    and saved.layout_kind == table.slot_kind
  )
  if same:
    restored = _placed(table, saved)
  else:
    scores = saved.scores if keep else None
    if keep and scores is None and table.eviction.takes_scores:
      scores = np.zeros(len(saved.keys), np.uint32)
    restored = _imported(table, saved._replace(scores=scores))
    lost = int(restored.dropped) + int(restored.evictions) - (int(table.evictions) if keep else 0)
    if lost:
      raise ValueError(
        f"{len(saved.keys)} entries do not fit a table of capacity {table.capacity} ({lost} would be lost)."
      )
  if keep and saved.counters:
    return restored.with_counters(saved.counters.get("clock", 0), saved.counters.get("evictions", 0))
  return restored


@functools.singledispatch
def _local_shards(table: Table) -> list[int]:
  """The shards this process holds (a table that is not split holds its one shard, 0)."""
  del table
  return [0]


@_local_shards.register
def _(table: ShardedTable) -> list[int]:
  return sorted(processes.local_rows(table.shards.size))


@functools.singledispatch
def _placed(table: Table, saved: Saved) -> Table:
  """The saved entries back at their slots (only for a table of the saved layout)."""
  (slots,) = saved.slots
  return table.placed(saved.keys, saved.values, saved.scores, slots)


@_placed.register
def _(table: ShardedTable, saved: Saved) -> Table:
  """Each of this process's shards gets its saved entries at their slots (the keys' owners are checked)."""
  n = len(saved.keys)
  words = np.asarray(table.key_spec.encode(saved.keys, "keys")[0]).reshape(n, table.key_spec.num_words)
  leaves = [np.asarray(x) for x in call_args.value_leaves(table, saved.values, (n,))]
  scores = [] if saved.scores is None else [np.asarray(saved.scores, np.uint32)]
  owners = np.asarray(_owner_of(words, table.num_shards)) if n else np.zeros(0, np.int32)
  ends = np.cumsum([0, *(len(s) for s in saved.slots)])
  parts = {}
  for shard, where, (start, end) in zip(saved.shards, saved.slots, itertools.pairwise(ends)):
    if end - start > table.shard_capacity:
      raise ValueError(
        f"{end - start} entries of shard {shard} do not fit its capacity {table.shard_capacity}."
      )
    if np.any(owners[start:end] != shard):
      raise ValueError(f"slots: entries saved under shard {shard} belong to other shards (corrupted).")
    table.shards.check_slots(words[start:end], where)
    parts[shard] = np.arange(start, end)
  slots = np.concatenate([np.asarray(s, np.int64) for s in saved.slots]).astype(np.int32)
  local = _local_shards(table)
  width = max(1, int(processes.everywhere(np.array(max(len(parts[i]) for i in local))).max()))
  split = NamedSharding(table.mesh, PartitionSpec(table.axis))

  def stacked(x):
    """This process's shards' rows, padded to one width, as its part of a global array."""
    rows = np.stack(
      [np.pad(x[parts[i]], [(0, width - len(parts[i]))] + [(0, 0)] * (x.ndim - 1)) for i in local]
    )
    return jax.make_array_from_process_local_data(split, rows, (table.num_shards, *rows.shape[1:]))

  valid = np.arange(width) < np.array([[len(parts[i])] for i in local])
  words, slots, *rest = (stacked(x) for x in (words, slots, *leaves, *scores))
  leaves, scores = (rest[:-1], rest[-1]) if saved.scores is not None else (rest, None)
  valid = jax.make_array_from_process_local_data(split, valid, (table.num_shards, width))
  return table.place_shards(words, leaves, scores, slots, valid)


@functools.singledispatch
def _imported(table: Table, saved: Saved) -> Table:
  """:meth:`~jaxres.Table.import_` of the saved entries; a table each process holds whole takes every
  process's part where each read only some shards."""
  keys, values, scores = saved.keys, saved.values, saved.scores
  if not saved.complete:
    leaves, treedef = jax.tree.flatten(values)
    keys, *leaves = processes.gather_rows([keys, *leaves])
    values = jax.tree.unflatten(treedef, leaves)
    scores = None if scores is None else processes.gather_rows([scores])[0]
  return table.import_(keys, values, scores=scores)


@_imported.register
def _(table: ShardedTable, saved: Saved) -> Table:
  """Saved entries that each process holds a part of go to their owners without leaving their process.

  Only where the shards are the whole mesh and span processes: with replicas
  (other mesh axes), every process takes every part instead.
  """
  local = len(table.mesh.local_devices)
  if saved.complete or table.mesh.devices.size != table.num_shards or local == table.num_shards:
    return _imported.dispatch(Table)(table, saved)
  n = len(saved.keys)
  words = np.asarray(table.key_spec.encode(saved.keys, "keys")[0]).reshape(n, table.key_spec.num_words)
  leaves = [np.asarray(x) for x in call_args.value_leaves(table, saved.values, (n,))]
  scores = [] if saved.scores is None else [np.asarray(saved.scores, np.uint32)]
  rows = -(-int(processes.everywhere(np.array(n)).max()) // local) * local or local
  split = NamedSharding(table.mesh, PartitionSpec(table.axis))

  def spread(x):
    """This process's rows (padded) as its part of a global array split over the axis."""
    padded = np.zeros((rows, *x.shape[1:]), x.dtype)
    padded[:n] = x
    return jax.make_array_from_process_local_data(split, padded, (rows * jax.process_count(), *x.shape[1:]))

  words, valid, *rest = (spread(x) for x in (words, np.ones(n, bool), *leaves, *scores))
  leaves, scores = (rest[:-1], rest[-1]) if saved.scores is not None else (rest, None)
  return table.import_words(words, leaves, valid, scores)


_owner_of = jax.jit(owner_of, static_argnums=1)  # eager: one program, not one per operation
