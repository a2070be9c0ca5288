"""Weights of multi-hot lookups, and the combiners that pool their rows.

A lookup's weights (``float[*batch]``, one per id) say how much each id's row
counts: a weight of 0 marks padding (the id is not looked up, inserted,
counted or trained, and its row reads zeros), and a row comes back scaled by
its weight, so its gradient is scaled alike. A combiner then pools the
weighted rows of each example: ``"sum"`` adds them, ``"mean"`` divides the sum
by the sum of the weights, ``"sqrtn"`` by the root of the sum of the squared
weights; an example with no id (all padding) pools to zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

COMBINERS = ("sum", "mean", "sqrtn", None)


def check_weights(weights, batch: tuple[int, ...], name: str) -> jax.Array | None:
  """``weights`` as a float array of shape ``batch``, or ``None`` for none.

  Raises:
    TypeError: the weights are not floating point.
    ValueError: their shape is not ``batch`` (one weight per id), or (where
      their values are known, outside ``jit``) one is negative or not finite.

  Examples:
    >>> check_weights([1.0, 0.0], (2,), "weights").tolist()
    [1.0, 0.0]
    >>> check_weights([1.0, -1.0], (2,), "weights")
    Traceback (most recent call last):
    ...
    ValueError: weights: expected finite weights >= 0 (0 marks padding), got -1.0.
  """
  if weights is None:
    return None
  if not isinstance(weights, (jax.Array, np.ndarray)):
    weights = np.asarray(weights)
  if not jnp.issubdtype(weights.dtype, jnp.floating):
    raise TypeError(f"{name}: expected floating point weights (0.0 marks padding), got {weights.dtype}.")
  if tuple(weights.shape) != tuple(batch):
    raise ValueError(
      f"{name}: expected shape {tuple(batch)} (one weight per id), got {tuple(weights.shape)}."
    )
  if not isinstance(weights, jax.core.Tracer):
    values = np.asarray(weights)
    bad = values[~(values >= 0) | ~np.isfinite(values)]
    if bad.size:
      raise ValueError(f"{name}: expected finite weights >= 0 (0 marks padding), got {bad.flat[0]}.")
  return jnp.asarray(weights, jnp.float32)


def check_combiner(combiner, name: str):
  """``combiner`` if it is one of :data:`COMBINERS`.

  Raises:
    ValueError: it is not.
  """
  if not (combiner is None or (isinstance(combiner, str) and combiner in COMBINERS)):
    raise ValueError(f"{name}: expected one of 'sum', 'mean', 'sqrtn' or None, got {combiner!r}.")
  return combiner


def pool(rows: jax.Array, weights: jax.Array | None, combiner) -> jax.Array:
  """Pools weighted ``rows`` (``float32[batch, L, features]``) over their second axis.

  ``weights`` (``float32[batch, L]`` or ``None`` for ones) are those the rows
  were scaled by. ``combiner=None`` returns the rows as they are.

  Examples:
    >>> rows = jnp.array([[[2.0], [4.0]], [[0.0], [0.0]]])   # already scaled by the weights
    >>> weights = jnp.array([[1.0, 2.0], [0.0, 0.0]])
    >>> pool(rows, weights, "sum").tolist(), pool(rows, weights, "mean").tolist()
    ([[6.0], [0.0]], [[2.0], [0.0]])
  """
  if combiner is None:
    return rows
  total = jnp.sum(rows, axis=1)
  if combiner == "sum":
    return total
  if weights is None:
    weights = jnp.ones(rows.shape[:2], jnp.float32)
  if combiner == "mean":
    scale = jnp.sum(weights, axis=1)
  else:
    squares = jnp.sum(jnp.square(weights), axis=1)
    scale = jnp.sqrt(jnp.where(squares > 0, squares, 1.0))  # no infinite slope at 0: no NaN gradient
  return total / jnp.where(scale > 0, scale, 1.0)[:, None]
