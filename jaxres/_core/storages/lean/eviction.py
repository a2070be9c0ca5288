"""Eviction rounds: new keys of a full table take the slot of an entry of their two buckets.

A new key that must evict (the table holds its ``capacity`` entries) has the
slots of its two buckets as candidates, as HierarchicalKV's dual buckets: it
takes the slot of the candidate of lowest score (the first in slot order of
its first bucket, then of its second, on a tie) if that score is lower than
its own, and is refused otherwise. The victim leaves; the key's value is
written in the victim's row, its slot. A full table's free slots (its few
beyond the capacity) score the highest (``NO_SCORE``), so no key takes one:
``size`` never exceeds ``capacity``.

Entries the call names are not candidates: their scores read as the highest
while the rounds run, and are written back after. Under LRU every key a call
names has the newest score, so no masking is needed, and no key of the call
evicts another. Entries the call placed
by evicting are candidates, so that the keys of one batch compete by score as
entries of the table do: a key placed, then evicted by a later row of the
same call, is *displaced* (reported by the row that evicted it, with the
value it offered).

Keys choose in parallel, in rounds of the lowest pending rows, about three per
bucket (as a round of placement takes: with more, the keys of one bucket
choose from stale scores too often). When several choose one slot, it goes to
the lowest batch row (an integer scatter-min claim, deterministic on every
backend) and the others choose again in the next round, seeing what the
winners did. Work is O(batch): each round reads its rows' two buckets.

On CPU one kernel (``jaxres_lean_evict``) replays the same rounds row by row, with the same
claims, so every key takes the slot it takes here.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxres._core import constants, ordering
from jaxres._core.kernels import claims, native
from jaxres._core.storages.lean.layout import Layout

NO_SCORE = np.uint32(np.iinfo(np.uint32).max)  # a free slot's score (storage.NO_SCORE): never evicted


class Outcome(NamedTuple):
  """What the rounds did: the slots' arrays, updated, and batch-sized fields."""

  digests: jax.Array  # the slots' digests
  keys: jax.Array  # the slots' key words
  overflow: jax.Array  # the buckets' overflow counts
  scores: jax.Array  # the slots' scores
  slot: jax.Array  # int32[N]: the slot a row's key took (its victim's)
  placed: jax.Array  # bool[N]: the row's key evicted an entry, took its slot, and stayed
  refused: jax.Array  # bool[N]: the row's key was refused
  displaced: jax.Array  # bool[N]: the row's key evicted an entry, then a later row's key evicted it
  victim_batch: jax.Array  # int32[N]: the row that had placed the victim, if this call's (else -1)
  victim_words: jax.Array  # uint32[N, W]: the victim's key
  victim_score: jax.Array  # uint32[N]: the victim's score


def evict(layout: Layout, digests, keys, overflow, scores, words, pending, new_score, named) -> Outcome:
  """Places the keys of the ``pending`` rows (distinct new keys of a full table) by evicting entries.

  Args:
    layout: the slots' layout; ``digests``, ``keys``, ``overflow``, ``scores``: its arrays.
    words: uint32[N, W] key rows.
    pending: bool[N], one row per new key that must evict to enter.
    new_score: uint32[N], each row's key's score.
    named: int32[N] slots of the entries the call names, which must not be evicted (``-1``:
      none), or ``None`` when scores already protect them: every key of the call then has one
      score (``new_score``, LRU's clock), the highest of the table.
  """
  n = words.shape[0]
  results = Outcome(
    *(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (digests, keys, overflow, scores)),
    slot=jax.ShapeDtypeStruct((n,), jnp.int32),
    placed=jax.ShapeDtypeStruct((n,), jnp.bool_),
    refused=jax.ShapeDtypeStruct((n,), jnp.bool_),
    displaced=jax.ShapeDtypeStruct((n,), jnp.bool_),
    victim_batch=jax.ShapeDtypeStruct((n,), jnp.int32),
    victim_words=jax.ShapeDtypeStruct(words.shape, jnp.uint32),
    victim_score=jax.ShapeDtypeStruct((n,), jnp.uint32),
  )
  protect = named is not None

  def reference(digests, keys, overflow, scores, words, pending, new_score, named):
    return tuple(
      _evict_reference(
        layout, digests, keys, overflow, scores, words, pending, new_score, named if protect else None
      )
    )

  out = native.on_cpu(
    "jaxres_lean_evict", reference, results, digests, keys, overflow, scores, words, pending, new_score,
    named if protect else jnp.zeros((0,), jnp.int32), aliases={0: 0, 1: 1, 2: 2, 3: 3},
    bucket_size=layout.bucket_size,
  )  # fmt: skip
  return Outcome(*out)


def _evict_reference(
  layout: Layout, digests, keys, overflow, scores, words, pending, new_score, named
) -> Outcome:
  """:func:`evict` in XLA: the reference of its kernel, and the GPU/TPU path."""
  n = words.shape[0]
  first, second, digest = layout.buckets_of(words)
  if named is not None:  # read before the masking writes, then written back after the rounds
    named_scores = scores[jnp.maximum(named, 0)]
    taken = jnp.where(ordering.after(named >= 0, named_scores), named, scores.shape[0])
    scores = scores.at[taken].set(NO_SCORE, mode="drop")
  m = min(n, max(constants.CHUNK_MIN_ROWS, constants.LEAN_ROWS_PER_BUCKET * layout.num_buckets))
  scratch = claims.scratch_size(m)

  def round_(state, rows, target):
    rounds, digests, keys, overflow, scores, out, pending = state
    position = jnp.arange(rows.shape[0], dtype=jnp.int32)
    active = pending[rows] & (target < n)
    victim, victim_score = _lowest(layout, scores, jnp.stack([first[rows], second[rows]], axis=1))
    can = active & (victim_score < new_score[rows])
    won = can & (claims.lowest_writer(claims.cell_of(victim, rounds, scratch), can, scratch) == position)
    victim_words = keys[victim]
    old = layout.digest_at(digests, victim)
    won = ordering.after(won, victim_words, old)  # the writes below update the arrays in place
    victim_first, on = layout.probed_on(victim_words, victim)
    overflow = layout.shift_overflow(overflow, victim_first, victim, won & on, -1)
    digests = layout.with_digests(digests, victim, digest[rows] - old, won)
    keys = keys.at[jnp.where(won, victim, keys.shape[0])].set(words[rows], mode="drop")
    scores = scores.at[jnp.where(won, victim, scores.shape[0])].set(new_score[rows], mode="drop")

    def put(field, value, mask):
      return field.at[jnp.where(mask, target, n)].set(value, mode="drop")

    out = out._replace(
      slot=put(out.slot, victim, won),
      placed=put(out.placed, won, won),
      refused=put(out.refused, True, active & ~can),
      victim_words=put(out.victim_words, victim_words, won),
      victim_score=put(out.victim_score, victim_score, won),
    )
    pending = pending.at[jnp.where(active & (~can | won), target, n)].set(False, mode="drop")
    return rounds + 1, digests, keys, overflow, scores, out, pending

  index = jnp.arange(n, dtype=jnp.int32)
  out = Outcome(  # the arrays travel in the loop state, not twice
    digests=None,
    keys=None,
    overflow=None,
    scores=None,
    slot=index * 0,
    placed=jnp.zeros(n, bool),
    refused=jnp.zeros(n, bool),
    displaced=jnp.zeros(n, bool),
    victim_batch=index * 0 - 1,
    victim_words=jnp.zeros_like(words),
    victim_score=jnp.zeros(n, jnp.uint32),
  )
  state = (jnp.int32(0), digests, keys, overflow, scores, out, pending)
  state = claims.rounds(round_, state, m, min(m, claims.chunk_size(n)))
  _, digests, keys, overflow, scores, out, _ = state
  out = out._replace(digests=digests, keys=keys, overflow=overflow, scores=scores)
  if named is None:  # every key of the call scores the highest: none evicts another
    return out
  return _displacements(out._replace(scores=scores.at[taken].set(named_scores, mode="drop")), words)


def _lowest(layout: Layout, scores, pair) -> tuple[jax.Array, jax.Array]:
  """``(slot, score)``: each row's first slot of lowest score in its buckets ``pair`` (int32[R, 2]),
  in slot order of the first bucket, then of the second: one gather of whole buckets, then per
  bucket a min and the first slot holding it (cheaper in XLA than an argmin)."""
  size = layout.bucket_size
  buckets = scores.reshape(layout.num_buckets, size)[pair]  # [R, 2, size]
  low = _halving_min(buckets)
  first = _halving_min(jnp.where(buckets == low[..., None], jnp.arange(size, dtype=jnp.int32), size))
  second = low[:, 1] < low[:, 0]  # a tie goes to the first bucket
  slot = jnp.where(second, pair[:, 1] * size + first[:, 1], pair[:, 0] * size + first[:, 0])
  return slot, jnp.where(second, low[:, 1], low[:, 0])


def _halving_min(x: jax.Array) -> jax.Array:
  """The min over the last axis by halves (elementwise mins of the two halves of what is left, an odd
  element carried): XLA vectorizes these, where a reduction over a short trailing axis runs a lane
  at a time on CPU (a bucket's 128 scores: 2.3x faster)."""
  while x.shape[-1] > 1:
    half = x.shape[-1] // 2
    low = jnp.minimum(x[..., :half], x[..., half : 2 * half])
    x = jnp.concatenate([low, x[..., 2 * half :]], axis=-1) if x.shape[-1] % 2 else low
  return x[..., 0]


def _displacements(out: Outcome, words) -> Outcome:
  """Who displaced whom: a row that evicted the entry of a key this call placed (the victim's key
  is one of the placed rows' keys: the table held none of them before) displaced that row, and
  reports it. The victims' keys are matched to the batch's by claims, without a sort."""
  n = words.shape[0]
  owner = claims.owner_per_key(
    jnp.concatenate([words, out.victim_words]), jnp.concatenate([out.placed, out.placed])
  )[n:]
  victim_batch = jnp.where(out.placed & (owner < n), owner, -1)
  # Each entry is evicted once: the displaced rows are distinct.
  displaced = jnp.zeros(n, bool).at[jnp.where(victim_batch >= 0, victim_batch, n)].set(True, mode="drop")
  return out._replace(placed=out.placed & ~displaced, displaced=displaced, victim_batch=victim_batch)
