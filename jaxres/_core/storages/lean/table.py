"""``LeanTable``: open addressing where the slot is the row.

Each entry lives in one slot of one of its key's two buckets (rarely past the
first, when both were full: see :mod:`layout`), and everything it has is at
that slot's index: key words, a one-byte digest, the value row and a change
stamp. Beyond the value row that is 13 bytes a slot for 64-bit keys (9 for
32-bit keys), and the table has about 2 % more slots than its capacity.

* **Conflicts resolved by claims, not by racing scatters** (:mod:`placing`):
  per-call work is O(batch) and never touches the whole capacity.
* **Exact when full.** New keys are admitted in batch order, the first
  ``capacity - size`` of them; the others are counted in ``dropped``.
* **No tombstones.** A bucket's overflow count is the number of live entries
  that probed past it; removing one lowers the counts it raised.

It runs on the XLA path on every backend, and does not evict yet.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxres._core import call_args
from jaxres._core.encoding import key_specs
from jaxres._core.encoding.value_specs import ValueSpec
from jaxres._core.kernels.row_ops import select_rows, take_rows
from jaxres._core.policies import check_policy
from jaxres._core.pytrees import pytree_dataclass, static_field
from jaxres._core.storages.lean import placing, probing
from jaxres._core.storages.lean.layout import MAX_BUCKET_SIZE, PER_WORD, Layout, geometry
from jaxres._core.storages.storage import KeptSlots, empty_fields
from jaxres._core.table import check_capacity
from jaxres._errors import check_int


@pytree_dataclass
class LeanTable(KeptSlots):
  """A mutable hash table whose slots are its value rows: 13 bytes a slot beyond the row (int64 keys).

  Create one with :meth:`create`; every method returns a new table (see
  :class:`Table` for the full method list and batch semantics).

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from jaxres._core.storages.lean import LeanTable
    >>> t = LeanTable.create(capacity=1024, key=jnp.int32, value=jax.ShapeDtypeStruct((2,), jnp.float32))
    >>> t = jax.jit(lambda t, k, v: t.insert(k, v))(t, jnp.array([4, 8]), jnp.ones((2, 2)))
    >>> t.find(jnp.array([8, 5])).tolist(), int(t.size), t.num_slots
    ([[1.0, 1.0], [0.0, 0.0]], 2, 1044)
  """

  keys: jax.Array  # uint32[num_slots, num_words]: each slot's key words
  digests: jax.Array  # uint32[num_slots // 4]: each slot's digest byte, 0 where free
  overflow: jax.Array  # uint32[num_buckets]: live entries that probed past each bucket
  values: tuple  # leaves [num_slots, *storage_shape]: each slot's value row
  default: tuple  # leaves [*storage_shape]
  slot_scores: jax.Array  # uint32[0]: no eviction yet
  row_stamps: jax.Array  # uint32[num_slots]: the version when each slot's entry last changed
  version: jax.Array  # uint32: calls that changed the table so far (see Storage)
  size: jax.Array  # shape=(), dtype=int32
  dropped: jax.Array  # shape=(), dtype=int32
  clock: jax.Array  # shape=(), dtype=uint32
  evictions: jax.Array  # shape=(), dtype=int32: always 0
  capacity: int = static_field()
  key_spec: key_specs.KeySpec = static_field()
  value_spec: ValueSpec = static_field()
  eviction: None = static_field()
  num_buckets: int = static_field()
  bucket_size: int = static_field()

  @classmethod
  def create(cls, capacity: int, key, value, default=0, *, bucket_size: int | None = None, eviction=None):
    """An empty table guaranteed to hold ``capacity`` live entries, however its keys hash.

    Args:
      capacity: static number of live entries the table holds (>= 1).
      key: ``jnp.int32``/``uint32``/``int64``/``uint64``, or a
        ``jax.ShapeDtypeStruct`` of one for composite keys.
      value: a dtype, a ``jax.ShapeDtypeStruct``, or a pytree of them.
      default: value returned for missing keys; a matching pytree, scalars broadcast.
      bucket_size: slots per bucket, a multiple of 4 up to 128; by default the
        largest (64 for most capacities) that keeps the table's slots within
        3 % of its capacity (see :func:`layout.geometry`).
      eviction: must be ``None``: this layout does not evict yet.

    Raises:
      TypeError: unsupported key or value dtype, non-integer ``capacity`` or ``bucket_size``.
      ValueError: ``capacity`` or ``bucket_size`` out of range, or an eviction policy given.

    Examples:
      >>> import jax.numpy as jnp, jaxres as jr
      >>> LeanTable.create(8, key=jnp.int32, value=jnp.float32, bucket_size=6)
      Traceback (most recent call last):
      ...
      ValueError: bucket_size: expected a multiple of 4, got 6.
      >>> LeanTable.create(8, key=jnp.int32, value=jnp.float32, eviction=jr.LRU())
      Traceback (most recent call last):
      ...
      ValueError: eviction: a LeanTable cannot evict yet; use jr.OpenAddressingTable for eviction=jr.LRU().
    """
    capacity = check_capacity(capacity)
    if check_policy(eviction) is not None:
      raise ValueError(
        f"eviction: a LeanTable cannot evict yet; use jr.OpenAddressingTable for eviction={eviction}."
      )
    key_spec, value_spec, default = cls._specs(key, value, default)
    if bucket_size is not None:
      bucket_size = check_int(bucket_size, "bucket_size", low=PER_WORD, high=MAX_BUCKET_SIZE)
      if bucket_size % PER_WORD:
        raise ValueError(f"bucket_size: expected a multiple of {PER_WORD}, got {bucket_size}.")
    return _empty(capacity, key_spec, value_spec, default, *geometry(capacity, bucket_size))

  # ------------------------------------------------------------- layout

  @property
  def layout(self) -> Layout:
    return Layout(self.num_buckets, self.bucket_size, self.key_spec.num_words)

  @property
  def num_slots(self) -> int:
    return self.num_buckets * self.bucket_size

  @property
  def num_rows(self) -> int:
    """Value rows: one per slot (a slot is its value row), ``num_slots``."""
    return self.num_slots

  @property
  def slot_layout(self):
    return np.array([1, self.num_buckets, self.bucket_size])  # shards, buckets, slots per bucket

  def placed(self, keys, values, scores, slots):
    empty = self._cleared()._advance()  # every entry newer than any version of this table before
    rows = call_args.prepare(empty, keys, values, scores=scores, explicit_scores=True)
    self.check_slots(rows.words[: rows.n], slots)
    if not rows.n:
      return empty
    slots = call_args.pad_to(jnp.asarray(slots, jnp.int32), rows)
    return _jit_place(empty, rows.words, rows.leaves, slots, rows.active)

  def _place_rows(self, words, leaves, slots, valid):
    """This empty table with the rows' entries at ``slots`` (distinct), where ``valid``; a slot in
    neither of its key's buckets counts as probed on from the first."""
    layout = self.layout
    _, _, digest = layout.buckets_of(words)
    first, on = layout.probed_on(words, slots)
    table = dataclasses.replace(
      self,
      digests=layout.with_digests(self.digests, slots, digest, valid),
      keys=self.keys.at[jnp.where(valid, slots, self.num_slots)].set(words, mode="drop"),
      overflow=layout.shift_overflow(self.overflow, first, slots, valid & on, +1),
    )
    table = table._put(slots, leaves, valid)
    return dataclasses.replace(table, size=jnp.sum(valid, dtype=jnp.int32))

  def _with_capacity(self, capacity):
    given = self.bucket_size if geometry(self.capacity) != (self.num_buckets, self.bucket_size) else None
    return _empty(capacity, self.key_spec, self.value_spec, self.default, *geometry(capacity, given))

  # ------------------------------------------------------------ queries

  def _arrays(self) -> tuple:
    return self.digests, self.keys, self.overflow

  def _locate(self, words):
    """``(hit, slot)`` of each key row: its slot, or for a miss the first slot of its first bucket."""
    return probing.locate(self.layout, *self._arrays(), words)

  def _slots(self):
    live = self.layout.digest_at(self.digests, jnp.arange(self.num_slots, dtype=jnp.int32)) != 0
    return self.keys, live

  def _slots_at(self, slot):
    return self.keys[slot], self.layout.digest_at(self.digests, slot) != 0

  def _slot_rows(self, offset, size: int):
    """As :meth:`Storage._slot_rows`, the rows of free slots read as zeros: a free slot's row keeps
    the value of the entry it held last, which an exported chunk does not show."""
    words, leaves, scores, valid = super()._slot_rows(offset, size)
    return words, select_rows(valid, leaves, [jnp.zeros_like(x) for x in leaves]), scores, valid

  # ---------------------------------------------------------- mutations

  def _upsert_rows(self, words, leaves, active, mode, given_scores=None, weights=None):
    del given_scores, weights  # no scores kept
    table, claim = self._claim(words, active)
    index = jnp.arange(words.shape[0], dtype=jnp.int32)
    if not mode.keeps_present:
      return table._put_last(claim.slot, leaves, claim.found | claim.placed), [], None
    defaults = [jnp.broadcast_to(d, x.shape) for d, x in zip(table.default, leaves)]
    new_values = select_rows(claim.placed, take_rows(leaves, claim.first), defaults)
    table = table._put(claim.slot, leaves, claim.placed & (claim.first == index))
    # Found keys' values are read after the write (which leaves them as they were): a read of
    # the old array would keep it alive next to the new one, and XLA would copy it whole.
    return table, select_rows(claim.found, take_rows(table.values, claim.slot), new_values), None

  def _claim_rows(self, words, active, given_scores=None, weights=None):
    del given_scores, weights  # no scores kept
    table, claim = self._claim(words, active)
    return table, jnp.where(claim.found | claim.placed, claim.slot, -1), claim.found, claim.placed, None

  def _claim(self, words, active) -> tuple[LeanTable, Claim]:
    """Locates the rows' keys and gives the new ones that fit slots (stamped; their values are left
    as they were: the caller writes them)."""
    index = jnp.arange(words.shape[0], dtype=jnp.int32)
    active = jnp.ones(words.shape[0], bool) if active is None else active  # masked rows do nothing
    up = placing.upsert_slots(self.layout, *self._arrays(), words, active, self.size, self.capacity)
    table = dataclasses.replace(
      self,
      digests=up.digests,
      keys=up.keys,
      overflow=up.overflow,
      size=self.size + jnp.sum(up.admitted & (up.first == index), dtype=jnp.int32),
      dropped=self.dropped + up.dropped,
    )
    return table._stamped(up.slot, up.admitted), Claim(up.found, up.admitted, up.slot, up.first)

  def _release(self, words, slot, mask):
    layout = self.layout
    _, _, digest = layout.buckets_of(words)
    first, on = layout.probed_on(words, slot)
    return dataclasses.replace(
      self,
      digests=layout.with_digests(self.digests, slot, jnp.uint32(0) - digest, mask),
      overflow=layout.shift_overflow(self.overflow, first, slot, mask & on, -1),
    )


class Claim(NamedTuple):
  """Where the keys of a batch of rows live after :meth:`LeanTable._claim`."""

  found: jax.Array  # bool[N]: active rows whose key was present
  placed: jax.Array  # bool[N]: active rows whose key was new and now has a slot (every row of the key)
  slot: jax.Array  # int32[N]: the slot (value row) of each found or placed row's key
  first: jax.Array  # int32[N]: the first row of each placed key (a row's own index elsewhere)


@jax.jit
def _jit_place(table: LeanTable, words, leaves, slots, valid) -> LeanTable:
  return table._place_rows(words, leaves, slots, valid)


def _empty(capacity, key_spec, value_spec, default, num_buckets, bucket_size):
  slots = num_buckets * bucket_size
  return LeanTable(
    keys=jnp.zeros((slots, key_spec.num_words), jnp.uint32),
    digests=jnp.zeros((slots // PER_WORD,), jnp.uint32),
    overflow=jnp.zeros((num_buckets,), jnp.uint32),
    num_buckets=num_buckets,
    bucket_size=bucket_size,
    **empty_fields(
      capacity, key_spec, value_spec, default, slots=slots, rows=slots, eviction=None, stamps=True
    ),
  )
