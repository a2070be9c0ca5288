"""``Storage``: a table held in one set of arrays, its row operations written once.

The open-addressing and sorted storages differ in how they find, store and
delete keys; :class:`Storage` builds the row operations of the :class:`Table`
protocol that they share on top of three primitives:

* ``_locate(words)``: ``(found, slot)`` of live entries;
* ``_release(words, slot, mask)``: delete entries;
* ``_compact()``: all live entries packed at the front of ``capacity`` rows.

Each storage implements ``_upsert_rows`` (insert and find_or_insert) itself.
"""

from __future__ import annotations

import abc
import dataclasses
import operator

import jax
import jax.numpy as jnp

from jaxres._core import claims
from jaxres._core.rows import select_rows, take_rows
from jaxres._core.table import Table


def empty_fields(capacity: int, key_spec, value_spec, default, rows: int) -> dict:
  """The fields every storage starts with: no entries and ``rows`` value rows."""
  return {
    "values": tuple(value_spec.empty((rows,))),
    "default": tuple(default),
    "size": jnp.zeros((), jnp.int32),
    "dropped": jnp.zeros((), jnp.int32),
    "capacity": capacity,
    "key_spec": key_spec,
    "value_spec": value_spec,
  }


class Storage(Table):
  """A table held in one set of arrays: the row operations, written once over three primitives."""

  def _lookup_rows(self, words, defaults):
    found, slot = self._locate(words)
    return select_rows(found, take_rows(self.values, slot), defaults), found

  def _remove_rows(self, words, active):
    """The first active row of each present key releases it."""
    found, slot = self._locate(words)
    found = found if active is None else found & active
    first = claims.first_per_slot(slot, found)
    table = self._release(words, slot, first)
    return dataclasses.replace(table, size=table.size - jnp.sum(first, dtype=jnp.int32))

  def _apply_rows(self, words, leaves, active, fn):
    """insert_or_apply: the first occurrence of a new key inserts, every other row folds in.

    Each round applies ``fn`` to the earliest pending row of every slot, so the
    rows of one key are folded in batch order; rounds = the largest number of
    times one key occurs in the batch.
    """
    before, _ = self._locate(words)
    table, _ = self._upsert_rows(words, leaves, active, "first")
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

  def _write(self, slot, rows, mask) -> Storage:
    """Overwrites the values of existing entries at ``slot`` where ``mask``."""
    index = jnp.where(mask, slot, self.values[0].shape[0])
    values = tuple(v.at[index].set(r, mode="drop") for v, r in zip(self.values, rows))
    return dataclasses.replace(self, values=values)

  @abc.abstractmethod
  def _locate(self, words) -> tuple[jax.Array, jax.Array]:
    """``(found bool[N], slot int32[N])`` of live entries; slot indexes ``values``."""

  @abc.abstractmethod
  def _release(self, words, slot, mask) -> Storage:
    """Deletes the entries of keys ``words`` at ``slot`` where ``mask`` (unique keys)."""


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
