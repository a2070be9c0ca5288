"""Worked examples built on jaxres: a dynamic-embedding click model and its training loop.

- :class:`DynamicEmbedding`: ids get embedding rows on first sight, in ``nnx.jit``.
- :class:`ClickStream`, :class:`ClickModel`: a synthetic click-through task.
- :func:`train_step`, :class:`Run`: the jitted Adam step, and runs that
  checkpoint every few steps and resume exactly, with deferred restore.
"""

from jaxres.examples.clicks import ClickBatch, ClickModel, ClickStream
from jaxres.examples.embedding import DynamicEmbedding, take_rows
from jaxres.examples.training import Run, RunConfig, loss_fn, train_step

__all__ = [
  "ClickBatch",
  "ClickModel",
  "ClickStream",
  "DynamicEmbedding",
  "Run",
  "RunConfig",
  "loss_fn",
  "take_rows",
  "train_step",
]
