"""``python -m benchmarks.memory``: the bytes an embedding row costs, by row optimizer and key dtype.

For rows of ``--features`` float32 (16 by default), each row optimizer and
key dtype, with and without eviction: the bytes per row of a
``jr.DynamicEmbedding`` (``memory()``'s sum over its capacity, built
abstractly at ``--capacity``), split into the row, its optimizer state and
the index, and the index beyond the row's data. Admission (``min_count`` 2
and 256: one- and two-byte counts) adds its bytes per counted id. Then the
index of a table by storage, side by side (today's open addressing and the
lean layout of issue 66): the bytes a
table holds beyond its value rows, per entry and per slot. Nothing is timed:
the figures are the arrays' sizes, the same on every machine.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jaxres as jr
from jaxres._core import memory
from jaxres._core.storages import registry

OPTIMIZERS = {
  "optax.sgd": lambda: optax.sgd(0.1),
  "optax.adagrad": lambda: optax.adagrad(0.1),
  "optax.lion": lambda: optax.lion(0.1),
  "optax.adam": lambda: optax.adam(0.1),
  "jr.CatchUpAdam": lambda: jr.CatchUpAdam(0.1),
}
KEYS = {"int64": jnp.int64, "int32": jnp.int32}
# The storages of tables that change, side by side (the sorted storage is read-only): a table's index
# is what it holds beyond the value rows.
INDEXED = ("open_addressing", "lean")


def parts(capacity: int, features: int, **options) -> dict[str, int]:
  """``memory()`` of an embedding built abstractly (nothing allocated)."""
  emb = nnx.eval_shape(lambda: jr.DynamicEmbedding(capacity, features, rngs=nnx.Rngs(0), **options))
  return jr.DynamicEmbedding.memory(emb)


def index_bytes(storage: str, capacity: int, features: int, key, eviction) -> tuple[int, int, int]:
  """``(index bytes, slots, value rows)`` of a ``storage`` table (a name of ``registry.STORAGES``) of
  ``capacity`` rows of ``features`` float32, built abstractly: every array but the value rows and
  the default row."""
  make = registry.storage(storage).create
  table = jax.eval_shape(
    lambda: make(capacity, key=key, value=jax.ShapeDtypeStruct((features,), jnp.float32), eviction=eviction)
  )
  rows = memory.nbytes(table.values) + memory.nbytes(table.default)
  return memory.nbytes(table) - rows, table.num_slots, jax.tree.leaves(table.values)[0].shape[0]


def storages_report(capacity: int, features: int) -> list[str]:
  """The index of each storage of :data:`INDEXED`, per entry (over the capacity) and per slot."""
  lines = [
    f"## The index by storage: tables of {capacity:,} rows of {features} float32",
    "",
    "| storage | ids | eviction | value rows / capacity | slots / capacity | index bytes per entry "
    "| index bytes per slot |",
    "|---|---|---|---|---|---|---|",
  ]
  for storage in INDEXED:
    for key_name, key in KEYS.items():
      for eviction in (None, jr.LRU()):
        index, slots, rows = index_bytes(storage, capacity, features, key, eviction)
        lines.append(
          f"| {storage} | {key_name} | {eviction or 'none'} | {rows / capacity:.3f} | {slots / capacity:.3f} "
          f"| {index / capacity:.2f} | {index / slots:.2f} |"
        )
  return [
    *lines,
    "",
    "Index: everything a table holds beyond its value rows (keys, digests or slot words, row "
    "pointers and free rows where the layout keeps them, scores, change stamps, overflow counts). "
    "The lean layout (issue 66) keeps the row at its slot: a row a slot, up to 3 % more than the "
    "capacity.",
  ]


def report(capacity: int, features: int) -> str:
  lines = [
    f"## Bytes per row: rows of {features} float32, tables of {capacity:,} rows",
    "",
    "| row optimizer | ids | eviction | bytes per row | row | optimizer state | index |",
    "|---|---|---|---|---|---|---|",
  ]
  for name, optimizer in OPTIMIZERS.items():
    for key_name, key in KEYS.items():
      for eviction in (None, jr.LRU()):
        held = parts(capacity, features, optimizer=optimizer(), key=key, eviction=eviction)
        per = {part: held[part] / capacity for part in ("rows", "optimizer", "index")}
        lines.append(
          f"| `{name}` | {key_name} | {eviction or 'none'} | {sum(held.values()) / capacity:.1f} "
          f"| {per['rows']:.1f} | {per['optimizer']:.1f} | {per['index']:.1f} |"
        )
  lines += ["", "| admission | ids | `min_count` | bytes per counted id |", "|---|---|---|---|"]
  for key_name, key in KEYS.items():
    for min_count in (2, 256):  # one-byte counts up to 255, two-byte ones from 256
      held = parts(capacity, features, optimizer=optax.sgd(0.1), key=key, min_count=min_count)
      lines.append(
        f"| `admission_capacity` ids | {key_name} | {min_count} | {held['admission'] / capacity:.1f} |"
      )
  lines += [
    "",
    "Bytes per row: `memory()`'s sum over the capacity. Index: the hash table's keys, slots, scores, "
    "change stamps and free rows; the optimizer state includes a per-row step count where the "
    "optimizer keeps one.",
    "",
    *storages_report(capacity, features),
  ]
  return "\n".join(lines) + "\n"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--capacity", type=int, default=1 << 20)
  parser.add_argument("--features", type=int, default=16)
  parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "memory.md"))
  args = parser.parse_args()
  text = report(args.capacity, args.features)
  print(text)
  Path(args.out).write_text(text)


if __name__ == "__main__":
  main()
