"""``jr.CatchUpAdam``: embedding rows that catch up, in closed form, the Adam steps they sat idle.

Two oracles: a NumPy model of the stated rule, step by step in float64 (every row, every step,
evictions none), and dense ``optax.adam`` over a matrix of all the ids with zero gradients for
the absent ones, which the rule equals once the bias corrections have settled.
"""

import math

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from oracle import mesh_of

import jaxres as jr

FEATURES = 3
POOL = (np.arange(12, dtype=np.int64) * 7919 + 2**40) * np.array([1, -1] * 6)  # 64-bit ids, exact


def _embedding(optimizer, **options):
  return jr.DynamicEmbedding(64, FEATURES, optimizer=optimizer, rngs=nnx.Rngs(0), **options)


class _Rule:
  """The rule of ``jaxres._nn.catch_up``, one row at a time, in float64."""

  def __init__(self, lr, b1, b2, eps):
    self.lr, self.b1, self.b2, self.eps = lr, b1, b2, eps
    self.state = {}  # id -> [row, mu, nu, last]

  def update(self, key, grad, t):
    row, mu, nu, last = self.state[key]
    c1, c2 = 1 - self.b1**t, 1 - self.b2**t
    idle = t - last - 1
    moved = sum((self.b1 / math.sqrt(self.b2)) ** i for i in range(1, idle + 1))
    row = row - self.lr * (mu / c1) / (np.sqrt(nu / c2) + self.eps) * moved
    mu, nu = mu * self.b1**idle, nu * self.b2**idle
    mu = self.b1 * mu + (1 - self.b1) * grad
    nu = self.b2 * nu + (1 - self.b2) * grad**2
    self.state[key] = [row - self.lr * (mu / c1) / (np.sqrt(nu / c2) + self.eps), mu, nu, t]


@pytest.mark.parametrize("sharded", [False, True], ids=["one_device", "sharded"])
def test_rows_follow_the_rule_step_by_step(sharded):
  mesh = {"mesh": mesh_of(4), "axis": "shard"} if sharded else {}
  emb = _embedding(jr.CatchUpAdam(0.05, b1=0.8, b2=0.95, eps=1e-6), **mesh)
  rule, rng = _Rule(0.05, 0.8, 0.95, 1e-6), np.random.default_rng(3)
  for t in range(1, 31):
    ids = rng.choice(POOL[: rng.integers(2, len(POOL) + 1)], 6)  # some ids idle for long spans
    grads = rng.normal(size=(6, FEATURES)).astype(np.float32)
    rows = np.asarray(emb(ids), np.float64)
    for key, row in zip(ids.tolist(), rows):
      if key in rule.state:
        np.testing.assert_allclose(row, rule.state[key][0], rtol=2e-5, atol=1e-6)
      else:  # a new row: the embedding's initial row, no moments, no update yet
        rule.state[key] = [row, np.zeros(FEATURES), np.zeros(FEATURES), 0]
    emb.apply_gradients(ids, grads)
    for key in np.unique(ids).tolist():  # repeated ids: one update with their summed gradients
      rule.update(key, grads[ids == key].astype(np.float64).sum(axis=0), t)
  assert int(emb.step.get_value()) == 30
  got_ids, got_rows = emb.export()
  np.testing.assert_allclose(got_rows, [rule.state[k][0] for k in got_ids.tolist()], rtol=2e-5, atol=1e-6)


def test_rows_equal_dense_adam_once_the_bias_corrections_settle():
  """With b2 = 0.6 the bias corrections are 1 in float32 from step 40 on: every idle span caught up
  after that is exactly dense Adam's, where lazy Adam leaves the rows behind."""
  lr, b1, b2 = 0.05, 0.5, 0.6
  warm, steps, rng = 40, 90, np.random.default_rng(0)
  zeros = nnx.initializers.zeros
  catching_up = _embedding(jr.CatchUpAdam(lr, b1=b1, b2=b2), initializer=zeros)
  lazy = _embedding(optax.adam(lr, b1=b1, b2=b2), initializer=zeros)
  dense, dense_adam = jnp.zeros((len(POOL), FEATURES)), optax.adam(lr, b1=b1, b2=b2)
  state = dense_adam.init(dense)
  for t in range(steps):
    # ids[0] at every step (it counts the warm-up); the others from step `warm` on, now and then
    present = [0] if t < warm else [0, *np.flatnonzero(rng.random(len(POOL) - 1) < 0.3) + 1]
    if t == steps - 1:  # every id, with a zero gradient: each row catches up its idle steps
      present = list(range(len(POOL)))
    ids = POOL[present]
    grads = rng.normal(size=(len(ids), FEATURES)).astype(np.float32) * (t < steps - 1)
    for emb in (catching_up, lazy):
      emb(ids)
      emb.apply_gradients(ids, grads)
    updates, state = dense_adam.update(jnp.zeros_like(dense).at[np.array(present)].set(grads), state)
    dense = optax.apply_updates(dense, updates)
  want = np.asarray(dense)[np.argsort(POOL)]  # export() sorts by id
  np.testing.assert_allclose(catching_up.export()[1], want, rtol=1e-4, atol=1e-6)
  assert np.abs(lazy.export()[1] - want).max() > 1e-2  # without catching up the rows lag behind


def test_the_step_count_and_the_rows_resume_from_a_checkpoint(tmp_path):
  def train(emb, seed, steps):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
      ids = rng.choice(POOL, 5)
      emb(ids)
      emb.apply_gradients(ids, rng.normal(size=(5, FEATURES)).astype(np.float32))

  first = _embedding(jr.CatchUpAdam(0.1), eviction=jr.LRU())
  train(first, seed=0, steps=7)
  jr.Checkpoint(emb=first).save(tmp_path / "ckpt")
  resumed = _embedding(jr.CatchUpAdam(0.1), eviction=jr.LRU())
  jr.Checkpoint(emb=resumed).restore(tmp_path / "ckpt").assert_consumed()
  assert int(resumed.step.get_value()) == 7
  for emb in (first, resumed):
    train(emb, seed=1, steps=4)
  np.testing.assert_array_equal(resumed.export()[1], first.export()[1])


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    ({"learning_rate": 0.0}, ValueError, "learning_rate"),
    ({"learning_rate": "fast"}, ValueError, "learning_rate"),
    ({"learning_rate": 0.1, "b1": 0.99, "b2": 0.9}, ValueError, "b1, b2"),
    ({"learning_rate": 0.1, "b2": 1.0}, ValueError, "b1, b2"),
    ({"learning_rate": 0.1, "b1": None}, TypeError, "b1"),
    ({"learning_rate": 0.1, "eps": -1.0}, ValueError, "eps"),
  ],
)
def test_bad_settings_are_refused(kwargs, error, match):
  with pytest.raises(error, match=match):
    jr.CatchUpAdam(**kwargs)


def test_settings_built_alike_are_equal():
  schedule = optax.cosine_decay_schedule
  assert jr.CatchUpAdam(0.1) == jr.CatchUpAdam(0.1) and hash(jr.CatchUpAdam(0.1)) == hash(jr.CatchUpAdam(0.1))
  assert jr.CatchUpAdam(schedule(0.1, 100)) == jr.CatchUpAdam(schedule(0.1, 100))
  assert jr.CatchUpAdam(0.1) != jr.CatchUpAdam(0.1, b1=0.8)
