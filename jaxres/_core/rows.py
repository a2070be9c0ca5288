"""Row-wise helpers over lists of arrays that share a leading (row) axis."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxres._core import native


def take_rows(leaves, index):
  """Rows ``index`` of every leaf (clipped)."""
  return [jnp.take(x, index, axis=0, mode="clip") for x in leaves]


def read_rows(leaves, index) -> tuple[list, list]:
  """``(leaves, rows)``: rows ``index`` of every leaf (clipped), and the leaves to write into next.

  Writes into the returned leaves come after the read, so XLA can make them in
  place; a read of arrays that are then written in place, left unordered,
  makes XLA copy them whole. On CPU a kernel reads the rows and hands each
  array back as its own output (unchanged, aliased); elsewhere this is
  :func:`take_rows`.

  Example:
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


def select_rows(mask, on_true, on_false):
  """Per row, the leaves of ``on_true`` where ``mask`` else those of ``on_false``."""

  def pick(a, b):
    return jnp.where(mask.reshape(mask.shape + (1,) * (a.ndim - 1)), a, b)

  return [pick(a, b) for a, b in zip(on_true, on_false)]
