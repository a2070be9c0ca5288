"""Placing new keys into free slots of a bucket array by claims, without sorting.

An upsert (:func:`upsert_slots`) locates its keys, admits the new ones that
fit, and places them. New keys choose a free slot of their bucket and claim it
with an integer scatter-min of their batch index into a batch-sized scratch
array, at a cell hashed from the slot. Integer min does not depend on the
order of the writes, so the lowest batch index wins on every backend; rows
carrying the same key see that they lost to an equal key and become duplicates
of it, and rows that only met another slot in the same cell try again with a
new hash, a chunk at a time (a retried row first looks for its key in its
current bucket, where an equal row of an earlier chunk may have put it). A row
whose bucket is full moves to the next bucket. Work is O(batch): the scratch is sized by the batch.

A winner also takes a value row from the top of the table's stack of free rows
(:func:`take_free_rows`), in the order keys are placed: round by round, in
batch order within a round (so the CPU kernel hands each winner its row as it
stores the key).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxres._core import constants
from jaxres._core.encoding.hashing import hash_words
from jaxres._core.kernels import claims, grouping, native
from jaxres._core.storages.open_addressing.buckets import Layout

_LANE_MIX = np.uint32(constants.GOLDEN_MIX)


class Upserted(NamedTuple):
  """What :func:`upsert_slots` did to a batch of ``N`` key rows."""

  records: jax.Array  # the bucket records, with the admitted keys stored
  found: jax.Array  # bool[N]: active rows whose key was in the table
  slot: jax.Array  # int32[N]: each row's slot (a miss that was not admitted: the first of its home bucket)
  admitted: jax.Array  # bool[N]: active rows whose key was new and fits, now placed
  dropped: jax.Array  # int32[]: distinct new keys that did not fit
  first: jax.Array  # int32[N]: for an admitted row the first row of its key, else its own index
  row: jax.Array  # int32[N]: the value row of each row's slot


def upsert_slots(
  layout: Layout,
  records: jax.Array,
  words: jax.Array,
  active: jax.Array,
  free_rows: jax.Array,
  size: jax.Array,
  locate: Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]],
) -> Upserted:
  """Locates the keys of the ``active`` rows, admits the new ones that fit, and places them.

  The new keys that fit are those of :func:`batch.admit`: all of them when
  they fit, else the first ones by first occurrence. Their rows (equal rows
  allowed) claim free slots, and each new key takes a value row.

  Args:
    layout: the bucket array's layout; ``records`` the array,
      ``[num_buckets, record_width]``.
    words: uint32[N, W] key rows; ``active``: bool[N], the rows taking part.
    free_rows: int32[capacity], the table's stack of value rows; ``size``
      (int32[]) of them are taken, the rest are free.
    locate: the XLA probe, ``(records, words) -> (hit, slot)``.
  """
  n = words.shape[0]
  flag, index = jax.ShapeDtypeStruct((n,), jnp.bool_), jax.ShapeDtypeStruct((n,), jnp.int32)
  table, count = jax.ShapeDtypeStruct(records.shape, records.dtype), jax.ShapeDtypeStruct((), jnp.int32)
  results = Upserted(table, flag, index, flag, count, index, index)

  reference = lambda *args: tuple(_upsert_reference(layout, locate, *args))
  out = native.on_cpu(
    "jaxres_upsert", reference, results, records, words, active, free_rows, size,
    aliases={0: 0}, bucket_size=layout.bucket_size,
  )  # fmt: skip
  return Upserted(*out)


def _upsert_reference(layout, locate, records, words, active, free_rows, size):
  """:func:`upsert_slots` in XLA: the reference of its kernel, and the GPU/TPU path."""
  hit, slot = locate(records, words)
  new = active & ~hit
  room = free_rows.shape[0] - size
  admitted, dropped = lax.cond(
    jnp.sum(new, dtype=jnp.int32) <= room,
    lambda: (new, jnp.int32(0)),
    lambda: grouping.admit(words, new, room),
  )
  flat, slot, first, row = _claim_reference(
    layout, records.reshape(-1), words, admitted, slot, free_rows, size
  )
  return Upserted(flat.reshape(records.shape), hit & active, slot, admitted, dropped, first, row)


def _claim_reference(layout, flat, words, admitted, slot, free_rows, size):
  """The claims of :func:`upsert_slots` in XLA: ``(flat, slot, first, row)``."""
  flat, slot, first = _claim_slots(layout, flat, words, admitted, slot, free_rows, taken=size)
  return flat, slot, first, layout.row_of(flat, slot)


def take_free_rows(layout: Layout, flat, slot, new, free_rows, size) -> jax.Array:
  """The records ``flat`` with a value row for each ``new`` entry's slot: ``free_rows[size + k]``
  for the ``k``-th, in the order of ``new``.

  ``new`` marks distinct slots, at most ``len(free_rows) - size`` of them;
  the caller adds them to the table's size.
  """
  rank = claims.prefix_sum(new) - 1
  row = free_rows[jnp.clip(size + rank, 0, free_rows.shape[0] - 1)].astype(jnp.uint32)
  return flat.at[jnp.where(new, layout.row_cell(slot), flat.size)].set(row, mode="drop")


def _claim_slots(layout, flat, words, admitted, slot, free_rows, taken):
  n, size = words.shape[0], layout.bucket_size
  index = jnp.arange(n, dtype=jnp.int32)
  home = layout.home(words)
  # A per-key choice among the free slots spreads distinct keys apart (fewer
  # lost claims); equal keys make the same choice and so meet on one slot.
  lane = (hash_words(words, seed=constants.LANE_SEED) * _LANE_MIX) >> 16

  def claim_round(state, rows, target, later: bool):
    """One round for the rows ``rows`` (``target``: the same, for scatters)."""
    rounds, taken, flat, bucket, slot, first, pending = state
    position = jnp.arange(rows.shape[0], dtype=jnp.int32)
    active, current, row_words = pending[rows] & (target < n), bucket[rows], words[rows]
    placed, placed_slot = jnp.zeros_like(active), jnp.int32(0)
    if later:
      # An equal key of an earlier chunk may have been placed since: these
      # rows follow the same buckets, so they find it in the current one.
      record = layout.records(flat, current)
      match = layout.occupancy(record[:, layout.mask_column]) & jnp.all(
        layout.keys_of(record) == row_words[:, None, :], axis=-1
      )
      placed = active & jnp.any(match, axis=-1)
      placed_slot = current * size + jnp.argmax(match, axis=-1).astype(jnp.int32)
      active = active & ~placed
      masks = record[:, layout.mask_column]
    else:
      masks = flat[layout.column(current, layout.mask_column)]
    free = ~layout.occupancy(masks)
    num_free = jnp.sum(free, axis=-1, dtype=jnp.int32)
    full = num_free == 0
    choice = (lane[rows] % jnp.maximum(num_free, 1).astype(jnp.uint32)).astype(jnp.int32)
    pick = free & (jnp.cumsum(free, axis=-1) == (choice + 1)[:, None])
    candidate = current * size + jnp.argmax(pick, axis=-1).astype(jnp.int32)
    trying = active & ~full
    scratch = claims.scratch_size(rows.shape[0])
    winner = claims.lowest_writer(claims.cell_of(candidate, rounds, scratch), trying, scratch)
    same_slot = trying & (candidate[winner] == candidate)
    won = same_slot & (winner == position)
    same_key = same_slot & ~won & jnp.all(row_words[winner] == row_words, axis=-1)
    new_slot = jnp.where(won | same_key, candidate, slot[rows])
    flat = layout.store(flat, candidate, row_words, won)
    return (
      rounds + 1,
      taken + jnp.sum(won, dtype=jnp.int32),
      take_free_rows(layout, flat, candidate, won, free_rows, taken),
      bucket.at[target].set(
        jnp.where(active & full, (current + 1) % layout.num_buckets, current), mode="drop"
      ),
      slot.at[target].set(jnp.where(placed, placed_slot, new_slot), mode="drop"),
      # -1: placed by an equal key whose row is not known here (resolved below).
      first.at[target].set(
        jnp.where(placed, -1, jnp.where(same_key, rows[winner], first[rows])), mode="drop"
      ),
      pending.at[target].set(active & ~won & ~same_key, mode="drop"),
    )

  def later_round(state):
    # Few rows are left after the first round; take them a chunk at a time,
    # lowest batch index first, so a key's first occurrence always takes part.
    return claim_round(state, *claims.pending_rows(state[-1], claims.chunk_size(n)), later=True)

  state = (jnp.int32(0), taken, flat, home, slot, index, admitted)
  state = claim_round(state, index, index, later=False)
  _, _, flat, _, slot, first, _ = lax.while_loop(lambda s: jnp.any(s[-1]), later_round, state)
  # Rare: equal keys split over chunks. Each key's first row is then its slot's lowest row.
  first = lax.cond(jnp.any(first < 0), lambda: claims.owner_per_slot(slot, admitted), lambda: first)
  flat = layout.shift_overflow(flat, home, slot, admitted & (first == index), +1)
  return flat, slot, first
