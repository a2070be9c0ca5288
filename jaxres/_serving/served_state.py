"""The object a served signature reads: a copy in inference mode, its tables in read-only form.

The copy shares the object's arrays (nothing is copied but the tables, which
are compacted): each NNX module is put in inference mode (``eval()``: an
embedding's lookup only reads), and each ``jr.Table`` held by a variable (an
embedding's table, a stateful table's state) becomes its read-only form, a
sorted table of exactly its live entries (``sorted_table.read_only``). What
the signatures then read of that state is found by tracing them; the rest
(optimizer slots, scores, admission counts, counters) is never saved.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from jaxres._core.sorted_table import read_only
from jaxres._core.table import Table


def serving_copy(obj) -> Any:
  """``obj`` (an NNX object, or a pytree of them) as a signature reads it.

  Raises:
    TypeError: ``obj`` holds no NNX object (its state could not be traced).
  """
  try:
    graphdef, state = nnx.split(obj)
  except Exception as err:  # NNX's own error says which node it could not split
    raise TypeError(
      f"obj: expected an nnx.Module (a model, a jaxres table or embedding) or a pytree of them, got "
      f"{type(obj).__name__} ({err})."
    ) from None
  copy = nnx.merge(graphdef, state)
  for _, node in nnx.iter_graph(copy):
    if isinstance(node, nnx.Module):
      node.set_attributes(deterministic=True, use_running_average=True, raise_if_not_found=False)
    elif isinstance(node, nnx.Variable) and isinstance(node.get_value(), Table):
      node.set_value(read_only(node.get_value()))
  return copy


def split(obj) -> tuple[list[jax.Array], Any]:
  """``(leaves, rebuild)``: the object's arrays, and ``rebuild(leaves)`` giving an object holding them."""
  graphdef, state = nnx.split(obj)
  leaves, treedef = jax.tree.flatten(state)

  def rebuild(new_leaves):
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, list(new_leaves)))

  return leaves, rebuild


def changed_paths(obj, leaves: list) -> list[str]:
  """The paths of ``obj``'s state whose arrays are no longer ``leaves`` (the ones it was built from)."""
  flat, _ = jax.tree_util.tree_flatten_with_path(nnx.state(obj))
  if len(flat) != len(leaves):
    return ["(its structure)"]
  return [
    jax.tree_util.keystr(path, simple=True, separator="/")
    for (path, now), then in zip(flat, leaves, strict=True)
    if now is not then
  ]
