"""The one module that talks to Orbax: flat dicts of arrays in and out.

Arrays are saved under opaque keys (``e0``, ``e1``, ...); object paths live in
the manifest, never in Orbax's keys, so Orbax's own key joining cannot mix up
names that contain dots. Orbax refuses empty arrays, so those are recreated
from their recorded shape and dtype instead of being stored.

With several processes (``jax.distributed``) every process calls these
functions together. A global array split by rows over the processes (a
sharded table's blocks) is written shard by shard, each process its own
(Orbax's multi-process arrays), with a checksum per row; reading it back,
each process reads whole rows of its share (:class:`processes.Blocks`), so no
host holds all of it. Other arrays are written once and read by every process.
"""

from __future__ import annotations

import os
import shutil
import zlib
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxres._persistence import files, processes, replacing
from jaxres._persistence.processes import Blocks
from jaxres._tracking import tensorstore_json

tensorstore_json.install()  # TensorStore's to_json leaks what it returns; Orbax calls it per array

ARRAYS_DIR = "arrays"
MANIFEST_ITEM = "manifest"  # Orbax's JSON item: manifest/metadata
LEGACY_MANIFEST = "manifest.json"  # where checkpoints written before kept it
TEMPORARY_SUFFIX = ".orbax-checkpoint-tmp"  # Orbax's temporary directory of a save: <directory> + this


def specs(arrays: dict[str, np.ndarray | jax.Array]) -> dict[str, dict]:
  """The JSON description of each array entry, with a checksum of its bytes.

  ``arrays``: NumPy arrays, or global arrays split by rows over several
  processes (the copies a save makes), checksummed row by row.
  """
  return {key: _spec_of(array) for key, array in arrays.items()}


def _spec_of(array: np.ndarray | jax.Array) -> dict:
  spec = {"shape": list(array.shape), "dtype": str(array.dtype)}
  if isinstance(array, np.ndarray):
    return spec | {"crc32": _checksum(array)}
  local = np.full(array.shape[0], -1, np.int64)
  for row, data in processes.local_rows(array).items():
    local[row] = _checksum(data)
  return spec | {"crc32": processes.everywhere(local).max(axis=0).tolist()}


def _checksum(array: np.ndarray) -> int:
  return zlib.crc32(np.ascontiguousarray(array))


def write(directory: str, manifest: dict, arrays: dict[str, np.ndarray | jax.Array]) -> None:
  """Writes a checkpoint to the new ``directory`` on Orbax's atomic commit: the manifest (Orbax's
  JSON item ``manifest``) and the non-empty ``arrays`` (item ``arrays``) go to a temporary directory
  that is renamed to ``directory`` once all is written (by every process), so ``directory`` exists
  only complete. The same items as a :class:`StepStore` step's.
  """
  checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
  try:
    checkpointer.save(os.path.abspath(directory), args=ocp.args.Composite(**_items(manifest, arrays)))
  finally:
    checkpointer.close()


def _items(manifest: dict, arrays: dict[str, np.ndarray | jax.Array]) -> dict:
  """The Orbax items of a checkpoint: the manifest (sealed with its checksum), and the arrays that
  are not empty."""
  items = {MANIFEST_ITEM: ocp.args.JsonSave(files.sealed(manifest))}
  stored = {key: value for key, value in arrays.items() if value.size}
  if stored:
    items[ARRAYS_DIR] = ocp.args.StandardSave(stored)
  return items


def read_manifest(directory: str) -> Any:
  """The manifest a checkpoint directory holds, as JSON (unchecked: see ``manifest.check``):
  Orbax's JSON item, or the ``manifest.json`` of a checkpoint written before checkpoints were Orbax
  items. Everything in the directory is checked to be a regular file or a directory first (nothing
  that would block a reader, no link leading out), since Orbax then reads the arrays on its own.

  Raises:
    ValueError: no manifest, one that is not JSON, or a file of another kind in
      the directory.
  """
  if not os.path.isdir(directory):
    raise ValueError(f"{directory}: not a jaxres checkpoint (no such directory).")
  files.check_tree(Path(directory))
  path = os.path.join(directory, MANIFEST_ITEM, "metadata")
  if not os.path.isfile(path) and os.path.exists(os.path.join(directory, LEGACY_MANIFEST)):
    path = os.path.join(directory, LEGACY_MANIFEST)
  if not os.path.exists(path):
    raise ValueError(f"{directory}: not a jaxres checkpoint (no manifest).")
  return files.read_json(Path(path), "manifest")


def load_arrays(directory: str, specs: dict[str, dict]) -> dict[str, np.ndarray | Blocks]:
  """Reads the arrays described by ``specs`` (key -> its entry of :func:`specs`) as NumPy arrays.

  With several processes, an array saved split by rows comes back as the
  :class:`Blocks` of rows this process read.

  Raises:
    ValueError: an array is missing, or its shape, dtype or checksum differs from ``specs``.
  """
  restored = {}
  if targets := _targets(specs, os.path.join(os.path.abspath(directory), ARRAYS_DIR), directory):
    checkpointer = ocp.StandardCheckpointer()
    try:
      restored = checkpointer.restore(os.path.join(os.path.abspath(directory), ARRAYS_DIR), targets)
    except Exception as err:
      raise ValueError(
        f"{directory}: cannot read the checkpoint's arrays ({type(err).__name__}: {err})."
      ) from err
    finally:
      checkpointer.close()
  return _fill(directory, specs, restored)


def _targets(specs: dict[str, dict], stored: str, label: str) -> dict:
  """What Orbax reads each stored array into: NumPy, or this process's rows of a row-split one.

  Each array's shape and dtype are first checked against what Orbax recorded of the arrays it
  stored in ``stored`` (a manifest's claim allocates nothing the checkpoint does not hold).

  Raises:
    ValueError: naming ``label`` and the array: described otherwise than stored, or not stored.
  """
  wanted = {
    key: spec for key, spec in specs.items() if np.prod(spec["shape"], dtype=object) and "step" not in spec
  }  # not empty, nor stored in another step
  if not wanted:
    return {}
  recorded = _stored_arrays(stored, label)
  targets = {}
  for key, spec in wanted.items():
    shape, dtype = tuple(spec["shape"]), np.dtype(spec["dtype"])
    if key not in recorded or recorded[key] != (shape, dtype):
      found = "not stored" if key not in recorded else f"stored as {recorded[key][1]}{list(recorded[key][0])}"
      raise ValueError(f"{label}: array {key} is described as {dtype}{list(shape)} but {found} (corrupted).")
    nbytes = int(np.prod(shape, dtype=object)) * dtype.itemsize
    if nbytes > _memory_bytes():  # a crafted shape: refused before anything is allocated
      raise ValueError(
        f"{label}: array {key} is {dtype}{list(shape)}, {nbytes / 2**30:.1f} GiB: more than this "
        "machine's memory (corrupted, or not meant for this machine)."
      )
    split = isinstance(spec.get("crc32"), list) and jax.process_count() > 1
    if split and jax.dtypes.canonicalize_dtype(dtype) == dtype:
      targets[key] = jax.ShapeDtypeStruct(shape, dtype, sharding=processes.reading_sharding(shape[0]))
    else:
      try:
        targets[key] = np.empty(shape, dtype)
      except MemoryError as err:
        message = f"{label}: array {key} is {dtype}{list(shape)}, which does not fit in memory."
        raise ValueError(message) from err
  return targets


def _memory_bytes() -> int:
  """The machine's physical memory in bytes (no bound where the system does not say)."""
  try:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  except (ValueError, OSError, AttributeError):
    return 1 << 62


def _stored_arrays(stored: str, label: str) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
  """``{key: (shape, dtype)}`` of the arrays Orbax recorded in the item directory ``stored``."""
  handler = ocp.StandardCheckpointHandler()  # the item's own metadata (no step metadata to look for)
  try:
    tree = handler.metadata(Path(stored))
    return {key: (tuple(m.shape), np.dtype(m.dtype)) for key, m in dict(tree).items()}
  except Exception as err:  # missing or damaged metadata
    raise ValueError(
      f"{label}: cannot read what the checkpoint's arrays are ({type(err).__name__}: {err})."
    ) from err
  finally:
    handler.close()


def _fill(label: str, specs: dict[str, dict], restored: dict) -> dict[str, np.ndarray | Blocks]:
  """Restored arrays checked against their specs; empty arrays recreated."""
  out = {}
  for key, spec in specs.items():
    if "step" in spec:  # stored in another step (an incremental step's): read from there
      continue
    if np.prod(spec["shape"], dtype=np.int64):
      if key not in restored:
        raise ValueError(f"{label}: array {key} is missing from the checkpoint.")
      value = restored[key]
      if isinstance(value, jax.Array):  # this process's rows of a row-split array
        value = Blocks(tuple(value.shape), np.dtype(value.dtype), processes.local_rows(value))
      else:
        value = np.asarray(value)
    else:
      value = np.zeros(spec["shape"], spec["dtype"])
    if list(value.shape) != spec["shape"] or str(value.dtype) != spec["dtype"]:
      raise ValueError(f"{label}: array {key} is {value.dtype}{list(value.shape)}, expected {spec}.")
    if "crc32" in spec and not _intact(value, spec["crc32"]):
      raise ValueError(f"{label}: array {key} is corrupted (its checksum differs from the manifest's).")
    out[key] = value
  return out


def _intact(value: np.ndarray | Blocks, crc32: int | list[int]) -> bool:
  """Whether ``value`` has the checksum ``crc32`` (a list: one per row; of ``Blocks``, the rows held)."""
  if not isinstance(crc32, list):
    return _checksum(value) == crc32
  rows = value.rows.items() if isinstance(value, Blocks) else enumerate(value)
  return len(crc32) == value.shape[0] and all(_checksum(row) == crc32[i] for i, row in rows)


TRASH = ".deleted"  # where a manager's steps go to be removed (not a step name: never listed)
_STEP_NAMES = ocp.path.step.standard_name_format()  # how Orbax's manager names the step directories
_LISTING_ATTEMPTS = 8


class StepStore:
  """Numbered checkpoints in one directory, on Orbax's ``CheckpointManager``.

  Each step holds a JSON manifest and the non-empty arrays. Orbax writes a
  step to a temporary directory and commits it by renaming, so a save that is
  interrupted never shows up in :meth:`all_steps`. Saves run asynchronously;
  every read waits for them first.
  """

  def __init__(self, directory: str):
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=True, todelete_subdir=TRASH)
    self._manager = ocp.CheckpointManager(os.path.abspath(directory), options=options)

  def save(self, step: int, manifest: dict, arrays: dict[str, np.ndarray | jax.Array]) -> None:
    try:
      self._manager.save(step, args=ocp.args.Composite(**_items(manifest, arrays)))
    except Exception as err:
      raise OSError(f"{self._label(step)}: could not save this step ({err}).") from err

  def load(self, step: int, check_manifest) -> tuple[dict, dict[str, np.ndarray | Blocks]]:
    """``(manifest, arrays)`` of ``step``; ``check_manifest`` vets the manifest first."""
    self.wait()
    label = self._label(step)
    files.check_tree(Path(label))
    try:
      args = ocp.args.Composite(manifest=ocp.args.JsonRestore())
      manifest = self._manager.restore(step, args=args)["manifest"]
    except Exception as err:  # missing or unreadable
      raise ValueError(f"{label}: corrupted manifest ({type(err).__name__}: {err}).") from err
    manifest = check_manifest(manifest, label)
    specs = manifest["arrays"]
    restored = {}
    if targets := _targets(specs, os.path.join(label, ARRAYS_DIR), label):
      try:
        args = ocp.args.Composite(arrays=ocp.args.StandardRestore(targets))
        restored = self._manager.restore(step, args=args)["arrays"]
      except Exception as err:
        raise ValueError(
          f"{label}: cannot read the checkpoint's arrays ({type(err).__name__}: {err})."
        ) from err
    return manifest, _fill(label, specs, restored)

  def all_steps(self, reload: bool = False) -> list[int]:
    """The committed steps; ``reload``: listed from the directory (Orbax's manager keeps the list it
    read last, which another process's saves and deletions leave behind)."""
    self.wait()
    if not reload:
      return sorted(self._manager.all_steps())
    directory = self._manager.directory
    for _ in range(_LISTING_ATTEMPTS):
      try:
        steps = sorted(step.step for step in _STEP_NAMES.find_all(directory)) if directory.exists() else []
        break
      except FileNotFoundError:  # a step another process deleted while it was listed: list again
        continue
    else:
      raise OSError(f"{directory}: steps kept being deleted while they were listed; try again.")
    return steps

  def remove_unfinished(self) -> None:
    """Removes the temporary directories of saves that never committed (a failed save's, or a killed
    writer's): only for the directory's writer, which no other process saves beside."""
    if not processes.is_primary():  # the process Orbax writes the temporary directories in
      return
    directory = Path(self._manager.directory)
    # The failed save's writes still in flight recreate what is removed: removed until it stays gone.
    replacing.remove_until_gone(
      lambda: [e for e in (directory.iterdir() if directory.is_dir() else ()) if TEMPORARY_SUFFIX in e.name]
    )

  def refresh(self) -> None:
    """Orbax's manager lists the steps on the disk again (for a writer that has just taken the
    directory: no other process deletes steps meanwhile)."""
    self.wait()
    self._manager.reload()

  def delete(self, step: int) -> None:
    """Deletes ``step`` at once: Orbax renames its directory into :data:`TRASH` (one rename: a process
    killed meanwhile leaves the step whole or gone, never half of it listed), then the trash, with
    whatever an interrupted deletion left there, is removed."""
    self._manager.delete(step)
    if processes.is_primary():  # the process Orbax renames in
      shutil.rmtree(self._manager.directory / TRASH, ignore_errors=True)

  def path(self, step: int) -> str:
    """The directory of ``step``."""
    return self._label(step)

  def wait(self) -> None:
    """Blocks until pending saves are written; a failed one raises ``OSError`` (once)."""
    try:
      self._manager.wait_until_finished()
    except Exception as err:  # Orbax re-raises a background save's error here
      raise OSError(
        f"{self._manager.directory}: an asynchronous save failed and was not committed; "
        f"earlier steps are intact ({err})."
      ) from err

  def _label(self, step: int) -> str:
    return os.path.join(str(self._manager.directory), str(step))

  def close(self) -> None:
    try:
      self.wait()
    finally:
      self._manager.close()
