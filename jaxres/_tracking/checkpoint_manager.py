"""``CheckpointManager``: numbered, atomic checkpoints of one :class:`Checkpoint`."""

from __future__ import annotations

import os

from jaxres._errors import check_int
from jaxres._tracking import manifest, restoring
from jaxres._tracking.checkpoint import Checkpoint, collect
from jaxres._tracking.orbax_io import StepStore, absolute_path
from jaxres._tracking.status import LoadStatus


class CheckpointManager:
  """Saves a :class:`Checkpoint` every few steps and restores the latest.

  Built on Orbax's ``CheckpointManager``: saves are asynchronous (the arrays
  are copied first, so training can go on), atomic (a save interrupted at any
  moment, even by SIGKILL, never becomes the latest step) and pruned to the
  ``max_to_keep`` newest steps. With several processes (``jax.distributed``)
  every process calls each method together, as for :class:`Checkpoint`.

  Args:
    directory: where the numbered checkpoints live.
    checkpoint: the :class:`Checkpoint` to save and restore.
    max_to_keep: keep only this many newest steps (``None``: keep all).

  Examples:
    >>> import tempfile, jax.numpy as jnp, jaxres as jr
    >>> root = jr.AutoTrackable()
    >>> root.step = jnp.array(0)
    >>> manager = jr.CheckpointManager(tempfile.mkdtemp(), jr.Checkpoint(model=root), max_to_keep=2)
    >>> for step in range(3):
    ...   root.step = jnp.array(step)
    ...   manager.save(step)
    >>> manager.all_steps(), manager.latest_step()
    ([1, 2], 2)
    >>> root.step = jnp.array(-1)
    >>> _ = manager.restore()
    >>> int(root.step)
    2
    >>> manager.close()
  """

  def __init__(self, directory, checkpoint: Checkpoint, max_to_keep: int | None = None):
    if not isinstance(checkpoint, Checkpoint):
      raise TypeError(f"checkpoint: expected a jr.Checkpoint, got {type(checkpoint).__name__}.")
    if max_to_keep is not None:
      max_to_keep = check_int(max_to_keep, "max_to_keep", low=1)
    self.directory = absolute_path(directory, "directory")
    self.checkpoint = checkpoint
    self._store = StepStore(self.directory, max_to_keep)

  def save(self, step: int) -> None:
    """Saves the checkpoint's objects as ``step`` (returns once the arrays are copied).

    Raises:
      TypeError: ``step`` is not an int, or an object cannot be checkpointed.
      ValueError: ``step`` is negative or already saved.
    """
    step = check_int(step, "step", low=0)
    if step in self._store.all_steps():
      raise ValueError(f"step: {step} is already saved in {self.directory}.")
    self._store.save(step, *collect(self.checkpoint.root))

  def restore(self, step: int | None = None) -> LoadStatus:
    """Restores ``step`` (the latest when ``None``) into the checkpoint's objects.

    Raises:
      ValueError: there is no such step, or the checkpoint is unreadable or
        of another structure (see :meth:`Checkpoint.restore`).
    """
    steps = self._store.all_steps()
    if step is None:
      if not steps:
        raise ValueError(f"{self.directory}: no checkpoint to restore.")
      step = steps[-1]
    if step not in steps:
      raise ValueError(f"step: {step} is not among the saved steps {steps}.")
    label = os.path.join(self.directory, str(step))
    contents, arrays = self._store.load(step, manifest.check)
    return restoring.restore(self.checkpoint.root, manifest.Reader(contents, arrays, label))

  def latest_step(self) -> int | None:
    """The newest complete step, or ``None``."""
    steps = self._store.all_steps()
    return steps[-1] if steps else None

  def all_steps(self) -> list[int]:
    """The complete steps, oldest first."""
    return self._store.all_steps()

  def wait_until_finished(self) -> None:
    """Blocks until every asynchronous save has been written."""
    self._store.wait()

  def close(self) -> None:
    """Waits for pending saves and releases Orbax's resources."""
    self._store.close()
