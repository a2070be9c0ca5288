"""What arrays hold, and the largest capacity a byte budget buys.

``nbytes`` counts the bytes of a pytree's arrays (or of its abstract
``jax.ShapeDtypeStruct`` leaves: nothing is allocated); ``largest_capacity``
searches the capacity whose structure (built abstractly, with
``jax.eval_shape``) holds at most a budget. Tables, embeddings and collections
report their ``memory()`` and answer ``capacity_for`` with these two.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import numpy as np

from jaxres._errors import check_int

MAX_CAPACITY = 1 << 30


def nbytes(tree) -> int:
  """The bytes of ``tree``'s array leaves (arrays or ``jax.ShapeDtypeStruct``; ``None`` holds none).

  A sharded array counts once, whole (its global shape), as ``jax.Array.nbytes`` does.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> nbytes({"a": jnp.zeros((4, 2)), "b": jax.ShapeDtypeStruct((3,), jnp.int8), "c": None})
    35
  """
  return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def largest_capacity(bytes_at: Callable[[int], int], budget, name: str = "nbytes", smallest: int = 1) -> int:
  """The largest capacity ``c`` (``smallest`` to ``2**30``) with ``bytes_at(c) <= budget``.

  ``bytes_at`` must not decrease with the capacity (a structure grows with its
  rows). It is called a few times (a guess from the bytes at two capacities,
  then a galloping and a binary search around it), never once per capacity.

  Raises:
    TypeError: ``budget`` is not an integer.
    ValueError: ``budget`` is negative, or holds not even the ``smallest`` capacity.

  Examples:
    >>> largest_capacity(lambda c: 100 + 24 * c + 64 * (c // 1000), 1_000_000)
    41553
  """
  budget = check_int(budget, name, low=0)
  least = bytes_at(smallest)
  if least > budget:
    raise ValueError(f"{name}: {budget} bytes hold no row: a capacity of {smallest} takes {least} bytes.")
  probe = smallest + (1 << 20)
  per_row = max((bytes_at(probe) - least) / (probe - smallest), 1e-9)
  guess = int(min(max(smallest + (budget - least) / per_row, smallest), MAX_CAPACITY))

  def fits(c: int) -> bool:
    return bytes_at(c) <= budget

  step = max(1, guess >> 12)
  if fits(guess):  # gallop up to a capacity that does not fit
    low, high = guess, guess + step
    while high <= MAX_CAPACITY and fits(high):
      low, step = high, step * 2
      high = low + step
    high = min(high, MAX_CAPACITY + 1)
  else:  # gallop down to one that does
    low, high = max(smallest, guess - step), guess
    while not fits(low):
      high, step = low, step * 2
      low = max(smallest, low - step)
  while high - low > 1:  # low fits, high does not (or lies past the largest capacity)
    middle = (low + high) // 2
    low, high = (middle, high) if fits(middle) else (low, middle)
  return low
