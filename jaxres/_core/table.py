"""``Table``: the public API every jaxres hash table shares, its arguments checked on the host.

Public methods check and encode their arguments on the host (:mod:`call_args`),
then call the operation's one jitted function of :mod:`row_protocol`, which
runs the table's row operations on flat batches of encoded rows. A table's
entries go in and out through :meth:`Table.live_entries`, :meth:`Table.placed`,
:meth:`Table.import_words` and :meth:`Table.with_counters` (a checkpoint uses
those: see :mod:`jaxres._persistence`).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxres._core import call_args, display, folds, memory, row_protocol
from jaxres._core.encoding import key_specs
from jaxres._core.encoding.value_specs import ValueSpec
from jaxres._core.kernels.row_ops import select_rows
from jaxres._core.modes import Upsert
from jaxres._core.policies import Evicted, Policy
from jaxres._core.row_protocol import RowProtocol
from jaxres._errors import check_int

_MAX_CAPACITY = 2**30


def check_capacity(capacity, name: str = "capacity") -> int:
  """A static capacity: an int in ``[1, 2**30]`` (``TypeError``/``ValueError`` naming ``name``)."""
  return check_int(capacity, name, low=1, high=_MAX_CAPACITY)


class LiveEntries(NamedTuple):
  """A table's live entries on the host (:meth:`Table.live_entries`), ``n`` of them."""

  keys: np.ndarray  # [n, *key_shape], the exact key dtype
  leaves: list[np.ndarray]  # each value leaf, [n, *leaf_shape]
  scores: np.ndarray | None  # uint32[n], where the table keeps scores
  slots: np.ndarray | None  # int[n], where the storage keeps a slot layout


class Changes(NamedTuple):
  """What changed in a table since a clock (:meth:`Table.changes`), on the host.

  ``entries``: the live entries whose key, value or score changed (with their
  slots); ``live``: ``bool[num_slots]``, which slots hold an entry now (so an
  entry removed or evicted since is one whose slot is no longer live, or holds
  another key).
  """

  entries: LiveEntries
  live: np.ndarray


class RowHandles(NamedTuple):
  """What :meth:`Table.find_or_insert_rows` did for each key: its value row and how it got it.

  Attributes:
    index: ``int32[*batch]``, the row of the key's value, for :meth:`Table.read_rows`
      and :meth:`Table.write_rows`; ``-1`` where the key has no row (refused,
      dropped, or masked out by ``valid``).
    found: ``bool[*batch]``: the key was present before the call.
    inserted: ``bool[*batch]``: the key got its row in this call (every row of
      the key in the batch); the row holds no value of it yet.
    evicted: :class:`Evicted`, as for :meth:`Table.find_or_insert_and_evict`.

  Examples:
    >>> import jax.numpy as jnp, jaxres as jr
    >>> t = jr.OpenAddressingTable.create(8, key=jnp.int32, value=jnp.float32)
    >>> t, handles = t.find_or_insert_rows(jnp.array([5, 5, 6]))
    >>> handles.inserted.tolist(), bool(handles.index[0] == handles.index[1])
    ([True, True, True], True)
  """

  index: jax.Array
  found: jax.Array
  inserted: jax.Array
  evicted: Evicted


class Table(RowProtocol):
  """Common protocol of jaxres hash tables: immutable pytrees, pure methods.

  Both storages (:class:`OpenAddressingTable`, :class:`SortedTable`) provide
  every method below with identical results. A batched call behaves as if its
  keys were processed one at a time in row-major order: ``insert`` lets the
  last duplicate win, ``find_or_insert`` lets the first one insert and
  ``insert_or_apply`` folds duplicates in order.

  Keys are ``int32``/``uint32``/``int64``/``uint64`` scalars or fixed-shape
  vectors of them, with any leading batch shape. Every value of the dtype is a
  valid key. With ``jax_enable_x64`` off, 64-bit keys are given as NumPy arrays
  on the host, or as ``uint32[..., 2]`` word pairs (see :mod:`jaxres.keys`).

  A table created with an eviction policy (``eviction=jr.LRU()``, ...) keeps a
  score per entry and evicts when full instead of refusing new keys (see
  :class:`jaxres.LRU` and the other policies).

  **Cost.** Every method that takes a batch of keys costs O(batch) under
  ``jit`` when the caller donates the table (``jax.jit(step,
  donate_argnums=...)``). Called eagerly, a method that returns a new table
  copies the table's arrays, unless it is given ``donate=True``: the result
  then reuses this table's buffers, and this table may no longer be used
  (its arrays are deleted). The stateful tables donate the state they own.

  Examples:
    >>> import jax, jax.numpy as jnp, jaxres as jr
    >>> t = jr.SortedTable.create(8, key=jnp.int32, value=jnp.float32, default=-1.0)
    >>> isinstance(t, jr.Table)
    True
    >>> jax.jit(lambda t, k: t.insert(k, k * 1.0).find(k))(t, jnp.array([2, 9])).tolist()
    [2.0, 9.0]
  """

  # Fields every storage declares (see the storage modules).
  values: tuple
  default: tuple
  size: jax.Array  # shape=(), dtype=int32: live entries
  dropped: jax.Array  # shape=(), dtype=int32: keys an insert could not place
  clock: jax.Array  # shape=(), dtype=uint32: mutating calls so far (LRU time)
  evictions: jax.Array  # shape=(), dtype=int32: entries evicted or refused so far
  capacity: int
  key_spec: key_specs.KeySpec
  value_spec: ValueSpec
  eviction: Policy | None

  @classmethod
  def _specs(cls, key, value, default):
    key_spec = key_specs.KeySpec.parse(key)
    value_spec = ValueSpec.parse(value)
    default_leaves = tuple(
      x if isinstance(x, jax.Array) else jax.device_put(np.asarray(x))
      for x in value_spec.to_storage(value_spec.spread(default), (), "default", broadcast=True)
    )
    return key_spec, value_spec, default_leaves

  @property
  @abc.abstractmethod
  def num_slots(self) -> int:
    """Slots the table's arrays have (``export_batch`` streams them): at least ``capacity``."""

  @property
  def num_rows(self) -> int:
    """Value rows the table's arrays have: row handles (:meth:`find_rows`) lie in ``[0, num_rows)``."""
    return self.values[0].shape[0]

  # ------------------------------------------------------------- queries

  def lookup(self, keys) -> tuple[Any, jax.Array]:
    """Finds keys, returning ``(values, found)`` from a single probe.

    Args:
      keys: ``key_dtype[*batch, *key_shape]`` (or word pairs, see class doc).

    Returns:
      ``values``: the value pytree with leaves ``[*batch, *value_shape]``
      (the table's default where missing), and ``found``: ``bool[*batch]``.

    Examples:
      >>> import jax.numpy as jnp, jaxres as jr
      >>> t = jr.OpenAddressingTable.create(8, key=jnp.int32, value=jnp.float32, default=-1.0)
      >>> t = t.insert(jnp.array([3, 5]), jnp.array([0.5, 1.5]))
      >>> values, found = t.lookup(jnp.array([5, 7]))
      >>> values.tolist(), found.tolist()
      ([1.5, -1.0], [True, False])
    """
    return self._lookup(keys, None)

  def find(self, keys, default=None):
    """Values of ``keys``; missing keys get ``default``.

    Args:
      keys: ``key_dtype[*batch, *key_shape]``.
      default: ``None`` for the table's default, or a per-call pytree that
        broadcasts to ``[*batch, *value_shape]`` (a "dynamic default").

    Examples:
      >>> import jax.numpy as jnp, jaxres as jr
      >>> t = jr.SortedTable.create(8, key=jnp.int32, value=jnp.float32, default=-1.0)
      >>> t = t.insert(jnp.array([3]), jnp.array([0.5]))
      >>> t.find(jnp.array([3, 4])).tolist(), t.find(jnp.array([4]), default=9.0).tolist()
      ([0.5, -1.0], [9.0])
    """
    return self._lookup(keys, default)[0]

  def contains(self, keys) -> jax.Array:
    """``bool[*batch]``: whether each key is present."""
    rows = call_args.prepare(self, keys)
    if not rows.n:
      return jnp.zeros(rows.batch, bool)
    return call_args.unpadded(row_protocol.contains(self, rows.words), rows.batch)

  def scores(self, keys) -> jax.Array:
    """``uint32[*batch]``: the score of each key (0 where missing, and in a table without eviction)."""
    rows = call_args.prepare(self, keys)
    if not rows.n:
      return jnp.zeros(rows.batch, jnp.uint32)
    return call_args.unpadded(row_protocol.scores(self, rows.words), rows.batch)

  def _lookup(self, keys, default):
    rows = call_args.prepare(self, keys)
    batch = rows.batch
    flat = call_args.default_rows(self, default, batch)
    shapes = [leaf.storage_shape for leaf in self.value_spec.leaves]
    if not rows.n:
      empty = [jnp.broadcast_to(x, (0, *shape)) for x, shape in zip(flat, shapes, strict=True)]
      return call_args.output(self, empty, batch), jnp.zeros(batch, bool)
    flat = [call_args.pad_rows(x, rows, len(shape)) for x, shape in zip(flat, shapes, strict=True)]
    leaves, found = row_protocol.lookup(self, rows.words, flat)
    return call_args.output(self, leaves, batch), call_args.unpadded(found, batch)

  # ----------------------------------------------------------- mutations

  def insert(self, keys, values, valid=None, scores=None, *, donate: bool = False) -> Table:
    """Inserts or assigns; the last duplicate in the batch wins.

    New keys that do not fit (``size == capacity``) are counted in
    :attr:`dropped` instead, in batch order, exactly as a one-at-a-time loop;
    with an eviction policy they evict (see :meth:`insert_and_evict`).

    Args:
      keys: ``key_dtype[*batch, *key_shape]``.
      values: value pytree with leaves ``[*batch, *value_shape]`` (a scalar
        leaf broadcasts).
      valid: optional ``bool[*batch]``; rows marked ``False`` are skipped
        (padding in a fixed-shape batch).
      scores: ``uint32[*batch]``, the keys' scores: required with
        ``eviction=jr.CustomScore()``, refused otherwise.

    Returns:
      The new table.
    """
    return self._upsert(keys, values, valid, scores, Upsert.INSERT, report=False, donate=donate)[0]

  def insert_and_evict(
    self, keys, values, valid=None, scores=None, *, donate: bool = False
  ) -> tuple[Table, Evicted]:
    """:meth:`insert`, also returning the entries that left: ``(table, evicted)``.

    ``evicted`` (:class:`Evicted`) has one row per key row: the entry the row's
    new key replaced, or the key itself when it was refused (its score was not
    above any candidate's). With an eviction policy, every key that was in the
    table or offered to it is afterwards in the table or in ``evicted``.

    Examples:
      >>> import jax.numpy as jnp, jaxres as jr
      >>> t = jr.OpenAddressingTable.create(2, key=jnp.int32, value=jnp.float32, eviction=jr.LFU())
      >>> t = t.insert(jnp.array([1, 1, 2]), jnp.array([1.0, 1.0, 2.0]))   # 1 seen twice, 2 once
      >>> t, evicted = t.insert_and_evict(jnp.array([3, 3]), jnp.array([3.0, 3.0]))
      >>> evicted.keys.tolist(), evicted.valid.tolist(), t.find(jnp.array([1, 2, 3])).tolist()
      ([2, 0], [True, False], [1.0, 0.0, 3.0])
    """
    table, _, evicted, rows = self._upsert(
      keys, values, valid, scores, Upsert.INSERT, report=True, donate=donate
    )
    return table, call_args.evicted(table, evicted, rows)

  def find_or_insert(
    self, keys, values, valid=None, scores=None, *, donate: bool = False
  ) -> tuple[Table, Any]:
    """Returns existing values and inserts the missing keys with ``values``.

    The first occurrence of a new key inserts it; later duplicates see that
    value. A new key that does not fit gets the table default and is counted
    in :attr:`dropped` (with an eviction policy, it evicts or is refused).

    Args:
      keys: ``key_dtype[*batch, *key_shape]``.
      values: value pytree with leaves ``[*batch, *value_shape]``.
      valid: optional ``bool[*batch]``; rows marked ``False`` are skipped
        and get the table default (padding in a fixed-shape batch).
      scores: as for :meth:`insert`.

    Returns:
      ``(table, values)`` where ``values`` has leaves ``[*batch, *value_shape]``.

    Examples:
      >>> import jax.numpy as jnp, jaxres as jr
      >>> t = jr.OpenAddressingTable.create(8, key=jnp.int32, value=jnp.int32, default=-1)
      >>> t, rows = t.find_or_insert(jnp.array([7, 9, 7]), jnp.array([0, 1, 2]))
      >>> rows.tolist()
      [0, 1, 0]
    """
    table, found, _, _ = self._upsert(
      keys, values, valid, scores, Upsert.FIND_OR_INSERT, report=False, donate=donate
    )
    return table, found

  def find_or_insert_and_evict(
    self, keys, values, valid=None, scores=None, *, donate: bool = False
  ) -> tuple[Table, Any, Evicted]:
    """:meth:`find_or_insert`, also returning the entries that left: ``(table, values, evicted)``.

    ``evicted`` is as for :meth:`insert_and_evict`; a refused key reads the
    table default.
    """
    table, found, evicted, rows = self._upsert(
      keys, values, valid, scores, Upsert.FIND_OR_INSERT, report=True, donate=donate
    )
    return table, found, call_args.evicted(table, evicted, rows)

  def _upsert(self, keys, values, valid, scores, mode: Upsert, report: bool, donate: bool = False):
    """insert or find_or_insert: ``(table, found values, evicted rows or None, rows)``."""
    rows = call_args.prepare(self, keys, values, valid, scores)
    if not rows.n:
      return self, call_args.output(self, [x[:0] for x in rows.leaves], rows.batch), None, rows
    table, out, evicted = row_protocol.upsert(
      self, rows.words, rows.leaves, rows.active, rows.given_scores, mode=mode, report=report, donate=donate
    )
    if not mode.keeps_present:
      return table, None, evicted, rows
    if valid is not None:
      out = select_rows(rows.active, out, list(table.default))
    return table, call_args.output(table, out, rows.batch), evicted, rows

  # -------------------------------------------------------- row handles

  def find_rows(self, keys) -> jax.Array:
    """``int32[*batch]``: the row holding each key's value (``-1`` where missing), from one probe.

    Rows stay valid until the next call that inserts or removes keys; read and
    write them with :meth:`read_rows` and :meth:`write_rows`.
    """
    rows = call_args.prepare(self, keys)
    if not rows.n:
      return jnp.zeros(rows.batch, jnp.int32)
    return call_args.unpadded(row_protocol.find_rows(self, rows.words), rows.batch)

  def find_or_insert_rows(
    self, keys, valid=None, scores=None, *, donate: bool = False
  ) -> tuple[Table, RowHandles]:
    """Gives each new key a row, without a value yet: ``(table, handles)``, one probe per key.

    The handle-based form of :meth:`find_or_insert_and_evict`, for callers that
    make a new key's value from its row (an embedding initialises it, then
    reads it and later writes an update): present keys keep their rows, new
    keys get rows as :meth:`find_or_insert` would place them (evicting or
    refused when full, counted in :attr:`dropped` without a policy), and
    nothing is written to the rows. Write the values of ``handles.inserted``
    keys with :meth:`write_rows` before reading them. Rows stay valid until
    the next call that inserts or removes keys.

    Args:
      keys: ``key_dtype[*batch, *key_shape]``.
      valid: optional ``bool[*batch]``; rows marked ``False`` are skipped.
      scores: as for :meth:`insert`.

    Returns:
      ``(table, handles)``, :class:`RowHandles` with fields of shape ``[*batch]``.

    Examples:
      >>> import jax.numpy as jnp, jaxres as jr
      >>> t = jr.OpenAddressingTable.create(8, key=jnp.int32, value=jnp.float32)
      >>> t = t.insert(jnp.array([5]), jnp.array([0.5]))
      >>> t, handles = t.find_or_insert_rows(jnp.array([5, 9, 9]))
      >>> handles.found.tolist(), handles.inserted.tolist()
      ([True, False, False], [False, True, True])
      >>> t = t.write_rows(handles.index, jnp.array([0.0, 9.0, 9.0]), valid=handles.inserted)
      >>> t.read_rows(handles.index).tolist(), t.find(jnp.array([5, 9])).tolist()
      ([0.5, 9.0, 9.0], [0.5, 9.0])
    """
    rows = call_args.prepare(self, keys, valid=valid, scores=scores, inserts=True)
    n, batch = rows.n, rows.batch
    if not n:
      empty = call_args.evicted(self, None, rows)
      nothing = jnp.zeros(batch, bool)
      return self, RowHandles(jnp.zeros(batch, jnp.int32), nothing, nothing, empty)
    table, index, found, inserted, evicted = row_protocol.claim(
      self, rows.words, rows.active, rows.given_scores, report=True, donate=donate
    )
    handles = RowHandles(
      call_args.unpadded(index, batch),
      call_args.unpadded(found, batch),
      call_args.unpadded(inserted, batch),
      call_args.evicted(table, evicted, rows),
    )
    return table, handles

  def read_rows(self, index, default=None):
    """The values in rows ``index`` (``int32[*batch]``); ``-1`` reads ``default`` (the table's when ``None``).

    Rows come from :meth:`find_rows` or :meth:`find_or_insert_rows`.
    """
    index, batch, n = call_args.row_index(index)
    flat = [d.reshape((n, *d.shape[len(batch) :])) for d in call_args.defaults(self, default, batch)]
    if not n:
      return call_args.output(self, flat, batch)
    rows = call_args.Rows(index[:, None], [], None, None, n, batch)
    leaves = row_protocol.read_rows(self, index, [call_args.pad_to(x, rows) for x in flat])
    return call_args.output(self, leaves, batch)

  def write_rows(self, index, values, valid=None, *, donate: bool = False) -> Table:
    """Writes ``values`` into rows ``index``; the last duplicate wins, ``-1`` and masked rows are skipped.

    Nothing about the keys changes (no insert, no score, no clock tick): the
    write-back of a read-modify-write on rows from :meth:`find_rows` or
    :meth:`find_or_insert_rows`.

    Args:
      index: ``int32[*batch]`` rows.
      values: value pytree with leaves ``[*batch, *value_shape]``.
      valid: optional ``bool[*batch]``.
    """
    index, batch, n = call_args.row_index(index)
    leaves = call_args.value_leaves(self, values, batch)
    active = call_args.check_valid(valid, batch)
    if not n:
      return self
    rows = call_args.Rows(index[:, None], [], None, None, n, batch)
    active = index >= 0 if active is None else call_args.pad_to(active, rows) & (index >= 0)
    return row_protocol.write_rows(
      self, index, [call_args.pad_to(x, rows) for x in leaves], active, donate=donate
    )

  def insert_or_apply(
    self, keys, values, fn: Callable, valid=None, scores=None, *, donate: bool = False
  ) -> Table:
    """New keys get ``values``; existing ones become ``fn(old, new)``.

    Duplicates within the batch fold in order: a key ``k`` present with value
    ``a`` and given ``b`` then ``c`` ends as ``fn(fn(a, b), c)``.

    ``jnp.add``, ``jnp.subtract``, ``jnp.multiply``, ``jnp.maximum``,
    ``jnp.minimum``, ``jnp.bitwise_and``, ``jnp.bitwise_or`` and
    ``jnp.bitwise_xor`` (or the same ``jax.lax`` and ``operator`` functions)
    apply leaf by leaf and are exact on 64-bit integer leaves with
    ``jax_enable_x64`` on or off: with it off such a leaf is held as uint32
    word pairs, on which they compute as on ``int64``/``uint64`` (add with
    carry, subtract with borrow, signed comparison for ``int64``), wrapping
    around as NumPy does. Any other ``fn`` gets a 64-bit integer leaf with
    x64 off as its ``uint32[..., 2]`` ``(high, low)`` word pairs and computes
    on the words.

    Args:
      keys: ``key_dtype[*batch, *key_shape]``.
      values: value pytree with leaves ``[*batch, *value_shape]``.
      fn: ``fn(old, new) -> value``, both one entry's value pytree (it is
        vectorised with ``jax.vmap``), e.g. ``jnp.add``. Pass the same
        function object each call to avoid recompiling.
      valid: optional ``bool[*batch]``; rows marked ``False`` are skipped
        (padding in a fixed-shape batch).
      scores: as for :meth:`insert`.

    Examples:
      >>> import jax.numpy as jnp, numpy as np, jaxres as jr
      >>> t = jr.OpenAddressingTable.create(8, key=jnp.int32, value=jnp.float32)
      >>> t = t.insert_or_apply(jnp.array([1, 1, 2]), jnp.array([1.0, 2.0, 5.0]), jnp.add)
      >>> t.find(jnp.array([1, 2])).tolist()
      [3.0, 5.0]

      Counting in ``int64``, exact past ``2**32`` with x64 off:

      >>> counts = jr.OpenAddressingTable.create(8, key=np.int64, value=np.int64)
      >>> counts = counts.insert_or_apply(np.array([7, 7, 9]), np.array([2**32 - 1, 2, -5]), jnp.add)
      >>> np.asarray(counts.find(np.array([7, 9]))).tolist()
      [4294967297, -5]
    """
    fn = call_args.static_fn(folds.fold(fn, self.value_spec), "fn(old, new)")
    rows = call_args.prepare(self, keys, values, valid, scores)
    if not rows.n:
      return self
    self._check_fn(fn)
    return row_protocol.apply(
      self, rows.words, rows.leaves, rows.active, rows.given_scores, fn=fn, donate=donate
    )

  def _check_fn(self, fn):
    entry = [jax.ShapeDtypeStruct(s.storage_shape, s.storage_dtype) for s in self.value_spec.leaves]
    tree = jax.tree.unflatten(self.value_spec.treedef, entry)
    try:
      out = jax.eval_shape(fn, tree, tree)
    except Exception as err:
      raise TypeError(f"fn: calling fn(old, new) on entries {tree} failed: {err}") from err
    got = [(tuple(x.shape), x.dtype) for x in jax.tree.leaves(out)]
    want = [(tuple(x.shape), x.dtype) for x in entry]
    if jax.tree.structure(out) != self.value_spec.treedef or got != want:
      raise TypeError(f"fn: must return an entry like {tree}, got {out}.")

  def assign(self, keys, values, valid=None, *, donate: bool = False) -> Table:
    """Replaces the values of keys present; absent keys are ignored. Scores and clock stay.

    The write-back half of a read-modify-write (an optimizer step on the
    rows a batch looked up): it never inserts, evicts or counts as a use of
    a key. The last duplicate in the batch wins.

    Args:
      keys: ``key_dtype[*batch, *key_shape]``.
      values: value pytree with leaves ``[*batch, *value_shape]``.
      valid: optional ``bool[*batch]``; rows marked ``False`` are skipped.

    Examples:
      >>> import jax.numpy as jnp, jaxres as jr
      >>> t = jr.OpenAddressingTable.create(8, key=jnp.int32, value=jnp.float32)
      >>> t = t.insert(jnp.array([1]), jnp.array([1.0])).assign(jnp.array([1, 2]), jnp.array([5.0, 6.0]))
      >>> t.find(jnp.array([1, 2])).tolist(), int(t.size)
      ([5.0, 0.0], 1)
    """
    rows = call_args.prepare(self, keys, values, valid, inserts=False)  # no scores: assign inserts nothing
    if not rows.n:
      return self
    return row_protocol.assign(self, rows.words, rows.leaves, rows.active, donate=donate)

  def assign_scores(self, keys, scores=None, valid=None, *, donate: bool = False) -> Table:
    """Updates the scores of present keys only (HierarchicalKV's ``assign_scores``): values stay.

    Each present key gets the score an insert naming it would give: ``LRU()``
    the clock, ``LFU()`` its score plus its occurrences in the batch,
    ``CustomScore()`` the last of its ``scores``. Missing keys are ignored
    (never inserted). Advances the :attr:`clock` once, as any mutating call.

    Args:
      keys: ``key_dtype[*batch, *key_shape]``.
      scores: ``uint32[*batch]``: required with ``eviction=jr.CustomScore()``,
        refused otherwise.
      valid: optional ``bool[*batch]``; rows marked ``False`` are skipped.

    Returns:
      The new table.

    Raises:
      ValueError: the table keeps no scores (created without ``eviction``).

    Examples:
      >>> import jax.numpy as jnp, jaxres as jr
      >>> t = jr.OpenAddressingTable.create(8, key=jnp.int32, value=jnp.float32, eviction=jr.LRU())
      >>> t = t.insert(jnp.array([1, 2]), jnp.array([1.0, 2.0]))  # clock 1
      >>> t = t.assign_scores(jnp.array([2, 5]))  # clock 2: key 2 touched, key 5 not inserted
      >>> t.scores(jnp.array([1, 2, 5])).tolist(), t.find(jnp.array([2])).tolist()
      ([1, 2, 0], [2.0])
    """
    if self.eviction is None:
      raise ValueError(
        "assign_scores: the table keeps no scores; create it with eviction=jr.LRU(), jr.LFU() or "
        "jr.CustomScore()."
      )
    rows = call_args.prepare(self, keys, valid=valid, scores=scores, inserts=True)
    if not rows.n:
      return self
    return row_protocol.rescore(self, rows.words, rows.active, rows.given_scores, donate=donate)

  def remove(self, keys, valid=None, *, donate: bool = False) -> Table:
    """Removes keys; absent keys are ignored.

    Args:
      keys: ``key_dtype[*batch, *key_shape]``.
      valid: optional ``bool[*batch]``; rows marked ``False`` are skipped
        (padding in a fixed-shape batch).
    """
    rows = call_args.prepare(self, keys, valid=valid)
    if not rows.n:
      return self
    return row_protocol.remove(self, rows.words, rows.active, donate=donate)

  def erase_if(self, fn: Callable) -> Table:
    """Removes every entry for which ``fn(keys, values, scores)`` is True: expiry, O(capacity).

    ``fn`` gets every slot at once: keys ``[num_slots, *key_shape]`` (64-bit
    keys as word pairs with x64 off), the value pytree and ``uint32`` scores
    ``[num_slots]`` (0 without eviction); it returns ``bool[num_slots]`` (slots
    holding no entry are ignored). Pass the same function object each call to
    avoid recompiling.

    Examples:
      >>> import jax.numpy as jnp, jaxres as jr
      >>> t = jr.OpenAddressingTable.create(8, key=jnp.int32, value=jnp.float32, eviction=jr.LRU())
      >>> for key in range(3):  # key k is inserted at clock k + 1
      ...   t = t.insert(jnp.array([key]), jnp.array([1.0]))
      >>> ttl = 1  # calls an entry may go unnamed
      >>> t = t.erase_if(lambda keys, values, scores: scores + ttl < t.clock)
      >>> t.contains(jnp.array([0, 1, 2])).tolist()
      [False, True, True]
    """
    return row_protocol.erase(self, fn=call_args.static_fn(fn, "fn(keys, values, scores)"))

  # ------------------------------------------------------ whole contents

  def export(self):
    """All entries as fixed-shape arrays ``(keys, values, valid)``.

    Returns ``capacity`` rows with the live entries first (``valid`` marks
    them); jittable. ``SortedTable`` exports in key order. 64-bit keys come
    back as NumPy arrays when x64 is off and the call is eager, and as word
    pairs under ``jit``.
    """
    words, leaves, valid = row_protocol.exported(self)
    return self.key_spec.decode(words), self.value_spec.from_storage(leaves), valid

  def export_batch(self, offset, size: int):
    """Slots ``[offset, offset + size)`` as ``(keys, values, scores, valid)``: any table, in chunks.

    ``valid`` marks the slots holding an entry (slots past :attr:`num_slots`
    hold none), so ``range(0, t.num_slots, size)`` streams every entry exactly
    once. ``size`` is static; ``offset`` may be traced.

    Examples:
      >>> import jax.numpy as jnp, jaxres as jr
      >>> t = jr.OpenAddressingTable.create(4, key=jnp.int32, value=jnp.float32)
      >>> t = t.insert(jnp.arange(4), jnp.arange(4.0))
      >>> chunks = [t.export_batch(offset, 4) for offset in range(0, t.num_slots, 4)]
      >>> sorted(int(k) for keys, _, _, valid in chunks for k in keys[valid])
      [0, 1, 2, 3]
    """
    size = check_int(size, "size", low=1)
    if not key_specs.is_traced(offset):
      offset = check_int(offset, "offset")
    words, leaves, scores, valid = row_protocol.slots(self, jnp.asarray(offset, jnp.int32), size=size)
    words = jnp.where(valid[:, None], words, self.key_spec.encode_zero())
    return self.key_spec.decode(words), self.value_spec.from_storage(leaves), scores, valid

  def export_if(self, fn: Callable, offset, size: int):
    """The entries of slots ``[offset, offset + size)`` for which ``fn(keys, values, scores)`` is True.

    HierarchicalKV's ``export_batch_if``: deltas, reports and audits over any
    table, chunk by chunk, each chunk O(``size``) and jittable. Returns
    ``(keys, values, scores, valid)`` of ``size`` rows, the matching entries
    first (in slot order): ``valid`` marks them, so ``keys[:valid.sum()]`` are
    the keys found. ``fn`` gets the chunk's keys ``[size, *key_shape]`` (64-bit
    keys as word pairs with x64 off), the value pytree and ``uint32`` scores
    (0 without eviction), as ``erase_if``'s does, and returns ``bool[size]``
    (slots holding no entry are never matched). ``size`` is static;
    ``offset`` may be traced. Pass the same function object each call to
    avoid recompiling.

    Args:
      fn: the predicate ``fn(keys, values, scores) -> bool[size]``.
      offset: the first slot of the chunk (an int, or traced under ``jit``).
      size: the number of slots of the chunk (a static int >= 1).

    Returns:
      ``(keys, values, scores, valid)`` as :meth:`export_batch` gives them,
      the matches first.

    Raises:
      TypeError: ``fn`` is not callable or does not return ``bool[size]``;
        ``size`` or an eager ``offset`` is not an int.
      ValueError: ``size`` below 1.

    Examples:
      >>> import jax.numpy as jnp, jaxres as jr
      >>> t = jr.OpenAddressingTable.create(64, key=jnp.int32, value=jnp.float32)
      >>> t = t.insert(jnp.arange(10), jnp.arange(10.0))
      >>> large = lambda keys, values, scores: values >= 7.0
      >>> found = [t.export_if(large, offset, 32) for offset in range(0, t.num_slots, 32)]
      >>> sorted(int(k) for keys, _, _, valid in found for k in keys[:int(valid.sum())])
      [7, 8, 9]
    """
    fn = call_args.static_fn(fn, "fn(keys, values, scores)")
    size = check_int(size, "size", low=1)
    if not key_specs.is_traced(offset):
      offset = check_int(offset, "offset")
    words, leaves, scores, valid = row_protocol.slots_if(
      self, jnp.asarray(offset, jnp.int32), size=size, fn=fn
    )
    words = jnp.where(valid[:, None], words, self.key_spec.encode_zero())
    return self.key_spec.decode(words), self.value_spec.from_storage(leaves), scores, valid

  def import_(self, keys, values, valid=None, scores=None) -> Table:
    """A table of the same capacity holding exactly the given entries.

    Args:
      keys: ``key_dtype[n, *key_shape]``.
      values: value pytree with leaves ``[n, *value_shape]``.
      valid: optional ``bool[n]``; rows marked ``False`` are ignored.
      scores: with an eviction policy, the entries' scores (``uint32[n]``);
        by default they are scored as an insert would score them.

    Entries beyond the capacity are counted in :attr:`dropped` (with an
    eviction policy, the lowest-scored are evicted), which otherwise restarts
    at zero.
    """
    rows = call_args.prepare(self, keys, values, valid, scores, explicit_scores=True)
    if not rows.n:
      return self._cleared()
    return self.import_words(rows.words, rows.leaves, rows.active, rows.given_scores)

  def resize(self, capacity: int) -> Table:
    """The same contents (and scores) in a table of another ``capacity`` (static).

    Raises:
      ValueError: eagerly, when ``capacity`` is below the current size (under
        ``jit`` the entries that do not fit are counted in ``dropped``, or
        evicted).
    """
    capacity = check_capacity(capacity)
    if not key_specs.is_traced(self.size) and int(self.size) > capacity:
      raise ValueError(f"capacity: {capacity} is below the table's size {int(self.size)}.")
    words, leaves, scores, valid = row_protocol.compact(self)
    target = self._with_capacity(capacity)._carry(self)._advance()  # every entry newer than before
    given_scores = scores if self.eviction is not None else None
    return row_protocol.upsert(target, words, leaves, valid, given_scores, mode=Upsert.INSERT, tick=False)[0]

  # ------------------------------------------------ memory

  def memory(self) -> dict[str, int]:
    """Bytes the table's arrays hold: ``{"values": ..., "index": ...}``, summing to all of them.

    ``values``: the value rows and the default (by leaf: :meth:`value_memory`);
    ``index``: the rest (keys and the slots that find them, scores, change
    stamps, free rows, counters). A table's bytes do not change with its
    size: its arrays are sized by its capacity.

    Examples:
      >>> import jax, jax.numpy as jnp, jaxres as jr
      >>> t = jr.SortedTable.create(1000, key=jnp.int32, value=jax.ShapeDtypeStruct((4,), jnp.float32))
      >>> t.memory()
      {'values': 16016, 'index': 5024}
    """
    values = sum(jax.tree.leaves(self.value_memory()))
    return {"values": values, "index": memory.nbytes(self) - values}

  def value_memory(self):
    """The bytes of each value leaf (its rows and default), as the value pytree of ``int``\\ s."""
    leaves = [memory.nbytes(arrays) for arrays in self._value_arrays()]
    return jax.tree.unflatten(self.value_spec.treedef, leaves)

  def _value_arrays(self) -> list:
    """Per value leaf, the arrays that hold it (its rows and its default)."""
    return [(rows, default) for rows, default in zip(self.values, self.default)]

  # ------------------------------------------------ entries in and out

  def live_entries(self) -> LiveEntries:
    """The live entries on the host, in their exact dtypes (keys and values, with scores and slots).

    ``scores`` where the table has an eviction policy; ``slots`` (where each
    entry sits) where the storage places entries by slot (:attr:`slot_layout`
    is not ``None``): :meth:`placed` puts them back exactly there. O(capacity).

    Examples:
      >>> import numpy as np, jaxres as jr
      >>> t = jr.SortedTable.create(8, key=np.int32, value=np.float32, default=0.0)
      >>> t.insert(np.array([3, 1], np.int32), np.ones(2, np.float32)).live_entries().keys
      array([1, 3], dtype=int32)
    """
    words, leaves, scores, valid = jax.device_get(row_protocol.compact(self))
    live = np.asarray(valid)
    keys = self.key_spec.decode_host(np.asarray(words)[live])  # on the host: no program per count
    values = self.value_spec.from_storage([np.asarray(x)[live] for x in leaves])
    return LiveEntries(
      np.asarray(keys),
      [np.asarray(x) for x in jax.tree.leaves(values)],
      np.asarray(scores)[live] if self.eviction is not None else None,
      self._live_slots(),
    )

  def changes(self, since) -> Changes | None:
    """The entries changed since the table's ``version`` read ``since``, and which slots are live.

    Every call that changes a table advances its ``version`` (a uint32 count
    of such calls, ``assign`` and ``write_rows`` included, where the
    :attr:`clock` counts the calls that score) and stamps each entry it
    changes (places its key, writes its value or sets its score) with it,
    O(batch); this reads the stamps and the live slots (O(capacity) bits) and
    fetches the changed entries only: a delta. ``None`` for a storage whose
    entries move (a sorted table): save it whole.

    Args:
      since: a ``version`` noted earlier (an int, or a uint32 scalar).

    Returns:
      A :class:`Changes`, or ``None``.

    Examples:
      >>> import jax.numpy as jnp, jaxres as jr
      >>> t = jr.OpenAddressingTable.create(8, key=jnp.int32, value=jnp.float32)
      >>> t = t.insert(jnp.array([1]), jnp.array([1.0]))
      >>> t = t.insert(jnp.array([2]), jnp.array([2.0]))
      >>> mark = int(t.version)
      >>> t = t.insert(jnp.array([3]), jnp.array([3.0])).remove(jnp.array([1]))
      >>> changed = t.changes(mark)  # 3 inserted; 1 removed: its slot is no longer live
      >>> changed.entries.keys.tolist(), int(changed.live.sum())
      ([3], 2)
    """
    del since
    return None

  @property
  def slot_layout(self) -> np.ndarray | None:
    """The shape the slots of :meth:`live_entries` refer to: ``[shards, buckets, slots per bucket]``.

    ``None``: the entries alone fix where they sit (a sorted table).
    """
    return None

  @property
  def slot_kind(self) -> str | None:
    """The storage kind whose placement the slots of :attr:`slot_layout` follow (its name in
    ``jr.MutableHashTable(storage=...)``), or ``None`` without a layout.

    Saved entries go back to their slots (:meth:`placed`) only in a table of the same kind and
    layout: another kind's lookups search elsewhere, even where the two layouts' numbers agree.
    """
    return None

  def placed(self, keys, values, scores, slots) -> Table:
    """An empty table like this one holding the entries at ``slots``, as :meth:`live_entries` gave them.

    A table of the same :attr:`slot_layout` then sits exactly as the one the
    entries came from (so it evicts exactly as that one would). ``scores``:
    ``uint32[n]`` or ``None``.

    Raises:
      ValueError: slots out of range, repeated, or not where the keys may sit.
    """
    del slots
    return self.import_(keys, values, scores=scores)

  def import_words(self, words, leaves, valid, scores=None) -> Table:
    """:meth:`import_` of encoded rows: key ``words`` (``uint32[n, words]``, as
    ``key_spec.encode`` gives them), the stored value ``leaves``, ``valid`` and
    ``scores`` (``uint32[n]`` or ``None``); jax arrays, placed as they are (a
    sharded table's rows may be spread over several processes)."""
    return row_protocol.upsert(self._cleared(), words, leaves, valid, scores, mode=Upsert.INSERT)[0]

  @abc.abstractmethod
  def with_counters(self, clock, evictions) -> Table:
    """This table with the given ``clock`` and ``evictions`` counts (as a restored table resumes them)."""

  def _live_slots(self) -> np.ndarray | None:
    """The slots of the live entries (in :meth:`live_entries` order), where :attr:`slot_layout` is kept."""
    return None

  def __repr__(self) -> str:
    size = "traced" if key_specs.is_traced(self.size) else int(self.size)
    policy = "" if self.eviction is None else f", eviction={self.eviction}"
    return (
      f"{type(self).__name__}(capacity={self.capacity}, size={size}, "
      f"key={self.key_spec}, value={self.value_spec}{policy})"
    )

  def _repr_html_(self) -> str:
    """A notebook summary: specs, size, load and the first live entries."""
    facts = {"key": str(self.key_spec), "value": str(self.value_spec), "capacity": f"{self.capacity:,}"}
    if self.eviction is not None:
      facts["eviction"] = str(self.eviction)
    if key_specs.is_traced(self.size):
      return display.html_table(type(self).__name__, facts, [], 0)
    size = int(self.size)
    facts |= {"size": f"{size:,}", "load": f"{size / self.capacity:.2f}", "dropped": f"{int(self.dropped):,}"}
    if self.eviction is not None:
      facts["evictions"] = f"{int(self.evictions):,}"
    keys, values, _ = jax.device_get(self.export())  # live entries first
    return display.html_table(
      type(self).__name__, facts, display.first_entries(keys, values, min(10, size)), size
    )
