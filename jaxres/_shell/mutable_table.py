"""``MutableHashTable``: a stateful, growable, thread-safe table resource."""

from __future__ import annotations

import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np

from jaxres._core import codec
from jaxres._core.open_addressing import OpenAddressingTable
from jaxres._core.sorted_table import SortedTable
from jaxres._core.table import check_capacity
from jaxres._shell.codecs import KeyCodec, ValueCodec
from jaxres._shell.resource import Resource

STORAGES = {"open_addressing": OpenAddressingTable, "sorted": SortedTable}
_REPR_ENTRIES = 3
_REPR_ENTRY_CHARS = 100


class MutableHashTable(Resource):
  """A mutable table resource, the analogue of ``tf.lookup.experimental.MutableHashTable``.

  The state (:attr:`state`) is a functional :class:`jaxres.Table`; methods
  replace it under a lock, so concurrent Python threads lose no update. Eager
  calls never lose a key: the table grows before it is full. Held by an
  ``nnx.Module``, the table can be read and updated inside ``nnx.jit`` with
  the same methods; the update persists on the module. Inside ``jit`` the
  table cannot grow: keys that do not fit are counted, and the next eager use
  raises a ``ValueError`` saying how many were lost (call :meth:`reserve`
  before jitting to make room).

  Args:
    key_dtype: ``int32``, ``uint32``, ``int64``, ``uint64`` or ``str``.
    value_dtype: a dtype, a pytree of dtypes matching ``default_value``, or ``str``.
    default_value: value of missing keys; its shape is the per-entry value shape.
    initial_capacity: live entries before the first growth.
    storage: ``"open_addressing"`` (default) or ``"sorted"``.
    device: optional ``jax.Device`` or sharding for the state.
    max_key_length: for ``str`` keys, the longest key in UTF-8 bytes.
    max_value_length: for ``str`` values, the longest value in UTF-8 bytes.

  With ``jax_enable_x64`` off, 64-bit integer keys and values are exact (NumPy
  arrays on the host); ``float64`` values are stored as ``float32``.

  Example:
    >>> import numpy as np, jaxres as jr
    >>> table = jr.MutableHashTable(np.int64, np.float32, default_value=-999.0)
    >>> table.insert(np.array([1, 2**40]), np.array([100.0, 200.0], np.float32))
    >>> table.find(np.array([2**40, 3])).tolist()
    [200.0, -999.0]
    >>> names = jr.MutableHashTable(str, np.int32, default_value=-1)
    >>> names.insert(["ada", "grace"], np.array([1815, 1906], np.int32))
    >>> names.export()
    (array(['ada', 'grace'], dtype=object), Array([1815, 1906], dtype=int32))
  """

  def __init__(
    self,
    key_dtype,
    value_dtype,
    default_value,
    *,
    initial_capacity: int = 1024,
    storage: str = "open_addressing",
    device=None,
    max_key_length: int = 64,
    max_value_length: int = 64,
  ):
    super().__init__(device=device)
    if storage not in STORAGES:
      raise ValueError(f"storage: expected one of {sorted(STORAGES)}, got {storage!r}.")
    self._storage = STORAGES[storage]
    self._key_codec = KeyCodec(key_dtype, max_key_length)
    self._value_codec = ValueCodec(value_dtype, default_value, max_value_length)
    self._initial_capacity = check_capacity(initial_capacity, "initial_capacity")
    self._lock = threading.RLock()
    self.state  # noqa: B018  (create now: bad dtypes fail here, and NNX sees the state)

  def _create_resource(self):
    values = self._value_codec
    return self._storage.create(
      self._initial_capacity, key=self._key_codec.spec, value=values.spec, default=values.default
    )

  # ------------------------------------------------------------ helpers

  def _current(self):
    """The state, after reporting keys lost inside jit (eager use only)."""
    table = self.state
    if codec.is_traced(table.dropped):
      return table
    lost = int(table.dropped)
    if lost:
      self.state = dataclasses.replace(table, dropped=jnp.zeros_like(table.dropped))
      raise ValueError(
        f"{type(self).__name__}: {lost} key(s) were lost by an insert inside jit, where the table cannot "
        f"grow (capacity {table.capacity}). Call reserve() before jitting, or start with a larger "
        "initial_capacity."
      )
    return table

  def _insert_growing(self, table, keys, values):
    """Eager insert that grows the table instead of dropping keys."""
    grown = table.insert(keys, values)
    while not codec.is_traced(grown.dropped) and int(grown.dropped) > int(table.dropped):
      lost = int(grown.dropped) - int(table.dropped)
      table = table.resize(max(2 * table.capacity, table.capacity + 2 * lost))
      grown = table.insert(keys, values)
    return grown

  # ------------------------------------------------------------- methods

  def insert(self, keys, values) -> None:
    """Inserts or assigns ``values`` for ``keys`` (the last duplicate wins).

    Raises:
      TypeError, ValueError: bad keys or values (the table is unchanged).
    """
    with self._lock:
      table = self._current()
      keys, values = self._key_codec.encode(keys), self._value_codec.encode(values)
      self.state = self._insert_growing(table, keys, values)

  def find(self, keys, default=None):
    """Values for ``keys``; missing keys get ``default`` (the table's default if ``None``)."""
    with self._lock:
      table = self._current()
      if default is not None:
        default = self._value_codec.encode(default, name="default")
      return self._value_codec.decode(table.find(self._key_codec.encode(keys), default))

  def lookup(self, keys):
    """``(values, found)`` for ``keys`` from a single probe."""
    with self._lock:
      values, found = self._current().lookup(self._key_codec.encode(keys))
      return self._value_codec.decode(values), found

  def contains(self, keys):
    """``bool[*batch]``: whether each key is present."""
    with self._lock:
      return self._current().contains(self._key_codec.encode(keys))

  def remove(self, keys) -> None:
    """Removes ``keys``; absent keys are ignored."""
    with self._lock:
      self.state = self._current().remove(self._key_codec.encode(keys))

  def export(self):
    """``(keys, values)``: the live entries, sorted by key, with exact dtypes (eager only)."""
    with self._lock:
      table = self._current()
      if codec.is_traced(table.size):
        raise TypeError("export: the stateful export runs eagerly; inside jit use table.state.export().")
      keys, values, valid = table.export()
      live = np.asarray(valid)
      keys = self._key_codec.decode(np.asarray(keys)[live])
      order = self._key_codec.order(keys)
      values = jax.tree.map(lambda v: v[live][order], values)
      return keys[order], self._value_codec.decode(values)

  def import_(self, keys, values) -> None:
    """Replaces the contents with the given entries (growing as needed)."""
    with self._lock:
      table = self._current()
      keys, values = self._key_codec.encode(keys), self._value_codec.encode(values)
      self.state = self._insert_growing(table._cleared(), keys, values)

  def reserve(self, capacity: int) -> None:
    """Grows the table to hold ``capacity`` entries (e.g. before jitting)."""
    capacity = check_capacity(capacity)
    with self._lock:
      table = self._current()
      if capacity > table.capacity:
        self.state = table.resize(capacity)

  @property
  def capacity(self) -> int:
    """Live entries the table holds before it next grows."""
    return self.state.capacity

  def size(self):
    """The number of live entries (an int32 array)."""
    return self._current().size

  def __len__(self) -> int:
    return int(self.size())

  def __str__(self) -> str:
    return repr(self)

  def __repr__(self) -> str:
    name = f"{type(self).__name__}(key={self._key_codec.name}, value={self._value_codec.name}"
    if not self.created or codec.is_traced(self.state.size):
      return name + ")"
    keys, values = self.export()
    shown = []
    for i in range(min(_REPR_ENTRIES, len(keys))):
      value = jax.tree.map(lambda v, i=i: np.asarray(v[i]).tolist(), values)
      entry = f"{keys[i]!r}: {value!r}"
      shown.append(entry if len(entry) <= _REPR_ENTRY_CHARS else entry[:_REPR_ENTRY_CHARS] + " ...")
    more = ", ..." if len(keys) > _REPR_ENTRIES else ""
    return f"{name}, size={len(keys)}, {{{', '.join(shown)}{more}}})"
