"""A table call's arguments checked, encoded and padded on the host, and its results decoded.

Keys become flat ``uint32`` word rows, values flat storage leaves, ``valid``
a flat mask and ``scores`` flat ``uint32``. Eager batches are padded to a power
of two (at least 8 rows) with the padding masked: each new batch shape compiles
a new executable, and on XLA:CPU each one holds hundreds of memory mappings,
so padding bounds eager calls to a few shapes. Under ``jit`` the caller's
shapes are kept.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxres._core.encoding import key_specs
from jaxres._core.kernels.row_ops import select_rows
from jaxres._core.policies import Evicted

_MIN_EAGER_ROWS = 8
NO_VALUES = object()  # a call that takes keys only (``None`` is a bad value, not no value)


class Rows(NamedTuple):
  """A call's batch as the jitted row operations take it."""

  words: jax.Array  # uint32[N, W]
  leaves: list  # value leaves [N, *storage_shape]
  active: jax.Array | None  # bool[N]: rows to act on (None: all)
  given_scores: jax.Array | None  # uint32[N]: scores given with the call
  n: int  # rows before padding
  batch: tuple[int, ...]  # the caller's batch shape


def prepare(
  table, keys, values=NO_VALUES, valid=None, scores=None, *, explicit_scores: bool = False, inserts=None
) -> Rows:
  """Checks and encodes a call's arguments (``values=NO_VALUES``: a call that takes keys only).

  ``explicit_scores``: the scores of entries being moved (``import_``): any
  table with an eviction policy takes them, none requires them. ``inserts``:
  whether the call inserts keys (and so takes scores); by default, whether it
  takes values.

  Raises:
    TypeError, ValueError: naming ``keys``, ``values``, ``valid`` or ``scores``.
  """
  words, batch = table.key_spec.encode(keys, "keys")
  words = words.reshape(-1, table.key_spec.num_words)
  n = words.shape[0]
  leaves = [] if values is NO_VALUES else value_leaves(table, values, batch)
  active = check_valid(valid, batch)
  inserts = values is not NO_VALUES if inserts is None else inserts
  given_scores = _given_scores(table, scores, batch, inserts, explicit_scores)
  if key_specs.is_traced(words) or not n:
    return Rows(words, leaves, active, given_scores, n, batch)
  size = max(_MIN_EAGER_ROWS, 1 << (n - 1).bit_length())

  def padded(x):
    return _padded(x, size)

  # Always a mask, so padded and unpadded batches of one size share a compile.
  active = np.arange(size) < n if active is None else padded(active)
  given_scores = None if given_scores is None else padded(given_scores)
  return Rows(padded(words), [padded(x) for x in leaves], active, given_scores, n, batch)


def _padded(x, size: int):
  """``x`` (``[n, ...]``) with zero rows up to ``size``; host arrays stay on the host."""
  extra = size - x.shape[0]
  if not extra:
    return x
  return (jnp if isinstance(x, jax.Array) else np).pad(x, [(0, extra)] + [(0, 0)] * (x.ndim - 1))


def pad_to(x, rows: Rows):
  """``x`` (``[n, ...]``) padded like the call's rows."""
  return _padded(x, rows.words.shape[0])


def value_leaves(table, values, batch, name: str = "values") -> list:
  leaves = table.value_spec.to_storage(values, batch, name)
  return [x.reshape((math.prod(batch), *x.shape[len(batch) :])) for x in leaves]


def output(table, leaves, batch) -> Any:
  """Flat storage leaves (padded or not) -> the value pytree with the caller's batch shape."""
  return table.value_spec.from_storage([unpadded(x, batch) for x in leaves])


def unpadded(x, batch: tuple[int, ...]):
  """A flat result ``[rows, ...]`` of a call of ``batch``: its first ``prod(batch)`` rows in that shape.

  Eager, the slice and the reshape are one program of their own, run only where needed.
  """
  n, shape = math.prod(batch), batch + x.shape[1:]
  if x.shape == shape:
    return x
  if key_specs.is_traced(x):
    return x[:n].reshape(shape)
  return _first_rows(x, n, shape)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _first_rows(x: jax.Array, n: int, shape: tuple[int, ...]) -> jax.Array:
  return x[:n].reshape(shape)


def defaults(table, default, batch) -> list:
  """The default leaves for ``batch`` (the table's, or a per-call one), broadcast to it."""
  if default is None:
    return [jnp.broadcast_to(d, batch + d.shape) for d in table.default]
  return table.value_spec.to_storage(table.value_spec.spread(default), batch, "default", broadcast=True)


def default_rows(table, default, batch) -> list:
  """The default leaves of a read of ``batch``: one row (``[*shape]``) where every key reads the
  same (the table's default, or a per-call one of one row), else one row per key (``[n, *shape]``).

  A single row is never broadcast: a read of many wide rows would otherwise
  fill a batch-sized array with copies of it first.
  """
  if default is None:
    return list(table.default)
  spec = table.value_spec
  try:
    return spec.to_storage(spec.spread(default), (), "default", broadcast=True)
  except ValueError:  # one row per key
    return [x.reshape((math.prod(batch), *x.shape[len(batch) :])) for x in defaults(table, default, batch)]


def pad_rows(x, rows: Rows, row_ndim: int):
  """A leaf of one row (``row_ndim`` dimensions) as is; one of a row per key padded like ``rows``."""
  return x if x.ndim == row_ndim else pad_to(x, rows)


def evicted(table, result, rows: Rows) -> Evicted:
  """The ``Evicted`` of a call, from the row operation's ``(words, leaves, scores, valid)`` or ``None``."""
  n, batch = rows.n, rows.batch
  if result is None:  # a table without eviction: nothing ever leaves
    words = jnp.zeros((n, table.key_spec.num_words), jnp.uint32)
    leaves = [d.reshape((n, *d.shape[len(batch) :])) for d in defaults(table, None, batch)]
    result = (words, leaves, jnp.zeros(n, jnp.uint32), jnp.zeros(n, bool))
  words, leaves, scores, valid = (jax.tree.map(lambda x: x[:n], part) for part in result)
  # Rows where nothing left read as a table without eviction's: zero keys and scores, the default.
  words = jnp.where(valid[:, None], words, table.key_spec.encode_zero())
  leaves = select_rows(
    valid, leaves, [d.reshape((n, *d.shape[len(batch) :])) for d in defaults(table, None, batch)]
  )
  scores = jnp.where(valid, scores, jnp.uint32(0))
  keys = table.key_spec.decode(words.reshape(*batch, table.key_spec.num_words))
  return Evicted(keys, output(table, leaves, batch), scores.reshape(batch), valid.reshape(batch))


def row_index(index) -> tuple[jax.Array, tuple[int, ...], int]:
  """The rows of ``Table.read_rows`` and ``write_rows``: ``(index int32[N], batch, n)``, eager ones padded.

  Raises:
    TypeError: ``index`` is not an integer array.
  """
  on_host = not isinstance(index, jax.Array)
  xp = np if on_host else jnp  # host rows are padded on the host: no program for each count
  index = np.asarray(index) if on_host else index
  if not jnp.issubdtype(index.dtype, jnp.integer):
    raise TypeError(f"index: expected int32 rows (from find_rows or find_or_insert_rows), got {index.dtype}.")
  batch, n = tuple(index.shape), math.prod(index.shape)
  index = index.reshape(-1).astype(xp.int32)
  if key_specs.is_traced(index) or not n:
    return (jax.device_put(index) if on_host else index), batch, n
  size = max(_MIN_EAGER_ROWS, 1 << (n - 1).bit_length())
  padded = xp.pad(index, (0, size - n), constant_values=-1)
  return (jax.device_put(padded) if on_host else padded), batch, n


class _Callable:
  """A function JAX can hold weakly and compare, standing for one that Python cannot weakly reference
  (a builtin such as ``operator.add``): equal for the same function, so calls share a compile."""

  def __init__(self, fn: Callable):
    self.fn = fn

  def __call__(self, *args):
    return self.fn(*args)

  def __eq__(self, other) -> bool:
    return isinstance(other, _Callable) and other.fn == self.fn

  def __hash__(self) -> int:
    return hash(self.fn)


def static_fn(fn, signature: str) -> Callable:
  """``fn``, a static argument of a jitted call (held weakly by JAX's caches).

  Raises:
    TypeError: ``fn`` is not callable.
  """
  if not callable(fn):
    raise TypeError(f"fn: expected a callable {signature}, got {fn!r}.")
  if isinstance(fn, np.ufunc):
    raise TypeError(
      f"fn: np.{fn.__name__} is a NumPy ufunc, which cannot run on the traced arrays a table's jitted "
      f"update gives it; pass jnp.{fn.__name__} (or a function of jax.numpy operations)."
    )
  try:
    weakref.ref(fn)
  except TypeError:
    return _Callable(fn)
  return fn


def predicate_mask(out, slots: int) -> jax.Array:
  """What a predicate ``fn(keys, values, scores)`` over ``slots`` slots returned, checked.

  Raises:
    TypeError: ``out`` is not ``bool[slots]`` (one per slot).
  """
  out = jnp.asarray(out)
  if out.shape != (slots,) or out.dtype != bool:
    raise TypeError(f"fn: must return bool[{slots}] (one per slot), got {out.dtype}{list(out.shape)}.")
  return out


def check_valid(valid, batch) -> jax.Array | None:
  """``valid`` as a flat mask (``None`` stays ``None``).

  Raises:
    TypeError: ``valid`` is not boolean.
    ValueError: its shape is not the batch's.
  """
  if valid is None:
    return None
  active = valid if isinstance(valid, jax.Array) else np.asarray(valid)
  if active.dtype != bool or active.shape != batch:
    error = TypeError if active.dtype != bool else ValueError
    raise error(f"valid: expected bool{list(batch)}, got {active.dtype}{list(active.shape)}.")
  return active.reshape(-1)


def _given_scores(table, scores, batch, names_keys: bool, explicit: bool) -> jax.Array | None:
  """``scores`` checked against the table's policy, as flat ``uint32``."""
  policy = table.eviction
  takes = policy is not None and (policy.takes_scores or explicit)
  if scores is None:
    if takes and names_keys and not explicit:
      raise TypeError(
        "scores: a table with eviction=jr.CustomScore() takes scores=uint32[*batch] with every call "
        "that inserts keys or assigns scores."
      )
    return None
  if not takes:
    wanted = "an eviction policy" if explicit else "eviction=jr.CustomScore()"
    raise ValueError(f"scores: only a table with {wanted} takes scores, this one has eviction={policy}.")
  if isinstance(scores, jax.Array):
    if scores.dtype != jnp.uint32:
      raise TypeError(f"scores: expected uint32 scores, got {scores.dtype}; cast with .astype(jnp.uint32).")
    array = scores
  else:
    array = key_specs.host_integers(scores, np.dtype(np.uint32), "scores")
  if array.shape != batch:
    raise ValueError(f"scores: expected shape {batch} (one per key), got {tuple(array.shape)}.")
  return array.reshape(-1)
