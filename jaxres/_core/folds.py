"""The functions ``insert_or_apply`` knows: exact on 64-bit word pairs, and reduced in one scatter.

``insert_or_apply(keys, values, fn)`` folds a present key's rows into its value
with ``fn(old, new)``. With ``jax_enable_x64`` off a 64-bit integer value leaf
is held as uint32 ``(high, low)`` word pairs (``LeafSpec.wide``), on which an
arbitrary ``fn`` computes on the words, not on 64-bit integers. The
elementwise operations of :data:`EXACT` are known by identity (``jnp.add``,
``jax.lax.add`` and ``operator.add`` alike): :func:`fold` applies one leaf by
leaf, on a word-pair leaf as 64-bit integer arithmetic (add with carry,
subtract with borrow, compare the high words, signed for ``int64``, then the
low ones), wrapping around as NumPy's ``int64`` and ``uint64`` do, and on any
other leaf as the operation itself. Where folding integers in any order gives
the same result (a sum, a product, a maximum, a minimum), a table reduces the
rows of a key in one scatter instead of folding them in order (:func:`reduction`).

Examples:
  >>> import jax.numpy as jnp, numpy as np
  >>> from jaxres._core.encoding.value_specs import ValueSpec
  >>> from jaxres._core.encoding.key_specs import split64_host, join64_host
  >>> add = fold(jnp.add, ValueSpec.parse(np.int64))  # x64 off: int64 held as word pairs
  >>> old, new = split64_host(np.array([2**32 - 1, -3])), split64_host(np.array([1, 1]))
  >>> join64_host(np.asarray(add(old, new)), np.int64).tolist()
  [4294967296, -2]
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxres._core.encoding.value_specs import ValueSpec
from jaxres._core.modes import Carry

_SIGN = np.uint32(1 << 31)
_HALF = np.uint32(0xFFFF)


def _words(pairs):
  return pairs[..., 0], pairs[..., 1]


def _pair(high, low):
  return jnp.stack([high, low], axis=-1)


def _add(a, b, signed: bool):
  del signed  # two's complement: one sum for both
  (a_high, a_low), (b_high, b_low) = _words(a), _words(b)
  low = a_low + b_low
  return _pair(a_high + b_high + (low < a_low).astype(jnp.uint32), low)


def _subtract(a, b, signed: bool):
  del signed
  (a_high, a_low), (b_high, b_low) = _words(a), _words(b)
  return _pair(a_high - b_high - (a_low < b_low).astype(jnp.uint32), a_low - b_low)


def _product(a, b):
  """The 64-bit product of uint32 ``a`` and ``b`` as ``(high, low)`` words (16-bit halves multiplied)."""
  a0, a1, b0, b1 = a & _HALF, a >> 16, b & _HALF, b >> 16
  p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
  middle = (p00 >> 16) + (p01 & _HALF) + (p10 & _HALF)
  return p11 + (p01 >> 16) + (p10 >> 16) + (middle >> 16), (p00 & _HALF) | (middle << 16)


def _multiply(a, b, signed: bool):
  del signed  # the low 64 bits of a product are the same for both
  (a_high, a_low), (b_high, b_low) = _words(a), _words(b)
  high, low = _product(a_low, b_low)
  return _pair(high + a_high * b_low + a_low * b_high, low)


def _greater(a, b, signed: bool):
  """``a > b`` per pair: the high words (signed: their sign bit flipped), then the low words."""
  flip = _SIGN if signed else np.uint32(0)
  (a_high, a_low), (b_high, b_low) = _words(a), _words(b)
  a_high, b_high = a_high ^ flip, b_high ^ flip
  return (a_high > b_high) | ((a_high == b_high) & (a_low > b_low))


def _maximum(a, b, signed: bool):
  return jnp.where(_greater(b, a, signed)[..., None], b, a)


def _minimum(a, b, signed: bool):
  return jnp.where(_greater(a, b, signed)[..., None], b, a)


def _on_words(op) -> Callable:
  """A bitwise operation: the same on each word."""
  return lambda a, b, signed: op(a, b)


@dataclasses.dataclass(frozen=True)
class _Operation:
  """A known elementwise operation: its exact form on word pairs and, where integers fold to the same
  result in any order, the scatter reduction that equals the fold."""

  name: str
  on_pairs: Callable  # (old pairs, new pairs, signed) -> pairs
  reduction: Carry | None = None


_ADD = _Operation("add", _add, Carry.ADD)
_SUBTRACT = _Operation("subtract", _subtract)
_MULTIPLY = _Operation("multiply", _multiply, Carry.MULTIPLY)
_MAXIMUM = _Operation("maximum", _maximum, Carry.MAX)
_MINIMUM = _Operation("minimum", _minimum, Carry.MIN)
_AND = _Operation("bitwise_and", _on_words(jnp.bitwise_and))
_OR = _Operation("bitwise_or", _on_words(jnp.bitwise_or))
_XOR = _Operation("bitwise_xor", _on_words(jnp.bitwise_xor))

_KNOWN = {
  jnp.add: _ADD,
  jax.lax.add: _ADD,
  operator.add: _ADD,
  jnp.subtract: _SUBTRACT,
  jax.lax.sub: _SUBTRACT,
  operator.sub: _SUBTRACT,
  jnp.multiply: _MULTIPLY,
  jax.lax.mul: _MULTIPLY,
  operator.mul: _MULTIPLY,
  jnp.maximum: _MAXIMUM,
  jax.lax.max: _MAXIMUM,
  jnp.minimum: _MINIMUM,
  jax.lax.min: _MINIMUM,
  jnp.bitwise_and: _AND,
  jax.lax.bitwise_and: _AND,
  operator.and_: _AND,
  jnp.bitwise_or: _OR,
  jax.lax.bitwise_or: _OR,
  operator.or_: _OR,
  jnp.bitwise_xor: _XOR,
  jax.lax.bitwise_xor: _XOR,
  operator.xor: _XOR,
}

# The known operations, as an error message or a docstring names them.
EXACT = (
  ", ".join(f"jnp.{name}" for name in dict.fromkeys(op.name for op in _KNOWN.values()))
  + " (or the same jax.lax and operator functions)"
)


def _known(fn) -> _Operation | None:
  try:
    return _KNOWN.get(fn)
  except TypeError:  # an unhashable callable
    return None


def is_exact(fn) -> bool:
  """Whether ``fn`` is one of the operations of :data:`EXACT` (exact on 64-bit word pairs).

  Examples:
    >>> import operator, jax.numpy as jnp
    >>> is_exact(jnp.add), is_exact(operator.sub), is_exact(lambda a, b: a + b)
    (True, True, False)
  """
  return _known(fn) is not None


@dataclasses.dataclass(frozen=True)
class Fold:
  """``fn(old, new)`` of a known operation over a table's value entries, applied leaf by leaf.

  Equal for the same operation and values (a static argument of a jitted
  call: calls share a compile).
  """

  op: Callable  # the operation as the caller gave it, applied to the leaves held natively
  operation: _Operation
  value_spec: ValueSpec

  def __call__(self, old, new):
    spec = self.value_spec
    olds, news = spec.treedef.flatten_up_to(old), spec.treedef.flatten_up_to(new)
    leaves = [
      self.operation.on_pairs(a, b, leaf.dtype.kind == "i") if leaf.wide else self.op(a, b)
      for leaf, a, b in zip(spec.leaves, olds, news, strict=True)
    ]
    return jax.tree.unflatten(spec.treedef, leaves)

  @property
  def reduction(self) -> Carry | None:
    """The scatter reduction equal to folding in order: only integer leaves held natively make a
    sum or a product independent of the order."""
    integral = all(leaf.dtype.kind in "iu" and not leaf.wide for leaf in self.value_spec.leaves)
    return self.operation.reduction if integral else None


def fold(fn, value_spec: ValueSpec):
  """What ``insert_or_apply`` folds with: a known operation as a :class:`Fold`, any other ``fn`` as given
  (a 64-bit integer leaf reaches it as word pairs when x64 is off)."""
  operation = _known(fn)
  return fn if operation is None else Fold(fn, operation, value_spec)


def reduction(fn) -> Carry | None:
  """The scatter reduction equal to folding with ``fn`` (from :func:`fold`) in order, or ``None``."""
  return fn.reduction if isinstance(fn, Fold) else None
