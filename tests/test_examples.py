"""The click-model example: training lowers the loss, resumes bitwise, and compiles once."""

import jax
import numpy as np
import pytest
from flax import nnx

from jaxres.examples import Run, RunConfig

pytestmark = pytest.mark.filterwarnings("error::jaxres.TableCopyWarning")  # the examples donate

SMALL = RunConfig(capacity=256, num_fields=3, batch_size=64, features=8, hidden=16, vocab_size=2000)


def test_training_lowers_the_loss(tmp_path):
  run = Run(SMALL, tmp_path, checkpoint_every=None)
  losses = run.train(80)
  assert losses.shape == (80,) and np.isfinite(losses).all()
  assert losses[-20:].mean() < losses[:20].mean() - 0.02
  embedding = run.model.embedding
  stats = embedding.stats()
  assert 0 < embedding.size() <= SMALL.capacity
  assert stats["evictions"] > 0 and stats["refused"] > 0  # the table filled; ids seen once have no row


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
    a, b = (nnx.to_flat_state(nnx.state(m, nnx.Param)) for m in (ours, theirs))
    assert [p for p, _ in a] == [p for p, _ in b]
    for (path, x), (_, y) in zip(a, b):
      assert np.array_equal(x.get_value(), y.get_value()), path
  for got, want in zip(restarted.model.embedding.export(), uninterrupted.model.embedding.export()):
    assert got.tobytes() == want.tobytes()
  assert restarted.model.embedding.stats() == uninterrupted.model.embedding.stats()
  restarted.close()


def test_models_configured_alike_share_compiled_functions():
  """NNX keys compiled functions by module structure: equal configs must not retrace."""
  a, b = SMALL.model(), SMALL.model()
  assert nnx.graphdef(a) == nnx.graphdef(b)
  traces = []

  @nnx.jit(donate_argnums=0)
  def size(model):
    traces.append(1)
    return model.embedding.table.get_value().size

  size(a), size(b)
  assert len(traces) == 1
  assert jax.tree.structure(nnx.state(a)) == jax.tree.structure(nnx.state(b))


def test_the_drift_stream_brings_ids_that_peak_and_fade():
  from jaxres.examples import DriftStream

  stream = DriftStream(batch_size=256, num_fields=2, arrivals=8, lifetime=40, seed=3)
  assert (
    stream.batch(7).ids.tobytes()
    == DriftStream(batch_size=256, num_fields=2, arrivals=8, lifetime=40, seed=3).batch(7).ids.tobytes()
  )
  assert (
    stream.batch(7).ids.tobytes()
    != DriftStream(batch_size=256, num_fields=2, arrivals=8, lifetime=40, seed=4).batch(7).ids.tobytes()
  )
  seen = [set(stream.batch(step).ids[:, 0].tolist()) for step in range(200)]
  assert not seen[0] & seen[150]  # after twice the lifetime, other ids entirely
  # An id born during the stream: absent, then drawn, then gone, its draws peaking in between.
  counts = {}
  for step, ids in enumerate(seen):
    for key in ids:
      counts.setdefault(key, []).append(step)
  born_late = [steps for steps in counts.values() if steps[0] > 100 and len(steps) > 20]
  assert born_late, "no id of the stream's own became popular"
  for steps in born_late:
    assert steps[-1] - steps[0] < 2 * 40 + 1  # drawn for at most twice the lifetime
  batch = stream.batch(0)
  assert batch.labels.shape == (256,) and 0 < batch.probabilities.min() <= batch.probabilities.max() < 1


def test_a_run_on_the_drift_task_learns(tmp_path):
  config = RunConfig(capacity=256, num_fields=2, batch_size=64, features=8, hidden=16, task="drift")
  losses = Run(config, tmp_path, checkpoint_every=None).train(60)
  assert np.isfinite(losses).all() and losses[-15:].mean() < losses[:15].mean()
  with pytest.raises(ValueError, match="task"):
    RunConfig(task="weather").stream()
