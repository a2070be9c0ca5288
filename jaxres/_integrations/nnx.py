"""Flax NNX objects in the checkpointed graph: modules, optimizers and their variables.

An NNX object (``nnx.Module``, ``nnx.Optimizer``, ``nnx.List``, ...) is a node
whose children are the variables and trackables of its graph, by their NNX
paths: ``model/hidden/kernel``, ``model/layers/0/table``,
``optimizer/opt_state/0/mu/hidden/kernel``. A variable whose type sets
``checkpointed = False`` (state a step derives and rebuilds, such as the rows
``jr.DynamicEmbedding`` keeps between a lookup and its update) is left out.
A variable saves its value
through that value's own handle (an array, a pytree of arrays, or a
functional table's live entries) and is restored in place. Trackables inside
the graph (tables and other resources) save themselves; their own variables
are theirs.

Served (``jaxres._serving``), an NNX object is a copy in inference mode sharing
its arrays, whose variables holding tables hold their served form; a
``jr.Resource`` (a trackable that is an NNX module) is served as one.

Importing this module registers the adapters (``import jaxres`` does).
"""

from __future__ import annotations

from typing import Any

from flax import nnx

from jaxres._core.table import Table
from jaxres._shell.resource import Resource
from jaxres._shell.trackable import Trackable
from jaxres._tracking import handles, paths


class _ServedAsModule:
  """Serving hooks of an NNX graph node: a copy sharing its arrays, modules in inference mode, each
  table as ``served(table)``; its state split as ``nnx.split`` gives it."""

  obj: Any

  def serving_copy(self, served, copy_child):
    graphdef, state = nnx.split(self.obj)
    copied = nnx.merge(graphdef, state, copy=True)  # new modules and variables, the same arrays
    for _, inner in nnx.iter_graph(copied):
      if isinstance(inner, nnx.Module):
        inner.set_attributes(deterministic=True, use_running_average=True, raise_if_not_found=False)
      elif isinstance(inner, nnx.Variable) and isinstance(inner.get_value(), Table):
        inner.set_value(served(inner.get_value()))
    return copied

  def serving_split(self, path, split_child):
    graphdef, state = nnx.split(self.obj)
    return handles.flattened(state, path, lambda tree: nnx.merge(graphdef, tree))


class NnxHandle(_ServedAsModule, handles.Handle):
  """An NNX graph node: its variables and trackables are its children."""

  kind = "nnx"

  def children(self) -> dict[str, Any]:
    graph = list(nnx.iter_graph(self.obj))  # each node once, children before parents
    owned = {path for path, node in graph if path and isinstance(node, Trackable)}
    found = {}
    for keys, node in graph:
      path = tuple(map(str, keys))
      if not path or any(keys[:k] in owned for k in range(1, len(keys))):
        continue  # this node itself, or what a trackable holds
      if isinstance(node, nnx.Variable) and not getattr(type(node), "checkpointed", True):
        continue
      if isinstance(node, handles.ARRAY_TYPES):
        raise TypeError(
          f"{paths.relative(path)}: an array held by an NNX object outside an nnx.Variable cannot be "
          "restored in place; hold it in an nnx.Variable."
        )
      if isinstance(node, (Trackable, nnx.Variable)):
        found[path] = node  # a variable without arrays has no handle: the walkers skip it
    return paths.by_relative(found)


class ResourceHandle(_ServedAsModule, handles.TrackableHandle):
  """A ``jr.Resource``: saved as a trackable, served as an NNX module."""


class VariableHandle(handles.Handle):
  """An ``nnx.Variable`` holding arrays: its value saves itself; restoring sets the value in place."""

  def __init__(self, variable: nnx.Variable, value: handles.Handle):
    super().__init__(variable)
    self._value = value
    self.kind = value.kind
    self.takes_parts = value.takes_parts

  @classmethod
  def of(cls, variable: nnx.Variable) -> VariableHandle | None:
    """The handle of a variable whose value is arrays (or a table); ``None`` for one holding
    something else (a number, a string, ``None``), which is not part of the graph."""
    value = handles.handle_for(variable.get_value(), containers=False)
    return None if value is None else cls(variable, value)

  def arrays(self):
    return self._value.arrays()

  def changes(self, since):
    return self._value.changes(since)

  def holds_values(self) -> bool:
    return True

  def restore(self, arrays):
    new, _ = self._value.restore(arrays)
    return self.obj, handles.setting(self.obj.set_value, self.obj.get_value(), new)


handles.register(nnx.Variable, VariableHandle.of)
handles.register(nnx.Pytree, NnxHandle)
handles.register(Resource, ResourceHandle)
