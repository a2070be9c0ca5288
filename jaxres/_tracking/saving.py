"""Saving: the object graph walked breadth first into manifest nodes and host arrays.

Breadth first, so an object reachable through several paths is saved under
its shortest (the first met) and its other paths become aliases.
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Mapping
from typing import Any

from jaxres import _errors as errors
from jaxres._persistence import processes
from jaxres._tracking import paths
from jaxres._tracking.handles import Handle, handle_for

_SAVABLE = "biufc"  # bool, integer, float and complex arrays


def collect(root: Any, since: Mapping[str, Any] | None = None) -> tuple[dict, dict, dict[str, Any]]:
  """``(nodes, arrays, marks)`` of the graph below ``root``: manifest nodes and copies of the arrays.

  Copies, for the save may finish asynchronously, after a jitted update donated the source: on the
  host, except arrays split by rows over several processes (see :func:`processes.host_copies`).

  ``since``: an incremental save, given the marks by path of the save before
  (``{}``: none, save whole). Objects that give deltas are saved as what
  changed since their mark (their node says ``"delta"``), unless another
  object now holds the path (a stateful table replaced by another), and their
  new marks are returned; without ``since`` every object is saved whole and
  ``marks`` is empty.

  Raises:
    TypeError: naming the path of an object that is reachable but cannot be
      checkpointed, or of an array of another dtype than numbers and bools.
  """
  root_handle = _handle(root, "")
  if root_handle is None:
    raise TypeError(f"root: cannot checkpoint a {type(root).__name__}.")
  nodes: dict[str, dict] = {}
  arrays: dict[str, Any] = {}
  marks: dict[str, Any] = {}
  named: dict[str, tuple[str, str]] = {}  # array key -> (path, array name)
  first_path: dict[int, str] = {}
  held = []  # keeps each shared object alive (and its id unique) during the walk
  queue = collections.deque([("", root_handle)])
  while queue:
    path, handle = queue.popleft()
    if handle.shared:
      if id(handle.obj) in first_path:
        nodes[path] = {"alias": first_path[id(handle.obj)]}
        continue
      first_path[id(handle.obj)] = path
      held.append(handle.obj)
    node = {"kind": handle.kind, "type": handle.type, "arrays": {}, "children": []}
    try:
      delta = None
      if since is not None:
        owner = _reference(handle.obj) if handle.shared else None
        before = since.get(path)
        mark, delta = handle.changes(before[1] if before is not None and before[0] == owner else None)
        if mark is not None:
          marks[path] = (owner, mark)
      if delta is not None:
        node["delta"] = True
      named_arrays = delta if delta is not None else handle.arrays()
    except (TypeError, ValueError) as err:
      raise errors.at_path(path, err) from err
    for name, value in named_arrays.items():
      if not isinstance(name, str) or not name:
        raise TypeError(f"{path}: array names must be non-empty str, got {name!r}.")
      key = f"e{len(arrays)}"
      arrays[key] = value
      node["arrays"][name] = key
      named[key] = (path, name)
    try:
      children = handle.children()
    except (TypeError, ValueError) as err:
      raise errors.at_path(path, err) from err
    for relative, child in children.items():
      child_path = paths.join(path, relative)
      child_handle = _handle(child, child_path)
      if child_handle is None:
        if handle.strict and child is not None:
          raise TypeError(
            f"{child_path}: cannot checkpoint a {type(child).__name__} (checkpoints hold trackables, tables, "
            "NNX objects, arrays, and lists, tuples and dicts of them)."
          )
        continue
      node["children"].append(relative)
      queue.append((child_path, child_handle))
    nodes[path] = node
  copies = dict(zip(arrays, processes.host_copies(list(arrays.values()), _SAVABLE)))
  for key, copy in copies.items():
    if copy.dtype.kind not in _SAVABLE:
      path, name = named[key]
      raise TypeError(
        f"{path}: array {name!r} has dtype {copy.dtype}; checkpoints hold numbers and bools only."
      )
  return nodes, copies, marks


def _reference(obj: Any) -> weakref.ref | None:
  """A weak reference to ``obj`` (equal to another only while both name the same object), or
  ``None`` for an object that takes none (an ``nnx.Variable``)."""
  try:
    return weakref.ref(obj)
  except TypeError:
    return None


def _handle(obj: Any, path: str) -> Handle | None:
  try:
    return handle_for(obj)
  except (TypeError, ValueError) as err:
    raise errors.at_path(path, err) from err
