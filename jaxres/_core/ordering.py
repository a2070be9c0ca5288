"""Reads of an array ordered before the writes that update it in place.

XLA updates a donated array in place only where every read of its old
contents is known to come before the first write. A read whose result the
writes do not depend on (a key gathered for the caller, a row looked up for
later) may be scheduled after them, and XLA then keeps a copy of the whole
array for it: a capacity-sized copy per call. :func:`after` makes the writes'
mask depend on such reads. The optimization barrier that says the same is
removed by XLA's CPU and GPU pipelines before buffers are assigned, so the
dependency is made of data: a test that is always true, which XLA cannot fold.

Examples:
  >>> import jax.numpy as jnp
  >>> after(jnp.array([True, False]), jnp.array([7, 0], jnp.uint32)).tolist()
  [True, False]
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax


def after(mask: jax.Array, *reads: jax.Array) -> jax.Array:
  """``mask``, unchanged, computed from ``reads`` (arrays whose leading axis is ``mask``'s)."""
  return functools.reduce(jnp.logical_and, [_read(r) for r in reads], mask)


def _read(r: jax.Array) -> jax.Array:
  """bool[N]: True for each row of ``r``, from its bits."""
  if r.dtype == jnp.bool_:
    r = r.astype(jnp.uint8)
  bits = lax.bitcast_convert_type(r, jnp.dtype(f"uint{8 * r.dtype.itemsize}"))
  return jnp.all((bits | 1) != 0, axis=tuple(range(1, r.ndim)))
