"""Eviction rounds: new keys of a full table replace low-score entries near their home bucket.

Each new key looks at the entries of its *window*: its home bucket and the
``WINDOW - 1`` buckets after it (``WINDOW * bucket_size`` slots, the buckets a
probe for it would visit first). Among the entries there that the call does
not name, it picks the one of lowest score, the one nearest its home (probe
order, then slot order) on a tie. If that score is lower than the new key's
own, the key takes the entry's slot and the entry leaves; otherwise the key
is refused. Keys choose in parallel; when several choose one entry, it goes to
the lowest batch row (an integer scatter-min claim, deterministic on every
backend) and the others choose again in the next round, seeing what the
winners placed. Work per round is O(rows x WINDOW x bucket_size).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxres._core import claims
from jaxres._core.buckets import Layout

WINDOW = 2  # buckets a new key may evict from: its home bucket and the next
_NO_SCORE = np.uint32(np.iinfo(np.uint32).max)


class Outcome(NamedTuple):
  """What the rounds did to each row (batch-sized fields)."""

  flat: jax.Array  # the bucket records, updated
  scores: jax.Array  # the per-slot scores, updated
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
  n = words.shape[0]
  num_words = layout.num_words

  def round_(state, rows, target):
    rounds, flat, scores, out, pending = state
    position = jnp.arange(rows.shape[0], dtype=jnp.int32)
    active = pending[rows] & (target < n)
    home = layout.home(words[rows])
    bucket = (home[:, None] + jnp.arange(WINDOW)) % layout.num_buckets
    records = layout.records(flat, bucket)  # [R, WINDOW, record]
    occupied = layout.occupancy(records[..., layout.mask_column]).reshape(rows.shape[0], -1)
    candidate = (bucket[..., None] * layout.bucket_size + jnp.arange(layout.bucket_size)).reshape(
      occupied.shape
    )
    eligible = occupied if named is None else occupied & ~_among(candidate, named, out.slot, out.placed)
    candidate_score = jnp.where(eligible, scores[candidate], _NO_SCORE)
    choice = jnp.argmin(candidate_score, axis=-1)  # the first minimum: nearest the home bucket
    victim = jnp.take_along_axis(candidate, choice[:, None], axis=-1)[:, 0]
    victim_score = jnp.take_along_axis(candidate_score, choice[:, None], axis=-1)[:, 0]
    can = (
      active
      & jnp.take_along_axis(eligible, choice[:, None], axis=-1)[:, 0]
      & (victim_score < new_score[rows])
    )
    scratch = claims.scratch_size(rows.shape[0])
    winner = claims.lowest_writer(claims.cell_of(victim, rounds, scratch), can, scratch)
    won = can & (victim[winner] == victim) & (winner == position)
    victim_words = layout.keys_of(records).reshape(rows.shape[0], -1, num_words)
    victim_words = jnp.take_along_axis(victim_words, choice[:, None, None], axis=1)[:, 0]
    flat = layout.unset(flat, victim, won)
    flat = layout.shift_overflow(flat, layout.home(victim_words), victim, won, -1)
    flat = layout.store(flat, victim, words[rows], won)
    flat = layout.shift_overflow(flat, home, victim, won, +1)
    scores = scores.at[jnp.where(won, victim, scores.shape[0])].set(new_score[rows], mode="drop")

    def put(field, value, mask):
      return field.at[jnp.where(mask, target, n)].set(value, mode="drop")

    out = out._replace(
      slot=put(out.slot, victim, won),
      placed=put(out.placed, won, won),
      refused=put(out.refused, active & ~can, active & ~can),
      victim_slot=put(out.victim_slot, victim, won),
      victim_words=put(out.victim_words, victim_words, won),
      victim_score=put(out.victim_score, victim_score, won),
    )
    return rounds + 1, flat, scores, out, pending.at[target].set(active & can & ~won, mode="drop")

  def later_round(state):
    return round_(state, *claims.pending_rows(state[-1], claims.chunk_size(n)))

  index = jnp.arange(n, dtype=jnp.int32)
  out = Outcome(  # the records and scores travel in the loop state, not twice
    flat=None,
    scores=None,
    slot=index * 0,
    placed=jnp.zeros(n, bool),
    refused=jnp.zeros(n, bool),
    victim_slot=index * 0,
    victim_words=jnp.zeros((n, num_words), jnp.uint32),
    victim_score=jnp.zeros(n, jnp.uint32),
  )
  state = round_((jnp.int32(0), flat, scores, out, pending), index, index)
  _, flat, scores, out, _ = lax.while_loop(lambda s: jnp.any(s[-1]), later_round, state)
  return out._replace(flat=flat, scores=scores)


def _among(candidate: jax.Array, named: jax.Array, slot: jax.Array, placed: jax.Array) -> jax.Array:
  """bool[R, C]: which candidate slots hold entries the call names or has placed."""
  taken = jnp.sort(jnp.concatenate([named, jnp.where(placed, slot, -1)]))
  at = jnp.clip(jnp.searchsorted(taken, candidate), 0, taken.shape[0] - 1)
  return taken[at] == candidate
