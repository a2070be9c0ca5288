"""The model the serving tests export: a ``jr.DynamicEmbedding`` of two ids per example and a linear head.

The served-program tests block this module from import in the processes that serve: a served
model needs no model code.
"""

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jaxres as jr

FEATURES = 4
ADAM = optax.adam(0.05)
IDS = jax.ShapeDtypeStruct(("batch", 2), jnp.int64)


class Model(nnx.Module):
  def __init__(self, capacity=256, **options):
    self.emb = jr.DynamicEmbedding(
      capacity, FEATURES, optimizer=ADAM, eviction=jr.LRU(), rngs=nnx.Rngs(0), **options
    )
    self.head = nnx.Linear(2 * FEATURES, 1, rngs=nnx.Rngs(1))

  def __call__(self, ids):
    rows = self.emb(ids)
    return self.head(rows.reshape(*rows.shape[:-2], -1))[..., 0]


@functools.partial(nnx.jit, donate_argnums=(0, 1))
def train_step(model, optimizer, ids, labels):
  """One step of squared error on ``labels``: the head by ``optimizer``, the rows by the embedding."""
  rows = model.emb(ids)

  def loss_fn(model, rows):
    return jnp.mean((model.head(rows.reshape(rows.shape[0], -1))[:, 0] - labels) ** 2)

  loss, (grads, row_grads) = nnx.value_and_grad(loss_fn, argnums=(0, 1))(model, rows)
  optimizer.update(model, grads)
  model.emb.apply_gradients(ids, row_grads)
  return loss


def predict(model, ids):
  return {"score": nnx.sigmoid(model(ids)), "rows": model.emb(ids)}
