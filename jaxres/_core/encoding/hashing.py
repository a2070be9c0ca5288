"""Hashing of uint32 word rows (murmur3-style mixing, all in uint32 arithmetic)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxres._core import constants

_C1 = np.uint32(constants.HASH_C1)
_C2 = np.uint32(constants.HASH_C2)


def _rotl(x: jax.Array, r: int) -> jax.Array:
  return (x << r) | (x >> (32 - r))


def _fmix(h: jax.Array) -> jax.Array:
  h = h ^ (h >> 16)
  h = h * np.uint32(constants.HASH_FINAL_1)
  h = h ^ (h >> 13)
  h = h * np.uint32(constants.HASH_FINAL_2)
  return h ^ (h >> 16)


def hash_words(words: jax.Array, seed: int = constants.BUCKET_SEED) -> jax.Array:
  """uint32[..., W] -> uint32[...]: a well-mixed hash of each word row.

  Deterministic on every backend (pure integer arithmetic), so the same keys
  always land in the same buckets.
  """
  if isinstance(words, jax.Array) and not isinstance(words, jax.core.Tracer):  # eager: one program
    return _hashed(words, seed=seed)
  num_words = words.shape[-1]
  h = jnp.full(words.shape[:-1], np.uint32(seed), dtype=jnp.uint32)
  for j in range(num_words):
    k = _rotl(words[..., j] * _C1, 15) * _C2
    h = _rotl(h ^ k, 13) * np.uint32(5) + np.uint32(constants.HASH_ROUND_ADD)
  return _fmix(h ^ np.uint32(num_words))


def mix(h: jax.Array, seed: int) -> jax.Array:
  """uint32: a hash ``h`` mixed again with ``seed`` (murmur's finalizer): a second hash of the same
  key at the cost of a few operations, independent enough of the first to choose a second bucket.

  Examples:
    >>> import jax.numpy as jnp
    >>> h = jnp.array([1, 2], jnp.uint32)
    >>> bool(jnp.all(mix(h, 7) != mix(h, 8)))
    True
  """
  return _fmix(h ^ np.uint32(seed))


_hashed = jax.jit(hash_words, static_argnames="seed")
