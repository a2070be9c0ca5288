"""Finding keys in the slots: their two buckets' digests, the keys of the slots that match, and
(rarely) the buckets past the first while they have overflow (see :mod:`layout`).

:func:`locate` reads both buckets' digest words at once (one gather), reads
the keys of the first :data:`FIRST_CANDIDATES` slots whose digest matches, and
leaves the rare rest (more matches, or a first bucket with overflow) to a loop
over a chunk of rows at a time. It is the reference of the CPU kernel ``jaxres_lean_locate``
(``kernels.cc``, through ``LeanTable._locate``) and the path of every other backend.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxres._core.kernels import claims
from jaxres._core.storages.lean.layout import Layout, lowest_bit

FIRST_CANDIDATES = 3  # matching slots whose keys every row reads (more: about 2 % of a full table's misses)
RARE_FRACTION = 32  # rows searched further a chunk at a time: a chunk is this fraction of the batch


def locate(layout: Layout, digests, keys, overflow, words) -> tuple[jax.Array, jax.Array]:
  """``(hit, slot)`` of each key row: its slot, or for a miss the first slot of its first bucket."""
  n = words.shape[0]
  first, second, digest = layout.buckets_of(words)
  pair = jnp.stack([first, second], axis=1)
  masks = layout.matching(layout.digest_words(digests, pair), digest[:, None]).reshape(n, -1)
  hit, slot = jnp.zeros(n, bool), first * layout.bucket_size
  for _ in range(FIRST_CANDIDATES):
    masks, candidate, some = _next_candidate(layout, masks, pair)
    equal = some & ~hit & jnp.all(keys[candidate] == words, axis=-1)
    hit, slot = hit | equal, jnp.where(equal, candidate, slot)
  rest = ~hit & (jnp.any(masks != 0, axis=-1) | (overflow[first] > 0))
  chunk = claims.chunk_size(n, RARE_FRACTION)

  def search_rest(state):
    # A chunk of the rows still searching: every candidate of both buckets, then the buckets past
    # the first while the bucket reached has overflow.
    hit, slot, rest = state
    rows, target = claims.pending_rows(rest, chunk)
    inside = target < n
    found, where = _search_far(layout, digests, keys, overflow, words[rows], digest[rows], pair[rows], inside)
    return (
      hit.at[target].set(found, mode="drop"),
      slot.at[target].set(jnp.where(found, where, slot[rows]), mode="drop"),
      rest.at[target].set(False, mode="drop"),
    )

  hit, slot, _ = lax.while_loop(lambda s: jnp.any(s[-1]), search_rest, (hit, slot, rest))
  return hit, slot


def _next_candidate(layout: Layout, masks, buckets):
  """``(masks, slot, some)``: each row's lowest matching slot taken out of its bitmask rows (words of
  ``buckets``' slots in turn, ``mask_words`` each), the slot, and whether there was one."""
  per_bucket = layout.mask_words
  word, bit, held = lowest_bit(masks)
  some = word < masks.shape[-1]
  bucket = buckets[:, 0]
  for b in range(1, buckets.shape[1]):
    bucket = jnp.where(word >= b * per_bucket, buckets[:, b], bucket)
  slot = jnp.where(some, bucket * layout.bucket_size + (word % per_bucket) * 32 + bit, 0)
  masks = jnp.where(jnp.arange(masks.shape[-1]) == word[:, None], (held & (held - 1))[:, None], masks)
  return masks, slot, some


def _search_far(layout: Layout, digests, keys, overflow, words, digest, pair, active):
  """``(hit, slot)`` of rows ``words`` (``active`` ones): every candidate of their two buckets, then
  of each bucket past the first while the last one reached has overflow (a bounded walk)."""

  def search(buckets, searching):
    masks = layout.matching(layout.digest_words(digests, buckets), digest[:, None])
    masks = jnp.where(searching[:, None], masks.reshape(words.shape[0], -1), 0)

    def step(state):
      masks, hit, slot = state
      masks, candidate, some = _next_candidate(layout, masks, buckets)
      equal = some & ~hit & jnp.all(keys[candidate] == words, axis=-1)
      return jnp.where((hit | equal)[:, None], 0, masks), hit | equal, jnp.where(equal, candidate, slot)

    start = (masks, jnp.zeros(words.shape[0], bool), jnp.zeros(words.shape[0], jnp.int32))
    _, hit, slot = lax.while_loop(lambda s: jnp.any(s[0] != 0), step, start)
    return hit, slot

  hit, slot = search(pair, active)
  nb = layout.num_buckets

  def walk(state):
    at, steps, hit, slot, going = state
    at = jnp.where(going, (at + 1) % nb, at)
    found, where = search(at[:, None], going)
    steps = steps + going
    return (
      at,
      steps,
      hit | found,
      jnp.where(found, where, slot),
      going & ~found & (overflow[at] > 0) & (steps < nb),
    )

  going = active & ~hit & (overflow[pair[:, 0]] > 0)
  start = (pair[:, 0], jnp.zeros(words.shape[0], jnp.int32), hit, slot, going)
  _, _, hit, slot, _ = lax.while_loop(lambda s: jnp.any(s[-1]), walk, start)
  return hit & active, slot
