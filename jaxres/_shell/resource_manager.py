"""Sharing resources by (container, shared_name), as TensorFlow's ResourceMgr does."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any


def _check_name(value, name: str) -> str:
  if not isinstance(value, str):
    raise TypeError(f"{name}: expected a str, got {value!r}.")
  return value


class ResourceManager:
  """A registry of shared resources, keyed by ``(container, shared_name)``.

  * The same ``(container, shared_name)`` gives the same object: the first
    request creates it with ``create_fn``, later ones get it back (after
    ``verify_fn(existing)``, which may raise for an incompatible request).
  * An empty ``shared_name`` means private: ``create_fn`` runs every time and
    nothing is registered. An empty ``container`` is the default container.
  * Entries are weak: a resource nobody references any more is dropped.
  * Thread-safe: racing requests for one name create exactly one resource.

  Examples:
    >>> import jaxres as jr
    >>> mgr = jr.ResourceManager()
    >>> a = mgr.lookup_or_create("", "vocab", jr.AutoTrackable)
    >>> a is mgr.lookup_or_create("", "vocab", jr.AutoTrackable)
    True
    >>> mgr.lookup_or_create("", "", jr.AutoTrackable) is a  # private
    False
  """

  def __init__(self):
    self._lock = threading.RLock()
    self._entries: dict[tuple[str, str], weakref.ref] = {}

  def lookup_or_create(
    self,
    container: str,
    shared_name: str,
    create_fn: Callable[[], Any],
    verify_fn: Callable[[Any], None] | None = None,
  ) -> Any:
    """The resource registered under the name, created by ``create_fn`` if absent.

    Raises:
      TypeError: a name is not a string, or the created object cannot be
        weakly referenced.
      Exception: whatever ``verify_fn`` raises for an incompatible existing resource.
    """
    key = (_check_name(container, "container"), _check_name(shared_name, "shared_name"))
    if not callable(create_fn):
      raise TypeError(f"create_fn: expected a callable, got {create_fn!r}.")
    if verify_fn is not None and not callable(verify_fn):
      raise TypeError(f"verify_fn: expected None or a callable, got {verify_fn!r}.")
    if shared_name == "":
      return create_fn()
    with self._lock:
      existing = self._get(key)
      if existing is None:
        resource = create_fn()
        try:
          self._entries[key] = weakref.ref(resource, self._forget(key))
        except TypeError:
          raise TypeError(
            f"create_fn: returned {type(resource).__name__}, which cannot be weakly referenced."
          ) from None
        return resource
    if verify_fn is not None:
      verify_fn(existing)
    return existing

  def lookup(self, container: str, shared_name: str) -> Any:
    """The registered resource; ``KeyError`` when there is none."""
    key = (_check_name(container, "container"), _check_name(shared_name, "shared_name"))
    with self._lock:
      existing = self._get(key)
    if existing is None:
      raise KeyError(f"no resource {shared_name!r} in container {container!r}")
    return existing

  def delete(self, container: str, shared_name: str) -> None:
    """Unregisters a resource (it lives on while referenced); ``KeyError`` if absent."""
    key = (_check_name(container, "container"), _check_name(shared_name, "shared_name"))
    with self._lock:
      if self._get(key) is None:
        raise KeyError(f"no resource {shared_name!r} in container {container!r}")
      del self._entries[key]

  def names(self, container: str = "") -> list[str]:
    """Sorted shared names of the live resources in ``container``."""
    with self._lock:
      return sorted(name for (c, name) in list(self._entries) if c == container and self._get((c, name)))

  def _get(self, key):
    ref = self._entries.get(key)
    return None if ref is None else ref()

  def _forget(self, key):
    def callback(ref):
      with self._lock:
        if self._entries.get(key) is ref:
          del self._entries[key]

    return callback
