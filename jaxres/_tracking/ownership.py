"""One writer per checkpoint directory: the manager that saves there owns it until it closes.

A :class:`CheckpointManager` takes the directory's ownership at its first save:
an exclusive ``flock`` on the directory itself (no file is added to it), held until
:meth:`Owner.release` (the manager's ``close``) or the end of the process
(the kernel drops the lock of a process that dies, so a killed trainer leaves
no stale lock). A manager in another process that tries to save there is
refused. Within one process, a newer manager of the same directory takes the
ownership over (a restarted trainer that never closed the old manager): the
older one's next save is refused instead. Readers take nothing.
"""

from __future__ import annotations

import fcntl
import os
import threading
import weakref

_held: dict[str, tuple[int, weakref.ref]] = {}  # directory -> (locked fd, the owner holding it)
_guard = threading.Lock()


class Owner:
  """The ownership of one directory by one manager (taken by :meth:`claim`)."""

  def __init__(self, directory: str):
    self.directory = os.path.realpath(directory)
    self._fd: int | None = None
    self._superseded = False  # a newer manager of this process took the directory over

  def claim(self) -> None:
    """Makes this the directory's writer (a no-op if it is already).

    Raises:
      ValueError: naming the directory: a manager of another process owns it,
        or a newer manager of this process took it over.
    """
    with _guard:
      if self._fd is not None:
        held = _held.get(self.directory)
        if held is None or held[1]() is not self:
          self._fd, self._superseded = None, True
      if self._superseded:
        raise ValueError(
          f"{self.directory}: a newer CheckpointManager of this process saves here now; this one "
          "no longer may (one writer per directory)."
        )
      if self._fd is not None:
        return
      held = _held.get(self.directory)
      if held is not None:  # a manager of this process: hand the lock over
        fd = held[0]
        _held[self.directory] = (fd, weakref.ref(self))
        self._fd = fd
        return
      os.makedirs(self.directory, exist_ok=True)
      fd = os.open(self.directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except OSError:
        os.close(fd)
        raise ValueError(
          f"directory: {self.directory} is being saved to by another CheckpointManager, of another "
          "process; one writer per directory: wait for it to close, or save elsewhere."
        ) from None
      _held[self.directory] = (fd, weakref.ref(self))
      self._fd = fd

  def release(self) -> None:
    """Gives the ownership up (if this still holds it)."""
    with _guard:
      held = _held.get(self.directory)
      if self._fd is not None and held is not None and held[1]() is self:
        del _held[self.directory]
        os.close(self._fd)  # drops the flock
      self._fd = None
