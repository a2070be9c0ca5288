"""Open addressing over buckets, with overflow counts instead of tombstones.

A key's home bucket comes from its hash; the key lives in the first bucket at
or after home (in probe order, wrapping) that had a free slot when it was
inserted (see :mod:`buckets` for the records).

* **No tombstones.** A bucket's overflow count is the number of live entries
  that probed past it. A search stops at the first bucket that holds the key
  or has no overflow; removing an entry decrements the counts it incremented,
  so probe chains shrink again instead of filling up with deleted markers.
* **Conflicts resolved by claims, not by racing scatters** (:mod:`placing`):
  per-call work is O(batch) and never touches the whole capacity.
* **Dense values.** A slot's value row is kept in its bucket's record; the
  ``capacity`` value rows are handed out from a stack of free rows, so wide
  values cost ``capacity`` rows, not one per slot.
* **Exact when full.** When a batch might not fit, the sort-based admission
  (:func:`batch.admit`) takes new keys in batch order. Without an eviction
  policy the others are counted in ``dropped``; with one they evict
  (:mod:`eviction_rounds`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxres._core import call_args, constants, ordering
from jaxres._core.encoding import key_specs
from jaxres._core.encoding.value_specs import ValueSpec
from jaxres._core.kernels import claims, native
from jaxres._core.kernels.row_ops import select_rows, take_rows
from jaxres._core.policies import Policy, check_policy
from jaxres._core.pytrees import pytree_dataclass, static_field
from jaxres._core.storages.open_addressing import eviction_rounds, placing
from jaxres._core.storages.open_addressing.buckets import LINE_WORDS, Layout
from jaxres._core.storages.storage import NO_SCORE, KeptSlots, Storage, empty_fields
from jaxres._core.table import check_capacity
from jaxres._errors import check_int

_MAX_LOAD = 0.5  # live entries per slot at full capacity: short probe chains
_EVICTION_BUCKET = constants.EVICTING_BUCKET_SIZE


@pytree_dataclass
class OpenAddressingTable(KeptSlots):
  """A mutable hash table with O(1) expected probes per key.

  Create one with :meth:`create`; every method returns a new table (see
  :class:`Table` for the full method list and batch semantics).

  Examples:
    >>> import jax, jax.numpy as jnp, jaxres as jr
    >>> t = jr.OpenAddressingTable.create(
    ...   capacity=1024, key=jnp.int32, value=jax.ShapeDtypeStruct((2,), jnp.float32), default=0.0
    ... )
    >>> t = jax.jit(lambda t, k, v: t.insert(k, v))(t, jnp.array([4, 8]), jnp.ones((2, 2)))
    >>> t.find(jnp.array([8, 5])).tolist(), int(t.size)
    ([[1.0, 1.0], [0.0, 0.0]], 2)
  """

  buckets: jax.Array  # uint32[num_buckets, layout.record_width]
  values: tuple  # leaves [num_rows, *storage_shape]: dense rows, the slots' records point into them
  free_rows: jax.Array  # int32[capacity]: free_rows[size:] are the rows no entry holds
  default: tuple  # leaves [*storage_shape]
  slot_scores: jax.Array  # uint32[num_buckets * bucket_size] with an eviction policy, else uint32[0]
  bucket_floors: jax.Array  # uint32[num_buckets] with a fixed eviction_window > 1: each bucket's lowest score
  row_stamps: jax.Array  # uint32[num_rows]: the clock when each row's entry last changed
  version: jax.Array  # uint32: calls that changed the table so far (see Storage)
  size: jax.Array  # shape=(), dtype=int32
  dropped: jax.Array  # shape=(), dtype=int32
  clock: jax.Array  # shape=(), dtype=uint32
  evictions: jax.Array  # shape=(), dtype=int32
  capacity: int = static_field()
  key_spec: key_specs.KeySpec = static_field()
  value_spec: ValueSpec = static_field()
  eviction: Policy | None = static_field()
  bucket_size: int = static_field()
  eviction_window: int | None = static_field()

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
    eviction_window: int | None = None,
  ) -> OpenAddressingTable:
    """An empty table guaranteed to hold ``capacity`` live entries.

    Args:
      capacity: static number of live entries the table holds (>= 1).
      key: ``jnp.int32``/``uint32``/``int64``/``uint64``, or a
        ``jax.ShapeDtypeStruct`` of one for composite keys, e.g.
        ``ShapeDtypeStruct((2,), jnp.int32)`` for ``(user_id, item_id)``.
      value: a dtype, a ``jax.ShapeDtypeStruct``, or a pytree of them.
      default: value returned for missing keys; a matching pytree, scalars
        broadcast.
      bucket_size: slots per bucket, fetched by one gather (1 to 32); by
        default as many as fill one 64-byte cache line with the bucket's
        record (7 for 32-bit keys, 4 for 64-bit ones); 8 with an eviction
        policy.
      eviction: ``None`` (a full table refuses new keys, counted in
        ``dropped``), or ``jr.LRU()``, ``jr.LFU()``, ``jr.CustomScore()``: a
        full table evicts (see :mod:`jaxres` section on eviction). Scores take
        4 bytes per slot.
      eviction_window: buckets in each of a new key's two windows of
        eviction candidates (1 to 64), or ``None`` (the default): per call,
        from the share of the capacity its new keys replace: 1 (16 slots,
        about 8 entries) below 1/16 of it, doubling with the share up to 32
        for a whole capacity, where the keys of one batch would otherwise
        compete for few candidates. More candidates evict closer to the
        lowest scores of the whole table. A fixed window wider than 1 keeps
        each bucket's lowest score too (half a byte more per slot): a key
        reads its windows' floors, then one bucket's scores; by default every
        candidate's score is read (see :mod:`eviction_rounds`).

    Raises:
      TypeError: unsupported key or value dtype, non-integer ``capacity`` or
        ``bucket_size``, an ``eviction`` that is not a policy.
      ValueError: ``capacity``, ``bucket_size`` or ``eviction_window`` out of range.
    """
    capacity = check_capacity(capacity)
    if eviction_window is not None:
      eviction_window = check_int(
        eviction_window, "eviction_window", low=1, high=constants.MAX_EVICTION_WINDOW
      )
    eviction = check_policy(eviction)
    key_spec, value_spec, default = cls._specs(key, value, default)
    if bucket_size is None:
      bucket_size = line_slots(key_spec.num_words) if eviction is None else _EVICTION_BUCKET
    bucket_size = check_int(bucket_size, "bucket_size", low=1, high=32)
    return _empty(capacity, key_spec, value_spec, default, bucket_size, eviction, eviction_window)

  # ------------------------------------------------------------- layout

  @property
  def layout(self) -> Layout:
    return Layout(self.buckets.shape[-2], self.bucket_size, self.key_spec.num_words)

  @property
  def num_buckets(self) -> int:
    return self.buckets.shape[-2]

  @property
  def num_slots(self) -> int:
    return self.layout.num_slots

  @property
  def num_rows(self) -> int:
    """Dense value rows, one per entry the table holds (``free_rows`` hands them out): ``capacity``."""
    return self.capacity

  @property
  def slot_layout(self):
    return np.array([1, self.buckets.shape[-2], self.bucket_size])  # shards, buckets, slots per bucket

  @property
  def slot_kind(self) -> str:
    return "open_addressing"

  def placed(self, keys, values, scores, slots):
    empty = self._cleared()._advance()  # every entry newer than any version of this table before
    rows = call_args.prepare(empty, keys, values, scores=scores, explicit_scores=True)
    self.check_slots(rows.words[: rows.n], slots)
    if not rows.n:
      return empty
    slots = call_args.pad_to(jnp.asarray(slots, jnp.int32), rows)
    return _jit_place(empty, rows.words, rows.leaves, rows.given_scores, slots, rows.active)

  def _place_rows(self, words, leaves, given_scores, slots, valid):
    """This empty table with the rows' entries at ``slots`` (distinct), where ``valid``."""
    layout = self.layout
    flat = layout.store(self.buckets.reshape(-1), slots, words, valid)
    flat = layout.shift_overflow(flat, layout.home(words), slots, valid, 1)
    flat = placing.take_free_rows(layout, flat, slots, valid, self.free_rows, self.size)
    table = dataclasses.replace(self, buckets=flat.reshape(self.buckets.shape))
    table = table._write(slots, leaves, valid)
    if given_scores is not None:
      table = table._set_scores(slots, given_scores, valid)
    return dataclasses.replace(table, size=jnp.sum(valid, dtype=jnp.int32))

  def _row_of(self, slot):
    return self.layout.row_of(self.buckets.reshape(-1), slot)

  def _with_capacity(self, capacity):
    return _empty(
      capacity,
      self.key_spec,
      self.value_spec,
      self.default,
      self.bucket_size,
      self.eviction,
      self.eviction_window,
    )

  # ------------------------------------------------------------ queries

  def _probe(self, buckets, words, bucket):
    layout = self.layout
    records = buckets[bucket]  # the one gather: [N, record]
    match = layout.occupancy(records[:, layout.mask_column]) & jnp.all(
      layout.keys_of(records) == words[:, None, :], axis=-1
    )
    hit = jnp.any(match, axis=-1)
    slot = bucket * self.bucket_size + jnp.argmax(match, axis=-1).astype(jnp.int32)
    return hit, slot, ~hit & (records[:, layout.mask_column + 1] > 0)

  def _locate(self, words):
    """``(hit, slot)`` of each key row: its slot, or for a miss the first slot of its home bucket."""
    n = words.shape[0]
    results = (jax.ShapeDtypeStruct((n,), jnp.bool_), jax.ShapeDtypeStruct((n,), jnp.int32))
    reference = self._follow_chains
    return native.on_cpu(
      "jaxres_locate", reference, results, self.buckets, words, bucket_size=self.bucket_size
    )

  def _lookup_rows(self, words, defaults):
    """``(values, found)``: one kernel on CPU probes and gathers (prefetching both).

    ``defaults``: leaves ``[n, *shape]`` or ``[*shape]``, or none for ``found`` alone.
    """
    n = words.shape[0]
    values = self.values if defaults else ()
    results = (
      jax.ShapeDtypeStruct((n,), jnp.bool_),
      *(jax.ShapeDtypeStruct((n, *v.shape[1:]), v.dtype) for v in values),
    )

    def reference(buckets, words, *leaves):
      values, found = Storage._lookup_rows(self, words, leaves[len(leaves) // 2 :])
      return found, *values

    found, *out = native.on_cpu(
      "jaxres_lookup", reference, results, self.buckets, words, *values, *defaults,
      bucket_size=self.bucket_size,
    )  # fmt: skip
    return out, found

  def _follow_chains(self, buckets, words):
    """``(hit, slot)`` of each key row in ``buckets`` (the table's records, or their update), in XLA."""
    n = words.shape[0]
    bucket = self.layout.home(words)
    hit, slot, more = self._probe(buckets, words, bucket)
    chunk = max(64, min(n, n // 32))  # keys probing past their home bucket are rare

    def probe_further(state):
      # Compact up to `chunk` of the keys still probing, follow their chains
      # on chunk-sized arrays only, then write the answers back once.
      hit, slot, more = state
      rows, target = claims.pending_rows(more, chunk)

      def step(inner):
        at, steps, hit_c, slot_c, more_c = inner
        at = jnp.where(more_c, (at + 1) % self.num_buckets, at)
        hit2, slot2, more2 = self._probe(buckets, words[rows], at)
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

  def _slots(self):
    layout = self.layout
    live = layout.occupancy(self.buckets[:, layout.mask_column]).reshape(-1)
    return layout.keys_of(self.buckets).reshape(-1, layout.num_words), live

  def _slots_at(self, slot):
    layout = self.layout
    records = self.buckets[slot // layout.bucket_size]  # one record per slot
    lane = (slot % layout.bucket_size)[:, None]
    live = jnp.take_along_axis(layout.occupancy(records[:, layout.mask_column]), lane, axis=1)[:, 0]
    words = jnp.take_along_axis(layout.keys_of(records), lane[:, :, None], axis=1)[:, 0]
    return words, live

  # ---------------------------------------------------------- mutations

  def _upsert_rows(self, words, leaves, active, mode, given_scores=None, weights=None):
    table, claim = self._claim(words, active, mode, given_scores, weights)
    table, evicted = table._evicted(
      claim.victims, take_rows(leaves, claim.victims.offered) if claim.victims else None
    )
    if evicted is not None:  # the victims' values are read before their rows are written
      claim = claim._replace(placed=ordering.after(claim.placed, *evicted[1]))
    table, out = table._write_values(words, leaves, claim, mode)
    return table, out, evicted

  def value_rows(self, placement) -> jax.Array:
    """A slot's value lives in a row of its own: ``placement.row``."""
    return placement.row

  def _claim(self, words, active, mode, given_scores, weights) -> tuple[OpenAddressingTable, Claim]:
    """Locates the rows' keys and gives the new ones slots and value rows (evicting when full).

    The values of the new keys' rows are left as they were: :meth:`_write_values`
    (or a caller holding the rows) writes them.
    """
    index = jnp.arange(words.shape[0], dtype=jnp.int32)
    active = (
      jnp.ones(words.shape[0], bool) if active is None else active
    )  # masked rows neither update nor insert
    # One call locates, admits and places: no cond around the placement, as each branch
    # would take its own copy of the whole bucket array.
    up = placing.upsert_slots(
      self.layout, self.buckets, words, active, self.free_rows, self.size, self._follow_chains
    )
    table = dataclasses.replace(
      self,
      buckets=up.records,
      size=self.size + jnp.sum(up.admitted & (up.first == index), dtype=jnp.int32),
      dropped=self.dropped + (up.dropped if self.eviction is None else 0),
    )
    if self.eviction is None:
      return table._stamped(up.row, up.admitted), Claim(up.found, up.admitted, up.row, up.first, None)
    # With an eviction policy, the new keys that do not fit evict instead of being dropped, and
    # every key named gets a new score.
    to_evict = active & ~up.found & ~up.admitted
    table, claim = table._claim_evicting(
      words, up.found, up.admitted, to_evict, up.slot, up.row, up.first, given_scores, mode, weights
    )
    return table._stamped(claim.row, claim.found | claim.placed), claim

  def _write_values(self, words, leaves, claim: Claim, mode):
    """The values of an insert or find_or_insert whose keys have rows: ``(table, out)``."""
    index = jnp.arange(words.shape[0], dtype=jnp.int32)
    found, placed, row, first = claim.found, claim.placed, claim.row, claim.first
    if not mode.keeps_present:
      return self._put_last(row, leaves, found | placed), []
    defaults = [jnp.broadcast_to(d, x.shape) for d, x in zip(self.default, leaves)]
    new_values = select_rows(placed, take_rows(leaves, first), defaults)
    table = self._put(row, leaves, placed & (first == index))
    # Found keys' values are read after the write (which leaves them as they were): a read of
    # the old array would keep it alive next to the new one, and XLA would copy it whole.
    return table, select_rows(found, take_rows(table.values, row), new_values)

  def _claim_evicting(self, words, found, admitted, to_evict, slot, row, first, given_scores, mode, weights):
    """The rest of a claim with an eviction policy: scores, then new keys that do not fit evict.

    ``row`` and ``first``: the value row of each row's slot, and the first row
    of each admitted key (from their placement).
    """
    n = words.shape[0]
    index = jnp.arange(n, dtype=jnp.int32)
    named = found | admitted | to_evict
    # Rows are grouped by key where scores need it (counts, given scores) and
    # always for the keys that evict, so that each evicts once. Under LRU every
    # row of a present key writes the same clock, so those need no grouping.
    grouped = to_evict if given_scores is None and not self.eviction.counts else named
    first = jnp.where(grouped, claims.owner_per_key(words, grouped), first)
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
    outcome = eviction_rounds.evict(
      self.layout,
      self.buckets.reshape(-1),
      scored.slot_scores,
      scored.bucket_floors,
      words,
      ordering.after(to_evict & heads, row),  # the rows placed keys took, read before evicting writes
      score,
      protect,
      self.eviction_window,
      self.capacity,
    )
    # Rows of a key that had to evict follow its first row.
    placed = to_evict & outcome.placed[first]
    refused = to_evict & heads & outcome.refused
    evicted = heads & (outcome.placed | outcome.displaced)  # rows that made an entry leave
    table = dataclasses.replace(
      self,
      buckets=outcome.flat.reshape(self.buckets.shape),
      slot_scores=outcome.scores,
      bucket_floors=outcome.floors,
      evictions=self.evictions + jnp.sum(evicted | refused, dtype=jnp.int32),
    )
    victim_row = outcome.victim_row
    offered = first if mode.keeps_present else last
    # A row whose victim was a key of this call (displaced) reports that key's offered value.
    newcomer = outcome.victim_batch >= 0
    victims = Victims(
      words=jnp.where(refused[:, None], words, outcome.victim_words),
      row=victim_row,
      scores=jnp.where(refused, score, outcome.victim_score),
      valid=refused | evicted,
      refused=refused | newcomer,
      offered=jnp.where(newcomer, offered[jnp.maximum(outcome.victim_batch, 0)], offered),
    )
    row = jnp.where(placed, victim_row[first], row)
    return table, Claim(found, admitted | placed, row, first, victims)

  def _set_scores(self, slot, score, mask):
    """As :meth:`Storage._set_scores`, the floors of the buckets written kept exact (eviction_rounds)."""
    table = super()._set_scores(slot, score, mask)
    if not self.bucket_floors.shape[-1]:  # none kept (see _empty)
      return table
    floors = eviction_rounds.refresh_floors(
      self.layout, table.slot_scores, self.bucket_floors, slot // self.bucket_size, mask
    )
    return dataclasses.replace(table, bucket_floors=floors)

  def _release(self, words, slot, mask):
    layout = self.layout
    flat = layout.unset(self.buckets.reshape(-1), slot, mask)
    flat = layout.shift_overflow(flat, layout.home(words), slot, mask, -1)
    table = dataclasses.replace(self, buckets=flat.reshape(self.buckets.shape))
    if self.eviction is not None:  # a free slot scores the highest (see eviction_rounds)
      table = table._set_scores(slot, NO_SCORE, mask)
    # The released rows go on top of the free ones, free_rows[size - released:]. Their row
    # cells are read from the updated records (unchanged): a read of the old ones would make
    # XLA copy the whole array.
    at = self.size - jnp.sum(mask, dtype=jnp.int32) + claims.prefix_sum(mask) - 1
    free_rows = self.free_rows.at[jnp.where(mask, at, self.capacity)].set(table._row_of(slot), mode="drop")
    return dataclasses.replace(table, free_rows=free_rows)


class Victims(NamedTuple):
  """The entries a claim evicted or refused, one per key row (see ``Table.insert_and_evict``)."""

  words: jax.Array  # uint32[N, W]: the victim's key (a refused row: its own)
  row: jax.Array  # int32[N]: the victim's value row, read before a newcomer writes it
  scores: jax.Array  # uint32[N]
  valid: jax.Array  # bool[N]: the rows that evicted an entry or were refused
  refused: jax.Array  # bool[N]: the row reports a key of the call (refused, or displaced by the row)
  offered: jax.Array  # int32[N]: the row whose value that key offered


class Claim(NamedTuple):
  """Where the keys of a batch of rows live after :meth:`OpenAddressingTable._claim`."""

  found: jax.Array  # bool[N]: active rows whose key was present
  placed: jax.Array  # bool[N]: active rows whose key was new and now has a slot (every row of the key)
  row: jax.Array  # int32[N]: the value row of each found or placed row's key
  first: jax.Array  # int32[N]: the first row of each placed key (a row's own index elsewhere)
  victims: Victims | None  # with an eviction policy


def line_slots(num_words: int) -> int:
  """Slots per bucket such that a record (keys, mask, overflow count, rows) fits one 64-byte line.

  Examples:
    >>> line_slots(1), line_slots(2), line_slots(3)
    (7, 4, 3)
  """
  return max(1, (LINE_WORDS - 2) // (num_words + 1))


@jax.jit
def _jit_place(table: OpenAddressingTable, words, leaves, given_scores, slots, valid) -> OpenAddressingTable:
  return table._place_rows(words, leaves, given_scores, slots, valid)


# One program builds an empty table (its arrays filled on the device, not one dispatch each); only
# ``default`` is an array argument.
@functools.partial(jax.jit, static_argnums=(0, 1, 2, 4, 5, 6))
def _empty(capacity, key_spec, value_spec, default, bucket_size, eviction, eviction_window):
  layout = Layout(max(1, math.ceil(capacity / (bucket_size * _MAX_LOAD))), bucket_size, key_spec.num_words)
  # Floors pay where every call's windows are wider than a bucket (their upkeep slows every write of a
  # score): one-bucket windows read their two buckets' scores, and per-call windows every candidate's.
  floors = layout.num_buckets if eviction is not None and (eviction_window or 1) > 1 else 0
  return OpenAddressingTable(
    buckets=jnp.zeros((layout.num_buckets, layout.record_width), jnp.uint32),
    free_rows=jnp.arange(capacity, dtype=jnp.int32),  # every value row (num_rows == capacity) is free
    bucket_floors=jnp.full((floors,), NO_SCORE, jnp.uint32),
    bucket_size=bucket_size,
    eviction_window=eviction_window,
    **empty_fields(
      capacity,
      key_spec,
      value_spec,
      default,
      slots=layout.num_slots,
      rows=capacity,
      eviction=eviction,
      stamps=True,
    ),
  )
