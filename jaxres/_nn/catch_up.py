"""``jr.CatchUpAdam``: Adam for embedding rows that catches up the steps a row sat idle.

A row-wise ("lazy") Adam updates a row only at the steps its id occurs, so
between two occurrences the row stands still, where dense Adam (every row
updated at every step, with zero gradients for absent ids) keeps moving it
along its momentum. For an embedding whose ids come back every few steps,
that movement is a large part of the training; dense Adam cannot afford
rows the size of a vocabulary, lazy Adam loses the movement.

:class:`CatchUpAdam` keeps, with each row, its Adam moments ``mu`` and
``nu`` and the global step of its last update; the embedding counts steps
(one per ``apply_gradients``). When a row idle for ``k`` steps is updated at
step ``t``, it first makes the ``k`` zero-gradient steps of dense Adam in
closed form, then the step of its gradient:

* idle steps: ``row -= lr * mu_hat / (sqrt(nu_hat) + eps) * S_k`` with
  ``S_k = r + r^2 + ... + r^k``, ``r = b1 / sqrt(b2)``, and ``mu_hat``,
  ``nu_hat`` the moments with step ``t``'s bias corrections; then
  ``mu *= b1^k``, ``nu *= b2^k``.
* the gradient ``g``: ``mu = b1 mu + (1 - b1) g``, ``nu = b2 nu + (1 - b2) g^2``,
  ``row -= lr * mu_hat / (sqrt(nu_hat) + eps)``, bias corrections of step ``t``.

The idle steps are dense Adam's but for two simplifications: their bias
corrections are step ``t``'s (they tend to 1 as training goes on: exact
after the first few thousand steps with ``b2 = 0.999``), and ``eps`` is
added to the root of the moment as the row had it, not decayed step by step
(negligible while ``eps`` is small against the gradients). The cost is a
few scalar operations per row: still O(batch).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxres._nn.rowwise import structure_key


@dataclasses.dataclass(frozen=True, eq=False)
class CatchUpAdam:
  """Adam for :class:`jaxres.DynamicEmbedding` rows, moving each row over the steps it missed.

  Pass it as the embedding's ``optimizer``. Each row keeps ``mu`` and ``nu``
  (as Adam) and the step of its last update (an ``int32``: the memory of
  ``optax.adam``'s per-row ``count``), and the embedding counts its steps.
  A row updated after ``k`` idle steps moves as dense Adam would have moved
  it over them, in closed form (by ``lr * mu_hat / (sqrt(nu_hat) + eps) * S``
  with ``S = r + r^2 + ... + r^k``, ``r = b1 / sqrt(b2)``, its moments decaying
  by ``b1^k`` and ``b2^k``), then takes its gradient's step; lazy Adam
  (``optax.adam``) would leave it where it was. On the click task of :mod:`jaxres.examples` it
  brings the embedding level with hashed tables trained by dense Adam at
  equal memory (see the embeddings guide).

  Args:
    learning_rate: a positive float, or a schedule ``step -> float``
      (called with the number of steps before this one, as optax's
      schedules; the idle steps use the rate of the step that catches them up).
    b1: the decay rate of the first moment, ``0 <= b1 < sqrt(b2)`` (so that
      the idle steps' movement converges).
    b2: the decay rate of the second moment, below 1.
    eps: added to the root of the second moment.

  Examples:
    >>> import numpy as np, jaxres as jr
    >>> from flax import nnx
    >>> emb = jr.DynamicEmbedding(8, 2, optimizer=jr.CatchUpAdam(0.1), rngs=nnx.Rngs(0))
    >>> for step in range(3):                 # id 5 at every step, id 9 at the first only
    ...   ids = np.array([5, 9]) if step == 0 else np.array([5])
    ...   rows = emb(ids)
    ...   emb.apply_gradients(ids, np.ones_like(rows))
    >>> before = emb(np.array([9]))           # 9 sat idle for two steps: not moved yet
    >>> emb.apply_gradients(np.array([9]), np.zeros((1, 2), np.float32))
    >>> moved = before - emb(np.array([9]))   # its momentum's two missed steps and this one
    >>> bool(np.all(moved > 0.1))
    True
  """

  learning_rate: float | Callable
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8

  def __post_init__(self):
    lr = self.learning_rate
    if not callable(lr) and (isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0):
      raise ValueError(f"learning_rate: expected a positive float or a schedule, got {lr!r}.")
    for name in ("b1", "b2", "eps"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{name}: expected a float, got {value!r}.")
    if not (0 <= self.b1 < 1 and 0 < self.b2 < 1 and self.b1**2 < self.b2):
      raise ValueError(
        f"b1, b2: expected 0 <= b1 < sqrt(b2) and b2 < 1 (the idle steps' movement must converge), "
        f"got b1={self.b1}, b2={self.b2}."
      )
    if self.eps < 0:
      raise ValueError(f"eps: expected a non-negative float, got {self.eps}.")

  def __eq__(self, other) -> bool:
    return isinstance(other, CatchUpAdam) and self._key == other._key

  def __hash__(self) -> int:
    return hash(self._key)

  @property
  def _key(self):  # schedules built alike are equal (see structure_key): compiled steps are reused
    return (structure_key(self.learning_rate), self.b1, self.b2, self.eps)

  def for_rows(self, features: int) -> RowAdam:
    """The row optimizer of rows of ``features`` values."""
    return RowAdam(self, features)

  def init(self, params):
    """Raises ``TypeError``: a row optimizer is not an optax transformation (``nnx.Optimizer`` calls this)."""
    del params
    raise TypeError(_NOT_OPTAX)

  def update(self, updates, state, params=None):
    """Raises ``TypeError``, as :meth:`init`."""
    del updates, state, params
    raise TypeError(_NOT_OPTAX)


_NOT_OPTAX = (
  "jr.CatchUpAdam is a row optimizer, not an optax transformation: give it to "
  "jr.DynamicEmbedding(optimizer=...) or jr.TableConfig(optimizer=...), which keep its state with each "
  "row; for dense parameters (nnx.Optimizer, optax.chain) use optax.adam."
)


@dataclasses.dataclass(frozen=True)
class RowAdam:
  """A :class:`CatchUpAdam` for rows of ``features`` values: the row optimizer of an embedding."""

  settings: CatchUpAdam
  features: int
  needs_step = True  # the embedding counts its steps and passes the current one
  name = "jr.CatchUpAdam"  # for reprs

  @property
  def slots(self) -> tuple[jax.ShapeDtypeStruct, ...]:
    """One row's state leaves: ``mu``, ``nu`` and the step of its last update."""
    row = jax.ShapeDtypeStruct((self.features,), jnp.float32)
    return (row, row, jax.ShapeDtypeStruct((), jnp.int32))

  def init(self, rows: jax.Array) -> list[jax.Array]:
    """Zero moments, and no update yet (step 0), for ``rows`` (``[n, features]``)."""
    return [jnp.zeros_like(rows), jnp.zeros_like(rows), jnp.zeros(rows.shape[:1], jnp.int32)]

  def update(self, grads: jax.Array, rows: jax.Array, slots, step: jax.Array) -> tuple[jax.Array, list]:
    """``(rows, slots)`` after step ``step`` (``int32``, from 1) with the gradients ``grads``."""
    s = self.settings
    mu, nu, last = slots
    t = step.astype(jnp.float32)
    lr = s.learning_rate(step - 1) if callable(s.learning_rate) else s.learning_rate
    idle = jnp.maximum(step - last - 1, 0).astype(jnp.float32)[:, None]
    c1, c2 = 1 - s.b1**t, 1 - s.b2**t

    def step_of(mu, nu):
      return lr * (mu / c1) / (jnp.sqrt(nu / c2) + s.eps)

    r = s.b1 / math.sqrt(s.b2)
    missed = r * (1 - r**idle) / (1 - r)  # r + r^2 + ... + r^idle
    rows = rows - step_of(mu, nu) * missed
    mu, nu = mu * s.b1**idle, nu * s.b2**idle
    mu = s.b1 * mu + (1 - s.b1) * grads
    nu = s.b2 * nu + (1 - s.b2) * jnp.square(grads)
    rows = rows - step_of(mu, nu)
    return rows, [mu, nu, jnp.broadcast_to(step, last.shape).astype(jnp.int32)]
