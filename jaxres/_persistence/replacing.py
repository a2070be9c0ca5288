"""Directories replaced atomically, recovered after a kill, and cleared of what killed saves left.

Every directory jaxres writes whole (a checkpoint, a saved model, a serving
delta) is first written under a temporary name beside its place, then moved
there. POSIX has no atomic swap of two directories, so an existing one is
*retired* first (renamed into ``.<name>.old-*``), the new one renamed into
place, and the retired one removed. A save killed between the two renames
leaves nothing at the path: :func:`recover` puts the retired one back, and the
next save or read in that place calls it. :func:`remove_stale` clears the
temporary and retired directories that killed saves left (``.<name>.saving-*``,
``.<name>.old-*``), so they do not pile up.
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile

SAVING, OLD = "saving-", "old-"


def staging_dir(path: str) -> str:
  """A new, empty directory beside ``path`` to write a save into (see :func:`replace`)."""
  parent, name = os.path.split(os.fspath(path))
  os.makedirs(parent, exist_ok=True)
  return tempfile.mkdtemp(prefix=f".{name}.{SAVING}", dir=parent)


def replace(staged: str, path: str) -> None:
  """Moves the finished directory ``staged`` to ``path``; an existing ``path`` is retired first,
  and removed once ``staged`` is in place (a kill in between: see :func:`recover`)."""
  staged, path = os.fspath(staged), os.fspath(path)
  if not os.path.exists(path):
    os.rename(staged, path)
    return
  parent, name = os.path.split(path)
  retired = tempfile.mkdtemp(prefix=f".{name}.{OLD}", dir=parent)
  os.rename(path, os.path.join(retired, "previous"))
  os.rename(staged, path)
  shutil.rmtree(retired, ignore_errors=True)


def recover(path: str) -> None:
  """Puts back the directory that a save killed between the renames of :func:`replace` had
  retired, if nothing is at ``path``."""
  path = os.fspath(path)
  if os.path.exists(path):
    return
  for retired in _beside(path, OLD):
    previous = [os.path.join(retired, child) for child in sorted(os.listdir(retired))]
    if len(previous) == 1 and os.path.isdir(previous[0]):
      os.rename(previous[0], path)
      shutil.rmtree(retired, ignore_errors=True)
      return


def remove_stale(path: str, keep: tuple[str, ...] = ()) -> None:
  """Recovers ``path`` (see :func:`recover`), then removes the temporary and retired directories
  that killed saves left beside it, except those in ``keep`` (and what starts with them)."""
  recover(path)
  for stale in _beside(path, SAVING) + _beside(path, OLD):
    if not any(stale.startswith(os.fspath(k)) for k in keep):
      shutil.rmtree(stale, ignore_errors=True)


def _beside(path: str, kind: str) -> list[str]:
  parent, name = os.path.split(os.fspath(path))
  pattern = os.path.join(glob.escape(parent), f".{glob.escape(name)}.{kind}*")
  return sorted(d for d in glob.glob(pattern) if os.path.isdir(d) and not os.path.islink(d))
