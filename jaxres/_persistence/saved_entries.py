"""A table's live entries as named host arrays: what a checkpoint stores of a table.

A table holding one set of entries is stored as ``keys`` (exact dtype,
``[n, *key_shape]``) and ``values`` (one array per value leaf, named by its
key path: ``values``, or ``values/emb`` and ``values/count``); a table with an
eviction policy adds ``scores`` (``uint32[n]``) and the scalars ``clock`` and
``evictions``.

A table split into shards (which may live on several processes) stores them
as *blocks*, so that each process writes and reads whole shards of global
arrays (see :mod:`processes`): ``blocks/keys`` (the key words, ``uint32[shards,
width, words]``), ``blocks/values...`` (the stored value leaves),
``blocks/scores`` and ``blocks/slots``, where row ``i`` holds shard ``i``'s
live entries first and ``counts[i]`` says how many; empty ``keys`` and
``values...`` arrays record the exact dtypes. A process may read only some
shards: the entries it holds are :attr:`Saved.complete` or not. (Checkpoints
from before blocks stored shard ``i`` under ``shards/<i>/``; blocks are read
through that form.) Every form restores into any table with the same keys and
values, whatever its capacity or number of shards.

A *delta* (an incremental save, see :func:`delta_to_arrays`) holds the
entries changed since an earlier save, in the same names, and ``live``: which
slots hold an entry now, as packed bits; :func:`compose` applies it to the
arrays of that earlier save.

A table that places keys by hashing (open addressing, lean) also stores
where each entry sits (``slots``, ``int32[n]``), the shape those numbers refer
to (``layout``) and the storage kind that placed them (``layout_kind``: its
registered name as ASCII bytes; checkpoints written before it was kept were
all open addressing, and read as such). Restored into a table of that same
kind and shape, the entries go back to their slots, so the table is the one
saved, not merely one with the same contents: which entry a full table evicts
depends on where entries sit, and a resumed run evicts exactly as the
uninterrupted one did. Into any other table they are inserted anew: slots of
one kind are not where another kind's lookups search, even where the two
layouts' numbers agree.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import jax
import numpy as np

from jaxres._core.encoding import key_specs
from jaxres._core.encoding.key_specs import KeySpec
from jaxres._core.encoding.value_specs import ValueSpec
from jaxres._core.pytrees import leaf_names
from jaxres._persistence import processes
from jaxres._persistence.processes import Blocks

_SHARD = re.compile(r"shards/(\d+)/(.+)")

# keys, value leaves, scores (or None), slots (or None): host arrays of the live entries
Entries = tuple[np.ndarray, list[np.ndarray], np.ndarray | None, np.ndarray | None]
_COUNTERS = ("clock", "evictions")
_LAYOUT = "layout"
_KIND = "layout_kind"
OLDEST_KIND = "open_addressing"  # the kind of slots saved before the kind was (every one of them)
_LIVE = "live"
_PER_ENTRY = ("keys", "values", "scores", "slots")
_COUNTS = "counts"
_BLOCK = "blocks/"


class Saved(NamedTuple):
  """A table's entries read back: all shards' concatenated, with what places them."""

  keys: np.ndarray
  values: object  # the value pytree, leaves [n, *value_shape]
  scores: np.ndarray | None
  counters: dict
  layout: np.ndarray | None  # the shape ``slots`` refer to
  layout_kind: str | None  # the storage kind that placed the entries at ``slots``
  slots: list[np.ndarray] | None  # per shard, in the order of ``keys``
  complete: bool = True  # False: other processes read the other shards' entries
  shards: tuple[int, ...] = (0,)  # the saved shards these are, in order


def value_names(value_spec: ValueSpec) -> list[str]:
  """The array name of each value leaf."""
  return leaf_names(jax.tree.unflatten(value_spec.treedef, [0] * len(value_spec.leaves)), "values")


def field_of(name: str) -> str:
  """``"keys"``, ``"values"`` or ``"scores"``: what the array ``name`` holds (others: the name itself)."""
  match = _SHARD.fullmatch(name)
  field = match[2] if match else name
  return "values" if field.startswith("values") else field


def to_arrays(
  entries: Entries, value_spec: ValueSpec, counters: dict | None = None, layout=None, kind: str | None = None
) -> dict[str, np.ndarray]:
  """The named arrays of a table's entries.

  ``counters``: the ``clock`` and ``evictions`` of a table with an eviction
  policy; ``layout``: the shape the entries' slots refer to, if kept, and
  ``kind`` the storage kind that placed them (its registered name).

  Examples:
    >>> import numpy as np
    >>> from jaxres._core.encoding.value_specs import ValueSpec
    >>> entries = (np.array([7]), [np.array([1.5], np.float32)], None, np.array([3]))
    >>> arrays = to_arrays(entries, ValueSpec.parse(np.float32), layout=[1, 2, 4], kind="lean")
    >>> sorted(arrays), bytes(arrays["layout_kind"])
    (['keys', 'layout', 'layout_kind', 'slots', 'values'], b'lean')
  """
  keys, leaves, scores, slots = entries
  out = {name: np.asarray(value) for name, value in (counters or {}).items()}
  out["keys"] = keys
  out |= dict(zip(value_names(value_spec), leaves))
  if scores is not None:
    out["scores"] = scores
  if slots is not None:
    out["slots"] = np.asarray(slots, np.int32)
  if layout is not None:
    out[_LAYOUT] = np.asarray(layout, np.int64)
    out[_KIND] = np.frombuffer(kind.encode("ascii"), np.uint8).copy()
  return out


def delta_to_arrays(
  entries: Entries, live: np.ndarray, value_spec: ValueSpec, counters: dict | None, layout, kind: str
) -> dict[str, np.ndarray]:
  """The named arrays of a delta: the changed ``entries`` (with their slots) and ``live``
  (``bool[num_slots]``, the slots holding an entry now)."""
  return to_arrays(entries, value_spec, counters, layout, kind) | {_LIVE: np.packbits(live)}


def delta_to_blocks(
  blocks: dict, counts: np.ndarray, live: np.ndarray, key_spec: KeySpec, value_spec: ValueSpec, **extra
) -> dict:
  """The named arrays of a delta of a table in shards: as :func:`to_blocks`, each shard's changed
  entries, and ``blocks/live`` (``uint8[shards, bytes]``: each shard's live slots, packed bits)."""
  return to_blocks(blocks, counts, key_spec, value_spec, **extra) | {_BLOCK + _LIVE: live}


def delta_live(delta: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], np.ndarray]:
  """``(arrays, live)``: a delta's changed entries as arrays :func:`from_arrays` reads, and which
  slots hold an entry now (``bool``, every shard's slots in turn: see :func:`numbered_slots`)."""
  name = _BLOCK + _LIVE if _COUNTS in delta else _LIVE
  per_shard = int(np.prod(np.asarray(delta[_LAYOUT])[1:]))
  packed = np.asarray(delta[name], np.uint8).reshape(-1, (per_shard + 7) // 8)
  live = np.unpackbits(packed, axis=1, count=per_shard).astype(bool).reshape(-1)
  return {n: array for n, array in delta.items() if n != name}, live


def numbered_slots(saved: Saved) -> np.ndarray | None:
  """Each saved entry's slot numbered over every shard in turn (``shard * slots_per_shard + slot``,
  ``int64[n]``), or ``None`` for entries saved without slots."""
  if saved.slots is None:
    return None
  per_shard = int(np.prod(saved.layout[1:]))
  parts = [shard * per_shard + np.asarray(s, np.int64) for shard, s in zip(saved.shards, saved.slots)]
  return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def compose(earlier: dict[str, np.ndarray], delta: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """The arrays of the table ``delta`` was taken from, given ``earlier``: the arrays of the save the
  delta follows (whole ones, with slots; both in blocks for a table in shards). The entries whose
  slot is no longer live, or holds a changed entry, leave; the changed entries come in; entries
  come out in slot order.

  Raises:
    ValueError: ``earlier`` holds no slots, or the two disagree on the entries' names or layout.
  """
  live_name = _BLOCK + _LIVE if _COUNTS in delta else _LIVE
  slots_name = _BLOCK + "slots" if _COUNTS in delta else "slots"
  if slots_name not in earlier or sorted(earlier) != sorted(n for n in delta if n != live_name):
    raise ValueError(
      f"a delta with arrays {sorted(delta)} does not follow a save of arrays {sorted(earlier)} (corrupted)."
    )
  if not np.array_equal(earlier.get(_LAYOUT), delta.get(_LAYOUT)) or _kind_of(earlier) != _kind_of(delta):
    raise ValueError("a delta of another slot layout than the save it follows (corrupted).")
  if _COUNTS not in delta:
    fields = [name for name in delta if field_of(name) in _PER_ENTRY]
    rows = _composed_rows(earlier, delta, np.asarray(delta[_LIVE]), fields)
    return {name: rows.get(name, array) for name, array in delta.items() if name != _LIVE}
  fields = [name for name in delta if name.startswith(_BLOCK) and name != live_name]
  read = delta[live_name]  # on several processes, each read (and composes) only some shards' rows
  held = sorted(read.rows) if isinstance(read, Blocks) else range(len(delta[_COUNTS]))
  shards = {}
  for shard in held:
    before, after = int(earlier[_COUNTS][shard]), int(delta[_COUNTS][shard])
    rows_before = {name: _row(earlier[name], shard)[:before] for name in fields}
    rows_after = {name: _row(delta[name], shard)[:after] for name in fields}
    shards[shard] = _composed_rows(rows_before, rows_after, _row(read, shard), fields)
  counts = np.zeros(len(delta[_COUNTS]), np.int32)
  for shard, rows in shards.items():
    counts[shard] = len(rows[slots_name])
  if isinstance(read, Blocks):  # each shard composed by the one process that read it: tell every process
    counts = processes.everywhere(counts).sum(axis=0, dtype=np.int32)
  width = max(1, int(counts.max(initial=0)))

  def padded(rows: np.ndarray) -> np.ndarray:
    return np.pad(rows, [(0, width - len(rows))] + [(0, 0)] * (rows.ndim - 1))

  out = {name: array for name, array in delta.items() if name not in fields and name != live_name}
  out[_COUNTS] = counts
  for name in fields:
    rows = {shard: padded(shards[shard][name]) for shard in held}
    if isinstance(read, Blocks):
      dtype = delta[name].dtype
      out[name] = Blocks((len(counts), width, *delta[name].shape[2:]), dtype, rows)
    else:
      out[name] = np.stack([rows[shard] for shard in held])
  return out


def _row(array, shard: int) -> np.ndarray:
  """Row ``shard`` of a block array (read whole, or as :class:`Blocks`)."""
  return array.rows[shard] if isinstance(array, Blocks) else np.asarray(array)[shard]


def _composed_rows(earlier: dict, delta: dict, packed_live: np.ndarray, fields: list[str]) -> dict:
  """One set of entries (a table's, or a shard's) composed, by field name, in slot order."""
  slots_name = next(name for name in fields if name.endswith("slots"))
  live = np.unpackbits(np.asarray(packed_live, np.uint8)).astype(bool)
  slots = np.asarray(earlier[slots_name], np.int64)
  if len(slots) and slots.max() >= len(live):
    raise ValueError("a delta's live slots do not cover the save it follows (corrupted).")
  keep = live[slots] & ~np.isin(slots, delta[slots_name])
  rows = {name: np.concatenate([np.asarray(earlier[name])[keep], np.asarray(delta[name])]) for name in fields}
  order = np.argsort(rows[slots_name], kind="stable")
  return {name: array[order] for name, array in rows.items()}


def to_blocks(blocks: dict, counts: np.ndarray, key_spec: KeySpec, value_spec: ValueSpec, **extra) -> dict:
  """The named arrays of a table stored as blocks (see above).

  Args:
    blocks: ``"keys"`` (the key words), ``"values"`` (the stored value
      leaves), and with an eviction policy or a kept layout ``"scores"`` and
      ``"slots"``: arrays ``[shards, width, ...]`` (global arrays on several
      processes), each row a shard's live entries first.
    counts: ``int[shards]``, each shard's live entries.
    extra: ``counters``, ``layout`` and ``kind`` as for :func:`to_arrays`.
  """
  prototype = _prototype(key_spec, value_spec)
  out = to_arrays(prototype, value_spec, extra.get("counters"), extra.get("layout"), extra.get("kind"))
  out[_COUNTS] = np.asarray(counts, np.int32)
  out[_BLOCK + "keys"] = blocks["keys"]
  out |= {_BLOCK + name: leaf for name, leaf in zip(value_names(value_spec), blocks["values"])}
  out |= {_BLOCK + field: blocks[field] for field in ("scores", "slots") if blocks.get(field) is not None}
  return out


def count(arrays) -> int:
  """How many entries the arrays of a table hold (over every process)."""
  if _COUNTS in arrays:
    return int(np.sum(arrays[_COUNTS]))
  return sum(len(array) for name, array in arrays.items() if field_of(name) == "keys")


def _prototype(key_spec: KeySpec, value_spec: ValueSpec) -> Entries:
  """No entries, in the exact dtypes: what records them beside blocks of words."""
  leaves = [np.zeros((0, *leaf.shape), leaf.dtype) for leaf in value_spec.leaves]
  return np.zeros((0, *key_spec.shape), key_spec.dtype), leaves, None, None


def _unblocked(arrays, key_spec: KeySpec) -> tuple[dict[int, dict], bool]:
  """``{shard: {field: rows}}`` of the shards this process holds, and whether that is every shard."""
  counts = np.asarray(arrays[_COUNTS])
  blocks = {name.removeprefix(_BLOCK): array for name, array in arrays.items() if name.startswith(_BLOCK)}
  shapes = {
    field: block.shape if isinstance(block, Blocks) else np.shape(block) for field, block in blocks.items()
  }
  if (
    "keys" not in blocks
    or "keys" not in arrays
    or counts.ndim != 1
    or any(len(shape) < 2 or shape[0] != len(counts) for shape in shapes.values())
  ):
    raise TypeError(f"expected the blocks of a table's shards, got {sorted(arrays)}.")
  _check_keys(np.asarray(arrays["keys"]), key_spec)
  if shapes["keys"][-1] != key_spec.num_words:
    words = shapes["keys"][-1]
    raise ValueError(f"blocks/keys: {words} words per key, expected {key_spec.num_words} (corrupted).")
  words = blocks["keys"]
  held = sorted(words.rows) if isinstance(words, Blocks) else range(len(counts))
  shards = {}
  for shard in held:
    live, fields = int(counts[shard]), {}
    for field, block in blocks.items():
      rows = (block.rows[shard] if isinstance(block, Blocks) else np.asarray(block)[shard])[:live]
      if field == "keys":
        rows = key_spec.decode_host(rows)
      elif field in arrays:  # a value leaf, stored as the table stores it; the empty array has its dtype
        rows = _exact(rows, np.asarray(arrays[field]).dtype)
      fields[field] = rows
    shards[shard] = fields
  return shards, len(held) == len(counts)


def _by_shard(arrays) -> dict[int, dict]:
  """``{shard: {field: rows}}`` of arrays named ``keys``, ``values...`` (shard -1) or ``shards/<i>/...``."""
  shards: dict[int, dict[str, np.ndarray]] = {}
  for name, array in arrays.items():
    if name in (*_COUNTERS, _LAYOUT, _KIND):
      continue
    match = _SHARD.fullmatch(name)
    index, field = (int(match[1]), match[2]) if match else (-1, name)
    shards.setdefault(index, {})[field] = np.asarray(array)
  return shards


def _exact(rows: np.ndarray, dtype: np.dtype) -> np.ndarray:
  """Stored value rows in their exact dtype (64-bit integers stored as word pairs joined)."""
  if np.dtype(dtype).kind in "iu" and np.dtype(dtype).itemsize == 8 and rows.dtype == np.uint32:
    return key_specs.join64_host(rows, dtype)
  return rows


def _check_keys(keys: np.ndarray, key_spec: KeySpec) -> None:
  if keys.dtype != key_spec.dtype or keys.shape[1:] != key_spec.shape:
    saved = f"{keys.dtype}{list(keys.shape[1:]) if keys.ndim > 1 else ''}"
    raise ValueError(f"keys: the checkpoint holds {saved} keys, the table {key_spec} keys.")


def from_arrays(arrays, key_spec: KeySpec, value_spec: ValueSpec) -> Saved:
  """The :class:`Saved` entries of :func:`to_arrays` output, checked against the specs.

  ``scores`` is ``None`` and ``counters`` empty for a table saved without an
  eviction policy; ``layout``, ``layout_kind`` and ``slots`` are ``None`` unless saved.

  Raises:
    TypeError: the arrays are not those of a table (other names).
    ValueError: keys or values of another dtype or shape than the specs.
  """
  shards, complete = _unblocked(arrays, key_spec) if _COUNTS in arrays else (_by_shard(arrays), True)
  expected = ["keys", *value_names(value_spec)]
  counters = {name: int(np.asarray(arrays[name])) for name in _COUNTERS if name in arrays}
  scored = bool(counters) and all("scores" in fields for fields in shards.values())
  placed = _LAYOUT in arrays and all("slots" in fields for fields in shards.values())
  want = sorted(expected + ["scores"] * scored + ["slots"] * placed)
  mixed = -1 in shards and len(shards) > 1
  if (not shards and complete) or mixed or any(sorted(fields) != want for fields in shards.values()):
    raise TypeError(f"expected the arrays of a table, {expected}, got {sorted(arrays)}.")
  parts = [shards[i] for i in sorted(shards)]
  if not parts:  # this process read no shard
    keys, leaves, _, _ = _prototype(key_spec, value_spec)
    empty = dict(zip(expected, [keys, *leaves]))
    empty |= {"scores": np.zeros(0, np.uint32), "slots": np.zeros(0, np.int32)}
    parts = [{field: empty[field] for field in want}]
  keys = np.concatenate([part["keys"] for part in parts])
  _check_keys(keys, key_spec)
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
  kind = _kind_of(arrays) if placed else None
  values = jax.tree.unflatten(value_spec.treedef, leaves)
  held = tuple(max(i, 0) for i in sorted(shards))  # one set of entries (no prefix) is shard 0
  return Saved(keys, values, scores, counters, layout, kind, slots, complete, held)


def _kind_of(arrays) -> str | None:
  """The storage kind that placed the saved slots (:data:`OLDEST_KIND` where not recorded), or
  ``None`` for arrays without a layout."""
  if _LAYOUT not in arrays:
    return None
  if _KIND not in arrays:
    return OLDEST_KIND
  name = np.asarray(arrays[_KIND])
  if name.dtype != np.uint8 or name.ndim != 1 or not 0 < name.size <= 64 or not np.all(name < 128):
    raise ValueError(
      f"{_KIND}: expected a storage kind's ASCII name, got {name.dtype}{list(name.shape)} (corrupted)."
    )
  return name.tobytes().decode("ascii")
