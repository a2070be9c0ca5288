"""``Checkpoint``: save an object graph to one directory, restore it, possibly later.

A checkpoint directory holds ``manifest.json`` (format, version, one node per
object path, the shape, dtype and checksum of every array) and the arrays, written by
Orbax. Saving writes to a temporary directory and renames it into place, so
an interrupted save never replaces a complete checkpoint.

Restoring matches checkpointed paths with the objects that exist now and
restores them at once. A path whose object does not exist yet is queued on
its nearest existing ancestor and restored the moment an object is attached
there (restore-on-create); a later ``restore`` replaces what an earlier one
queued.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import tempfile
from typing import Any

from jaxres._tracking import nodes, storage
from jaxres._tracking.trackable import AutoTrackable

MANIFEST = "manifest.json"
FORMAT = "jaxres.checkpoint"
VERSION = 1


class LoadStatus:
  """What a :meth:`Checkpoint.restore` matched, and what is still waiting.

  Every ``assert_*`` method raises ``AssertionError`` naming the paths at
  fault and otherwise returns the status, so calls can be chained.
  """

  def __init__(self, reader: nodes.Reader, directory: str):
    self._reader, self._directory = reader, directory
    self._matched: set[str] = set()
    self._pending: dict[str, Any] = {}
    self._extra: list[str] = []
    self._sharing: list[str] = []

  @property
  def pending(self) -> list[str]:
    """Sorted checkpoint paths still waiting for an object to be attached."""
    return sorted(self._pending)

  def _record(self, report: nodes.Report) -> None:
    self._matched |= report.matched
    self._extra += report.extra
    self._sharing += report.sharing

  def assert_consumed(self) -> LoadStatus:
    """Every checkpointed value found an object, and every object a value."""
    unused = sorted(p for p in self._reader.nodes if p not in self._matched)
    if unused:
      raise AssertionError(f"{self._directory}: checkpoint values with no object: {unused}")
    return self.assert_existing_objects_matched()

  def assert_existing_objects_matched(self) -> LoadStatus:
    """Every object that exists in the restored graph had a checkpointed value."""
    if self._extra:
      raise AssertionError(f"{self._directory}: objects with no checkpointed value: {sorted(self._extra)}")
    if self._sharing:
      raise AssertionError(
        f"{self._directory}: objects shared differently from the checkpoint at: {sorted(self._sharing)}"
      )
    return self

  def assert_nontrivial_match(self) -> LoadStatus:
    """At least one object besides the root was restored."""
    if not self._matched - {""}:
      raise AssertionError(f"{self._directory}: nothing but the root matched the checkpoint.")
    return self

  def expect_partial(self) -> LoadStatus:
    """Declares that a partial restore is intended (nothing is reported)."""
    return self

  def __repr__(self) -> str:
    return f"LoadStatus({self._directory!r}, matched={len(self._matched)}, pending={self.pending})"


class _Deferred:
  """A restoration queued on an object's attribute until something is attached there."""

  def __init__(self, reader: nodes.Reader, path: str, status: LoadStatus):
    self.reader, self.path, self.status = reader, path, status

  def restore(self, value: Any) -> Any:
    """Restores ``value`` (raising, with nothing changed, on a mismatch); returns what to attach."""
    if nodes.kind_of(value) in nodes.VALUE_KINDS:
      restored = nodes.plan_value(self.reader, value, self.path)
      self.status._matched.update(self.reader.subtree(self.path))
      self.status._pending.pop(self.path, None)
      return restored
    report = nodes.Report()
    actions = nodes.plan_restore(self.reader, value, self.path, report)
    _apply(actions, report, self.reader, self.status)
    self.status._pending.pop(self.path, None)
    return value


def _apply(actions, report: nodes.Report, reader: nodes.Reader, status: LoadStatus) -> None:
  for action in actions:
    action()
  status._record(report)
  for owner, name, path in report.missing:
    status._pending[path] = owner
    if isinstance(owner, AutoTrackable):
      owner.__dict__.setdefault("_jaxres_deferred", {})[name] = _Deferred(reader, path, status)


def read_manifest(directory: str) -> dict:
  """The manifest of a checkpoint directory, checked for format and version.

  Raises:
    ValueError: no manifest, a corrupted one, another format or a newer version.
  """
  path = os.path.join(directory, MANIFEST)
  try:
    with open(path, encoding="utf-8") as f:
      manifest = json.load(f)
  except (FileNotFoundError, NotADirectoryError):
    raise ValueError(f"{directory}: not a jaxres checkpoint (no {MANIFEST}).") from None
  except json.JSONDecodeError as err:
    raise ValueError(f"{path}: corrupted manifest ({err}).") from None
  return check_manifest(manifest, path)


def check_manifest(manifest, path: str) -> dict:
  """``manifest`` if it is a jaxres manifest this version can read; else ``ValueError``."""
  if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
    raise ValueError(f"{path}: not a jaxres checkpoint manifest.")
  if not isinstance(manifest.get("version"), int) or manifest["version"] > VERSION:
    raise ValueError(
      f"{path}: format version {manifest.get('version')!r} is newer than this jaxres reads ({VERSION})."
    )
  return manifest


class Checkpoint(AutoTrackable):
  """Saves and restores a graph of objects, like ``tf.train.Checkpoint``.

  Children are given by keyword (``Checkpoint(model=root)``) and found by
  attribute; ``Checkpoint(root=obj)`` makes ``obj`` itself the root of the
  graph (keyword children are then set on it), as in TensorFlow. Objects are
  tables and other resources, ``jr.AutoTrackable`` s, NNX objects (``nnx.Module``,
  ``nnx.Optimizer``), and
  arrays or pytrees of arrays. Tables store their live
  entries only, so checkpoints grow with the number of entries, not with the
  capacity.

  Example:
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
    object.__setattr__(self, "_root", self if root is None else root)
    for name, child in children.items():
      setattr(self._root, name, child)

  def __getattr__(self, name: str) -> Any:
    root = self.__dict__.get("_root")
    if root is None or root is self:
      raise AttributeError(name)
    return getattr(root, name)

  def _trackable_children(self) -> dict[str, Any]:
    if self._root is self:
      return super()._trackable_children()
    return self._root._trackable_children()

  def save(self, path: str) -> str:
    """Writes the graph to the directory ``path`` (replacing it atomically); returns it.

    Raises:
      OSError: the checkpoint could not be written (a full disk, say); a
        checkpoint already at ``path`` is then left as it was.
    """
    manifest, arrays = self._collect()
    path = storage.absolute_path(path)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    _recover(path)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.saving-", dir=parent)
    try:
      try:
        storage.save_arrays(staging, arrays)
        with open(os.path.join(staging, MANIFEST), "w", encoding="utf-8") as f:
          json.dump(manifest, f)
          f.flush()
          os.fsync(f.fileno())
      except Exception as err:  # Orbax reports write errors as ValueError
        raise OSError(f"{path}: could not write the checkpoint, nothing was replaced ({err}).") from err
      _replace_dir(staging, path)
    except BaseException:
      shutil.rmtree(staging, ignore_errors=True)
      raise
    return path

  def restore(self, path: str) -> LoadStatus:
    """Restores existing objects now and queues the rest; returns a :class:`LoadStatus`.

    Raises:
      ValueError: ``path`` is not a readable checkpoint, or an array differs in
        shape or dtype from its object (nothing is restored then).
      TypeError: an object is of another kind than the checkpoint holds at
        its path (nothing is restored then).
    """
    directory = storage.absolute_path(path)
    _recover(directory)
    manifest = read_manifest(directory)
    return self._apply(manifest, storage.load_arrays(directory, manifest["arrays"]), directory)

  def _collect(self) -> tuple[dict, dict]:
    """``(manifest, arrays)`` describing the graph now."""
    writer = nodes.Writer()
    nodes.save_node(self._root, "", writer)
    manifest = {
      "format": FORMAT,
      "version": VERSION,
      "nodes": writer.nodes,
      "arrays": {key: storage.spec_of(value) for key, value in writer.arrays.items()},
    }
    return manifest, writer.arrays

  def _apply(self, manifest: dict, arrays: dict, label: str) -> LoadStatus:
    reader = nodes.Reader(manifest["nodes"], arrays)
    status = LoadStatus(reader, label)
    report = nodes.Report()
    actions = nodes.plan_restore(reader, self._root, "", report)
    _apply(actions, report, reader, status)
    return status


def _replace_dir(staging: str, path: str) -> None:
  """Moves ``staging`` to ``path``; an existing ``path`` is retired first (see :func:`_recover`)."""
  if not os.path.exists(path):
    os.rename(staging, path)
    return
  retired = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.old-", dir=os.path.dirname(path))
  os.rename(path, os.path.join(retired, "checkpoint"))
  os.rename(staging, path)
  shutil.rmtree(retired, ignore_errors=True)


def _recover(path: str) -> None:
  """Puts back the checkpoint that a save killed between its two renames had retired."""
  if os.path.exists(path):
    return
  parent, name = os.path.split(path)
  for retired in sorted(glob.glob(os.path.join(glob.escape(parent), f".{glob.escape(name)}.old-*"))):
    previous = os.path.join(retired, "checkpoint")
    if os.path.isdir(previous):
      os.rename(previous, path)
      shutil.rmtree(retired, ignore_errors=True)
      return
