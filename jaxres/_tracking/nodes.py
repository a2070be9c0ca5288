"""How each kind of object is written to, and checked against, a checkpoint.

Saving walks the object graph and records one manifest node per path, with
the node's arrays added to a flat dict under opaque keys. An object reached a
second time becomes an ``alias`` of its first path.

Restoring is planned before anything changes: :func:`plan_restore` checks a
whole subtree (kinds, dtypes, shapes) and returns actions to apply, so a
mismatch raises with the path named and leaves every object as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxres._core.table import Table
from jaxres._shell.lookup_table import LookupTable
from jaxres._shell.resource import Resource, ResourceState
from jaxres._tracking import paths
from jaxres._tracking.trackable import Trackable

Action = Callable[[], None]
VALUE_KINDS = ("array", "pytree", "table_value")  # restored by replacing the attribute


def kind_of(obj: Any) -> str:
  """The manifest kind of a graph object."""
  if isinstance(obj, LookupTable):
    return "table"
  if isinstance(obj, Table):  # a functional table: an immutable value, like an array
    return "table_value"
  if isinstance(obj, Resource):
    return "resource"
  if isinstance(obj, nnx.Pytree):  # nnx.Module, nnx.Optimizer, ...
    return "module"
  if isinstance(obj, Trackable):
    return "trackable"
  if isinstance(obj, (jax.Array, np.ndarray, np.generic)):
    return "array"
  return "pytree"


class Writer:
  """Collects arrays under opaque keys while the graph is walked."""

  def __init__(self):
    self.arrays: dict[str, np.ndarray] = {}
    self.seen: dict[int, str] = {}
    self.nodes: dict[str, dict] = {}

  def add(self, value) -> str:
    key = f"e{len(self.arrays)}"
    # A copy: the save may finish asynchronously, after the source buffers
    # have been donated to a jitted update.
    self.arrays[key] = np.array(value, copy=True)
    return key


def _module_variables(module) -> list[tuple[str, Any]]:
  state = nnx.state(module, nnx.Not(ResourceState))
  return [("/".join(map(str, p)), var) for p, var in nnx.to_flat_state(state)]


def _module_resources(module) -> dict[str, Resource]:
  return {
    ".".join(map(str, p)): node
    for p, node in nnx.iter_graph(module)
    if isinstance(node, Resource) and node is not module
  }


def _pytree_layout(value, writer: Writer, path: str):
  if isinstance(value, dict):
    if not all(isinstance(k, str) for k in value):
      raise TypeError(f"{path}: only dicts with str keys can be checkpointed.")
    return {"dict": {k: _pytree_layout(v, writer, path) for k, v in value.items()}}
  if isinstance(value, (list, tuple)):
    return {type(value).__name__: [_pytree_layout(v, writer, path) for v in value]}
  if isinstance(value, (jax.Array, np.ndarray, np.generic)):
    return {"leaf": writer.add(value)}
  raise TypeError(
    f"{path}: cannot checkpoint a {type(value).__name__} (arrays, dicts, lists and tuples only)."
  )


def save_node(obj: Any, path: str, writer: Writer) -> None:
  """Records ``obj`` (and its subtree) under ``path``."""
  kind = kind_of(obj)
  if kind not in VALUE_KINDS:
    if id(obj) in writer.seen:
      writer.nodes[path] = {"kind": "alias", "of": writer.seen[id(obj)]}
      return
    writer.seen[id(obj)] = path
  node: dict[str, Any] = {"kind": kind, "type": f"{type(obj).__module__}.{type(obj).__qualname__}"}
  writer.nodes[path] = node
  if kind == "table":
    keys, values, valid = obj.state.export()
    live = np.asarray(valid)
    node["config"] = {"key": obj._key_codec.name, "value": obj._value_codec.name}
    node["capacity"] = obj.state.capacity  # informational: restores rehash into any capacity
    node["keys"] = writer.add(np.asarray(keys)[live])
    node["values"] = [writer.add(np.asarray(v)[live]) for v in jax.tree.leaves(values)]
  elif kind == "resource":
    node["values"] = [writer.add(v) for v in jax.tree.leaves(obj.state)]
  elif kind == "module":
    node["variables"] = {name: writer.add(var.get_value()) for name, var in _module_variables(obj)}
    resources = _module_resources(obj)
    node["children"] = sorted(resources)
    for name in node["children"]:
      save_node(resources[name], paths.child(path, name), writer)
  elif kind == "trackable":
    children = obj._trackable_children()
    node["children"] = list(children)
    for name, child in children.items():
      save_node(child, paths.child(path, name), writer)
  elif kind == "table_value":
    node["config"] = _table_config(obj)
    node["shards"] = [
      {"keys": writer.add(keys), "values": [writer.add(v) for v in values]}
      for keys, values in obj._live_by_shard()
    ]
  elif kind == "array":
    node["value"] = writer.add(obj)
  else:
    node["layout"] = _pytree_layout(obj, writer, path)


# ---------------------------------------------------------------- restoring


class Reader:
  """A loaded checkpoint: manifest nodes and their arrays."""

  def __init__(self, nodes: dict[str, dict], arrays: dict[str, np.ndarray]):
    self.nodes, self.arrays = nodes, arrays

  def resolve(self, path: str) -> tuple[str, dict]:
    """The node at ``path``, following an alias to the object's first path."""
    node = self.nodes[path]
    if node["kind"] == "alias":
      return node["of"], self.nodes[node["of"]]
    return path, node

  def subtree(self, path: str) -> list[str]:
    """``path`` and every checkpointed path below it."""
    prefix = path + "/"
    return [p for p in self.nodes if p == path or p.startswith(prefix)]


def _same_array(existing, restored: np.ndarray, path: str) -> None:
  shape, dtype = (
    tuple(np.shape(existing)),
    np.dtype(getattr(existing, "dtype", None) or np.asarray(existing).dtype),
  )
  if shape != restored.shape or dtype != restored.dtype:
    raise ValueError(
      f"{path}: the checkpoint holds {restored.dtype}{list(restored.shape)}, "
      f"the object is {np.dtype(dtype)}{list(shape)}."
    )


def _check_kind(obj, node: dict, path: str) -> None:
  kind = kind_of(obj)
  if kind != node["kind"]:
    raise TypeError(
      f"{path}: the checkpoint holds a {node['kind']} ({node['type']}), got a {kind} ({type(obj).__name__})."
    )


def rebuild_value(reader: Reader, node: dict, path: str):
  """An array or pytree node as a new value (for attributes that do not exist yet)."""
  if node["kind"] == "array":
    return jnp.asarray(reader.arrays[node["value"]])
  if node["kind"] == "pytree":
    return _rebuild_layout(reader, node["layout"])
  raise TypeError(
    f"{path}: a {node['kind']} cannot be rebuilt from the checkpoint; attach an object to restore into."
  )


def _rebuild_layout(reader: Reader, layout: dict):
  ((tag, body),) = layout.items()
  if tag == "leaf":
    return jnp.asarray(reader.arrays[body])
  if tag == "dict":
    return {k: _rebuild_layout(reader, v) for k, v in body.items()}
  items = [_rebuild_layout(reader, v) for v in body]
  return tuple(items) if tag == "tuple" else items


def _table_config(table: Table) -> dict:
  return {"key": str(table.key_spec), "value": str(table.value_spec)}


def _restored_table(reader: Reader, node: dict, existing: Table, path: str) -> Table:
  """``existing`` (its storage, capacity and mesh) refilled with the checkpointed entries."""
  config = _table_config(existing)
  if config != node["config"]:
    raise ValueError(f"{path}: the checkpoint holds a table of {node['config']}, the object is {config}.")
  shards = node["shards"]
  keys = np.concatenate([reader.arrays[shard["keys"]] for shard in shards])
  leaves = [
    np.concatenate(parts) for parts in zip(*[[reader.arrays[k] for k in s["values"]] for s in shards])
  ]
  return existing._with_entries(keys, jax.tree.unflatten(existing.value_spec.treedef, leaves), path)


def plan_value(reader: Reader, existing, path: str):
  """Checks a value attribute (array, pytree, functional table) against its node; returns its new value."""
  _, node = reader.resolve(path)
  _check_kind(existing, node, path)
  if node["kind"] == "table_value":
    return _restored_table(reader, node, existing, path)
  value = rebuild_value(reader, node, path)
  if jax.tree.structure(existing) != jax.tree.structure(value):
    raise ValueError(
      f"{path}: the checkpoint's structure {jax.tree.structure(value)} "
      f"differs from {jax.tree.structure(existing)}."
    )
  for old, new in zip(jax.tree.leaves(existing), jax.tree.leaves(value)):
    _same_array(old, np.asarray(new), path)
  return value


class Report:
  """What planning a restore found.

  ``matched``: checkpoint paths an object was found for. ``missing``:
  ``(owner, name, path)`` of checkpointed children with no object yet.
  ``extra``: paths of program objects the checkpoint has no value for.
  ``sharing``: paths where the program shares objects differently from the
  checkpoint (one object saved under two paths, two objects now, or the
  reverse).
  """

  def __init__(self):
    self.matched: set[str] = set()
    self.missing: list[tuple[Any, str, str]] = []
    self.extra: list[str] = []
    self.sharing: list[str] = []
    self.objects: dict[int, str] = {}  # id of each object restored -> its checkpoint node path


def plan_restore(reader: Reader, obj: Any, path: str, report: Report) -> list[Action]:
  """Checks ``obj`` against the checkpoint at ``path``; returns the actions that restore it."""
  node_path, node = reader.resolve(path)
  _check_kind(obj, node, path)
  report.matched.add(path)
  first = report.objects.setdefault(id(obj), node_path)
  shared_by_another = any(p == node_path for i, p in report.objects.items() if i != id(obj))
  if first != node_path or shared_by_another:
    report.sharing.append(path)
  if first != node_path or (node_path != path and not shared_by_another):
    return []  # this very object is restored from its first path already
  kind = node["kind"]
  if kind == "table":
    config = {"key": obj._key_codec.name, "value": obj._value_codec.name}
    if config != node["config"]:
      raise ValueError(f"{path}: the checkpoint holds a table of {node['config']}, the object is {config}.")
    keys = reader.arrays[node["keys"]]
    values = [reader.arrays[k] for k in node["values"]]
    treedef = jax.tree.structure(obj._value_codec.spec)
    if treedef.num_leaves != len(values):
      raise ValueError(
        f"{path}: the checkpoint's values have {len(values)} leaves, the table {treedef.num_leaves}."
      )
    return [lambda: obj._restore_entries(keys, jax.tree.unflatten(treedef, values))]
  if kind == "resource":
    current = jax.tree.leaves(obj.state)
    values = [reader.arrays[k] for k in node["values"]]
    if len(current) != len(values):
      raise ValueError(
        f"{path}: the checkpoint's state has {len(values)} leaves, the resource {len(current)}."
      )
    for old, new in zip(current, values):
      _same_array(old, new, path)
    treedef = jax.tree.structure(obj.state)
    return [lambda: setattr(obj, "state", jax.tree.unflatten(treedef, [jnp.asarray(v) for v in values]))]
  if kind == "module":
    variables = dict(_module_variables(obj))
    if set(variables) != set(node["variables"]):
      raise ValueError(
        f"{path}: the checkpoint's variables {sorted(node['variables'])} differ from {sorted(variables)}."
      )
    updates = []
    for name, var in variables.items():
      value = reader.arrays[node["variables"][name]]
      _same_array(var.get_value(), value, f"{path}/{name}")
      updates.append((var, value))
    actions = [lambda: [var.set_value(jnp.asarray(value)) for var, value in updates]]
    resources = _module_resources(obj)
    for name in node["children"]:
      if name in resources:
        actions += plan_restore(reader, resources[name], paths.child(path, name), report)
      else:
        report.missing.append((obj, name, paths.child(path, name)))
    report.extra += [paths.child(path, name) for name in resources if name not in node["children"]]
    return actions
  if kind == "trackable":
    actions = []
    children = obj._trackable_children()
    for name in node["children"]:
      child_path = paths.child(path, name)
      if name not in children:
        report.missing.append((obj, name, child_path))
      elif kind_of(children[name]) in VALUE_KINDS:
        value = plan_value(reader, children[name], child_path)
        report.matched.update(reader.subtree(child_path))
        actions.append(lambda name=name, value=value: object.__setattr__(obj, name, value))
      else:
        actions += plan_restore(reader, children[name], child_path, report)
    report.extra += [paths.child(path, name) for name in children if name not in node["children"]]
    return actions
  raise TypeError(f"{path}: a {kind} must be restored through the object that holds it.")
