"""Eviction policies: how a full table chooses which entry a new key replaces.

A table created with ``eviction=`` keeps one ``uint32`` score per entry and a
``uint32`` clock. Every call that names keys (``insert``, ``find_or_insert``,
``insert_or_apply`` and their ``*_and_evict`` forms) sets their scores by the
policy; reads never change a table. When a new key arrives and the table holds
``capacity`` entries, it replaces the lowest-score entry among the entries near
its position that the call does not name, if that score is lower than its own;
otherwise the key is refused. Either way the entry that leaves is reported in
:class:`Evicted` and counted in the table's ``evictions``.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

_MAX_SCORE = np.uint32(np.iinfo(np.uint32).max)


class Policy(abc.ABC):
  """Base of the eviction policies: the score a call gives each key it names."""

  takes_scores = False  # whether calls must pass ``scores=``
  counts = False  # whether scores depend on how often a call names a key
  # Whether every key a call names scores above every entry it does not (its score is the
  # clock, which the call advanced): the named entries then need no protection from eviction.
  names_newest = False

  @abc.abstractmethod
  def score(self, old: jax.Array, count: jax.Array, clock: jax.Array) -> jax.Array:
    """``uint32[N]``: the new scores of keys with scores ``old`` (0 for new keys).

    ``count``: how often the call names each key (``None`` unless
    :attr:`counts`); ``clock``: the table's clock, this call included. (Scores
    given by the caller replace these.)
    """

  def __repr__(self) -> str:
    return f"jr.{type(self).__name__}()"


@dataclasses.dataclass(frozen=True, repr=False)
class LRU(Policy):
  """Least recently used: a key's score is the table's ``clock`` at the last call that named it.

  The clock counts the table's mutating calls, so the entry evicted first is
  the one no call has named for longest.

  Examples:
    >>> import jax.numpy as jnp, jaxres as jr
    >>> t = jr.OpenAddressingTable.create(2, key=jnp.int32, value=jnp.float32, eviction=jr.LRU())
    >>> t = t.insert(jnp.array([1, 2]), jnp.array([1.0, 2.0]))
    >>> t = t.insert(jnp.array([1]), jnp.array([1.5]))         # 1 is now the more recent
    >>> t, evicted = t.insert_and_evict(jnp.array([3]), jnp.array([3.0]))
    >>> evicted.keys.tolist(), t.find(jnp.array([1, 2, 3])).tolist()
    ([2], [1.5, 0.0, 3.0])
  """

  names_newest = True

  def score(self, old, count, clock):
    return jnp.broadcast_to(clock, old.shape)


@dataclasses.dataclass(frozen=True, repr=False)
class LFU(Policy):
  """Least frequently used: a key's score is how often calls have named it (saturating).

  Each call adds the key's occurrences in its batch, so a new key needs more
  occurrences in one batch than an entry has gathered to replace it: frequent
  keys stay.

  Examples:
    >>> import jax.numpy as jnp, jaxres as jr
    >>> t = jr.OpenAddressingTable.create(2, key=jnp.int32, value=jnp.float32, eviction=jr.LFU())
    >>> t = t.insert(jnp.array([1, 1, 2]), jnp.ones(3))      # 1 named twice, 2 once
    >>> t.scores(jnp.array([1, 2])).tolist()
    [2, 1]
  """

  counts = True

  def score(self, old, count, clock):
    count = count.astype(jnp.uint32)
    return jnp.where(old > _MAX_SCORE - count, _MAX_SCORE, old + count)


@dataclasses.dataclass(frozen=True, repr=False)
class LRFU(Policy):
  """Least recently and frequently used: how often calls named a key, each time weighing half as much
  every ``half_life`` calls (Lee et al.'s LRFU).

  An entry's weight at clock ``t`` is the sum over the calls that named it, at
  clocks ``t_i``, of ``2 ** ((t_i - t) / half_life)`` per occurrence; entries
  are compared by their weights at the same clock. The score is that weight as
  a time: ``half_life * log2(sum 2 ** (t_i / half_life))``, in calls (rounded
  at each naming). It only grows, so no entry needs rescoring as time passes,
  and a key named once scores the clock of that call, as with ``LRU``; each
  further naming moves it later, by up to ``half_life`` calls (two namings at
  once: exactly ``half_life``). A new key replaces an entry whose weight has
  decayed below its own: ``half_life`` spans the other two policies, ranking
  by recency when small (``LRU``) and by frequency when large (``LFU``).

  Args:
    half_life: calls over which a naming's weight halves (1 to ``2**24``; 256
      by default, the best of 64 to 4096 on the embeddings' synthetic quality
      tasks).

  Examples:
    >>> import jax.numpy as jnp, jaxres as jr
    >>> t = jr.OpenAddressingTable.create(2, key=jnp.int32, value=jnp.float32, eviction=jr.LRFU(16))
    >>> t = t.insert(jnp.array([1, 1, 1, 2]), jnp.ones(4))    # 1 named three times, 2 once
    >>> t.scores(jnp.array([1, 2])).tolist()                 # clock 1, and 1 + 16 * log2(3)
    [26, 1]
    >>> t = t.insert_and_evict(jnp.array([3]), jnp.ones(1))[0]  # one call later: 3 evicts 2
    >>> t.contains(jnp.array([1, 2, 3])).tolist()
    [True, False, True]
  """

  half_life: int = 256

  counts = True

  def __post_init__(self):
    if isinstance(self.half_life, bool) or not isinstance(self.half_life, (int, np.integer)):
      raise TypeError(f"half_life: expected an int, got {self.half_life!r}.")
    if not 1 <= self.half_life <= 2**24:
      raise ValueError(f"half_life: expected 1 to 2**24 calls, got {self.half_life}.")

  def score(self, old, count, clock):
    half_life = np.float32(self.half_life)
    # A naming of `count` occurrences at `clock`, as a time: clock + half_life * log2(count).
    boost = jnp.round(half_life * jnp.log2(count.astype(jnp.float32))).astype(jnp.uint32)
    named = jnp.where(clock > _MAX_SCORE - boost, _MAX_SCORE, clock + boost)
    high, low = jnp.maximum(old, named), jnp.minimum(old, named)
    # log-add of two weights: half_life * log2(2**(high / h) + 2**(low / h)), at most half_life more.
    gap = (high - low).astype(jnp.float32) / half_life
    extra = jnp.round(half_life * jnp.log2(1.0 + jnp.exp2(-gap))).astype(jnp.uint32)
    added = jnp.where(high > _MAX_SCORE - extra, _MAX_SCORE, high + extra)
    return jnp.where(old == 0, named, added)  # 0: a new key (a named one scores its clock, 1 or more)

  def __repr__(self) -> str:
    return f"jr.LRFU(half_life={self.half_life})"


@dataclasses.dataclass(frozen=True, repr=False)
class CustomScore(Policy):
  """Scores chosen by the caller: every call that names keys passes ``scores=`` (``uint32[*batch]``).

  A key named several times in a call takes the score of its last occurrence.

  Examples:
    >>> import jax.numpy as jnp, numpy as np, jaxres as jr
    >>> t = jr.OpenAddressingTable.create(2, key=jnp.int32, value=jnp.float32, eviction=jr.CustomScore())
    >>> t = t.insert(jnp.array([1, 2]), jnp.ones(2), scores=np.array([10, 5], np.uint32))
    >>> t, evicted = t.insert_and_evict(jnp.array([3]), jnp.ones(1), scores=np.array([7], np.uint32))
    >>> evicted.keys.tolist()      # the lowest score left
    [2]
  """

  takes_scores = True

  def score(self, old, count, clock):
    return old  # only entries moved without scores (an import) get here: they keep theirs, 0 if new


def check_policy(eviction: Any) -> Policy | None:
  """``eviction`` if it is ``None`` or a policy object.

  Raises:
    TypeError: anything else (a class instead of an instance, a string).
  """
  if eviction is None or isinstance(eviction, Policy):
    return eviction
  hint = " (an instance: jr.LRU(), not jr.LRU)" if isinstance(eviction, type) else ""
  expected = "None, jr.LRU(), jr.LFU(), jr.LRFU() or jr.CustomScore()"
  raise TypeError(f"eviction: expected {expected}{hint}, got {eviction!r}.")


class Evicted(NamedTuple):
  """The entries a call removed to make room, one row per row of its batch.

  ``valid`` marks the rows that evicted an entry (or whose own key was
  refused: then ``keys`` is that key). Keys come in their exact dtype, as from
  ``export()``; values have the table's value pytree; scores are the entries'
  scores when they left. Every field has the call's batch shape ``[*batch]``.

  Attributes:
    keys: the evicted (or refused) keys, ``[*batch, *key_shape]``.
    values: their values (the table's default where nothing left).
    scores: ``uint32[*batch]``, their scores when they left.
    valid: ``bool[*batch]``, the rows where an entry left.

  Examples:
    >>> import jax.numpy as jnp, jaxres as jr
    >>> t = jr.OpenAddressingTable.create(1, key=jnp.int32, value=jnp.float32, eviction=jr.LRU())
    >>> t, evicted = t.insert(jnp.array([1]), jnp.ones(1)).insert_and_evict(jnp.array([2]), jnp.ones(1))
    >>> evicted.keys.tolist(), evicted.valid.tolist()
    ([1], [True])
  """

  keys: Any
  values: Any
  scores: jax.Array
  valid: jax.Array
