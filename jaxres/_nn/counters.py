"""An embedding's counters: ids given rows, lookups refused (and why), ids evicted.

The counters are 64-bit, kept as ``(high, low)`` uint32 word pairs (JAX
without ``jax_enable_x64`` has no 64-bit integers), one pair per name of
:data:`NAMES`. ``refused`` is not kept: it is ``unadmitted + full``.

A checkpoint written before the split of ``refused`` holds three pairs
(``admitted``, ``refused``, ``evictions``): :func:`split_refusals` reads them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

NAMES = ("admitted", "unadmitted", "full", "evictions")
_BEFORE_THE_SPLIT = ("admitted", "refused", "evictions")


def zeros() -> jax.Array:
  """``uint32[len(NAMES), 2]``: every counter at 0."""
  return jnp.zeros((len(NAMES), 2), jnp.uint32)


def add(words: jax.Array, amounts: jax.Array) -> jax.Array:
  """``words`` plus ``amounts`` (non-negative ``int32[len(NAMES)]``), carrying into the high words.

  Examples:
    >>> words = add(zeros(), jnp.array([1, 0, 0, 0]))
    >>> words = words.at[0, 1].set(0xFFFFFFFF)
    >>> add(words, jnp.array([2, 0, 0, 0]))[0].tolist()
    [1, 1]
  """
  low = words[:, 1] + amounts.astype(jnp.uint32)
  high = words[:, 0] + (low < words[:, 1]).astype(jnp.uint32)
  return jnp.stack([high, low], axis=1)


def read(words) -> dict[str, int]:
  """``{"admitted", "refused", "unadmitted", "full", "evictions"}`` as Python ints.

  Examples:
    >>> read(add(zeros(), jnp.array([3, 1, 2, 0])))
    {'admitted': 3, 'refused': 3, 'unadmitted': 1, 'full': 2, 'evictions': 0}
  """
  words = np.asarray(jax.device_get(words)).astype(np.uint64)
  value = {name: int((high << np.uint64(32)) | low) for name, (high, low) in zip(NAMES, words)}
  return {
    "admitted": value["admitted"],
    "refused": value["unadmitted"] + value["full"],
    "unadmitted": value["unadmitted"],
    "full": value["full"],
    "evictions": value["evictions"],
  }


def split_refusals(saved: np.ndarray, admits: bool) -> np.ndarray:
  """Counters saved before ``refused`` was split (``uint32[3, 2]``) as :data:`NAMES` counts.

  The refusals are ``full`` ones for an embedding without admission (``admits``
  false: no lookup waited for one), else ``unadmitted`` ones (the most common
  kind there; the checkpoint does not tell them apart).

  Examples:
    >>> saved = np.array([[0, 5], [0, 2], [0, 1]], np.uint32)
    >>> split_refusals(saved, admits=False)[:, 1].tolist()
    [5, 0, 2, 1]
  """
  old = dict(zip(_BEFORE_THE_SPLIT, saved))
  none = np.zeros(2, np.uint32)
  return np.stack(
    [
      old["admitted"],
      old["refused"] if admits else none,
      none if admits else old["refused"],
      old["evictions"],
    ]
  )
