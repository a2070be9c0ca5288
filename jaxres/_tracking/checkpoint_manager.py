"""``CheckpointManager``: numbered, atomic checkpoints of one :class:`Checkpoint`, whole or incremental."""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401 (registers its exit hook before ours: see _close_open_managers)
import functools
import sys
import threading
import weakref

from jaxres._errors import check_int
from jaxres._persistence import files, processes
from jaxres._tracking import increments, manifest, orbax_io, ownership, restoring, saving
from jaxres._tracking.checkpoint import Checkpoint
from jaxres._tracking.orbax_io import StepStore
from jaxres._tracking.status import LoadStatus


class CheckpointManager:
  """Saves a :class:`Checkpoint` every few steps and restores the latest.

  Built on Orbax's ``CheckpointManager``: saves are asynchronous (the arrays
  are copied first, so training can go on), atomic (a save interrupted at any
  moment, even by SIGKILL, never becomes the latest step) and pruned to the
  ``max_to_keep`` newest steps. With several processes (``jax.distributed``)
  every process calls each method together, as for :class:`Checkpoint`.
  One manager writes to a directory at a time: the first save takes it over
  until :meth:`close` (or the process ends), and a manager of another
  process that saves there meanwhile is refused; a manager that only reads
  (``restore``, ``all_steps``) takes nothing and deletes nothing. A manager
  left open is closed when the interpreter exits (its pending save is
  committed, old steps pruned), and one dropped unclosed commits its pending
  save then; :meth:`close` is where a failed save's error is raised.

  **Incremental saves** (``incremental=True``): the first save, every
  ``full_every``-th one and ``save(step, full=True)`` write everything; the
  others write only what changed since the step before: the entries of
  open-addressing tables (stateful or functional, sharded or not, an
  embedding's rows with their optimizer state and scores) inserted, changed,
  evicted or removed, and the other arrays whose contents changed. Their size
  follows what training touched, not the tables. ``restore(step)`` reads the
  steps a step needs and gives exactly the state a whole save would have;
  ``max_to_keep`` keeps the steps that kept steps need. The first save after
  the manager is made or restores is whole. Sorted tables are saved whole in
  every step. With several processes each writes (and composes) its own
  shards' changes.

  Args:
    directory: where the numbered checkpoints live.
    checkpoint: the :class:`Checkpoint` to save and restore.
    max_to_keep: keep only this many newest steps (``None``: keep all), and
      the steps they need.
    incremental: save what changed since the step before (see above).
    full_every: with ``incremental``, every this many saves is whole (``None``:
      every :attr:`FULL_EVERY`-th), so that a chain stays short: a restore
      reads at most ``full_every`` steps, and ``max_to_keep`` can delete the
      chains no kept step needs.

  Raises:
    TypeError: an argument of the wrong type.
    ValueError: ``directory``, or a folder above it, is a file; or an option
      out of range.

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

    Incremental saves of a table:

    >>> import numpy as np
    >>> root.table = jr.MutableHashTable(np.int64, np.float32, default_value=0.0, initial_capacity=4096)
    >>> manager = jr.CheckpointManager(tempfile.mkdtemp(), jr.Checkpoint(model=root), incremental=True)
    >>> root.table.insert(np.arange(1000), np.ones(1000, np.float32))
    >>> manager.save(0)  # whole: 1000 entries
    >>> root.table.insert(np.array([5, 2000]), np.array([7.0, 8.0], np.float32))
    >>> manager.save(1)  # the 2 entries that changed
    >>> [a["shape"] for e in jr.inspect_checkpoint(manager.step_path(1)) if e["path"] == "model/table"
    ...  for a in e["arrays"] if a["name"] == "keys"]
    [[2]]
    >>> root.table.remove(np.array([5]))
    >>> _ = manager.restore(1)
    >>> root.table.find(np.array([5, 2000])).tolist()
    [7.0, 8.0]
    >>> manager.close()
  """

  FULL_EVERY = 16  # incremental saves: by default every 16th is whole (a restore reads at most 16 steps)
  READ_ATTEMPTS = 8  # restore(): how many latest steps a reader tries while a writer prunes them

  def __init__(
    self,
    directory,
    checkpoint: Checkpoint,
    max_to_keep: int | None = None,
    *,
    incremental: bool = False,
    full_every: int | None = None,
  ):
    if not isinstance(checkpoint, Checkpoint):
      raise TypeError(f"checkpoint: expected a jr.Checkpoint, got {type(checkpoint).__name__}.")
    if max_to_keep is not None:
      max_to_keep = check_int(max_to_keep, "max_to_keep", low=1)
    if not isinstance(incremental, bool):
      raise TypeError(f"incremental: expected a bool, got {incremental!r}.")
    if full_every is not None:
      if not incremental:
        raise ValueError(
          "full_every: only incremental saves (incremental=True) have saves that are not full."
        )
      full_every = check_int(full_every, "full_every", low=1)
    self.directory = files.directory_path(directory, "directory")
    self.checkpoint = checkpoint
    self._incremental = incremental
    self._max_to_keep = max_to_keep
    self._full_every = self.FULL_EVERY if full_every is None else full_every
    # The manager prunes (not Orbax), keeping the steps that kept steps need: the directory may hold
    # incremental steps even where this manager writes whole ones.
    self._store = StepStore(self.directory)
    self._written: increments.Written | None = None  # the step the next one is written against
    self._saves_since_full = 0
    self._needs: dict[int, list[int]] = {}
    self._saved = False  # pruning follows this manager's own saves: reading never deletes
    self._owner = ownership.Owner(self.directory)  # one writer per directory, claimed at the first save
    # A manager dropped unclosed still commits its pending save (and gives the directory up).
    self._release = weakref.finalize(self, _release, self._store, self._owner)
    _open_managers.add(self)

  def save(self, step: int, full: bool | None = None) -> None:
    """Saves the checkpoint's objects as ``step`` (returns once the arrays are copied).

    Args:
      step: the step number (a new one).
      full: with ``incremental=True``, ``True`` writes everything (``None``:
        as ``full_every`` says).

    Raises:
      TypeError: ``step`` is not an int, or an object cannot be checkpointed.
      ValueError: ``step`` is negative, already saved, or below the latest step;
        or a manager of another process saves to this directory (one writer per
        directory, until it closes; a newer manager of this process takes over).
      OSError: the step before failed to be written (nothing of it was kept);
        the next save is whole.
    """
    step = check_int(step, "step", low=0)
    if full is not None and not isinstance(full, bool):
      raise TypeError(f"full: expected a bool or None, got {full!r}.")
    # The process that commits the steps takes the directory; where it takes it now (its first save,
    # or a directory removed and made again since), the steps are listed afresh from the disk.
    claimed = self._owner.claim() if processes.is_primary() else ownership.HELD
    if claimed != ownership.HELD:  # taken now: the steps listed from the disk
      self._store.refresh()
    if claimed == ownership.LOCKED:  # no other writer: what a killed one left unfinished is removed
      self._store.remove_unfinished()
    self._settle()
    steps = self._store.all_steps()
    if step in steps:
      raise ValueError(f"step: {step} is already saved in {self.directory}.")
    if steps and step < steps[-1]:
      raise ValueError(f"step: {step} is below the latest saved step {steps[-1]}; steps only go up.")
    self._saved = True
    if not self._incremental:
      nodes, arrays, _ = saving.collect(self.checkpoint.root)
      self._store.save(step, manifest.build(nodes, orbax_io.specs(arrays)), arrays)
      return
    previous = self._written
    whole = full or previous is None or self._saves_since_full == self._full_every
    nodes, arrays, marks = saving.collect(self.checkpoint.root, since={} if whole else previous.marks)
    specs = orbax_io.specs(arrays)
    if whole:
      contents, written = increments.whole(step, nodes, specs, marks)
    else:
      contents, arrays, written = increments.incremental(step, nodes, arrays, specs, marks, previous)
    self._written = None  # until the step is written
    self._store.save(step, contents, arrays)
    self._written = written
    self._needs[step] = increments.needs(contents)
    self._saves_since_full = 1 if whole else self._saves_since_full + 1

  def restore(self, step: int | None = None) -> LoadStatus:
    """Restores ``step`` (the latest when ``None``) into the checkpoint's objects.

    An incremental step is read with the steps it needs, into exactly the
    state a whole save would have restored.

    A manager that only reads lists the steps from the directory first (see
    :meth:`all_steps`); where a writing manager of another process prunes the
    latest step while it is read, the newest step is read instead.

    Raises:
      ValueError: there is no such step (or another manager deleted it while it
        was read), or the checkpoint is unreadable or of another structure (see
        :meth:`Checkpoint.restore`).
    """
    requested = step
    for attempt in range(self.READ_ATTEMPTS):
      steps = self.all_steps()
      if requested is None and not steps:
        raise ValueError(f"{self.directory}: no checkpoint to restore.")
      step = steps[-1] if requested is None else requested
      if step not in steps:
        raise ValueError(f"step: {step} is not among the saved steps {steps}.")
      try:
        contents, arrays = self._read(step)
        break
      except ValueError as err:
        # Another process's manager may have pruned the step since it was listed: then the latest
        # step is read again (a step asked for by number is gone, and said so).
        now = self._store.all_steps(reload=not self._saved)
        if step in now:
          raise
        if requested is not None or attempt + 1 == self.READ_ATTEMPTS:
          raise ValueError(
            f"step: {step} was deleted by another manager while it was read (the saved steps are now {now})."
          ) from err
    self._written = None  # the objects now hold another state than the step written last
    return restoring.restore(self.checkpoint.root, manifest.Reader(contents, arrays, self._store.path(step)))

  def _read(self, step: int) -> tuple[dict, dict]:
    """``(contents, arrays)`` of ``step``, with the steps it needs."""
    check = functools.partial(manifest.check, incremental=True)
    return increments.materialize(step, lambda s: self._store.load(s, check), self._store.path)

  def step_path(self, step: int) -> str:
    """The directory of ``step`` (which ``jr.inspect_checkpoint`` opens).

    Raises:
      ValueError: ``step`` is not saved.
    """
    if step not in self.all_steps():
      raise ValueError(f"step: {step} is not among the saved steps {self.all_steps()}.")
    return self._store.path(step)

  def latest_step(self) -> int | None:
    """The newest complete step, or ``None``."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def all_steps(self) -> list[int]:
    """The complete steps, oldest first.

    A manager that has not saved lists them from the directory at each call, so
    a reader (an evaluator beside a trainer in another process) sees the steps
    the writer saves and prunes.
    """
    self._settle()
    return self._store.all_steps(reload=not self._saved)

  def wait_until_finished(self) -> None:
    """Blocks until every asynchronous save has been written."""
    self._settle()

  def close(self) -> None:
    """Waits for pending saves and releases Orbax's resources."""
    _open_managers.discard(self)
    try:
      self._settle()
    finally:
      self._release()

  def _settle(self) -> None:
    """Waits for the pending save; then, once this manager has saved, removes the steps that are
    neither among the ``max_to_keep`` newest nor needed by one of them (a manager that only reads
    deletes nothing, as TensorFlow's).

    A failed save raises (``OSError``) and makes the next one whole.
    """
    try:
      self._store.wait()
    except OSError:
      self._written = None
      if self._saved:
        self._store.remove_unfinished()  # the failed step's temporary directory
      raise
    if self._max_to_keep is None or not self._saved:
      return
    steps = self._store.all_steps()
    kept = set(steps[-self._max_to_keep :])
    for step in list(kept):
      kept.update(self._steps_needed(step))
    for step in steps:
      if step not in kept:
        self._store.delete(step)
        self._needs.pop(step, None)

  def _steps_needed(self, step: int) -> list[int]:
    if step not in self._needs:
      label = self._store.path(step)
      try:
        contents = manifest.check(orbax_io.read_manifest(label), label, incremental=True)
      except ValueError:  # a damaged step restores nothing: it keeps no other step
        contents = {}
      self._needs[step] = increments.needs(contents)
    return self._needs[step]


def _release(store: StepStore, owner: ownership.Owner) -> None:
  """Waits for ``store``'s pending save, closes it and gives the directory up."""
  try:
    store.close()
  finally:
    owner.release()


_open_managers: weakref.WeakSet[CheckpointManager] = weakref.WeakSet()


def _close_open_managers() -> None:
  """Closes the managers still open at interpreter exit: their pending saves are committed.

  Runs among ``threading``'s exit hooks, which run in the reverse order of their registration,
  before the interpreter joins its threads and before ``atexit``: so before the hook of
  ``concurrent.futures.thread`` (imported above, so registered first) refuses new work to
  executors, which Orbax's background commit of a save still needs. Left to run after it, that
  commit fails and the save is lost, with a traceback for each of its threads.
  """
  for manager in list(_open_managers):
    try:
      manager.close()
    except Exception as err:  # reported, as nothing is left to raise it to
      print(f"jaxres: closing CheckpointManager({manager.directory!r}) at exit: {err}", file=sys.stderr)


threading._register_atexit(_close_open_managers)
