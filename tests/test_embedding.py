"""jr.DynamicEmbedding: row-wise optimizers against NumPy, admission, eviction, checkpoints, sharding."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from oracle import compilations, mesh_of

import jaxres as jr
from jaxres._nn import rowwise

FEATURES = 3
POOL = (np.arange(24, dtype=np.int64) * 7919 + 2**40) * np.array([1, -1] * 12)  # 64-bit ids, exact
SGD, ADAM, SLOW = (
  optax.sgd(0.5),
  optax.adam(0.1),
  optax.sgd(0.05),
)  # shared: modules built alike share compiles


def _embedding(capacity=64, optimizer=ADAM, **kwargs):
  return jr.DynamicEmbedding(capacity, FEATURES, optimizer=optimizer, rngs=nnx.Rngs(0), **kwargs)


def _batches(seed, steps, size=8, pool=POOL):
  rng = np.random.default_rng(seed)
  return [
    (rng.choice(pool, size), rng.normal(size=(size, FEATURES)).astype(np.float32)) for _ in range(steps)
  ]


def _rows(emb) -> dict:
  ids, rows = emb.export()
  return dict(zip(ids.tolist(), rows))


class NumpyRows:
  """The reference: each id's row and optimizer state, updated in float64 by the textbook formulas
  (``learning_rate``: a float, or a schedule of the steps taken before, every id's alike)."""

  def __init__(self, name: str, learning_rate):
    self.name, self.schedule = name, learning_rate if callable(learning_rate) else lambda _: learning_rate
    self.rows, self.mu, self.nu, self.count = {}, {}, {}, collections.Counter()
    self.steps = 0

  def start(self, key: int, row: np.ndarray) -> None:
    self.rows.setdefault(key, row.astype(np.float64))
    self.mu.setdefault(key, np.zeros(FEATURES))
    self.nu.setdefault(key, np.zeros(FEATURES))

  def step(self, ids, grads) -> None:
    totals = collections.defaultdict(lambda: np.zeros(FEATURES))
    for key, grad in zip(ids.tolist(), grads.astype(np.float64)):
      totals[key] += grad
    self.lr = self.schedule(self.steps)
    self.steps += 1
    for key, g in totals.items():
      if self.name == "sgd":
        self.rows[key] -= self.lr * g
        continue
      self.count[key] += 1
      t = self.count[key]
      self.mu[key] = 0.9 * self.mu[key] + 0.1 * g
      self.nu[key] = 0.999 * self.nu[key] + 0.001 * g * g
      mu_hat, nu_hat = self.mu[key] / (1 - 0.9**t), self.nu[key] / (1 - 0.999**t)
      self.rows[key] -= self.lr * mu_hat / (np.sqrt(nu_hat) + 1e-8)


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_a_decaying_schedule_follows_the_embeddings_steps_for_an_id_met_late(name, tmp_path):
  """A schedule on rows reads the embedding's step (the apply_gradients calls before), as a dense
  parameter's would and as jr.CatchUpAdam's: an id met at the sixth step takes the sixth step's
  decayed rate, not the first (Adam's bias corrections count the row's own updates); the step is
  checkpointed, so a restored embedding goes on where the schedule was."""
  schedule = optax.exponential_decay(0.5, transition_steps=1, decay_rate=0.5)
  emb = _embedding(optimizer=(optax.sgd if name == "sgd" else optax.adam)(schedule))
  reference = NumpyRows(name, lambda step: 0.5 * 0.5**step)
  rng = np.random.default_rng(3)
  early, late = POOL[:4], POOL[4:8]
  for ids in [early] * 5 + [np.concatenate([early, late])] * 2:
    grads = rng.normal(size=(len(ids), FEATURES)).astype(np.float32)
    for key, row in zip(ids.tolist(), np.asarray(emb(ids))):
      reference.start(key, row)
    emb.apply_gradients(ids, grads)
    reference.step(ids, grads)
  rows = _rows(emb)
  for key in POOL[:8].tolist():
    np.testing.assert_allclose(rows[key], reference.rows[key], rtol=1e-5, atol=1e-6)
  assert int(emb.step.get_value()) == 7

  jr.Checkpoint(model=emb).save(tmp_path / "ckpt")
  restored = _embedding(optimizer=(optax.sgd if name == "sgd" else optax.adam)(schedule))
  jr.Checkpoint(model=restored).restore(tmp_path / "ckpt").assert_consumed()
  for model in (emb, restored):
    model(late)
    model.apply_gradients(late, np.ones((4, FEATURES), np.float32))
  assert int(restored.step.get_value()) == 8
  expected = _rows(emb)
  for key, row in _rows(restored).items():
    np.testing.assert_array_equal(row, expected[key])


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_rowwise_optimizers_match_numpy_and_leave_other_rows_bitwise(name):
  emb = _embedding(optimizer=SGD if name == "sgd" else ADAM)
  reference = NumpyRows(name, 0.5 if name == "sgd" else 0.1)
  for ids, grads in _batches(seed=1, steps=5):
    rows = np.asarray(emb(ids))
    for key, row in zip(ids.tolist(), rows):
      reference.start(key, row)
      np.testing.assert_allclose(row, reference.rows[key], rtol=1e-5, atol=1e-6)
    before = _rows(emb)
    emb.apply_gradients(ids, grads)
    reference.step(ids, grads)
    after = _rows(emb)
    assert after.keys() == before.keys()
    for key, row in after.items():
      if key in set(ids.tolist()):
        np.testing.assert_allclose(row, reference.rows[key], rtol=1e-5, atol=1e-6)
      else:
        assert row.tobytes() == before[key].tobytes()  # untouched rows: bitwise unchanged
  if name == "adam":  # each row keeps its own count: the steps that touched it
    ids = np.array(sorted(reference.rows), np.int64)
    count = emb.table.get_value().find(ids)["slots"][0]
    assert np.asarray(count).tolist() == [reference.count[k] for k in ids.tolist()]


def test_new_rows_depend_on_the_seed_and_the_id_alone():
  a, b = _embedding(), _embedding()
  ids = POOL[:6]
  rows_a = np.asarray(a(ids))
  rows_b = np.asarray(b(ids[::-1]))[::-1]
  assert rows_a.tobytes() == rows_b.tobytes()
  few = _embedding()  # one new id in a batch of known ones: drawn alone (the sparse path)
  few(ids[:-1])
  assert np.asarray(few(ids))[-1].tobytes() == rows_a[-1].tobytes()
  other = jr.DynamicEmbedding(64, FEATURES, optimizer=ADAM, rngs=nnx.Rngs(1))
  assert not np.array_equal(np.asarray(other(ids)), rows_a)
  assert len({row.tobytes() for row in rows_a}) == len(ids)


def test_int64_ids_with_equal_low_words_get_distinct_rows():
  emb = _embedding()
  ids = np.array([5, 5 + 2**32, 5 - 2**40], np.int64)
  rows = np.asarray(emb(ids))
  assert emb.size() == 3 and len({row.tobytes() for row in rows}) == 3
  assert emb.export()[0].tolist() == sorted(ids.tolist()) and emb.export()[0].dtype == np.int64


class Tower(nnx.Module):
  def __init__(self, capacity, **kwargs):
    self.emb = _embedding(capacity, optimizer=SLOW, **kwargs)
    self.head = nnx.Linear(FEATURES, 1, rngs=nnx.Rngs(1))

  def loss(self, rows, labels):
    return jnp.mean((self.head(rows).sum(axis=(1, 2)) - labels) ** 2)


def _train_step(model, optimizer, ids, labels):
  rows = model.emb(ids)
  loss, (grads, row_grads) = nnx.value_and_grad(lambda m, r: m.loss(r, labels), argnums=(0, 1))(model, rows)
  optimizer.update(model, grads)
  model.emb.apply_gradients(ids, row_grads)
  return loss


_jit_step = nnx.jit(_train_step, donate_argnums=(0, 1))


def _tower_batches(steps, seed=3):
  rng = np.random.default_rng(seed)
  return [(rng.choice(POOL, (4, 2)), rng.normal(size=4).astype(np.float32)) for _ in range(steps)]


def _train(model, batches, jit=True):
  optimizer = nnx.Optimizer(model, SLOW, wrt=nnx.Param)
  losses = []
  for ids, labels in batches:
    if jit:
      losses.append(float(_jit_step(model, optimizer, jr.keys.split64(ids), labels)))
    else:
      losses.append(float(_train_step(model, optimizer, ids, labels)))
  return losses


def test_training_in_nnx_jit_persists_updates_and_matches_eager():
  batches = _tower_batches(2) * 3  # the same batches again: their loss must fall
  jitted, eager = Tower(16, eviction=jr.LRU()), Tower(16, eviction=jr.LRU())
  losses_jit, losses_eager = _train(jitted, batches), _train(eager, batches, jit=False)
  np.testing.assert_allclose(losses_jit, losses_eager, rtol=1e-5)
  assert sum(losses_jit[-2:]) < sum(losses_jit[:2])
  a, b = _rows(jitted.emb), _rows(eager.emb)
  assert a.keys() == b.keys() and jitted.emb.size() == len(a) <= 16
  for key in a:
    np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-6)
  assert jitted.emb.stats() == eager.emb.stats()


def test_admission_eviction_and_counters_follow_their_definitions():
  """An oracle of occurrences: an id gets its row at its second occurrence, in batch order."""
  emb = _embedding(4, eviction=jr.LRU(), min_count=2, admission_capacity=64)
  counts = collections.Counter()
  expected = {"admitted": 0, "refused": 0, "unadmitted": 0, "full": 0, "evictions": 0}
  for ids, _ in _batches(seed=4, steps=12, size=6, pool=POOL[:10]):
    before = set(_rows(emb))
    occurrence = []  # each row's occurrence number of its id, for ids without a row
    for key in ids.tolist():
      if key not in before:
        counts[key] += 1
      occurrence.append(counts[key])
    rows = np.asarray(emb(ids))
    after = set(_rows(emb))
    assert len(after) <= 4
    for key in after - before:  # admitted now: seen min_count times since it last had no row
      assert counts[key] >= 2
    for key in set(ids.tolist()) - before - after:
      assert counts[key] < 2 or len(before) == 4  # not admitted yet, or refused by a full table
    for key in set(ids.tolist()) - before:
      if counts[key] >= 2:
        counts[key] = 0  # admitted, or refused by a full table: either way it starts afresh
    for key in before - after:
      counts[key] = 0  # evicted: starts afresh
    # A row is served if its id had one, or got one and this is its second occurrence or later.
    present = np.array([k in before or (k in after and n >= 2) for k, n in zip(ids.tolist(), occurrence)])
    assert not rows[~present].any() and rows[present].all(axis=1).all()  # the others read zeros
    expected["admitted"] += len(after - before)
    expected["evictions"] += len(before - after)
    expected["refused"] += int((~present).sum())
    waiting = np.array(occurrence) < 2  # refused before their second occurrence: not admitted yet
    expected["unadmitted"] += int((~present & waiting).sum())
    expected["full"] += int((~present & ~waiting).sum())  # admitted, and refused by the full table
    assert emb.stats() == expected
  assert expected["evictions"] > 0 and expected["unadmitted"] > 0


def test_refused_ids_get_no_update_and_a_full_table_without_eviction_refuses():
  emb = _embedding(2, optimizer=SGD)
  ids = POOL[:4]
  rows = np.asarray(emb(ids))
  assert emb.size() == 2 and not rows[2:].any() and emb.stats()["refused"] == 2
  emb.apply_gradients(ids, np.ones((4, FEATURES), np.float32))
  assert emb.size() == 2 and set(_rows(emb)) == set(ids[:2].tolist())


def _run(emb, batches):
  for ids, grads in batches:
    emb(ids)
    emb.apply_gradients(ids, grads)
  return emb


def test_runs_are_deterministic():
  batches = _batches(seed=5, steps=6, size=12)
  a = _run(_embedding(8, eviction=jr.LFU(), min_count=2), batches)
  b = _run(_embedding(8, eviction=jr.LFU(), min_count=2), batches)
  ids_a, rows_a = a.export()
  ids_b, rows_b = b.export()
  assert ids_a.tolist() == ids_b.tolist() and rows_a.tobytes() == rows_b.tobytes()
  assert a.stats() == b.stats()


@pytest.mark.parametrize("deferred", [False, True])
def test_checkpoint_round_trip_then_identical_steps(tmp_path, deferred):
  """A full, evicting embedding saved mid-run and restored continues bitwise as the uninterrupted one."""
  batches = _batches(seed=6, steps=8, size=12)
  config = {"eviction": jr.LRU(), "min_count": 2, "admission_capacity": 8}
  uninterrupted = _run(_embedding(8, **config), batches)
  first = _run(_embedding(8, **config), batches[:4])
  jr.Checkpoint(emb=first).save(tmp_path / "ckpt")
  resumed = _embedding(8, **config)
  if deferred:
    root = jr.Checkpoint()
    status = root.restore(tmp_path / "ckpt")
    assert status.pending == ["emb"]
    root.emb = resumed
  else:
    status = jr.Checkpoint(emb=resumed).restore(tmp_path / "ckpt")
  status.assert_consumed()
  assert resumed.stats() == first.stats()
  _run(resumed, batches[4:])
  for got, want in zip(resumed.export(), uninterrupted.export()):
    assert got.tobytes() == want.tobytes()
  assert resumed.stats() == uninterrupted.stats()


def test_checkpoint_restores_into_another_capacity(tmp_path):
  emb = _run(_embedding(8, eviction=jr.LRU()), _batches(seed=7, steps=3))
  jr.Checkpoint(emb=emb).save(tmp_path / "ckpt")
  bigger = _embedding(256, eviction=jr.LRU())
  jr.Checkpoint(emb=bigger).restore(tmp_path / "ckpt").assert_consumed()
  for got, want in zip(bigger.export(), emb.export()):
    assert got.tobytes() == want.tobytes()
  small = _embedding(2, eviction=jr.LRU())
  with pytest.raises(ValueError, match="emb"):
    jr.Checkpoint(emb=small).restore(tmp_path / "ckpt")
  assert small.size() == 0


@pytest.mark.parametrize("eviction", [None, jr.LRU()], ids=["no_eviction", "lru"])
def test_checkpoints_of_other_policies_restore_into_the_default_one(tmp_path, eviction):
  """Written before LRFU was the default (no eviction, or LRU), read by a module built with defaults."""
  emb = _run(_embedding(16, eviction=eviction), _batches(seed=3, steps=3))
  jr.Checkpoint(emb=emb).save(tmp_path / "ckpt")
  default = jr.DynamicEmbedding(16, emb.features, optimizer=optax.adam(0.1), rngs=nnx.Rngs(0))
  assert isinstance(default.eviction, jr.LRFU)
  jr.Checkpoint(emb=default).restore(tmp_path / "ckpt").assert_consumed()
  for got, want in zip(default.export(), emb.export()):
    assert got.tobytes() == want.tobytes()
  default(np.arange(1000, 1064))  # full: the new ids evict the restored rows of lower weight
  assert default.size() == 16 and default.stats()["evictions"] > 0


def test_eager_steps_of_a_shape_met_before_load_no_program():
  """An eager lookup and apply_gradients of a batch shape met before compiles nothing: each program
  they run is cached (an eager lax.cond, traced anew on every call, was not)."""
  emb = _embedding(16, optimizer=optax.sgd(1.0), eviction=jr.LRU())
  batches = _batches(seed=3, steps=3, size=10)
  with compilations() as loaded:
    for step, (ids, grads) in enumerate(batches):
      emb(ids)
      emb.apply_gradients(ids, grads)
      if step == 0:
        first = len(loaded)
  assert first and len(loaded) == first


def test_rows_of_a_lookup_are_reused_only_for_the_same_ids_on_the_same_table(tmp_path):
  """apply_gradients after the lookup of other ids, or after the table changed, finds the ids again."""
  batches = _batches(seed=8, steps=4, size=10)
  for stale in ("other ids", "a changed table"):
    emb = _embedding(16, optimizer=optax.sgd(1.0), eviction=jr.LRU())
    (ids, grads), (other, _) = batches[:2]
    emb(ids)
    if stale == "other ids":
      emb(other)  # the rows kept are other's now
    else:
      emb.table.set_value(emb.table.get_value().remove(other[:3]))  # rows may move; the clock moves
    before = _rows(emb)
    emb.apply_gradients(ids, grads)
    assert emb.recent.get_value() is None
    expected = dict(before)
    for key in set(ids.tolist()) & set(before):
      expected[key] = before[key] - grads[ids == key].sum(axis=0)
    after = _rows(emb)
    assert after.keys() == expected.keys()
    for key, row in after.items():
      np.testing.assert_allclose(row, expected[key], rtol=1e-5, atol=1e-6, err_msg=stale)
  # A checkpoint taken between a lookup and its update leaves the kept rows out.
  emb = _embedding(16, eviction=jr.LRU())
  emb(batches[0][0])
  assert emb.recent.get_value() is not None
  jr.Checkpoint(emb=emb).save(tmp_path / "ckpt")
  fresh = _embedding(16, eviction=jr.LRU())
  jr.Checkpoint(emb=fresh).restore(tmp_path / "ckpt").assert_consumed()
  assert fresh.recent.get_value() is None and fresh.size() == emb.size()


def test_sharded_equals_unsharded():
  batches = _batches(seed=8, steps=5, size=16)
  mesh = mesh_of(4)
  unsharded = _run(_embedding(128, min_count=2), batches)
  sharded = _run(_embedding(128, min_count=2, mesh=mesh, axis="shard"), batches)
  assert isinstance(sharded.table.get_value(), jr.ShardedTable)
  for got, want in zip(sharded.export(), unsharded.export()):
    assert got.tobytes() == want.tobytes()
  assert sharded.stats() == unsharded.stats()


def test_sharded_with_eviction_stays_within_capacity_and_restores_on_other_meshes(tmp_path):
  emb = _run(
    _embedding(16, eviction=jr.LRU(), mesh=mesh_of(4), axis="shard"), _batches(seed=9, steps=4, size=12)
  )
  assert emb.size() <= 16 and emb.stats()["evictions"] > 0
  jr.Checkpoint(emb=emb).save(tmp_path / "ckpt")
  unsharded = _embedding(16, eviction=jr.LRU())
  two = _embedding(64, eviction=jr.LRU(), mesh=mesh_of(2), axis="shard")
  for other in (unsharded, two):  # 4 shards -> 1 -> 2
    jr.Checkpoint(emb=other).restore(tmp_path / "ckpt").assert_consumed()
    for got, want in zip(other.export(), emb.export()):
      assert got.tobytes() == want.tobytes()
    assert other.stats() == emb.stats()


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
  ("kwargs", "error", "name"),
  [
    ({"capacity": 0}, ValueError, "capacity"),
    ({"features": 0}, ValueError, "features"),
    ({"features": 2.0}, TypeError, "features"),
    ({"min_count": 0}, ValueError, "min_count"),
    ({"min_count": 65_536}, ValueError, "min_count"),  # more than an admission count holds
    ({"optimizer": "adam"}, TypeError, "optimizer"),
    ({"optimizer": optax.adam}, TypeError, "optimizer"),
    ({"optimizer": optax.clip_by_global_norm(1.0)}, ValueError, "optimizer"),
    ({"optimizer": optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))}, ValueError, "optimizer"),
    ({"optimizer": optax.lbfgs()}, ValueError, "optimizer"),
    ({"optimizer": optax.adafactor(0.1)}, ValueError, "optimizer"),
    ({"eviction": jr.CustomScore()}, ValueError, "eviction"),
    ({"eviction": "lru"}, TypeError, "eviction"),
    ({"mesh": None, "axis": "shard"}, ValueError, "mesh"),
    ({"key": jnp.float32}, TypeError, "key"),
    ({"initializer": 0.5}, TypeError, "initializer"),
    ({"oov_buckets": -1}, ValueError, "oov_buckets"),
    ({"oov_buckets": 2.0}, TypeError, "oov_buckets"),
  ],
)
def test_bad_constructor_arguments_are_named(kwargs, error, name):
  args = {"capacity": 8, "features": 2, "optimizer": SGD, "rngs": nnx.Rngs(0)} | kwargs
  with pytest.raises(error, match=name):
    jr.DynamicEmbedding(args.pop("capacity"), args.pop("features"), **args)


@pytest.mark.parametrize("optimizer", [optax.adagrad(0.1), optax.rmsprop(0.1), optax.lion(0.1)])
def test_elementwise_optimizers_are_accepted(optimizer):
  emb = _embedding(8, optimizer=optimizer)
  ids = POOL[:3]
  before = np.asarray(emb(ids))
  emb.apply_gradients(ids, np.ones((3, FEATURES), np.float32))
  assert not np.array_equal(np.asarray(emb(ids)), before)


def test_the_elementwise_check_runs_once_per_optimizer_built_alike():
  """It compiles a program: a model of many tables built with equal optimizers checks once."""
  rowwise._elementwise.cache_clear()
  for _ in range(3):
    _embedding(8, optimizer=optax.adam(0.03))
  with pytest.raises(ValueError, match="depends on other elements"):  # and refusals are kept too
    _embedding(8, optimizer=optax.clip_by_global_norm(1.0))
  assert rowwise._elementwise.cache_info().misses == 2


def test_bad_gradients_and_ids_leave_the_embedding_unchanged():
  emb = _run(_embedding(8), _batches(seed=10, steps=2))
  ids = POOL[:4]
  emb(ids)
  before, stats = emb.export(), emb.stats()
  for grads, error, name in [
    (np.ones((4, FEATURES + 1), np.float32), ValueError, "row_grads"),
    (np.ones((3, FEATURES), np.float32), ValueError, "row_grads"),
    (np.ones((4, FEATURES), np.int32), TypeError, "row_grads"),
  ]:
    with pytest.raises(error, match=name):
      emb.apply_gradients(ids, grads)
  with pytest.raises(TypeError, match="ids"):
    emb.apply_gradients(ids.astype(np.float32), np.ones((4, FEATURES), np.float32))
  with pytest.raises(TypeError, match="ids"):
    emb(ids.astype(np.float64))
  after = emb.export()
  assert all(a.tobytes() == b.tobytes() for a, b in zip(after, before)) and emb.stats() == stats


def test_empty_batches_change_nothing():
  emb = _run(_embedding(8), _batches(seed=11, steps=1))
  before = emb.export()
  assert emb(np.zeros((0,), np.int64)).shape == (0, FEATURES)
  emb.apply_gradients(np.zeros((0,), np.int64), np.zeros((0, FEATURES), np.float32))
  assert all(a.tobytes() == b.tobytes() for a, b in zip(emb.export(), before))


def test_composite_ids_export_sorted_by_element():
  emb = jr.DynamicEmbedding(16, 2, key=jax.ShapeDtypeStruct((2,), jnp.int32), optimizer=SGD, rngs=nnx.Rngs(0))
  ids = np.array([[3, 1], [1, 9], [1, 2], [3, 0]], np.int32)
  rows = np.asarray(emb(ids))
  exported, exported_rows = emb.export()
  order = sorted(range(4), key=lambda i: tuple(ids[i]))
  assert exported.tolist() == ids[order].tolist()
  assert exported_rows.tobytes() == rows[order].tobytes()


def test_an_empty_embedding_exports_nothing():
  ids, rows = _embedding().export()
  assert ids.shape == (0,) and ids.dtype == np.int64 and rows.shape == (0, FEATURES)


@pytest.mark.parametrize("min_count", [200, 300], ids=["uint8", "uint16"])
def test_counts_stop_at_min_count_however_often_an_id_comes(min_count):
  """Counts are one or two bytes: a batch repeating an id more often than they hold admits it at its
  ``min_count``-th occurrence all the same (an oracle of occurrences)."""
  emb = _embedding(8, min_count=min_count, admission_capacity=8)
  assert emb.counts.get_value().value_spec.leaves[0].dtype == (np.uint8 if min_count < 256 else np.uint16)
  seen = collections.Counter()
  batches = [[5] * 150 + [6] * 700, [5] * 100 + [7] * (min_count - 1), [7, 7, 5]]
  for batch in batches:
    admitted = set(_rows(emb))
    expected = []
    for key in batch:
      seen[key] += 1
      expected.append(key in admitted or seen[key] >= min_count)
    rows = np.asarray(emb(np.array(batch, np.int64)))
    assert rows.any(axis=1).tolist() == expected
  admitted = sum(n >= min_count for n in seen.values())
  assert emb.stats()["admitted"] == admitted == (3 if min_count < 250 else 2)


def test_occurrences_within_a_batch_count_in_batch_order():
  emb = _embedding(8, min_count=3, admission_capacity=8)
  rows = np.asarray(emb(np.array([5, 6, 5, 5, 5], np.int64)))
  assert [bool(r.any()) for r in rows] == [False, False, False, True, True]  # 5's third occurrence on
  assert rows[3].tobytes() == rows[4].tobytes() and emb.stats() == {
    "admitted": 1,
    "refused": 3,
    "unadmitted": 3,
    "full": 0,
    "evictions": 0,
  }
  rows = np.asarray(emb(np.array([6, 6], np.int64)))  # 6 was seen once before
  assert [bool(r.any()) for r in rows] == [False, True] and emb.size() == 2
