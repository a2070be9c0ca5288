"""Grouping duplicate keys within a batch by sorting, never by racing scatters.

A batched call must behave as if its keys were processed one at a time. The
batch is stably sorted by (optional prefix, key words); equal keys become one
contiguous *group* whose rows stay in batch order, so "first occurrence" and
"last occurrence" are the group's first and last rows. Sorting is
deterministic on every backend, unlike scatters with duplicate indices.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxres._core.kernels import claims, native


class Groups(NamedTuple):
  """Sorted view of a batch of N key rows (all fields have leading dim N)."""

  perm: jax.Array  # int32[N]: sorted position -> batch index
  words: jax.Array  # uint32[N, W]: key words in sorted order
  active: jax.Array  # bool[N]: row takes part (inactive rows sort last)
  head: jax.Array  # bool[N]: first row of its group (the first occurrence)
  start: jax.Array  # int32[N]: sorted position of the row's group head
  end: jax.Array  # int32[N]: sorted position of the row's group tail


def group(words: jax.Array, active: jax.Array | None = None, prefix: jax.Array | None = None) -> Groups:
  """Sorts a flat batch of key rows into groups of equal keys.

  Args:
    words: uint32[N, W] key rows, N > 0.
    active: optional bool[N]; inactive rows sort after all active ones and
      form groups of their own that callers ignore.
    prefix: optional uint32[N] sort key placed before the words (the home
      bucket, so that rows competing for a bucket are contiguous).
  """
  n, num_words = words.shape
  index = jnp.arange(n, dtype=jnp.int32)
  keys = [] if active is None else [(~active).astype(jnp.uint32)]
  keys += [] if prefix is None else [prefix]
  keys += [words[:, j] for j in range(num_words)]
  *_, perm = lax.sort((*tuple(keys), index), num_keys=len(keys), is_stable=True)
  sorted_words = words[perm]
  sorted_active = jnp.ones(n, bool) if active is None else active[perm]
  differs = jnp.any(sorted_words[1:] != sorted_words[:-1], axis=1)
  differs = differs | (sorted_active[1:] != sorted_active[:-1])
  head = jnp.concatenate([jnp.ones(1, bool), differs])
  tail = jnp.concatenate([differs, jnp.ones(1, bool)])
  start = lax.cummax(jnp.where(head, index, 0))
  end = lax.cummin(jnp.where(tail, index, n - 1), reverse=True)
  return Groups(perm, sorted_words, sorted_active, head, start, end)


def unsort(groups: Groups, x):
  """Sorted-order rows -> batch order (a permutation: unique indices)."""
  return jax.tree.map(lambda a: jnp.zeros_like(a).at[groups.perm].set(a, unique_indices=True), x)


def group_sums(group_of: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The distinct groups of a batch and the sum of ``x`` over each, as a balanced tree in batch order.

  ``group_of``: ``int32[N]``, equal for the rows of a group (an id's value
  row, say); negative rows belong to no group. Returns ``(groups, sums)``:
  ``groups`` (``int32[N]``) holds the distinct groups in ascending order,
  then ``-1``; ``sums[j]`` is the sum over the rows of ``groups[j]`` (zeros
  after the last group). A group's rows ``r0, r1, r2, ...`` (in batch order)
  are added as ``(x[r0] + x[r1]) + (x[r2] + x[r3]) ...``: the bits of a sum
  depend on the group's own rows alone, not on how the group numbers sort
  among others, so the same ids give the same sums whatever rows a table
  gave them. No scatter with duplicate indices is involved: bitwise
  reproducible on every backend. On CPU a kernel (``jaxres_group_sums``)
  computes the same sums.

  Examples:
    >>> import jax.numpy as jnp
    >>> groups, sums = group_sums(jnp.array([7, 2, 7, -1, 7]), jnp.array([1.0, 2.0, 4.0, 8.0, 16.0]))
    >>> groups.tolist(), sums.tolist()
    ([2, 7, -1, -1, -1], [2.0, 21.0, 0.0, 0.0, 0.0])
  """
  group_of = jnp.asarray(group_of, jnp.int32)
  results = (jax.ShapeDtypeStruct(group_of.shape, jnp.int32), jax.ShapeDtypeStruct(x.shape, x.dtype))
  if x.dtype not in (jnp.float32, jnp.float64):
    return _group_sums(group_of, x)
  return native.on_cpu("jaxres_group_sums", _group_sums, results, group_of, x)


def _group_sums(group_of, x):
  n = group_of.shape[0]
  index = jnp.arange(n, dtype=jnp.int32)
  none = jnp.iinfo(jnp.int32).max
  _, perm = lax.sort((jnp.where(group_of >= 0, group_of, none), index), num_keys=1, is_stable=True)
  sorted_group = jnp.where(group_of >= 0, group_of, none)[perm]
  head = jnp.concatenate([jnp.ones(1, bool), sorted_group[1:] != sorted_group[:-1]])
  tail = jnp.concatenate([sorted_group[1:] != sorted_group[:-1], jnp.ones(1, bool)])
  start = lax.cummax(jnp.where(head, index, 0))
  end = lax.cummin(jnp.where(tail, index, n - 1), reverse=True)
  rank, length = index - start, end - start + 1
  partial = x[perm]

  def combine(state):
    step, partial = state
    partner = index + step
    adds = (rank % (2 * step) == 0) & (rank + step < length)
    other = partial[jnp.minimum(partner, n - 1)]
    widen = adds.reshape(adds.shape + (1,) * (x.ndim - 1))
    return 2 * step, jnp.where(widen, partial + other, partial)

  longest = jnp.max(length)
  _, partial = lax.while_loop(lambda s: s[0] < longest, combine, (jnp.int32(1), partial))
  first = head & (sorted_group != none)  # each group's first row now holds its sum
  target = jnp.where(first, jnp.cumsum(first, dtype=jnp.int32) - 1, n)
  groups = jnp.full(n, -1, jnp.int32).at[target].set(sorted_group, mode="drop", unique_indices=True)
  return groups, jnp.zeros_like(x).at[target].set(partial, mode="drop", unique_indices=True)


def first_occurrence_rank(groups: Groups, selected: jax.Array) -> jax.Array:
  """For each sorted row: how many selected heads come earlier in batch order.

  ``selected`` marks group heads (bool[N], sorted order). Admission of new
  keys into a nearly full table follows this rank, so the keys that fit are
  exactly those a one-at-a-time loop would have inserted.
  """
  in_batch_order = unsort(groups, selected.astype(jnp.int32))
  rank = claims.prefix_sum(in_batch_order) - in_batch_order
  return rank[groups.perm]


def admit(words: jax.Array, new: jax.Array, room: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Which rows may insert when at most ``room`` new keys still fit.

  Args:
    words: uint32[N, W] key rows in batch order.
    new: bool[N], rows whose key is not in the table (and that are not masked out).
    room: int32 scalar, free capacity.

  Returns:
    ``(admitted, dropped)``: bool[N] in batch order, True for every row whose
    key is among the first ``room`` distinct new keys (by first occurrence),
    and the number of distinct new keys left out.
  """
  groups = group(words, new)  # a key's group starts at its first new row
  heads = groups.head & groups.active
  admitted_heads = heads & (first_occurrence_rank(groups, heads) < room)
  dropped = jnp.sum(heads, dtype=jnp.int32) - jnp.sum(admitted_heads, dtype=jnp.int32)
  return unsort(groups, admitted_heads[groups.start]), dropped
