"""Worked examples built on jaxres: a click-through model with a dynamic embedding, and its training loop.

- :class:`ClickStream`, :class:`ClickModel`: a synthetic click-through task,
  and a model whose ids get :class:`jaxres.DynamicEmbedding` rows;
  :class:`DriftStream`: the same task with ids that appear, peak and fade.
- :func:`train_step`, :class:`Run`: the jitted step (dense Adam for the
  layers, row-wise Adam for the embedding), and runs that checkpoint every
  few steps and resume exactly, with deferred restore.
- :func:`evaluate`, :func:`export`, :func:`predict`: the loss in inference
  mode (nothing changes), and the model exported with ``jr.saved_model``.
"""

from jaxres.examples.clicks import ClickBatch, ClickModel, ClickStream, DriftStream
from jaxres.examples.serving import evaluate, export, predict
from jaxres.examples.training import Run, RunConfig, loss_fn, train_step

__all__ = [
  "ClickBatch",
  "ClickModel",
  "ClickStream",
  "DriftStream",
  "Run",
  "RunConfig",
  "evaluate",
  "export",
  "loss_fn",
  "predict",
  "train_step",
]
