"""The lean layout: buckets of slots, where a slot is its entry's row.

``num_buckets`` buckets of ``bucket_size`` slots; slot ``s`` is offset
``s % bucket_size`` of bucket ``s // bucket_size``, and the entry in it keeps
everything at index ``s``: its key words (``keys[s]``), its one-byte
*digest*, its value row (``values[s]``, so no row pointer and no free-row
stack) and its change stamp. Beside them, each bucket keeps an *overflow*
count.

* **Two buckets per key.** A key's *first* and *second* buckets come from one
  hash of it, mixed twice; a new key goes to its first unless the second has
  more than 4 more free slots (or the first none), so that buckets fill
  evenly (the "power of two choices": at 98 % of the slots filled, almost no
  bucket pair is full) while most keys sit in their first bucket.
* **Digests.** A free slot's digest is 0; an occupied one's is 1 to 255, a
  hash of its key. A lookup compares the key's digest with a bucket's (a
  ``uint32`` word holds four: the array is ``uint32[num_slots // 4]``) and
  reads the keys of the slots that match only. Several matches are normal
  (about one slot in 255 of a bucket matches a key it does not hold).
* **Probing on, rarely.** When both buckets of a key the table must hold are
  full, it goes to the first bucket with a free slot after its first one
  (wrapping), and every bucket it passed counts it in its overflow count; a
  lookup goes on past the first bucket while the bucket it reached has
  overflow. So a table holds ``capacity`` entries however its keys hash.

A table of capacity ``c`` has :func:`geometry` slots: about ``1.02 c``, so
that a full table's buckets are 98 % full (probing on stays rare), and at
most ``1.03 c`` from 4096 entries on.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxres._core import constants
from jaxres._core.encoding.hashing import hash_words, mix

MAX_BUCKET_SIZE = constants.LEAN_MAX_BUCKET_SIZE
PER_WORD = constants.LEAN_DIGESTS_PER_WORD  # digests per uint32 word
_SLACK = 50  # slots beyond the capacity: capacity // _SLACK (2 %), a full table's buckets 98 % full
_MOST = 1.03  # the most slots a capacity of 4096 or more gets, as a multiple of it
_LARGEST_KEEPING = 64  # the largest bucket of a table that does not evict: its digests fill a cache line


def geometry(capacity: int, bucket_size: int | None = None, evicting: bool = False) -> tuple[int, int]:
  """``(num_buckets, bucket_size)`` of a table of ``capacity`` entries.

  At least ``capacity + capacity // 50`` slots. Without a ``bucket_size``, the
  largest bucket size (a multiple of 4, from half the largest up) whose slots
  stay within 1.03 x the capacity, the largest being 128 for a table that
  evicts (a new key's candidates are its two buckets' slots: HierarchicalKV's
  eviction quality needs buckets that large) and 64 for one that does not; a
  table too small for that gets one bucket, or the bucket size of fewest slots.

  Examples:
    >>> [geometry(c) for c in (4, 10, 1000, 4096, 1 << 20)]
    [(1, 4), (1, 12), (16, 64), (70, 60), (16712, 64)]
    >>> [geometry(c, evicting=True) for c in (100, 1000, 4096, 1 << 20)]
    [(1, 104), (8, 128), (34, 124), (8356, 128)]
    >>> geometry(4, bucket_size=8)
    (1, 8)
  """
  target = capacity + capacity // _SLACK
  if bucket_size is not None:
    return math.ceil(target / bucket_size), bucket_size
  largest = MAX_BUCKET_SIZE if evicting else _LARGEST_KEEPING
  if target <= largest:
    return 1, -(-target // PER_WORD) * PER_WORD
  most = max(target, int(capacity * _MOST))
  sizes = range(largest, PER_WORD - 1, -PER_WORD)
  for size in sizes:
    if size >= largest // 2 and math.ceil(target / size) * size <= most:
      return math.ceil(target / size), size
  size = min(sizes, key=lambda b: (math.ceil(target / b) * b, -b))
  return math.ceil(target / size), size


@dataclasses.dataclass(frozen=True)
class Layout:
  """The static shape of the slots: buckets, slots per bucket, key words."""

  num_buckets: int
  bucket_size: int
  num_words: int

  @property
  def num_slots(self) -> int:
    return self.num_buckets * self.bucket_size

  @property
  def bucket_words(self) -> int:
    """uint32 words of digests per bucket."""
    return self.bucket_size // PER_WORD

  @property
  def mask_words(self) -> int:
    """uint32 words of a bucket's slot bitmask (:meth:`bits`)."""
    return -(-self.bucket_size // 32)

  # ------------------------------------------------------------- hashing

  def buckets_of(self, words: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(first, second, digest)`` of each key row: int32 buckets (distinct unless there is one
    bucket) and a uint32 digest in 1..255, all from one hash of the key words."""
    h = hash_words(words)
    nb = self.num_buckets
    first = (h % np.uint32(nb)).astype(jnp.int32)
    top = h >> 24
    digest = top + (top == 0).astype(jnp.uint32)
    if nb == 1:
      return first, first, digest
    other = mix(h, constants.LEAN_SECOND_BUCKET_SEED) % np.uint32(nb - 1)
    return first, (first + 1 + other.astype(jnp.int32)) % nb, digest

  @staticmethod
  def second_choice(free_first: jax.Array, free_second: jax.Array) -> jax.Array:
    """bool: whether a new key takes its second bucket, given the free slots of both (int32): where
    the first is full, or the second has more than ``LEAN_FIRST_BUCKET_BIAS`` more free slots."""
    bias = constants.LEAN_FIRST_BUCKET_BIAS
    return (free_second > free_first + bias) | ((free_first == 0) & (free_second > 0))

  @staticmethod
  def lane(words: jax.Array) -> jax.Array:
    """uint32 in ``[0, 2**16)``: which free slot a new key tries first (:meth:`nth_free`)."""
    return mix(hash_words(words), constants.LANE_SEED) >> 16

  @staticmethod
  def nth_free(lane: jax.Array, num_free: jax.Array) -> jax.Array:
    """int32: which of ``num_free`` free slots (by rank) a key of ``lane`` takes: the lane scaled to
    the count, ``lane * num_free >> 16`` (a multiply where a modulo would divide); 0 where none."""
    return ((lane * num_free.astype(jnp.uint32)) >> 16).astype(jnp.int32)

  # ------------------------------------------------------------- buckets

  def digest_words(self, digests: jax.Array, bucket: jax.Array) -> jax.Array:
    """uint32[*bucket.shape, bucket_words]: the digest words of each ``bucket`` (one gather)."""
    return digests.reshape(self.num_buckets, self.bucket_words)[bucket]

  def bits(self, flags: jax.Array) -> jax.Array:
    """Per-byte flags (the top bit of each byte of ``uint32[..., bucket_words]``) as slot bitmasks,
    ``uint32[..., mask_words]``: bit ``j`` of word ``m`` is slot ``32 m + j`` of the bucket."""
    # One multiply gathers the four flags (bits 7, 15, 23, 31) into bits 28-31, with no carries:
    # the other products of its four terms land on distinct bits below 28.
    nibbles = (flags * np.uint32(0x00204081)) >> 28
    pad = self.mask_words * 8 - self.bucket_words
    nibbles = jnp.pad(nibbles, [(0, 0)] * (nibbles.ndim - 1) + [(0, pad)])
    nibbles = nibbles.reshape(*nibbles.shape[:-1], self.mask_words, 8)
    return jnp.sum(nibbles << (4 * jnp.arange(8, dtype=jnp.uint32)), axis=-1, dtype=jnp.uint32)

  def matching(self, words: jax.Array, digest: jax.Array) -> jax.Array:
    """Slot bitmasks (:meth:`bits`) of the bytes of digest words ``words`` equal to ``digest``
    (broadcast over the trailing axis): exact per byte, with no borrow between bytes."""
    x = words ^ (digest * np.uint32(0x01010101))[..., None]
    return self.bits(_zero_bytes(x))

  def free(self, words: jax.Array) -> jax.Array:
    """Slot bitmasks (:meth:`bits`) of the free slots (digest 0) of digest words ``words``."""
    return self.bits(_zero_bytes(words))

  # ------------------------------------------------------------- writes

  @staticmethod
  def with_digests(digests, slot, digest, mask) -> jax.Array:
    """``digests`` with each masked ``slot``'s digest raised by ``digest`` (distinct slots):
    0 to d sets a digest, d to 0 (``digest`` = -d, wrapping) clears one. Slots of one word hold
    disjoint bytes, so adding their changes is exact in any order."""
    shift = (8 * (slot % PER_WORD)).astype(jnp.uint32)
    target = jnp.where(mask, slot // PER_WORD, digests.shape[0])
    return digests.at[target].add(digest.astype(jnp.uint32) << shift, mode="drop")

  @staticmethod
  def digest_at(digests: jax.Array, slot: jax.Array) -> jax.Array:
    """uint32: the digest held at each ``slot`` (0: free)."""
    return (digests[slot // PER_WORD] >> (8 * (slot % PER_WORD)).astype(jnp.uint32)) & 0xFF

  def shift_overflow(self, overflow, first, slot, mask, delta: int) -> jax.Array:
    """``overflow`` with ``delta`` added in every bucket a key at ``slot`` passed from its ``first``
    bucket (none for a key in its first or second bucket: the caller masks those out)."""
    distance = (slot // self.bucket_size - first) % self.num_buckets
    amount = jnp.uint32(delta % 2**32)

    def step(r, overflow):
      passed = mask & (r < distance)
      return overflow.at[jnp.where(passed, (first + r) % self.num_buckets, overflow.shape[0])].add(
        amount, mode="drop"
      )

    return lax.fori_loop(0, jnp.max(jnp.where(mask, distance, 0), initial=0), step, overflow)

  def probed_on(self, words: jax.Array, slot: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(first, on)``: each key's first bucket, and whether ``slot`` lies in neither of its buckets
    (a key placed by probing on, counted in the overflow of the buckets it passed)."""
    first, second, _ = self.buckets_of(words)
    bucket = slot // self.bucket_size
    return first, (bucket != first) & (bucket != second)


def _zero_bytes(x: jax.Array) -> jax.Array:
  """The top bit of each zero byte of ``x`` (uint32) set, every other bit clear."""
  low = np.uint32(0x7F7F7F7F)
  return ~(((x & low) + low) | x | low)


def lowest_bit(masks: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(word, bit, held)`` of the lowest set bit of bitmask rows ``uint32[..., M]``: its word (``M``
  where none), its bit in that word, and that word (0 where none).

  ``M`` is small (a bucket pair's bitmask words): one select a word, no reduction or gather.

  Examples:
    >>> lowest_bit(jnp.array([[0, 0b1100], [1, 0], [0, 0]], jnp.uint32))
    (Array([1, 0, 2], dtype=int32), Array([2, 0, 0], dtype=int32), Array([12,  1,  0], dtype=uint32))
  """
  m = masks.shape[-1]
  word = jnp.full(masks.shape[:-1], m, jnp.int32)
  held = jnp.zeros(masks.shape[:-1], jnp.uint32)
  for j in reversed(range(m)):
    some = masks[..., j] != 0
    word, held = jnp.where(some, j, word), jnp.where(some, masks[..., j], held)
  low = held & (jnp.uint32(0) - held)
  return word, jnp.where(held == 0, 0, 31 - lax.clz(low).astype(jnp.int32)), held


def nth_bit(masks: jax.Array, n: jax.Array) -> jax.Array:
  """int32: the position of the ``n``-th set bit (from 0) of bitmask rows ``uint32[..., M]``
  (``n`` below their population).

  Examples:
    >>> nth_bit(jnp.array([[0b1010, 0b1], [0b110, 0]], jnp.uint32), jnp.array([2, 1]))
    Array([32,  2], dtype=int32)
  """
  counts = lax.population_count(masks).astype(jnp.int32)
  before = jnp.cumsum(counts, axis=-1, dtype=jnp.int32) - counts  # set bits in the words before each
  word = jnp.minimum(jnp.sum(before + counts <= n[..., None], axis=-1, dtype=jnp.int32), masks.shape[-1] - 1)
  x = jnp.take_along_axis(masks, word[..., None], axis=-1)[..., 0]
  rest = n.astype(jnp.int32) - jnp.take_along_axis(before, word[..., None], axis=-1)[..., 0]
  position = jnp.zeros_like(rest)
  for width in (16, 8, 4, 2, 1):  # binary search: how many set bits lie below position + width
    low = lax.population_count((x >> position.astype(jnp.uint32)) & np.uint32((1 << width) - 1))
    skip = rest >= low.astype(jnp.int32)
    rest = jnp.where(skip, rest - low.astype(jnp.int32), rest)
    position = jnp.where(skip, position + width, position)
  return 32 * word + position
