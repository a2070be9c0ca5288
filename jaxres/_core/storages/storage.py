"""``Storage``: a table held in one set of arrays, its row operations written once.

The open-addressing and sorted storages differ in how they find, store and
delete keys; :class:`Storage` builds the row operations of the row protocol
(:mod:`jaxres._core.row_protocol`) that they share on top of four primitives:

* ``_locate(words)``: ``(found, slot)`` of live entries;
* ``_release(words, slot, mask)``: delete entries;
* ``_slots()``: every slot's key words and whether it holds an entry;
* ``_row_of(slot)``: the row of ``values`` that holds a slot's value.

Each storage declares its number of value rows, :attr:`Storage.num_rows`
(``capacity`` for both storages today, whatever the number of slots): the
arrays of rows are sized by it, and a row handle lies below it.

Each storage implements ``_upsert_rows`` (insert and find_or_insert) itself.
"""

from __future__ import annotations

import abc
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxres._core import call_args, folds, memory
from jaxres._core.kernels import claims
from jaxres._core.kernels.row_ops import read_rows, select_rows, take_rows, write_rows
from jaxres._core.modes import Upsert
from jaxres._core.policies import Policy
from jaxres._core.table import Changes, LiveEntries, Table

NO_SCORE = jnp.iinfo(jnp.uint32).max  # the score of a free slot


def empty_fields(
  capacity: int,
  key_spec,
  value_spec,
  default,
  *,
  slots: int,
  rows: int,
  eviction: Policy | None,
  stamps: bool = False,
) -> dict:
  """The fields every storage starts with: no entries, ``rows`` value rows (the storage's
  :attr:`~Storage.num_rows`), a score per slot when the table evicts, and a stamp per value row
  where ``stamps`` (see ``Storage``)."""
  return {
    "values": tuple(value_spec.empty((rows,))),
    "default": tuple(default),
    # A free slot scores the highest: no new key evicts it (eviction_rounds reads scores alone).
    "slot_scores": jnp.full((slots if eviction is not None else 0,), NO_SCORE, jnp.uint32),
    "row_stamps": jnp.zeros((rows if stamps else 0,), jnp.uint32),
    "size": jnp.zeros((), jnp.int32),
    "dropped": jnp.zeros((), jnp.int32),
    "clock": jnp.zeros((), jnp.uint32),
    "version": jnp.zeros((), jnp.uint32),
    "evictions": jnp.zeros((), jnp.int32),
    "capacity": capacity,
    "key_spec": key_spec,
    "value_spec": value_spec,
    "eviction": eviction,
  }


class Storage(Table):
  """A table held in one set of arrays: the row operations, written once over four primitives.

  Every call that changes a table advances its ``version`` (those that score,
  its ``clock`` too). A storage whose entries keep their slots (open
  addressing) stamps each value row with the version of the call that last
  changed its entry (its key placed, its value written or its score set), so
  that :meth:`changes` finds what changed since a version without a log:
  O(batch) per call.
  """

  slot_scores: jax.Array  # uint32[num_slots] with an eviction policy, else uint32[0]
  row_stamps: jax.Array  # uint32[num_rows] where entries keep their slots, else uint32[0]
  version: jax.Array  # uint32: calls that changed the table so far

  # Whether a write costs O(batch) (a hashed storage) rather than O(capacity): what a table written
  # every step needs (an embedding's; see registry.writable).
  BATCH_WRITES = True

  @property
  @abc.abstractmethod
  def num_rows(self) -> int:
    """Value rows the storage's arrays have (static), declared by each storage: every row handle
    (:meth:`find_rows`, :meth:`find_or_insert_rows`) lies in ``[0, num_rows)``, and a write to row
    ``num_rows`` is dropped."""

  @classmethod
  def capacity_for(cls, nbytes: int, key, value, default=0, **options) -> int:
    """The largest capacity whose table (``cls.create(capacity, key, value, default, **options)``)
    holds at most ``nbytes`` (:meth:`memory`), found without allocating a table.

    Examples:
      >>> import jax.numpy as jnp, jaxres as jr
      >>> args = (jnp.int64, jnp.float32)
      >>> c = jr.OpenAddressingTable.capacity_for(1 << 20, *args, eviction=jr.LRU())
      >>> held = lambda c: sum(jr.OpenAddressingTable.create(c, *args, eviction=jr.LRU()).memory().values())
      >>> c, held(c) <= 1 << 20 < held(c + 1)
      (20164, True)
    """
    create = lambda c: cls.create(c, key, value, default, **options)
    return memory.largest_capacity(lambda c: memory.nbytes(jax.eval_shape(lambda: create(c))), nbytes)

  def check_slots(self, words, slots) -> None:
    """Raises ``ValueError`` unless ``slots`` are distinct slots of this storage (below
    :attr:`num_slots`) for the distinct keys ``words`` (``uint32[n, W]``): the check of entries that
    a checkpoint puts back where they were (:meth:`placed`). Host side.

    Examples:
      >>> import numpy as np, jaxres as jr
      >>> t = jr.SortedTable.create(4, key=np.int32, value=np.float32)
      >>> t.check_slots(np.array([[1], [2]], np.uint32), np.array([0, 3]))
      >>> t.check_slots(np.array([[1], [2]], np.uint32), np.array([3, 3]))  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      ValueError: slots: 2 entries given slots that a table of 4 cannot hold (repeated ...): corrupted.
    """
    slots, n, num_slots = np.asarray(slots), words.shape[0], self.num_slots
    bad = slots.shape != (n,) or (n and (slots.min() < 0 or slots.max() >= num_slots))
    if bad or len(np.unique(slots)) != n or len(np.unique(np.asarray(words), axis=0)) != n:
      raise ValueError(
        f"slots: {n} entries given slots that a table of {num_slots} cannot hold "
        "(repeated or out of range slots, or repeated keys): corrupted."
      )

  def _tick(self) -> Storage:
    return dataclasses.replace(self, clock=self.clock + jnp.uint32(1), version=self.version + jnp.uint32(1))

  def _advance(self) -> Storage:
    return dataclasses.replace(self, version=self.version + jnp.uint32(1))

  def _carry(self, other: Storage) -> Storage:
    return dataclasses.replace(self, clock=other.clock, version=other.version, evictions=other.evictions)

  def succeeding(self, other: Storage) -> Storage:
    """This table as the one that replaces ``other`` (a stateful table's state rebuilt): its version
    goes on past ``other``'s and every entry counts as changed since any earlier version, so a
    delta taken against ``other`` holds every entry. O(capacity), eager."""
    version = jnp.maximum(self.version, other.version) + jnp.uint32(1)
    return dataclasses.replace(self, version=version, row_stamps=jnp.full_like(self.row_stamps, version))

  def with_counters(self, clock, evictions) -> Storage:
    return dataclasses.replace(
      self, clock=jnp.asarray(clock, jnp.uint32), evictions=jnp.asarray(evictions, jnp.int32)
    )

  def _row_of(self, slot: jax.Array) -> jax.Array:
    """The value row of each slot (the identity where slots are rows)."""
    return slot

  def _read(self, slot: jax.Array) -> list:
    """The value leaves of ``slot``'s entries."""
    return take_rows(self.values, self._row_of(slot))

  def _lookup_rows(self, words, defaults):
    found, slot = self._locate(words)
    return select_rows(found, self._read(slot), defaults), found

  def _score_rows(self, words):
    if self.eviction is None:  # no scores kept: every key scores 0
      return jnp.zeros(words.shape[0], jnp.uint32)
    found, slot = self._locate(words)
    return jnp.where(found, self.slot_scores[slot], jnp.uint32(0))

  def _scores_by_slot(self) -> jax.Array:
    """uint32[num_slots]: each slot's score (zeros for a table without eviction)."""
    return self.slot_scores if self.eviction is not None else jnp.zeros((self.num_slots,), jnp.uint32)

  def _policy_scores(self, named, first, last, old, given_scores, weights) -> jax.Array:
    """uint32[N]: the score the policy gives each named row's key (read on its ``first`` row).

    ``last``: each key's last row, whose given score counts; ``old``: the
    keys' present scores; ``weights``: occurrences each row stands for.
    """
    if given_scores is not None:
      return given_scores[last]
    count = None
    if self.eviction.counts:
      n = named.shape[0]
      weights = jnp.int32(1) if weights is None else weights
      count = jnp.zeros(n, jnp.int32).at[jnp.where(named, first, n)].add(weights, mode="drop")[first]
    return self.eviction.score(old, count, self.clock)

  def _rescore_rows(self, words, active, given_scores=None, weights=None):
    """assign_scores on flat rows: present keys get the score an insert would give them."""
    found, slot = self._locate(words)
    named = found if active is None else found & active
    first = claims.owner_per_key(words, named)
    last = claims.owner_per_key(words, named, last=True) if given_scores is not None else first
    old = jnp.where(found, self.slot_scores[slot], jnp.uint32(0))
    score = self._policy_scores(named, first, last, old, given_scores, weights)
    heads = named & (first == jnp.arange(words.shape[0], dtype=jnp.int32))
    return self._set_scores(slot, score, heads)._stamped(self._row_of(slot), heads)

  def _set_scores(self, slot, score, mask) -> Storage:
    """This table with ``score`` at ``slot``, where ``mask`` (distinct slots)."""
    drop = self.slot_scores.shape[0]
    return dataclasses.replace(
      self, slot_scores=self.slot_scores.at[jnp.where(mask, slot, drop)].set(score, mode="drop")
    )

  def _find_rows(self, words):
    found, slot = self._locate(words)
    return jnp.where(found, self._row_of(slot), -1)

  def _claim_rows(self, words, active, given_scores=None, weights=None):
    """find_or_insert_rows over :meth:`_upsert_rows`: a storage whose rows move on insert (sorted)."""
    found = self._locate(words)[0] & (True if active is None else active)
    defaults = [jnp.broadcast_to(d, (words.shape[0], *d.shape)) for d in self.default]
    table, _, evicted = self._upsert_rows(
      words, defaults, active, Upsert.FIND_OR_INSERT, given_scores, weights
    )
    index = table._find_rows(words)
    if active is not None:
      index = jnp.where(active, index, -1)
    if evicted is not None:
      evicted = (evicted[0], defaults, *evicted[2:])
    return table, index, found, (index >= 0) & ~found, evicted

  def _read_rows(self, index, defaults):
    return select_rows(index >= 0, take_rows(self.values, index), defaults)

  def _write_rows(self, index, leaves, active):
    return self._put_last(index, leaves, active & (index >= 0))

  def _assign_rows(self, words, leaves, active):
    found, slot = self._locate(words)
    found = found if active is None else found & active
    return self._put_last(self._row_of(slot), leaves, found)

  def _remove_rows(self, words, active):
    """The first active row of each present key releases it."""
    found, slot = self._locate(words)
    found = found if active is None else found & active
    first = claims.first_per_slot(slot, found)
    table = self._release(words, slot, first)
    return dataclasses.replace(table, size=table.size - jnp.sum(first, dtype=jnp.int32))

  def _apply_rows(self, words, leaves, active, fn, given_scores, weights=None):
    """insert_or_apply: the first occurrence of a new key inserts, every other row folds in.

    One claim gives every row its key's value row. Each round applies ``fn``
    to the earliest pending row of every value row, so the rows of one key are
    folded in batch order; rounds = the largest number of times one key
    occurs in the batch.
    """
    table, row, _, inserted, _ = self._claim_rows(words, active, given_scores, weights)
    present = row >= 0
    first = claims.first_per_slot(row, inserted)
    table = table._put(row, leaves, first)
    treedef = table.value_spec.treedef

    def fold(state):
      table, pending = state
      rows, target = claims.pending_rows(pending, claims.chunk_size(pending.shape[0]))
      live = pending[rows] & (target < pending.shape[0])
      earliest = claims.first_per_slot(row[rows], live)
      old = jax.tree.unflatten(treedef, take_rows(table.values, row[rows]))
      new = jax.tree.unflatten(treedef, take_rows(leaves, rows))
      folded = jax.tree.leaves(jax.vmap(fn)(old, new))
      return table._put(row[rows], folded, earliest), pending.at[target].set(live & ~earliest, mode="drop")

    pending = present & ~first
    reduction = folds.reduction(fn)
    if reduction is not None:
      target = jnp.where(pending, row, table.num_rows)
      values = tuple(reduction.scatter(v.at[target], x) for v, x in zip(table.values, leaves))
      return dataclasses.replace(table, values=values)._stamped(row, pending)
    table, _ = jax.lax.while_loop(lambda s: jnp.any(s[1]), fold, (table, pending))
    return table

  def _erase_rows(self, fn):
    """Removes the entries for which ``fn(keys, values, scores)`` is True (one pass over the slots)."""
    words, live = self._slots()
    keys = self.key_spec.decode(words)
    every = jnp.arange(live.shape[0], dtype=jnp.int32)
    values = self.value_spec.from_storage(self._read(every))
    erase = call_args.predicate_mask(fn(keys, values, self._scores_by_slot()), live.shape[0]) & live
    table = self._release(words, every, erase)
    return dataclasses.replace(table, size=table.size - jnp.sum(erase, dtype=jnp.int32))

  def _slot_rows(self, offset, size: int):
    """``(words, leaves, scores, valid)`` of slots ``[offset, offset + size)`` (past the end: not valid)."""
    index = offset + jnp.arange(size, dtype=jnp.int32)
    inside = (index >= 0) & (index < self.num_slots)
    index = jnp.clip(index, 0, self.num_slots - 1)
    words, live = self._slots_at(index)
    return words, self._read(index), self._scores_at(index), inside & live

  def _scores_at(self, slot: jax.Array) -> jax.Array:
    """uint32[N]: the scores of the slots ``slot`` (zeros for a table without eviction)."""
    return self.slot_scores[slot] if self.eviction is not None else jnp.zeros(slot.shape, jnp.uint32)

  def _write(self, slot, rows, mask) -> Storage:
    """Overwrites the values of existing entries at ``slot`` where ``mask``."""
    return self._put(self._row_of(slot), rows, mask)

  def _put(self, row, leaves, mask) -> Storage:
    """Writes value ``row``s (distinct where ``mask``) with ``leaves`` where ``mask``."""
    index = jnp.where(mask, row, self.num_rows)
    values = tuple(v.at[index].set(x, mode="drop") for v, x in zip(self.values, leaves))
    return dataclasses.replace(self, values=values)._stamped(row, mask)

  def _put_last(self, row, leaves, mask) -> Storage:
    """Writes value ``row``s with ``leaves`` where ``mask``; of the rows naming one row, the last wins."""
    table = dataclasses.replace(self, values=tuple(write_rows(self.values, row, leaves, mask)))
    return table._stamped(row, mask)

  def _changed_slots(self, since) -> tuple[jax.Array, jax.Array]:
    """``(live, changed)``, ``bool[num_slots]``: the slots holding an entry, and those whose row was
    stamped after version ``since`` (a storage without stamps: every live slot). O(capacity)."""
    live = self._slots()[1]
    if not self.row_stamps.shape[0]:
      return live, live
    rows = self._row_of(jnp.arange(self.num_slots, dtype=jnp.int32))
    return live, live & (self.row_stamps[jnp.where(live, rows, 0)] > since)

  def _stamped(self, row, mask) -> Storage:
    """Stamps value ``row``s with the version where ``mask`` (every row writes the same version, so
    repeated rows agree); a storage without stamps is returned as it is."""
    size = self.row_stamps.shape[0]
    if not size:
      return self
    stamps = self.row_stamps.at[jnp.where(mask, row, size)].set(self.version, mode="drop")
    return dataclasses.replace(self, row_stamps=stamps)

  def _compact(self):
    words, live = self._slots()
    slot = jnp.nonzero(live, size=self.capacity, fill_value=0)[0].astype(jnp.int32)
    valid = jnp.arange(self.capacity) < jnp.sum(live, dtype=jnp.int32)
    zeros = [jnp.zeros((self.capacity, *v.shape[1:]), v.dtype) for v in self.values]  # capacity entries
    leaves = select_rows(valid, self._read(slot), zeros)
    words = jnp.where(valid[:, None], words[slot], jnp.uint32(0))
    return words, leaves, jnp.where(valid, self._scores_by_slot()[slot], jnp.uint32(0)), valid

  @abc.abstractmethod
  def _locate(self, words) -> tuple[jax.Array, jax.Array]:
    """``(found bool[N], slot int32[N])`` of live entries (a slot's value is in row ``_row_of(slot)``)."""

  @abc.abstractmethod
  def _release(self, words, slot, mask) -> Storage:
    """Deletes the entries of keys ``words`` at ``slot`` where ``mask`` (unique keys).

    Called while ``size`` still counts them; the caller lowers it.
    """

  @abc.abstractmethod
  def _slots(self) -> tuple[jax.Array, jax.Array]:
    """``(words[rows, W], live bool[rows])``: the key words in each slot and whether it holds an entry."""

  def _slots_at(self, slot: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(words[N, W], live bool[N])`` of the slots ``slot`` alone (O(N), where :meth:`_slots` reads all)."""
    words, live = self._slots()
    return words[slot], live[slot]


_MIN_FETCH = 64  # changed entries are fetched in power-of-two batches of at least this many


class KeptSlots(Storage):
  """A storage whose entries keep their slots until removed (open addressing, lean), with a change
  stamp per value row: a save writes only the entries stamped since the last one (:meth:`changes`),
  and a restore puts entries back at their slots (:meth:`placed`)."""

  @abc.abstractmethod
  def value_rows(self, placement) -> jax.Array:
    """``int32[N]``: the value row of each row of a claim (its key's) or of its victims (the victim's).

    ``placement``: the ``Claim`` or ``Victims`` of this storage's ``_claim``; their only difference
    between storages is where an entry keeps its value (its slot, or a row of its own).
    """

  def _claim_rows(self, words, active, given_scores=None, weights=None):
    table, claim = self._claim(words, active, Upsert.FIND_OR_INSERT, given_scores, weights)
    row = jnp.where(claim.found | claim.placed, self.value_rows(claim), -1)
    victims = claim.victims
    if victims is None:
      return table, row, claim.found, claim.placed, None
    # No row is written here: the victims' values are still in their rows, read by a plain
    # gather that the compiled program drops when the caller does not use them. A refused
    # key offered no value: it reports the default.
    offered = [jnp.broadcast_to(d, (words.shape[0], *d.shape)) for d in self.default]
    values = select_rows(victims.refused, offered, take_rows(table.values, self.value_rows(victims)))
    return table, row, claim.found, claim.placed, (victims.words, values, victims.scores, victims.valid)

  def _evicted(self, victims, offered) -> tuple[KeptSlots, tuple | None]:
    """``(table, evicted)``: the victims' entries (a claim's ``Victims``, or none), read before a
    newcomer writes their rows.

    ``offered``: the value leaves a refused (or displaced) key reports.
    """
    if victims is None:
      return self, None
    values, victim_values = read_rows(self.values, self.value_rows(victims))
    leaves = select_rows(victims.refused, offered, victim_values)
    table = dataclasses.replace(self, values=tuple(values))
    return table, (victims.words, leaves, victims.scores, victims.valid)

  def _live_slots(self):
    return np.flatnonzero(jax.device_get(_jit_live(self)))

  def changes(self, since):
    packed_live, packed_changed = jax.device_get(_jit_changed(self, jnp.asarray(since, jnp.uint32)))
    live = np.unpackbits(packed_live, count=self.num_slots).astype(bool)
    slots = np.flatnonzero(np.unpackbits(packed_changed, count=self.num_slots))
    n = len(slots)
    padded = np.zeros(max(_MIN_FETCH, 1 << max(0, n - 1).bit_length()), np.int32)
    padded[:n] = slots
    words, leaves, scores = jax.device_get(_jit_entries_at(self, jnp.asarray(padded)))
    keys = self.key_spec.decode_host(np.asarray(words)[:n])
    values = self.value_spec.from_storage([np.asarray(x)[:n] for x in leaves])
    entries = LiveEntries(
      np.asarray(keys),
      [np.asarray(x) for x in jax.tree.leaves(values)],
      np.asarray(scores)[:n] if self.eviction is not None else None,
      slots,
    )
    return Changes(entries, live)


@jax.jit
def _jit_live(table: Storage) -> jax.Array:
  return table._slots()[1]


@jax.jit
def _jit_changed(table: Storage, since) -> tuple[jax.Array, jax.Array]:
  """The live slots and the live slots whose row was stamped after version ``since``, as packed bits."""
  live, changed = table._changed_slots(since)
  return jnp.packbits(live), jnp.packbits(changed)


@jax.jit
def _jit_entries_at(table: Storage, slots) -> tuple:
  """``(words, leaves, scores)`` of the entries at ``slots``."""
  words, _ = table._slots_at(slots)
  return words, table._read(slots), table._scores_at(slots)
