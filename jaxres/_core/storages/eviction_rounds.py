"""Eviction rounds: new keys of a full table replace low-score entries of their home bucket.

Each new key's candidates are the entries of its home bucket that the call
does not name (``bucket_size`` slots: what one probe reads). It takes the one
of lowest score (the first in slot order on a tie) if that score is lower than
its own: the key takes the entry's slot and the entry leaves. When no
candidate there has a lower score (or the bucket has none), it looks in the
next bucket the same way, up to ``WINDOW`` buckets; then it is refused.

Keys choose in parallel; when several choose one entry, it goes to the lowest
batch row (an integer scatter-min claim, deterministic on every backend) and
the others choose again in the next round, seeing what the winners placed.
Work per round is O(rows x bucket_size). On CPU a kernel (``jaxres_evict``)
runs the same rounds one row at a time.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxres._core import constants
from jaxres._core.kernels import claims, native
from jaxres._core.storages.buckets import Layout

WINDOW = constants.EVICTION_WINDOW  # buckets a new key may look in: its home, then the next
_NO_SCORE = np.uint32(np.iinfo(np.uint32).max)


class Outcome(NamedTuple):
  """What the rounds did to each row (batch-sized fields)."""

  flat: jax.Array | None  # the bucket records, updated
  scores: jax.Array | None  # the per-slot scores, updated
  step: jax.Array  # int32[N]: buckets past home the row looked in
  slot: jax.Array  # int32[N]: where a placed row's key now lives
  placed: jax.Array  # bool[N]: the row's key took an entry's slot
  refused: jax.Array  # bool[N]: the row's key was refused
  victim_slot: jax.Array  # int32[N]: the slot of the entry a placed row evicted
  victim_words: jax.Array  # uint32[N, W]: that entry's key
  victim_score: jax.Array  # uint32[N]: that entry's score


def evict(
  layout: Layout,
  flat: jax.Array,
  scores: jax.Array,
  words: jax.Array,
  pending: jax.Array,
  new_score: jax.Array,
  named: jax.Array | None,
) -> Outcome:
  """Places the keys of the ``pending`` rows (distinct new keys) by evicting entries.

  Args:
    layout: the bucket array's layout; ``flat`` its records, flattened.
    scores: uint32[num_slots], the score of each slot's entry.
    words: uint32[N, W] key rows.
    pending: bool[N], one row per new key that must evict to enter.
    new_score: uint32[N], each row's key's score.
    named: int32[M] slots of the entries the call names, which must not be
      evicted, or ``None`` when scores already protect them (every named
      entry's score then equals the highest a new key can have).
  """
  n, protect = words.shape[0], named is not None
  records = flat.reshape(layout.num_buckets, layout.record_width)
  results = (
    jax.ShapeDtypeStruct(records.shape, jnp.uint32),
    jax.ShapeDtypeStruct(scores.shape, jnp.uint32),
    *[jax.ShapeDtypeStruct((n,), dtype) for dtype in (jnp.int32, jnp.int32, bool, bool, jnp.int32)],
    jax.ShapeDtypeStruct(words.shape, jnp.uint32),
    jax.ShapeDtypeStruct((n,), jnp.uint32),
  )

  def reference(records, scores, words, pending, new_score, named):
    outcome = _evict_reference(
      layout, records.reshape(-1), scores, words, pending, new_score, named if protect else None
    )
    return tuple(outcome._replace(flat=outcome.flat.reshape(records.shape)))

  named = named if protect else jnp.zeros((0,), jnp.int32)
  args = (records, scores, words, pending, new_score, named)
  outcome = Outcome(
    *native.on_cpu(
      "jaxres_evict",
      reference,
      results,
      *args,
      aliases={0: 0, 1: 1},
      bucket_size=layout.bucket_size,
      protect=protect,
    )
  )
  return outcome._replace(flat=outcome.flat.reshape(-1))


def _evict_reference(layout, flat, scores, words, pending, new_score, named) -> Outcome:
  """:func:`evict` in data-parallel rounds: the GPU/TPU path and the kernel's reference."""
  n = words.shape[0]

  def round_(state, rows, target):
    rounds, flat, scores, out, pending = state
    position = jnp.arange(rows.shape[0], dtype=jnp.int32)
    active = pending[rows] & (target < n)
    home = layout.home(words[rows])
    bucket = (home + out.step[rows]) % layout.num_buckets
    records = layout.records(flat, bucket)  # [R, record]: one gather
    candidate = bucket[:, None] * layout.bucket_size + jnp.arange(layout.bucket_size, dtype=jnp.int32)
    eligible = layout.occupancy(records[:, layout.mask_column])
    if named is not None:
      eligible = eligible & ~_among(candidate, named, out.slot, out.placed)
    candidate_score = jnp.where(eligible, layout.bucket_rows(scores, bucket), _NO_SCORE)
    choice = jnp.argmin(candidate_score, axis=-1)  # the first minimum

    def chosen(x):
      return jnp.take_along_axis(x, choice.reshape(-1, *[1] * (x.ndim - 1)), axis=1)[:, 0]

    victim, victim_score = chosen(candidate), chosen(candidate_score)
    lower = victim_score < new_score[rows]  # the lowest candidate here can be replaced
    onward = active & ~lower & (out.step[rows] < WINDOW - 1)  # else: the next bucket
    can = active & lower
    refused = active & ~can & ~onward
    scratch = claims.scratch_size(rows.shape[0])
    winner = claims.lowest_writer(claims.cell_of(victim, rounds, scratch), can, scratch)
    won = can & (victim[winner] == victim) & (winner == position)
    victim_words = chosen(layout.keys_of(records))
    flat = layout.unset(flat, victim, won)
    flat = layout.shift_overflow(flat, layout.home(victim_words), victim, won, -1)
    flat = layout.store(flat, victim, words[rows], won)
    flat = layout.shift_overflow(flat, home, victim, won, +1)
    scores = scores.at[jnp.where(won, victim, scores.shape[0])].set(new_score[rows], mode="drop")

    def put(field, value, mask):
      return field.at[jnp.where(mask, target, n)].set(value, mode="drop")

    out = out._replace(
      step=put(out.step, out.step[rows] + 1, onward),
      slot=put(out.slot, victim, won),
      placed=put(out.placed, won, won),
      refused=put(out.refused, refused, refused),
      victim_slot=put(out.victim_slot, victim, won),
      victim_words=put(out.victim_words, victim_words, won),
      victim_score=put(out.victim_score, victim_score, won),
    )
    still = active & (onward | (can & ~won))
    return rounds + 1, flat, scores, out, pending.at[target].set(still, mode="drop")

  def later_round(state):
    return round_(state, *claims.pending_rows(state[-1], claims.chunk_size(n)))

  index = jnp.arange(n, dtype=jnp.int32)
  out = Outcome(  # the records and scores travel in the loop state, not twice
    flat=None,
    scores=None,
    step=index * 0,
    slot=index * 0,
    placed=jnp.zeros(n, bool),
    refused=jnp.zeros(n, bool),
    victim_slot=index * 0,
    victim_words=jnp.zeros((n, layout.num_words), jnp.uint32),
    victim_score=jnp.zeros(n, jnp.uint32),
  )
  # The first round takes up to half the batch (the new keys of a typical call), lowest rows first.
  state = round_((jnp.int32(0), flat, scores, out, pending), *claims.pending_rows(pending, max(1, n // 2)))
  _, flat, scores, out, _ = lax.while_loop(lambda s: jnp.any(s[-1]), later_round, state)
  return out._replace(flat=flat, scores=scores)


def _among(candidate: jax.Array, named: jax.Array, slot: jax.Array, placed: jax.Array) -> jax.Array:
  """bool[R, C]: which candidate slots hold entries the call names or has placed."""
  taken = jnp.sort(jnp.concatenate([named, jnp.where(placed, slot, -1)]))
  at = jnp.clip(jnp.searchsorted(taken, candidate), 0, taken.shape[0] - 1)
  return taken[at] == candidate
