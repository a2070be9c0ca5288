"""The bucket array of open addressing: records, occupancy and overflow counts.

``num_buckets`` buckets of ``bucket_size`` slots. Each bucket is one
``uint32`` record: the key words of its slots, a bitmask of occupied slots, an
overflow count (the live entries that probed past it) and the value row of
each slot, so reading a bucket is a single gather. Slot ``s`` is offset
``s % bucket_size`` of bucket ``s // bucket_size``. Records are padded to a
power of two words (up to 16, a 64-byte cache line; then to a multiple of 16)
so that none straddles more lines than it must. The functions here work on the
record array flattened, as the placement loops carry it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jaxres._core import constants
from jaxres._core.encoding.hashing import hash_words

LINE_WORDS = constants.LINE_WORDS  # uint32 words per 64-byte cache line


@dataclasses.dataclass(frozen=True)
class Layout:
  """The static shape of a bucket array."""

  num_buckets: int
  bucket_size: int
  num_words: int  # uint32 words per key

  @property
  def mask_column(self) -> int:
    """Column of the occupancy bitmask in a record (the overflow count follows it)."""
    return self.bucket_size * self.num_words

  @property
  def row_column(self) -> int:
    """Column of slot 0's value row in a record (slot ``s``'s follows at ``row_column + s``)."""
    return self.mask_column + 2

  @property
  def record_width(self) -> int:
    """uint32 words per record, padding included."""
    used = self.row_column + self.bucket_size
    return 1 << (used - 1).bit_length() if used <= LINE_WORDS else -(-used // LINE_WORDS) * LINE_WORDS

  @property
  def num_slots(self) -> int:
    return self.num_buckets * self.bucket_size

  def home(self, words: jax.Array) -> jax.Array:
    """int32[N]: the home bucket of each key row."""
    return (hash_words(words) % jnp.uint32(self.num_buckets)).astype(jnp.int32)

  def column(self, bucket: jax.Array, column) -> jax.Array:
    """Flat index of ``column`` in each ``bucket`` record."""
    return bucket * self.record_width + column

  def occupancy(self, masks: jax.Array) -> jax.Array:
    """uint32[...] bitmasks -> bool[..., bucket_size]."""
    bits = jnp.arange(self.bucket_size, dtype=jnp.uint32)
    return ((masks[..., None] >> bits) & 1).astype(bool)

  def records(self, flat: jax.Array, bucket: jax.Array) -> jax.Array:
    """uint32[*bucket.shape, record_width]: the records of ``bucket`` (one gather of whole rows)."""
    return flat.reshape(self.num_buckets, self.record_width)[bucket]

  def bucket_rows(self, per_slot: jax.Array, bucket: jax.Array) -> jax.Array:
    """``[*bucket.shape, bucket_size]``: a per-slot array's values for the slots of ``bucket``."""
    return per_slot.reshape(self.num_buckets, self.bucket_size)[bucket]

  def row_cell(self, slot: jax.Array) -> jax.Array:
    """Flat index of each ``slot``'s value row in the records."""
    return self.column(slot // self.bucket_size, self.row_column + slot % self.bucket_size)

  def row_of(self, flat: jax.Array, slot: jax.Array) -> jax.Array:
    """int32: the value row recorded for each ``slot``."""
    return flat[self.row_cell(slot)].astype(jnp.int32)

  def keys_of(self, records: jax.Array) -> jax.Array:
    """uint32[..., bucket_size, num_words]: the key words held in records."""
    return records[..., : self.mask_column].reshape(*records.shape[:-1], self.bucket_size, self.num_words)

  def store(self, flat: jax.Array, slot: jax.Array, words: jax.Array, mask: jax.Array) -> jax.Array:
    """Writes key words into ``slot`` and marks it occupied, where ``mask`` (distinct slots)."""
    bucket, offset = slot // self.bucket_size, slot % self.bucket_size
    word_index = self.column(bucket, offset * self.num_words)[:, None] + jnp.arange(
      self.num_words, dtype=jnp.int32
    )
    flat = flat.at[jnp.where(mask[:, None], word_index, flat.size)].set(words, mode="drop")
    # Distinct slots of one bucket have distinct bits, so adding them is an OR.
    bit = jnp.uint32(1) << offset.astype(jnp.uint32)
    return flat.at[jnp.where(mask, self.column(bucket, self.mask_column), flat.size)].add(bit, mode="drop")

  def unset(self, flat: jax.Array, slot: jax.Array, mask: jax.Array) -> jax.Array:
    """Marks ``slot`` free, where ``mask`` (distinct occupied slots)."""
    bucket, offset = slot // self.bucket_size, slot % self.bucket_size
    unset = jnp.uint32(0) - (jnp.uint32(1) << offset.astype(jnp.uint32))
    return flat.at[jnp.where(mask, self.column(bucket, self.mask_column), flat.size)].add(unset, mode="drop")

  def shift_overflow(self, flat, home, slot, mask, delta: int) -> jax.Array:
    """Adds ``delta`` to the overflow count of every bucket a key probed past (home up to its slot)."""
    distance = (slot // self.bucket_size - home) % self.num_buckets
    amount = jnp.uint32(delta % 2**32)

    def step(r, flat):
      passed = mask & (r < distance)
      column = self.column((home + r) % self.num_buckets, self.mask_column + 1)
      return flat.at[jnp.where(passed, column, flat.size)].add(amount, mode="drop")

    return lax.fori_loop(0, jnp.max(jnp.where(mask, distance, 0)), step, flat)
