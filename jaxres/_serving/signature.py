"""A served signature's inputs: as the caller gives them, and as the traced function receives them.

A signature input is a ``jax.ShapeDtypeStruct`` whose dimensions are ints or
names (``("batch", 4)``: any size, the same for every input that names it).
The function receives each input in the form jaxres takes inside ``jit``:
64-bit integers as ``uint32[..., 2]`` word pairs when ``jax_enable_x64`` is
off, strings as the rows of ``jr.keys.encode_strings(values, max_length)``,
other dtypes as JAX holds them.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxres._core.encoding import key_specs, strings

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_KINDS = "biuf"  # bool, integers, floats (and strings, as dtype str)


@dataclasses.dataclass(frozen=True)
class Input:
  """One input of a signature: its name, the dimensions and dtype callers give."""

  name: str
  dims: tuple  # ints and dimension names
  dtype: np.dtype  # np.dtype(str) for strings
  # A 64-bit integer input of an export: traced as word pairs (jax_enable_x64 off when it was saved) or
  # not; None: as this process traces it (a signature being saved, or an export from before the field).
  words: bool | None = None

  @property
  def is_string(self) -> bool:
    return self.dtype.kind == "U"

  @property
  def is_64_bit_integer(self) -> bool:
    return self.dtype.kind in "iu" and self.dtype.itemsize == 8

  @property
  def is_wide(self) -> bool:
    """A 64-bit integer input traced as word pairs: when x64 was off at export (or is off here)."""
    return self.is_64_bit_integer and (not key_specs.x64_enabled() if self.words is None else self.words)

  def check_servable(self, signature: str) -> None:
    """Raises ``ValueError`` naming the input if this process cannot give it in its traced form: a
    64-bit integer exported with ``jax_enable_x64`` on, in a process where it is off (JAX holds no
    int64 array then). The reverse serves: the values are split into word pairs as at export."""
    if self.is_64_bit_integer and self.words is False and not key_specs.x64_enabled():
      raise ValueError(
        f"signature {signature!r}, input {self.name!r}: exported with jax_enable_x64 on, as {self.dtype} "
        "arrays, which this process cannot make with jax_enable_x64 off; serve it with "
        'jax.config.update("jax_enable_x64", True), or export it with jax_enable_x64 off (word pairs, '
        "served in either setting)."
      )

  def spec(self) -> jax.ShapeDtypeStruct:
    """As the caller gives it (``jax.ShapeDtypeStruct`` with named dimensions)."""
    return jax.ShapeDtypeStruct(self.dims, str if self.is_string else self.dtype)

  def traced(self, sizes: Mapping[str, object], max_length: int) -> jax.ShapeDtypeStruct:
    """As the function receives it; ``sizes`` maps dimension names to (symbolic) sizes."""
    shape = tuple(sizes[d] if isinstance(d, str) else d for d in self.dims)
    if self.is_string:
      return jax.ShapeDtypeStruct((*shape, strings.string_width(max_length)), jnp.uint32)
    if self.is_wide:
      return jax.ShapeDtypeStruct((*shape, 2), jnp.uint32)
    return jax.ShapeDtypeStruct(shape, jax.dtypes.canonicalize_dtype(self.dtype))

  def encode(self, value, max_length: int) -> np.ndarray:
    """A caller's value (checked by :meth:`check`) in the traced form, on the host."""
    if self.is_string:
      return strings.encode(value, max_length, name=self.name)
    if self.is_wide:
      return key_specs.split64_host(np.asarray(value, self.dtype))
    return np.asarray(value).astype(jax.dtypes.canonicalize_dtype(self.dtype), copy=False)

  def check(self, value, sizes: dict[str, int]) -> None:
    """Raises ``TypeError``/``ValueError`` naming the input unless ``value`` fits; records named sizes."""
    if self.is_string:
      array = np.asarray(value, dtype=object)
      if array.size and not all(isinstance(x, (str, bytes)) for x in array.reshape(-1)):
        raise TypeError(f"{self.name}: expected strings, got {_describe(value)}.")
    else:
      array = np.asarray(value)
      if array.dtype != self.dtype and not (
        array.dtype.kind in "iu" and self.dtype.kind in "iu" and np.can_cast(array.dtype, self.dtype, "safe")
      ):
        raise TypeError(f"{self.name}: expected {self.dtype} values, got {array.dtype}.")
    if array.ndim != len(self.dims):
      raise ValueError(f"{self.name}: expected shape {self.dims}, got {array.shape}.")
    for axis, (dim, size) in enumerate(zip(self.dims, array.shape)):
      if isinstance(dim, str):
        if sizes.setdefault(dim, size) != size:
          raise ValueError(
            f"{self.name}: dimension {axis} ({dim!r}) is {size}, but another input gives "
            f"{dim!r} = {sizes[dim]}."
          )
      elif dim != size:
        raise ValueError(f"{self.name}: expected shape {self.dims}, got {array.shape}.")

  def to_json(self) -> dict:
    dtype = "str" if self.is_string else self.dtype.name
    entry = {"name": self.name, "dims": list(self.dims), "dtype": dtype}
    return entry | ({"words": self.is_wide} if self.is_64_bit_integer else {})

  @classmethod
  def from_json(cls, entry: dict) -> Input:
    dtype = np.dtype(str) if entry["dtype"] == "str" else np.dtype(entry["dtype"])
    return cls(entry["name"], tuple(entry["dims"]), dtype, entry.get("words"))


def _describe(value) -> str:
  return type(value).__name__ if not hasattr(value, "dtype") else f"an array of {value.dtype}"


class Signature:
  """A function to serve and the inputs it takes: ``Signature(fn, max_length=64, **inputs)``.

  ``fn(obj, **inputs)`` reads the saved object (in inference mode) and
  returns a dict of arrays, or one array (named ``"output"``). Each input is
  a ``jax.ShapeDtypeStruct`` whose dimensions may be names: any size at call
  time. ``max_length``: the longest string (UTF-8 bytes) a string input takes.

  Args:
    fn: ``fn(obj, **inputs)``, a pure read of the saved object.
    max_length: the longest string input, in UTF-8 bytes.
    **inputs: each input's ``jax.ShapeDtypeStruct``, by name.

  Examples:
    >>> import jax, jax.numpy as jnp, jaxres as jr
    >>> sig = jr.saved_model.Signature(lambda m, ids: ids, ids=jax.ShapeDtypeStruct(("batch",), jnp.int32))
    >>> sig.inputs
    {'ids': ShapeDtypeStruct(shape=('batch',), dtype=int32)}
  """

  def __init__(self, fn: Callable, /, max_length: int = 64, **inputs):
    if not callable(fn):
      raise TypeError(f"fn: expected a function of the object and its inputs, got {fn!r}.")
    self.fn = fn
    self.max_length = strings.check_max_length(max_length, "max_length")
    self._inputs = tuple(_parse(name, spec) for name, spec in inputs.items())

  @property
  def inputs(self) -> dict[str, jax.ShapeDtypeStruct]:
    """``{name: jax.ShapeDtypeStruct}`` as callers give them."""
    return {i.name: i.spec() for i in self._inputs}

  @property
  def parsed(self) -> tuple[Input, ...]:
    return self._inputs

  def __repr__(self) -> str:
    return f"jr.saved_model.Signature({getattr(self.fn, '__name__', self.fn)!r}, inputs={self.inputs})"


def _parse(name: str, spec) -> Input:
  if not isinstance(spec, jax.ShapeDtypeStruct):
    raise TypeError(f"{name}: expected a jax.ShapeDtypeStruct (dimensions ints or names), got {spec!r}.")
  dims = tuple(spec.shape)
  for dim in dims:
    if isinstance(dim, str):
      if not _NAME.match(dim):
        raise ValueError(f"{name}: a dimension name must be an identifier, got {dim!r}.")
    elif not isinstance(dim, (int, np.integer)) or isinstance(dim, bool) or dim < 0:
      raise TypeError(f"{name}: expected dimensions that are ints or names, got {dims}.")
  dtype = np.dtype(spec.dtype)
  if dtype.kind not in _KINDS + "U":
    raise TypeError(f"{name}: unsupported dtype {dtype}; expected booleans, integers, floats or str.")
  return Input(name, tuple(d if isinstance(d, str) else int(d) for d in dims), dtype)
