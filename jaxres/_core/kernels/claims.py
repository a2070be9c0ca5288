"""Sort-free grouping of batch rows by slot, with deterministic claims.

Rows that target the same table slot (the same key) must be told apart
without racing scatters. Here each row writes its index into a batch-sized
scratch array with an integer scatter-min, at a cell hashed from its slot.
Integer min gives the same result whatever order a backend applies the
writes in, so the lowest index wins on CPU, GPU and TPU alike. Rows that met
a different slot in their cell try again with a new hash; every round
settles at least one slot per contended cell. The scratch is sized by the
batch, never by the table.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxres._core import constants
from jaxres._core.encoding.hashing import hash_words
from jaxres._core.kernels import native

_FREE = np.int32(np.iinfo(np.int32).max)  # an unclaimed scratch cell
_MIX = np.uint32(constants.GOLDEN_MIX)


def chunk_size(n: int, fraction: int = constants.CHUNK_FRACTION) -> int:
  """Rows handled per round of a loop that only rare rows enter: a ``fraction`` of the batch, at
  least ``CHUNK_MIN_ROWS``, at most the batch."""
  return min(n, max(constants.CHUNK_MIN_ROWS, n // fraction))


def prefix_sum(x: jax.Array) -> jax.Array:
  """int32[N]: the running total of a 1-D bool or int32 array, ``jnp.cumsum`` exactly.

  A kernel on CPU, where XLA's cumsum costs about 17 ns a row.

  Examples:
    >>> import jax.numpy as jnp
    >>> prefix_sum(jnp.array([True, False, True])).tolist()
    [1, 1, 2]
  """
  x = x.astype(jnp.int32)
  reference = lambda x: (jnp.cumsum(x, dtype=jnp.int32),)
  return native.on_cpu("jaxres_prefix_sum", reference, (jax.ShapeDtypeStruct(x.shape, jnp.int32),), x)[0]


def pending_rows(mask: jax.Array, chunk: int) -> tuple[jax.Array, jax.Array]:
  """Up to ``chunk`` indices of True rows, lowest first: ``(rows, target)``.

  ``rows`` is safe to gather with; ``target`` is ``rows`` with unused entries
  pointing past the end, for scatters with ``mode="drop"``.
  """
  n = mask.shape[0]
  position = prefix_sum(mask) - 1
  keep = mask & (position < chunk)
  target = jnp.full((chunk,), n, jnp.int32)
  target = target.at[jnp.where(keep, position, chunk)].set(jnp.arange(n, dtype=jnp.int32), mode="drop")
  return jnp.minimum(target, n - 1), target


def round_rows(mask: jax.Array, chunk: int) -> tuple[jax.Array, jax.Array]:
  """The rows of a claim round over the lowest ``chunk`` True rows, as :func:`pending_rows`'s
  ``(rows, target)``; with ``chunk`` the whole batch, every row in order and no prefix sum (``target``
  past the end where not True). Rows keep their order either way, so a claim's lowest writer
  (:func:`lowest_writer`, by position) is the same row.

  Examples:
    >>> import jax.numpy as jnp
    >>> mask = jnp.array([False, True, True, False])
    >>> [x.tolist() for x in round_rows(mask, 4)], [x.tolist() for x in round_rows(mask, 1)]
    ([[0, 1, 2, 3], [4, 1, 2, 4]], [[1], [1]])
  """
  n = mask.shape[0]
  if chunk < n:
    return pending_rows(mask, chunk)
  index = jnp.arange(n, dtype=jnp.int32)
  return index, jnp.where(mask, index, n)


def rounds(round_, state, width: int, narrow: int):
  """Runs ``round_(state, rows, target)`` until no row is pending (``state[-1]``), each round over the
  lowest ``width`` pending rows: while more than ``narrow`` are pending, rows found anew each round
  (:func:`round_rows`); then every row left, found once, in rounds of ``narrow`` rows. A round
  over a list that holds every pending row, in order, is the round over the lowest ``width`` of them
  (claims by position pick the same rows), so these are ``width``'s rounds at a fraction of their
  cost: the first round or two place most rows."""
  many = lambda s: jnp.sum(s[-1], dtype=jnp.int32) > narrow
  state = lax.while_loop(many, lambda s: round_(s, *round_rows(s[-1], width)), state)
  rows, target = pending_rows(state[-1], narrow)
  return lax.while_loop(lambda s: jnp.any(s[-1]), lambda s: round_(s, rows, target), state)


def scratch_size(n: int, cells_per_row: int = constants.CELLS_PER_ROW) -> int:
  """Scratch cells for a batch of ``n`` rows (a power of two)."""
  return 1 << max(1, (cells_per_row * n - 1).bit_length())


def cell_of(slot: jax.Array, rounds: jax.Array, size: int) -> jax.Array:
  """Scratch cell of each slot in claim round ``rounds`` (a fresh hash per round)."""
  mixed = (slot.astype(jnp.uint32) ^ (rounds.astype(jnp.uint32) * np.uint32(constants.ROUND_MIX))) * _MIX
  return (mixed >> np.uint32(33 - size.bit_length())).astype(jnp.int32)


def lowest_writer(cells: jax.Array, mask: jax.Array, size: int) -> jax.Array:
  """For each row, the lowest index among the masked rows that wrote its cell."""
  index = jnp.arange(cells.shape[0], dtype=jnp.int32)
  scratch = jnp.full((size,), _FREE, jnp.int32).at[jnp.where(mask, cells, size)].min(index, mode="drop")
  return jnp.minimum(scratch[cells], cells.shape[0] - 1)


def owner_per_key(words: jax.Array, mask: jax.Array, last: bool = False) -> jax.Array:
  """int32[N]: for each masked row, the first (or ``last``) masked row with the same key words.

  ``words`` is ``uint32[N, W]``. Unmasked rows get their own index.

  Examples:
    >>> import jax.numpy as jnp
    >>> words = jnp.array([[1, 2], [3, 4], [1, 2], [1, 2]], jnp.uint32)
    >>> mask = jnp.array([True, True, True, False])
    >>> owner_per_key(words, mask).tolist(), owner_per_key(words, mask, last=True).tolist()
    ([0, 1, 0, 3], [2, 1, 2, 3])
  """
  n = words.shape[0]
  results = (jax.ShapeDtypeStruct((n,), jnp.int32),)
  reference = lambda words, mask: (_owner_per_key(words, mask, last),)
  return native.on_cpu("jaxres_owner", reference, results, words, mask, last=last)[0]


def _owner_per_key(words, mask, last):
  n = words.shape[0]
  size = scratch_size(n)
  order = jnp.arange(n, dtype=jnp.int32)
  rows = order[::-1] if last else order  # claim priority: position in `rows`
  ranked_words, ranked_mask = words[rows], mask[rows]
  ranked_hash = hash_words(ranked_words, seed=constants.GROUPING_SEED)

  def body(state):
    # Rows of one key share its cell, so they settle together, on the lowest of them.
    rounds, pending, owner = state
    writer = lowest_writer(cell_of(ranked_hash, rounds, size), pending, size)
    settled = pending & jnp.all(ranked_words[writer] == ranked_words, axis=-1)
    return rounds + 1, pending & ~settled, jnp.where(settled, writer, owner)

  state = (jnp.int32(0), ranked_mask, order)
  _, _, owner = lax.while_loop(lambda s: jnp.any(s[1]), body, state)
  return rows[owner[rows]]  # `rows` is its own inverse


def owner_per_slot(slot: jax.Array, mask: jax.Array, last: bool = False) -> jax.Array:
  """int32[N]: for each masked row, the first (or ``last``) masked row with its ``slot``.

  Unmasked rows get their own index.

  Examples:
    >>> import jax.numpy as jnp
    >>> slot, mask = jnp.array([4, 9, 4, 4]), jnp.array([True, True, True, False])
    >>> owner_per_slot(slot, mask).tolist(), owner_per_slot(slot, mask, last=True).tolist()
    ([0, 1, 0, 3], [2, 1, 2, 3])
  """
  return owner_per_key(slot.astype(jnp.uint32)[:, None], mask, last)


def first_per_slot(slot: jax.Array, mask: jax.Array, last: bool = False) -> jax.Array:
  """bool[N]: the first (or ``last``) masked row of each distinct ``slot``.

  Examples:
    >>> import jax.numpy as jnp
    >>> slot, mask = jnp.array([4, 9, 4, 4]), jnp.array([True, True, True, False])
    >>> first_per_slot(slot, mask).tolist(), first_per_slot(slot, mask, last=True).tolist()
    ([True, True, False, False], [False, True, True, False])
  """
  return mask & (owner_per_slot(slot, mask, last) == jnp.arange(slot.shape[0], dtype=jnp.int32))
