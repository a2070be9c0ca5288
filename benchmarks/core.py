"""Throughput of the functional core at one million int64 keys.

Workloads (int64 keys, float32 values, JAX on this machine's default device):

* insert 1M distinct keys into a fresh table, batches of 65536;
* find 1M queries (50% hits), batches of 65536;
* remove half of the keys, batches of 65536;
* a training-step pattern: insert then find a 4096-key batch on a table
  holding 1M keys (time per call).

Every update is jitted with the table donated, so it happens in place. Run
``python -m benchmarks [--keys N] [--storage open_addressing|sorted|both]``.
"""

from __future__ import annotations

import argparse
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxres as jr

BATCH = 65536
STEP_BATCH = 4096


def _distinct_keys(n: int, seed: int) -> np.ndarray:
  rng = np.random.default_rng(seed)
  keys = rng.integers(-(2**63), 2**63 - 1, size=int(n * 1.01), dtype=np.int64)
  keys = np.unique(keys)
  return rng.permutation(keys)[:n]


def _batches(keys, size):
  return [jr.keys.split64(keys[i : i + size]) for i in range(0, len(keys), size)]


@jax.jit
def _find(table, keys):
  return table.find(keys)


_insert = jax.jit(lambda table, keys, values: table.insert(keys, values), donate_argnums=0)
_remove = jax.jit(lambda table, keys: table.remove(keys), donate_argnums=0)


@jax.jit
def _step(table, keys, values):
  table = table.insert(keys, values)
  return table, table.find(keys)


_step_donated = jax.jit(_step.__wrapped__, donate_argnums=0)


def _timed(fn, repeats=3):
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    best = min(best, time.perf_counter() - start)
  return best, out


def measure(storage, num_keys: int, steps: int = 50) -> dict:
  keys = _distinct_keys(num_keys, seed=0)
  misses = _distinct_keys(num_keys, seed=1)
  queries = np.where(np.random.default_rng(2).random(num_keys) < 0.5, keys, misses)
  values = jnp.ones((BATCH,), jnp.float32)
  insert_batches, query_batches = _batches(keys, BATCH), _batches(queries, BATCH)
  # Room for the training-step workload: each step brings STEP_BATCH / 2 new ids.
  capacity = num_keys + steps * STEP_BATCH

  def fresh():
    return storage.create(capacity, key=jnp.int64, value=jnp.float32, default=0.0)

  def fill(table):
    for b in insert_batches:
      table = _insert(table, b, values[: b.shape[0]])
    return table

  fill(fresh())  # compile
  t_insert, table = _timed(lambda: fill(fresh()))
  assert int(table.size) == num_keys and int(table.dropped) == 0
  bytes_per_entry = sum(x.nbytes for x in jax.tree.leaves(table)) / capacity
  t_update, table = _timed(lambda: fill(table), repeats=1)

  found = [_find(table, b) for b in query_batches]  # compile
  t_find, _ = _timed(lambda: [_find(table, b) for b in query_batches])
  hits = sum(int((f == 1.0).sum()) for f in found)

  # Training-step pattern: every step sees half known ids and half new ones.
  half = STEP_BATCH // 2
  step_batches = [
    jr.keys.split64(np.concatenate([keys[i * half : (i + 1) * half], misses[i * half : (i + 1) * half]]))
    for i in range(steps + 1)
  ]
  step_values = jnp.full((STEP_BATCH,), 2.0, jnp.float32)
  table, _ = _step_donated(table, step_batches[-1], step_values)  # compile
  start = time.perf_counter()
  for b in step_batches[:steps]:
    table, out = _step_donated(table, b, step_values)
  jax.block_until_ready(out)
  t_step = (time.perf_counter() - start) / steps
  assert int(table.dropped) == 0

  removals = insert_batches[: len(insert_batches) // 2]
  table = _remove(table, _batches(misses[-BATCH:], BATCH)[0])  # compile (absent keys: no change)
  t_remove, table = _timed(lambda: _remove_all(table, removals), repeats=1)
  return {
    "insert (fresh)": num_keys / t_insert,
    "insert (overwrite)": num_keys / t_update,
    "find (50% hits)": num_keys / t_find,
    "remove": sum(b.shape[0] for b in removals) / t_remove,
    "step_us": t_step * 1e6,
    "hits": hits / num_keys,
    "bytes/entry": bytes_per_entry,
  }


def _remove_all(table, batches):
  for b in batches:
    table = _remove(table, b)
  return table


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description="jaxres core throughput")
  parser.add_argument("--keys", type=int, default=1 << 20)
  parser.add_argument("--storage", choices=["open_addressing", "sorted", "both"], default="open_addressing")
  args = parser.parse_args(argv)
  storages = {
    "open_addressing": [jr.OpenAddressingTable],
    "sorted": [jr.SortedTable],
    "both": [jr.OpenAddressingTable, jr.SortedTable],
  }[args.storage]
  print(f"# jaxres core, {args.keys} int64 keys -> float32, batch {BATCH}")
  print(
    f"# {platform.processor() or platform.machine()}, {jax.devices()[0].device_kind}, jax {jax.__version__}"
  )
  print(
    "| storage | insert fresh M/s | insert overwrite M/s | find M/s | remove M/s | 4096 insert+find step µs |"
  )
  print("|---|---|---|---|---|---|")
  for storage in storages:
    r = measure(storage, args.keys)
    print(
      f"| {storage.__name__} | {r['insert (fresh)'] / 1e6:.2f} | {r['insert (overwrite)'] / 1e6:.2f} | "
      f"{r['find (50% hits)'] / 1e6:.2f} | {r['remove'] / 1e6:.2f} | {r['step_us']:.0f} | "
      f"{r['bytes/entry']:.1f} |"
    )


if __name__ == "__main__":
  main()
