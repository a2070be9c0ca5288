"""The read side shared by the stateful tables: codecs, lookups, export, checkpoints, repr."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxres._core import display
from jaxres._core.encoding import key_specs
from jaxres._core.encoding.value_specs import ValueSpec
from jaxres._core.policies import check_policy
from jaxres._core.storages import registry
from jaxres._core.table import Table, check_capacity
from jaxres._errors import KeysLostError
from jaxres._persistence import saved_entries, table_arrays
from jaxres._shell.resource import Resource
from jaxres._shell.table_codecs import KeyCodec, ValueCodec

_REPR_ENTRIES = 3
_HTML_ENTRIES = 10


class Known:
  """What an eager update knows of the state it made: no key was lost, and at most
  ``size_bound`` entries are live (``None``: not known).

  It recognises that state by its first array (the state pytree itself is
  rebuilt each time it is read), held by a weak reference.
  """

  def __init__(self, table, size_bound: int | None):
    self._leaf = weakref.ref(jax.tree.leaves(table)[0])
    self.size_bound = size_bound

  def made(self, table) -> bool:
    return self._leaf() is jax.tree.leaves(table)[0]


class LookupTable(Resource):
  """Base of the stateful tables: key/value codecs, reads, export and repr.

  The state (:attr:`state`) is a functional :class:`jaxres.Table`. Keys may be
  integers (scalars or fixed-shape vectors: composite keys) or strings, values
  dtypes, pytrees of dtypes or strings; 64-bit integers are exact with
  ``jax_enable_x64`` off (NumPy arrays on the host). Every stateful table reads
  alike: ``find`` gives values (also ``table[keys]``), ``lookup`` gives
  ``(values, found)``, ``contains`` gives bools.

  Checkpoints store the live entries only, as a functional table does (the
  two restore into each other), and restore into any capacity.

  Args:
    key_dtype: the key dtype, spec (composite keys) or ``str``.
    value_dtype: a dtype, a pytree of dtypes or ``str``.
    default_value: the value of missing keys.
    initial_capacity: live entries before the first growth (with ``eviction``, the bound).
    storage: ``"open_addressing"`` or ``"sorted"``.
    device: optional ``jax.Device`` or sharding for the state.
    max_key_length: for ``str`` keys, the longest key in UTF-8 bytes.
    max_value_length: for ``str`` values, the longest value in UTF-8 bytes.
    eviction: ``None`` or an eviction policy.

  Examples:
    >>> import numpy as np, jaxres as jr
    >>> table = jr.MutableHashTable(np.int64, np.float32, default_value=0.0)
    >>> isinstance(table, jr.LookupTable)
    True
    >>> table.insert(np.array([5]), np.array([2.5], np.float32))
    >>> table[np.array([5, 6])].tolist(), table.contains(np.array([5, 6])).tolist()
    ([2.5, 0.0], [True, False])
  """

  _checkpoint_kind = table_arrays.KIND

  def __init__(
    self,
    key_dtype,
    value_dtype,
    default_value,
    *,
    initial_capacity: int,
    storage: str,
    device=None,
    max_key_length: int = 64,
    max_value_length: int = 64,
    eviction=None,
  ):
    super().__init__(device=device)
    self._storage = registry.storage(storage)
    self._eviction = check_policy(eviction)
    self._key_codec = KeyCodec(key_dtype, max_key_length)
    self._value_codec = ValueCodec(value_dtype, default_value, max_value_length)
    self._initial_capacity = check_capacity(initial_capacity, "initial_capacity")

  def _check_state(self, state) -> None:
    key_spec = key_specs.KeySpec.parse(self._key_codec.spec)
    value_spec = ValueSpec.parse(self._value_codec.spec)
    if not (
      isinstance(state, self._storage)
      and state.key_spec == key_spec
      and state.value_spec == value_spec
      and state.eviction == self._eviction
    ):
      got = type(state).__name__
      if isinstance(state, Table):
        got += f" with keys {state.key_spec} and values {state.value_spec}"
      raise TypeError(
        f"state: expected a table of type {self._storage.__name__} with keys {key_spec} and values "
        f"{value_spec}, got {got}."
      )

  def _empty(self, capacity: int):
    values = self._value_codec
    return self._storage.create(
      capacity, key=self._key_codec.spec, value=values.spec, default=values.default, eviction=self._eviction
    )

  @property
  def bounded(self) -> bool:
    """Whether the table evicts when full (an eviction policy) instead of growing."""
    return self._eviction is not None

  def _room_for(self, rows: int) -> int:
    """The capacity of a new state for ``rows`` entries: grown to hold them, unless bounded."""
    return self.state.capacity if self.bounded else max(self.state.capacity, rows, 1)

  def _imported(self, keys, values) -> Table:
    """A new state holding exactly ``keys -> values`` (the core's encoding); a bounded table evicts."""
    rows = int(np.shape(keys)[0]) if np.ndim(keys) else 1
    self._life().epoch = object()  # rebuilt: the marks of incremental saves before lapse
    return self._empty(self._room_for(rows)).import_(keys, values).succeeding(self.state)

  # -------------------------------------------------------- checkpoints

  def _serialize_to_arrays(self) -> dict[str, np.ndarray]:
    # Under the lock: a writer's insert donates the state it replaces. The entries are copied to the
    # host here, so the snapshot is one state the table had. Live entries only (not the lost-in-jit report).
    with self._life().lock:
      return table_arrays.to_arrays(self.state)

  def _serialize_changes_to_arrays(self, since):
    """A delta of the state since ``since``, unless the state was rebuilt since (the lifecycle's
    ``epoch``, kept out of the attributes that NNX compares)."""
    epoch, since = since if since is not None else (None, None)
    # One state, not donated meanwhile (see _serialize_to_arrays). Saved whole (delta None), the
    # entries are read after this mark, from a state as new or newer: changes since are then saved again.
    with self._life().lock:
      current = self._life().epoch
      mark, delta = table_arrays.changes(self.state, since if epoch is current else None)
    return (None if mark is None else (current, mark)), delta

  def _restore_from_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
    """Makes the checkpointed entries the contents, all checked before the state changes (the
    undo of :meth:`Resource._prepare_restore` puts the state from before back)."""
    codecs = {"keys": self._key_codec, "values": self._value_codec}
    arrays = {  # string rows written for another maximum length are re-encoded
      name: codecs[field].fit(array, name) if (field := saved_entries.field_of(name)) in codecs else array
      for name, array in arrays.items()
    }
    rows = saved_entries.count(arrays)
    restored = table_arrays.from_arrays(self._empty(self._room_for(rows)), arrays)
    self.state = restored.succeeding(self.state)  # every entry newer than what deltas were taken against
    self._life().epoch = object()

  def _current(self):
    """The state, after reporting keys lost inside jit (eager use only).

    A state this table's own eager update made lost nothing (eager calls grow
    first): only a state from elsewhere (``nnx.jit``, an assignment, a
    restore) is read back from the device to check.
    """
    table = self.state
    if key_specs.is_traced(table.dropped) or self._known(table) is not None:
      return table
    lost = int(table.dropped)
    if lost:
      self.state = dataclasses.replace(table, dropped=jnp.zeros_like(table.dropped))
      raise KeysLostError(
        f"{type(self).__name__}: {lost} key(s) were lost by an insert inside jit, where the table cannot "
        f"grow (capacity {table.capacity}). Call reserve() before jitting, or start with a larger "
        "initial_capacity."
      )
    return table

  def _known(self, table) -> Known | None:
    """What this table's own last eager update knows of ``table``, if it made it."""
    known = self._life().known
    return known if known is not None and known.made(table) else None

  def _updated(self, table, size_bound: int | None = None) -> None:
    """Makes ``table``, the result of an eager update by this table's own method, the state.

    ``size_bound``: at most this many entries (``None``: not known, the next
    growth check reads the size).
    """
    self._replace_state(table)
    self._life().known = Known(table, size_bound)

  def __getitem__(self, keys):
    """``table[keys]`` is ``table.find(keys)``."""
    return self.find(keys)

  def find(self, keys, default=None):
    """Values for ``keys``; missing keys get ``default`` (the table's default if ``None``)."""
    with self._life().lock:
      table = self._current()
      if default is not None:
        default = self._value_codec.encode(default, name="default")
      return self._value_codec.decode(table.find(self._key_codec.encode(keys), default))

  def lookup(self, keys):
    """``(values, found)`` for ``keys`` from a single probe."""
    with self._life().lock:
      values, found = self._current().lookup(self._key_codec.encode(keys))
      return self._value_codec.decode(values), found

  def contains(self, keys):
    """``bool[*batch]``: whether each key is present."""
    with self._life().lock:
      return self._current().contains(self._key_codec.encode(keys))

  def export(self):
    """``(keys, values)``: the live entries, sorted by key, as NumPy arrays of exact dtypes (eager only)."""
    with self._life().lock:
      table = self._current()
      if key_specs.is_traced(table.size):
        raise TypeError("export: the stateful export runs eagerly; inside jit use table.state.export().")
      return self._sorted_entries(table)

  def _sorted_entries(self, table):
    keys, values, valid = jax.device_get(table.export())  # host NumPy throughout
    live = np.asarray(valid)
    keys = self._key_codec.decode(np.asarray(keys)[live])
    order = self._key_codec.order(keys)
    values = jax.tree.map(lambda v: v[live][order], values)
    return keys[order], self._value_codec.decode(values)

  @property
  def capacity(self) -> int:
    """Live entries the table holds before it next grows."""
    return self.state.capacity

  def memory(self) -> dict[str, int]:
    """Bytes the table holds now: ``{"values": ..., "index": ...}`` (:meth:`jaxres.Table.memory` of
    its state), sized by its capacity, whatever its size."""
    return self._current().memory()

  def size(self):
    """The number of live entries: an ``int`` (inside ``jit``, a traced int32 scalar).

    Not the table's own counter, which its next write donates: ``n = t.size()`` stays readable after
    ``t.insert(...)``.
    """
    size = self._current().size
    return size if isinstance(size, jax.core.Tracer) else int(size)

  def __len__(self) -> int:
    return int(self.size())

  def __str__(self) -> str:
    return repr(self)

  def _entries(self, count: int):
    """``(first entries as text, size)``, or ``None`` when not created or traced.

    A repr does not consume the report of keys lost inside jit (see ``_current``).
    """
    if not self.created or key_specs.is_traced(self.state.size):
      return None
    with self._life().lock:
      keys, values = self._sorted_entries(self.state)
    return display.first_entries(keys, values, count), len(keys)

  def __repr__(self) -> str:
    name = f"{type(self).__name__}(key={self._key_codec.name}, value={self._value_codec.name}"
    if self._eviction is not None:
      name += f", eviction={self._eviction}"
    shown = self._entries(_REPR_ENTRIES)
    return name + ")" if shown is None else display.text(name, *shown)

  def _repr_html_(self) -> str:
    """A notebook summary: dtypes, size, capacity and the first entries in key order."""
    facts = {"key": self._key_codec.name, "value": self._value_codec.name}
    shown = self._entries(_HTML_ENTRIES)
    if shown is not None:
      facts |= {"size": f"{shown[1]:,}", "capacity": f"{self.capacity:,}", "storage": self._storage.__name__}
      lost = int(self.state.dropped)
      if lost:
        facts["lost inside jit"] = f"{lost:,}"
    return display.html_table(type(self).__name__, facts, *(shown or ([], 0)))
