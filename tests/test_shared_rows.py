"""``DynamicEmbedding(..., oov_buckets=n)``: ids without a row of their own read and train shared rows.

The oracle runs the same batches through an embedding without shared rows: its own rows must be
the same bit for bit (shared rows never touch them), and where it reads zeros (an id without a
row) the embedding with shared rows reads one of its shared rows, always the same one for an id,
trained by NumPy with the summed gradients of the ids that read it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from oracle import mesh_of

import jaxres as jr

FEATURES = 3
POOL = (np.arange(40, dtype=np.int64) * 7919 + 2**40) * np.array([1, -1] * 20)  # 64-bit ids, exact
SGD = optax.sgd(0.5)
BUCKETS = 5


def _embedding(oov_buckets=BUCKETS, optimizer=SGD, **options):
  options = {"eviction": jr.LRU(), "min_count": 2} | options
  return jr.DynamicEmbedding(
    8, FEATURES, optimizer=optimizer, rngs=nnx.Rngs(0), oov_buckets=oov_buckets, **options
  )


def _batches(seed, steps, size=12):
  rng = np.random.default_rng(seed)
  return [
    (rng.choice(POOL, size), rng.normal(size=(size, FEATURES)).astype(np.float32)) for _ in range(steps)
  ]


def _shared(emb) -> np.ndarray:
  return np.asarray(emb.shared.get_value()["row"], np.float64)


@pytest.mark.parametrize("sharded", [False, True], ids=["one_device", "sharded"])
def test_ids_without_a_row_read_and_train_their_shared_row(sharded):
  mesh = {"mesh": mesh_of(4), "axis": "shard"} if sharded else {}
  emb, plain = _embedding(**mesh), _embedding(oov_buckets=0, **mesh)
  shared, bucket_of = _shared(emb), {}
  for ids, grads in _batches(seed=1, steps=10):
    rows, reference = np.asarray(emb(ids)), np.asarray(plain(ids))
    own = reference.any(axis=1)  # an id without a row reads zeros without shared rows
    np.testing.assert_array_equal(rows[own], reference[own])
    for key, row in zip(ids[~own].tolist(), rows[~own]):
      matches = np.flatnonzero(np.all(np.isclose(shared, row, rtol=1e-5, atol=1e-5), axis=1))
      assert len(matches) == 1, (key, row, shared)
      assert bucket_of.setdefault(key, int(matches[0])) == matches[0]  # always the same shared row
    emb.apply_gradients(ids, grads)
    plain.apply_gradients(ids, grads)
    for key, grad in zip(ids[~own].tolist(), grads[~own].astype(np.float64)):
      shared[bucket_of[key]] -= 0.5 * grad
    np.testing.assert_allclose(_shared(emb), shared, rtol=1e-5, atol=1e-6)
    for got, want in zip(emb.export(), plain.export()):  # own rows: untouched by shared ones
      assert got.tobytes() == want.tobytes()
  assert len(set(bucket_of.values())) >= 3 and emb.stats()["evictions"] > 0


def test_inference_reads_shared_rows_and_changes_nothing():
  emb = _embedding()
  for ids, grads in _batches(seed=2, steps=4):
    emb(ids)
    emb.apply_gradients(ids, grads)
  before = [np.asarray(x).copy() for x in jax.tree.leaves(nnx.state(emb))]
  emb.eval()
  unseen = np.array([5, -7, 2**50])
  rows = np.asarray(emb(np.concatenate([unseen, POOL])))
  assert [x.tobytes() for x in map(np.asarray, jax.tree.leaves(nnx.state(emb)))] == [
    x.tobytes() for x in before
  ]
  shared = _shared(emb).astype(np.float32)
  for row in rows[:3]:  # unseen ids: a shared row each
    assert any(np.array_equal(row, s) for s in shared)
  ids, own = emb.export()
  for key, row in zip(ids.tolist(), own):
    np.testing.assert_array_equal(rows[3:][POOL.tolist().index(key)], row)


class Tower(nnx.Module):
  def __init__(self, **options):
    self.emb = _embedding(optimizer=optax.adam(0.05), **options)
    self.head = nnx.Linear(FEATURES, 1, rngs=nnx.Rngs(1))


def _step(model, optimizer, ids, labels):
  rows = model.emb(ids)

  def loss_fn(model, rows):
    return jnp.mean((model.head(rows)[..., 0].sum(axis=1) - labels) ** 2)

  loss, (grads, row_grads) = nnx.value_and_grad(loss_fn, argnums=(0, 1))(model, rows)
  optimizer.update(model, grads)
  model.emb.apply_gradients(ids, row_grads)
  return loss


_jit_step = nnx.jit(_step, donate_argnums=(0, 1))


def _trained(model, batches, jit=True):
  optimizer = nnx.Optimizer(model, optax.adam(0.05), wrt=nnx.Param)
  for ids, labels in batches:
    if jit:
      _jit_step(model, optimizer, jr.keys.split64(ids), labels)
    else:
      _step(model, optimizer, ids, labels)
  return model, optimizer


def _tower_batches(seed, steps):
  rng = np.random.default_rng(seed)
  return [(rng.choice(POOL, (6, 2)), rng.normal(size=6).astype(np.float32)) for _ in range(steps)]


def test_jitted_steps_match_eager_ones_and_checkpoints_resume_bitwise(tmp_path):
  batches = _tower_batches(3, 8)
  jitted, _ = _trained(Tower(), batches)
  eager, _ = _trained(Tower(), batches, jit=False)
  np.testing.assert_allclose(_shared(jitted.emb), _shared(eager.emb), rtol=1e-5, atol=1e-6)
  first, optimizer = _trained(Tower(), batches[:4])
  jr.Checkpoint(model=first, optimizer=optimizer).save(tmp_path / "ckpt")
  resumed = Tower()
  resumed_optimizer = nnx.Optimizer(resumed, optax.adam(0.05), wrt=nnx.Param)
  jr.Checkpoint(model=resumed, optimizer=resumed_optimizer).restore(tmp_path / "ckpt").assert_consumed()
  assert _shared(resumed.emb).tobytes() == _shared(first.emb).tobytes()
  for ids, labels in batches[4:]:
    _jit_step(resumed, resumed_optimizer, jr.keys.split64(ids), labels)
  assert _shared(resumed.emb).tobytes() == _shared(jitted.emb).tobytes()
  for got, want in zip(resumed.emb.export(), jitted.emb.export()):
    assert got.tobytes() == want.tobytes()


def test_a_checkpoint_of_other_shared_rows_is_refused_naming_them(tmp_path):
  jr.Checkpoint(emb=_embedding()).save(tmp_path / "ckpt")
  other = _embedding(oov_buckets=BUCKETS + 1)
  before = _shared(other).tobytes()
  with pytest.raises((TypeError, ValueError), match="emb/shared"):
    jr.Checkpoint(emb=other).restore(tmp_path / "ckpt")
  assert _shared(other).tobytes() == before
  with pytest.raises(AssertionError, match="emb/shared"):  # restored without them: left unconsumed
    jr.Checkpoint(emb=_embedding(oov_buckets=0)).restore(tmp_path / "ckpt").assert_consumed()


def test_served_ids_without_a_row_read_their_shared_row(tmp_path):
  model, _ = _trained(Tower(), _tower_batches(4, 6))
  spec = jax.ShapeDtypeStruct(("batch", 2), jnp.int64)
  lookup = {"rows": jr.saved_model.Signature(lambda m, ids: m.emb(ids), ids=spec)}
  jr.saved_model.save(model, tmp_path / "export", lookup, updatable=True)
  served = jr.saved_model.load(tmp_path / "export")
  ids = np.concatenate([POOL, [3, -3, 2**45, 7]]).reshape(-1, 2)
  model.eval()
  expected = np.asarray(model.emb(jr.keys.split64(ids)))
  assert np.asarray(served.signatures["rows"](ids=ids)["output"]).tobytes() == expected.tobytes()
  model.train()
  _trained(model, _tower_batches(5, 3))  # the shared rows change: a delta carries them
  jr.saved_model.save_delta(model, tmp_path / "delta", since=tmp_path / "export", step=1)
  served.update(tmp_path / "delta")
  model.eval()
  expected = np.asarray(model.emb(jr.keys.split64(ids)))
  assert np.asarray(served.signatures["rows"](ids=ids)["output"]).tobytes() == expected.tobytes()
