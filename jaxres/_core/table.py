"""The ``Table`` protocol: argument checking on the host, one jitted function per operation.

Public methods validate and encode arguments on the host, then call one of the
jitted functions below, so eager calls are compiled once per shape and calls
inside a user's ``jit`` simply inline. Those functions work on flat batches of
uint32 key rows through a table's row operations (``_lookup_rows``,
``_upsert_rows``, ``_apply_rows``, ``_remove_rows``, ``_compact``), which each
kind of table implements: the storages (:mod:`storage`) in their arrays, a
sharded table by routing each row to the storage that owns its key.
"""

from __future__ import annotations

import abc
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxres._core import codec, display, entries
from jaxres._core.args import check_int
from jaxres._core.rows import select_rows
from jaxres._core.values import ValueSpec

_MAX_CAPACITY = 2**30
_MIN_EAGER_ROWS = 8  # eager batches are padded to a power of two of at least this many rows


def check_capacity(capacity, name: str = "capacity") -> int:
  """A static capacity: an int in ``[1, 2**30]`` (``TypeError``/``ValueError`` naming ``name``)."""
  return check_int(capacity, name, low=1, high=_MAX_CAPACITY)


@jax.jit
def _jit_lookup(table: Table, words, defaults):
  return table._lookup_rows(words, defaults)


@jax.jit
def _jit_contains(table: Table, words):
  return table._lookup_rows(words, [])[1]


@jax.jit
def _jit_compact(table: Table):
  return table._compact()


@jax.jit
def _jit_remove(table: Table, words, active):
  return table._remove_rows(words, active)


@functools.partial(jax.jit, static_argnames=("mode",))
def _jit_upsert(table: Table, words, leaves, active, *, mode: str):
  """insert ("insert": last duplicate wins) and find_or_insert ("first")."""
  return table._upsert_rows(words, leaves, active, mode)


@functools.partial(jax.jit, static_argnames=("fn",))
def _jit_apply(table: Table, words, leaves, active, *, fn):
  return table._apply_rows(words, leaves, active, fn)


class Table(abc.ABC):
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
  """

  _checkpoint_kind = "table"  # checkpoints of stateful and functional tables are interchangeable

  # Fields every storage declares (see the storage modules).
  values: tuple
  default: tuple
  size: jax.Array  # shape=(), dtype=int32: live entries
  dropped: jax.Array  # shape=(), dtype=int32: keys an insert could not place
  capacity: int
  key_spec: codec.KeySpec
  value_spec: ValueSpec

  # ------------------------------------------------------------------ args

  @classmethod
  def _specs(cls, key, value, default):
    key_spec = codec.KeySpec.parse(key)
    value_spec = ValueSpec.parse(value)
    default_leaves = tuple(value_spec.to_storage(value_spec.spread(default), (), "default", broadcast=True))
    return key_spec, value_spec, default_leaves

  def _keys(self, keys, name="keys"):
    words, batch = self.key_spec.encode(keys, name)
    return words.reshape(-1, self.key_spec.num_words), batch

  def _values(self, values, batch, name="values"):
    n = math.prod(batch)
    leaves = self.value_spec.to_storage(values, batch, name)
    return [x.reshape((n, *x.shape[len(batch) :])) for x in leaves]

  def _output(self, leaves, batch):
    return self.value_spec.from_storage([x.reshape(batch + x.shape[1:]) for x in leaves])

  def _default(self, default, batch):
    if default is None:
      return [jnp.broadcast_to(d, batch + d.shape) for d in self.default]
    return self.value_spec.to_storage(self.value_spec.spread(default), batch, "default", broadcast=True)

  def _active(self, valid, batch):
    """``valid`` as a flat ``bool`` mask, or ``None``."""
    if valid is None:
      return None
    active = jnp.asarray(valid)
    if active.dtype != bool or active.shape != batch:
      raise ValueError(f"valid: expected bool{list(batch)}, got {active.dtype}{list(active.shape)}.")
    return active.reshape(-1)

  def _padded(self, words, leaves, active):
    """Eager batches padded to a power of two (>= 8 rows), the padding masked.

    Each new batch shape compiles a new executable, and on XLA:CPU each one
    holds hundreds of memory mappings; padding bounds eager calls to a few
    shapes. Under ``jit`` the caller's shapes are kept.

    Returns ``(words, leaves, active, n)`` with ``n`` the rows before padding.
    """
    n = words.shape[0]
    if codec.is_traced(words):
      return words, leaves, active, n
    size = max(_MIN_EAGER_ROWS, 1 << (n - 1).bit_length())

    def pad(x):
      return x if size == n else jnp.pad(x, [(0, size - n)] + [(0, 0)] * (x.ndim - 1))

    # Always a mask, so padded and unpadded batches of one size share a compile.
    active = jnp.arange(size) < n if active is None else pad(active)
    return pad(words), [pad(x) for x in leaves], active, n

  def _empty_result(self, batch):
    return self._output([x.reshape((0, *x.shape[len(batch) :])) for x in self._default(None, batch)], batch)

  # ------------------------------------------------------------- queries

  def lookup(self, keys) -> tuple[Any, jax.Array]:
    """Finds keys, returning ``(values, found)`` from a single probe.

    Args:
      keys: ``key_dtype[*batch, *key_shape]`` (or word pairs, see class doc).

    Returns:
      ``values``: the value pytree with leaves ``[*batch, *value_shape]``
      (the table's default where missing), and ``found``: ``bool[*batch]``.

    Example:
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

    Example:
      >>> import jax.numpy as jnp, jaxres as jr
      >>> t = jr.SortedTable.create(8, key=jnp.int32, value=jnp.float32, default=-1.0)
      >>> t = t.insert(jnp.array([3]), jnp.array([0.5]))
      >>> t.find(jnp.array([3, 4])).tolist(), t.find(jnp.array([4]), default=9.0).tolist()
      ([0.5, -1.0], [9.0])
    """
    return self._lookup(keys, default)[0]

  def contains(self, keys) -> jax.Array:
    """``bool[*batch]``: whether each key is present."""
    words, batch = self._keys(keys)
    if not words.shape[0]:
      return jnp.zeros(batch, bool)
    words, _, _, n = self._padded(words, [], None)
    return _jit_contains(self, words)[:n].reshape(batch)

  def _lookup(self, keys, default):
    words, batch = self._keys(keys)
    defaults = self._default(default, batch)
    if not words.shape[0]:
      return self._empty_result(batch), jnp.zeros(batch, bool)
    flat_defaults = [d.reshape((words.shape[0], *d.shape[len(batch) :])) for d in defaults]
    words, flat_defaults, _, n = self._padded(words, flat_defaults, None)
    leaves, found = _jit_lookup(self, words, flat_defaults)
    return self._output([x[:n] for x in leaves], batch), found[:n].reshape(batch)

  # ----------------------------------------------------------- mutations

  def insert(self, keys, values, valid=None) -> Table:
    """Inserts or assigns; the last duplicate in the batch wins.

    New keys that do not fit (``size == capacity``) are counted in
    :attr:`dropped` instead, in batch order, exactly as a one-at-a-time loop.

    Args:
      keys: ``key_dtype[*batch, *key_shape]``.
      values: value pytree with leaves ``[*batch, *value_shape]`` (a scalar
        leaf broadcasts).
      valid: optional ``bool[*batch]``; rows marked ``False`` are skipped
        (padding in a fixed-shape batch).

    Returns:
      The new table.
    """
    words, batch = self._keys(keys)
    leaves = self._values(values, batch)
    active = self._active(valid, batch)
    if not words.shape[0]:
      return self
    return _jit_upsert(self, *self._padded(words, leaves, active)[:3], mode="insert")[0]

  def find_or_insert(self, keys, values, valid=None) -> tuple[Table, Any]:
    """Returns existing values and inserts the missing keys with ``values``.

    The first occurrence of a new key inserts it; later duplicates see that
    value. A new key that does not fit gets the table default and is counted
    in :attr:`dropped`.

    Args:
      keys: ``key_dtype[*batch, *key_shape]``.
      values: value pytree with leaves ``[*batch, *value_shape]``.
      valid: optional ``bool[*batch]``; rows marked ``False`` are skipped
        and get the table default (padding in a fixed-shape batch).

    Returns:
      ``(table, values)`` where ``values`` has leaves ``[*batch, *value_shape]``.

    Example:
      >>> import jax.numpy as jnp, jaxres as jr
      >>> t = jr.OpenAddressingTable.create(8, key=jnp.int32, value=jnp.int32, default=-1)
      >>> t, rows = t.find_or_insert(jnp.array([7, 9, 7]), jnp.array([0, 1, 2]))
      >>> rows.tolist()
      [0, 1, 0]
    """
    words, batch = self._keys(keys)
    leaves = self._values(values, batch)
    active = self._active(valid, batch)
    if not words.shape[0]:
      return self, self._empty_result(batch)
    padded_words, padded_leaves, padded_active, n = self._padded(words, leaves, active)
    table, out = _jit_upsert(self, padded_words, padded_leaves, padded_active, mode="first")
    out = [x[:n] for x in out]
    if active is not None:
      out = select_rows(active, out, self._default(None, (n,)))
    return table, self._output(out, batch)

  def insert_or_apply(self, keys, values, fn: Callable, valid=None) -> Table:
    """New keys get ``values``; existing ones become ``fn(old, new)``.

    Duplicates within the batch fold in order: a key ``k`` present with value
    ``a`` and given ``b`` then ``c`` ends as ``fn(fn(a, b), c)``.

    Args:
      keys: ``key_dtype[*batch, *key_shape]``.
      values: value pytree with leaves ``[*batch, *value_shape]``.
      fn: ``fn(old, new) -> value``, both one entry's value pytree (it is
        vectorised with ``jax.vmap``), e.g. ``jnp.add``. 64-bit integer leaves
        with x64 off appear as uint32 word pairs. Pass the same function object
        each call to avoid recompiling.
      valid: optional ``bool[*batch]``; rows marked ``False`` are skipped
        (padding in a fixed-shape batch).

    Example:
      >>> import jax.numpy as jnp, jaxres as jr
      >>> t = jr.OpenAddressingTable.create(8, key=jnp.int32, value=jnp.float32)
      >>> t = t.insert_or_apply(jnp.array([1, 1, 2]), jnp.array([1.0, 2.0, 5.0]), jnp.add)
      >>> t.find(jnp.array([1, 2])).tolist()
      [3.0, 5.0]
    """
    if not callable(fn):
      raise TypeError(f"fn: expected a callable fn(old, new), got {fn!r}.")
    words, batch = self._keys(keys)
    leaves = self._values(values, batch)
    active = self._active(valid, batch)
    if not words.shape[0]:
      return self
    self._check_fn(fn)
    return _jit_apply(self, *self._padded(words, leaves, active)[:3], fn=fn)

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

  def remove(self, keys, valid=None) -> Table:
    """Removes keys; absent keys are ignored.

    Args:
      keys: ``key_dtype[*batch, *key_shape]``.
      valid: optional ``bool[*batch]``; rows marked ``False`` are skipped
        (padding in a fixed-shape batch).
    """
    words, batch = self._keys(keys)
    active = self._active(valid, batch)
    if not words.shape[0]:
      return self
    words, _, active, _ = self._padded(words, [], active)
    return _jit_remove(self, words, active)

  # ------------------------------------------------------ whole contents

  def export(self):
    """All entries as fixed-shape arrays ``(keys, values, valid)``.

    Returns ``capacity`` rows with the live entries first (``valid`` marks
    them); jittable. ``SortedTable`` exports in key order. 64-bit keys come
    back as NumPy arrays when x64 is off and the call is eager, and as word
    pairs under ``jit``.
    """
    words, leaves, valid = _jit_compact(self)
    words = jnp.where(valid[:, None], words, self.key_spec.encode_zero())
    return self.key_spec.decode(words), self.value_spec.from_storage(leaves), valid

  def import_(self, keys, values, valid=None) -> Table:
    """A table of the same capacity holding exactly the given entries.

    Args:
      keys: ``key_dtype[n, *key_shape]``.
      values: value pytree with leaves ``[n, *value_shape]``.
      valid: optional ``bool[n]``; rows marked ``False`` are ignored.

    Entries beyond the capacity are counted in :attr:`dropped`, which
    otherwise restarts at zero.
    """
    words, batch = self._keys(keys)
    leaves = self._values(values, batch)
    active = self._active(valid, batch)
    empty = self._cleared()
    if not words.shape[0]:
      return empty
    return _jit_upsert(empty, *self._padded(words, leaves, active)[:3], mode="insert")[0]

  def resize(self, capacity: int) -> Table:
    """The same contents in a table of another ``capacity`` (static).

    Raises:
      ValueError: eagerly, when ``capacity`` is below the current size (under
        ``jit`` the entries that do not fit are counted in ``dropped``).
    """
    capacity = check_capacity(capacity)
    if not codec.is_traced(self.size) and int(self.size) > capacity:
      raise ValueError(f"capacity: {capacity} is below the table's size {int(self.size)}.")
    words, leaves, valid = _jit_compact(self)
    return _jit_upsert(self._with_capacity(capacity), words, leaves, valid, mode="insert")[0]

  # ------------------------------------------------------ checkpoints

  def _serialize_to_arrays(self) -> dict[str, np.ndarray]:
    """The live entries as named host arrays (see :mod:`entries`): keys in their exact dtype."""
    return entries.to_arrays(self._live_by_shard(), self.value_spec)

  def _from_arrays(self, arrays) -> Table:
    """This table (its storage, capacity, mesh) holding exactly the entries of ``arrays``.

    Raises:
      TypeError: ``arrays`` are not a table's.
      ValueError: keys or values of other dtypes or shapes, or more entries
        than the capacity holds.
    """
    keys, values = entries.from_arrays(arrays, self.key_spec, self.value_spec)
    table = self.import_(keys, values)
    if int(table.dropped):
      raise ValueError(
        f"{len(keys)} entries do not fit a table of capacity {self.capacity} "
        f"({int(table.dropped)} would be lost)."
      )
    return table

  def _live_by_shard(self) -> list[entries.Entries]:
    """The live entries on the host, ``(keys, value leaves)`` per shard, in exact dtypes."""
    words, leaves, valid = jax.device_get(_jit_compact(self))
    return [self._host_entries(words, leaves, valid)]

  def _host_entries(self, words, leaves, valid) -> entries.Entries:
    live = np.asarray(valid)
    keys = self.key_spec.decode(jnp.asarray(np.asarray(words)[live]))
    values = self.value_spec.from_storage([jnp.asarray(np.asarray(x)[live]) for x in leaves])
    return np.asarray(keys), [np.asarray(x) for x in jax.tree.leaves(values)]

  def __repr__(self) -> str:
    size = "traced" if codec.is_traced(self.size) else int(self.size)
    return (
      f"{type(self).__name__}(capacity={self.capacity}, size={size}, "
      f"key={self.key_spec}, value={self.value_spec})"
    )

  def _repr_html_(self) -> str:
    """A notebook summary: specs, size, load and the first live entries."""
    facts = {"key": str(self.key_spec), "value": str(self.value_spec), "capacity": f"{self.capacity:,}"}
    if codec.is_traced(self.size):
      return display.html_table(type(self).__name__, facts, [], 0)
    size = int(self.size)
    facts |= {"size": f"{size:,}", "load": f"{size / self.capacity:.2f}", "dropped": f"{int(self.dropped):,}"}
    keys, values, _ = jax.device_get(self.export())  # live entries first
    return display.html_table(
      type(self).__name__, facts, display.first_entries(keys, values, min(10, size)), size
    )

  # ------------------------------------------------------ row operations
  # Flat batches of uint32 key rows, called inside the jitted functions above.

  def _cleared(self) -> Table:
    return self._with_capacity(self.capacity)

  @abc.abstractmethod
  def _with_capacity(self, capacity: int) -> Table:
    """An empty table with this one's specs and default and a new capacity."""

  @abc.abstractmethod
  def _lookup_rows(self, words, defaults) -> tuple[list, jax.Array]:
    """``(leaves, found)``: stored values of present keys, ``defaults`` (leaves) elsewhere."""

  @abc.abstractmethod
  def _upsert_rows(self, words, leaves, active, mode) -> tuple[Table, list]:
    """insert (``mode="insert"``) or find_or_insert (``"first"``) on flat rows."""

  @abc.abstractmethod
  def _apply_rows(self, words, leaves, active, fn) -> Table:
    """insert_or_apply on flat rows."""

  @abc.abstractmethod
  def _remove_rows(self, words, active) -> Table:
    """remove on flat rows."""

  @abc.abstractmethod
  def _compact(self) -> tuple[jax.Array, list, jax.Array]:
    """``(words[rows, W], leaves, valid)`` with the live entries first."""
