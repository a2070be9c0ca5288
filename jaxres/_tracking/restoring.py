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
  ``AutoTrackable`` can) and restored on attach. Only the arrays such pending
  paths may still need are kept in memory.
* **The later restore wins.** A restore that still waits for paths hears of
  what every later restore writes (the objects whose arrays it wrote, and the
  values an owner holds that it replaced: arrays, functional tables, tuples),
  and reaching them afterwards (through a deferred attach) does not overwrite
  them; one whose checkpoint no longer matches what is attached is simply
  superseded. Nothing is kept of a restore once nothing of it waits.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

from jaxres import _errors as errors
from jaxres._shell.trackable import Commit
from jaxres._tracking import paths
from jaxres._tracking.handles import Handle, handle_for
from jaxres._tracking.identity import IdentityMap, reference, weakly_referenceable
from jaxres._tracking.manifest import Reader
from jaxres._tracking.status import Ledger, LoadStatus


class Writes:
  """The objects whose arrays some restores wrote, and the values they replaced (owner, relative path)."""

  def __init__(self):
    self.objects = IdentityMap()  # object -> True
    self.slots = IdentityMap()  # owner -> {relative path of a value child}

  def has_object(self, obj: Any) -> bool:
    return self.objects.get(obj, False)

  def has_slot(self, owner: Any, relative: str) -> bool:
    return relative in self.slots.get(owner, ())

  def object_written(self, obj: Any) -> None:
    self.objects[obj] = True

  def slot_written(self, owner: Any, relative: str) -> None:
    slots = self.slots.get(owner)
    if slots is None:
      slots = self.slots[owner] = set()
    slots.add(relative)

  def merge(self, other: Writes, *, lasting: bool = False) -> None:
    """Takes ``other``'s records; ``lasting``: only those of objects that can be weakly referenced
    (a waiting restore's records must not keep lists and dicts alive)."""
    for obj, _ in other.objects.items():
      if not lasting or weakly_referenceable(obj):
        self.object_written(obj)
    for owner, slots in other.slots.items():
      if not lasting or weakly_referenceable(owner):
        for relative in slots:
          self.slot_written(owner, relative)


class Restore:
  """One call of ``restore``: the checkpoint read, what it has done so far, and what later restores wrote.

  From its start until nothing of it waits any more, a restore is in
  :data:`_UNDER_WAY` (weakly: a restore whose deferred paths can never be
  attached, their owners gone, goes with them).
  """

  def __init__(self, reader: Reader):
    self.reader, self.ledger = reader, Ledger()
    self.waiting: dict[str, str] = {}  # program path -> checkpoint path, of the deferred restores
    self.later = Writes()  # what restores begun after this one wrote, while this one waits
    _UNDER_WAY.begin(self)

  def settle(self) -> None:
    """Drops the arrays that no pending path can need any more; ends the restore when none waits."""
    self.reader.retain(self.waiting.values())
    if not self.waiting:
      _UNDER_WAY.end(self)


class UnderWay:
  """The restores begun and not yet done, oldest first: who must hear of a restore's writes."""

  def __init__(self):
    self._restores: list[weakref.ref] = []
    self._lock = threading.Lock()

  def begin(self, restore: Restore) -> None:
    with self._lock:
      self._restores = [r for r in self._restores if r() is not None] + [weakref.ref(restore)]

  def end(self, restore: Restore) -> None:
    with self._lock:
      self._restores = [r for r in self._restores if r() not in (None, restore)]

  def newest_first(self, restores: list[Restore]) -> list[Restore]:
    order = self._order()
    return sorted(restores, key=lambda r: order.get(id(r), -1), reverse=True)

  def written(self, restore: Restore, writes: Writes) -> None:
    """Tells each restore begun before ``restore`` and still under way what ``restore`` wrote."""
    for older in self._alive():
      if older is restore:
        break
      older.later.merge(writes, lasting=True)

  def _alive(self) -> list[Restore]:
    with self._lock:
      return [r for ref in self._restores if (r := ref()) is not None]

  def _order(self) -> dict[int, int]:
    return {id(r): i for i, r in enumerate(self._alive())}


_UNDER_WAY = UnderWay()


def restore(root: Any, reader: Reader) -> LoadStatus:
  """Restores the graph below ``root`` from ``reader`` now, and queues what does not exist yet."""
  if not getattr(handle_for(root), "shared", False):
    raise TypeError(f"root: expected an object to restore into, got a {type(root).__name__}.")
  this = Restore(reader)
  transaction = Transaction()
  plan = Plan(this, transaction)
  plan.visit(root, "", "", owner=None, relative="", inherited=False)
  transaction.accept(plan)
  transaction.commit()
  plan.finish()
  this.settle()
  return LoadStatus(reader, this.ledger)


class Transaction:
  """The changes of one or more plans, committed together: all of them, or (undone) none."""

  def __init__(self):
    self.changes: list[tuple[str, Commit]] = []
    self.writes = Writes()  # of the plans accepted so far: restores later than the next plan's
    self._plans: list[Plan] = []

  def accept(self, plan: Plan) -> None:
    self.changes += plan.changes
    self.writes.merge(plan.writes)
    self._plans.append(plan)

  def commit(self) -> None:
    undos = []
    try:
      for path, commit in self.changes:
        try:
          undo = commit()
        except Exception as err:
          raise errors.at_path(path, err) from err
        if undo is not None:
          undos.append(undo)
    except BaseException:
      for undo in reversed(undos):
        undo()
      raise
    for plan in self._plans:
      _UNDER_WAY.written(plan.restore, plan.writes)


class Plan:
  """One restore's part of a transaction: the subtree it visits, checked and planned."""

  def __init__(self, restore: Restore, transaction: Transaction):
    self.restore, self.transaction = restore, transaction
    self.changes: list[tuple[str, Commit]] = []
    self.writes = Writes()
    self.ledger = Ledger()
    self.missing: list[tuple[Handle, str, str, str]] = []  # owner, relative, program path, checkpoint path

  def visit(self, obj: Any, path: str, node_path: str, owner: Any, relative: str, inherited: bool) -> Any:
    """Plans the restore of ``obj`` (at ``path``) from ``node_path``; returns the object for its place.

    ``owner`` holds ``obj`` at ``relative`` (``None`` inside a value).
    ``inherited``: the value holding this one was written by a later restore.
    """
    reader = self.restore.reader
    node_path = reader.canonical(node_path)
    node = reader.nodes[node_path]
    try:
      handle = handle_for(obj)
    except Exception as err:
      raise errors.at_path(path, err) from err
    if handle is None or handle.kind != node["kind"]:
      got = type(obj).__name__ + (
        ", which cannot be checkpointed" if handle is None else f" (kind {handle.kind})"
      )
      saved = node["type"].rsplit(".", 1)[-1]
      raise TypeError(
        f"{path or errors.ROOT}: the checkpoint holds {saved} (kind {node['kind']}), got {got}."
      )
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
      frozen = self._written_later(Writes.has_object, obj)
      if not frozen:
        self.writes.object_written(obj)
    else:
      frozen = inherited or (owner is not None and self._written_later(Writes.has_slot, owner, relative))
    self.ledger.matched.add(path)
    self.ledger.consumed.add(node_path)
    new = obj
    if not frozen:
      try:
        new, commit = handle.restore(reader.arrays(node_path, handle.takes_parts))
      except Exception as err:
        raise errors.at_path(path, err) from err
      if commit is not None:
        self.changes.append((path, commit))
    replaced = self._visit_children(handle, path, node_path, node, frozen and not handle.shared)
    if replaced:
      try:
        new, commits = handle.replace(replaced)
      except Exception as err:
        raise errors.at_path(path, err) from err
      self.changes += [(path, commit) for commit in commits]
      if handle.shared:
        for child in replaced:
          self.writes.slot_written(obj, child)
    return new

  def _visit_children(self, handle: Handle, path: str, node_path: str, node: dict, inherited: bool) -> dict:
    """Visits the children; returns the new values of those that are replaced (relative path -> value)."""
    try:
      program = handle.children()
    except Exception as err:
      raise errors.at_path(path, err) from err
    owner = handle.obj if handle.shared else None
    replaced = {}
    for relative in node["children"]:
      child_path, child_node = paths.join(path, relative), paths.join(node_path, relative)
      if relative not in program:
        self.missing.append((handle, relative, child_path, child_node))
        continue
      child = program[relative]
      new = self.visit(child, child_path, child_node, owner, relative, inherited)
      if new is not child:
        replaced[relative] = new
    saved = set(node["children"])
    self.ledger.extra |= {
      paths.join(path, relative)
      for relative, child in program.items()
      if relative not in saved and _holds_state(child, set())
    }
    return replaced

  def _written_later(self, has: Callable[..., bool], *key: Any) -> bool:
    """Whether a later restore wrote there: one committed while this one waited, or one of the same attach."""
    return any(has(record, *key) for record in (self.transaction.writes, self.restore.later))

  def _first_object(self, node_path: str) -> Any:
    ref = self.ledger.first_object.get(node_path) or self.restore.ledger.first_object.get(node_path)
    return None if ref is None else ref()

  def finish(self) -> None:
    """After the commit: records what was matched and queues what is missing."""
    for owner, relative, path, node_path in self.missing:
      self.ledger.pending.add(path)
      queue = owner.defer(relative, functools.partial(DeferredQueue, reference(owner.obj), relative))
      if queue is not None:
        queue.add(self.restore, path, node_path)
        self.restore.waiting[path] = node_path
    self.restore.ledger.merge(self.ledger)


class DeferredQueue:
  """The restores waiting for one child of one object, run when something is attached there."""

  def __init__(self, owner: Callable[[], Any], relative: str):
    self._owner, self._relative = owner, relative
    self._waiting: list[tuple[Restore, str, str]] = []  # restore, program path, checkpoint path
    self._superseded: list[tuple[Restore, str, str]] = []  # the same, of restores a newer one stands for
    self._lock = threading.Lock()

  def add(self, restore: Restore, path: str, node_path: str) -> None:
    """Queues ``restore`` for ``path``.

    An older restore waiting for the same path whose checkpoint holds nothing
    there that this one lacks would add nothing on attach: it is superseded.
    It lets its arrays for the path go (restores that wait do not pile up) and
    stays pending until the attach, which then counts its values as matched
    too (see :meth:`attach`).
    """
    with self._lock:
      outline = restore.reader.outline(node_path)
      older = _UNDER_WAY.newest_first([r for r, _, _ in self._waiting] + [restore])
      superseded = [
        entry
        for entry in self._waiting
        if entry[1] == path
        and older.index(entry[0]) > older.index(restore)
        and entry[0].reader.outline(entry[2]) <= outline
      ]
      self._waiting = [e for e in self._waiting if e not in superseded] + [(restore, path, node_path)]
      self._superseded += superseded
    for old, old_path, _ in superseded:
      old.waiting.pop(old_path, None)
      old.settle()

  def attach(self, value: Any, place: Callable[[Any], None]) -> bool:
    """Restores ``value`` and calls ``place`` with what to attach, as the last step; True when done.

    The latest restore sets the value; earlier ones add what only they hold,
    and one whose checkpoint does not match ``value`` is superseded. A value
    that is not part of the graph (a number, ``None``) is placed as it is and
    the path stays pending (returns False). On a mismatch with the latest
    restore this raises, with every object left as it was and nothing placed.
    """
    with self._lock:
      if not self._waiting or not _is_content(value):
        place(value)
        return not self._waiting
      order = _UNDER_WAY.newest_first([restore for restore, _, _ in self._waiting])
      waiting = sorted(self._waiting, key=lambda entry: order.index(entry[0]))
      transaction = Transaction()
      owner = self._owner()
      attached, plans, served = value, [], []  # served: (restore, path) no longer waiting here
      for i, (restore, path, node_path) in enumerate(waiting):
        plan = Plan(restore, transaction)
        try:
          new = plan.visit(value, path, node_path, owner, self._relative, inherited=False)
        except (TypeError, ValueError):
          if i == 0:
            raise
          served.append((restore, path))  # superseded by the later restore
          continue
        transaction.accept(plan)
        if i == 0 and new is not value:
          attached = new
          if owner is not None:
            for record in (plan.writes, transaction.writes):  # the later plans', and older restores' to hear
              record.slot_written(owner, self._relative)
        plans.append(plan)
        served.append((restore, path))
      transaction.changes.append((waiting[0][1], lambda: place(attached)))
      transaction.commit()
      self._waiting = []
      superseded, self._superseded = self._superseded, []
    for plan in plans:
      plan.finish()
    matched = plans[0].restore.ledger.matched if plans else set()
    for restore, path, node_path in superseded:  # what the newest restore matched, in their terms
      for relative, canonical in restore.reader.below(node_path):
        program_path = paths.join(path, relative) if relative else path
        if program_path in matched:
          restore.ledger.matched.add(program_path)
          restore.ledger.consumed.add(canonical)
      restore.ledger.pending.discard(path)
    for restore, path in served:
      restore.ledger.pending.discard(path)
      restore.waiting.pop(path, None)
      restore.settle()
    return True


def _is_content(value: Any) -> bool:
  try:
    return handle_for(value) is not None
  except TypeError:
    return True  # in part: the restore names the problem


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
