"""A served model kept fresh: tables with room to change, and the deltas of later training steps.

An updatable export (``jr.saved_model.save(..., updatable=True)``) serves each
table as a sorted table of the training table's capacity, so that entries can
come and go without changing the shapes its programs were lowered for. Its
directory still holds only the live entries (the rest is padded at load), and,
for each served entry, the slot it sat in in the training table.

The export and every delta record a *lineage*: the model's identity, an
identity of its own, its step, where each table's arrays sit in the serving
state (and the version and slot layout the training table had), and a digest
of every other array the programs read. ``jr.saved_model.save_delta``
compares the training object with the lineage of the export or delta it
follows and writes only what changed:

- of each table, the entries inserted or changed since (with their slots)
  and which training slots hold an entry now, as packed bits, read from the
  table's change stamps (:meth:`jaxres.Table.changes`): the entries removed or
  evicted since are the served ones whose slot is no longer live or holds a
  changed entry. A table rebuilt since (grown, replaced, or one whose storage
  gives no changes) comes whole. So does every table when the lineage
  followed was not written in this process from this same object (a
  restarted trainer): versions only tell changes apart within one run.
- every other array whose digest changed, whole.

Applying a delta to a loaded model (:func:`applied`) rebuilds each changed
table's sorted arrays on the host (one pass over the served table and a sort
of its entries) and hands the new arrays to the same compiled programs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import uuid
import weakref
from pathlib import Path

import jax
import numpy as np

from jaxres._core.storages.sorted import SortedTable, read_only, read_only_like
from jaxres._core.table import Table
from jaxres._persistence import saved_entries, table_arrays
from jaxres._persistence.table_arrays import Mark
from jaxres._serving import directory, served_state

DELTA_FORMAT = "jaxres.saved_model.delta"
DELTA_VERSION = 2  # 2: always sealed; 1, read too: sealed or not
DELTA_MANIFEST = "delta.json"
TABLE_FIELDS = ("keys", "live", "count", "size")  # the served table's arrays a delta rewrites


@dataclasses.dataclass
class Rows:
  """A table's entries as a served table holds them: key words, stored value leaves, training slots.

  ``live``: which training slots hold an entry now (``None``: these rows are
  the whole table, not a change).
  """

  words: np.ndarray  # uint32[n, words]
  leaves: list[np.ndarray | None]  # each stored value leaf [n, ...] (None: not served)
  slots: np.ndarray  # int64[n]
  live: np.ndarray | None

  def to_arrays(self) -> dict[str, np.ndarray]:
    out = {"words": self.words, "slots": self.slots}
    out |= {f"values/{j}": leaf for j, leaf in enumerate(self.leaves) if leaf is not None}
    if self.live is not None:
      out["live"] = np.packbits(self.live)
    return out

  @classmethod
  def from_arrays(cls, arrays: dict, leaves: int, num_slots: int | None) -> Rows:
    """The rows of a delta's arrays, once their sizes agree (``num_slots``: the bits of ``live``).

    Raises:
      ValueError: ``num_slots`` is not what the packed ``live`` bits hold, or a
        slot is out of range or repeated.
    """
    live = None
    if num_slots is not None:
      packed = arrays["live"]
      if not isinstance(num_slots, int) or packed.ndim != 1 or -(-num_slots // 8) != len(packed):
        raise ValueError(f"slots_total {num_slots!r} is not the {8 * len(packed)} bits of live at most")
      live = np.unpackbits(packed, count=num_slots).astype(bool)
    values = [arrays.get(f"values/{j}") for j in range(leaves)]
    slots = np.asarray(arrays["slots"], np.int64)
    if (
      slots.ndim != 1
      or len(np.unique(slots)) != len(slots)
      or (live is not None and len(slots) and (slots.min() < 0 or slots.max() >= len(live)))
    ):
      raise ValueError("slots repeated or out of range")
    return cls(arrays["words"], values, slots, live)


def table_rows(table: Table, since: Mark | None, served: list[bool]) -> tuple[Mark | None, Rows]:
  """``(mark, rows)``: ``table``'s entries changed since ``since`` (or all of them, ``rows.live``
  ``None``, where it cannot give changes), with the value leaves marked ``served``."""
  mark, delta = table_arrays.changes(table, since)
  live = None
  if delta is None:
    delta = table_arrays.to_arrays(table)
  else:
    delta, live = saved_entries.delta_live(delta)
  saved = saved_entries.from_arrays(delta, table.key_spec, table.value_spec)
  n = len(saved.keys)
  words = np.asarray(table.key_spec.encode(np.asarray(saved.keys))[0], np.uint32)
  words = words.reshape(n, table.key_spec.num_words)
  stored = table.value_spec.to_storage(saved.values, (n,), "values")
  slots = saved_entries.numbered_slots(saved)
  return mark, Rows(
    words,
    [np.asarray(x) if keep else None for x, keep in zip(stored, served)],
    np.arange(n, dtype=np.int64) if slots is None else slots,
    live,
  )


def _mark_json(mark: Mark | None):
  return None if mark is None else {"version": mark.version, "layout": list(mark.layout), "kind": mark.kind}


def _mark(entry) -> Mark | None:
  if entry is None:
    return None
  layout = tuple(int(x) for x in entry["layout"])  # marks written before the kind was kept: the oldest
  return Mark(int(entry["version"]), layout, entry.get("kind", saved_entries.OLDEST_KIND))


def _digest(x) -> str:
  return hashlib.blake2b(np.ascontiguousarray(jax.device_get(x)).tobytes(), digest_size=16).hexdigest()


# The lineages this process wrote (by id), each with the object it was written from: a delta follows
# one of them with the tables' own changes, any other one with every table whole.
_WRITTEN: dict[str, weakref.ref | None] = {}


def written(lineage: dict, obj) -> None:
  """Notes that this process wrote ``lineage`` from ``obj``."""
  try:
    _WRITTEN[lineage["id"]] = weakref.ref(obj)
  except TypeError:  # an object that takes no weak reference (a list, a dict) is not followed
    _WRITTEN[lineage["id"]] = None


def _follows(lineage: dict, obj) -> bool:
  """Whether ``obj`` is the object this process wrote ``lineage`` from."""
  ref = _WRITTEN.get(lineage.get("id"))
  return ref is not None and ref() is obj


# ---------------------------------------------------------------- the export


class Recorder:
  """The ``served`` function of :func:`served_state.serving_copy` for an updatable export: each table
  as a read-only table of its capacity, noted with it in the order they come."""

  def __init__(self):
    self.tables: list[tuple[Table, SortedTable]] = []

  def __call__(self, table: Table) -> SortedTable:
    served = read_only(table, table.capacity)
    self.tables.append((table, served))
    return served


def lineage(recorder: Recorder, leaves: list, names: list[str], position: dict[int, int], step: int):
  """``(lineage, extra, rows)``: the lineage of an updatable export; the arrays it adds to the
  serving state (each table's fields a delta rewrites that no program reads, and its training
  slots), placed after the leaves the programs read (``position``); and, by place, the rows in use
  and in all of each table array (padded at load).
  """
  index = {id(x): i for i, x in enumerate(leaves)}
  owned: set[int] = set()
  extra: list[np.ndarray] = []

  def place_of(array, add: bool) -> int | None:
    leaf = index[id(array)]
    owned.add(leaf)
    if leaf in position or not add:
      return position.get(leaf)
    extra.append(np.asarray(jax.device_get(array)))
    return len(position) + len(extra) - 1

  tables, padded = [], {}
  for table, served in recorder.tables:
    fields = {name: place_of(getattr(served, name), add=True) for name in TABLE_FIELDS}
    values = [place_of(x, add=False) for x in served.values]
    mark, rows = table_rows(table, None, [True] * len(values))
    order = np.lexsort(rows.words.T[::-1])  # the served table's order: ascending key words
    extra.append(np.pad(rows.slots[order], (0, served.capacity - len(order)), constant_values=-1))
    fields["slots"] = len(position) + len(extra) - 1
    for place in [fields["keys"], fields["live"], fields["slots"], *(v for v in values if v is not None)]:
      padded[place] = (len(order), served.capacity)
    tables.append(
      {
        "path": names[index[id(served.keys)]].rpartition("/")[0] or "the object",
        "capacity": served.capacity,
        "key_words": table.key_spec.num_words,
        "fields": fields,
        "values": values,
        "mark": _mark_json(mark),
        "version": int(jax.device_get(table.version)),
      }
    )
  dense = [[place, leaf, _digest(leaves[leaf])] for leaf, place in position.items() if leaf not in owned]
  record = {
    "model": uuid.uuid4().hex,
    "id": uuid.uuid4().hex,
    "step": step,
    "leaves": len(leaves),
    "tables": tables,
    "dense": dense,
  }
  return record, extra, padded


# ---------------------------------------------------------------- deltas


def read_lineage(path: Path) -> dict:
  """The lineage of the export or delta at ``path``.

  Raises:
    ValueError: naming ``path``: neither, or an export saved without ``updatable=True``.
  """
  if (path / DELTA_MANIFEST).is_file():
    return read_delta(path)[0]["lineage"]
  manifest = directory.read_manifest(path)
  if "updates" not in manifest:
    raise ValueError(
      f"since: {path} was exported without updatable=True; export it again with "
      "jr.saved_model.save(..., updatable=True) to take deltas."
    )
  return manifest["updates"]


def check_target(path) -> Path:
  """``path`` as a ``Path`` a delta may be written to: new, empty, or an earlier delta (see
  :func:`directory.check_target`)."""
  return directory.check_target(path, "delta", lambda p: (p / DELTA_MANIFEST).is_file())


def write_delta(obj, path: Path, since: Path, step: int) -> None:
  """Writes the delta of ``obj`` against the export or delta at ``since`` (see the module)."""
  parent = read_lineage(since)
  if step <= parent["step"]:
    raise ValueError(f"step: {step} is not after step {parent['step']} of {since}.")
  if path.resolve() == since.resolve():
    raise ValueError(f"path: {path} is the export or delta the new one follows.")
  tables: list[Table] = []

  def stand_in(table: Table) -> SortedTable:
    tables.append(table)
    return read_only_like(table, 1)

  leaves, _, _ = served_state.split(served_state.serving_copy(obj, stand_in))
  if len(leaves) != parent["leaves"] or len(tables) != len(parent["tables"]):
    raise ValueError(
      f"obj: its serving state has {len(leaves)} arrays and {len(tables)} tables; the model at {since} "
      f"has {parent['leaves']} and {len(parent['tables'])}: another model."
    )
  follows = _follows(parent, obj)
  arrays, kinds, records = {}, [], []
  for t, (table, record) in enumerate(zip(tables, parent["tables"], strict=True)):
    version = int(jax.device_get(table.version))
    mark = _mark(record["mark"]) if follows else None
    layout = (
      None if table.slot_layout is None else (tuple(int(x) for x in table.slot_layout), table.slot_kind)
    )
    alike = len(table.value_spec.leaves) == len(record["values"])
    if table.key_spec.num_words != record["key_words"] or not alike:
      raise ValueError(f"obj: the table at {record['path']} has other keys or values than the one served.")
    record = dict(record, version=version)
    same_layout = layout == (None if mark is None else (mark.layout, mark.kind))
    if follows and version == parent["tables"][t]["version"] and same_layout:
      kinds.append("same")
    else:
      served = [place is not None for place in record["values"]]
      new_mark, rows = table_rows(table, mark, served)
      count = len(rows.words) if rows.live is None else int(rows.live.sum())
      if count > record["capacity"]:
        raise ValueError(
          f"obj: the table at {record['path']} holds {count} entries; the served model has room for "
          f"{record['capacity']}. Export the model again."
        )
      kinds.append("whole" if rows.live is None else "changes")
      arrays |= {f"tables/{t}/{name}": x for name, x in rows.to_arrays().items()}
      record["mark"] = _mark_json(new_mark)
      record["slots_total"] = None if rows.live is None else len(rows.live)
    records.append(record)
  dense = []
  for place, leaf, digest in parent["dense"]:
    now = _digest(leaves[leaf])
    if now != digest:
      arrays[f"dense/{place}"] = np.asarray(jax.device_get(leaves[leaf]))
    dense.append([place, leaf, now])
  record = dict(parent, id=uuid.uuid4().hex, step=step, tables=records, dense=dense)
  manifest = {
    "format": DELTA_FORMAT,
    "version": DELTA_VERSION,
    "parent": {"id": parent["id"], "step": parent["step"]},
    "kinds": kinds,
  }
  directory.write_files(path, DELTA_MANIFEST, manifest | {"lineage": record}, arrays)
  written(record, obj)


def read_delta(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
  """``(manifest, arrays)`` of the delta at ``path``.

  Raises:
    ValueError: naming ``path``: not a delta, a newer format version, or damaged.
  """
  return directory.read_files(
    path, DELTA_MANIFEST, DELTA_FORMAT, "jaxres saved-model delta", (1, DELTA_VERSION), sealed_since=2
  )


def applied(state: list, served: dict, path: Path) -> tuple[dict[int, np.ndarray], dict]:
  """``(arrays, lineage)``: the serving state's arrays the delta at ``path`` replaces (by place), and
  the lineage after it; ``state`` and ``served`` (its lineage) are those of the model served now.

  Raises:
    ValueError: naming ``path``: not a delta of this model, not the delta that follows the
      export or delta served, damaged, or holding more entries than a served table has room for.
  """
  manifest, arrays = read_delta(path)
  try:
    after, parent = manifest["lineage"], manifest["parent"]
    if after["model"] != served["model"]:
      raise ValueError(f"{path}: a delta of another model than the one served.")
    if _layout(after) != _layout(served):  # where the served arrays are, and their room: the model's
      raise ValueError(
        f"{path}: corrupted delta (its tables' places, fields or capacities are not the served model's)."
      )
    if after["step"] <= served["step"]:
      raise ValueError(f"{path}: the delta of step {after['step']}; this model serves step {served['step']}.")
    if parent["id"] != served["id"]:
      raise ValueError(
        f"{path}: the delta of step {parent['step']} to {after['step']} does not follow what this model "
        f"serves (step {served['step']}): apply the deltas in between first, in the order written."
      )
    out: dict[int, np.ndarray] = {}
    for t, (kind, record) in enumerate(zip(manifest["kinds"], after["tables"], strict=True)):
      if kind == "same":
        continue
      prefix = f"tables/{t}/"
      mine = {name[len(prefix) :]: x for name, x in arrays.items() if name.startswith(prefix)}
      rows = Rows.from_arrays(mine, len(record["values"]), record.get("slots_total"))
      out |= _table_applied(state, record, rows, path)
    for place, _, _ in after["dense"]:
      if f"dense/{place}" in arrays:
        out[place] = _alike(arrays[f"dense/{place}"], state[place], f"array {place}", path)
  except (KeyError, TypeError, IndexError, AttributeError) as err:
    raise ValueError(f"{path}: corrupted delta ({err!r}).") from None
  except ValueError as err:
    if str(path) in str(err):
      raise
    raise ValueError(f"{path}: corrupted delta ({err}).") from None
  return out, after


def _layout(lineage: dict) -> tuple:
  """What of a lineage only an export sets: each table's path, places and capacity, the dense places."""
  tables = [(t["path"], t["fields"], t["values"], t["capacity"]) for t in lineage["tables"]]
  return tables, [place for place, *_ in lineage["dense"]]


def _alike(new: np.ndarray, old: np.ndarray, what: str, path: Path, rows: bool = False) -> np.ndarray:
  """``new`` where it has ``old``'s dtype and shape (of a row, with ``rows``)."""
  shape, expected = (new.shape[1:], old.shape[1:]) if rows else (new.shape, old.shape)
  if new.dtype != old.dtype or shape != expected:
    raise ValueError(f"{path}: {what} is {new.dtype}{list(shape)}, served {old.dtype}{list(expected)}.")
  return new


def _table_applied(state: list, record: dict, rows: Rows, path: Path) -> dict[int, np.ndarray]:
  """The served table of ``record`` with ``rows`` applied: its new arrays by place."""
  fields, capacity = record["fields"], record["capacity"]
  count = int(np.asarray(state[fields["count"]]))
  keys = np.asarray(state[fields["keys"]])[:count]
  slots = np.asarray(state[fields["slots"]])[:count]
  live = np.asarray(state[fields["live"]])[:count]
  if rows.live is None:
    keep = np.zeros(count, bool)
  else:
    if len(slots) and slots.max() >= len(rows.live):
      raise ValueError(f"{path}: its live slots do not cover the table at {record['path']} (corrupted).")
    keep = live & rows.live[slots] & ~np.isin(slots, rows.slots)
  words = np.concatenate([keys[keep], _alike(rows.words, keys, f"the keys of {record['path']}", path, True)])
  order = np.lexsort(words.T[::-1])
  n = len(order)
  if n > 1 and np.any(np.all(words[order[1:]] == words[order[:-1]], axis=1)):
    raise ValueError(f"{path}: corrupted delta (the table at {record['path']} would hold a key twice).")
  if n > capacity:
    raise ValueError(
      f"{path}: the table at {record['path']} would hold {n} entries; the served model has room "
      f"for {capacity}."
    )

  def padded(old: np.ndarray, new: np.ndarray, fill=0) -> np.ndarray:
    out = np.full((capacity, *old.shape[1:]), fill, old.dtype)
    out[:n] = np.concatenate([old[:count][keep], new.astype(old.dtype, copy=False)])[order]
    return out

  out = {
    fields["keys"]: padded(np.asarray(state[fields["keys"]]), rows.words),
    fields["slots"]: padded(np.asarray(state[fields["slots"]]), rows.slots, -1),
    fields["live"]: np.arange(capacity) < n,
    fields["count"]: np.asarray(n, np.asarray(state[fields["count"]]).dtype),
    fields["size"]: np.asarray(n, np.asarray(state[fields["size"]]).dtype),
  }
  for place, leaf in zip(record["values"], rows.leaves, strict=True):
    if place is not None:
      if leaf is None:
        raise ValueError(f"{path}: a value of the table at {record['path']} is missing (corrupted).")
      old = np.asarray(state[place])
      out[place] = padded(old, _alike(leaf, old, f"a value of {record['path']}", path, rows=True))
  return out
