"""Evaluating the click model in inference mode, and serving it with ``jr.saved_model``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxres as jr
from jaxres.examples.clicks import ClickModel, ClickStream


def predict(model: ClickModel, ids) -> dict[str, jax.Array]:
  """The served signature: click probabilities ``float32[batch]`` for ids ``[batch, fields]``."""
  return {"probability": nnx.sigmoid(model(ids))}


@nnx.jit(donate_argnums=0)  # donated: nnx.jit would otherwise copy the tables
def _eval_loss(model: ClickModel, ids, labels) -> jax.Array:
  return optax.sigmoid_binary_cross_entropy(model(ids), labels).mean()


def evaluate(model: ClickModel, stream: ClickStream, steps: range) -> float:
  """Mean loss over the batches ``steps`` of ``stream``, in inference mode.

  ``model.eval()`` puts the embedding in inference mode: the lookups read
  (unseen ids read zeros) and change nothing, neither rows nor counters. The
  model is back in training mode afterwards.

  Examples:
    >>> import optax, jaxres as jr
    >>> from flax import nnx
    >>> from jaxres.examples import ClickModel, ClickStream, evaluate
    >>> model = ClickModel(256, num_fields=2, optimizer=optax.adam(0.01), rngs=nnx.Rngs(0))
    >>> loss = evaluate(model, ClickStream(batch_size=8, num_fields=2), range(2))
    >>> model.embedding.size(), model.embedding.deterministic
    (0, False)
  """
  model.eval()
  try:
    losses = [_eval_loss(model, jr.keys.split64(b.ids), b.labels) for b in map(stream.batch, steps)]
  finally:
    model.train()
  return float(np.mean(jax.device_get(losses)))


def export(model: ClickModel, path, num_fields: int, **options) -> None:
  """Exports ``model`` to ``path`` with one signature, ``serving_default``: :func:`predict` of
  ``ids`` (``int64[batch, num_fields]``, any batch). ``options`` go to ``jr.saved_model.save``."""
  ids = jax.ShapeDtypeStruct(("batch", num_fields), jnp.int64)
  signature = jr.saved_model.Signature(predict, ids=ids)
  jr.saved_model.save(model, path, {"serving_default": signature}, **options)
