"""The dynamic-embedding example: row assignment, gradients, training and exact resume."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxres as jr
from jaxres._shell.resource import ResourceState
from jaxres.examples import ClickStream, DynamicEmbedding, Run, RunConfig, take_rows

NUM_ROWS, NUM_OOV = 12, 3


@nnx.jit
def jitted_assign(embedding, ids):
  return embedding.assign(ids)


def eager_assign(embedding, ids):
  return embedding.assign(ids)


@pytest.mark.parametrize("assign", [eager_assign, jitted_assign], ids=["eager", "nnx.jit"])
def test_rows_follow_first_occurrence_and_full_table_policy(assign):
  """Rows 0, 1, ... in first-occurrence order, like a loop; then shared rows, stable per id."""
  rng = np.random.default_rng(0)
  embedding = DynamicEmbedding(NUM_ROWS, 2, rngs=nnx.Rngs(0), num_oov_rows=NUM_OOV)
  oracle, shared, oov_lookups = {}, {}, 0
  for _ in range(6):
    ids = rng.integers(-40, 40, size=(3, 4)) * (2**40 + 1)  # 64-bit ids, duplicates within batches
    rows = np.asarray(assign(embedding, jr.keys.split64(ids)))
    assert rows.shape == ids.shape
    for key, row in zip(ids.ravel().tolist(), rows.ravel().tolist()):
      if key not in oracle and len(oracle) < NUM_ROWS:
        oracle[key] = len(oracle)
      if key in oracle:
        assert row == oracle[key]
      else:
        assert NUM_ROWS <= row < NUM_ROWS + NUM_OOV
        assert shared.setdefault(key, row) == row  # the same shared row every time
        oov_lookups += 1
  assert shared, "the test must fill the table"
  keys, values = embedding.ids.export()  # eager use: no keys reported lost
  assert dict(zip(keys.tolist(), values.tolist())) == oracle
  assert int(embedding.oov_lookups.get_value()) == oov_lookups
  assert int(embedding.ids.state.dropped) == 0


def test_assign_handles_empty_batches_and_rejects_bad_ids():
  embedding = DynamicEmbedding(4, 2, rngs=nnx.Rngs(0))
  assert embedding.assign(np.zeros((0,), np.int64)).shape == (0,)
  assert embedding(np.zeros((0, 3), np.int64)).shape == (0, 3, 2)
  with pytest.raises(TypeError, match="keys"):
    embedding.assign(jnp.array([1, 2], jnp.int32))  # int32 given to an int64 table
  assert len(embedding.ids) == 0
  with pytest.raises(ValueError, match="initial_capacity"):  # num_rows is the table's capacity
    DynamicEmbedding(0, 2, rngs=nnx.Rngs(0))


def test_take_rows_gradient_is_the_scatter_add_and_deterministic():
  rng = np.random.default_rng(1)
  matrix = jnp.asarray(rng.normal(size=(10, 3)), jnp.float32)
  rows = jnp.asarray(rng.integers(0, 10, size=(7, 5)), jnp.int32)  # many repeats
  weights = jnp.asarray(rng.normal(size=(7, 5, 3)), jnp.float32)
  grad = jax.jit(jax.grad(lambda m: jnp.sum(take_rows(m, rows) * weights)))
  expected = np.zeros((10, 3), np.float64)
  np.add.at(expected, np.asarray(rows), np.asarray(weights, np.float64))
  got = grad(matrix)
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
  assert np.array_equal(take_rows(matrix, rows), matrix[rows])
  assert all(np.array_equal(grad(matrix), got) for _ in range(3))


def test_gradients_reach_exactly_the_rows_looked_up():
  config = RunConfig(capacity=64, num_fields=3, batch_size=8)
  model = config.model()
  ids = jr.keys.split64(ClickStream(batch_size=8, num_fields=3).batch(0).ids)

  def loss(model):
    return jnp.sum(model(ids))

  grads = nnx.jit(nnx.grad(loss))(model)
  used = np.asarray(jnp.any(grads.embedding.rows.get_value() != 0, axis=1))
  assigned = np.zeros(64 + 8, bool)
  assigned[np.asarray(model.embedding.ids.export()[1])] = True
  assert np.array_equal(used, assigned)


SMALL = RunConfig(capacity=512, num_fields=3, batch_size=64, features=8, hidden=16, vocab_size=2000)


def test_training_lowers_the_loss(tmp_path):
  run = Run(SMALL, tmp_path, checkpoint_every=None)
  losses = run.train(80)
  assert losses.shape == (80,) and np.isfinite(losses).all()
  assert losses[-20:].mean() < losses[:20].mean() - 0.02
  assert 0 < len(run.model.embedding.ids) <= SMALL.capacity


def test_restart_with_deferred_restore_continues_bitwise(tmp_path):
  uninterrupted = Run(SMALL, tmp_path / "a", checkpoint_every=None)
  expected = uninterrupted.train(10)

  first = Run(SMALL, tmp_path / "b", checkpoint_every=4)
  assert np.array_equal(first.train(6), expected[:6])
  first.close()
  assert first.manager.all_steps() == [4]

  restarted = Run(SMALL, tmp_path / "b", checkpoint_every=4)  # a fresh model: restored on attach
  assert restarted.deferred == ["model", "optimizer"] and restarted.step == 4
  resumed = restarted.train(6)
  assert resumed.view(np.uint32).tolist() == expected[4:].view(np.uint32).tolist()
  for ours, theirs in [
    (restarted.model, uninterrupted.model),
    (restarted.optimizer, uninterrupted.optimizer),
  ]:
    # Table layouts may differ (restore reinserts the entries); their contents are compared below.
    a, b = (nnx.to_flat_state(nnx.state(m, nnx.Not(ResourceState))) for m in (ours, theirs))
    assert [p for p, _ in a] == [p for p, _ in b]
    for (path, x), (_, y) in zip(a, b):
      assert jax.tree.all(jax.tree.map(lambda u, v: np.array_equal(u, v), x.get_value(), y.get_value())), path
  keys, rows = restarted.model.embedding.ids.export()
  keys_b, rows_b = uninterrupted.model.embedding.ids.export()
  assert np.array_equal(keys, keys_b) and np.array_equal(rows, rows_b)
  restarted.close()


def test_tables_configured_alike_share_compiled_functions():
  """NNX keys compiled functions by module structure: equal configs must not retrace."""
  a, b = SMALL.model(), SMALL.model()
  assert nnx.graphdef(a) == nnx.graphdef(b)
  other = jr.MutableHashTable(np.int64, np.int32, default_value=-2, initial_capacity=SMALL.capacity)
  assert nnx.graphdef(a.embedding.ids) != nnx.graphdef(other)
  traces = []

  @nnx.jit
  def size(model):
    traces.append(1)
    return model.embedding.ids.size()

  size(a), size(b)
  assert len(traces) == 1
