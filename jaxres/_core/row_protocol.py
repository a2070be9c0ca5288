"""The row protocol: what every kind of table implements on flat batches of encoded rows, and the
one jitted function per operation that runs it.

A table's public methods (:mod:`jaxres._core.table`) check and encode their
arguments on the host, then call one of the functions below, so eager calls
are compiled once per shape and calls inside a user's ``jit`` simply inline.
The functions work on flat batches of uint32 key rows through the protocol's
row operations (``_lookup_rows``, ``_upsert_rows``, ``_apply_rows``,
``_remove_rows``, ...), which each kind of table implements: the storages
(:mod:`jaxres._core.storages`) in their arrays, a sharded table by routing each
row to the storage that owns its key. Calls that change a table advance its
``clock`` and ``version`` once (``_tick``); ``assign`` and ``write_rows``, which
set no score, only the version (``_advance``; see ``Table.changes``).
"""

from __future__ import annotations

import abc
import functools
import inspect

import jax
import jax.numpy as jnp

from jaxres._core import call_args
from jaxres._core.modes import Upsert


class RowProtocol(abc.ABC):
  """The row operations every kind of table implements (called inside the jitted functions below)."""

  def _cleared(self) -> RowProtocol:
    """An empty table like this one, same capacity; the clock and eviction count go on."""
    return self._with_capacity(self.capacity)._carry(self)

  @abc.abstractmethod
  def _with_capacity(self, capacity: int) -> RowProtocol:
    """An empty table with this one's specs, default and policy and a new capacity."""

  @abc.abstractmethod
  def _carry(self, other: RowProtocol) -> RowProtocol:
    """This table with ``other``'s clock and eviction count (an empty table taking over)."""

  @abc.abstractmethod
  def _tick(self) -> RowProtocol:
    """This table with its clock and version advanced by one call."""

  @abc.abstractmethod
  def _advance(self) -> RowProtocol:
    """This table with its version advanced by one call (a call that sets no score)."""

  @abc.abstractmethod
  def _lookup_rows(self, words, defaults) -> tuple[list, jax.Array]:
    """``(leaves, found)``: stored values of present keys, ``defaults`` (leaves) elsewhere."""

  @abc.abstractmethod
  def _score_rows(self, words) -> jax.Array:
    """``uint32[N]``: the scores of present keys, 0 elsewhere."""

  @abc.abstractmethod
  def _upsert_rows(
    self, words, leaves, active, mode: Upsert, given_scores=None, weights=None
  ) -> tuple[RowProtocol, list, tuple | None]:
    """insert or find_or_insert (``mode``) on flat rows.

    Returns ``(table, out, evicted)``: ``out`` the found-or-inserted values
    (``Upsert.FIND_OR_INSERT``), ``evicted`` the rows' ``(words, leaves, scores, valid)``
    (``None`` without an eviction policy). ``given_scores``: scores for the keys
    (``CustomScore``, or entries moved with their scores). ``weights``:
    ``int32[N]``, how many occurrences each row stands for (a counting policy
    adds them up; ``None``: one each).
    """

  @abc.abstractmethod
  def _find_rows(self, words) -> jax.Array:
    """``int32[N]``: the value row of each present key, ``-1`` elsewhere."""

  @abc.abstractmethod
  def _claim_rows(self, words, active, given_scores=None, weights=None) -> tuple:
    """find_or_insert_rows on flat rows: ``(table, index, found, inserted, evicted)``.

    ``evicted`` as for :meth:`_upsert_rows` (a refused key's values: the default).
    """

  @abc.abstractmethod
  def _read_rows(self, index, defaults) -> list:
    """The value leaves of rows ``index``, ``defaults`` where ``index < 0``."""

  @abc.abstractmethod
  def _write_rows(self, index, leaves, active) -> RowProtocol:
    """Writes rows ``index`` where ``active`` and ``index >= 0``; of equal rows the last wins."""

  @abc.abstractmethod
  def _assign_rows(self, words, leaves, active) -> RowProtocol:
    """assign on flat rows: present keys take their last active row's values."""

  @abc.abstractmethod
  def _apply_rows(self, words, leaves, active, fn, given_scores=None, weights=None) -> RowProtocol:
    """insert_or_apply on flat rows (``given`` and ``weights`` as for :meth:`_upsert_rows`)."""

  @abc.abstractmethod
  def _rescore_rows(self, words, active, given_scores=None, weights=None) -> RowProtocol:
    """assign_scores on flat rows (``given`` and ``weights`` as for :meth:`_upsert_rows`)."""

  @abc.abstractmethod
  def _remove_rows(self, words, active) -> RowProtocol:
    """remove on flat rows."""

  @abc.abstractmethod
  def _erase_rows(self, fn) -> RowProtocol:
    """erase_if over every slot."""

  @abc.abstractmethod
  def _slot_rows(self, offset, size: int) -> tuple:
    """``(words, leaves, scores, valid)`` of ``size`` slots from ``offset``."""

  @abc.abstractmethod
  def _compact(self) -> tuple[jax.Array, list, jax.Array, jax.Array]:
    """``(words[capacity, W], leaves, scores, valid)`` with the live entries first."""


class _Mutation:
  """A jitted operation that returns a new table, compiled twice: as is, and donating the table.

  Donated, XLA writes the result into the table's own buffers: an eager call
  then costs O(batch) instead of a copy of every array. The stateful tables
  donate the state they own; ``donate=True`` lets any caller do the same.
  """

  def __init__(self, fn, static_argnames=()):
    functools.update_wrapper(self, fn)
    self._plain = jax.jit(fn, static_argnames=static_argnames)
    self._donating = jax.jit(fn, static_argnames=static_argnames, donate_argnums=0)
    # jit keys its cache by the keywords as given: a static argument left to its default and the
    # same value passed would trace and lower one program twice. Every call passes them all.
    parameters = inspect.signature(fn).parameters
    self._static_defaults = {
      name: parameters[name].default
      for name in static_argnames
      if parameters[name].default is not inspect.Parameter.empty
    }

  def __call__(self, table, *args, donate: bool = False, **kwargs):
    return (self._donating if donate else self._plain)(table, *args, **(self._static_defaults | kwargs))

  def _cache_size(self) -> int:
    """Programs compiled so far, both forms together (as ``jax.jit``'s own ``_cache_size``)."""
    return self._plain._cache_size() + self._donating._cache_size()


def mutation(static_argnames=()):
  return lambda fn: _Mutation(fn, static_argnames)


@jax.jit
def lookup(table: RowProtocol, words, defaults):
  return table._lookup_rows(words, defaults)


@jax.jit
def contains(table: RowProtocol, words):
  return table._lookup_rows(words, [])[1]


@jax.jit
def scores(table: RowProtocol, words):
  return table._score_rows(words)


@jax.jit
def compact(table: RowProtocol):
  return table._compact()


@jax.jit
def exported(table: RowProtocol):
  """:meth:`Table.export`'s key words (the zero key's past the live entries), values and mask."""
  words, leaves, _, valid = table._compact()
  return jnp.where(valid[:, None], words, table.key_spec.encode_zero()), leaves, valid


@mutation()
def remove(table: RowProtocol, words, active):
  return table._tick()._remove_rows(words, active)


@mutation(static_argnames=("mode", "tick", "report"))
def upsert(
  table: RowProtocol,
  words,
  leaves,
  active,
  given_scores,
  *,
  mode: Upsert,
  tick: bool = True,
  report: bool = False,
):
  """insert or find_or_insert (``mode``): ``(table, out, evicted)``.

  ``report``: return the evicted entries (else ``None``, and they are not computed).
  """
  table, out, evicted = (table._tick() if tick else table)._upsert_rows(
    words, leaves, active, mode, given_scores
  )
  return table, out, evicted if report else None


@mutation()
def assign(table: RowProtocol, words, leaves, active):
  return table._advance()._assign_rows(words, leaves, active)


@mutation()
def rescore(table: RowProtocol, words, active, given_scores):
  return table._tick()._rescore_rows(words, active, given_scores)


@mutation(static_argnames=("fn",))
def apply(table: RowProtocol, words, leaves, active, given_scores, *, fn):
  return table._tick()._apply_rows(words, leaves, active, fn, given_scores)


@functools.partial(jax.jit, static_argnames=("fn",))
def erase(table: RowProtocol, *, fn):
  return table._tick()._erase_rows(fn)


@jax.jit
def find_rows(table: RowProtocol, words):
  return table._find_rows(words)


@mutation(static_argnames=("report",))
def claim(table: RowProtocol, words, active, given_scores, *, report: bool):
  table, index, found, inserted, evicted = table._tick()._claim_rows(words, active, given_scores)
  return table, index, found, inserted, evicted if report else None


@jax.jit
def read_rows(table: RowProtocol, index, defaults):
  return table._read_rows(index, defaults)


@mutation()
def write_rows(table: RowProtocol, index, leaves, active):
  return table._advance()._write_rows(index, leaves, active)


@functools.partial(jax.jit, static_argnames=("size",))
def slots(table: RowProtocol, offset, *, size: int):
  return table._slot_rows(offset, size)


@functools.partial(jax.jit, static_argnames=("size", "fn"))
def slots_if(table: RowProtocol, offset, *, size: int, fn):
  """The slots of :func:`slots` whose entries satisfy ``fn(keys, values, scores)``, moved first.

  Returns ``(words, leaves, scores, match)``; the matching rows keep their
  slot order, then come the others (``match`` false). O(size).
  """
  words, leaves, scores, valid = table._slot_rows(offset, size)
  keys, values = table.key_spec.decode(words), table.value_spec.from_storage(leaves)
  match = call_args.predicate_mask(fn(keys, values, scores), size) & valid
  count = jnp.sum(match, dtype=jnp.int32)
  before = jnp.cumsum(match, dtype=jnp.int32) - match  # matches before each row
  position = jnp.where(match, before, count + jnp.arange(size, dtype=jnp.int32) - before)
  inverse = jnp.zeros(size, jnp.int32).at[position].set(jnp.arange(size, dtype=jnp.int32))
  gather = lambda x: x[inverse]
  return gather(words), [gather(x) for x in leaves], gather(scores), gather(match)
