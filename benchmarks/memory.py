"""``python -m benchmarks.memory``: the bytes an embedding row costs, by row optimizer and key dtype.

For rows of ``--features`` float32 (16 by default), each row optimizer and
key dtype, with and without eviction: the bytes per row of a
``jr.DynamicEmbedding`` (``memory()``'s sum over its capacity, built
abstractly at ``--capacity``), split into the row, its optimizer state and
the index, and the index beyond the row's data. Admission (``min_count=2``)
adds its bytes per counted id. Nothing is timed: the figures are the arrays'
sizes, the same on every machine.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax.numpy as jnp
import optax
from flax import nnx

import jaxres as jr

OPTIMIZERS = {
  "optax.sgd": lambda: optax.sgd(0.1),
  "optax.adagrad": lambda: optax.adagrad(0.1),
  "optax.lion": lambda: optax.lion(0.1),
  "optax.adam": lambda: optax.adam(0.1),
  "jr.CatchUpAdam": lambda: jr.CatchUpAdam(0.1),
}
KEYS = {"int64": jnp.int64, "int32": jnp.int32}


def parts(capacity: int, features: int, **options) -> dict[str, int]:
  """``memory()`` of an embedding built abstractly (nothing allocated)."""
  emb = nnx.eval_shape(lambda: jr.DynamicEmbedding(capacity, features, rngs=nnx.Rngs(0), **options))
  return jr.DynamicEmbedding.memory(emb)


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
  lines += ["", "| admission (`min_count=2`) | ids | bytes per counted id |", "|---|---|---|"]
  for key_name, key in KEYS.items():
    held = parts(capacity, features, optimizer=optax.sgd(0.1), key=key, min_count=2)
    lines.append(f"| `admission_capacity` ids | {key_name} | {held['admission'] / capacity:.1f} |")
  lines += [
    "",
    "Bytes per row: `memory()`'s sum over the capacity. Index: the hash table's keys, slots, scores, "
    "change stamps and free rows; the optimizer state includes a per-row step count where the "
    "optimizer keeps one.",
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
