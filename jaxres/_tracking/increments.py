"""Incremental steps of a ``CheckpointManager``: what one writes after the step before, and how a step is
read back whole.

An incremental step writes, for each object that gives deltas (a table of
open addressing, stateful or functional, an embedding's rows), only what
changed since the step before (:func:`jaxres._persistence.table_arrays.changes`),
and of the other arrays only those whose checksum changed: an unchanged array
is described with the step and key it is stored under. Its manifest (format
:data:`manifest.INCREMENTAL_FORMAT`) names its ``parent`` and every step it ``needs``.

:func:`materialize` reads a step with the steps it needs into the manifest and
arrays of a whole checkpoint, which restore as any other (deferred restore
included).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from jaxres._persistence import saved_entries
from jaxres._persistence.processes import Blocks
from jaxres._tracking import manifest

_LOCATION = ("step", "key")


class Written(NamedTuple):
  """What a manager knows of the step it wrote last, to write the next one against it."""

  step: int
  marks: dict[str, Any]  # object path -> the mark of its state (see Handle.changes)
  stored: dict[tuple[str, str], tuple[dict, int, str]]  # (path, name) -> (spec, step, key) of the bytes
  needs: tuple[int, ...]  # the steps that step reads from


def whole(step: int, nodes: dict, specs: dict, marks: dict) -> tuple[dict, Written]:
  """The manifest of a whole step, and what the next step is written against."""
  return manifest.build(nodes, specs), Written(step, marks, _stored(step, nodes, specs), ())


def incremental(
  step: int, nodes: dict, arrays: dict, specs: dict, marks: dict, previous: Written
) -> tuple[dict, dict, Written]:
  """``(manifest, arrays to write, written)`` of a step after ``previous``: the nodes saved as deltas
  are kept as they are, and arrays equal to those of the step before (same shape, dtype and
  checksum, not a delta's) point to where those are stored instead of being written again."""
  kept_specs, to_write = {}, dict(arrays)
  for path, node in nodes.items():
    for name, key in node.get("arrays", {}).items():
      spec = specs[key]
      before = previous.stored.get((path, name))
      if not node.get("delta") and before is not None and before[0] == spec:
        kept_specs[key] = spec | dict(zip(_LOCATION, before[1:]))
        del to_write[key]
  specs = specs | kept_specs
  needs = tuple(sorted({previous.step, *previous.needs}))
  contents = manifest.build(nodes, specs) | {
    "format": manifest.INCREMENTAL_FORMAT,
    "parent": previous.step,
    "needs": list(needs),
  }
  return contents, to_write, Written(step, marks, _stored(step, nodes, specs), needs)


def _stored(step: int, nodes: dict, specs: dict) -> dict:
  """Where the bytes of each ``(path, array name)`` of a step are stored: ``(spec, step, key)``."""
  stored = {}
  for path, node in nodes.items():
    for name, key in node.get("arrays", {}).items():
      spec = {k: v for k, v in specs[key].items() if k not in _LOCATION}
      location = (specs[key]["step"], specs[key]["key"]) if "step" in specs[key] else (step, key)
      stored[(path, name)] = (spec, *location)
  return stored


def needs(contents: dict) -> list[int]:
  """The steps a step's manifest reads from (none for a whole step)."""
  return list(contents.get("needs", []))


def materialize(
  step: int, load: Callable[[int], tuple[dict, dict]], label: Callable[[int], str] = str
) -> tuple[dict, dict]:
  """The manifest and arrays of ``step`` as a whole checkpoint.

  ``load(step)``: a step's own manifest (checked) and the arrays stored in it
  (called once per step); ``label(step)``: how errors name a step. The chain
  of parents is followed and composed in a loop, so its length is bounded by
  the steps on disk, not by Python's recursion limit.

  Raises:
    ValueError: naming the step and the field: a step it needs is missing, or
      its lineage (``parent``, ``needs``, where kept arrays are stored) does
      not fit the steps it names (corrupted).
  """
  loaded: dict[int, tuple[dict, dict]] = {}

  def own(s: int) -> tuple[dict, dict]:
    if s not in loaded:
      loaded[s] = load(s)
    return loaded[s]

  chain = [step]  # the step, its parent, ..., down to a whole step; parents only go down
  while own(chain[-1])[0]["format"] == manifest.INCREMENTAL_FORMAT:
    chain.append(_checked_parent(chain[-1], own, label))
  made = own(chain[-1])
  for s in reversed(chain[:-1]):
    made = _whole(s, own, made)
  return made


def _checked_parent(s: int, own, label) -> int:
  """The parent of the incremental step ``s``, once its lineage is checked against the parent's."""
  contents = own(s)[0]
  parent, needed = contents["parent"], contents["needs"]
  if parent >= s:
    raise ValueError(f"{label(s)}: corrupted manifest (parent {parent} is not an earlier step).")
  parent_contents = own(parent)[0]
  expected = sorted({parent, *needs(parent_contents)})
  if needed != expected:
    raise ValueError(
      f"{label(s)}: corrupted manifest (needs {needed} but its parent, step {parent}, makes it need "
      f"{expected})."
    )
  for key, spec in contents["arrays"].items():
    if "step" in spec and (spec["step"] not in needed or spec["key"] not in own(spec["step"])[1]):
      raise ValueError(
        f"{label(s)}: corrupted manifest (array {key} is kept in step {spec['step']} under "
        f"{spec['key']!r}, which that step does not hold or this step does not need)."
      )
  return parent


def _whole(s: int, own, parent: tuple[dict, dict]) -> tuple[dict, dict]:
  """The incremental step ``s`` as a whole checkpoint, its parent's whole form given."""
  contents, stored = own(s)
  arrays = {}
  for key, spec in contents["arrays"].items():
    arrays[key] = own(spec["step"])[1][spec["key"]] if "step" in spec else stored[key]
  nodes = {}
  for path, node in contents["nodes"].items():
    if node.get("delta"):
      node, arrays = _composed(path, node, arrays, parent, contents["parent"])
    nodes[path] = node
  specs = {key: _described(a) for key, a in arrays.items()}
  return manifest.build(nodes, specs), arrays


def _described(array) -> dict:
  """The spec of an array read back (on several processes, perhaps only some of its rows)."""
  if isinstance(array, Blocks):
    return {"shape": list(array.shape), "dtype": str(np.dtype(array.dtype))}
  return {"shape": list(np.shape(array)), "dtype": str(np.asarray(array).dtype)}


def _composed(path: str, node: dict, arrays: dict, parent: tuple[dict, dict], parent_step: int) -> tuple:
  """``(node, arrays)``: the node at ``path`` (a delta) as a whole one, its arrays composed with those
  of the same path in the parent step (whole already)."""
  parent_contents, parent_arrays = parent
  earlier_node = parent_contents["nodes"].get(path)
  if earlier_node is None or "alias" in earlier_node or earlier_node["kind"] != node["kind"]:
    raise ValueError(f"{path or 'the root'}: a delta of nothing saved in step {parent_step} (corrupted).")
  earlier = {name: parent_arrays[key] for name, key in earlier_node["arrays"].items()}
  delta = {name: arrays[key] for name, key in node["arrays"].items()}
  composed = saved_entries.compose(earlier, delta)
  arrays = {key: a for key, a in arrays.items() if key not in node["arrays"].values()}
  names = {}
  for name, array in composed.items():
    key = f"{path}:{name}"
    arrays[key] = array
    names[name] = key
  return {k: v for k, v in node.items() if k != "delta"} | {"arrays": names}, arrays
