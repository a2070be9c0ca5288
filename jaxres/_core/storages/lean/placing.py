"""Placing new keys into free slots by claims, without sorting.

An upsert (:func:`upsert_slots`) locates its keys, admits the new ones that
fit (the first ``capacity - size`` distinct ones, in batch order), and places
each admitted key once (the first row of each key; the others follow it), in
rounds:

1. **Pairs.** Each round takes the lowest pending rows (at most
   ``3 x num_buckets``: buckets see the rounds' placements before they fill,
   so the choice between a key's buckets stays good for a whole table at
   once). From the slots as the round found them, a row whose two buckets
   have room picks one (its first, unless the second has more than 4 more
   free slots: :meth:`Layout.second_choice`) and the free slot its lane picks
   there; a row whose buckets are both full waits for step 2.
2. **Probing on.** The waiting rows try the buckets after their first one,
   one bucket per round, a chunk at a time.

In each round the rows claim their slots with an integer scatter-min of
their batch index into a batch-sized scratch array, at a cell hashed from the
slot (:mod:`jaxres._core.kernels.claims`): the lowest row wins on every
backend; the others try again in the next round. Work is O(batch).

On CPU one kernel (``jaxres_lean_upsert``) replays the same rounds row by row, with the same
claims, so it places every key where this module does.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxres._core import constants
from jaxres._core.kernels import claims, native
from jaxres._core.storages.lean import probing
from jaxres._core.storages.lean.layout import Layout, nth_bit


class Upserted(NamedTuple):
  """What :func:`upsert_slots` did to a batch of ``N`` key rows."""

  digests: jax.Array  # the slots' digests, with the admitted keys'
  keys: jax.Array  # the slots' key words, with the admitted keys'
  overflow: jax.Array  # the buckets' overflow counts
  found: jax.Array  # bool[N]: active rows whose key was in the table
  slot: jax.Array  # int32[N]: each row's slot (a miss not admitted: the first of its first bucket)
  admitted: jax.Array  # bool[N]: active rows whose key was new and fits, now placed
  dropped: jax.Array  # int32[]: distinct new keys that did not fit
  first: jax.Array  # int32[N]: for a new key's row the first row of its key, else the row itself


def upsert_slots(layout: Layout, digests, keys, overflow, words, active, size, capacity: int) -> Upserted:
  """Locates the keys of the ``active`` rows, admits the new ones that fit, and places them (on CPU
  the kernel ``jaxres_lean_upsert``, which replays the rounds below, updating the arrays in place).

  Args:
    layout: the slots' layout; ``digests``, ``keys``, ``overflow``: its arrays.
    words: uint32[N, W] key rows; ``active``: bool[N], the rows taking part.
    size: int32[], the table's live entries; ``capacity``: the entries it holds.
  """
  n = words.shape[0]
  flag, index = jax.ShapeDtypeStruct((n,), jnp.bool_), jax.ShapeDtypeStruct((n,), jnp.int32)
  results = Upserted(
    *(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (digests, keys, overflow)),
    flag, index, flag, jax.ShapeDtypeStruct((), jnp.int32), index,
  )  # fmt: skip
  reference = lambda *args: tuple(_upsert_reference(layout, *args, capacity))
  out = native.on_cpu(
    "jaxres_lean_upsert", reference, results, digests, keys, overflow, words, active, size,
    aliases={0: 0, 1: 1, 2: 2}, bucket_size=layout.bucket_size, capacity=capacity,
  )  # fmt: skip
  return Upserted(*out)


def _upsert_reference(
  layout: Layout, digests, keys, overflow, words, active, size, capacity: int
) -> Upserted:
  """:func:`upsert_slots` in XLA: the reference of its kernel, and the GPU/TPU path."""
  n = words.shape[0]
  index = jnp.arange(n, dtype=jnp.int32)
  hit, slot = probing.locate(layout, digests, keys, overflow, words)
  new = active & ~hit
  first = claims.owner_per_key(words, new)
  head = new & (first == index)
  room = jnp.maximum(capacity - size, 0)
  admitted_head = head & (claims.prefix_sum(head) <= room)
  dropped = jnp.sum(head, dtype=jnp.int32) - jnp.sum(admitted_head, dtype=jnp.int32)
  digests, keys, overflow, placed = place(layout, digests, keys, overflow, words, admitted_head)
  admitted = new & admitted_head[first]
  slot = jnp.where(admitted, placed[first], slot)
  return Upserted(digests, keys, overflow, hit & active, slot, admitted, dropped, first)


def place(layout: Layout, digests, keys, overflow, words, pending) -> tuple:
  """Places the keys of the ``pending`` rows (distinct new keys, as many as the table has room for):
  ``(digests, keys, overflow, slot)``, ``slot`` each placed row's."""
  n, size = words.shape[0], layout.bucket_size
  first, second, digest = layout.buckets_of(words)
  lane = layout.lane(words)
  m = min(n, max(constants.CHUNK_MIN_ROWS, constants.LEAN_ROWS_PER_BUCKET * layout.num_buckets))
  chunk = claims.chunk_size(n)

  def claim(state, rows, target, bucket, free, scratch):
    """Rows ``rows`` claim the lane's free slot of ``bucket`` (``free``: its free bitmask) through
    ``scratch`` cells; ``state``: ``(rounds, digests, keys, slot, pending)``, as every round's state
    begins."""
    rounds, digests, keys, slot, pending = state
    position = jnp.arange(rows.shape[0], dtype=jnp.int32)
    num_free = jnp.sum(lax.population_count(free), axis=-1, dtype=jnp.uint32)
    trying = pending[rows] & (target < n) & (num_free > 0)
    candidate = bucket * size + nth_bit(free, layout.nth_free(lane[rows], num_free))
    won = trying & (
      claims.lowest_writer(claims.cell_of(candidate, rounds, scratch), trying, scratch) == position
    )
    digests = layout.with_digests(digests, candidate, digest[rows], won)
    keys = keys.at[jnp.where(won, candidate, keys.shape[0])].set(words[rows], mode="drop")
    slot = slot.at[jnp.where(won, target, n)].set(candidate, mode="drop")
    return rounds + 1, digests, keys, slot, pending.at[jnp.where(won, target, n)].set(False, mode="drop")

  def pair_round(state, rows, target):
    *state, spilled, pending = state
    frees = layout.free(layout.digest_words(state[1], jnp.stack([first[rows], second[rows]], axis=1)))
    counts = jnp.sum(lax.population_count(frees), axis=-1, dtype=jnp.int32)  # [rows, 2]
    other = layout.second_choice(counts[:, 0], counts[:, 1])
    full = (counts[:, 0] == 0) & (counts[:, 1] == 0) & (target < n) & pending[rows]
    spilled = spilled.at[jnp.where(full, target, n)].set(True, mode="drop")
    pending = pending.at[jnp.where(full, target, n)].set(False, mode="drop")
    bucket = jnp.where(other, second[rows], first[rows])
    free = jnp.where(other[:, None], frees[:, 1], frees[:, 0])
    *state, pending = claim((*state, pending), rows, target, bucket, free, claims.scratch_size(m))
    return (*state, spilled, pending)

  def probe_round(state):
    *state, pending, cursor = state
    rows, target = claims.pending_rows(pending, chunk)
    bucket = (cursor[rows] + 1) % layout.num_buckets
    free = layout.free(layout.digest_words(state[1], bucket))
    full = jnp.all(free == 0, axis=-1)
    cursor = cursor.at[jnp.where(full, target, n)].set(bucket, mode="drop")
    return (*claim((*state, pending), rows, target, bucket, free, claims.scratch_size(chunk)), cursor)

  state = (jnp.int32(0), digests, keys, jnp.zeros(n, jnp.int32), jnp.zeros(n, bool), pending)
  *state, spilled, _ = claims.rounds(pair_round, state, m, min(m, chunk))
  state = (*state, spilled, first)
  _, digests, keys, slot, _, _ = lax.while_loop(lambda s: jnp.any(s[-2]), probe_round, tuple(state))
  overflow = layout.shift_overflow(overflow, first, slot, spilled, +1)
  return digests, keys, overflow, slot
