"""A jitted call that copies a table because it was not donated warns once, naming the table."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from oracle import mesh_of

import jaxres as jr


class Model(nnx.Module):
  def __init__(self, name="items", mesh=None, axis=None):
    self.emb = jr.DynamicEmbedding(
      256, 4, key=jnp.int32, optimizer=optax.sgd(0.1), rngs=nnx.Rngs(0), name=name, mesh=mesh, axis=axis
    )
    self.head = nnx.Linear(4, 1, rngs=nnx.Rngs(1))

  def __call__(self, ids):
    return self.head(self.emb(ids))[..., 0]


def _loss(model, ids, labels):
  return optax.sigmoid_binary_cross_entropy(model(ids), labels).mean()


def _step(model, optimizer, ids, labels):
  loss, grads = jr.value_and_grad(_loss)(model, ids, labels)
  optimizer.update(model, grads)
  return loss


IDS = np.array([3, 9, 3, 12], np.int32)
LABELS = np.array([1.0, 0.0, 1.0, 0.0], np.float32)


def _train(donate, steps=3, **model_kwargs):
  model = Model(**model_kwargs)
  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  step = nnx.jit(_step, donate_argnums=donate)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("default")  # as a user sees them: once per table
    losses = [float(step(model, optimizer, IDS, LABELS)) for _ in range(steps)]
  return model, losses, [w for w in caught if issubclass(w.category, jr.TableCopyWarning)]


def test_an_undonated_step_warns_once_naming_the_table_and_donate_argnums():
  model, losses, caught = _train(donate=())
  assert len(caught) == 1, [str(w.message) for w in caught]
  message = str(caught[0].message)
  assert "DynamicEmbedding 'items'" in message and "donate_argnums" in message
  # the warning changes nothing: the same rows and losses as the donated run
  donated, donated_losses, quiet = _train(donate=(0, 1))
  assert quiet == []
  assert losses == donated_losses
  for got, want in zip(model.emb.export(), donated.emb.export()):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_each_table_warns_and_an_unnamed_one_says_what_it_is():
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("default")
    for name in ("users", None):
      model = Model(name=name)
      nnx.jit(lambda m: m(IDS))(model)  # a read-only call copies too: nnx.jit returns every variable
  messages = [str(w.message) for w in caught if issubclass(w.category, jr.TableCopyWarning)]
  assert len(messages) == 2
  assert "DynamicEmbedding 'users'" in messages[0] and "a DynamicEmbedding" in messages[1]


def test_a_sharded_table_donated_is_quiet_and_undonated_warns():
  mesh = mesh_of(2)
  _, _, loud = _train(donate=(), steps=1, mesh=mesh, axis="shard")
  _, _, quiet = _train(donate=(0, 1), steps=1, mesh=mesh, axis="shard")
  assert len(loud) == 1 and quiet == []


class Counts(nnx.Module):
  def __init__(self):
    self.table = jr.MutableHashTable(jnp.int32, jnp.int32, default_value=0)


def _count(m, ids):
  m.table.insert_or_apply(ids, jnp.ones(ids.shape, jnp.int32), jnp.add)


def test_a_stateful_table_in_a_module_warns_undonated_and_counts_the_same():
  ids = jnp.array([1, 2, 1])
  loud, quiet = Counts(), Counts()
  for m in (loud, quiet):
    m.table.reserve(64)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("default")
    for _ in range(2):
      nnx.jit(_count)(loud, ids)
    for _ in range(2):
      nnx.jit(_count, donate_argnums=0)(quiet, ids)
  copied = [str(w.message) for w in caught if issubclass(w.category, jr.TableCopyWarning)]
  assert len(copied) == 1 and "MutableHashTable" in copied[0]
  assert loud.table.find(np.array([1, 2, 3], np.int32)).tolist() == [4, 2, 0]
  assert quiet.table.find(np.array([1, 2, 3], np.int32)).tolist() == [4, 2, 0]


def test_eager_calls_and_restores_do_not_warn(tmp_path):
  with warnings.catch_warnings():
    warnings.simplefilter("error", jr.TableCopyWarning)
    model = Model()
    model.emb(IDS)  # eager lookups and inserts update the table in place
    counts = Counts()
    counts.table.insert(np.array([4], np.int32), np.array([1], np.int32))
    jr.Checkpoint(model=model, counts=counts).save(tmp_path / "ckpt")
    fresh, fresh_counts = Model(), Counts()
    jr.Checkpoint(model=fresh, counts=fresh_counts).restore(tmp_path / "ckpt").assert_consumed()
  assert fresh_counts.table.find(np.array([4], np.int32)).tolist() == [1]
  for got, want in zip(fresh.emb.export(), model.emb.export()):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("donate", [(), (0, 1)])
def test_the_warning_follows_the_copy_in_the_compiled_program(donate):
  """The warning's premise, read from XLA: undonated, the table's buffer is not reused."""
  model = Model()
  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  before = model.emb.table.get_value()
  storage = max(jax.tree.leaves(before), key=lambda x: x.size)
  pointer = storage.unsafe_buffer_pointer()
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", jr.TableCopyWarning)
    nnx.jit(_step, donate_argnums=donate)(model, optimizer, IDS, LABELS)
  after = max(jax.tree.leaves(model.emb.table.get_value()), key=lambda x: x.size)
  assert (after.unsafe_buffer_pointer() == pointer) == bool(donate)
