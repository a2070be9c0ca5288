"""Admission by count: an id earns a row at its ``min_count``-th occurrence.

Occurrences of ids that have no row yet are counted in a small table of its
own: a lean table (:mod:`jaxres._core.storages.lean`) with ``jr.LRU()``
eviction, no change stamps and a one- or two-byte count that stops at
``min_count``, about 14.3 bytes a counted 64-bit id (10.2 for 32-bit ids;
the count's type is :func:`count_dtype`). The counting is bounded
(``capacity`` ids) and exact for the ids it holds. When it is full, the id
counted least recently in the new id's two buckets leaves and its count is
lost, so the error is one-sided: an id is never admitted before its
``min_count``-th occurrence, and it is admitted late only if many other
unadmitted ids arrived between two of its occurrences. (A count-min sketch
errs the other way: it over-counts and admits ids early, more and more of
them as its cells fill over a long stream.) An admitted id's count is
removed, so a later eviction of its row makes it start afresh.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxres._core.kernels import grouping
from jaxres._core.policies import LRU
from jaxres._core.storages import registry
from jaxres._core.table import Table
from jaxres._errors import check_int

STORAGE = "lean"  # the storage kind of the counts
MAX_MIN_COUNT = int(np.iinfo(np.uint16).max)  # the most a count holds


def check_min_count(min_count) -> int:
  """``min_count`` as an int, checked to be one an admission count holds (1 to 65,535).

  Raises:
    TypeError: ``min_count`` is not an int.
    ValueError: ``min_count`` below 1 or above :data:`MAX_MIN_COUNT`.

  Examples:
    >>> check_min_count(70_000)
    Traceback (most recent call last):
    ...
    ValueError: min_count: expected 1 <= min_count <= 65535 (what an admission count holds), got 70000.
  """
  expected = f"1 <= min_count <= {MAX_MIN_COUNT} (what an admission count holds)"
  return check_int(min_count, "min_count", low=1, high=MAX_MIN_COUNT, expected=expected)


def count_dtype(min_count: int) -> np.dtype:
  """The dtype of counts that stop at ``min_count``: ``uint8`` up to 255, else ``uint16``.

  Examples:
    >>> count_dtype(2), count_dtype(1000)
    (dtype('uint8'), dtype('uint16'))
  """
  return np.dtype(np.uint8 if check_min_count(min_count) <= np.iinfo(np.uint8).max else np.uint16)


def counter(capacity: int, key, min_count: int) -> Table:
  """An empty count table for ``capacity`` ids of dtype ``key``, its counts stopping at ``min_count``.

  Examples:
    >>> import jax.numpy as jnp
    >>> counts = counter(4096, jnp.int64, min_count=3)
    >>> counts.value_spec.leaves[0].dtype, round(sum(counts.memory().values()) / 4096, 1)
    (dtype('uint8'), 14.4)
  """
  kind = registry.storage(STORAGE)
  dtype = count_dtype(min_count)
  return kind.create(capacity, key=key, value=dtype, default=0, eviction=LRU(), stamps=False)


def admit(counts: Table, keys, words, candidates: jax.Array, min_count: int) -> tuple[Table, jax.Array]:
  """Counts the occurrences of ``keys`` where ``candidates``; ``(counts, admitted)``.

  ``admitted`` (``bool[N]``) marks the candidate rows that are their id's
  ``min_count``-th occurrence or later, in batch order, as if the rows came
  one at a time: an earlier row of the same id in the batch is not admitted.
  ``words`` are the keys' ``uint32[N, W]`` rows (for grouping the batch). A
  count never exceeds ``min_count`` (an admitted id's count is removed), so
  it fits the counts' :func:`count_dtype` however often an id comes.

  Examples:
    >>> import jax.numpy as jnp
    >>> counts = counter(8, jnp.int32, min_count=2)
    >>> ids = jnp.array([4, 5, 4, 4])
    >>> counts, admitted = admit(counts, ids, ids[:, None].astype(jnp.uint32), jnp.ones(4, bool), 2)
    >>> admitted.tolist(), counts.contains(ids).tolist()  # 4 admitted: its count is dropped
    ([False, False, True, True], [False, True, False, False])
    >>> counts.find(jnp.array([5])).tolist()
    [1]
  """
  groups = grouping.group(words, candidates)  # an id's candidate rows, contiguous, in batch order
  position = jnp.arange(words.shape[0], dtype=jnp.int32)
  earlier, occurrences = grouping.unsort(groups, (position - groups.start, groups.end - groups.start + 1))
  counts, rows = counts.find_or_insert_rows(keys, valid=candidates)
  # A found id's count before the batch; a new one's row holds no count yet, a refused one counts none.
  kept = counts.read_rows(rows.index)
  before = jnp.where(rows.found, kept.astype(jnp.int32), 0)
  admitted = candidates & (before + earlier + 1 >= min_count)
  total = jnp.minimum(before + occurrences, min_count).astype(kept.dtype)  # every row of an id: the same
  counts = counts.write_rows(rows.index, total, valid=candidates)  # a refused id's row, -1, is skipped
  return counts.remove(keys, valid=admitted), admitted
