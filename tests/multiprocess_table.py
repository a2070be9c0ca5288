"""The table the multi-process checkpoint tests build, in their workers and in the test process alike.

int64 keys beyond 32 bits, a pytree value with a 64-bit integer leaf, LRU
scores; at step ``k`` it holds the first ``150 + 50 k`` of 300 keys.
"""

import jax
import jax.numpy as jnp
import numpy as np

import jaxres as jr

KEYS = np.arange(1, 301, dtype=np.int64) * (2**33 + 7)
VALUE = {"row": jax.ShapeDtypeStruct((2,), np.float32), "count": np.int64}


def empty_table(mesh) -> jr.ShardedTable:
  return jr.ShardedTable.create(mesh, "shard", 400, key=jnp.int64, value=VALUE, eviction=jr.LRU())


def table_at(step: int, mesh) -> jr.ShardedTable:
  n = 150 + 50 * step
  rows = np.stack([KEYS % 1000, np.full(300, step)], 1).astype(np.float32)
  return empty_table(mesh).insert(KEYS[:n], {"row": rows[:n], "count": (KEYS * 3 + step)[:n]})


def changed(table, step: int):
  """``table`` after step ``step`` of the incremental tests: 25 keys in, 5 out, 10 rows written."""
  new = KEYS[150 + 25 * (step - 1) : 150 + 25 * step]
  rows = np.stack([new % 1000, np.full(len(new), -step)], 1).astype(np.float32)
  table = table.insert(new, {"row": rows, "count": new * 5 + step})
  table = table.remove(KEYS[10 * step : 10 * step + 5])
  rewritten = KEYS[100 + step : 110 + step]
  return table.insert(rewritten, {"row": np.full((10, 2), step, np.float32), "count": rewritten - step})
