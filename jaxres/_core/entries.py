"""A table's live entries as named host arrays: what a checkpoint stores of a table.

A table holding one set of entries is stored as ``keys`` (exact dtype,
``[n, *key_shape]``) and ``values`` (one array per value leaf, named by its
key path: ``values``, or ``values/emb`` and ``values/count``); a table with an
eviction policy adds ``scores`` (``uint32[n]``) and the scalars ``clock`` and
``evictions``. A table split into shards stores each shard's entries under
``shards/<i>/``, so each shard can be written by whoever holds it. Either
form restores into any table with the same keys and values, whatever its
capacity or number of shards.

An open-addressing table also stores where each entry sits (``slots``,
``int32[n]``) and the shape those numbers refer to (``layout``). Restored
into a table of that same shape, the entries go back to their slots, so the
table is the one saved, not merely one with the same contents: which entry a
full table evicts depends on where entries sit, and a resumed run evicts
exactly as the uninterrupted one did.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import jax
import numpy as np

from jaxres._core.codec import KeySpec
from jaxres._core.pytrees import leaf_names
from jaxres._core.values import ValueSpec

_SHARD = re.compile(r"shards/(\d+)/(.+)")

# keys, value leaves, scores (or None), slots (or None): host arrays of the live entries
Entries = tuple[np.ndarray, list[np.ndarray], np.ndarray | None, np.ndarray | None]
_COUNTERS = ("clock", "evictions")
_LAYOUT = "layout"


class Saved(NamedTuple):
  """A table's entries read back: all shards' concatenated, with what places them."""

  keys: np.ndarray
  values: object  # the value pytree, leaves [n, *value_shape]
  scores: np.ndarray | None
  counters: dict
  layout: np.ndarray | None  # the shape ``slots`` refer to
  slots: list[np.ndarray] | None  # per shard, in the order of ``keys``


def value_names(value_spec: ValueSpec) -> list[str]:
  """The array name of each value leaf."""
  return leaf_names(jax.tree.unflatten(value_spec.treedef, [0] * len(value_spec.leaves)), "values")


def field_of(name: str) -> str:
  """``"keys"``, ``"values"`` or ``"scores"``: what the array ``name`` holds (others: the name itself)."""
  match = _SHARD.fullmatch(name)
  field = match[2] if match else name
  return "values" if field.startswith("values") else field


def to_arrays(
  shards: list[Entries], value_spec: ValueSpec, counters: dict | None = None, layout=None
) -> dict[str, np.ndarray]:
  """The named arrays of a table's entries, given shard by shard (one shard: no prefix).

  ``counters``: the ``clock`` and ``evictions`` of a table with an eviction
  policy; ``layout``: the shape the entries' slots refer to, if kept.
  """
  names = value_names(value_spec)
  out = {name: np.asarray(value) for name, value in (counters or {}).items()}
  for i, (keys, leaves, scores, slots) in enumerate(shards):
    prefix = "" if len(shards) == 1 else f"shards/{i}/"
    out[prefix + "keys"] = keys
    out |= {prefix + name: leaf for name, leaf in zip(names, leaves)}
    if scores is not None:
      out[prefix + "scores"] = scores
    if slots is not None:
      out[prefix + "slots"] = np.asarray(slots, np.int32)
  if layout is not None:
    out[_LAYOUT] = np.asarray(layout, np.int64)
  return out


def from_arrays(arrays, key_spec: KeySpec, value_spec: ValueSpec) -> Saved:
  """The :class:`Saved` entries of :func:`to_arrays` output, checked against the specs.

  ``scores`` is ``None`` and ``counters`` empty for a table saved without an
  eviction policy; ``layout`` and ``slots`` are ``None`` unless saved.

  Raises:
    TypeError: the arrays are not those of a table (other names).
    ValueError: keys or values of another dtype or shape than the specs.
  """
  expected = ["keys", *value_names(value_spec)]
  counters = {name: int(np.asarray(arrays[name])) for name in _COUNTERS if name in arrays}
  shards: dict[int, dict[str, np.ndarray]] = {}
  for name, array in arrays.items():
    if name in (*_COUNTERS, _LAYOUT):
      continue
    match = _SHARD.fullmatch(name)
    index, field = (int(match[1]), match[2]) if match else (-1, name)
    shards.setdefault(index, {})[field] = np.asarray(array)
  scored = bool(counters) and all("scores" in fields for fields in shards.values())
  placed = _LAYOUT in arrays and all("slots" in fields for fields in shards.values())
  want = sorted(expected + ["scores"] * scored + ["slots"] * placed)
  mixed = -1 in shards and len(shards) > 1
  if not shards or mixed or any(sorted(fields) != want for fields in shards.values()):
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
  scores = np.concatenate([part["scores"] for part in parts]) if scored else None
  if scores is not None and (scores.dtype != np.uint32 or scores.shape != (len(keys),)):
    raise ValueError(f"scores: the checkpoint holds {scores.dtype}{list(scores.shape)} for {len(keys)} keys.")
  slots = [part["slots"] for part in parts] if placed else None
  if slots is not None and any(
    s.shape != (len(p["keys"]),) or s.dtype.kind not in "iu" for s, p in zip(slots, parts)
  ):
    raise ValueError("slots: the checkpoint's slot numbers do not match its keys (corrupted).")
  layout = np.asarray(arrays[_LAYOUT]) if placed else None
  return Saved(keys, jax.tree.unflatten(value_spec.treedef, leaves), scores, counters, layout, slots)
