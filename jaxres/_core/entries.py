"""A table's live entries as named host arrays: what a checkpoint stores of a table.

A table holding one set of entries is stored as ``keys`` (exact dtype,
``[n, *key_shape]``) and ``values`` (one array per value leaf, named by its
key path: ``values``, or ``values/emb`` and ``values/count``). A table split
into shards stores each shard under ``shards/<i>/``, so each shard can be
written by whoever holds it. Either form restores into any table with the
same keys and values, whatever its capacity or number of shards.
"""

from __future__ import annotations

import re

import jax
import numpy as np

from jaxres._core.codec import KeySpec
from jaxres._core.pytrees import leaf_names
from jaxres._core.values import ValueSpec

_SHARD = re.compile(r"shards/(\d+)/(.+)")

Entries = tuple[np.ndarray, list[np.ndarray]]  # keys, value leaves (host arrays, live entries only)


def value_names(value_spec: ValueSpec) -> list[str]:
  """The array name of each value leaf."""
  return leaf_names(jax.tree.unflatten(value_spec.treedef, [0] * len(value_spec.leaves)), "values")


def field_of(name: str) -> str:
  """``"keys"`` or ``"values"``: what the array ``name`` holds (any other name is returned as it is)."""
  match = _SHARD.fullmatch(name)
  field = match[2] if match else name
  return "values" if field.startswith("values") else field


def to_arrays(shards: list[Entries], value_spec: ValueSpec) -> dict[str, np.ndarray]:
  """The named arrays of a table's entries, given shard by shard (one shard: no prefix)."""
  names = value_names(value_spec)
  out = {}
  for i, (keys, leaves) in enumerate(shards):
    prefix = "" if len(shards) == 1 else f"shards/{i}/"
    out[prefix + "keys"] = keys
    out |= {prefix + name: leaf for name, leaf in zip(names, leaves)}
  return out


def from_arrays(arrays, key_spec: KeySpec, value_spec: ValueSpec) -> tuple[np.ndarray, object]:
  """``(keys, values)`` of all shards of :func:`to_arrays` output, checked against the specs.

  Raises:
    TypeError: the arrays are not those of a table (other names).
    ValueError: keys or values of another dtype or shape than the specs.
  """
  expected = ["keys", *value_names(value_spec)]
  shards: dict[int, dict[str, np.ndarray]] = {}
  for name, array in arrays.items():
    match = _SHARD.fullmatch(name)
    index, field = (int(match[1]), match[2]) if match else (-1, name)
    shards.setdefault(index, {})[field] = np.asarray(array)
  mixed = -1 in shards and len(shards) > 1
  if not shards or mixed or any(sorted(fields) != sorted(expected) for fields in shards.values()):
    raise TypeError(f"expected the arrays of a table, {expected}, got {sorted(arrays)}.")
  parts = [shards[i] for i in sorted(shards)]
  keys = np.concatenate([part["keys"] for part in parts])
  if keys.dtype != key_spec.dtype or keys.shape[1:] != key_spec.shape:
    saved = f"{keys.dtype}{list(keys.shape[1:]) if keys.ndim > 1 else ''}"
    raise ValueError(f"keys: the checkpoint holds {saved} keys, the table {key_spec} keys.")
  leaves = []
  for name, leaf in zip(expected[1:], value_spec.leaves):
    values = np.concatenate([part[name] for part in parts])
    if not leaf.accepts(values.dtype) or values.shape != (len(keys), *leaf.shape):
      raise ValueError(
        f"{name}: the checkpoint holds {values.dtype}{list(values.shape[1:])} for {len(keys)} keys, "
        f"the table {leaf}."
      )
    leaves.append(values)
  return keys, jax.tree.unflatten(value_spec.treedef, leaves)
