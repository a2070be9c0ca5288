"""Keys and 64-bit integers as rows of ``uint32`` words.

Every key is stored as a row of ``uint32`` words so that one code path serves
all key dtypes, composite keys and both settings of ``jax_enable_x64``:

* a 32-bit element is one word, a 64-bit element two (high word first);
* signed elements have their sign bit flipped, so the unsigned lexicographic
  order of the words equals the numeric order of the keys (``SortedTable``
  relies on this; the hash tables do not care);
* a composite key of shape ``(k,)`` is the concatenation of its elements' words.

Outside the table, a 64-bit integer that JAX cannot hold (``jax_enable_x64``
off) travels as a *word pair*: ``uint32[..., 2]`` holding the high and the low
32 bits of its two's complement form (see :mod:`jaxres.keys`).
"""

from __future__ import annotations

import dataclasses
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxres._core.encoding.hashing import hash_words

KEY_DTYPES = (np.dtype(np.int32), np.dtype(np.uint32), np.dtype(np.int64), np.dtype(np.uint64))
_SIGN_BIT = np.uint32(0x80000000)
STRING_KEYS = (
  "string ids are the keys of a table made with key=str: jr.DynamicEmbedding(..., key=str, "
  "max_length=n), jr.TableConfig(..., key=str, max_length=n), jr.MutableHashTable(str, ...); "
  "inside jit such a table takes the uint32 rows of jr.keys.encode_strings(ids, max_length=n)."
)


def x64_enabled() -> bool:
  """Whether JAX currently represents 64-bit types natively."""
  return bool(jax.config.read("jax_enable_x64"))


def is_traced(x) -> bool:
  return isinstance(x, jax.core.Tracer)


def _is_jax_array(x) -> bool:
  return isinstance(x, jax.Array)


# --------------------------------------------------------------------------
# Word pairs for 64-bit integers (public through jaxres.keys).


def split64_host(x: np.ndarray) -> np.ndarray:
  """NumPy int64/uint64 -> uint32[..., 2] (high, low) word pairs."""
  u = np.ascontiguousarray(x, dtype=np.uint64 if x.dtype.kind == "u" else np.int64).view(np.uint32)
  pairs = u.reshape(*x.shape, 2)
  return pairs[..., ::-1] if sys.byteorder == "little" else pairs  # the high word first


def join64_host(pairs: np.ndarray, dtype: np.dtype) -> np.ndarray:
  """uint32[..., 2] word pairs -> NumPy array of the 64-bit ``dtype``."""
  pairs = np.asarray(pairs, dtype=np.uint32)
  u = (pairs[..., 0].astype(np.uint64) << np.uint64(32)) | pairs[..., 1].astype(np.uint64)
  return u.view(np.dtype(dtype)) if np.dtype(dtype).kind == "i" else u


def split64_jax(x: jax.Array) -> jax.Array:
  """JAX int64/uint64 (x64 on) -> uint32[..., 2] word pairs; traceable."""
  u = jax.lax.bitcast_convert_type(x, jnp.uint64) if x.dtype == jnp.int64 else x
  return jnp.stack([(u >> 32).astype(jnp.uint32), u.astype(jnp.uint32)], axis=-1)


def join64_jax(pairs: jax.Array, dtype) -> jax.Array:
  """uint32[..., 2] word pairs -> JAX int64/uint64 (x64 on); traceable."""
  u = (pairs[..., 0].astype(jnp.uint64) << 32) | pairs[..., 1].astype(jnp.uint64)
  return jax.lax.bitcast_convert_type(u, jnp.int64) if np.dtype(dtype).kind == "i" else u


def decode_wide(pairs, dtype):
  """Word pairs -> the most exact array this context can hold.

  A native 64-bit JAX array when x64 is on; a NumPy array when the pairs are
  concrete (eager use with x64 off); the word pairs themselves under ``jit``
  with x64 off.
  """
  if x64_enabled():
    return join64_jax(pairs, dtype)
  if is_traced(pairs):
    return pairs
  return join64_host(np.asarray(pairs), dtype)


# --------------------------------------------------------------------------
# Argument checking shared by keys and wide values.


def _describe(x) -> str:
  if hasattr(x, "dtype") and hasattr(x, "shape"):
    return f"{type(x).__name__} of dtype {x.dtype} and shape {tuple(x.shape)}"
  return repr(type(x).__name__)


def host_integers(x, dtype: np.dtype, name: str, hint: str = "") -> np.ndarray:
  """Python ints (or nested lists of them) -> NumPy ``dtype``, range-checked; ``hint`` follows the
  message of strings given instead."""
  try:
    arr = np.asarray(x)
  except ValueError as err:  # ragged nested lists
    raise ValueError(f"{name}: not a rectangular array ({err}).") from None
  if arr.size == 0 and arr.dtype.kind == "f":  # `[]` parses as float64
    return arr.astype(dtype)
  if arr.dtype.kind not in "iu" or arr.dtype == np.bool_:
    strings = f"; {hint}" if hint and arr.dtype.kind in "US" else "."
    raise TypeError(f"{name}: expected integers of dtype {dtype}, got {_describe(arr)}{strings}")
  info = np.iinfo(dtype)
  if arr.size and (int(arr.min()) < info.min or int(arr.max()) > info.max):
    raise ValueError(f"{name}: value out of range for {dtype} [{info.min}, {info.max}].")
  return arr.astype(dtype)


def _check_trailing(shape: tuple, trailing: tuple, name: str, spec, what: str = "keys") -> tuple:
  k = len(trailing)
  if len(shape) < k or tuple(shape[len(shape) - k :]) != trailing:
    raise ValueError(
      f"{name}: expected shape (*batch, {', '.join(map(str, trailing))}) for {spec} {what}, "
      f"got shape {tuple(shape)}."
    )
  return tuple(shape[: len(shape) - k])


# --------------------------------------------------------------------------
# Keys.


@dataclasses.dataclass(frozen=True)
class KeySpec:
  """Static description of a table's keys: element dtype and per-key shape."""

  dtype: np.dtype
  shape: tuple[int, ...] = ()

  @classmethod
  def parse(cls, key) -> KeySpec:
    if key is None:  # np.dtype(None) would be float64
      raise TypeError("key: expected an integer dtype or jax.ShapeDtypeStruct, got None.")
    if isinstance(key, jax.ShapeDtypeStruct):
      dtype, shape = np.dtype(key.dtype), tuple(key.shape)
    else:
      try:
        dtype, shape = np.dtype(key), ()
      except TypeError:
        raise TypeError(f"key: expected an integer dtype or jax.ShapeDtypeStruct, got {key!r}.") from None
    if dtype not in KEY_DTYPES:
      raise TypeError(f"key: expected one of int32, uint32, int64, uint64, got {dtype}; {STRING_KEYS}")
    if any(d <= 0 for d in shape):
      raise ValueError(f"key: every dimension of a composite key must be positive, got {shape}.")
    return cls(dtype, shape)

  @property
  def wide(self) -> bool:
    return self.dtype.itemsize == 8

  @property
  def words_per_element(self) -> int:
    return 2 if self.wide else 1

  @property
  def num_words(self) -> int:
    return math.prod(self.shape) * self.words_per_element

  def __str__(self) -> str:
    return f"{self.dtype}{list(self.shape) if self.shape else ''}"

  # Internal words <-> external pairs differ only by the flipped sign bit.
  def _flip(self, words):
    if self.dtype.kind != "i":
      return words
    flip = [_SIGN_BIT] + [np.uint32(0)] * (self.words_per_element - 1)
    return words ^ jnp.asarray(flip, dtype=jnp.uint32)

  def _flip_host(self, words: np.ndarray) -> np.ndarray:
    if self.dtype.kind != "i":
      return words
    flip = np.asarray([_SIGN_BIT] + [0] * (self.words_per_element - 1), dtype=np.uint32)
    return words ^ flip

  def encode(self, keys, name: str = "keys") -> tuple[jax.Array | np.ndarray, tuple[int, ...]]:
    """User keys -> (uint32[*batch, num_words], batch_shape).

    Host keys (NumPy, Python ints) give NumPy words, JAX arrays JAX words: an
    eager call encodes on the host and hands the words to its jitted program.

    Raises:
      TypeError: the keys' dtype could silently change their value (floats,
        booleans, a wider integer, ``int32`` given to a 64-bit table).
      ValueError: the trailing shape does not match the key shape.
    """
    if _is_jax_array(keys):
      return self._encode_jax(keys, name)
    if isinstance(keys, (np.ndarray, np.generic)):
      arr = np.asarray(keys)
      if arr.dtype == object and arr.size and isinstance(arr.reshape(-1)[0], (str, bytes)):
        raise TypeError(f"{name}: expected {self} keys, got strings (an object array); {STRING_KEYS}")
      self._check_dtype(arr.dtype, arr.shape, name)
    else:
      arr = host_integers(keys, self.dtype, name, hint=STRING_KEYS)
    return self._encode_host(arr, name)

  def count(self, keys) -> int:
    """How many keys ``keys`` holds, from its shape alone (:meth:`encode` checks them)."""
    shape = np.shape(keys)
    dtype = getattr(keys, "dtype", None)
    trailing = len(self.shape) + (1 if dtype is not None and self._is_pairs(dtype, shape) else 0)
    return math.prod(shape[: max(0, len(shape) - trailing)])

  def _is_pairs(self, dtype, shape) -> bool:
    return self.wide and dtype == np.uint32 and tuple(shape[-1:]) == (2,)

  def _check_dtype(self, dtype, shape, name, jax_array: bool = False):
    dtype = np.dtype(dtype)
    if dtype == self.dtype or self._is_pairs(dtype, shape):
      return
    if dtype.kind in "US":
      raise TypeError(f"{name}: expected {self} keys, got strings ({dtype}); {STRING_KEYS}")
    if not self.wide and dtype.kind in "iu" and np.can_cast(dtype, self.dtype, "safe"):
      return
    if self.wide and jax_array and dtype == jax.dtypes.canonicalize_dtype(self.dtype):
      raise TypeError(
        f"{name}: expected {self.dtype} keys, got a JAX {dtype} array: with jax_enable_x64 off, JAX "
        f"turns {self.dtype} ids passed into jit (or jnp.asarray) into {dtype}, dropping their high "
        "bits. Pass jr.keys.split64(ids) (uint32 word pairs) into the jitted function instead, or "
        "enable jax_enable_x64."
      )
    if self.wide:
      hint = (
        f"pass a NumPy {self.dtype} array, a JAX array of dtype {self.dtype} (with jax_enable_x64), "
        "or uint32 word pairs from jr.keys.split64 (inside jit with x64 off); "
        f"a narrower integer array may already have been truncated."
      )
    else:
      hint = f"cast with .astype({self.dtype.name}) if the values fit."
    raise TypeError(f"{name}: expected {self.dtype} keys, got {dtype}; {hint}")

  def _encode_jax(self, keys, name):
    self._check_dtype(keys.dtype, keys.shape, name, jax_array=True)
    if self._is_pairs(keys.dtype, keys.shape):
      batch = _check_trailing(keys.shape, (*self.shape, 2), name, self, "word-pair keys")
      words = self._flip(keys)
    elif self.wide:
      batch = _check_trailing(keys.shape, self.shape, name, self)
      words = self._flip(split64_jax(keys))
    else:
      batch = _check_trailing(keys.shape, self.shape, name, self)
      words = self._flip(jax.lax.bitcast_convert_type(keys.astype(self.dtype), jnp.uint32))
    return words.reshape((*batch, self.num_words)), batch

  def _encode_host(self, arr: np.ndarray, name):
    if self._is_pairs(arr.dtype, arr.shape):
      batch = _check_trailing(arr.shape, (*self.shape, 2), name, self, "word-pair keys")
      words = arr
    else:
      batch = _check_trailing(arr.shape, self.shape, name, self)
      arr = arr.astype(self.dtype, copy=False)
      words = split64_host(arr) if self.wide else arr.view(np.uint32)
    words = self._flip_host(np.asarray(words, dtype=np.uint32))
    return words.reshape((*batch, self.num_words)), batch

  def decode_host(self, words: np.ndarray) -> np.ndarray:
    """NumPy ``uint32[*batch, num_words]`` -> NumPy keys of the exact dtype, on the host.

    What :meth:`decode` computes, with no JAX program: the host side of an export
    decodes batches of any size without compiling one for each.
    """
    words = np.asarray(words, dtype=np.uint32)
    batch = words.shape[:-1]
    if self.wide:
      return join64_host(self._flip_host(words.reshape(batch + self.shape + (2,))), self.dtype)
    return np.ascontiguousarray(self._flip_host(words)).reshape(batch + self.shape).view(self.dtype)

  def hash(self, keys, seed: int = 0) -> jax.Array:
    """``uint32[*batch]``: a fixed hash of each key (see :func:`hashing.hash_words`)."""
    words, _ = self.encode(keys)
    return hash_words(words, seed=seed)

  def encode_zero(self) -> jax.Array:
    """The words of the all-zero key (padding in exports)."""
    elements = jnp.zeros((self.num_words // self.words_per_element, self.words_per_element), jnp.uint32)
    return self._flip(elements).reshape(-1)

  def decode(self, words: jax.Array):
    """uint32[*batch, num_words] -> keys in the most exact form available."""
    if _is_jax_array(words) and not is_traced(words):  # eager: on the host, or by one program
      return self.decode_host(np.asarray(words)) if self.wide and not x64_enabled() else _decoded(self, words)
    batch = tuple(words.shape[:-1])
    if not self.wide:
      elems = self._flip(words).reshape(batch + self.shape)
      return jax.lax.bitcast_convert_type(elems, self.dtype) if self.dtype.kind == "i" else elems
    pairs = self._flip(words.reshape(batch + self.shape + (2,)))
    return decode_wide(pairs, self.dtype)


_decoded = jax.jit(KeySpec.decode, static_argnums=0)
