"""Eviction rounds: new keys of a full table replace the lowest-score entries of two windows.

A new key's candidates are the occupied slots of two windows of ``window``
buckets each: the first starts at its home bucket, the second at a bucket
chosen by an independent hash of the key (``EVICTION_SEED``), so two keys that
share a home rarely share both windows (it starts past the first: in a table
of few buckets the two cover different ones). A table's ``eviction_window``
fixes ``window``; by default each call sets it from the share of the capacity
its new keys replace (:func:`auto_window`): one bucket for a few keys, up to 32
for a batch of a whole capacity, whose keys would otherwise compete for few
candidates. Entries the call names are not
candidates; entries it placed are, so that the keys of one batch compete by
score as entries of the table do (a key placed, then evicted by a later key of
the same call, is *displaced*: reported by the key that evicted it, with the
value it offered). Under LRU every key a call names has the newest score, so
its keys never evict each other. The key takes the candidate of lowest score
(the first in window, bucket, slot order on a tie) if that score is lower than
its own; else it is refused. The victim leaves, and the key takes the victim's value
row and the first free slot of its first window (a table that evicts is at
most half full, so one is there: lookups then find it from its home as any
key); only if that window has none does it take the victim's slot, and only
if the victim is in that window (else it is refused).

Keys choose in parallel. When several choose one victim (or one free slot),
it goes to the lowest batch row (an integer scatter-min claim, deterministic
on every backend) and the others choose again in the next round, seeing what
the winners did. Work per round is O(rows x (window + bucket_size)). On CPU a
kernel (``jaxres_evict``) runs the same rounds one row at a time.

With a fixed window wider than one bucket, each bucket's lowest score, its
*floor*, is kept beside the scores (``floors``, one ``uint32`` per bucket,
half a byte per slot; the table keeps it exact on every write of a score),
so a key finds its victim by reading the floors of its windows, then the
scores of the one bucket that holds their lowest: the same entry as a scan of
every candidate, at a cost that grows slowly with ``window``. If that entry
is one the call names (protected by position rather than by score), or
without floors (``uint32[0]``: one-bucket windows, whose two buckets' scores
are read directly, and windows set per call), every candidate is scanned.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxres._core import constants, ordering
from jaxres._core.encoding.hashing import hash_words
from jaxres._core.kernels import claims, native
from jaxres._core.storages.open_addressing.buckets import Layout

_NO_SCORE = np.uint32(np.iinfo(np.uint32).max)  # a free slot's score (storage.NO_SCORE): never evicted


class Outcome(NamedTuple):
  """What the rounds did to each row (batch-sized fields)."""

  flat: jax.Array | None  # the bucket records, updated
  scores: jax.Array | None  # the per-slot scores, updated
  floors: jax.Array | None  # the per-bucket lowest scores, updated
  slot: jax.Array  # int32[N]: where a placed row's key now lives
  placed: jax.Array  # bool[N]: the row's key evicted an entry and took its value row (and stayed)
  refused: jax.Array  # bool[N]: the row's key was refused
  displaced: jax.Array  # bool[N]: the row's key evicted an entry, then a later row's key evicted it
  victim_batch: jax.Array  # int32[N]: the row that had placed the victim, if this call's (else -1)
  victim_slot: jax.Array  # int32[N]: the slot of the entry a placed row evicted
  victim_row: jax.Array  # int32[N]: that entry's value row (now the placed key's)
  victim_words: jax.Array  # uint32[N, W]: that entry's key
  victim_score: jax.Array  # uint32[N]: that entry's score


def evict(
  layout: Layout,
  flat: jax.Array,
  scores: jax.Array,
  floors: jax.Array,
  words: jax.Array,
  pending: jax.Array,
  new_score: jax.Array,
  named: jax.Array | None,
  window: int | None,
  capacity: int,
) -> Outcome:
  """Places the keys of the ``pending`` rows (distinct new keys) by evicting entries.

  Args:
    layout: the bucket array's layout; ``flat`` its records, flattened.
    scores: uint32[num_slots], the score of each slot's entry.
    floors: uint32[num_buckets], the lowest of each bucket's scores, or
      uint32[0] (none kept: every candidate is scanned).
    words: uint32[N, W] key rows.
    pending: bool[N], one row per new key that must evict to enter.
    new_score: uint32[N], each row's key's score.
    named: int32[M] slots of the entries the call names, which must not be
      evicted, or ``None`` when scores already protect them: every key of
      the call then has one score (``new_score``, LRU's clock), the highest
      of the table, so no key of the call can evict another either.
    window: buckets in each of a key's two windows of candidates, or ``None``:
      :func:`auto_window` of the pending rows and ``capacity``.
    capacity: the table's capacity (entries).
  """
  n, protect = words.shape[0], named is not None
  records = flat.reshape(layout.num_buckets, layout.record_width)
  results = (
    jax.ShapeDtypeStruct(records.shape, jnp.uint32),
    jax.ShapeDtypeStruct(scores.shape, jnp.uint32),
    jax.ShapeDtypeStruct(floors.shape, jnp.uint32),
    *[jax.ShapeDtypeStruct((n,), t) for t in (jnp.int32, bool, bool, bool, jnp.int32, jnp.int32, jnp.int32)],
    jax.ShapeDtypeStruct(words.shape, jnp.uint32),
    jax.ShapeDtypeStruct((n,), jnp.uint32),
  )

  def reference(records, scores, floors, words, pending, new_score, named):
    outcome = _evict_reference(
      layout,
      records.reshape(-1),
      scores,
      floors,
      words,
      pending,
      new_score,
      named if protect else None,
      window,
      capacity,
    )
    return tuple(outcome._replace(flat=outcome.flat.reshape(records.shape)))

  named = named if protect else jnp.zeros((0,), jnp.int32)
  args = (records, scores, floors, words, pending, new_score, named)
  outcome = Outcome(
    *native.on_cpu(
      "jaxres_evict",
      reference,
      results,
      *args,
      aliases={0: 0, 1: 1, 2: 2},
      bucket_size=layout.bucket_size,
      window=0 if window is None else window,
      capacity=capacity,
      protect=protect,
    )
  )
  return outcome._replace(flat=outcome.flat.reshape(-1))


AUTO_WINDOWS = tuple(1 << k for k in range(constants.MAX_AUTO_EVICTION_WINDOW.bit_length()))


def auto_window(count: jax.Array, capacity: int) -> jax.Array:
  """int32 index into :data:`AUTO_WINDOWS` of the window for ``count`` keys that must evict.

  The widest window ``w`` with ``w * capacity <= AUTO_EVICTION_SHARE * count`` (else 1): the
  candidates grow with the share of the table one call replaces, where keys of one batch would
  otherwise compete for few of them.

  Examples:
    >>> from jaxres._core.storages.open_addressing.eviction_rounds import AUTO_WINDOWS, auto_window
    >>> [AUTO_WINDOWS[int(auto_window(jnp.int32(n), 1 << 20))] for n in (4096, 1 << 16, 1 << 19, 1 << 20)]
    [1, 2, 16, 32]
  """
  return sum((count >= n).astype(jnp.int32) for n in _least_counts(capacity))


def reachable_windows(rows: int, capacity: int) -> tuple[int, ...]:
  """The leading windows of :data:`AUTO_WINDOWS` that :func:`auto_window` picks for at most ``rows``
  keys: a call's program holds the choice for these alone (a batch far below the capacity: one).

  Examples:
    >>> from jaxres._core.storages.open_addressing.eviction_rounds import reachable_windows
    >>> reachable_windows(4096, 1 << 20), reachable_windows(1 << 19, 1 << 20)
    ((1,), (1, 2, 4, 8, 16))
  """
  return AUTO_WINDOWS[: 1 + sum(rows >= n for n in _least_counts(capacity))]


def _distinct_windows(layout: Layout, widths: tuple[int, ...]) -> tuple[int, ...]:
  """The leading ``widths`` up to the first that covers every bucket: wider ones choose as it does.

  Examples:
    >>> from jaxres._core.storages.open_addressing.buckets import Layout
    >>> _distinct_windows(Layout(num_buckets=4, bucket_size=8, num_words=1), (1, 2, 4, 8, 16))
    (1, 2, 4)
  """
  covering = [w >= layout.num_buckets for w in widths]
  return widths[: covering.index(True) + 1] if any(covering) else widths


def _least_counts(capacity: int) -> list[int]:
  """The fewest keys that must evict for each window of :data:`AUTO_WINDOWS` past the first."""
  share = constants.AUTO_EVICTION_SHARE
  return [min(-(-width * capacity // share), np.iinfo(np.int32).max) for width in AUTO_WINDOWS[1:]]


def windows(layout: Layout, home: jax.Array, spread: jax.Array, window: int) -> jax.Array:
  """int32[N, 2 * window]: the buckets of each key row's two windows, in the order candidates rank.

  ``home`` is each row's home bucket (``layout.home``), ``spread`` its hash at
  ``EVICTION_SEED``. The second window starts at one of the buckets past the first, picked by
  that independent hash: in a table of few buckets, the two windows still cover different ones.
  """
  nb = layout.num_buckets
  if nb > window:
    past = spread % jnp.uint32(nb - window)
    second = (home + window + past.astype(jnp.int32)) % nb
  else:
    second = home
  steps = jnp.arange(window, dtype=jnp.int32)
  starts = jnp.stack([home, second], axis=1)
  return ((starts[:, :, None] + steps) % layout.num_buckets).reshape(home.shape[0], 2 * window)


def floors_of(layout: Layout, scores: jax.Array) -> jax.Array:
  """uint32[num_buckets]: the lowest score of each bucket (a whole pass: for checks, not calls)."""
  return jnp.min(scores.reshape(layout.num_buckets, layout.bucket_size), axis=-1)


def refresh_floors(layout: Layout, scores: jax.Array, floors: jax.Array, bucket, mask) -> jax.Array:
  """``floors`` with those of ``bucket`` (where ``mask``) recomputed from ``scores``: O(batch).

  Rows naming one bucket write the same value, so the scatter is deterministic.
  """
  lowest = jnp.min(layout.bucket_rows(scores, jnp.clip(bucket, 0, layout.num_buckets - 1)), axis=-1)
  return floors.at[jnp.where(mask, bucket, floors.shape[0])].set(lowest, mode="drop")


def _choose(layout, flat, scores, floors, row_words, home, spread, lane, taken, window):
  """Each row's victim, its score, and the slot its key takes (-1: none), in windows of ``window``."""
  size = layout.bucket_size
  bucket = windows(layout, home, spread, window)  # [R, 2 * window]

  # Scores alone decide: a free slot scores _NO_SCORE (the table keeps it so), never lower.
  if taken is None and floors.shape[0]:  # the first bucket of lowest floor, then its first lowest slot
    victim_bucket = _chosen(bucket, jnp.argmin(floors[bucket], axis=-1))
    bucket_scores = layout.bucket_rows(scores, victim_bucket)  # [R, size]
    offset = jnp.argmin(bucket_scores, axis=-1)
    victim, victim_score = victim_bucket * size + offset.astype(jnp.int32), _chosen(bucket_scores, offset)
  else:  # every candidate is read (named entries protected by position)
    rows = row_words.shape[0]
    candidate = (bucket[:, :, None] * size + jnp.arange(size, dtype=jnp.int32)).reshape(rows, -1)
    candidate_score = layout.bucket_rows(scores, bucket).reshape(rows, -1)
    if taken is not None:
      candidate_score = jnp.where(_among(candidate, taken), _NO_SCORE, candidate_score)
    choice = jnp.argmin(candidate_score, axis=-1)  # the first minimum
    victim, victim_score = _chosen(candidate, choice), _chosen(candidate_score, choice)
  # Where the key goes: the first bucket of its first window with a free slot, the free slot its
  # lane picks there (as placing.py: keys sharing the bucket rarely pick the same slot); else
  # the victim's slot if it is in that window.
  free = ~layout.occupancy(flat[layout.column(bucket[:, :window], layout.mask_column)])  # [R, window, size]
  room = jnp.any(free, axis=-1)
  first = jnp.argmax(room, axis=-1)
  free = _chosen(free, first)  # [R, size]
  nth = lane % jnp.maximum(jnp.sum(free, axis=-1, dtype=jnp.uint32), 1)
  offset = jnp.argmax(free & (jnp.cumsum(free, axis=-1, dtype=jnp.uint32) == (nth + 1)[:, None]), axis=-1)
  first_free = _chosen(bucket, first) * size + offset.astype(jnp.int32)
  in_first = (victim // size - home) % layout.num_buckets < window
  slot = jnp.where(jnp.any(room, axis=-1), first_free, jnp.where(in_first, victim, -1))
  return victim, victim_score, slot


def _evict_reference(
  layout, flat, scores, floors, words, pending, new_score, named, window, capacity
) -> Outcome:
  """:func:`evict` in data-parallel rounds: the GPU/TPU path and the kernel's reference."""
  n, size = words.shape[0], layout.bucket_size
  taken = None if named is None else jnp.sort(named)
  # Per-call windows: each round switches on the window for the choice alone, which reads the table
  # and writes none of it, so that no branch holds a copy of the records.
  # A call of n rows holds the branches its count of pending keys can reach (a batch far below the
  # capacity: window 1 alone, no switch), and one for all windows of at least every bucket (they
  # choose alike: a key's candidates, in the order they rank, are then its buckets from home on).
  reachable = (window,) if window is not None else _distinct_windows(layout, reachable_windows(n, capacity))
  per_call = None
  if len(reachable) > 1:
    per_call = jnp.minimum(auto_window(jnp.sum(pending, dtype=jnp.int32), capacity), len(reachable) - 1)

  # Each row's hashes, once: the rounds (two traced) and the window branches gather them.
  hashes = (
    layout.home(words),
    hash_words(words, seed=constants.EVICTION_SEED),
    (hash_words(words, seed=constants.LANE_SEED) * np.uint32(constants.GOLDEN_MIX)) >> 16,
  )

  def choose(*args):  # (flat, scores, floors, row_words, home, spread, lane)
    if per_call is None:
      return _choose(layout, *args, taken, reachable[0])
    branches = [functools.partial(_choose, layout, taken=taken, window=w) for w in reachable]
    return lax.switch(per_call, branches, *args)

  def round_(state, rows, target):
    rounds, flat, scores, floors, out, pending = state
    position = jnp.arange(rows.shape[0], dtype=jnp.int32)
    active = pending[rows] & (target < n)
    row_words = words[rows]
    home, spread, lane = (h[rows] for h in hashes)
    victim, victim_score, slot = choose(flat, scores, floors, row_words, home, spread, lane)
    can = active & (victim_score < new_score[rows]) & (slot >= 0)
    scratch = claims.scratch_size(rows.shape[0], constants.EVICTION_CELLS_PER_ROW)
    winner = claims.lowest_writer(claims.cell_of(victim, rounds, scratch), can, scratch)
    won = can & (winner == position)
    taker = claims.lowest_writer(claims.cell_of(slot, rounds, scratch), won, scratch)
    won = won & (taker == position)
    before = _placer(out, victim, won) if named is not None else jnp.full_like(victim, -1)
    victim_words = _chosen(layout.keys_of(layout.records(flat, victim // size)), victim % size)
    victim_row = layout.row_of(flat, victim)
    won = ordering.after(won, victim_words, victim_row)  # the writes below update flat in place
    flat = layout.unset(flat, victim, won)
    flat = layout.shift_overflow(flat, layout.home(victim_words), victim, won, -1)
    flat = layout.store(flat, slot, row_words, won)
    flat = flat.at[jnp.where(won, layout.row_cell(slot), flat.size)].set(
      victim_row.astype(jnp.uint32), mode="drop"
    )
    flat = layout.shift_overflow(flat, home, slot, won, +1)
    scores = scores.at[jnp.where(won, victim, scores.shape[0])].set(_NO_SCORE, mode="drop")  # freed
    scores = scores.at[jnp.where(won, slot, scores.shape[0])].set(new_score[rows], mode="drop")
    if floors.shape[0]:
      changed = jnp.concatenate([victim, slot]) // size
      floors = refresh_floors(layout, scores, floors, changed, jnp.concatenate([won, won]))

    def put(field, value, mask):
      return field.at[jnp.where(mask, target, n)].set(value, mode="drop")

    refused = active & ~can
    displaced = jnp.where(before >= 0, before, n)  # distinct: victims are
    out = out._replace(
      slot=put(out.slot, slot, won),
      placed=put(out.placed, won, won).at[displaced].set(False, mode="drop"),
      refused=put(out.refused, refused, refused),
      displaced=out.displaced.at[displaced].set(True, mode="drop"),
      victim_batch=put(out.victim_batch, before, won),
      victim_slot=put(out.victim_slot, victim, won),
      victim_row=put(out.victim_row, victim_row, won),
      victim_words=put(out.victim_words, victim_words, won),
      victim_score=put(out.victim_score, victim_score, won),
    )
    return rounds + 1, flat, scores, floors, out, pending.at[target].set(can & ~won, mode="drop")

  def later_round(state):
    return round_(state, *claims.pending_rows(state[-1], claims.chunk_size(n)))

  index = jnp.arange(n, dtype=jnp.int32)
  out = Outcome(  # the records, scores and floors travel in the loop state, not twice
    flat=None,
    scores=None,
    floors=None,
    slot=index * 0,
    placed=jnp.zeros(n, bool),
    refused=jnp.zeros(n, bool),
    displaced=jnp.zeros(n, bool),
    victim_batch=index * 0 - 1,
    victim_slot=index * 0,
    victim_row=index * 0,
    victim_words=jnp.zeros((n, layout.num_words), jnp.uint32),
    victim_score=jnp.zeros(n, jnp.uint32),
  )
  # The first round takes up to half the batch (the new keys of a typical call), lowest rows first.
  state = round_(
    (jnp.int32(0), flat, scores, floors, out, pending), *claims.pending_rows(pending, max(1, n // 2))
  )
  _, flat, scores, floors, out, _ = lax.while_loop(lambda s: jnp.any(s[-1]), later_round, state)
  return out._replace(flat=flat, scores=scores, floors=floors)


def _placer(out: Outcome, victim: jax.Array, won: jax.Array) -> jax.Array:
  """int32[R]: the row that placed each victim a row won, if this call placed it (else -1).

  That row is then displaced. A sort of the batch per round: only where the call's keys can evict
  each other. Where the scores protect the entries a call names (``named`` is ``None``), every new
  key carries the highest score, so a key this call placed is never lower than a newcomer's.
  """
  n = out.slot.shape[0]
  placed_slots = jnp.where(out.placed, out.slot, jnp.iinfo(jnp.int32).max)
  by_slot = jnp.argsort(placed_slots).astype(jnp.int32)
  at = jnp.clip(jnp.searchsorted(placed_slots[by_slot], victim), 0, n - 1)
  return jnp.where(won & (placed_slots[by_slot[at]] == victim), by_slot[at], -1)


def _chosen(x: jax.Array, at: jax.Array) -> jax.Array:
  """``x[r, at[r]]`` for each row ``r``."""
  return jnp.take_along_axis(x, at.reshape(-1, *[1] * (x.ndim - 1)), axis=1)[:, 0]


def _among(candidate: jax.Array, taken: jax.Array) -> jax.Array:
  """bool[R, C]: which candidate slots are among the sorted slots ``taken``."""
  if taken.shape[0] == 0:
    return jnp.zeros(candidate.shape, bool)
  at = jnp.clip(jnp.searchsorted(taken, candidate), 0, taken.shape[0] - 1)
  return taken[at] == candidate
