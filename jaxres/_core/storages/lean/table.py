"""``LeanTable``: open addressing where the slot is the row.

Each entry lives in one slot of one of its key's two buckets (rarely past the
first, when both were full: see :mod:`layout`), and everything it has is at
that slot's index: key words, a one-byte digest, the value row, a change
stamp and, with an eviction policy, a score. Beyond the value row that is 13
bytes a slot for 64-bit keys (9 for 32-bit keys), 17 (13) with eviction, and
the table has about 2 % more slots than its capacity.

* **Conflicts resolved by claims, not by racing scatters** (:mod:`placing`):
  per-call work is O(batch) and never touches the whole capacity.
* **Exact when full.** New keys are admitted in batch order, the first
  ``capacity - size`` of them; without an eviction policy the others are
  counted in ``dropped``; with one they evict an entry of their two buckets
  (:mod:`eviction`), so ``size`` never exceeds ``capacity``.
* **No tombstones.** A bucket's overflow count is the number of live entries
  that probed past it; removing one lowers the counts it raised.

On CPU its reads (locate, lookup) and the placement and eviction of its writes run kernels
(``kernels.cc``), bit for bit the XLA path that other backends run; the rest of its writes (values,
scores, stamps, removal) are scatters of the XLA path everywhere.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxres._core import call_args, ordering
from jaxres._core.encoding import key_specs
from jaxres._core.encoding.value_specs import ValueSpec
from jaxres._core.kernels import claims, native
from jaxres._core.kernels.row_ops import select_rows, take_rows
from jaxres._core.policies import Policy, check_policy
from jaxres._core.pytrees import pytree_dataclass, static_field
from jaxres._core.storages.lean import eviction, placing, probing
from jaxres._core.storages.lean.layout import MAX_BUCKET_SIZE, PER_WORD, Layout, geometry
from jaxres._core.storages.storage import NO_SCORE, KeptSlots, empty_fields
from jaxres._core.table import check_capacity
from jaxres._errors import check_int


@pytree_dataclass
class LeanTable(KeptSlots):
  """A mutable hash table whose slots are its value rows: 13 bytes a slot beyond the row (int64 keys),
  17 with an eviction policy.

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
  slot_scores: jax.Array  # uint32[num_slots] with an eviction policy, else uint32[0]
  row_stamps: jax.Array  # uint32[num_slots]: the version when each slot's entry last changed (or uint32[0])
  version: jax.Array  # uint32: calls that changed the table so far (see Storage)
  size: jax.Array  # shape=(), dtype=int32
  dropped: jax.Array  # shape=(), dtype=int32
  clock: jax.Array  # shape=(), dtype=uint32
  evictions: jax.Array  # shape=(), dtype=int32
  capacity: int = static_field()
  key_spec: key_specs.KeySpec = static_field()
  value_spec: ValueSpec = static_field()
  eviction: Policy | None = static_field()
  num_buckets: int = static_field()
  bucket_size: int = static_field()

  @classmethod
  def create(
    cls,
    capacity: int,
    key,
    value,
    default=0,
    *,
    bucket_size: int | None = None,
    eviction: Policy | None = None,
    eviction_window=None,
    stamps: bool = True,
  ) -> LeanTable:
    """An empty table guaranteed to hold ``capacity`` live entries, however its keys hash.

    Args:
      capacity: static number of live entries the table holds (>= 1).
      key: ``jnp.int32``/``uint32``/``int64``/``uint64``, or a
        ``jax.ShapeDtypeStruct`` of one for composite keys.
      value: a dtype, a ``jax.ShapeDtypeStruct``, or a pytree of them.
      default: value returned for missing keys; a matching pytree, scalars broadcast.
      bucket_size: slots per bucket, a multiple of 4 up to 128; by default the
        largest (for most capacities 64, or 128 for a table that evicts) that
        keeps the table's slots within 3 % of its capacity (see
        :func:`layout.geometry`).
      eviction: ``None`` (a full table refuses new keys, counted in
        ``dropped``), or ``jr.LRU()``, ``jr.LFU()``, ``jr.LRFU()``,
        ``jr.CustomScore()``: a full table evicts, a new key replacing the
        entry of lowest score of its two buckets (see :mod:`eviction`).
        Scores take 4 bytes a slot.
      eviction_window: must be ``None``: a new key's candidates are the slots of
        its two buckets, not windows of buckets (an option of
        :class:`OpenAddressingTable`).
      stamps: whether each slot keeps a change stamp (4 bytes a slot), so that
        :meth:`changes` reads what changed since a version and an incremental
        checkpoint saves that alone. Without, every live entry counts as changed
        (what a table that needs no deltas saves, such as an embedding's
        admission counts).

    Raises:
      TypeError: unsupported key or value dtype, non-integer ``capacity`` or
        ``bucket_size``, an ``eviction`` that is not a policy, ``stamps`` not a bool.
      ValueError: ``capacity`` or ``bucket_size`` out of range, or an ``eviction_window`` given.

    Examples:
      >>> import jax.numpy as jnp, jaxres as jr
      >>> LeanTable.create(8, key=jnp.int32, value=jnp.float32, bucket_size=6)
      Traceback (most recent call last):
      ...
      ValueError: bucket_size: expected a multiple of 4, got 6.
      >>> LeanTable.create(8, key=jnp.int32, value=jnp.float32, eviction=jr.LRU(), eviction_window=4)
      Traceback (most recent call last):
      ...
      ValueError: eviction_window: a LeanTable evicts among a new key's two buckets; expected None, got 4.
      >>> t = LeanTable.create(2, key=jnp.int32, value=jnp.float32, eviction=jr.LRU())
      >>> t = t.insert(jnp.array([1, 2]), jnp.ones(2)).insert(jnp.array([1]), jnp.ones(1))  # 2: the older
      >>> t, evicted = t.insert_and_evict(jnp.array([3]), jnp.ones(1))
      >>> evicted.keys.tolist(), int(t.size), int(t.evictions)
      ([2], 2, 1)
      >>> stamped = LeanTable.create(1000, key=jnp.int64, value=jnp.uint8, eviction=jr.LRU())
      >>> plain = LeanTable.create(1000, key=jnp.int64, value=jnp.uint8, eviction=jr.LRU(), stamps=False)
      >>> stamped.memory()["index"] - plain.memory()["index"] == 4 * plain.num_slots
      True
    """
    capacity = check_capacity(capacity)
    eviction = check_policy(eviction)
    if not isinstance(stamps, bool):
      raise TypeError(f"stamps: expected a bool, got {stamps!r}.")
    if eviction_window is not None:
      message = "a LeanTable evicts among a new key's two buckets; expected None"
      raise ValueError(f"eviction_window: {message}, got {eviction_window!r}.")
    key_spec, value_spec, default = cls._specs(key, value, default)
    if bucket_size is not None:
      bucket_size = check_int(bucket_size, "bucket_size", low=PER_WORD, high=MAX_BUCKET_SIZE)
      if bucket_size % PER_WORD:
        raise ValueError(f"bucket_size: expected a multiple of {PER_WORD}, got {bucket_size}.")
    shape = geometry(capacity, bucket_size, evicting=eviction is not None)
    return _empty(capacity, key_spec, value_spec, default, *shape, eviction, stamps)

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

  @property
  def slot_kind(self) -> str:
    return "lean"

  def placed(self, keys, values, scores, slots):
    empty = self._cleared()._advance()  # every entry newer than any version of this table before
    rows = call_args.prepare(empty, keys, values, scores=scores, explicit_scores=True)
    self.check_slots(rows.words[: rows.n], slots)
    if not rows.n:
      return empty
    slots = call_args.pad_to(jnp.asarray(slots, jnp.int32), rows)
    return _jit_place(empty, rows.words, rows.leaves, rows.given_scores, slots, rows.active)

  def _place_rows(self, words, leaves, given_scores, slots, valid):
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
    if given_scores is not None:
      table = table._set_scores(slots, given_scores, valid)
    return dataclasses.replace(table, size=jnp.sum(valid, dtype=jnp.int32))

  def _with_capacity(self, capacity):
    evicting = self.eviction is not None
    chosen = geometry(self.capacity, evicting=evicting) == (self.num_buckets, self.bucket_size)
    shape = geometry(capacity, None if chosen else self.bucket_size, evicting=evicting)
    stamps = self.row_stamps.shape[0] > 0
    return _empty(capacity, self.key_spec, self.value_spec, self.default, *shape, self.eviction, stamps)

  # ------------------------------------------------------------ queries

  def _arrays(self) -> tuple:
    return self.digests, self.keys, self.overflow

  def _locate(self, words):
    """``(hit, slot)`` of each key row: its slot, or for a miss the first slot of its first bucket
    (on CPU the kernel ``jaxres_lean_locate``)."""
    n = words.shape[0]
    results = (jax.ShapeDtypeStruct((n,), jnp.bool_), jax.ShapeDtypeStruct((n,), jnp.int32))
    reference = functools.partial(probing.locate, self.layout)
    return native.on_cpu(
      "jaxres_lean_locate", reference, results, *self._arrays(), words, bucket_size=self.bucket_size
    )

  def _lookup_rows(self, words, defaults):
    """``(values, found)``: on CPU one kernel (``jaxres_lean_lookup``) searches and gathers,
    prefetching both.

    ``defaults``: leaves ``[n, *shape]`` or ``[*shape]``, or none for ``found`` alone.
    """
    n = words.shape[0]
    values = self.values if defaults else ()
    results = (
      jax.ShapeDtypeStruct((n,), jnp.bool_),
      *(jax.ShapeDtypeStruct((n, *v.shape[1:]), v.dtype) for v in values),
    )

    def reference(digests, keys, overflow, words, *leaves):
      values, found = KeptSlots._lookup_rows(self, words, leaves[len(leaves) // 2 :])
      return found, *values

    found, *out = native.on_cpu(
      "jaxres_lean_lookup", reference, results, *self._arrays(), words, *values, *defaults,
      bucket_size=self.bucket_size,
    )  # fmt: skip
    return out, found

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
    table, claim = self._claim(words, active, mode, given_scores, weights)
    table, evicted = table._evicted(
      claim.victims, take_rows(leaves, claim.victims.offered) if claim.victims else None
    )
    if evicted is not None:  # the victims' values are read before the newcomers write their rows
      claim = claim._replace(placed=ordering.after(claim.placed, *evicted[1]))
    index = jnp.arange(words.shape[0], dtype=jnp.int32)
    if not mode.keeps_present:
      return table._put_last(claim.slot, leaves, claim.found | claim.placed), [], evicted
    defaults = [jnp.broadcast_to(d, x.shape) for d, x in zip(table.default, leaves)]
    new_values = select_rows(claim.placed, take_rows(leaves, claim.first), defaults)
    table = table._put(claim.slot, leaves, claim.placed & (claim.first == index))
    # Found keys' values are read after the write (which leaves them as they were): a read of
    # the old array would keep it alive next to the new one, and XLA would copy it whole.
    return table, select_rows(claim.found, take_rows(table.values, claim.slot), new_values), evicted

  def value_rows(self, placement) -> jax.Array:
    """A slot is its value row: ``placement.slot``."""
    return placement.slot

  def _claim(self, words, active, mode, given_scores, weights) -> tuple[LeanTable, Claim]:
    """Locates the rows' keys and gives the new ones slots, evicting when the table is full (stamped;
    their values are left as they were: the caller writes them)."""
    index = jnp.arange(words.shape[0], dtype=jnp.int32)
    active = jnp.ones(words.shape[0], bool) if active is None else active  # masked rows do nothing
    up = placing.upsert_slots(self.layout, *self._arrays(), words, active, self.size, self.capacity)
    table = dataclasses.replace(
      self,
      digests=up.digests,
      keys=up.keys,
      overflow=up.overflow,
      size=self.size + jnp.sum(up.admitted & (up.first == index), dtype=jnp.int32),
      dropped=self.dropped + (up.dropped if self.eviction is None else 0),
    )
    if self.eviction is None:
      return table._stamped(up.slot, up.admitted), Claim(up.found, up.admitted, up.slot, up.first, None)
    # With an eviction policy, the new keys that do not fit evict instead of being dropped, and
    # every key named gets a new score.
    to_evict = active & ~up.found & ~up.admitted
    table, claim = table._claim_evicting(
      words, up.found, up.admitted, to_evict, up.slot, up.first, given_scores, mode, weights
    )
    return table._stamped(claim.slot, claim.found | claim.placed), claim

  def _claim_evicting(self, words, found, admitted, to_evict, slot, first, given_scores, mode, weights):
    """The rest of a claim with an eviction policy: scores, then the new keys that do not fit evict
    (:mod:`eviction`). ``slot`` and ``first``: each row's slot and the first row of each new key."""
    index = jnp.arange(words.shape[0], dtype=jnp.int32)
    named = found | admitted | to_evict
    # Rows are grouped by key where scores need it (counts, given scores); placing grouped the new
    # keys' rows. Under LRU every row of a present key writes the same clock.
    if given_scores is not None or self.eviction.counts:
      first = claims.owner_per_key(words, named)
    # The last row of each key: whose value an insert keeps, whose score was given.
    takes_last = not mode.keeps_present or given_scores is not None
    last = claims.owner_per_key(words, named, last=True) if takes_last else first
    stored = found | admitted
    # Explicit scores: CustomScore, or entries moved by resize and import.
    old = None if given_scores is not None else jnp.where(found, self.slot_scores[slot], jnp.uint32(0))
    score = self._policy_scores(named, first, last, old, given_scores, weights)
    heads = named & (first == index)
    scored = self._set_scores(slot, score, stored & heads)
    protect = None if self.eviction.names_newest and given_scores is None else jnp.where(stored, slot, -1)
    outcome = eviction.evict(
      self.layout, *self._arrays(), scored.slot_scores, words, to_evict & heads, score, protect
    )
    placed = to_evict & outcome.placed[first]  # the rows of a key that took a slot follow its first row
    refused = to_evict & heads & outcome.refused
    evicted = heads & (outcome.placed | outcome.displaced)  # rows whose key made an entry leave
    table = dataclasses.replace(
      self,
      digests=outcome.digests,
      keys=outcome.keys,
      overflow=outcome.overflow,
      slot_scores=outcome.scores,
      evictions=self.evictions + jnp.sum(evicted | refused, dtype=jnp.int32),
    )
    offered = first if mode.keeps_present else last
    # A row whose victim was a key of this call (displaced) reports that key's offered value.
    newcomer = outcome.victim_batch >= 0
    victims = Victims(
      words=jnp.where(refused[:, None], words, outcome.victim_words),
      slot=outcome.slot,
      scores=jnp.where(refused, score, outcome.victim_score),
      valid=refused | evicted,
      refused=refused | newcomer,
      offered=jnp.where(newcomer, offered[jnp.maximum(outcome.victim_batch, 0)], offered),
    )
    slot = jnp.where(placed, outcome.slot[first], slot)
    return table, Claim(found, admitted | placed, slot, first, victims)

  def _release(self, words, slot, mask):
    layout = self.layout
    _, _, digest = layout.buckets_of(words)
    first, on = layout.probed_on(words, slot)
    table = dataclasses.replace(
      self,
      digests=layout.with_digests(self.digests, slot, jnp.uint32(0) - digest, mask),
      overflow=layout.shift_overflow(self.overflow, first, slot, mask & on, -1),
    )
    if self.eviction is not None:  # a free slot scores the highest: no new key evicts it
      table = table._set_scores(slot, NO_SCORE, mask)
    return table


class Victims(NamedTuple):
  """The entries a claim evicted or refused, one per key row (see ``Table.insert_and_evict``)."""

  words: jax.Array  # uint32[N, W]: the victim's key (a refused row: its own)
  slot: jax.Array  # int32[N]: the victim's slot (its value row), read before a newcomer writes it
  scores: jax.Array  # uint32[N]
  valid: jax.Array  # bool[N]: the rows that evicted an entry or were refused
  refused: jax.Array  # bool[N]: the row reports a key of the call (refused, or displaced by the row)
  offered: jax.Array  # int32[N]: the row whose value that key offered


class Claim(NamedTuple):
  """Where the keys of a batch of rows live after :meth:`LeanTable._claim`."""

  found: jax.Array  # bool[N]: active rows whose key was present
  placed: jax.Array  # bool[N]: active rows whose key was new and now has a slot (every row of the key)
  slot: jax.Array  # int32[N]: the slot (value row) of each found or placed row's key
  first: jax.Array  # int32[N]: the first row of each placed key (a row's own index elsewhere)
  victims: Victims | None  # with an eviction policy


@jax.jit
def _jit_place(table: LeanTable, words, leaves, given_scores, slots, valid) -> LeanTable:
  return table._place_rows(words, leaves, given_scores, slots, valid)


# One program builds an empty table; only ``default`` is an array argument.
@functools.partial(jax.jit, static_argnums=(0, 1, 2, 4, 5, 6, 7))
def _empty(capacity, key_spec, value_spec, default, num_buckets, bucket_size, eviction, stamps):
  slots = num_buckets * bucket_size
  return LeanTable(
    keys=jnp.zeros((slots, key_spec.num_words), jnp.uint32),
    digests=jnp.zeros((slots // PER_WORD,), jnp.uint32),
    overflow=jnp.zeros((num_buckets,), jnp.uint32),
    num_buckets=num_buckets,
    bucket_size=bucket_size,
    **empty_fields(
      capacity, key_spec, value_spec, default, slots=slots, rows=slots, eviction=eviction, stamps=stamps
    ),
  )
