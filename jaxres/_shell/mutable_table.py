"""``MutableHashTable``: a stateful, growable, thread-safe table resource."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxres._core import folds
from jaxres._core.encoding import key_specs
from jaxres._core.policies import Evicted
from jaxres._core.storages import registry
from jaxres._core.table import Table, check_capacity
from jaxres._shell.lookup_table import LookupTable


class MutableHashTable(LookupTable):
  """A mutable table resource, the analogue of ``tf.lookup.experimental.MutableHashTable``.

  The state (:attr:`state`) is a functional :class:`jaxres.Table`; methods
  replace it under a lock, so concurrent Python threads lose no update. Eager
  updates are made in place (the state is donated: a state read earlier from
  :attr:`state` is deleted by the next update) and cost O(batch) whatever the
  capacity. Eager calls never lose a key: the table grows before a call whose
  keys might not fit. Held by an
  ``nnx.Module``, the table can be read and updated inside ``nnx.jit`` with
  the same methods; the update persists on the module. Inside ``jit`` the
  table cannot grow: keys that do not fit are counted, and the next eager use
  raises a ``ValueError`` saying how many were lost (call :meth:`reserve`
  before jitting to make room).

  Args:
    key_dtype: ``int32``, ``uint32``, ``int64``, ``uint64``, a
      ``jax.ShapeDtypeStruct`` of one for composite keys (``(2,)``: keys of
      shape ``[*batch, 2]``), or ``str``.
    value_dtype: a dtype, a pytree of dtypes matching ``default_value``, or ``str``.
    default_value: value of missing keys; its shape is the per-entry value shape.
    initial_capacity: live entries before the first growth; with an eviction
      policy, the bound the table never grows past.
    storage: ``"open_addressing"`` (default), ``"sorted"`` or ``"lean"`` (the slot is
      the row: 17 bytes a slot beyond the row with eviction; not yet the default).
    device: optional ``jax.Device`` or sharding for the state.
    max_key_length: for ``str`` keys, the longest key in UTF-8 bytes.
    max_value_length: for ``str`` values, the longest value in UTF-8 bytes.
    eviction: ``None`` (the table grows), or ``jr.LRU()``, ``jr.LFU()``,
      ``jr.CustomScore()``: a bounded table of ``initial_capacity`` entries
      that evicts by the policy when full, eagerly and inside ``nnx.jit``
      (open addressing and lean storages).

  With ``jax_enable_x64`` off, 64-bit integer keys and values are exact (NumPy
  arrays on the host); ``float64`` values are stored as ``float32``.

  Examples:
    >>> import numpy as np, jaxres as jr
    >>> table = jr.MutableHashTable(np.int64, np.float32, default_value=-999.0)
    >>> table.insert(np.array([1, 2**40]), np.array([100.0, 200.0], np.float32))
    >>> table.find(np.array([2**40, 3])).tolist()
    [200.0, -999.0]
    >>> names = jr.MutableHashTable(str, np.int32, default_value=-1)
    >>> names.insert(["ada", "grace"], np.array([1815, 1906], np.int32))
    >>> names.export()
    (array(['ada', 'grace'], dtype=object), array([1815, 1906], dtype=int32))
  """

  def __init__(
    self,
    key_dtype,
    value_dtype,
    default_value,
    *,
    initial_capacity: int = 1024,
    storage: str = registry.DEFAULT,
    device=None,
    max_key_length: int = 64,
    max_value_length: int = 64,
    eviction=None,
  ):
    super().__init__(
      key_dtype,
      value_dtype,
      default_value,
      initial_capacity=initial_capacity,
      storage=storage,
      device=device,
      max_key_length=max_key_length,
      max_value_length=max_value_length,
      eviction=eviction,
    )
    self.state  # noqa: B018  (create now: bad dtypes fail here, and NNX sees the state)

  def _create_resource(self):
    return self._empty(self._initial_capacity)

  def _with_room(self, table, keys) -> tuple:
    """``(table, size_bound)``: ``table``, grown first when the keys of a call might not fit, and
    the most entries it can hold after the call (eager, unbounded tables only; else ``None``).

    Growing before the call, not after a call that dropped keys, lets every
    call donate the state: updates are made in place, O(batch). The size is
    read from the device only when the bound that the table's own updates
    keep says the keys might not fit.
    """
    if table.eviction is not None or key_specs.is_traced(table.size):
      return table, None
    rows = table.key_spec.count(keys)
    known = self._known(table)
    bound = known.size_bound if known is not None and known.size_bound is not None else None
    if bound is None or bound + rows > table.capacity:
      rows = math.prod(table.key_spec.encode(keys, "keys")[1])  # checked before the table can grow
      bound = int(table.size)
      if bound + rows > table.capacity:
        table = table.resize(max(2 * table.capacity, bound + rows))
    return table, bound + rows

  def _write(self, method, keys, values=None, *, inserts: bool = True, **kwargs):
    """Runs the functional ``method`` on the state, donating it, and makes its table the state;
    returns the rest of its result. ``inserts``: the call may add keys, so the table grows
    first when they might not fit (otherwise the size stays within what is known of it)."""
    with self._life().lock:
      table = self._current()
      keys = self._key_codec.encode(keys)
      args = (keys,) if values is None else (keys, self._value_codec.encode(values))
      if inserts:
        table, bound = self._with_room(table, keys)
      else:
        known = self._known(table)
        bound = known and known.size_bound
      result = method(table, *args, **kwargs, donate=True)
      table, rest = (result[0], result[1:]) if isinstance(result, tuple) else (result, ())
      self._updated(table, bound)
      return rest

  def insert(self, keys, values, valid=None, scores=None) -> None:
    """Inserts or assigns ``values`` for ``keys`` (the last duplicate wins).

    Args:
      keys: keys of the table's key dtype, ``[*batch, *key_shape]`` (or strings).
      values: values ``[*batch, *value_shape]`` (a pytree for pytree values).
      valid: optional ``bool[*batch]``; rows marked ``False`` are skipped.
      scores: ``uint32[*batch]``, for a table with ``eviction=jr.CustomScore()``.

    Raises:
      TypeError, ValueError: bad keys or values (the table is unchanged).
    """
    self._write(Table.insert, keys, values, valid=valid, scores=scores)

  def insert_and_evict(self, keys, values, valid=None, scores=None) -> Evicted:
    """:meth:`insert`, returning what left: the entry each key row's new key replaced (a bounded
    table evicts by its policy; a growing one never does), as host NumPy arrays.

    Examples:
      >>> import numpy as np, jaxres as jr
      >>> t = jr.MutableHashTable(np.int64, np.float32, 0.0, initial_capacity=1, eviction=jr.LRU())
      >>> t.insert(np.array([1]), np.array([1.0], np.float32))
      >>> evicted = t.insert_and_evict(np.array([2]), np.array([2.0], np.float32))
      >>> evicted.keys.tolist(), evicted.valid.tolist()
      ([1], [True])
    """
    (evicted,) = self._write(Table.insert_and_evict, keys, values, valid=valid, scores=scores)
    return self._decoded(evicted)

  def find_or_insert(self, keys, values, valid=None, scores=None):
    """Values of ``keys``; keys not yet present are inserted with ``values`` first.

    The first occurrence of a new key inserts it and later duplicates see that
    value (``jr.Table.find_or_insert``): the way to assign embedding rows to
    ids as they arrive. Eager calls grow the table; inside ``jit`` a new key
    that does not fit gets the default and is counted as lost (see the class
    doc). ``valid`` and ``scores`` as for :meth:`insert`.

    Examples:
      >>> import numpy as np, jaxres as jr
      >>> rows = jr.MutableHashTable(np.int64, np.int32, default_value=-1)
      >>> rows.find_or_insert(np.array([7, 9, 7]), np.array([0, 1, 2], np.int32)).tolist()
      [0, 1, 0]
    """
    (found,) = self._write(Table.find_or_insert, keys, values, valid=valid, scores=scores)
    return self._value_codec.decode(found)

  def find_or_insert_and_evict(self, keys, values, valid=None, scores=None) -> tuple[Any, Evicted]:
    """:meth:`find_or_insert`, also returning what left (as :meth:`insert_and_evict`)."""
    found, evicted = self._write(Table.find_or_insert_and_evict, keys, values, valid=valid, scores=scores)
    return self._value_codec.decode(found), self._decoded(evicted)

  def insert_or_apply(self, keys, values, fn: Callable, valid=None, scores=None) -> None:
    """New keys get ``values``; present ones become ``fn(old, new)`` (duplicates fold in order).

    ``fn`` as for :meth:`jaxres.Table.insert_or_apply` (``jnp.add``: counting);
    ``valid`` and ``scores`` as for :meth:`insert`. On 64-bit integer values
    the operations that table names (``jnp.add``, ``jnp.subtract``,
    ``jnp.maximum``...) are exact with ``jax_enable_x64`` on or off, wrapping
    around as NumPy's ``int64`` does.

    Raises:
      TypeError: ``fn`` is none of those operations and the values hold a
        64-bit integer leaf with x64 off (``fn`` would compute on uint32 word
        pairs), or the values are strings (the table is unchanged).

    Examples:
      >>> import numpy as np, jax.numpy as jnp, jaxres as jr
      >>> counts = jr.MutableHashTable(str, np.int64, default_value=0)
      >>> counts.insert_or_apply(["ada", "ada", "alan"], np.array([1, 2**32, 1]), jnp.add)
      >>> counts.insert_or_apply(["alan"], np.array([-3]), jnp.add)
      >>> counts.find(["ada", "alan", "grace"]).tolist()
      [4294967297, -2, 0]
    """
    if self._value_codec.is_string:
      raise TypeError("fn: a table of str values cannot apply fn to them; use insert.")
    if any(leaf.wide for leaf in self.state.value_spec.leaves) and not folds.is_exact(fn):
      raise TypeError(
        f"fn: with jax_enable_x64 off, 64-bit integer values are exact under {folds.EXACT}; "
        f"{fn!r} would get them as uint32 word pairs, on which arithmetic is not 64-bit arithmetic. "
        "Use one of those, int32 values, or enable jax_enable_x64."
      )
    self._write(Table.insert_or_apply, keys, values, fn=fn, valid=valid, scores=scores)

  def assign(self, keys, values, valid=None) -> None:
    """Replaces the values of keys present; absent keys are ignored (nothing is inserted or evicted,
    scores stay). The last duplicate wins."""
    self._write(Table.assign, keys, values, inserts=False, valid=valid)

  def assign_scores(self, keys, scores=None, valid=None) -> None:
    """Updates the scores of keys present as an insert would, values unchanged; absent keys are
    ignored (see :meth:`jaxres.Table.assign_scores`). ``scores``: with ``jr.CustomScore()``.

    Raises:
      ValueError: the table has no eviction policy (it keeps no scores).
    """
    self._write(Table.assign_scores, keys, inserts=False, scores=scores, valid=valid)

  def remove(self, keys, valid=None) -> None:
    """Removes ``keys``; absent keys are ignored; rows where ``valid`` is ``False`` are skipped."""
    self._write(Table.remove, keys, inserts=False, valid=valid)

  def _decoded(self, evicted: Evicted) -> Evicted:
    """The evicted entries on the host: keys and values as the table's users give them."""
    keys, values, scores, valid = jax.device_get(tuple(evicted))
    return Evicted(
      self._key_codec.decode(np.asarray(keys)), self._value_codec.decode(values), np.asarray(scores), valid
    )

  def import_(self, keys, values) -> None:
    """Replaces the contents with the given entries (growing as needed)."""
    with self._life().lock:
      self._current()
      self.state = self._imported(self._key_codec.encode(keys), self._value_codec.encode(values))

  def reserve(self, capacity: int) -> None:
    """Grows the table to hold ``capacity`` entries (e.g. before jitting)."""
    capacity = check_capacity(capacity)
    with self._life().lock:
      table = self._current()
      if capacity > table.capacity:
        self.state = table.resize(capacity)
