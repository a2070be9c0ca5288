"""The jitted operations behind :class:`Table` and the batch algorithms they use.

Each public ``Table`` method validates its arguments on the host and then
calls one function here, jitted once per shape, which calls the table's row
operations. The unjitted algorithms below implement those row operations for
both storages on top of the storage primitives (``_locate``, ``_place``, ...).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from jaxres._core import batch as batch_lib
from jaxres._core import claims

if TYPE_CHECKING:
  from jaxres._core.table import Table


def take_rows(leaves, index):
  """Rows ``index`` of every leaf (clipped)."""
  return [jnp.take(x, index, axis=0, mode="clip") for x in leaves]


def select_rows(mask, on_true, on_false):
  """Per row, the leaves of ``on_true`` where ``mask`` else those of ``on_false``."""

  def pick(a, b):
    return jnp.where(mask.reshape(mask.shape + (1,) * (a.ndim - 1)), a, b)

  return [pick(a, b) for a, b in zip(on_true, on_false)]


@jax.jit
def lookup(table: Table, words, defaults):
  return table._lookup_rows(words, defaults)


@jax.jit
def contains(table: Table, words):
  return table._lookup_rows(words, [])[1]


@jax.jit
def compact(table: Table):
  return table._compact()


@jax.jit
def remove(table: Table, words, active):
  return table._remove_rows(words, active)


def lookup_present(table: Table, words, defaults):
  """``(leaves, found)``: the stored values of present keys, ``defaults`` elsewhere."""
  found, slot = table._locate(words)
  return select_rows(found, take_rows(table.values, slot), defaults), found


def release_present(table: Table, words, active=None) -> Table:
  """Removal: the first (active) row of each present key releases its entry."""
  found, slot = table._locate(words)
  found = found if active is None else found & active
  first = claims.first_per_slot(slot, found)
  table = table._release(words, slot, first)
  return dataclasses.replace(table, size=table.size - jnp.sum(first, dtype=jnp.int32))


@functools.partial(jax.jit, static_argnames=("mode",))
def upsert(table: Table, words, leaves, active, *, mode: str):
  """insert ("insert": last duplicate wins) and find_or_insert ("first")."""
  return table._upsert_rows(words, leaves, active, mode)


@functools.partial(jax.jit, static_argnames=("fn",))
def apply(table: Table, words, leaves, active, *, fn):
  """insert_or_apply (see :func:`fold_in`)."""
  return table._apply_rows(words, leaves, active, fn)


def fold_in(table: Table, words, leaves, active, fn):
  """insert_or_apply: the first occurrence of a new key inserts, every other row folds in.

  Each round applies ``fn`` to the earliest pending row of every slot, so the
  rows of one key are folded in batch order; rounds = the largest number of
  times one key occurs in the batch.
  """
  before, _ = table._locate(words)
  table, _ = table._upsert_rows(words, leaves, active, "first")
  present, slot = table._locate(words)
  present = present if active is None else present & active
  inserted = claims.first_per_slot(slot, present & ~before)
  treedef = table.value_spec.treedef

  def fold(state):
    table, pending = state
    rows, target = claims.pending_rows(pending, claims.chunk_size(pending.shape[0]))
    live = pending[rows] & (target < pending.shape[0])
    earliest = claims.first_per_slot(slot[rows], live)
    old = jax.tree.unflatten(treedef, take_rows(table.values, slot[rows]))
    new = jax.tree.unflatten(treedef, take_rows(leaves, rows))
    folded = jax.tree.leaves(jax.vmap(fn)(old, new))
    return table._write(slot[rows], folded, earliest), pending.at[target].set(live & ~earliest, mode="drop")

  pending = present & ~inserted
  reduction = _exact_reduction(fn, table.value_spec)
  if reduction is not None:
    target = jnp.where(pending, slot, table.values[0].shape[0])
    values = tuple(getattr(v.at[target], reduction)(x, mode="drop") for v, x in zip(table.values, leaves))
    return dataclasses.replace(table, values=values)
  table, _ = jax.lax.while_loop(lambda s: jnp.any(s[1]), fold, (table, pending))
  return table


# Reductions whose result on integers does not depend on the order of the
# operands, so one scatter equals the in-order fold exactly.
_ORDER_FREE = {
  jnp.add: "add",
  jax.lax.add: "add",
  operator.add: "add",
  jnp.multiply: "multiply",
  jax.lax.mul: "multiply",
  operator.mul: "multiply",
  jnp.maximum: "max",
  jax.lax.max: "max",
  jnp.minimum: "min",
  jax.lax.min: "min",
}


def _exact_reduction(fn, value_spec) -> str | None:
  """The scatter method equal to folding with ``fn``, or None to fold in order."""
  try:
    reduction = _ORDER_FREE.get(fn)
  except TypeError:  # unhashable callable
    return None
  integral = all(leaf.dtype.kind in "iu" and not leaf.wide for leaf in value_spec.leaves)
  return reduction if integral else None


def update_existing(table: Table, leaves, slot, active, mode: str) -> tuple[Table, list]:
  """insert / find_or_insert when every active key is present: no grouping by sorting."""
  if mode == "insert":
    last = claims.first_per_slot(slot, jnp.ones(slot.shape, bool) if active is None else active, last=True)
    return table._write(slot, leaves, last), []
  return table, take_rows(table.values, slot)


def exact_upsert(table: Table, words, leaves, active, mode: str) -> tuple[Table, list]:
  """The reference batch algorithm: group by sorting, admit in batch order.

  Exact in every case, including a batch that overflows the table (the new
  keys admitted are those a one-at-a-time loop would have inserted).
  """
  groups = table._group(words, active)
  rows = take_rows(leaves, groups.perm)
  found, slot = table._locate(groups.words)
  if mode == "insert":
    rows = take_rows(rows, groups.end)
  heads = groups.head & groups.active
  new = heads & ~found
  rank = batch_lib.first_occurrence_rank(groups, new)
  admitted = new & (rank < table.capacity - table.size)
  num_admitted = jnp.sum(admitted, dtype=jnp.int32)

  out = []
  if mode == "first":
    defaults = [jnp.broadcast_to(d, x.shape) for d, x in zip(table.default, rows)]
    out = select_rows(found, take_rows(table.values, slot), select_rows(admitted, rows, defaults))
    out = batch_lib.unsort(groups, take_rows(out, groups.start))
  else:
    table = table._write(slot, rows, heads & found)
  table = table._place(groups, admitted, rows)
  table = dataclasses.replace(
    table,
    size=table.size + num_admitted,
    dropped=table.dropped + jnp.sum(new, dtype=jnp.int32) - num_admitted,
  )
  return table, out
