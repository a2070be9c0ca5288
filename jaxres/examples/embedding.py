"""A dynamic embedding: ids get embedding rows on first sight, inside ``nnx.jit``."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxres as jr

_INIT = nnx.initializers.normal(0.05)


class DynamicEmbedding(nnx.Module):
  """An embedding whose rows are assigned to ids as they arrive.

  A :class:`jaxres.MutableHashTable` maps each id to its row of an
  ``nnx.Param`` matrix. On a call, ids already in the table read their row;
  an unseen id is given the next free row with ``find_or_insert`` (rows
  ``0, 1, 2, ...`` in order of first occurrence, exactly as if the batch were
  processed one id at a time), so gradients reach exactly the rows looked up.
  Rows are never recycled: the table's ``size()`` is the number of rows in use.

  **When the table is full** (all ``num_rows`` rows assigned), unseen ids are
  not inserted: each is served by one of ``num_oov_rows`` shared rows picked by
  a fixed hash of the id (trained like any row), the same row every time.
  :attr:`oov_lookups` counts such lookups.

  Args:
    num_rows: rows that can be assigned to ids (the table's capacity).
    features: embedding width.
    rngs: ``nnx.Rngs`` for the initial rows.
    num_oov_rows: shared rows for ids that arrive when the table is full.
    key_dtype: the id dtype (``np.int64`` by default: with ``jax_enable_x64``
      off, pass ids as word pairs, ``jr.keys.split64(ids)``, inside ``jit``).
    init: initializer of the ``[num_rows + num_oov_rows, features]`` matrix.

  Example:
    >>> import numpy as np, jaxres as jr
    >>> from flax import nnx
    >>> from jaxres.examples import DynamicEmbedding
    >>> emb = DynamicEmbedding(4, 2, rngs=nnx.Rngs(0), num_oov_rows=1)
    >>> emb.assign(jr.keys.split64(np.array([[50, 7], [50, 2**40]]))).tolist()
    [[0, 1], [0, 2]]
    >>> emb.assign(jr.keys.split64(np.array([9, 11, 7]))).tolist()  # 11 finds the table full
    [3, 4, 1]
    >>> len(emb.ids), int(emb.oov_lookups.get_value())
    (4, 1)
  """

  def __init__(
    self,
    num_rows: int,
    features: int,
    *,
    rngs: nnx.Rngs,
    num_oov_rows: int = 8,
    key_dtype=np.int64,
    init=_INIT,
  ):
    self.num_rows, self.num_oov_rows, self.key_dtype = num_rows, num_oov_rows, key_dtype
    # The table checks num_rows (its initial_capacity) and the key dtype.
    self.ids = jr.MutableHashTable(key_dtype, np.int32, default_value=-1, initial_capacity=num_rows)
    self.rows = nnx.Param(init(rngs.params(), (num_rows + num_oov_rows, features), jnp.float32))
    self.oov_lookups = nnx.Variable(jnp.zeros((), jnp.int32))

  def assign(self, ids) -> jax.Array:
    """The row of each id (``int32[*batch]``), giving unseen ids new rows.

    Two passes over the table, both O(batch): ``find_or_insert`` gives every
    new id the batch position of its first occurrence as a provisional value,
    which identifies the first occurrences; ``insert`` then replaces those with
    dense rows ``size, size + 1, ...`` in order of first occurrence.
    """
    before = self.ids.state
    if before.capacity != self.num_rows:
      raise ValueError(f"ids: the table's capacity {before.capacity} differs from num_rows {self.num_rows}.")
    hashes = jr.keys.hash(ids, self.key_dtype)  # checks the ids; picks the shared row of a refused id
    batch_shape = hashes.shape
    size, position = before.size, jnp.arange(int(np.prod(batch_shape)), dtype=jnp.int32)
    table, first = before.find_or_insert(ids, (size + position).reshape(batch_shape))
    first = first.reshape(-1)
    new = first >= size  # existing ids hold rows below size, ids left out the default -1
    head = new & (first - size == position)
    rank = jnp.cumsum(head, dtype=jnp.int32) - head
    rows = jnp.where(new, size + rank[jnp.clip(first - size, 0, None)], first)
    table = table.insert(ids, rows.reshape(batch_shape))
    # Ids that found the table full were left out by both passes. That is the
    # policy here, not a loss: they take shared rows, so the drop count stays.
    self.ids.state = dataclasses.replace(table, dropped=before.dropped)
    oov = first < 0
    self.oov_lookups.set_value(self.oov_lookups.get_value() + jnp.sum(oov, dtype=jnp.int32))
    bucket = (hashes.reshape(-1) % np.uint32(self.num_oov_rows)).astype(jnp.int32)
    return jnp.where(oov, self.num_rows + bucket, rows).reshape(batch_shape)

  def __call__(self, ids) -> jax.Array:
    """``float32[*batch, features]``: the rows of ``ids`` (assigning new ones)."""
    return take_rows(self.rows.get_value(), self.assign(ids))


@jax.custom_vjp
def take_rows(matrix: jax.Array, rows: jax.Array) -> jax.Array:
  """``matrix[rows]`` with a deterministic gradient.

  The gradient of a plain gather adds the cotangents of repeated rows with a
  scatter-add, whose order of floating-point additions is not fixed on GPU.
  Here the cotangents are sorted by row and summed by a segmented scan, and
  each row is written once, so the gradient is bitwise reproducible on every
  backend.
  """
  return matrix[rows]


def _take_rows_fwd(matrix, rows):
  return matrix[rows], (rows, jnp.zeros((0, *matrix.shape), matrix.dtype))


def _take_rows_bwd(residuals, cotangent):
  rows, like = residuals
  num_rows, features = like.shape[1], like.shape[2:]
  rows = rows.reshape(-1)
  cotangent = cotangent.reshape(rows.shape + features)
  index = jnp.arange(rows.shape[0], dtype=jnp.int32)
  sorted_rows, order = jax.lax.sort((rows, index), num_keys=1, is_stable=True)
  starts = jnp.concatenate([jnp.ones(1, bool), sorted_rows[1:] != sorted_rows[:-1]])
  ends = jnp.concatenate([starts[1:], jnp.ones(1, bool)])

  def add_within_segment(a, b):
    (sum_a, start_a), (sum_b, start_b) = a, b
    flag = start_b.reshape(start_b.shape + (1,) * len(features))
    return jnp.where(flag, sum_b, sum_a + sum_b), start_a | start_b

  totals, _ = jax.lax.associative_scan(add_within_segment, (cotangent[order], starts))
  target = jnp.where(ends, sorted_rows, num_rows + index)  # one write per row; the rest out of range
  grad = jnp.zeros((num_rows, *features), like.dtype).at[target].set(totals, mode="drop", unique_indices=True)
  return grad, None


take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)
