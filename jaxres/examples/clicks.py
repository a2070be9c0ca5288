"""A click-through-rate task on synthetic data, and a model for it."""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np
import optax
from flax import nnx

import jaxres as jr

_MIX = np.uint64(0x9E3779B97F4A7C15)  # odd: multiplying by it permutes the 64-bit integers
_INIT = nnx.initializers.normal(0.05)
_LRU = jr.LRU()


def _mix64(x: np.ndarray) -> np.ndarray:
  """A bijective scramble of uint64 (splitmix64's finaliser)."""
  with np.errstate(over="ignore"):
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class ClickBatch(NamedTuple):
  ids: np.ndarray  # int64[batch, fields]: one categorical feature id per field
  labels: np.ndarray  # float32[batch]: 1.0 for a click
  probabilities: np.ndarray  # float32[batch]: the true click probability


class ClickStream:
  """Synthetic click-through data: Zipf-distributed 64-bit ids, clicks from a hidden rule.

  Each example has one id per field (think user, item, site, ...). Within a
  field, ids follow a Zipf law over ``vocab_size`` values, scrambled over the
  whole int64 range as hashed feature ids are. Every id carries a hidden
  weight (a fixed hash of the id, uniform in [-2, 2]); an example is clicked
  with probability ``sigmoid(sum of its ids' weights - 1)``. A model can only
  do well by learning a parameter per id, and the frequent ids are learned
  first.

  ``batch(step)`` depends on ``(seed, step)`` alone, so a restarted run sees
  the same data as an uninterrupted one.

  Examples:
    >>> from jaxres.examples import ClickStream
    >>> stream = ClickStream(batch_size=4, num_fields=3, seed=0)
    >>> batch = stream.batch(0)
    >>> batch.ids.shape, batch.ids.dtype, batch.labels.shape
    ((4, 3), dtype('int64'), (4,))
    >>> bool((stream.batch(0).ids == batch.ids).all())
    True
  """

  def __init__(
    self, *, batch_size: int = 512, num_fields: int = 4, vocab_size: int = 100_000, zipf: float = 1.05, seed=0
  ):
    self.batch_size, self.num_fields, self.vocab_size, self.seed = batch_size, num_fields, vocab_size, seed
    weights = np.arange(1, vocab_size + 1, dtype=np.float64) ** -zipf
    self._cdf = np.cumsum(weights) / weights.sum()

  def batch(self, step: int) -> ClickBatch:
    """The examples of training step ``step``."""
    rng = np.random.default_rng([self.seed, step])
    ranks = np.searchsorted(self._cdf, rng.random((self.batch_size, self.num_fields)), side="right")
    fields = np.arange(self.num_fields, dtype=np.uint64)
    ids = _mix64((fields << np.uint64(40)) + ranks.astype(np.uint64))
    weights = (_mix64(ids ^ _MIX) >> np.uint64(11)).astype(np.float64) / 2.0**53 * 4.0 - 2.0
    probabilities = 1.0 / (1.0 + np.exp(1.0 - weights.sum(axis=1)))
    labels = rng.random(self.batch_size) < probabilities
    return ClickBatch(ids.view(np.int64), labels.astype(np.float32), probabilities.astype(np.float32))


class DriftStream:
  """Click-through data whose ids appear, peak and fade, as new items and users do.

  Each field (think item, user, site) receives ``arrivals`` new ids per step.
  An id born at step ``b`` is drawn with a popularity ``w * (a / tau) *
  exp(1 - a / tau)`` at age ``a = step - b``: it rises, peaks after ``tau =
  lifetime / 4`` steps and fades, and is not drawn after ``lifetime * 2``;
  ``w``, its base popularity, is heavy-tailed (Pareto, index 1.1), so a few
  ids of each generation are hits. As in :class:`ClickStream`, every id
  carries a hidden weight (a fixed hash of the id, uniform in [-2, 2]) and an
  example is clicked with probability ``sigmoid(sum of its ids' weights -
  1)``: a model does well by learning the ids of the moment and letting the
  old ones go. The stream starts in its steady state (ids of every age).

  ``batch(step)`` depends on ``(seed, step)`` alone.

  Examples:
    >>> from jaxres.examples import DriftStream
    >>> stream = DriftStream(batch_size=4, num_fields=3, seed=0)
    >>> early, late = stream.batch(0).ids, stream.batch(5000).ids
    >>> early.shape, early.dtype, bool(set(early.ravel()) & set(late.ravel()))
    ((4, 3), dtype('int64'), False)
  """

  def __init__(
    self, *, batch_size: int = 512, num_fields: int = 4, arrivals: int = 64, lifetime: int = 400, seed=0
  ):
    if arrivals < 1 or lifetime < 4:
      raise ValueError(f"arrivals, lifetime: expected >= 1 and >= 4, got {arrivals} and {lifetime}.")
    self.batch_size, self.num_fields, self.seed = batch_size, num_fields, seed
    self.arrivals, self.lifetime = arrivals, lifetime

  def popularity(self, field: int, born: np.ndarray, step: int) -> np.ndarray:
    """The (unnormalised) popularity at ``step`` of the ids of ``field`` born at steps ``born``."""
    tau = self.lifetime / 4
    age = (step + 2 * self.lifetime) - born  # the stream starts in its steady state
    k = np.round(born * self.arrivals).astype(np.uint64)
    salt = _mix64(np.uint64(field) + (np.uint64(self.seed) << np.uint64(16)))
    u = (_mix64(k ^ salt) >> np.uint64(11)) / 2.0**53
    base = (1.0 - u) ** (-1 / 1.1)  # Pareto(1.1): a few hits among many
    return np.where((age >= 0) & (age < 2 * self.lifetime), base * (age / tau) * np.exp(1 - age / tau), 0.0)

  def batch(self, step: int) -> ClickBatch:
    """The examples of training step ``step``."""
    rng = np.random.default_rng([self.seed, step, 1])
    now = step + 2 * self.lifetime
    first = max(0, (now - 2 * self.lifetime) * self.arrivals)
    index = np.arange(first, now * self.arrivals + 1)  # every id of every field alive now
    ids = np.empty((self.batch_size, self.num_fields), np.uint64)
    for field in range(self.num_fields):
      weights = self.popularity(field, index / self.arrivals, step)
      cdf = np.cumsum(weights) / weights.sum()
      drawn = np.searchsorted(cdf, rng.random(self.batch_size), side="right")
      chosen = index[np.minimum(drawn, len(index) - 1)]
      ids[:, field] = _mix64((np.uint64(field + 8) << np.uint64(40)) + chosen.astype(np.uint64))
    weights = (_mix64(ids ^ _MIX) >> np.uint64(11)).astype(np.float64) / 2.0**53 * 4.0 - 2.0
    probabilities = 1.0 / (1.0 + np.exp(1.0 - weights.sum(axis=1)))
    labels = rng.random(self.batch_size) < probabilities
    return ClickBatch(ids.view(np.int64), labels.astype(np.float32), probabilities.astype(np.float32))


class ClickModel(nnx.Module):
  """Click-through model: a :class:`jaxres.DynamicEmbedding` row per id, then a small MLP.

  Args:
    capacity: embedding rows that ids can take.
    num_fields: ids per example.
    optimizer: the embedding rows' row-wise optax transformation.
    rngs: ``nnx.Rngs`` for the parameters and the new rows.
    features: embedding width.
    hidden: width of the hidden layer.
    eviction: the embedding's eviction policy.
    min_count: occurrences an id needs to get a row.
    oov_buckets: shared rows read and trained by ids without a row of their own (0: zeros).
    admission_capacity: ids the admission counts hold (default ``capacity``).

  Examples:
    >>> import optax, jaxres as jr
    >>> from flax import nnx
    >>> from jaxres.examples import ClickModel, ClickStream
    >>> model = ClickModel(1024, num_fields=3, optimizer=optax.adam(0.01), rngs=nnx.Rngs(0))
    >>> batch = ClickStream(batch_size=8, num_fields=3).batch(0)
    >>> model(jr.keys.split64(batch.ids)).shape
    (8,)
  """

  def __init__(
    self,
    capacity: int,
    *,
    num_fields: int,
    optimizer: optax.GradientTransformation,
    rngs: nnx.Rngs,
    features: int = 16,
    hidden: int = 64,
    eviction=_LRU,
    min_count: int = 2,
    oov_buckets: int = 0,
    admission_capacity: int | None = None,
  ):
    self.embedding = jr.DynamicEmbedding(
      capacity,
      features,
      optimizer=optimizer,
      eviction=eviction,
      min_count=min_count,
      initializer=_INIT,
      rngs=rngs,
      oov_buckets=oov_buckets,
      admission_capacity=admission_capacity,
    )
    self.hidden = nnx.Linear(num_fields * features, hidden, rngs=rngs)
    self.output = nnx.Linear(hidden, 1, rngs=rngs)

  def head(self, rows: jax.Array) -> jax.Array:
    """Click logits ``float32[batch]`` from the rows ``[batch, fields, features]``."""
    x = rows.reshape(rows.shape[0], -1)
    return self.output(nnx.relu(self.hidden(x)))[:, 0]

  def __call__(self, ids) -> jax.Array:
    """Click logits ``float32[batch]`` for ids ``[batch, fields]`` (as word pairs: ``[batch, fields, 2]``)."""
    return self.head(self.embedding(ids))
