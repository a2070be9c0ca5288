"""Host-side conversion between the stateful tables' keys/values and the core's.

The functional core stores integers (and word rows); the stateful tables also
take strings. A codec turns user keys or values into what the core accepts,
and the core's results back into what the user gave.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxres._core import codec, strings


def _is_string_dtype(dtype) -> bool:
  return dtype is str or dtype is bytes or (isinstance(dtype, str) and dtype in ("str", "string"))


def _is_string_rows(x, width: int) -> bool:
  return isinstance(x, jax.Array) and x.dtype == jnp.uint32 and x.shape[-1:] == (width,)


class KeyCodec:
  """Keys of a stateful table: an integer dtype, or ``str``."""

  def __init__(self, key_dtype, max_length: int):
    self.is_string = _is_string_dtype(key_dtype)
    if self.is_string:
      self.max_length = strings.check_max_length(max_length, "max_key_length")
      self.width = strings.string_width(self.max_length)
      self.spec = jax.ShapeDtypeStruct((self.width,), jnp.uint32)
      self.name = "str"
    else:
      self.spec = codec.KeySpec.parse(key_dtype).dtype
      self.name = str(self.spec)

  def encode(self, keys):
    """User keys -> core keys (strings become word rows on the host)."""
    if self.is_string and not _is_string_rows(keys, self.width):
      return jnp.asarray(strings.encode(keys, self.max_length, name="keys"))
    return keys

  def decode(self, keys):
    return strings.decode(keys) if self.is_string else keys

  def order(self, keys: np.ndarray) -> np.ndarray:
    """The permutation that sorts decoded host keys."""
    if keys.ndim > 1:  # composite keys: lexicographic over the elements
      return np.lexsort(keys.reshape(keys.shape[0], -1).T[::-1])
    return np.argsort(keys, kind="stable")


class ValueCodec:
  """Values of a stateful table: a dtype (or pytree of dtypes), or ``str``.

  The per-entry shape is the shape of ``default_value``, as in TensorFlow; a
  pytree default gives pytree values.
  """

  def __init__(self, value_dtype, default_value, max_length: int):
    self.is_string = _is_string_dtype(value_dtype)
    if self.is_string:
      if not isinstance(default_value, (str, bytes)):
        raise TypeError(f"default_value: expected a str for string values, got {default_value!r}.")
      self.max_length = strings.check_max_length(max_length, "max_value_length")
      self.width = strings.string_width(self.max_length)
      self.spec = jax.ShapeDtypeStruct((self.width,), jnp.uint32)
      self.default = strings.encode(default_value, self.max_length, name="default_value")
      self.name = "str"
      return
    leaves, treedef = jax.tree.flatten(default_value)
    if not leaves:
      raise TypeError(f"default_value: expected a value or pytree of values, got {default_value!r}.")
    try:
      dtypes = [np.dtype(value_dtype)] * len(leaves)
    except TypeError:
      dtype_leaves, dtype_tree = jax.tree.flatten(
        value_dtype, is_leaf=lambda x: not isinstance(x, (dict, list, tuple))
      )
      if dtype_tree != treedef:
        raise TypeError(
          f"value_dtype: expected a dtype or a pytree like default_value, got {value_dtype!r}."
        ) from None
      dtypes = [np.dtype(d) for d in dtype_leaves]
    self.spec = jax.tree.unflatten(
      treedef, [jax.ShapeDtypeStruct(np.shape(x), d) for x, d in zip(leaves, dtypes)]
    )
    self.default = default_value
    self.name = (
      str(dtypes[0]) if len(dtypes) == 1 else str(jax.tree.unflatten(treedef, [str(d) for d in dtypes]))
    )

  def encode(self, values, name: str = "values"):
    if self.is_string and not _is_string_rows(values, self.width):
      return jnp.asarray(strings.encode(values, self.max_length, name=name))
    return values

  def decode(self, values):
    return strings.decode(values) if self.is_string and not codec.is_traced(values) else values
