"""Checking Python arguments: one rule for every integer argument of jaxres.

A wrong *type* (a float, a bool, ``None``, a string) is a ``TypeError``; a
value out of range is a ``ValueError``. Both name the argument.
"""

from __future__ import annotations

import numpy as np


def check_int(
  value, name: str, *, low: int | None = None, high: int | None = None, expected: str | None = None
) -> int:
  """``value`` as a Python int, checked to lie in ``[low, high]`` (either bound optional).

  NumPy integers are accepted; ``bool`` is not (``True`` is no capacity).
  ``expected`` describes the valid values in the error (default: the bounds).

  Raises:
    TypeError: ``value`` is not an integer.
    ValueError: ``value`` is out of range.

  Example:
    >>> check_int(np.int64(8), "capacity", low=1)
    8
    >>> check_int(4.0, "bucket_size")
    Traceback (most recent call last):
    ...
    TypeError: bucket_size: expected an int, got 4.0.
  """
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name}: expected an int, got {value!r}.")
  value = int(value)
  if (low is not None and value < low) or (high is not None and value > high):
    if expected is not None:
      pass
    elif high is None:
      expected = f"{name} >= {low}"
    elif low is None:
      expected = f"{name} <= {high}"
    else:
      expected = f"{low} <= {name} <= {high}"
    raise ValueError(f"{name}: expected {expected}, got {value}.")
  return value
