"""Maps keyed by object identity that do not keep their objects alive where they can avoid it."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any


def reference(obj: Any) -> Callable[[], Any]:
  """A weak reference to ``obj`` where Python allows one (lists and dicts do not: a strong one)."""
  try:
    return weakref.ref(obj)
  except TypeError:
    return lambda: obj


def weakly_referenceable(obj: Any) -> bool:
  return isinstance(reference(obj), weakref.ref)


class IdentityMap:
  """``obj -> value`` by identity; an entry goes when its object is garbage collected."""

  def __init__(self):
    self._entries: dict[int, tuple[Callable[[], Any], Any]] = {}

  def get(self, obj: Any, default: Any = None) -> Any:
    entry = self._entries.get(id(obj))
    if entry is None or entry[0]() is not obj:  # gone, and the id reused
      return default
    return entry[1]

  def __setitem__(self, obj: Any, value: Any) -> None:
    key = id(obj)
    try:
      ref = weakref.ref(obj, lambda _, key=key: self._forget(key))
    except TypeError:
      ref = reference(obj)
    self._entries[key] = (ref, value)

  def items(self) -> list[tuple[Any, Any]]:
    """``(obj, value)`` of the objects still alive."""
    return [(obj, value) for ref, value in list(self._entries.values()) if (obj := ref()) is not None]

  def update(self, other: IdentityMap) -> None:
    for obj, value in other.items():
      self[obj] = value

  def _forget(self, key: int) -> None:
    entry = self._entries.get(key)
    if entry is not None and entry[0]() is None:
      del self._entries[key]
