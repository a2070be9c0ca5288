"""The manifest of a checkpoint: its object graph, checked on reading, and the reader of a loaded one.

One node per object path::

  {"kind": "table", "type": "jaxres...MutableHashTable",
   "arrays": {"keys": "e0", "values": "e1"}, "children": ["a", "b%2Ec"]}

``arrays`` maps the object's array names to opaque storage keys (described,
with shape, dtype and checksum, under the manifest's ``arrays``);
``children`` are relative paths. An object reached through a second path is
saved once: that path's node is ``{"alias": "<first path>"}``.

An incremental step of a ``CheckpointManager`` (format
:data:`INCREMENTAL_FORMAT`, which a jaxres that cannot compose it refuses; see
:mod:`increments`) adds ``"parent"`` (the step its deltas follow) and
``"needs"`` (every step it reads from); a node saved as a delta has
``"delta": true``, and an array kept from an earlier step is described with
``"step"`` and ``"key"``: where it is stored.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxres._persistence import files, processes
from jaxres._persistence.processes import Blocks
from jaxres._tracking import paths

FORMAT = "jaxres.checkpoint"
VERSION = 3  # 3: always sealed (files.sealed); 2, read too: sealed since 1711f00, or not
OLDEST = 2  # the save/restore protocol's first version
INCREMENTAL_FORMAT = "jaxres.checkpoint.incremental"  # a manager's step, read with the steps it needs


def build(nodes: dict[str, dict], specs: dict[str, dict]) -> dict:
  """A manifest from the graph's nodes and the specs of its arrays."""
  return {"format": FORMAT, "version": VERSION, "nodes": nodes, "arrays": specs}


def check(manifest: Any, label: str, incremental: bool = False) -> dict:
  """``manifest`` if it is a well-formed manifest of the version this jaxres reads, and the one
  written (its checksum, checked last, removed).

  ``incremental``: an incremental step may be read (by the manager, which
  reads the steps it needs too, or to inspect it).

  Raises:
    ValueError: another format, another version, a malformed graph, or an
      incremental step where a whole checkpoint is needed.
  """
  kind = manifest.get("format") if isinstance(manifest, dict) else None
  if kind == INCREMENTAL_FORMAT and not incremental:
    raise ValueError(
      f"{label}: an incremental step of a jr.CheckpointManager, which holds what changed since step "
      f"{manifest.get('parent')}; restore it with the manager's restore(step)."
    )
  if kind not in (FORMAT, INCREMENTAL_FORMAT):
    raise ValueError(f"{label}: not a jaxres checkpoint manifest.")
  version = manifest.get("version")
  if not isinstance(version, int) or version > VERSION:
    raise ValueError(f"{label}: format version {version!r} is newer than this jaxres reads ({VERSION}).")
  if version < OLDEST:
    raise ValueError(
      f"{label}: format version {version} was written by an earlier jaxres, before the save/restore "
      f"protocol (version {OLDEST}); restore it with that release and save it again."
    )
  problem = _graph_problem(manifest.get("nodes"), manifest.get("arrays"))
  if kind == INCREMENTAL_FORMAT:
    problem = problem or _lineage_problem(manifest)
  else:
    problem = problem or _kept_elsewhere(manifest["arrays"])
  if problem:
    raise ValueError(f"{label}: corrupted manifest ({problem}).")
  return files.unsealed(manifest, label, required=version >= 3)


def _kept_elsewhere(specs: dict) -> str | None:
  """An array a whole checkpoint says another step keeps (only an incremental step's may)."""
  for key, spec in specs.items():
    if "step" in spec:
      return f"array {key}: kept in step {spec['step']!r}, which a whole checkpoint cannot refer to"
  return None


def _lineage_problem(manifest: dict) -> str | None:
  """What is malformed in an incremental step's own lineage fields (the steps it names are
  cross-checked when they are read: see ``increments.materialize``)."""
  parent, needs = manifest.get("parent"), manifest.get("needs")
  if not _is_step(parent):
    return f"parent {parent!r} is not a step number"
  if not isinstance(needs, list) or not all(map(_is_step, needs)) or needs != sorted(set(needs)):
    return f"needs {needs!r} is not a sorted list of step numbers"
  if parent not in needs:
    return f"needs {needs} lacks the parent {parent}"
  for key, spec in manifest["arrays"].items():
    if "step" in spec and not (_is_step(spec["step"]) and isinstance(spec.get("key"), str)):
      return f"array {key} is kept in an earlier step that it does not name"
  return None


def _spec_problem(spec: Any) -> str | None:
  """What is malformed in an array's description (shape, dtype, checksums), before anything is read
  or allocated by it."""
  if not isinstance(spec, dict):
    return "not described by an object"
  shape, dtype, crc32 = spec.get("shape"), spec.get("dtype"), spec.get("crc32")
  if not isinstance(shape, list) or not all(_is_step(n) for n in shape):
    return f"shape {shape!r} is not a list of sizes"
  try:
    kind = np.dtype(dtype) if isinstance(dtype, str) else None
  except TypeError:
    kind = None
  if kind is None or kind.hasobject or kind.kind not in "biufcV":
    return f"dtype {dtype!r} is not a dtype of numbers"
  rows = shape[0] if shape else None
  per_row = isinstance(crc32, list) and len(crc32) == rows and all(isinstance(c, int) for c in crc32)
  if crc32 is not None and not (isinstance(crc32, int) or per_row):
    return f"checksum {str(crc32)[:40]} is neither a CRC-32 nor one per row"
  return None


def _is_step(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _graph_problem(nodes: Any, specs: Any) -> str | None:
  if not isinstance(nodes, dict) or "" not in nodes or not isinstance(specs, dict):
    return "no object graph"
  for key, spec in specs.items():
    if problem := _spec_problem(spec):
      return f"array {key}: {problem}"
  for path, node in nodes.items():
    if not isinstance(node, dict):
      return f"node {path!r} is not an object"
    if "alias" in node:
      target = node["alias"]
      if (
        not isinstance(target, str) or not isinstance(nodes.get(target), dict) or "kind" not in nodes[target]
      ):
        return f"node {path!r} is an alias of no node"
      continue
    fields = (node.get("kind"), node.get("type"), node.get("arrays"), node.get("children"))
    if not all(isinstance(x, t) for x, t in zip(fields, (str, str, dict, list))):
      return f"node {path!r} lacks its kind, type, arrays or children"
    if any(key not in specs for key in node["arrays"].values()):
      return f"node {path!r} names arrays that are not described"
    if any(not isinstance(c, str) or paths.join(path, c) not in nodes for c in node["children"]):
      return f"node {path!r} has children that are not nodes"
  return None


class Reader:
  """A loaded checkpoint: its nodes and arrays, read through aliases."""

  def __init__(self, manifest: dict, arrays: dict[str, np.ndarray], label: str):
    self.nodes, self._arrays, self.label = manifest["nodes"], arrays, label

  def canonical(self, path: str) -> str:
    """The path the object at ``path`` was saved under (its first path)."""
    return self.nodes[path].get("alias", path)

  def node(self, path: str) -> dict:
    return self.nodes[self.canonical(path)]

  def below(self, path: str) -> list[tuple[str, str]]:
    """``(relative, canonical)`` of the object at ``path`` and each below it: its path relative to
    ``path``, and the path it was saved under."""
    out, seen, stack = [], set(), [("", path)]
    while stack:
      relative, node_path = stack.pop()
      canonical = self.canonical(node_path)
      out.append((relative, canonical))
      if canonical not in seen:
        seen.add(canonical)
        stack += [
          (paths.join(relative, c), paths.join(canonical, c)) for c in self.nodes[canonical]["children"]
        ]
    return out

  def outline(self, path: str) -> frozenset[tuple[str, tuple[str, ...]]]:
    """What the checkpoint holds at and below ``path``: each object's path relative to it, with the
    names of its arrays (a restore whose outline holds another's gives everything that one would)."""
    return frozenset((relative, tuple(sorted(self.nodes[c]["arrays"]))) for relative, c in self.below(path))

  def arrays(self, path: str, parts: bool = False) -> dict[str, np.ndarray | Blocks]:
    """The arrays of the object saved at ``path``, by name.

    ``parts``: arrays that each process read some rows of stay so (as
    :class:`Blocks`); otherwise every process gets them whole (they are
    exchanged: every process restores the same objects in the same order).
    """
    arrays = {name: self._arrays[key] for name, key in self.node(path)["arrays"].items()}
    if parts:
      return arrays
    return {name: processes.whole(a) if isinstance(a, Blocks) else a for name, a in arrays.items()}

  def retain(self, node_paths) -> None:
    """Keeps only the arrays of the objects at ``node_paths`` and below (what pending restores need)."""
    keep, stack = set(), list(node_paths)
    while stack:
      path = self.canonical(stack.pop())
      if path not in keep:
        keep.add(path)
        stack += [paths.join(path, child) for child in self.nodes[path]["children"]]
    needed = {key for path in keep for key in self.nodes[path]["arrays"].values()}
    self._arrays = {key: array for key, array in self._arrays.items() if key in needed}

  def valued(self) -> list[str]:
    """The paths of objects that hold arrays of their own."""
    return [path for path, node in self.nodes.items() if node.get("arrays")]
