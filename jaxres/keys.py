"""Helpers for keys that JAX cannot hold directly: 64-bit integers and strings.

With ``jax_enable_x64`` off, JAX has no 64-bit integer arrays, so inside
``jit`` a 64-bit key travels as a *word pair*: ``uint32[..., 2]`` holding the
high and the low 32 bits of its two's complement form. Tables accept word
pairs wherever they accept 64-bit keys, and ``export()`` under ``jit`` returns
them. On the host, NumPy ``int64``/``uint64`` arrays are accepted directly.

Strings travel inside ``jit`` as fixed-width ``uint32`` rows
(:func:`encode_strings`); string tables encode and decode on the host for you.

Examples:
  >>> import numpy as np, jaxres as jr
  >>> ids = np.array([2**40 + 5, -1], dtype=np.int64)
  >>> pairs = jr.keys.split64(ids)
  >>> pairs.dtype, pairs.shape
  (dtype('uint32'), (2, 2))
  >>> jr.keys.join64(pairs, np.int64).tolist()
  [1099511627781, -1]
"""

from __future__ import annotations

import jax
import numpy as np

from jaxres._core.encoding import key_specs, strings

__all__ = ["decode_strings", "encode_strings", "hash", "join64", "split64", "to_int32"]


def split64(x):
  """64-bit integers -> ``uint32[..., 2]`` word pairs (high word first).

  Args:
    x: a NumPy ``int64``/``uint64`` array (or Python ints, read as int64), or a
      JAX 64-bit array when ``jax_enable_x64`` is on (traceable).

  Returns:
    A ``uint32`` array of shape ``x.shape + (2,)``: a JAX array.

  Raises:
    TypeError: ``x`` is not a 64-bit integer array.

  Examples:
    >>> import numpy as np, jaxres as jr
    >>> jr.keys.split64(np.array([2**32 + 7])).tolist()
    [[1, 7]]
  """
  if isinstance(x, jax.Array):
    if x.dtype not in (np.int64, np.uint64):
      raise TypeError(f"x: expected an int64 or uint64 array, got {x.dtype}.")
    return key_specs.split64_jax(x)
  arr = np.asarray(x)
  if arr.dtype.kind in "iu" and arr.dtype.itemsize < 8:
    arr = arr.astype(np.int64)
  if arr.dtype not in (np.int64, np.uint64):
    raise TypeError(f"x: expected an int64 or uint64 array, got {arr.dtype}.")
  return jax.device_put(np.ascontiguousarray(key_specs.split64_host(arr)))


def join64(pairs, dtype=np.int64):
  """``uint32[..., 2]`` word pairs -> 64-bit integers of ``dtype``.

  Args:
    pairs: ``uint32[..., 2]`` word pairs (high word first).
    dtype: ``int64`` or ``uint64``.

  Returns:
    A JAX array when x64 is on, a NumPy array for concrete pairs when it is off.

  Raises:
    TypeError: traced pairs with x64 off (there is no 64-bit JAX dtype to
      return: keep the pairs, or take ids below ``2**31`` with :func:`to_int32`).

  Examples:
    >>> import numpy as np, jaxres as jr
    >>> jr.keys.join64(np.array([[1, 7]], np.uint32)).tolist()
    [4294967303]
  """
  dtype = np.dtype(dtype)
  if dtype not in (np.int64, np.uint64):
    raise TypeError(f"dtype: expected int64 or uint64, got {dtype}.")
  if getattr(pairs, "dtype", np.uint32) != np.uint32 or np.shape(pairs)[-1:] != (2,):
    raise TypeError(
      f"pairs: expected uint32[..., 2], got {getattr(pairs, 'dtype', type(pairs))}{list(np.shape(pairs))}."
    )
  if key_specs.x64_enabled():
    return key_specs.join64_jax(jax.numpy.asarray(pairs), dtype)
  if key_specs.is_traced(pairs):
    raise TypeError(
      "pairs: cannot join traced word pairs with jax_enable_x64 off (JAX has no 64-bit integers then); "
      "keep them as pairs, or take ids below 2**31 (vocabulary ids, row numbers) as int32 with "
      "jr.keys.to_int32."
    )
  return key_specs.join64_host(np.asarray(pairs), dtype)


def to_int32(ids):
  """64-bit ids that lie in ``[0, 2**31)`` (vocabulary ids, row numbers) as ``int32``: what
  ``nnx.Embed`` and array indexing take. Jittable.

  Args:
    ids: a NumPy ``int64``/``uint64`` array, a JAX 64-bit array (x64 on), or
      ``uint32[..., 2]`` word pairs: what a vocabulary's ``find`` gives inside
      ``jit`` with x64 off.

  Returns:
    ``int32`` ids of the same batch shape (a JAX array). Inside ``jit`` an id
    outside ``[0, 2**31)`` becomes ``-1`` (nothing can raise there).

  Raises:
    ValueError: (eagerly) an id outside ``[0, 2**31)``.
    TypeError: ``ids`` are none of the above.

  Examples:
    >>> import numpy as np, jax, jaxres as jr
    >>> jax.jit(jr.keys.to_int32)(jr.keys.split64(np.array([3, 2**31 - 1, 2**40]))).tolist()
    [3, 2147483647, -1]
  """
  if getattr(ids, "dtype", None) == np.uint32 and np.shape(ids)[-1:] == (2,):
    pairs = ids if isinstance(ids, jax.Array) else jax.device_put(np.asarray(ids))
  elif isinstance(ids, jax.Array) and ids.dtype in (np.int64, np.uint64):
    pairs = key_specs.split64_jax(ids)
  elif isinstance(ids, (np.ndarray, np.generic)) and np.asarray(ids).dtype in (np.int64, np.uint64):
    pairs = jax.device_put(np.ascontiguousarray(key_specs.split64_host(np.asarray(ids))))
  else:
    got = f"{getattr(ids, 'dtype', type(ids).__name__)}{list(np.shape(ids))}"
    raise TypeError(f"ids: expected int64 or uint64 ids, or uint32[..., 2] word pairs, got {got}.")
  inside = (pairs[..., 0] == 0) & (pairs[..., 1] < jax.numpy.uint32(2**31))
  if not key_specs.is_traced(pairs) and not bool(inside.all()):
    bad = key_specs.join64_host(np.asarray(pairs), np.int64)[~np.asarray(inside)][0]
    raise ValueError(f"ids: {bad} is outside [0, 2**31), which int32 ids cover.")
  return jax.numpy.where(inside, pairs[..., 1].astype(jax.numpy.int32), -1)


def hash(keys, key, *, seed: int = 0):
  """A fixed, well-mixed ``uint32`` hash of each key: the same on every backend and in every process.

  Args:
    keys: keys as a table of ``key`` takes them (``key_dtype[*batch, *key_shape]``;
      64-bit keys as NumPy arrays or word pairs, see above). Jittable.
    key: the key dtype, or a ``jax.ShapeDtypeStruct`` for composite keys.
    seed: selects an independent hash function.

  Returns:
    ``uint32[*batch]``.

  Examples:
    >>> import numpy as np, jaxres as jr
    >>> h = jr.keys.hash(np.array([7, 2**40, 7]), np.int64)
    >>> h.dtype, h.shape, bool(h[0] == h[2]), bool(h[0] != h[1])
    (dtype('uint32'), (3,), True, True)
  """
  return key_specs.KeySpec.parse(key).hash(keys, seed=seed)


def encode_strings(values, max_length: int = 64):
  """Strings -> ``uint32[..., width]`` rows that a string table accepts inside ``jit``.

  ``width`` is ``ceil(max_length / 4) + 1``; pass the table's ``max_key_length``
  (or ``max_value_length``) so that the widths match.

  Args:
    values: strings (any array shape, or a list).
    max_length: the longest string in UTF-8 bytes.

  Returns:
    ``uint32[*shape, width]`` rows (a JAX array).

  Raises:
    TypeError: an element is not a string.
    ValueError: an element is longer than ``max_length`` UTF-8 bytes.

  Examples:
    >>> import jaxres as jr
    >>> rows = jr.keys.encode_strings(["héllo", ""], max_length=8)
    >>> rows.shape, jr.keys.decode_strings(rows).tolist()
    ((2, 3), ['héllo', ''])
  """
  strings.check_max_length(max_length, "max_length")
  return jax.device_put(strings.encode(values, max_length, name="values"))


def decode_strings(rows):
  """``uint32[..., width]`` rows -> NumPy array of ``str`` (host only).

  Args:
    rows: rows from :func:`encode_strings` (or a string table's export under ``jit``).

  Returns:
    A NumPy array of ``str`` of the rows' batch shape.

  Raises:
    TypeError: traced rows, or rows of another dtype or shape.
    ValueError: rows that are not encoded strings.

  Examples:
    >>> import jaxres as jr
    >>> jr.keys.decode_strings(jr.keys.encode_strings(["a", "bc"])).tolist()
    ['a', 'bc']
  """
  if key_specs.is_traced(rows):
    raise TypeError(
      "rows: strings can only be decoded outside jit; return the rows and decode them afterwards."
    )
  rows = np.asarray(rows)
  if rows.dtype != np.uint32 or rows.ndim < 1 or rows.shape[-1] < 2:
    raise TypeError(
      f"rows: expected uint32[..., width] rows from encode_strings, got {rows.dtype}{list(rows.shape)}."
    )
  if rows.size and int(rows[..., -1].max()) > 4 * (rows.shape[-1] - 1):
    raise ValueError("rows: a length word exceeds the row's width; these are not encoded strings.")
  try:
    return strings.decode(rows)
  except UnicodeDecodeError as err:
    raise ValueError(f"rows: not encoded strings ({err}).") from None
