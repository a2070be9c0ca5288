"""Restoring: the program's graph matched with a checkpoint's, checked, then changed all at once.

A restore walks the program's objects and the checkpoint's nodes together.
Every object is checked (kind, arrays) and its change planned before anything
changes; then the changes are committed in order, and a failure undoes those
already made, so a failing restore leaves every object as it was.

* **Aliases.** An object saved under several paths is restored from its
  node through whichever of its paths exists; when the program holds distinct
  objects there now, each is restored and the difference is reported.
* **Deferred restore.** A checkpointed child that does not exist yet is
  queued on its owner (if the owner can tell when it is attached, as an
  ``AutoTrackable`` can) and restored on attach.
* **The later restore wins.** Restores are numbered; an object records the
  number of the restore that last wrote it, and an earlier restore reaching it
  afterwards (through a deferred attach) does not overwrite it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from jaxres._shell.trackable import Commit
from jaxres._tracking import paths
from jaxres._tracking.handles import Handle, handle_for
from jaxres._tracking.identity import IdentityMap, reference, weakly_referenceable
from jaxres._tracking.manifest import Reader
from jaxres._tracking.status import Ledger, LoadStatus

_NUMBERS = itertools.count(1)
_LAST_WRITE = IdentityMap()  # object -> number of the latest restore that wrote it


class Restore:
  """One call of ``restore``: the checkpoint read, its number, and what it has done so far."""

  def __init__(self, reader: Reader):
    self.reader, self.number, self.ledger = reader, next(_NUMBERS), Ledger()


def restore(root: Any, reader: Reader) -> LoadStatus:
  """Restores the graph below ``root`` from ``reader`` now, and queues what does not exist yet."""
  if not getattr(handle_for(root), "shared", False):
    raise TypeError(f"root: expected an object to restore into, got a {type(root).__name__}.")
  this = Restore(reader)
  transaction = Transaction()
  plan = Plan(this, transaction)
  plan.visit(root, "", "", frozen=False)
  transaction.commit()
  plan.finish()
  return LoadStatus(reader, this.ledger)


class Transaction:
  """Changes committed together: all of them, or (undone) none."""

  def __init__(self):
    self.changes: list[tuple[str, Commit]] = []
    self.writes = IdentityMap()  # object -> restore number, for the objects these changes write

  def last_write(self, obj: Any) -> int:
    return max(self.writes.get(obj, 0), _LAST_WRITE.get(obj, 0))

  def commit(self) -> None:
    undos = []
    try:
      for path, commit in self.changes:
        try:
          undo = commit()
        except Exception as err:
          raise _at(path, err) from err
        if undo is not None:
          undos.append(undo)
    except BaseException:
      for undo in reversed(undos):
        undo()
      raise
    _LAST_WRITE.update(self.writes)


class Plan:
  """One restore's part of a transaction: the subtree it visits, checked and planned."""

  def __init__(self, restore: Restore, transaction: Transaction):
    self.restore, self.transaction = restore, transaction
    self.ledger = Ledger()
    self.missing: list[tuple[Handle, str, str, str]] = []  # owner, relative, program path, checkpoint path

  def visit(self, obj: Any, path: str, node_path: str, frozen: bool) -> Any:
    """Plans the restore of ``obj`` (at ``path``) from ``node_path``; returns the object for its place.

    ``frozen``: a later restore wrote the object holding this one, so values
    are not replaced (objects with an identity decide for themselves).
    """
    reader = self.restore.reader
    node_path = reader.canonical(node_path)
    node = reader.nodes[node_path]
    handle = _checked(path, lambda: handle_for(obj))
    if handle is None or handle.kind != node["kind"]:
      got = type(obj).__name__ + (
        ", which cannot be checkpointed" if handle is None else f" (kind {handle.kind})"
      )
      saved = node["type"].rsplit(".", 1)[-1]
      raise TypeError(f"{_shown(path)}: the checkpoint holds {saved} (kind {node['kind']}), got {got}.")
    if handle.shared:
      seen = self.ledger.objects.get(obj, self.restore.ledger.objects.get(obj))
      if seen is not None:  # met before in this restore: restored (or being restored) already
        if seen != node_path:
          self.ledger.sharing.add(path)  # one object here, two in the checkpoint
        self.ledger.matched.add(path)
        return obj
      if self._first_object(node_path) is not None:
        self.ledger.sharing.add(path)  # two objects here, one in the checkpoint: both restored
      self.ledger.objects[obj] = node_path
      self.ledger.first_object.setdefault(node_path, reference(obj))
      if weakly_referenceable(obj):
        frozen = self.transaction.last_write(obj) > self.restore.number
        if not frozen:
          self.transaction.writes[obj] = self.restore.number
    self.ledger.matched.add(path)
    self.ledger.consumed.add(node_path)
    new = obj
    if not frozen:
      new, commit = _checked(path, lambda: handle.restore(reader.arrays(node_path)))
      if commit is not None:
        self.transaction.changes.append((path, commit))
    replaced = self._visit_children(handle, path, node_path, node, frozen)
    if replaced:
      new, commits = _checked(path, lambda: handle.replace(replaced))
      self.transaction.changes += [(path, commit) for commit in commits]
    return new

  def _visit_children(self, handle: Handle, path: str, node_path: str, node: dict, frozen: bool) -> dict:
    """Visits the children; returns the new values of those that are replaced (relative path -> value)."""
    program = _checked(path, handle.children)
    replaced = {}
    for relative in node["children"]:
      child_path, child_node = paths.join(path, relative), paths.join(node_path, relative)
      if relative not in program:
        self.missing.append((handle, relative, child_path, child_node))
        continue
      child = program[relative]
      new = self.visit(child, child_path, child_node, frozen)
      if new is not child:
        replaced[relative] = new
    saved = set(node["children"])
    self.ledger.extra |= {
      paths.join(path, relative)
      for relative, child in program.items()
      if relative not in saved and _holds_state(child, set())
    }
    return replaced

  def _first_object(self, node_path: str) -> Any:
    ref = self.ledger.first_object.get(node_path) or self.restore.ledger.first_object.get(node_path)
    return None if ref is None else ref()

  def finish(self) -> None:
    """After the commit: records what was matched and queues what is missing."""
    for owner, relative, path, node_path in self.missing:
      self.ledger.pending.add(path)
      queue = owner.defer(relative, DeferredQueue)
      if queue is not None:
        queue.waiting.append((self.restore, path, node_path))
    self.restore.ledger.merge(self.ledger)


class DeferredQueue:
  """The restores waiting for one child of one object, run when something is attached there."""

  def __init__(self):
    self.waiting: list[tuple[Restore, str, str]] = []  # restore, program path, checkpoint path

  def attach(self, value: Any) -> Any:
    """Restores ``value`` (the later restore first); returns what to attach.

    Raises (with every object left as it was) when ``value`` does not match.
    """
    waiting = sorted(self.waiting, key=lambda entry: entry[0].number, reverse=True)
    transaction = Transaction()
    plans = [Plan(restore, transaction) for restore, _, _ in waiting]
    attached = value
    for i, (plan, (_, path, node_path)) in enumerate(zip(plans, waiting)):
      new = plan.visit(value, path, node_path, frozen=i > 0)  # the latest restore sets a value
      attached = new if i == 0 else attached
    transaction.commit()
    for plan, (restore, path, _) in zip(plans, waiting):
      plan.finish()
      restore.ledger.pending.discard(path)
    return attached


def _holds_state(obj: Any, seen: set[int]) -> bool:
  """Whether ``obj`` (or anything below it) holds arrays; an empty container does not."""
  if id(obj) in seen:
    return False
  seen.add(id(obj))
  try:
    handle = handle_for(obj)
  except TypeError:
    return True
  if handle is None:
    return False
  return handle.holds_values() or any(_holds_state(c, seen) for c in handle.children().values())


def _checked(path: str, action: Callable[[], Any]) -> Any:
  """``action()``, its errors renamed to name ``path``."""
  try:
    return action()
  except Exception as err:
    raise _at(path, err) from err


def _at(path: str, err: Exception) -> Exception:
  """``err`` with the path in front of its message (same type where it can be built from a message)."""
  message = f"{_shown(path)}: {err}"
  try:
    return type(err)(message)
  except Exception:
    return RuntimeError(f"{_shown(path)}: {type(err).__name__}: {err}")


def _shown(path: str) -> str:
  return path or "<root>"
