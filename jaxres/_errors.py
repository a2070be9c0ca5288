"""jaxres's errors: one rule, one way to name where they happened.

The rule: a wrong *type* (a float where an int belongs, a bool, ``None``, a
string, an array of the wrong dtype kind) is a ``TypeError``; a value of the
right type that is out of range or inconsistent is a ``ValueError``. Both name
the argument (``capacity: expected ...``) or the object's path in a checkpoint
graph (``model/emb/table: ...``), and leave every object as it was.
"""

from __future__ import annotations

import numpy as np

ROOT = "<root>"  # how the root of a checkpoint graph is named in messages


class KeysLostError(ValueError):
  """Keys an insert inside ``jit`` could not place: a stateful table cannot grow there.

  Raised by the table's next eager call (once: the report is then consumed), with how many
  keys were lost and what to do (``reserve()`` before jitting, or a larger initial capacity).
  A ``ValueError``, as the contract names it.

  Examples:
    >>> import numpy as np, jaxres as jr
    >>> from flax import nnx
    >>> class Model(nnx.Module):
    ...   def __init__(self):
    ...     self.table = jr.MutableHashTable(np.int32, np.float32, 0.0, initial_capacity=1)
    >>> model = Model()
    >>> insert = nnx.jit(lambda m, k: m.table.insert(k, k.astype(np.float32)), donate_argnums=0)
    >>> insert(model, np.arange(3, dtype=np.int32))
    >>> try:
    ...   model.table.find(np.array([0], np.int32))
    ... except jr.KeysLostError as err:
    ...   print(str(err)[:42])
    MutableHashTable: 2 key(s) were lost by an
  """


def check_int(
  value, name: str, *, low: int | None = None, high: int | None = None, expected: str | None = None
) -> int:
  """``value`` as a Python int, checked to lie in ``[low, high]`` (either bound optional).

  NumPy integers are accepted; ``bool`` is not (``True`` is no capacity).
  ``expected`` describes the valid values in the error (default: the bounds).

  Raises:
    TypeError: ``value`` is not an integer.
    ValueError: ``value`` is out of range.

  Examples:
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


def at_path(path: str, err: Exception) -> Exception:
  """``err`` with ``path`` in front of its message, of the same type where one can be built from a
  message (else a ``RuntimeError`` naming the type).

  Examples:
    >>> at_path("model/emb", ValueError("expected 4 rows, got 3."))
    ValueError('model/emb: expected 4 rows, got 3.')
  """
  message = f"{path or ROOT}: {err}"
  try:
    return type(err)(message)
  except Exception:
    return RuntimeError(f"{path or ROOT}: {type(err).__name__}: {err}")
