"""Open addressing over buckets, with overflow counts instead of tombstones.

Layout: ``num_buckets`` buckets of ``bucket_size`` slots. A key's home bucket
comes from its hash; the key lives in the first bucket at or after home (in
probe order, wrapping) that had a free slot when it was inserted.

* **Probing is vectorised.** One gather fetches a whole bucket (all its
  slots' key words and occupancy) per key; only keys that miss and whose
  bucket overflowed go round the loop again, a bucket at a time.
* **No tombstones.** ``overflow[b]`` counts the live entries that probed past
  bucket ``b`` (their home is at or before ``b`` and they live after it). A
  search stops at the first bucket that holds the key or has no overflow.
  Removing an entry decrements the counts it incremented, so probe chains
  shrink again instead of filling up with deleted markers.
* **Conflicts are resolved by rank, not by racing scatters.** New keys are
  sorted by home bucket; the r-th new key for a bucket takes that bucket's
  r-th free slot, and the rest move on together to the next bucket.

Per-call work is O(batch x bucket_size) plus the rare overflow rounds; the
capacity only enters through the number of buckets.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxres._core import batch as batch_lib
from jaxres._core import codec
from jaxres._core.hashing import hash_words
from jaxres._core.table import Table, check_capacity, pytree_dataclass, static_field
from jaxres._core.values import ValueSpec

_MAX_LOAD = 0.75  # live entries per slot when the table holds `capacity` entries


@pytree_dataclass
class OpenAddressingTable(Table):
  """A mutable hash table with O(1) expected probes per key.

  Create one with :meth:`create`; every method returns a new table (see
  :class:`Table` for the full method list and batch semantics).

  Example:
    >>> import jax, jax.numpy as jnp, jaxres as jr
    >>> t = jr.OpenAddressingTable.create(
    ...     capacity=1024, key=jnp.int32,
    ...     value=jax.ShapeDtypeStruct((2,), jnp.float32), default=0.0)
    >>> t = jax.jit(lambda t, k, v: t.insert(k, v))(t, jnp.array([4, 8]), jnp.ones((2, 2)))
    >>> t.find(jnp.array([8, 5])).tolist(), int(t.size)
    ([[1.0, 1.0], [0.0, 0.0]], 2)
  """

  keys: jax.Array  # uint32[num_buckets, bucket_size, num_words]
  occupied: jax.Array  # bool[num_buckets, bucket_size]
  overflow: jax.Array  # int32[num_buckets]: live entries that probed past the bucket
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
      bucket_size: slots per bucket gathered in one probe.

    Raises:
      TypeError: unsupported key or value dtype, non-integer capacity.
      ValueError: ``capacity`` or ``bucket_size`` out of range.
    """
    capacity = check_capacity(capacity)
    if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or not 1 <= bucket_size <= 64:
      raise ValueError(f"bucket_size: expected an int in [1, 64], got {bucket_size!r}.")
    key_spec, value_spec, default = cls._specs(key, value, default)
    return _empty(capacity, key_spec, value_spec, default, bucket_size)

  @property
  def num_buckets(self) -> int:
    return self.occupied.shape[0]

  def _with_capacity(self, capacity):
    return _empty(capacity, self.key_spec, self.value_spec, self.default, self.bucket_size)

  def _home(self, words):
    return hash_words(words) % jnp.uint32(self.num_buckets)

  def _group(self, words, active):
    return batch_lib.group(words, active, prefix=self._home(words))

  def _probe(self, words, bucket):
    window = self.keys[bucket]  # one gather: [N, bucket_size, num_words]
    match = self.occupied[bucket] & jnp.all(window == words[:, None, :], axis=-1)
    hit = jnp.any(match, axis=-1)
    slot = bucket.astype(jnp.int32) * self.bucket_size + jnp.argmax(match, axis=-1).astype(jnp.int32)
    return hit, slot, ~hit & (self.overflow[bucket] > 0)

  def _locate(self, words):
    num_buckets = jnp.uint32(self.num_buckets)
    bucket = self._home(words)
    hit, slot, more = self._probe(words, bucket)

    def cond(state):
      rounds, *_, more = state
      return jnp.any(more) & (rounds < self.num_buckets)

    def body(state):
      rounds, bucket, hit, slot, more = state
      bucket = jnp.where(more, (bucket + 1) % num_buckets, bucket)
      hit2, slot2, more2 = self._probe(words, bucket)
      take = more & hit2
      return rounds + 1, bucket, hit | take, jnp.where(take, slot2, slot), more & more2

    _, _, hit, slot, _ = lax.while_loop(cond, body, (jnp.int32(0), bucket, hit, slot, more))
    return hit, slot

  def _place(self, groups, admitted, rows):
    n = admitted.shape[0]
    size, num_buckets = self.bucket_size, self.num_buckets
    home = self._home(groups.words).astype(jnp.int32)
    index = jnp.arange(n, dtype=jnp.int32)
    # Rows are sorted by home bucket, so the keys competing for a bucket are
    # contiguous, and they stay together as they advance bucket by bucket.
    starts = jnp.concatenate([jnp.ones(1, bool), home[1:] != home[:-1]])
    group_start = lax.cummax(jnp.where(starts, index, 0))

    def cond(state):
      rounds, _, _, _, pending = state
      return jnp.any(pending) & (rounds < num_buckets)

    def body(state):
      rounds, occupied, overflow, slot, pending = state
      bucket = (home + rounds) % num_buckets
      free = ~occupied[bucket]
      before = jnp.cumsum(pending) - pending
      rank = before - before[group_start]
      take = pending & (rank < jnp.sum(free, axis=-1))
      nth_free = jnp.cumsum(free, axis=-1) == (rank + 1)[:, None]
      offset = jnp.argmax(free & nth_free, axis=-1).astype(jnp.int32)
      occupied = occupied.at[jnp.where(take, bucket, num_buckets), offset].set(True, mode="drop")
      moving = pending & ~take
      # Integer adds commute, so duplicate indices give the same result on every backend.
      overflow = overflow.at[jnp.where(moving, bucket, num_buckets)].add(1, mode="drop")
      slot = jnp.where(take, bucket * size + offset, slot)
      return rounds + 1, occupied, overflow, slot, moving

    state = (jnp.int32(0), self.occupied, self.overflow, jnp.zeros(n, jnp.int32), admitted)
    _, occupied, overflow, slot, _ = lax.while_loop(cond, body, state)
    target = jnp.where(admitted, slot, num_buckets * size)
    keys = self.keys.reshape(-1, self.key_spec.num_words).at[target].set(groups.words, mode="drop")
    values = tuple(v.at[target].set(r, mode="drop") for v, r in zip(self.values, rows))
    return dataclasses.replace(
      self, keys=keys.reshape(self.keys.shape), occupied=occupied, overflow=overflow, values=values
    )

  def _release(self, groups, slot, mask):
    num_buckets = self.num_buckets
    home = self._home(groups.words).astype(jnp.int32)
    distance = (slot // self.bucket_size - home) % num_buckets
    occupied = self.occupied.reshape(-1).at[jnp.where(mask, slot, self.occupied.size)].set(False, mode="drop")

    def undo_overflow(r, overflow):
      passed = mask & (r < distance)
      return overflow.at[jnp.where(passed, (home + r) % num_buckets, num_buckets)].add(-1, mode="drop")

    longest = jnp.max(jnp.where(mask, distance, 0))
    overflow = lax.fori_loop(0, longest, undo_overflow, self.overflow)
    return dataclasses.replace(self, occupied=occupied.reshape(self.occupied.shape), overflow=overflow)

  def _compact(self):
    occupied = self.occupied.reshape(-1)
    target = jnp.where(occupied, jnp.cumsum(occupied, dtype=jnp.int32) - 1, self.capacity)
    words = self.keys.reshape(-1, self.key_spec.num_words)
    out_words = jnp.zeros((self.capacity, words.shape[1]), jnp.uint32).at[target].set(words, mode="drop")
    leaves = [
      jnp.zeros((self.capacity, *v.shape[1:]), v.dtype).at[target].set(v, mode="drop") for v in self.values
    ]
    return out_words, leaves, jnp.arange(self.capacity) < self.size


def _empty(capacity, key_spec, value_spec, default, bucket_size):
  num_buckets = max(1, math.ceil(capacity / (bucket_size * _MAX_LOAD)))
  slots = num_buckets * bucket_size
  return OpenAddressingTable(
    keys=jnp.zeros((num_buckets, bucket_size, key_spec.num_words), jnp.uint32),
    occupied=jnp.zeros((num_buckets, bucket_size), bool),
    overflow=jnp.zeros((num_buckets,), jnp.int32),
    values=tuple(value_spec.empty((slots,))),
    default=tuple(default),
    size=jnp.zeros((), jnp.int32),
    dropped=jnp.zeros((), jnp.int32),
    capacity=capacity,
    key_spec=key_spec,
    value_spec=value_spec,
    bucket_size=bucket_size,
  )
