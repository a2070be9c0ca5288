"""Pytree helpers: frozen dataclasses as pytrees, and names for the leaves of a pytree."""

from __future__ import annotations

import dataclasses

import jax


def pytree_dataclass(cls):
  """A frozen dataclass registered as a pytree; fields marked ``static`` are aux data."""
  cls = dataclasses.dataclass(frozen=True, eq=False, repr=False)(cls)
  fields = dataclasses.fields(cls)
  meta = [f.name for f in fields if f.metadata.get("static")]
  data = [f.name for f in fields if not f.metadata.get("static")]
  return jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=meta)


def static_field():
  """A dataclass field that is static (part of the treedef, not a leaf)."""
  return dataclasses.field(metadata={"static": True})


def leaf_names(tree, prefix: str) -> list[str]:
  """One name per leaf of ``tree``: ``prefix`` for a single leaf, else ``prefix/<key path>``.

  Examples:
    >>> leaf_names(0.0, "values"), leaf_names({"emb": 0, "count": [1, 2]}, "values")
    (['values'], ['values/count/0', 'values/count/1', 'values/emb'])
  """
  paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
  if paths == [()]:
    return [prefix]
  return [f"{prefix}/{jax.tree_util.keystr(path, simple=True, separator='/')}" for path in paths]
