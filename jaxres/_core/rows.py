"""Row-wise helpers over lists of arrays that share a leading (row) axis."""

from __future__ import annotations

import jax.numpy as jnp


def take_rows(leaves, index):
  """Rows ``index`` of every leaf (clipped)."""
  return [jnp.take(x, index, axis=0, mode="clip") for x in leaves]


def select_rows(mask, on_true, on_false):
  """Per row, the leaves of ``on_true`` where ``mask`` else those of ``on_false``."""

  def pick(a, b):
    return jnp.where(mask.reshape(mask.shape + (1,) * (a.ndim - 1)), a, b)

  return [pick(a, b) for a, b in zip(on_true, on_false)]
