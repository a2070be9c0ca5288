"""The object a served signature reads: a copy in inference mode, its tables in read-only form.

The copy shares the object's arrays (nothing is copied but the tables, which
are compacted): each NNX module is put in inference mode (``eval()``: an
embedding's lookup only reads), and each ``jr.Table`` (held by a variable, as
an embedding's table or a stateful table's state, or directly) becomes its
read-only form, a sorted table of exactly its live entries
(``sorted_arrays.read_only``). What the signatures then read of that state is
found by tracing them; the rest (optimizer slots, scores, admission counts,
counters) is never saved.

The object may be an NNX object, a ``jr.AutoTrackable`` (its children are
served, the object keeps its type and methods), a list, tuple or dict of
these, a functional table or an array: whatever ``jr.Checkpoint`` saves.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxres._core.storages.sorted import read_only
from jaxres._core.table import Table
from jaxres._shell.trackable import AutoTrackable

Rebuild = Callable[[list], Any]


def serving_copy(obj, served: Callable[[Table], Table] = read_only) -> Any:
  """``obj`` as a signature reads it: modules in inference mode, each table as ``served(table)``
  (its read-only form), the tables taken in a fixed order (the same for objects alike)."""
  if isinstance(obj, AutoTrackable):
    copied = copy.copy(obj)
    for name, child in obj._trackable_children().items():
      copied._replace_trackable_child(name, serving_copy(child, served))
    return copied
  if isinstance(obj, (list, tuple)) and not nnx.graphlib.is_graph_node(obj):
    return type(obj)(serving_copy(x, served) for x in obj)
  if isinstance(obj, dict):
    return {k: serving_copy(v, served) for k, v in obj.items()}
  if isinstance(obj, Table):
    return served(obj)
  if not nnx.graphlib.is_graph_node(obj):
    return obj
  graphdef, state = nnx.split(obj)
  copied = nnx.merge(graphdef, state, copy=True)  # new modules and variables, the same arrays
  for _, node in nnx.iter_graph(copied):
    if isinstance(node, nnx.Module):
      node.set_attributes(deterministic=True, use_running_average=True, raise_if_not_found=False)
    elif isinstance(node, nnx.Variable) and isinstance(node.get_value(), Table):
      node.set_value(served(node.get_value()))
  return copied


def split(obj, path: str = "") -> tuple[list, list[str], Rebuild]:
  """``(leaves, names, rebuild)``: the arrays ``obj`` holds, their paths, and ``rebuild(leaves)``,
  an object like ``obj`` holding those leaves (under a trace: the traced values)."""
  if isinstance(obj, AutoTrackable):
    children = obj._trackable_children()
    parts = [split(child, _join(path, name)) for name, child in children.items()]

    def rebuild_trackable(leaves):
      rebuilt = copy.copy(obj)
      for name, part in zip(children, _pieces(parts, leaves), strict=True):
        rebuilt._replace_trackable_child(name, part)
      return rebuilt

    return _leaves(parts), _names(parts), rebuild_trackable
  if isinstance(obj, (list, tuple, dict)) and not nnx.graphlib.is_graph_node(obj):
    keys = list(obj) if isinstance(obj, dict) else list(range(len(obj)))
    parts = [split(obj[k], _join(path, str(k))) for k in keys]

    def rebuild_container(leaves):
      items = _pieces(parts, leaves)
      return dict(zip(keys, items, strict=True)) if isinstance(obj, dict) else type(obj)(items)

    return _leaves(parts), _names(parts), rebuild_container
  if nnx.graphlib.is_graph_node(obj) or isinstance(obj, (Table, jax.Array, np.ndarray)):
    graphdef, state = nnx.split(obj) if nnx.graphlib.is_graph_node(obj) else (None, obj)
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    names = [_join(path, jax.tree_util.keystr(p, simple=True, separator="/")) for p, _ in flat]

    def rebuild_leaves(new):
      tree = jax.tree.unflatten(treedef, list(new))
      return tree if graphdef is None else nnx.merge(graphdef, tree)

    return [x for _, x in flat], names, rebuild_leaves
  return [], [], lambda new: obj  # not state (a number, a string, a function): kept as it is


def _join(path: str, name: str) -> str:
  return f"{path}/{name}" if path and name else path or name


def _leaves(parts) -> list:
  return [x for leaves, _, _ in parts for x in leaves]


def _names(parts) -> list[str]:
  return [n for _, names, _ in parts for n in names]


def _pieces(parts: list, leaves) -> list:
  """``leaves`` cut into each part's own, each part rebuilt from its piece."""
  out, start = [], 0
  for part_leaves, _, rebuild in parts:
    out.append(rebuild(leaves[start : start + len(part_leaves)]))
    start += len(part_leaves)
  return out


def changed_paths(obj, leaves: list, names: list[str]) -> list[str]:
  """The paths where ``obj`` (built from ``leaves``) no longer holds them: what a signature changed."""
  now, _, _ = split(obj)
  if len(now) != len(leaves):
    return ["its structure"]
  return [name for name, a, b in zip(names, now, leaves, strict=True) if a is not b]
