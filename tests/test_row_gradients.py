"""jr.value_and_grad / jr.grad: the plain NNX step trains the rows looked up; nnx.value_and_grad refuses.

The oracle is the pattern that predates them (lookup outside the loss,
``argnums=(0, 1)``, ``apply_gradients``), which ``tests/test_embedding.py``
checks against NumPy: both must leave the same model, bit for bit.
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxres as jr

FEATURES = 3
POOL = (np.arange(40, dtype=np.int64) * 7919 + 2**40) * np.array([1, -1] * 20)
SGD = optax.sgd(0.5)
ADAM = optax.adam(0.05)

_OPTIONS = {
  "adam, LRU": {"eviction": jr.LRU()},
  "admission, shared rows": {"min_count": 2, "oov_buckets": 4, "eviction": jr.LRU()},
  "CatchUpAdam, full": {"optimizer": jr.CatchUpAdam(0.05)},
}


class Tower(nnx.Module):
  def __init__(self, capacity=16, **options):
    options = {"optimizer": ADAM, **options}
    self.emb = jr.DynamicEmbedding(capacity, FEATURES, rngs=nnx.Rngs(0), **options)
    self.head = nnx.Linear(FEATURES, 1, rngs=nnx.Rngs(1))

  def __call__(self, ids, weights=None):
    return self.head(self.emb(ids, weights))[..., 0].sum(axis=-1)


def loss_fn(model, ids, labels, weights=None):
  return jnp.mean((model(ids, weights) - labels) ** 2)


@functools.partial(nnx.jit, donate_argnums=(0, 1))
def plain_step(model, optimizer, ids, labels, weights):
  loss, grads = jr.value_and_grad(loss_fn)(model, ids, labels, weights)
  optimizer.update(model, grads)
  return loss


@functools.partial(nnx.jit, donate_argnums=(0, 1))
def apply_gradients_step(model, optimizer, ids, labels, weights):
  rows = model.emb(ids, weights)

  def rows_loss(model, rows):
    return jnp.mean((model.head(rows)[..., 0].sum(axis=-1) - labels) ** 2)

  loss, (grads, row_grads) = nnx.value_and_grad(rows_loss, argnums=(0, 1))(model, rows)
  optimizer.update(model, grads)
  model.emb.apply_gradients(ids, row_grads, weights)
  return loss


def _batches(seed, steps, padded=False):
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(steps):
    ids = rng.choice(POOL, (6, 3))
    weights = (
      rng.choice([0.0, 0.5, 1.0, 2.0], (6, 3)).astype(np.float32) if padded else np.ones((6, 3), np.float32)
    )
    out.append((ids, rng.normal(size=6).astype(np.float32), weights))
  return out


def _state_bytes(model) -> list[bytes]:
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(nnx.state(model))]


def _train(step, model, batches):
  optimizer = nnx.Optimizer(model, SGD, wrt=nnx.Param)
  losses = [float(step(model, optimizer, jr.keys.split64(ids), y, w)) for ids, y, w in batches]
  return losses


@pytest.mark.parametrize("options", list(_OPTIONS), ids=list(_OPTIONS))
def test_the_plain_step_trains_the_rows_as_apply_gradients_does_bitwise(options):
  batches = _batches(1, 6, padded=True)
  plain, reference = Tower(**_OPTIONS[options]), Tower(**_OPTIONS[options])
  assert _train(plain_step, plain, batches) == _train(apply_gradients_step, reference, batches)
  assert _state_bytes(plain) == _state_bytes(reference)
  assert plain.emb.size() > 0 and plain.emb.stats() == reference.emb.stats()
  ids, rows = plain.emb.export()
  fresh = Tower(**_OPTIONS[options])
  fresh.eval()
  assert not np.array_equal(rows, np.asarray(fresh.emb(ids))), "the rows were never trained"


def test_eager_calls_match_jitted_ones_and_the_function_traces_twice_once():
  traced = []

  def counted_loss(model, ids, labels):
    traced.append(1)
    return loss_fn(model, ids, labels)

  @nnx.jit
  def step(model, optimizer, ids, labels):
    loss, grads = jr.value_and_grad(counted_loss)(model, ids, labels)
    optimizer.update(model, grads)
    return loss

  jitted, eager = Tower(), Tower()
  opt_jitted = nnx.Optimizer(jitted, SGD, wrt=nnx.Param)
  opt_eager = nnx.Optimizer(eager, SGD, wrt=nnx.Param)
  for ids, labels, _ in _batches(2, 3):
    step(jitted, opt_jitted, jr.keys.split64(ids), labels)
    _, grads = jr.value_and_grad(loss_fn)(eager, ids, labels)
    opt_eager.update(eager, grads)
  assert len(traced) == 2  # once to find the lookups, once differentiated; never again
  for a, b in zip(jax.tree.leaves(nnx.state(jitted)), jax.tree.leaves(nnx.state(eager))):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=1e-5, atol=1e-6)


def test_grad_argnums_has_aux_and_an_embedding_looked_up_twice():
  """Two lookups of one embedding train it as one lookup of both batches would (one step)."""
  model, reference = Tower(optimizer=SGD), Tower(optimizer=SGD)
  first, second = POOL[:4], POOL[2:6]
  scale = jnp.float32(2.0)

  def twice(model, scale):
    loss = jnp.sum(model.emb(first)) + scale * jnp.sum(model.emb(second))
    return loss, {"aux": loss}

  grads, aux = jr.grad(twice, argnums=(0, 1), has_aux=True)(model, scale)
  assert isinstance(grads, tuple) and len(grads) == 2 and set(aux) == {"aux"}
  assert float(grads[1]) == pytest.approx(float(jnp.sum(reference.emb(second))), rel=1e-6)
  assert "emb" not in grads[0]  # the dense parameters only (the head has no gradient here: empty)
  both = np.concatenate([first, second])
  reference.emb(both)
  reference.emb.apply_gradients(
    both, np.concatenate([np.ones((4, 3)), np.full((4, 3), 2.0)]).astype(np.float32)
  )
  for got, want in zip(model.emb.export(), reference.emb.export()):
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("transform", ["nnx.value_and_grad", "nnx.grad", "jax.grad"])
@pytest.mark.parametrize("jit", [False, True])
def test_plain_differentiation_of_a_training_lookup_is_a_clear_error(transform, jit):
  model = Tower()
  before = _state_bytes(model)
  ids = POOL[:4]
  if transform == "jax.grad":

    def differentiate(model, ids):
      graphdef, params, rest = nnx.split(model, nnx.Param, ...)
      return jax.grad(lambda p: jnp.sum(nnx.merge(graphdef, p, rest)(ids)))(params)

  else:
    transformed = nnx.value_and_grad if transform == "nnx.value_and_grad" else nnx.grad

    def differentiate(model, ids):
      return transformed(lambda m: jnp.sum(m(ids)))(model)

  call = nnx.jit(differentiate) if jit else differentiate
  with pytest.raises(ValueError, match=r"DynamicEmbedding.*jr\.value_and_grad"):
    call(model, jr.keys.split64(ids) if jit else ids)
  assert _state_bytes(model) == before and model.emb.size() == 0


def test_inference_mode_is_neither_refused_nor_trained():
  model = Tower()
  model.emb(POOL[:4])
  model.eval()
  before = _state_bytes(model)
  loss, _ = nnx.value_and_grad(lambda m: jnp.sum(m(POOL[:6])))(model)  # a pure read: no rows to train
  with pytest.warns(jr.InferenceModeWarning, match=r"every embedding <lambda> looked up is in inference"):
    loss_too, _ = jr.value_and_grad(lambda m: jnp.sum(m(POOL[:6])))(model)
  assert float(loss) == float(loss_too) and _state_bytes(model) == before


def test_a_step_left_in_eval_mode_warns_once_per_compile():
  """Before issue 68: a model left in eval() trained no row, and nothing said so."""
  model = Tower()
  optimizer = nnx.Optimizer(model, SGD, wrt=nnx.Param)
  batches = _batches(3, 3)
  model.eval()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for ids, labels, weights in batches:  # one shape: one compile
      plain_step(model, optimizer, jr.keys.split64(ids), labels, weights)
    ids, labels, weights = batches[0]
    plain_step(model, optimizer, jr.keys.split64(ids[:4]), labels[:4], weights[:4])  # a second
  assert [w.category for w in caught] == [jr.InferenceModeWarning] * 2, [str(w.message) for w in caught]
  assert "call model.train()" in str(caught[0].message)
  assert model.emb.size() == 0, "no row was given or trained"
  model.train()
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    plain_step(model, optimizer, jr.keys.split64(ids), labels, weights)
  assert model.emb.size() > 0


class _TwoTowers(nnx.Module):
  def __init__(self):
    self.trained, self.frozen = Tower(), Tower()

  def __call__(self, ids):
    return self.trained(ids) + self.frozen(ids)


def test_a_step_training_one_embedding_and_reading_another_is_quiet():
  model = _TwoTowers()
  model.frozen.emb(POOL[:6])
  model.frozen.eval()
  frozen = _state_bytes(model.frozen)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    jr.value_and_grad(lambda m: jnp.sum(m(POOL[:6]) ** 2))(model)
  assert model.trained.emb.size() == 6 and _state_bytes(model.frozen) == frozen


def test_an_embedding_the_arguments_do_not_reach_is_named():
  outside = jr.DynamicEmbedding(8, FEATURES, optimizer=SGD, rngs=nnx.Rngs(0))
  head = nnx.Linear(FEATURES, 1, rngs=nnx.Rngs(1))
  with pytest.raises(ValueError, match="not reachable from the function's arguments"):
    jr.value_and_grad(lambda head: jnp.sum(head(outside(POOL[:2]))))(head)
  assert outside.size() == 0


def test_bad_weights_inside_the_step_change_nothing():
  model = Tower(optimizer=SGD)
  model.emb(POOL[:4])
  before = _state_bytes(model), model.emb.stats()
  for weights, error in (
    (np.array([[1.0, -1.0, 1.0]] * 2, np.float32), ValueError),
    (np.ones((2, 3), np.int32), TypeError),
  ):
    with pytest.raises(error, match="weights"):
      jr.value_and_grad(loss_fn)(model, POOL[:6].reshape(2, 3), np.zeros(2, np.float32), weights)
    assert (_state_bytes(model), model.emb.stats()) == before


def test_a_row_optimizer_handed_to_nnx_optimizer_is_a_type_error():
  with pytest.raises(TypeError, match=r"CatchUpAdam.*row optimizer"):
    nnx.Optimizer(Tower(), jr.CatchUpAdam(1e-3), wrt=nnx.Param)
  with pytest.raises(TypeError, match=r"CatchUpAdam.*row optimizer"):
    optax.chain(optax.clip(1.0), jr.CatchUpAdam(1e-3)).init(jnp.zeros(3))


def test_keyword_arguments_are_bound_to_their_positions():
  model, reference = Tower(optimizer=SGD), Tower(optimizer=SGD)
  ids, labels = POOL[:4].reshape(2, 2), np.ones(2, np.float32)
  loss, _ = jr.value_and_grad(loss_fn)(model, labels=labels, ids=ids)
  reference_loss, _ = jr.value_and_grad(loss_fn)(reference, ids, labels)
  assert float(loss) == float(reference_loss) and _state_bytes(model) == _state_bytes(reference)


@pytest.mark.parametrize(
  "fn, has_aux, match",
  [
    (lambda m, ids: m.emb(ids), False, "scalar loss"),  # rows, not a loss
    (lambda m, ids: jnp.sum(m.emb(ids)), True, r"\(loss, aux\)"),
    (lambda m, ids: jnp.sum(m.emb(ids)).astype(jnp.int32), False, "floating point loss"),
  ],
)
def test_a_function_that_cannot_be_differentiated_fails_before_the_model_changes(fn, has_aux, match):
  """Eagerly, the lookups of the differentiated pass must not consume the model's arrays first."""
  model = Tower(optimizer=SGD)
  model.emb(POOL[:2])
  before = _state_bytes(model)
  with pytest.raises(TypeError, match=match):
    jr.value_and_grad(fn, has_aux=has_aux)(model, POOL[:4])
  assert _state_bytes(model) == before and model.emb.size() == 2


def test_negative_argnums_count_from_the_end_of_the_arguments():
  model, reference = Tower(optimizer=SGD), Tower(optimizer=SGD)
  scale = jnp.float32(3.0)

  def scaled(model, scale):
    return scale * jnp.sum(model.emb(POOL[:3]))

  (loss, grads), want = (
    jr.value_and_grad(scaled, argnums=-1)(model, scale),
    jr.value_and_grad(scaled, argnums=1)(reference, scale),
  )
  assert float(loss) == float(want[0]) and float(grads) == float(want[1])
  assert _state_bytes(model) == _state_bytes(reference)


def test_rows_taken_by_a_later_insert_do_not_take_an_earlier_lookups_gradient():
  """A lookup's rows are found again when an insert moved the table on since (here a nested
  differentiation that evicts): evicted ids drop their gradient, the ids now in their rows keep theirs."""
  emb = jr.DynamicEmbedding(4, FEATURES, optimizer=optax.sgd(1.0), eviction=jr.LRU(), rngs=nnx.Rngs(0))
  first, newer = np.arange(4, dtype=np.int64), np.array([4, 5], np.int64)
  fresh = jr.DynamicEmbedding(8, FEATURES, optimizer=optax.sgd(1.0), rngs=nnx.Rngs(0))
  initial = dict(zip(range(6), np.asarray(fresh(np.arange(6, dtype=np.int64)))))

  def outer(emb):
    rows = emb(first)
    jr.grad(lambda emb: 0.0 * jnp.sum(emb(newer)))(emb)  # evicts the two oldest ids: 0 and 1
    return jnp.sum(rows)

  jr.grad(outer)(emb)
  rows = dict(zip(emb.export()[0].tolist(), emb.export()[1]))
  assert sorted(rows) == [2, 3, 4, 5]
  for key in (4, 5):
    np.testing.assert_array_equal(rows[key], initial[key])  # not 0's or 1's gradient
  for key in (2, 3):
    np.testing.assert_allclose(rows[key], initial[key] - 1.0, rtol=1e-6)
