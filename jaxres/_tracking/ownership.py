"""One writer per checkpoint directory: the manager that saves there owns it until it closes.

A :class:`CheckpointManager` takes the directory's ownership at its first save:
an exclusive ``flock`` on the directory itself (no file is added to it), held until
:meth:`Owner.release` (the manager's ``close``) or the end of the process
(the kernel drops the lock of a process that dies, so a killed trainer leaves
no stale lock; a child it forked closes its copy of the lock at once, so the
lock dies with the trainer whatever its children do). A manager in another
process that tries to save there is refused. Within one process, a newer
manager of the same directory takes the ownership over (a restarted trainer
that never closed the old manager): the older one's next save is refused
instead. Each save checks that the directory locked is still the one at the
path (one removed and made again is locked afresh). Where the filesystem has no
``flock`` (NFS without a lock manager, some FUSE mounts), saving goes on with a
:class:`UnlockedDirectoryWarning`: one writer per directory is then the user's to
keep. Readers take nothing.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import warnings
import weakref

HELD, HANDED, LOCKED = "held", "handed over", "locked"  # what Owner.claim did
_held: dict[str, tuple[int, weakref.ref]] = {}  # directory -> (locked fd, the owner holding it)
_guard = threading.Lock()
_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)}


class UnlockedDirectoryWarning(UserWarning):
  """A checkpoint directory's filesystem cannot lock it (no ``flock``: NFS without a lock manager,
  some FUSE mounts): a :class:`jaxres.CheckpointManager` saves there, but one of another process
  saving there too is not refused. Given at the manager's first save.

  Examples:
    >>> import warnings, jaxres as jr
    >>> warnings.filterwarnings("error", category=jr.UnlockedDirectoryWarning)  # or refuse such disks
    >>> issubclass(jr.UnlockedDirectoryWarning, UserWarning)
    True
  """


def _forget_in_child() -> None:
  """In a forked child: its copies of the parents' locks closed, so that they die with the parent."""
  global _guard
  _guard = threading.Lock()  # another thread of the parent may have held it at the fork
  for fd, _ in _held.values():
    try:
      os.close(fd)
    except OSError:
      pass
  _held.clear()


if hasattr(os, "register_at_fork"):
  os.register_at_fork(after_in_child=_forget_in_child)


def _same_directory(fd: int, directory: str) -> bool:
  """Whether ``directory`` is still the directory open as ``fd`` (not removed, nor made again)."""
  try:
    now = os.stat(directory)
  except OSError:
    return False
  held = os.fstat(fd)
  return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


class Owner:
  """The ownership of one directory by one manager (taken by :meth:`claim`)."""

  def __init__(self, directory: str):
    self.directory = os.path.realpath(directory)
    self._fd: int | None = None
    self._superseded = False  # a newer manager of this process took the directory over

  def claim(self) -> str:
    """Makes this the directory's writer: :data:`HELD` (it already was), :data:`HANDED` (taken over
    from a manager of this process, whose saves may still be pending) or :data:`LOCKED` (no writer of
    this process had it: the lock taken from the system).

    Raises:
      ValueError: naming the directory: a manager of another process owns it,
        or a newer manager of this process took it over.
    """
    with _guard:
      if self._fd is not None:
        held = _held.get(self.directory)
        if held is None or held[1]() is not self:
          self._fd, self._superseded = None, True
        elif not _same_directory(self._fd, self.directory):  # removed and made again: lock the new one
          del _held[self.directory]
          os.close(self._fd)
          self._fd = None
      if self._superseded:
        raise ValueError(
          f"{self.directory}: a newer CheckpointManager of this process saves here now; this one "
          "no longer may (one writer per directory)."
        )
      if self._fd is not None:
        return HELD
      held = _held.get(self.directory)
      if held is not None:  # a manager of this process: hand the lock over
        fd = held[0]
        _held[self.directory] = (fd, weakref.ref(self))
        self._fd = fd
        return HANDED
      os.makedirs(self.directory, exist_ok=True)
      fd = os.open(self.directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except OSError as err:
        if err.errno in _UNSUPPORTED:
          warnings.warn(
            f"directory: {self.directory} cannot be locked on its filesystem ({os.strerror(err.errno)}): "
            "a CheckpointManager of another process saving there too would not be refused; keep to one "
            "writer per directory.",
            UnlockedDirectoryWarning,
            stacklevel=3,
          )
        else:
          os.close(fd)
          if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise OSError(err.errno, f"{self.directory}: cannot lock the directory ({err.strerror})") from err
          raise ValueError(
            f"directory: {self.directory} is being saved to by another CheckpointManager, of another "
            "process; one writer per directory: wait for it to close, or save elsewhere."
          ) from None
      _held[self.directory] = (fd, weakref.ref(self))
      self._fd = fd
      return LOCKED

  def release(self) -> None:
    """Gives the ownership up (if this still holds it)."""
    with _guard:
      held = _held.get(self.directory)
      if self._fd is not None and held is not None and held[1]() is self:
        del _held[self.directory]
        os.close(self._fd)  # drops the flock
      self._fd = None
