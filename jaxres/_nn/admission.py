"""Admission by count: an id earns a row at its ``min_count``-th occurrence.

Occurrences of ids that have no row yet are counted in a small table of its
own, an :class:`~jaxres.OpenAddressingTable` with ``jr.LRU()`` eviction: the
counting is bounded (``capacity`` ids) and exact for the ids it holds. When
it is full, the id counted least recently leaves and its count is lost, so
the error is one-sided: an id is never admitted before its ``min_count``-th
occurrence, and it is admitted late only if more than ``capacity`` other
unadmitted ids arrived between two of its occurrences. (A count-min sketch
errs the other way: it over-counts and admits ids early, more and more of
them as its cells fill over a long stream.) An admitted id's count is
removed, so a later eviction of its row makes it start afresh.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxres._core.kernels import grouping
from jaxres._core.policies import LRU
from jaxres._core.storages import registry
from jaxres._core.table import Table


def counter(capacity: int, key) -> Table:
  """An empty count table for ``capacity`` ids of dtype ``key`` (of the default storage: it evicts)."""
  return registry.default().create(capacity, key=key, value=jnp.int32, default=0, eviction=LRU())


def admit(counts: Table, keys, words, candidates: jax.Array, min_count: int) -> tuple[Table, jax.Array]:
  """Counts the occurrences of ``keys`` where ``candidates``; ``(counts, admitted)``.

  ``admitted`` (``bool[N]``) marks the candidate rows that are their id's
  ``min_count``-th occurrence or later, in batch order, as if the rows came
  one at a time: an earlier row of the same id in the batch is not admitted.
  ``words`` are the keys' ``uint32[N, W]`` rows (for grouping the batch).

  Examples:
    >>> import jax.numpy as jnp
    >>> counts = counter(8, jnp.int32)
    >>> ids = jnp.array([4, 5, 4, 4])
    >>> counts, admitted = admit(counts, ids, ids[:, None].astype(jnp.uint32), jnp.ones(4, bool), 2)
    >>> admitted.tolist(), counts.contains(ids).tolist()  # 4 admitted: its count is dropped
    ([False, False, True, True], [False, True, False, False])
  """
  groups = grouping.group(words, candidates)  # an id's candidate rows, contiguous, in batch order
  position = jnp.arange(words.shape[0], dtype=jnp.int32)
  earlier, occurrences = grouping.unsort(groups, (position - groups.start, groups.end - groups.start + 1))
  counts = counts.insert_or_apply(keys, jnp.ones(candidates.shape, jnp.int32), jnp.add, valid=candidates)
  # Counts are read after the update (a read before it would make XLA copy the table to keep it):
  # a counted id had its count before the batch plus its occurrences; a refused one counted none.
  total, counted = counts.lookup(keys)
  before = jnp.where(counted, total - occurrences, 0)
  admitted = candidates & (before + earlier + 1 >= min_count)
  return counts.remove(keys, valid=admitted), admitted
