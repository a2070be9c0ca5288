"""End-to-end demo of the functional table core on synthetic data.

Run ``python -m jaxres.demo``. It streams Zipf-distributed 64-bit ids (as a
recommender's feature ids would arrive) through both storages inside a jitted
step, assigns each new id a row with ``find_or_insert``, accumulates counts
with ``insert_or_apply``, checks every result against a Python dict, and
prints what it measured.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxres as jr

_ROW = jax.ShapeDtypeStruct((), jnp.int32)


def zipf_ids(rng: np.random.Generator, n: int, vocab: int) -> np.ndarray:
  """Zipf-distributed ids scattered over the int64 range (exact 64-bit keys)."""
  ranks = np.minimum(rng.zipf(1.2, size=n), vocab)
  return (ranks.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)).view(np.int64)


@jax.jit
def assign_and_count(rows: jr.Table, counts: jr.Table, ids):
  """One step: a candidate row per new id (its batch position) and a count per id."""
  candidates = rows.size + jnp.arange(ids.shape[0], dtype=jnp.int32)
  rows, assigned = rows.find_or_insert(ids, candidates)
  counts = counts.insert_or_apply(ids, jnp.ones(ids.shape[0], jnp.int32), jnp.add)
  return rows, counts, assigned


def run(steps: int, batch: int, capacity: int, seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  results = {}
  for storage in (jr.OpenAddressingTable, jr.SortedTable):
    rows = storage.create(capacity, key=jnp.int64, value=_ROW, default=-1)
    counts = storage.create(capacity, key=jnp.int64, value=jnp.int32, default=0)
    oracle_rows: dict[int, int] = {}
    oracle_counts: dict[int, int] = {}
    elapsed = 0.0
    for step in range(steps):
      ids = zipf_ids(rng, batch, vocab=4 * capacity)
      pairs = jr.keys.split64(ids)  # 64-bit ids inside jit with x64 off
      start = time.perf_counter()
      rows, counts, assigned = jax.block_until_ready(assign_and_count(rows, counts, pairs))
      if step:  # the first step includes compilation
        elapsed += time.perf_counter() - start
      expected, size_before = [], len(oracle_rows)
      for position, key in enumerate(ids.tolist()):
        if key not in oracle_rows and len(oracle_rows) < capacity:
          oracle_rows[key] = size_before + position
        expected.append(oracle_rows.get(key, -1))
        oracle_counts[key] = oracle_counts.get(key, 0) + 1
      np.testing.assert_array_equal(np.asarray(assigned), expected)
    keys, values, valid = counts.export()
    exported = dict(zip(keys[np.asarray(valid)].tolist(), np.asarray(values)[np.asarray(valid)].tolist()))
    fitting = {k: v for k, v in oracle_counts.items() if k in oracle_rows}
    assert exported == fitting, "export differs from the dict oracle"
    top = sorted(exported.items(), key=lambda kv: -kv[1])[:3]
    results[storage.__name__] = {
      "ids/s": (steps - 1) * batch / max(elapsed, 1e-9),
      "distinct": int(rows.size),
      "dropped": int(rows.dropped),
      "top": top,
    }
  return results


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=50, help="batches to stream (default 50)")
  parser.add_argument("--batch", type=int, default=4096, help="ids per batch (default 4096)")
  parser.add_argument("--capacity", type=int, default=1 << 16, help="table capacity (default 65536)")
  args = parser.parse_args(argv)
  print(f"jaxres {jr.__version__} on {jax.devices()[0].platform}: {args.steps} steps x {args.batch} Zipf ids")
  for name, r in run(args.steps, args.batch, args.capacity).items():
    print(
      f"  {name:20s} {r['ids/s'] / 1e6:7.2f} M ids/s  distinct={r['distinct']:6d}  "
      f"dropped={r['dropped']}  hottest={[count for _, count in r['top']]}"
    )
  print("every assigned row and every count matched a Python dict oracle")


if __name__ == "__main__":
  main()
