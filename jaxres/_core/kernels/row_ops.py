"""Row-wise helpers over lists of arrays that share a leading (row) axis."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxres._core.kernels import claims, native


def take_rows(leaves, index):
  """Rows ``index`` of every leaf (clipped); on CPU a kernel (``jaxres_take_rows``) copies them."""
  index = jnp.asarray(index, jnp.int32)
  out = []
  for x in leaves:
    results = (jax.ShapeDtypeStruct(index.shape + x.shape[1:], x.dtype),)
    reference = lambda x, index: (jnp.take(x, index, axis=0, mode="clip"),)
    out.append(native.on_cpu("jaxres_take_rows", reference, results, x, index)[0])
  return out


def read_rows(leaves, index) -> tuple[list, list]:
  """``(leaves, rows)``: rows ``index`` of every leaf (clipped), and the leaves to write into next.

  Writes into the returned leaves come after the read, so XLA can make them in
  place; a read of arrays that are then written in place, left unordered,
  makes XLA copy them whole. On CPU a kernel reads the rows and hands each
  array back as its own output (unchanged, aliased); elsewhere this is
  :func:`take_rows`.

  Examples:
    >>> import jax.numpy as jnp
    >>> leaves, rows = read_rows([jnp.arange(6.0).reshape(3, 2)], jnp.array([2, 0]))
    >>> rows[0].tolist(), leaves[0].shape
    ([[4.0, 5.0], [0.0, 1.0]], (3, 2))
  """
  index = jnp.asarray(index, jnp.int32)
  out, rows = [], []
  for x in leaves:
    results = (
      jax.ShapeDtypeStruct(x.shape, x.dtype),
      jax.ShapeDtypeStruct(index.shape + x.shape[1:], x.dtype),
    )
    reference = lambda x, index: (x, jnp.take(x, index, axis=0, mode="clip"))
    leaf, taken = native.on_cpu("jaxres_read_rows", reference, results, x, index, aliases={0: 0})
    out.append(leaf)
    rows.append(taken)
  return out, rows


def write_rows(leaves, index, rows, mask) -> list:
  """``leaves`` with ``rows`` written at ``index`` where ``mask``, as if one row at a time in order.

  Of the rows naming one index the last wins; indices outside a leaf are
  dropped. On CPU a kernel writes the rows of every leaf in order, in one pass (in place); elsewhere the
  last row of each index is found first (:func:`claims.first_per_slot`), so
  that one scatter with distinct indices does the writes.

  Examples:
    >>> import jax.numpy as jnp
    >>> rows, mask = [jnp.array([1.0, 2.0, 3.0])], jnp.array([True, True, True])
    >>> leaves = write_rows([jnp.zeros(3)], jnp.array([2, 0, 2]), rows, mask)
    >>> leaves[0].tolist()
    [2.0, 0.0, 3.0]
  """
  index = jnp.asarray(index, jnp.int32)
  leaves, rows = list(leaves), list(rows)
  if not leaves:
    return []
  results = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves)
  aliases = {2 + j: j for j in range(len(leaves))}
  return list(
    native.on_cpu(
      "jaxres_write_rows", _write_rows_reference, results, index, mask, *leaves, *rows, aliases=aliases
    )
  )


def _write_rows_reference(index, mask, *leaves_and_rows):
  """The leaves (the first half of ``leaves_and_rows``) with their rows (the second half) written."""
  half = len(leaves_and_rows) // 2
  last = claims.first_per_slot(index, mask, last=True) & (index >= 0)  # negative indices: dropped
  return tuple(
    x.at[jnp.where(last, index, x.shape[0])].set(r, mode="drop")
    for x, r in zip(leaves_and_rows[:half], leaves_and_rows[half:], strict=True)
  )


def select_rows(mask, on_true, on_false):
  """Per row, the leaves of ``on_true`` where ``mask`` else those of ``on_false``."""

  def pick(a, b):
    return jnp.where(mask.reshape(mask.shape + (1,) * (a.ndim - 1)), a, b)

  return [pick(a, b) for a, b in zip(on_true, on_false)]
