"""Open addressing over buckets, with overflow counts instead of tombstones.

Layout: ``num_buckets`` buckets of ``bucket_size`` slots. Each bucket is one
``uint32`` record: the key words of its slots, a bitmask of occupied slots
and an overflow count, so a probe is a single gather. A key's home bucket
comes from its hash; the key lives in the first bucket at or after home (in
probe order, wrapping) that had a free slot when it was inserted.

* **No tombstones.** A bucket's overflow count is the number of live entries
  that probed past it. A search stops at the first bucket that holds the key
  or has no overflow; removing an entry decrements the counts it incremented,
  so probe chains shrink again instead of filling up with deleted markers.
* **Conflicts resolved by claims, not by racing scatters.** New keys choose a
  free slot of their bucket and claim it with an integer scatter-min of their
  batch index into a batch-sized scratch array, at a cell hashed from the
  slot. Integer min does not depend on the order of the writes, so the
  lowest batch index wins on every backend; rows carrying the same key see
  that they lost to an equal key and become duplicates of it, and rows that
  only met another slot in the same cell try again with a new hash, a chunk
  at a time (a retried row first looks for its key in its current bucket,
  where an equal row of an earlier chunk may have put it). Last-wins updates
  claim with reversed priority. The scratch is sized by the batch, so
  per-call work is O(batch) and never touches the whole capacity.
* **Exact when full.** When a batch might not fit, the sort-based reference
  admission (:func:`batch.admit`) takes new keys in batch order.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxres._core import batch as batch_lib
from jaxres._core import claims, codec
from jaxres._core.args import check_int
from jaxres._core.hashing import hash_words
from jaxres._core.pytrees import pytree_dataclass, static_field
from jaxres._core.rows import select_rows, take_rows
from jaxres._core.storage import Storage, empty_fields
from jaxres._core.table import check_capacity
from jaxres._core.values import ValueSpec

_MAX_LOAD = 0.5  # live entries per slot at full capacity: short probe chains, ~26 B/entry
_LANE_MIX = np.uint32(0x9E3779B1)


@pytree_dataclass
class OpenAddressingTable(Storage):
  """A mutable hash table with O(1) expected probes per key.

  Create one with :meth:`create`; every method returns a new table (see
  :class:`Table` for the full method list and batch semantics).

  Example:
    >>> import jax, jax.numpy as jnp, jaxres as jr
    >>> t = jr.OpenAddressingTable.create(
    ...   capacity=1024, key=jnp.int32, value=jax.ShapeDtypeStruct((2,), jnp.float32), default=0.0
    ... )
    >>> t = jax.jit(lambda t, k, v: t.insert(k, v))(t, jnp.array([4, 8]), jnp.ones((2, 2)))
    >>> t.find(jnp.array([8, 5])).tolist(), int(t.size)
    ([[1.0, 1.0], [0.0, 0.0]], 2)
  """

  buckets: jax.Array  # uint32[num_buckets, bucket_size * num_words + 2]
  values: tuple  # leaves [num_buckets * bucket_size, *storage_shape]
  default: tuple  # leaves [*storage_shape]
  size: jax.Array  # shape=(), dtype=int32
  dropped: jax.Array  # shape=(), dtype=int32
  capacity: int = static_field()
  key_spec: codec.KeySpec = static_field()
  value_spec: ValueSpec = static_field()
  bucket_size: int = static_field()

  @classmethod
  def create(cls, capacity: int, key, value, default=0, *, bucket_size: int = 8) -> OpenAddressingTable:
    """An empty table guaranteed to hold ``capacity`` live entries.

    Args:
      capacity: static number of live entries the table holds (>= 1).
      key: ``jnp.int32``/``uint32``/``int64``/``uint64``, or a
        ``jax.ShapeDtypeStruct`` of one for composite keys, e.g.
        ``ShapeDtypeStruct((2,), jnp.int32)`` for ``(user_id, item_id)``.
      value: a dtype, a ``jax.ShapeDtypeStruct``, or a pytree of them.
      default: value returned for missing keys; a matching pytree, scalars
        broadcast.
      bucket_size: slots per bucket, fetched by one gather (1 to 32).

    Raises:
      TypeError: unsupported key or value dtype, non-integer ``capacity`` or
        ``bucket_size``.
      ValueError: ``capacity`` or ``bucket_size`` out of range.
    """
    capacity = check_capacity(capacity)
    bucket_size = check_int(bucket_size, "bucket_size", low=1, high=32)
    key_spec, value_spec, default = cls._specs(key, value, default)
    return _empty(capacity, key_spec, value_spec, default, bucket_size)

  # ------------------------------------------------------------- layout

  @property
  def num_buckets(self) -> int:
    return self.buckets.shape[0]

  @property
  def _mask_column(self) -> int:
    return self.bucket_size * self.key_spec.num_words

  def _with_capacity(self, capacity):
    return _empty(capacity, self.key_spec, self.value_spec, self.default, self.bucket_size)

  def _home(self, words):
    return (hash_words(words) % jnp.uint32(self.num_buckets)).astype(jnp.int32)

  def _occupancy(self, masks):
    """uint32[N] bitmasks -> bool[N, bucket_size]."""
    bits = jnp.arange(self.bucket_size, dtype=jnp.uint32)
    return ((masks[:, None] >> bits) & 1).astype(bool)

  def _column(self, bucket, column):
    """Flat index of ``column`` in each ``bucket`` record."""
    return bucket * self.buckets.shape[1] + column

  # ------------------------------------------------------------ queries

  def _probe(self, words, bucket):
    records = self.buckets[bucket]  # the one gather: [N, record]
    num_words = self.key_spec.num_words
    keys = records[:, : self._mask_column].reshape(-1, self.bucket_size, num_words)
    match = self._occupancy(records[:, self._mask_column]) & jnp.all(keys == words[:, None, :], axis=-1)
    hit = jnp.any(match, axis=-1)
    slot = bucket * self.bucket_size + jnp.argmax(match, axis=-1).astype(jnp.int32)
    return hit, slot, ~hit & (records[:, self._mask_column + 1] > 0)

  def _locate(self, words):
    n = words.shape[0]
    bucket = self._home(words)
    hit, slot, more = self._probe(words, bucket)
    chunk = max(64, min(n, n // 32))  # keys probing past their home bucket are rare

    def probe_further(state):
      # Compact up to `chunk` of the keys still probing, follow their chains
      # on chunk-sized arrays only, then write the answers back once.
      hit, slot, more = state
      rows, target = claims.pending_rows(more, chunk)

      def step(inner):
        at, steps, hit_c, slot_c, more_c = inner
        at = jnp.where(more_c, (at + 1) % self.num_buckets, at)
        hit2, slot2, more2 = self._probe(words[rows], at)
        steps = steps + more_c
        return (
          at,
          steps,
          jnp.where(more_c, hit2, hit_c),
          jnp.where(more_c & hit2, slot2, slot_c),
          more_c & more2 & (steps < self.num_buckets),
        )

      inner = (bucket[rows], jnp.zeros(chunk, jnp.int32), hit[rows], slot[rows], target < n)
      _, _, hit_c, slot_c, _ = lax.while_loop(lambda s: jnp.any(s[-1]), step, inner)
      return (
        hit.at[target].set(hit_c, mode="drop"),
        slot.at[target].set(slot_c, mode="drop"),
        more.at[target].set(False, mode="drop"),
      )

    hit, slot, _ = lax.while_loop(lambda s: jnp.any(s[-1]), probe_further, (hit, slot, more))
    return hit, slot

  # ---------------------------------------------------------- mutations

  def _store(self, flat, slot, words, mask):
    """Writes key words into ``slot`` and marks it occupied, where ``mask``."""
    bucket, offset = slot // self.bucket_size, slot % self.bucket_size
    num_words = self.key_spec.num_words
    word_index = self._column(bucket, offset * num_words)[:, None] + jnp.arange(num_words)
    flat = flat.at[jnp.where(mask[:, None], word_index, flat.size)].set(words, mode="drop")
    # Distinct slots of one bucket have distinct bits, so adding them is an OR.
    bit = jnp.uint32(1) << offset.astype(jnp.uint32)
    return flat.at[jnp.where(mask, self._column(bucket, self._mask_column), flat.size)].add(bit, mode="drop")

  def _shift_overflow(self, flat, home, slot, mask, delta: int):
    """Adds ``delta`` to the overflow count of every bucket a key probed past."""
    distance = (slot // self.bucket_size - home) % self.num_buckets
    amount = jnp.uint32(delta % 2**32)

    def step(r, flat):
      passed = mask & (r < distance)
      column = self._column((home + r) % self.num_buckets, self._mask_column + 1)
      return flat.at[jnp.where(passed, column, flat.size)].add(amount, mode="drop")

    return lax.fori_loop(0, jnp.max(jnp.where(mask, distance, 0)), step, flat)

  def _upsert_rows(self, words, leaves, active, mode):
    found, slot = self._locate(words)
    new = ~found
    if active is not None:  # masked rows neither update nor insert
      found, new = found & active, new & active
    room = self.capacity - self.size
    # Only a batch that may not fit needs the (sorting) exact admission. The
    # cond returns a row mask, never the table, so the table is not copied.
    admitted, dropped = lax.cond(
      jnp.sum(new, dtype=jnp.int32) <= room,
      lambda: (new, jnp.int32(0)),
      lambda: batch_lib.admit(words, new, room),
    )
    table, out = _claim_upsert(self, words, leaves, found, slot, admitted, mode)
    return dataclasses.replace(table, dropped=table.dropped + dropped), out

  def _release(self, words, slot, mask):
    flat = self.buckets.reshape(-1)
    bucket, offset = slot // self.bucket_size, slot % self.bucket_size
    unset = jnp.uint32(0) - (jnp.uint32(1) << offset.astype(jnp.uint32))
    flat = flat.at[jnp.where(mask, self._column(bucket, self._mask_column), flat.size)].add(
      unset, mode="drop"
    )
    flat = self._shift_overflow(flat, self._home(words), slot, mask, -1)
    return dataclasses.replace(self, buckets=flat.reshape(self.buckets.shape))

  def _compact(self):
    occupied = self._occupancy(self.buckets[:, self._mask_column]).reshape(-1)
    target = jnp.where(occupied, jnp.cumsum(occupied, dtype=jnp.int32) - 1, self.capacity)
    words = self.buckets[:, : self._mask_column].reshape(-1, self.key_spec.num_words)
    out_words = jnp.zeros((self.capacity, words.shape[1]), jnp.uint32).at[target].set(words, mode="drop")
    leaves = [
      jnp.zeros((self.capacity, *v.shape[1:]), v.dtype).at[target].set(v, mode="drop") for v in self.values
    ]
    return out_words, leaves, jnp.arange(self.capacity) < self.size


def _claim_upsert(table: OpenAddressingTable, words, leaves, found, slot, admitted, mode):
  """insert / find_or_insert: the ``admitted`` new rows claim slots (no sorting)."""
  n, size = words.shape[0], table.bucket_size
  index = jnp.arange(n, dtype=jnp.int32)
  home = table._home(words)
  # A per-key choice among the free slots spreads distinct keys apart (fewer
  # lost claims); equal keys make the same choice and so meet on one slot.
  lane = (hash_words(words, seed=1) * _LANE_MIX) >> 16

  def claim_round(state, rows, target, later: bool):
    """One round for the rows ``rows`` (``target``: the same, for scatters)."""
    rounds, flat, bucket, slot, first, pending = state
    position = jnp.arange(rows.shape[0], dtype=jnp.int32)
    active, current, row_words = pending[rows] & (target < n), bucket[rows], words[rows]
    placed, placed_slot = jnp.zeros_like(active), jnp.int32(0)
    if later:
      # An equal key of an earlier chunk may have been placed since: these
      # rows follow the same buckets, so they find it in the current one.
      record = flat[table._column(current, 0)[:, None] + jnp.arange(table._mask_column + 1)]
      keys = record[:, : table._mask_column].reshape(-1, size, row_words.shape[1])
      match = table._occupancy(record[:, -1]) & jnp.all(keys == row_words[:, None, :], axis=-1)
      placed = active & jnp.any(match, axis=-1)
      placed_slot = current * size + jnp.argmax(match, axis=-1).astype(jnp.int32)
      active = active & ~placed
      masks = record[:, -1]
    else:
      masks = flat[table._column(current, table._mask_column)]
    free = ~table._occupancy(masks)
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
    return (
      rounds + 1,
      table._store(flat, candidate, row_words, won),
      bucket.at[target].set(
        jnp.where(active & full, (current + 1) % table.num_buckets, current), mode="drop"
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

  state = (jnp.int32(0), table.buckets.reshape(-1), home, slot, index, admitted)
  state = claim_round(state, index, index, later=False)
  _, flat, _, slot, first, _ = lax.while_loop(lambda s: jnp.any(s[-1]), later_round, state)
  # Rare: equal keys split over chunks. Each key's first row is then its slot's lowest row.
  first = lax.cond(jnp.any(first < 0), lambda: claims.owner_per_slot(slot, admitted), lambda: first)
  new_head = admitted & (first == index)
  flat = table._shift_overflow(flat, home, slot, new_head, +1)
  table = dataclasses.replace(
    table,
    buckets=flat.reshape(table.buckets.shape),
    size=table.size + jnp.sum(new_head, dtype=jnp.int32),
  )
  if mode == "insert":
    return table._write(slot, leaves, claims.first_per_slot(slot, found | admitted, last=True)), []
  defaults = [jnp.broadcast_to(d, x.shape) for d, x in zip(table.default, leaves)]
  new_values = select_rows(admitted, take_rows(leaves, first), defaults)
  out = select_rows(found, take_rows(table.values, slot), new_values)
  return table._write(slot, leaves, new_head), out


def _empty(capacity, key_spec, value_spec, default, bucket_size):
  num_buckets = max(1, math.ceil(capacity / (bucket_size * _MAX_LOAD)))
  return OpenAddressingTable(
    buckets=jnp.zeros((num_buckets, bucket_size * key_spec.num_words + 2), jnp.uint32),
    bucket_size=bucket_size,
    **empty_fields(capacity, key_spec, value_spec, default, rows=num_buckets * bucket_size),
  )
