"""Directories replaced atomically, recovered after a kill, and cleared of what killed saves left.

Every directory jaxres writes whole (a checkpoint, a saved model, a serving
delta) is first written under a temporary name beside its place, then moved
there. POSIX has no atomic swap of two directories, so an existing one is
*retired* first (renamed into ``.<name>.old-*``), the new one renamed into
place, and the retired one removed. A save killed between the two renames
leaves nothing at the path: :func:`recover` puts the retired one back, and the
next save in that place calls it. :func:`remove_stale` clears the temporary and
retired directories that killed saves left (``.<name>.saving-*``,
``.<name>.old-*``), so they do not pile up.

Readers write nothing: :func:`read_whole` reads a directory that another
process may be replacing meanwhile, all of its files from one save.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

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
  previous = _retired_copy(path)
  if previous is not None:
    os.rename(previous, path)
    shutil.rmtree(os.path.dirname(previous), ignore_errors=True)


def remove_until_gone(found: Callable[[], list], settle: float = 0.2, patience: float = 10.0) -> None:
  """Removes the directories ``found()`` lists until it lists none for ``settle`` seconds (or
  ``patience`` seconds have passed): what a failed save wrote.

  Orbax reports the first failed write of a save while its others may still be in flight, and
  those recreate their files; so the directories are removed again until no write brings them back.
  """
  deadline = time.monotonic() + patience
  while True:
    for directory in found():
      shutil.rmtree(directory, ignore_errors=True)
    time.sleep(settle)
    if not found() or time.monotonic() > deadline:
      return


READ_ATTEMPTS = 8  # reads of a directory replaced meanwhile, before read_whole gives up


def read_whole(path, read: Callable[[str], T], attempts: int = READ_ATTEMPTS) -> T:
  """``read(directory)`` of the directory at ``path``, every file of it from one save, though
  another process may replace ``path`` meanwhile (:func:`replace`); nothing is written.

  ``read`` is given ``path``, or where nothing is there (a save between its two renames, or killed
  there) the retired copy beside it. Where the directory at ``path`` is another one after ``read``
  than before (replaced: ``read`` may have met files of two saves, or none), ``read`` runs again,
  up to ``attempts`` times, a little later each time; its errors (``OSError``, ``ValueError``)
  are raised only when it failed on a directory that stayed in place.

  Raises:
    OSError: ``path`` was replaced during each of the ``attempts`` reads.

  Examples:
    >>> import tempfile
    >>> from pathlib import Path
    >>> path = Path(tempfile.mkdtemp(), "saved")
    >>> staged = staging_dir(path)
    >>> Path(staged, "step").write_text("1")
    1
    >>> replace(staged, path)
    >>> read_whole(path, lambda d: Path(d, "step").read_text())
    '1'
  """
  path = os.fspath(path)
  for attempt in range(attempts):
    if attempt:
      time.sleep(0.005 * 2**attempt)
    before = _identity(path)
    where = path if before is not None else (_retired_copy(path) or path)
    try:
      result = read(where)
    except (OSError, ValueError):
      if _identity(path) != before and attempt + 1 < attempts:
        continue
      raise
    if _identity(path) == before:
      return result
  raise OSError(f"{path}: replaced by another process during each of {attempts} reads; read it again later.")


def _identity(path: str) -> tuple[int, int] | None:
  """Which directory is at ``path`` (device and inode), or ``None``: none."""
  try:
    stat = os.stat(path)
  except OSError:
    return None
  return (stat.st_dev, stat.st_ino) if os.path.isdir(path) else None


def _retired_copy(path: str) -> str | None:
  """The directory a save retired from ``path`` (:func:`replace`), if one is left beside it."""
  for retired in _beside(path, OLD):
    try:
      previous = [os.path.join(retired, child) for child in sorted(os.listdir(retired))]
    except OSError:  # removed meanwhile
      continue
    if len(previous) == 1 and os.path.isdir(previous[0]):
      return previous[0]
  return None


def remove_stale(path: str, keep: tuple[str, ...] = ()) -> None:
  """Recovers ``path`` (see :func:`recover`), then removes the temporary and retired directories
  that killed saves left beside it, except those in ``keep`` (and what starts with them)."""
  recover(path)
  for stale in _beside(path, SAVING) + _beside(path, OLD):
    if not any(stale.startswith(os.fspath(k)) for k in keep):
      shutil.rmtree(stale, ignore_errors=True)


def _beside(path: str, kind: str) -> list[str]:
  """The directories ``.<name>.<kind>*`` beside ``path``. Listed and matched by prefix, not with
  ``glob``: ``fnmatch`` keeps every pattern it compiled (up to 32,768), one per checkpoint path."""
  parent, name = os.path.split(os.fspath(path))
  prefix = f".{name}.{kind}"
  try:
    entries = os.listdir(parent or os.curdir)
  except OSError:  # no parent directory (nothing beside), or not a directory
    return []
  found = (os.path.join(parent, e) for e in entries if e.startswith(prefix))
  return sorted(d for d in found if os.path.isdir(d) and not os.path.islink(d))
