"""Training the click model: the jitted step, and checkpointed runs that resume exactly."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import numpy as np
import optax
from flax import nnx

import jaxres as jr
from jaxres.examples.clicks import ClickModel, ClickStream, DriftStream


def loss_fn(model: ClickModel, ids, labels) -> jax.Array:
  """Mean binary cross-entropy of the model's click logits."""
  return optax.sigmoid_binary_cross_entropy(model(ids), labels).mean()


@functools.partial(nnx.jit, donate_argnums=(0, 1))
def train_step(model: ClickModel, optimizer: nnx.Optimizer, ids, labels) -> jax.Array:
  """One training step, the plain NNX step with ``jr.value_and_grad``; returns the loss.

  The embedding looks the ids up (new ids get rows), the dense layers take
  an Adam step through ``optimizer``, and the embedding's own row-wise Adam
  updates the rows of this batch's ids only: the step costs O(batch), not
  O(capacity). ``ids`` are ``uint32[batch, fields, 2]`` word pairs
  (``jr.keys.split64``), so 64-bit ids stay exact with ``jax_enable_x64`` off.
  The model and optimizer are donated: their arrays are updated in place.
  """
  loss, grads = jr.value_and_grad(loss_fn)(model, ids, labels)
  optimizer.update(model, grads)
  return loss


@functools.cache
def adam(learning_rate: float) -> optax.GradientTransformation:
  """``optax.adam``, one object per learning rate.

  The transformation is a static attribute of ``nnx.Optimizer`` and of the
  embedding: sharing it lets a rebuilt model reuse the compiled
  :func:`train_step`.
  """
  return optax.adam(learning_rate)


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """Sizes of the model and the data of a :class:`Run`."""

  capacity: int = 1 << 16  # embedding rows that ids can take
  num_fields: int = 4
  features: int = 16
  hidden: int = 64
  batch_size: int = 512
  vocab_size: int = 1 << 18  # distinct ids per field in the data
  learning_rate: float = 0.01
  min_count: int = 2  # occurrences an id needs to get a row
  oov_buckets: int = 0  # shared rows for ids without their own
  row_optimizer: str = "catch_up"  # "catch_up": jr.CatchUpAdam; "lazy": optax.adam row by row
  seed: int = 0
  task: str = "click"  # "click": ClickStream (stationary); "drift": DriftStream (ids come and go)

  def stream(self) -> ClickStream | DriftStream:
    if self.task == "drift":
      return DriftStream(batch_size=self.batch_size, num_fields=self.num_fields, seed=self.seed)
    if self.task != "click":
      raise ValueError(f"task: expected 'click' or 'drift', got {self.task!r}.")
    return ClickStream(
      batch_size=self.batch_size, num_fields=self.num_fields, vocab_size=self.vocab_size, seed=self.seed
    )

  def row_adam(self):
    """The embedding rows' Adam: catching up idle steps (``jr.CatchUpAdam``) or lazy (``optax.adam``)."""
    if self.row_optimizer == "catch_up":
      return jr.CatchUpAdam(self.learning_rate)
    if self.row_optimizer != "lazy":
      raise ValueError(f"row_optimizer: expected 'catch_up' or 'lazy', got {self.row_optimizer!r}.")
    return adam(self.learning_rate)

  def model(self) -> ClickModel:
    return ClickModel(
      self.capacity,
      num_fields=self.num_fields,
      optimizer=self.row_adam(),
      features=self.features,
      hidden=self.hidden,
      min_count=self.min_count,
      oov_buckets=self.oov_buckets,
      rngs=nnx.Rngs(self.seed),
    )


class Run:
  """A training run that checkpoints every few steps and resumes where it stopped.

  The run's objects hang off one :class:`jaxres.Checkpoint`: ``model`` (the
  :class:`ClickModel`, its embedding's rows, row optimizer states and scores
  included) and ``optimizer`` (of the dense layers). When
  ``workdir`` already holds checkpoints, the run restores one *before* the
  model exists (:attr:`status` then lists every path as pending) and each
  object is filled in as it is attached. Data batches depend on the step
  alone, so a resumed run continues exactly as an uninterrupted one would.

  Args:
    config: the sizes of the model and the data.
    workdir: directory of the numbered checkpoints.
    checkpoint_every: save after every this many steps (``None``: never).
    restore_step: the step to resume from; ``None`` for the latest, if any.
    max_to_keep: checkpoints kept (``None``: all), with the steps they need.
    full_every: checkpoints are incremental (what changed since the one
      before), every this many a whole one.
  """

  def __init__(
    self,
    config: RunConfig,
    workdir,
    *,
    checkpoint_every: int | None = 100,
    restore_step: int | None = None,
    max_to_keep: int | None = 3,
    full_every: int = 4,
  ):
    self.config, self.checkpoint_every = config, checkpoint_every
    self.stream = config.stream()
    self.checkpoint = jr.Checkpoint()
    self.manager = jr.CheckpointManager(
      workdir, self.checkpoint, max_to_keep=max_to_keep, incremental=True, full_every=full_every
    )
    self.step, self.status, self.deferred = 0, None, []
    if restore_step is None:
      restore_step = self.manager.latest_step()
    if restore_step is not None:
      self.status = self.manager.restore(restore_step)  # before the model exists: all deferred
      self.step, self.deferred = restore_step, self.status.pending
    self.checkpoint.model = config.model()  # restored here, on attach
    self.checkpoint.optimizer = nnx.Optimizer(self.model, adam(config.learning_rate), wrt=nnx.Param)
    if self.status is not None:
      self.status.assert_consumed()

  @property
  def model(self) -> ClickModel:
    return self.checkpoint.model

  @property
  def optimizer(self) -> nnx.Optimizer:
    return self.checkpoint.optimizer

  def train(self, steps: int, callback: Callable[[int, jax.Array], None] | None = None) -> np.ndarray:
    """Runs ``steps`` training steps; returns their losses (``float32[steps]``).

    ``callback(step, loss)`` runs after every step (``loss`` is a device array:
    converting it waits for the step to finish).
    """
    losses = []
    for _ in range(steps):
      batch = self.stream.batch(self.step)
      losses.append(train_step(self.model, self.optimizer, jr.keys.split64(batch.ids), batch.labels))
      self.step += 1
      if self.checkpoint_every and self.step % self.checkpoint_every == 0:
        self.manager.save(self.step)
      if callback is not None:
        callback(self.step, losses[-1])
    return np.asarray(jax.device_get(losses), np.float32).reshape(steps)

  def close(self) -> None:
    """Waits for the checkpoints being written."""
    self.manager.close()
