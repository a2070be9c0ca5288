"""``Checkpoint``: save an object graph to one directory, restore it, possibly later.

A checkpoint directory holds two Orbax items, the manifest (see :mod:`manifest`)
and the arrays, as a ``CheckpointManager`` step does: one layout, one writer
(:func:`orbax_io.write`). Orbax commits a save atomically to a new directory
beside ``path``, which then takes ``path``'s place (the one step Orbax has
no atomic form of: an old checkpoint is retired first and put back if a save
is killed in between), so an interrupted save never replaces a complete
checkpoint. With several processes, all save and restore together: each
writes its own shards of row-split arrays (see :mod:`orbax_io`), and process
0 writes the manifest and moves the directory once every process has written.
Checkpoints written before (``manifest.json`` beside the arrays) restore too.
Restoring (see :mod:`restoring`) matches checkpointed paths with the objects
that exist now and restores them at once; a path whose object does not exist
yet is restored the moment an object is attached there.
"""

from __future__ import annotations

import os
import secrets
from typing import Any

import jax

from jaxres._persistence import files, processes, replacing
from jaxres._shell.trackable import AutoTrackable
from jaxres._tracking import manifest, orbax_io, restoring, saving
from jaxres._tracking.status import LoadStatus


class Checkpoint(AutoTrackable):
  """Saves and restores a graph of objects, like ``tf.train.Checkpoint``.

  Children are given by keyword (``Checkpoint(model=root)``) and found by
  attribute; ``Checkpoint(root=obj)`` makes ``obj`` itself the root of the
  graph (keyword children and later attributes are then set on it; a keyword
  naming an attribute the root already has is a ``ValueError``), as in
  TensorFlow. Objects are tables and other resources, ``jr.AutoTrackable`` s
  and other ``jr.Trackable`` s, NNX objects (``nnx.Module``, ``nnx.Optimizer``),
  arrays and pytrees of arrays, and lists, tuples and dicts of all these.
  Tables store their live entries only, so checkpoints grow with the number of
  entries, not with the capacity. An object reachable through several paths is
  saved once.

  Args:
    root: the object graph's root (``None``: the checkpoint itself is).
    **children: objects set as attributes of the root, by name.

  Examples:
    >>> import tempfile, numpy as np, jax.numpy as jnp, jaxres as jr
    >>> root = jr.AutoTrackable()
    >>> root.table = jr.MutableHashTable(np.int32, np.float32, default_value=0.0)
    >>> root.table.insert(np.array([7], np.int32), np.array([1.5], np.float32))
    >>> path = jr.Checkpoint(model=root).save(tempfile.mkdtemp() + "/ckpt")
    >>> fresh = jr.Checkpoint(model=jr.AutoTrackable())
    >>> status = fresh.restore(path)
    >>> status.pending
    ['model/table']
    >>> fresh.model.table = jr.MutableHashTable(np.int32, np.float32, default_value=0.0)
    >>> fresh.model.table.find(np.array([7], np.int32)).tolist()
    [1.5]
    >>> _ = status.assert_consumed()
  """

  def __init__(self, root: Any = None, **children: Any):
    # As in TensorFlow: `root` is the object graph's root, and keyword
    # children are set on it; without one, the checkpoint is its own root.
    # A keyword naming what the root already holds is refused, as TensorFlow does, before anything is set.
    taken = sorted(name for name in children if root is not None and hasattr(root, name))
    if taken:
      raise ValueError(
        f"{taken[0]}: root.{taken[0]} already exists; set it on the root itself, or use another keyword."
      )
    object.__setattr__(self, "_root", self if root is None else root)
    for name, child in children.items():
      setattr(self._root, name, child)

  @property
  def root(self) -> Any:
    """The root of the object graph: this checkpoint, or the ``root`` it was given."""
    return self._root

  def __getattr__(self, name: str) -> Any:
    root = self.__dict__.get("_root")
    if root is None or root is self:
      raise AttributeError(name)
    return getattr(root, name)

  def __setattr__(self, name: str, value: Any) -> None:
    root = self.__dict__.get("_root")
    if root is None or root is self or name.startswith("_"):
      super().__setattr__(name, value)
    else:
      setattr(root, name, value)

  def save(self, path: str) -> str:
    """Writes the graph to the directory ``path`` (replacing it atomically); returns it.

    With several processes (``jax.distributed``), every process calls it
    with the same graph: each writes the shards of its own devices.

    Raises:
      ValueError: ``path``, or a folder above it, is a file (nothing is written).
      OSError: the checkpoint could not be written (a full disk, say); a
        checkpoint already at ``path`` is then left as it was.
    """
    path = files.directory_path(path)
    contents, arrays = collect(self._root)
    staging = _staging(path)
    try:
      try:
        orbax_io.write(staging, contents, arrays)  # exists only complete: Orbax's atomic commit
      except Exception as err:  # Orbax reports write errors as ValueError
        raise OSError(f"{path}: could not write the checkpoint, nothing was replaced ({err}).") from err
      processes.barrier("jaxres: checkpoint written")
      if processes.is_primary():
        replacing.replace(staging, path)
      processes.barrier("jaxres: checkpoint in place")
    except BaseException:
      if processes.is_primary():
        _discard(staging)
      raise
    return path

  def restore(self, path: str) -> LoadStatus:
    """Restores existing objects now and queues the rest; returns a :class:`LoadStatus`.

    With several processes, every process calls it (and attaches deferred
    objects) alike: each reads an even share of a sharded table's shards.

    Raises:
      ValueError: ``path`` is not a readable checkpoint (a file, say), or an array differs in
        shape or dtype from its object (nothing is restored then).
      TypeError: an object is of another kind than the checkpoint holds at
        its path (nothing is restored then).
      Exception: whatever an object's ``_restore_from_arrays`` raises, with
        its path (nothing is restored then).
    """
    directory = files.directory_path(path)

    def read(where: str) -> tuple[dict, dict]:
      contents = manifest.check(orbax_io.read_manifest(where), directory)
      return contents, orbax_io.load_arrays(where, contents["arrays"])

    if jax.process_count() == 1:  # a save by another process may replace the directory meanwhile
      contents, arrays = replacing.read_whole(directory, read)
    else:  # processes read together: the primary puts back what a killed save retired first
      if processes.is_primary():
        replacing.recover(directory)
      processes.barrier("jaxres: checkpoint recovered")
      contents, arrays = read(directory)
    return restoring.restore(self._root, manifest.Reader(contents, arrays, directory))


def collect(root: Any) -> tuple[dict, dict]:
  """``(manifest, arrays)`` of the graph below ``root`` now (arrays copied to the host)."""
  nodes, arrays, _ = saving.collect(root)
  return manifest.build(nodes, orbax_io.specs(arrays)), arrays


def _staging(path: str) -> str:
  """A new path beside ``path`` that this save's checkpoint is committed to (named alike on every
  process), before it takes ``path``'s place."""
  parent, name = os.path.split(path)
  staging = os.path.join(parent, f".{name}.{replacing.SAVING}{processes.agreed(secrets.randbelow(2**31))}")
  if processes.is_primary():
    os.makedirs(parent, exist_ok=True)
    replacing.remove_stale(path)  # what killed saves left here
  processes.barrier("jaxres: checkpoint staged")
  return staging


def _discard(staging: str) -> None:
  """Removes what a failed save wrote: ``staging``, and Orbax's temporary directory beside it."""
  replacing.remove_until_gone(lambda: _written(staging))


def _written(staging: str) -> list[str]:
  """``staging`` and Orbax's temporary directory for it, those that exist (no other save's)."""
  return [d for d in (staging, staging + orbax_io.TEMPORARY_SUFFIX) if os.path.exists(d)]
