"""A table partitioned across the devices of a mesh axis, on JAX's SPMD runtime.

Each device holds one ordinary table (a *shard*): the keys whose routing hash
falls to it. The shards' arrays lie end to end along their first axis (their
scalars stacked), split over the mesh axis, so the whole table is one pytree
of sharded ``jax.Array`` s and each device's part of it is its shard.

A batched operation runs under :func:`jax.shard_map` over that axis:

1. The batch is split over the devices (padded to a multiple of their number).
2. Each device sends each of its distinct keys once (with the value that
   counts; every row where a fold depends on the order), numbered per owner
   in batch order. A round's ``all_to_all`` carries the rows of positions
   ``[start, start + size)`` to every owner: the first round the device's
   expected share and some headroom (:func:`routing.round_rows`), further rounds,
   while any device has rows left, a quarter of that. The owner keeps the
   rows from device ``s`` at ``s * per_device + position``, so it sees its
   keys exactly in the order of the whole batch.
3. The owner runs the ordinary table operation on the rows it received
   (padding is masked with ``valid``), and the same rounds return the
   per-key results to the devices the keys came from; every row of a key
   takes its result.

All duplicates of a key meet on one shard in batch order, so every result
equals that of an unsharded table, whatever the skew; buffers and bytes per
key stay near one request and one reply unless a batch is skewed.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxres._core import folds, memory
from jaxres._core.encoding import key_specs
from jaxres._core.encoding.value_specs import ValueSpec
from jaxres._core.kernels import claims
from jaxres._core.kernels.row_ops import select_rows
from jaxres._core.modes import Carry
from jaxres._core.pytrees import pytree_dataclass, static_field
from jaxres._core.sharding.routing import Route, owner_of, round_rows, shard_capacity_for, travelling
from jaxres._core.storages import registry
from jaxres._core.storages.registry import Storage
from jaxres._core.table import Table, check_capacity


@pytree_dataclass
class ShardedTable(Table):
  """A hash table whose entries are spread over the devices of a mesh axis.

  The same methods as every :class:`Table`, with the same results as an
  unsharded table of the storage it is built from, under ``jit`` too (not
  under ``vmap``). Create one with :meth:`create`.

  Examples:
    >>> import jax, jax.numpy as jnp, jaxres as jr
    >>> mesh = jax.make_mesh((jax.device_count(),), ("shard",))
    >>> t = jr.ShardedTable.create(mesh, "shard", capacity=64, key=jnp.int32, value=jnp.float32)
    >>> t = t.insert(jnp.array([3, 5, 3]), jnp.array([1.0, 2.0, 4.0]))
    >>> t.find(jnp.array([3, 5, 7])).tolist(), int(t.size)
    ([4.0, 2.0, 0.0], 2)
  """

  parts: Storage  # the shards' leaves end to end on their first axis (scalars stacked), split over `axis`
  default: tuple  # leaves [*storage_shape]
  mesh: Mesh = static_field()
  axis: str = static_field()
  capacity: int = static_field()
  key_spec: key_specs.KeySpec = static_field()
  value_spec: ValueSpec = static_field()
  shard_ranks: tuple = static_field()  # the rank of each leaf of one shard

  @classmethod
  def create(
    cls,
    mesh: Mesh,
    axis: str,
    capacity: int,
    key,
    value,
    default=0,
    *,
    storage: type[Storage] = registry.STORAGES[registry.DEFAULT],
    shard_capacity: int | None = None,
    **options,
  ) -> ShardedTable:
    """An empty table over the devices of ``mesh`` along ``axis``.

    Args:
      mesh: a :class:`jax.sharding.Mesh`; other axes than ``axis`` hold
        replicas.
      axis: the mesh axis the entries are partitioned over.
      capacity: static total number of distinct keys the table is sized for.
      key: the key dtype or spec, as for the storage's ``create``.
      value: the value dtype, spec or pytree, as for the storage's ``create``.
      default: the value of missing keys, as for the storage's ``create``.
      storage: the table class of each shard, :class:`OpenAddressingTable`
        (default) or :class:`SortedTable`.
      shard_capacity: entries each shard holds; defaults to
        :func:`shard_capacity_for` ``(capacity, num_shards)``. New keys that
        do not fit their shard are counted in :attr:`dropped_per_shard`.
        With an eviction policy it defaults to ``capacity // num_shards``, so
        the table never holds more than ``capacity`` entries: each shard
        evicts among its own when it holds its share.
      **options: further arguments of ``storage.create`` (``bucket_size``,
        ``eviction``).

    Raises:
      TypeError: ``mesh`` is not a Mesh, ``storage`` not a storage class, or
        what the storage's ``create`` raises.
      ValueError: ``axis`` is not an axis of ``mesh``, or bad capacities.
    """
    if not isinstance(mesh, Mesh):
      raise TypeError(f"mesh: expected a jax.sharding.Mesh, got {type(mesh).__name__}.")
    if axis not in mesh.axis_names:
      raise ValueError(f"axis: {axis!r} is not an axis of the mesh {tuple(mesh.axis_names)}.")
    if not (isinstance(storage, type) and issubclass(storage, Storage)):
      known = " or ".join(table.__name__ for table in registry.STORAGES.values())
      raise TypeError(f"storage: expected {known}, got {storage!r}.")
    capacity = check_capacity(capacity)
    # Routing reshards the batch itself, so the mesh's axes are used in Auto
    # mode (``jax.make_mesh`` makes Explicit ones) and any input sharding works.
    mesh = Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))
    num_shards = mesh.shape[axis]
    if shard_capacity is None:
      shard_capacity = _shard_capacity(capacity, num_shards, options.get("eviction"))
    shard_capacity = check_capacity(shard_capacity, "shard_capacity")
    one = storage.create(1, key, value, default, **options)  # checks the arguments; specs and default
    shard = jax.eval_shape(lambda: storage.create(shard_capacity, key, value, default, **options))
    return cls(
      parts=_laid_out(shard, one.default, mesh, axis),
      default=jax.device_put(one.default, NamedSharding(mesh, PartitionSpec())),  # as jit returns it
      mesh=mesh,
      axis=axis,
      capacity=capacity,
      key_spec=one.key_spec,
      value_spec=one.value_spec,
      shard_ranks=tuple(x.ndim for x in jax.tree.leaves(one)),
    )

  # ------------------------------------------------------------ shards

  @property
  def shards(self) -> Storage:
    """The shards stacked on a leading axis (leaves ``[num_shards, ...]``): a view of :attr:`parts`.

    The shards are kept end to end rather than stacked so that each device's
    part of a leaf *is* its shard's leaf: taking a shard out of a stacked axis
    inside ``shard_map`` makes XLA copy it around the kernels that update it
    in place.
    """
    leaves, treedef = jax.tree.flatten(self.parts)
    num_shards = self.num_shards
    stacked = [
      x if rank == 0 else x.reshape(num_shards, x.shape[0] // num_shards, *x.shape[1:])
      for x, rank in zip(leaves, self.shard_ranks, strict=True)
    ]
    return jax.tree.unflatten(treedef, stacked)

  @property
  def _shard_structure(self) -> Storage:
    """One shard with ``jax.ShapeDtypeStruct`` leaves: its static properties, and no array touched
    (an eager :attr:`shards` reshapes every leaf, a program each)."""
    leaves, treedef = jax.tree.flatten(self.parts)
    n = self.num_shards
    return jax.tree.unflatten(
      treedef,
      [
        jax.ShapeDtypeStruct(() if rank == 0 else (x.shape[0] // n, *x.shape[1:]), x.dtype)
        for x, rank in zip(leaves, self.shard_ranks, strict=True)
      ],
    )

  @classmethod
  def capacity_for(cls, nbytes: int, mesh: Mesh, axis: str, key, value, default=0, **options) -> int:
    """The largest capacity whose table (:meth:`create` with these arguments) holds at most
    ``nbytes`` over all its shards (:meth:`memory`), found without allocating a table."""
    create = lambda c: cls.create(mesh, axis, c, key, value, default, **options)
    smallest = cls.smallest_capacity(mesh, axis, options.get("eviction"))
    return memory.largest_capacity(
      lambda c: memory.nbytes(jax.eval_shape(lambda: create(c))), nbytes, smallest=smallest
    )

  @staticmethod
  def smallest_capacity(mesh: Mesh, axis: str, eviction=None) -> int:
    """The smallest capacity of a table over ``axis`` of ``mesh``: one row per shard when it evicts."""
    return 1 if eviction is None else mesh.shape.get(axis, 1)

  def _value_arrays(self) -> list:
    return [
      (rows, *defaults) for rows, defaults in zip(self.parts.values, zip(self.parts.default, self.default))
    ]

  def _with_shards(self, shards: Storage) -> ShardedTable:
    """This table holding ``shards`` (stacked, as :attr:`shards` gives them)."""
    return dataclasses.replace(self, parts=_end_to_end(shards))

  # ------------------------------------------------------------ counts

  @property
  def num_shards(self) -> int:
    return self.mesh.shape[self.axis]

  @property
  def shard_capacity(self) -> int:
    return self._shard_structure.capacity

  @property
  def size(self) -> jax.Array:
    """int32[]: live entries over all shards."""
    return jnp.sum(self.parts.size)  # a shard's scalars lie end to end: [num_shards]

  @property
  def dropped(self) -> jax.Array:
    """int32[]: new keys lost because their shard was full."""
    return jnp.sum(self.parts.dropped)

  @property
  def size_per_shard(self) -> jax.Array:
    """int32[num_shards]: live entries of each shard."""
    return self.parts.size

  @property
  def dropped_per_shard(self) -> jax.Array:
    """int32[num_shards]: new keys each shard could not hold."""
    return self.parts.dropped

  @property
  def eviction(self):
    """The shards' eviction policy (each shard evicts among its own entries)."""
    return self._shard_structure.eviction

  @property
  def clock(self) -> jax.Array:
    """uint32[]: mutating calls so far (every call reaches every shard, so their clocks agree)."""
    return self.parts.clock[0]

  @property
  def evictions(self) -> jax.Array:
    """int32[]: entries evicted or refused, over all shards."""
    return jnp.sum(self.parts.evictions)

  @property
  def num_slots(self) -> int:
    """Slots over all shards; ``export_batch`` numbers them shard by shard."""
    return self.num_shards * self._shard_structure.num_slots

  @property
  def num_rows(self) -> int:
    """Value rows over all shards: a shard's row ``r`` is the table's ``shard * shard_rows + r``."""
    return self.num_shards * self.shard_rows

  @property
  def shard_rows(self) -> int:
    """Value rows of each shard, as its storage declares them (:attr:`Storage.num_rows`)."""
    return self._shard_structure.num_rows

  def export(self):
    """All entries as fixed-shape arrays ``(keys, values, valid)``.

    ``num_shards * shard_capacity`` rows (every entry the shards can hold),
    live entries first; otherwise as :meth:`Table.export`.
    """
    return super().export()

  # ---------------------------------------------------- row operations

  def _with_capacity(self, capacity):
    if capacity == self.capacity:
      shard_capacity = self.shard_capacity  # as created, perhaps by hand
    else:
      shard_capacity = _shard_capacity(capacity, self.num_shards, self.eviction)
    # no shard copied out: the new shard's structure from the old one's
    shard = jax.eval_shape(lambda old: old._with_capacity(shard_capacity), self._shard_structure)
    parts = _laid_out(shard, self.default, self.mesh, self.axis)
    return dataclasses.replace(self, parts=parts, capacity=capacity)

  def _tick(self):
    return dataclasses.replace(self, parts=self.parts._tick())

  def _advance(self):
    return dataclasses.replace(self, parts=self.parts._advance())

  def _carry(self, other):
    return dataclasses.replace(self, parts=self.parts._carry(other.parts))

  def with_counters(self, clock, evictions):
    clock = jnp.full_like(self.shards.clock, clock)
    evictions = jnp.zeros_like(self.shards.evictions).at[0].set(evictions)  # a total
    return dataclasses.replace(self, parts=dataclasses.replace(self.parts, clock=clock, evictions=evictions))

  def _lookup_rows(self, words, defaults):
    def op(shard, words, active, rows):
      del active, rows
      leaves, found = shard._lookup_rows(words, list(shard.default) if defaults else [])
      return shard, [*leaves, found]

    _, out = self._routed(op, words, None, [], pick=())
    found = out.pop()
    return select_rows(found, out, defaults), found

  def _score_rows(self, words):
    def op(shard, words, active, rows):
      del active, rows
      return shard, [shard._score_rows(words)]

    return self._routed(op, words, None, [], pick=())[1][0]

  def _upsert_rows(self, words, leaves, active, mode, given_scores=None, weights=None):
    extras = self._extras(words, given_scores, weights)

    def op(shard, words, active, rows):
      values, given_scores, weights = _split(rows, extras)
      shard, out, evicted = shard._upsert_rows(words, values, active, mode, given_scores, weights)
      pieces = [] if evicted is None else [evicted[0], *evicted[1], evicted[2], evicted[3]]
      return shard, [*out, *pieces]

    # A repeated key travels once, with the values that count (an insert's last, a
    # find_or_insert's first), its last given score and how often it occurred.
    pick = (Carry.FIRST if mode.keeps_present else Carry.LAST,) * len(leaves) + tuple(p for _, p in extras)
    travelling = [*leaves, *(x for x, _ in extras)]
    table, outputs = self._routed(op, words, active, travelling, pick, flags=self.eviction is not None)
    num_out = len(leaves) if mode.keeps_present else 0
    out, pieces = outputs[:num_out], outputs[num_out:]
    if self.eviction is None:
      return table, out, None
    return table, out, (pieces[0], pieces[1:-2], pieces[-2], pieces[-1])

  def _find_rows(self, words):
    def op(shard, words, active, rows):
      del active, rows
      return shard, [self._global_rows(shard._find_rows(words))]

    return self._routed(op, words, None, [], pick=())[1][0]

  def _claim_rows(self, words, active, given_scores=None, weights=None):
    extras = self._extras(words, given_scores, weights)

    def op(shard, words, active, rows):
      _, given_scores, weights = _split(rows, extras)
      shard, index, found, inserted, evicted = shard._claim_rows(words, active, given_scores, weights)
      pieces = [] if evicted is None else [evicted[0], *evicted[1], evicted[2], evicted[3]]
      return shard, [self._global_rows(index), found, inserted, *pieces]

    pick = tuple(p for _, p in extras)
    table, outputs = self._routed(
      op, words, active, [x for x, _ in extras], pick, flags=self.eviction is not None
    )
    index, found, inserted, *pieces = outputs
    evicted = None if self.eviction is None else (pieces[0], pieces[1:-2], pieces[-2], pieces[-1])
    return table, index, found, inserted, evicted

  def _global_rows(self, index):
    """A shard's value rows as the table's: ``shard * shard_rows + row`` (``-1`` stays)."""
    return jnp.where(index >= 0, lax.axis_index(self.axis) * self.shard_rows + index, -1)

  def _read_rows(self, index, defaults):
    def op(shard, rows, active, _):
      del active
      return shard, shard._read_rows(rows[:, 0].astype(jnp.int32), list(shard.default))

    out = self._routed(op, self._row_words(index), index >= 0, [], pick=(), by_row=True)[1]
    return select_rows(index >= 0, out, defaults)

  def _write_rows(self, index, leaves, active):
    def op(shard, rows, active, values):
      return shard._write_rows(rows[:, 0].astype(jnp.int32), values, active), []

    active = active & (index >= 0)
    pick = (Carry.LAST,) * len(leaves)
    return self._routed(op, self._row_words(index), active, leaves, pick, by_row=True)[0]

  def _row_words(self, index):
    """Rows as uint32 ``[N, 1]`` for routing by row (``-1``: row 0, inactive)."""
    return jnp.maximum(index, 0).astype(jnp.uint32)[:, None]

  def _assign_rows(self, words, leaves, active):
    def op(shard, words, active, rows):
      return shard._assign_rows(words, rows, active), []

    return self._routed(op, words, active, leaves, pick=(Carry.LAST,) * len(leaves))[0]

  def _apply_rows(self, words, leaves, active, fn, given_scores=None, weights=None):
    extras = self._extras(words, given_scores, weights)

    def op(shard, words, active, rows):
      values, given_scores, weights = _split(rows, extras)
      return shard._apply_rows(words, values, active, fn, given_scores, weights), []

    # A fold that no order changes (an integer sum, a maximum) is reduced per device and
    # travels once per key; any other needs every row at the owner, in batch order.
    reduction = folds.reduction(fn)
    pick = None if reduction is None else (reduction,) * len(leaves) + tuple(p for _, p in extras)
    return self._routed(op, words, active, [*leaves, *(x for x, _ in extras)], pick)[0]

  def _rescore_rows(self, words, active, given_scores=None, weights=None):
    extras = self._extras(words, given_scores, weights)

    def op(shard, words, active, rows):
      _, given_scores, weights = _split(rows, extras)
      return shard._rescore_rows(words, active, given_scores, weights), []

    return self._routed(op, words, active, [x for x, _ in extras], tuple(p for _, p in extras))[0]

  def _extras(self, words, given_scores, weights) -> list[tuple[jax.Array, Carry]]:
    """What travels with a call's rows besides their values, and how a repeated key combines each.

    The given scores (the last one counts) and the occurrences each row
    stands for (they add up: a counting policy scores by them), so that a
    repeated key still travels once per device. Absent ones are left out.
    """
    if self.eviction is not None and self.eviction.counts and weights is None:
      weights = jnp.ones(words.shape[0], jnp.int32)
    return [(x, pick) for x, pick in ((given_scores, Carry.LAST), (weights, Carry.ADD)) if x is not None]

  def _erase_rows(self, fn):
    return self._with_shards(jax.vmap(lambda shard: shard._erase_rows(fn))(self.shards))

  def _slot_rows(self, offset, size):
    per_shard = self.shards.num_slots
    index = offset + jnp.arange(size, dtype=jnp.int32)
    inside = (index >= 0) & (index < self.num_slots)
    index = jnp.clip(index, 0, self.num_slots - 1)
    shard, local = index // per_shard, index % per_shard

    def at(s):  # every shard's view of the slots (the slot numbers taken in each shard)
      words, live = s._slots_at(local)
      return words, live, s._scores_at(local), s._row_of(local)

    words, live, scores, rows = jax.vmap(at)(self.shards)  # [shards, size, ...]
    batch = jnp.arange(size)
    leaves = [v[shard, rows[shard, batch]] for v in self.shards.values]
    return words[shard, batch], leaves, scores[shard, batch], inside & live[shard, batch]

  def _remove_rows(self, words, active):
    def op(shard, words, active, rows):
      del rows
      return shard._remove_rows(words, active), []

    return self._routed(op, words, active, [], pick=())[0]

  def _compact(self):
    words, leaves, scores, valid = jax.vmap(lambda shard: shard._compact())(self.shards)  # [S, C, ...]
    rows = words.shape[0] * words.shape[1]
    order = jnp.argsort(~valid.reshape(-1), stable=True)  # live first, shard by shard
    flat = [x.reshape(rows, *x.shape[2:])[order] for x in (words, scores, *leaves)]
    return flat[0], flat[2:], flat[1], valid.reshape(-1)[order]

  @property
  def slot_layout(self):
    shape = self._shard_structure.slot_layout
    return None if shape is None else np.array([self.num_shards, *shape[1:]])

  @property
  def slot_kind(self):
    return self._shard_structure.slot_kind

  def shard_entries(self, width: int) -> dict:
    """Each shard's live entries first, in ``[shards, width, ...]`` arrays split over the mesh axis.

    ``"keys"`` (the key words), ``"values"`` (the stored value leaves), with
    an eviction policy ``"scores"`` and where the storage keeps a slot layout
    ``"slots"``; a shard's first ``size`` rows are its entries (``width``
    rows at most). On several processes these are global arrays, each
    process holding its own devices' shards.
    """
    return _jit_shard_entries(self, width)

  def _shard_entries(self, width: int) -> dict:
    def one(shard):
      words, leaves, scores, _ = shard._compact()
      block = {"keys": words[:width], "values": [x[:width] for x in leaves]}
      if self.eviction is not None:
        block["scores"] = scores[:width]
      if self.slot_layout is not None:  # the live slots, in the order _compact gives entries
        block["slots"] = jnp.nonzero(shard._slots()[1], size=width, fill_value=0)[0].astype(jnp.int32)
      return block

    return self._each_shard(one)

  @property
  def version(self) -> jax.Array:
    """uint32[]: calls that changed the table so far (every call reaches every shard)."""
    return self.shards.version[0]

  def shard_changes(self, since) -> tuple[jax.Array, jax.Array] | None:
    """Where each shard changed since the table's ``version`` read ``since`` (see
    :meth:`jaxres.Table.changes`): ``(live, counts)``, or ``None`` where the storage gives no changes.

    ``live``: ``uint8[shards, ceil(slots per shard / 8)]``, each shard's live
    slots as packed bits; ``counts``: ``int32[shards]``, each shard's changed
    entries (:meth:`changed_entries` gives them). Both split over the mesh
    axis like :meth:`shard_entries` (global arrays on several processes).
    O(capacity) on the devices.
    """
    if self.shards.row_stamps.shape[-1] == 0:
      return None
    return _jit_shard_changed(self, jnp.asarray(since, jnp.uint32))

  def changed_entries(self, since, width: int) -> dict:
    """Each shard's entries changed since ``since`` first, in ``[shards, width, ...]`` arrays split over
    the mesh axis, as :meth:`shard_entries` gives its entries (with their ``"slots"``); ``width``:
    at least the largest count of :meth:`shard_changes`."""
    return _jit_changed_entries(self, jnp.asarray(since, jnp.uint32), width)

  def _shard_changed(self, since):
    def one(shard):
      live, changed = shard._changed_slots(since)
      return jnp.packbits(live), jnp.sum(changed, dtype=jnp.int32)

    return self._each_shard(one)

  def _each_shard(self, fn):
    """``fn(shard)`` (a pytree of arrays) of every shard, run on the shard's own device under
    ``shard_map``: stacked ``[shards, ...]`` and split over the mesh axis, each shard's row where it
    was made. No array crosses devices or processes (a ``vmap`` over the shards, partitioned by
    XLA, gathered whole tables: 5.5x a table's bytes between two processes per save)."""
    spec = PartitionSpec(self.axis)

    def local(part):
      return jax.tree.map(lambda x: x[None], fn(self._own(part)))

    return jax.shard_map(local, mesh=self.mesh, in_specs=(spec,), out_specs=spec, check_vma=False)(self.parts)

  def _changed_entries(self, since, width: int) -> dict:
    def one(shard):
      slots = jnp.nonzero(shard._changed_slots(since)[1], size=width, fill_value=0)[0].astype(jnp.int32)
      block = {"keys": shard._slots_at(slots)[0], "values": shard._read(slots), "slots": slots}
      if self.eviction is not None:
        block["scores"] = shard._scores_at(slots)
      return block

    return self._each_shard(one)

  def place_shards(self, words, leaves, scores, slots, valid) -> ShardedTable:
    """An empty table like this one holding, in each shard, its rows of ``[shards, width, ...]`` arrays
    at their ``slots`` where ``valid`` (as :meth:`shard_entries` gave them; ``scores`` may be ``None``).

    The arrays are split over the mesh axis like :meth:`shard_entries`'s (global arrays on several
    processes); the keys' owners and slots are checked by the caller.
    """
    place = _placer(NamedSharding(self.mesh, PartitionSpec(self.axis)))
    empty = self._cleared()._advance()  # every entry newer than any version of this table before
    return empty._with_shards(place(empty.shards, words, leaves, scores, slots, valid))

  # ----------------------------------------------------------- routing

  def _routed(self, op, words, active, leaves, pick=None, flags=False, by_row=False):
    """Runs ``op(shard, words, active, leaves) -> (shard, outputs)`` where each row's key lives.

    ``by_row``: ``words`` are the table's value rows (``uint32[N, 1]``), each
    going to the shard that holds it, which gets its own row numbers instead.

    ``pick``: for each leaf, a :class:`Carry`: a key repeated on a device travels once, with
    the leaf of its first or last occurrence or the reduction over its rows,
    and all its rows take the reply to the first; ``None``: every row travels
    (a fold in batch order needs them all). ``flags``: the last output marks
    what the reply is about (an evicted entry), left on a key's first row only.
    Returns the new table and the per-row ``outputs`` in batch order.
    """
    num_shards, n, axis = self.num_shards, words.shape[0], self.axis
    per_device = -(-n // num_shards)
    pad = per_device * num_shards - n
    active = jnp.ones((n,), bool) if active is None else active
    block, later = round_rows(per_device, num_shards)

    def padded(x):
      return jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))

    def local(part, words, active, leaves):
      index = jnp.arange(per_device, dtype=jnp.int32)
      source, travels = index, jnp.ones(per_device, bool)
      if pick is not None:  # rows of one key: the first travels (inactive rows travel alone)
        source = claims.owner_per_key(words, active)
        last = claims.owner_per_key(words, active, last=True)
        travels = ~active | (source == index)
        others = jnp.where(active & (source != index), source, per_device)  # rows that fold into their first
        leaves = [travelling(x, which, last, others) for x, which in zip(leaves, pick, strict=True)]
      owner = words[:, 0].astype(jnp.int32) // self.shard_rows if by_row else owner_of(words, num_shards)
      route = Route.of(owner, travels, num_shards, axis)
      rounds = lax.pmax(jnp.max(-(-jnp.maximum(route.count - block, 0) // later)), axis)
      arrays = (words, active, *leaves)
      received = route.deliver(
        arrays, 0, block, [jnp.zeros((num_shards * per_device, *x.shape[1:]), x.dtype) for x in arrays]
      )
      received = lax.fori_loop(
        0, rounds, lambda k, acc: route.deliver(arrays, block + k * later, later, acc), received
      )
      shard = self._own(part)
      if by_row:
        received[0] = received[0] % jnp.uint32(self.shard_rows)
      shard, outputs = op(shard, received[0], received[1], received[2:])
      results = route.reply(
        outputs, 0, block, [jnp.zeros((per_device, *y.shape[1:]), y.dtype) for y in outputs]
      )
      results = lax.fori_loop(
        0, rounds, lambda k, acc: route.reply(outputs, block + k * later, later, acc), results
      )
      results = [y[source] for y in results]
      if flags:
        results[-1] = results[-1] & (source == index)
      return self._part(shard), results

    spec = PartitionSpec(self.axis)
    parts, outputs = jax.shard_map(
      # The storages' loops start from constants; every value here is per device anyway.
      local,
      mesh=self.mesh,
      in_specs=(spec, spec, spec, spec),
      out_specs=(spec, spec),
      check_vma=False,
    )(self.parts, padded(words), padded(active), [padded(x) for x in leaves])
    return dataclasses.replace(self, parts=parts), [y[:n] for y in outputs]

  def _own(self, part: Storage) -> Storage:
    """A device's part of :attr:`parts` (inside ``shard_map``) as its shard: its scalars unstacked."""
    leaves, treedef = jax.tree.flatten(part)
    own = [x[0] if rank == 0 else x for x, rank in zip(leaves, self.shard_ranks, strict=True)]
    return jax.tree.unflatten(treedef, own)

  def _part(self, shard: Storage) -> Storage:
    """The inverse of :meth:`_own`."""
    return jax.tree.map(lambda x: x[None] if x.ndim == 0 else x, shard)


def _split(rows: list, extras: list) -> tuple:
  """A shard's received leaves as ``(values, given, weights)`` (see :meth:`ShardedTable._extras`)."""
  count = len(rows) - len(extras)
  received = {pick: x for (_, pick), x in zip(extras, rows[count:])}
  return rows[:count], received.get(Carry.LAST), received.get(Carry.ADD)


def _shard_capacity(capacity: int, num_shards: int, eviction) -> int:
  """The default capacity of each shard: headroom without eviction, an exact share with it."""
  if eviction is None:
    return shard_capacity_for(capacity, num_shards)
  if capacity < num_shards:  # see ShardedTable.smallest_capacity
    raise ValueError(
      f"capacity: an evicting table over {num_shards} shards holds capacity // {num_shards} entries per "
      f"shard; expected capacity >= {num_shards}, got {capacity}."
    )
  return capacity // num_shards


def _laid_out(shard: Storage, default, mesh: Mesh, axis: str) -> Storage:
  """One empty copy of ``shard`` (its leaves ``jax.ShapeDtypeStruct``, its default ``default``) per device
  along ``axis``, as :attr:`ShardedTable.parts`: made on the devices, never whole on one."""
  leaves, treedef = jax.tree.flatten(shard)
  return _layer(treedef, tuple(leaves), NamedSharding(mesh, PartitionSpec(axis)))(default)


@functools.lru_cache(maxsize=32)  # one program a shard structure and sharding, not traced anew each table
def _layer(treedef, leaves: tuple, split: NamedSharding):
  num_shards = split.mesh.shape[split.spec[0]]

  def parts(default):
    shard = dataclasses.replace(jax.tree.unflatten(treedef, leaves), default=default)
    empty = shard._with_capacity(shard.capacity)
    return _end_to_end(jax.tree.map(lambda x: jnp.broadcast_to(x, (num_shards, *x.shape)), empty))

  return jax.jit(parts, out_shardings=split)


def _end_to_end(shards: Storage) -> Storage:
  """Stacked shards (leaves ``[num_shards, ...]``) as :attr:`ShardedTable.parts`: leaves end to end."""
  return jax.tree.map(lambda x: x if x.ndim == 1 else x.reshape(-1, *x.shape[2:]), shards)


@functools.lru_cache(maxsize=16)  # one jitted function a sharding: its programs are cached, not traced anew
def _placer(split: NamedSharding):
  return jax.jit(jax.vmap(_place_rows), out_shardings=split)


def _place_rows(shard: Storage, *rows) -> Storage:
  return shard._place_rows(*rows)


_jit_shard_entries = jax.jit(ShardedTable._shard_entries, static_argnums=1)
_jit_shard_changed = jax.jit(ShardedTable._shard_changed)
_jit_changed_entries = jax.jit(ShardedTable._changed_entries, static_argnums=2)
