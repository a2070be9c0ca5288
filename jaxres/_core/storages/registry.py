"""The storage kinds by name: the one place the rest of the package asks for a storage.

A storage kind is a :class:`~jaxres._core.storages.storage.Storage` subclass
(its table class) living in :mod:`jaxres._core.storages`; registering it in
:data:`STORAGES`, under the name that ``jr.MutableHashTable(storage=...)``
takes, is what makes it known to stateful tables, embeddings, admission
counts, sharded tables and the contract tests (``tests/test_storage_contract.py``).
Modules outside :mod:`jaxres._core.storages` import this module, not the
storages themselves (serving excepted: it reads the sorted storage's
read-only form).

Examples:
  >>> from jaxres._core.storages import registry
  >>> sorted(registry.STORAGES), registry.DEFAULT, registry.default().__name__
  (['lean', 'open_addressing', 'sorted'], 'open_addressing', 'OpenAddressingTable')
  >>> registry.storage("sorted").__name__
  'SortedTable'
"""

from __future__ import annotations

from jaxres._core.storages.lean import LeanTable
from jaxres._core.storages.open_addressing import OpenAddressingTable
from jaxres._core.storages.sorted import SortedTable
from jaxres._core.storages.storage import Storage

# The table classes are public (``jr.OpenAddressingTable``, ``jr.SortedTable``): the package re-exports them
# from here.
__all__ = [
  "DEFAULT",
  "READ_ONLY",
  "STORAGES",
  "OpenAddressingTable",
  "SortedTable",
  "Storage",
  "default",
  "storage",
  "writable",
]

# "lean": the slot is the row (issue 66; kernels for reads and writes); not yet the default.
STORAGES: dict[str, type[Storage]] = {
  "open_addressing": OpenAddressingTable,
  "sorted": SortedTable,
  "lean": LeanTable,
}
# The storage of tables that change: stateful tables, embeddings, sharded tables (admission counts are
# always lean: jaxres._nn.admission). It must evict (embeddings do).
DEFAULT = "open_addressing"
# The storage of tables built once and then read: the static tables (compact).
READ_ONLY = "sorted"


def storage(name: str, argument: str = "storage") -> type[Storage]:
  """The table class of the storage kind registered as ``name``.

  Args:
    name: a key of :data:`STORAGES`, such as ``"open_addressing"``.
    argument: the caller's argument that gave ``name``, named by the error.

  Raises:
    ValueError: no storage kind of that name (the error lists them).

  Examples:
    >>> storage("open_addressing").__name__
    'OpenAddressingTable'
    >>> storage("btree")
    Traceback (most recent call last):
    ...
    ValueError: storage: expected one of ['lean', 'open_addressing', 'sorted'], got 'btree'.
  """
  if name not in STORAGES:
    raise ValueError(f"{argument}: expected one of {sorted(STORAGES)}, got {name!r}.")
  return STORAGES[name]


def writable(name: str, argument: str = "storage") -> type[Storage]:
  """:func:`storage`, for a table written every step (embeddings): one whose writes cost O(batch).

  Raises:
    ValueError: no storage kind of that name, or one whose writes cost O(capacity) (sorted).

  Examples:
    >>> writable("lean").__name__
    'LeanTable'
    >>> writable("sorted")
    Traceback (most recent call last):
    ...
    ValueError: storage: 'sorted' writes in time of its capacity; expected one of ['lean', 'open_addressing'].
  """
  table_class = storage(name, argument)
  if not table_class.BATCH_WRITES:
    choices = sorted(n for n, c in STORAGES.items() if c.BATCH_WRITES)
    raise ValueError(f"{argument}: {name!r} writes in time of its capacity; expected one of {choices}.")
  return table_class


def default() -> type[Storage]:
  """The table class of :data:`DEFAULT`, the storage of tables that change (and evict)."""
  return STORAGES[DEFAULT]
