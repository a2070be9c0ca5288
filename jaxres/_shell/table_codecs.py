"""Host-side conversion between the stateful tables' keys/values and the core's.

The functional core stores integers (and word rows); the stateful tables also
take strings. A codec turns user keys or values into what the core accepts,
and the core's results back into what the user gave.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxres._core.encoding import key_specs, strings


def is_string_dtype(dtype) -> bool:
  return dtype is str or dtype is bytes or (isinstance(dtype, str) and dtype in ("str", "string"))


def _is_string_rows(x, width: int) -> bool:
  """Whether ``x`` already holds encoded strings (``uint32[..., width]`` rows)."""
  return isinstance(x, (jax.Array, np.ndarray)) and x.dtype == np.uint32 and x.shape[-1:] == (width,)


class _Codec:
  """Codecs compare by configuration: NNX keys compiled functions by a module's
  static attributes, so tables configured alike share them."""

  config: tuple

  def __eq__(self, other) -> bool:
    return type(other) is type(self) and other.config == self.config

  def __hash__(self) -> int:
    return hash(self.config)


def _fingerprint(tree) -> tuple:
  leaves, treedef = jax.tree.flatten(tree)
  return (str(treedef), *((np.asarray(x).dtype.str, np.shape(x), np.asarray(x).tobytes()) for x in leaves))


class _StringRows:
  """Strings stored as uint32 word rows of a fixed width."""

  is_string: bool
  max_length: int
  width: int

  def fit(self, rows: np.ndarray, name: str) -> np.ndarray:
    """Checkpointed rows, each checked to encode a UTF-8 string, re-encoded if they were written for
    another maximum length.

    Raises:
      ValueError: naming ``name``: a row encodes no UTF-8 string, or a string
        is longer than this table's maximum length.
    """
    if not self.is_string or rows.dtype != np.uint32 or rows.ndim != 2:
      return rows
    text = strings.decode(rows, name)
    return rows if rows.shape[1] == self.width else strings.encode(text, self.max_length, name=name)

  def _rows(self, x, name: str):
    """Strings (on the host), or encoded rows (``uint32[..., width]``, also inside ``jit``), as rows
    of this codec's width. Rows of a shorter maximum length are widened (zero words before their
    length word), exactly as encoding their strings again would.

    Raises:
      TypeError: an array of numbers other than ``uint32`` rows.
      ValueError: rows wider than this codec's (their strings could be too long), or concrete rows
        whose length word says a string longer than the maximum.
    """
    if _is_string_rows(x, self.width):
      return self._checked_lengths(x, name)
    if isinstance(x, (jax.Array, np.ndarray)) and x.dtype.kind not in "USO":
      rows = (
        f"string {name} inside jit are uint32 rows of jr.keys.encode_strings(..., max_length) with "
        f"max_length <= {self.max_length} (rows of width <= {self.width}); got {x.dtype}{list(x.shape)}"
      )
      if x.dtype != np.uint32:
        raise TypeError(f"{name}: expected strings on the host; {rows}.")
      if x.ndim < 1 or x.shape[-1] > self.width:
        raise ValueError(
          f"{name}: {rows}. A served signature's string input takes this max_length: "
          f"jr.saved_model.Signature(..., max_length={self.max_length})."
        )
      lib = jnp if isinstance(x, jax.Array) else np
      pad = lib.zeros((*x.shape[:-1], self.width - x.shape[-1]), np.uint32)
      return self._checked_lengths(lib.concatenate([x[..., :-1], pad, x[..., -1:]], axis=-1), name)
    return strings.encode(x, self.max_length, name=name)

  def _checked_lengths(self, rows, name: str):
    """``rows``, their length words checked when they are concrete (inside ``jit`` nothing can raise)."""
    if key_specs.is_traced(rows) or not rows.size:
      return rows
    longest = int(np.max(np.asarray(rows[..., -1])))
    if longest > self.max_length:
      raise ValueError(
        f"{name}: a row's length word says {longest} bytes, over this table's max length of "
        f"{self.max_length}: not rows of jr.keys.encode_strings(..., max_length={self.max_length})."
      )
    return rows


class KeyCodec(_Codec, _StringRows):
  """Keys of a stateful table: an integer dtype or spec (composite keys), or ``str``."""

  def __init__(self, key_dtype, max_length: int, length_name: str = "max_key_length"):
    self.is_string = is_string_dtype(key_dtype)
    if self.is_string:
      self.max_length = strings.check_max_length(max_length, length_name)
      self.width = strings.string_width(self.max_length)
      self.spec = jax.ShapeDtypeStruct((self.width,), jnp.uint32)
      self.name = "str"
    else:
      spec = key_specs.KeySpec.parse(key_dtype)  # composite keys keep their shape
      self.spec = jax.ShapeDtypeStruct(spec.shape, spec.dtype) if spec.shape else spec.dtype
      self.name = str(spec)
    self.config = (self.name, self.max_length if self.is_string else None)

  def encode(self, keys, name: str = "keys"):
    """User keys -> core keys (strings become word rows on the host); errors name ``name``."""
    return self._rows(keys, name) if self.is_string else keys

  def decode(self, keys):
    return strings.decode(keys) if self.is_string else keys

  def order(self, keys: np.ndarray) -> np.ndarray:
    """The permutation that sorts decoded host keys."""
    if keys.ndim > 1:  # composite keys: lexicographic over the elements
      return np.lexsort(keys.reshape(keys.shape[0], math.prod(keys.shape[1:])).T[::-1])
    return np.argsort(keys, kind="stable")


class ValueCodec(_Codec, _StringRows):
  """Values of a stateful table: a dtype (or pytree of dtypes), or ``str``.

  The per-entry shape is the shape of ``default_value``, as in TensorFlow; a
  pytree default gives pytree values.
  """

  def __init__(self, value_dtype, default_value, max_length: int):
    self.is_string = is_string_dtype(value_dtype)
    if self.is_string:
      if not isinstance(default_value, (str, bytes)):
        raise TypeError(f"default_value: expected a str for string values, got {default_value!r}.")
      self.max_length = strings.check_max_length(max_length, "max_value_length")
      self.width = strings.string_width(self.max_length)
      self.spec = jax.ShapeDtypeStruct((self.width,), jnp.uint32)
      self.default = strings.encode(default_value, self.max_length, name="default_value")
      self.name = "str"
      self.config = (self.name, self.max_length, _fingerprint(self.default))
      return
    if value_dtype is None:  # np.dtype(None) would be float64
      raise TypeError("value_dtype: expected a dtype, str or a pytree of dtypes, got None.")
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
    self.config = (self.name, str(self.spec), _fingerprint(default_value))

  def encode(self, values, name: str = "values"):
    return self._rows(values, name) if self.is_string else values

  def decode(self, values):
    return strings.decode(values) if self.is_string and not key_specs.is_traced(values) else values
