"""``python -m benchmarks.device``: one command for an accelerator (GPU, TPU), or the CPU where none is.

1. **Checks** on the default device, against NumPy (a ``dict`` of the
   entries): ``find``, ``insert``, ``find_or_insert``, ``remove`` and the
   evicting calls of an LRU table (every reported victim was an entry, every
   entry kept has its value), and a ``jr.DynamicEmbedding`` SGD step (each
   row moves by its summed gradient). A failed check stops the run.
2. **Throughput**, in G keys per second (median of the timed calls):
   ``find``, ``insert`` and ``find_or_insert`` of 2^20-key batches on tables
   of 2^24 and 2^26 entries at load factors 0.5 and 0.9 (entries held /
   capacity), rows of 8 and 64 float32 (HierarchicalKV's benchmark: A100
   find 2.47 G keys/s, insert_or_assign 1.09 G at dim 8, load 0.5);
   ``find_or_insert`` of new keys on a full LRU table (every key evicts);
   the training step of a ``jr.DynamicEmbedding`` (LRU, Adam) and of the
   26-feature DLRM-shaped collection of :mod:`benchmarks.model_peers`, at
   2^20 and 2^24 rows.

``--scale`` shrinks every size by that factor (the test suite runs it at
1/4096 on the CPU); the full sizes take about 8 minutes and 40 GiB of an H200.
Prints a Markdown report; ``--out`` writes it too.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ENTRIES = (1 << 24, 1 << 26)
BATCH = 1 << 20
LOADS = (0.5, 0.9)
DIMS = (8, 64)
ROWS = (1 << 20, 1 << 24)
CALLS = 10
HKV = "HierarchicalKV (A100, dim 8, load 0.5): find 2.47, insert_or_assign 1.09 G keys/s; H100 NVL find 6.9"


def _int64(rng, n: int) -> np.ndarray:
  return rng.integers(-(2**62), 2**62, n)


def _median_s(call, calls: int) -> float:
  jax.block_until_ready(call(-1))  # compiled and warm
  times = []
  for i in range(calls):
    start = time.perf_counter()
    jax.block_until_ready(call(i))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def check_tables(seed: int = 0) -> list[str]:
  """Random calls on small tables, each result compared with a ``dict``: the checks passed."""
  import jaxres as jr

  rng = np.random.default_rng(seed)
  value = jax.ShapeDtypeStruct((3,), jnp.float32)
  table = jr.OpenAddressingTable.create(1 << 12, key=jnp.int64, value=value, default=-1.0)
  oracle: dict[int, np.ndarray] = {}
  pool = _int64(rng, 6000)
  for _ in range(12):
    keys = rng.choice(pool, 1024)
    values = rng.normal(size=(1024, 3)).astype(np.float32)
    op = rng.choice(["insert", "find_or_insert", "remove"])
    if op == "insert":
      table = table.insert(jr.keys.split64(keys), values)
      for k, v in zip(keys, values):
        if k in oracle or len(oracle) < table.capacity:
          oracle[int(k)] = v
    elif op == "find_or_insert":
      table, got = table.find_or_insert(jr.keys.split64(keys), values)
      expected = []
      for k, v in zip(keys, values):
        if int(k) not in oracle and len(oracle) < table.capacity:
          oracle[int(k)] = v
        expected.append(oracle.get(int(k), np.full(3, -1.0, np.float32)))
      _same("find_or_insert", got, np.stack(expected))
    else:
      table = table.remove(jr.keys.split64(keys))
      for k in keys:
        oracle.pop(int(k), None)
    probe = rng.choice(pool, 2048)
    expected = np.stack([oracle.get(int(k), np.full(3, -1.0, np.float32)) for k in probe])
    _same(f"find after {op}", table.find(jr.keys.split64(probe)), expected)
    if int(table.size) != len(oracle):
      raise AssertionError(f"size after {op}: {int(table.size)}, expected {len(oracle)}")
  return ["find", "insert", "find_or_insert", "remove", *check_evicting(rng)]


def check_evicting(rng) -> list[str]:
  """An LRU table filled past its capacity: entries kept are exact, victims were entries."""
  import jaxres as jr

  table = jr.OpenAddressingTable.create(1 << 10, key=jnp.int64, value=jnp.float32, eviction=jr.LRU())
  oracle: dict[int, float] = {}
  for _ in range(8):
    keys = np.unique(_int64(rng, 512))
    values = rng.normal(size=len(keys)).astype(np.float32)
    table, victims = table.insert_and_evict(jr.keys.split64(keys), values)
    oracle.update(zip(keys.tolist(), values.tolist()))
    valid = np.asarray(victims.valid)
    gone_keys = np.asarray(victims.keys)  # exact: int64, or (high, low) words with x64 off
    gone_keys = (jr.keys.join64(gone_keys) if gone_keys.ndim == 2 else gone_keys)[valid]
    for k, v in zip(gone_keys.tolist(), np.asarray(victims.values)[valid].tolist()):
      if k not in oracle or oracle[k] != v:
        raise AssertionError(f"insert_and_evict reported {k}: {v}, not an entry of the table")
      del oracle[k]
    if int(table.size) != len(oracle) or len(oracle) > table.capacity:
      raise AssertionError(f"evicting: {int(table.size)} entries, expected {len(oracle)}")
    kept = np.array(list(oracle), np.int64)
    _same("find after insert_and_evict", table.find(jr.keys.split64(kept)), np.array(list(oracle.values())))
  return ["insert_and_evict"]


def check_embedding() -> list[str]:
  """An SGD step moves each row of a ``DynamicEmbedding`` by ``-lr`` times its ids' summed gradients."""
  import optax
  from flax import nnx

  import jaxres as jr

  emb = jr.DynamicEmbedding(1 << 10, 4, optimizer=optax.sgd(0.5), rngs=nnx.Rngs(0))
  ids = np.array([5, 9, 5, 7, 5], np.int64)
  before = np.asarray(emb(ids))
  grads = np.arange(20, dtype=np.float32).reshape(5, 4) / 10
  emb.apply_gradients(ids, grads)
  summed = {k: grads[ids == k].sum(axis=0) for k in np.unique(ids)}
  expected = np.stack([before[i] - 0.5 * summed[k] for i, k in enumerate(ids)])
  _same("embedding step", emb(ids), expected)
  return ["embedding step"]


def _same(what: str, got, expected) -> None:
  got = np.asarray(got)
  if got.shape != expected.shape or not np.allclose(got, expected, rtol=1e-6, atol=1e-6):
    raise AssertionError(f"{what}: results differ from NumPy's")


def throughput(entries: int, load: float, dim: int, batch: int, calls: int) -> dict:
  """G keys/s of find, insert and find_or_insert on a table of ``entries`` capacity at ``load``."""
  import jaxres as jr

  rng = np.random.default_rng(entries + dim)
  value = jax.ShapeDtypeStruct((dim,), jnp.float32)
  table = jr.OpenAddressingTable.create(entries, key=jnp.int64, value=value)
  live = _int64(rng, int(entries * load))
  rows = jnp.ones((batch, dim), jnp.float32)
  insert = jax.jit(lambda t, k, v: t.insert(k, v), donate_argnums=0)
  for i in range(0, len(live), batch):
    part = live[i : i + batch]
    table = insert(table, jr.keys.split64(np.resize(part, batch)), rows)
  holder = [table]
  known = [jr.keys.split64(rng.choice(live, batch)) for _ in range(calls + 1)]
  find = jax.jit(lambda t, k: t.find(k))
  assign = jax.jit(lambda t, k: t.insert(k, rows), donate_argnums=0)
  find_or_insert = jax.jit(lambda t, k: t.find_or_insert(k, rows), donate_argnums=0)

  def keep(result):
    holder[0] = result[0] if isinstance(result, tuple) else result
    return holder[0].size

  out = {
    "find": _median_s(lambda i: find(holder[0], known[i]), calls),
    "insert": _median_s(lambda i: keep(assign(holder[0], known[i])), calls),
    "find_or_insert": _median_s(lambda i: keep(find_or_insert(holder[0], known[i])), calls),
  }
  return {name: batch / s / 1e9 for name, s in out.items()}


def evicting(entries: int, batch: int, calls: int) -> float:
  """G keys/s of ``find_or_insert`` of new keys on a full LRU table (each key evicts)."""
  import jaxres as jr

  rng = np.random.default_rng(1)
  table = jr.OpenAddressingTable.create(
    entries, key=jnp.int64, value=jax.ShapeDtypeStruct((8,), jnp.float32), eviction=jr.LRU()
  )
  rows = jnp.ones((batch, 8), jnp.float32)
  step = jax.jit(lambda t, k: t.find_or_insert(k, rows), donate_argnums=0)
  for _ in range(-(-entries // batch)):
    table, _ = step(table, jr.keys.split64(_int64(rng, batch)))
  holder = [table]
  new = [jr.keys.split64(_int64(rng, batch)) for _ in range(calls + 1)]

  def call(i):
    holder[0], out = step(holder[0], new[i])
    return out

  return batch / _median_s(call, calls) / 1e9


def embedding_step(rows: int, batch: int, calls: int) -> float:
  """Milliseconds per training step of a ``jr.DynamicEmbedding`` of ``rows`` (LRU, Adam, 32 wide)."""
  from benchmarks import xla_path

  return xla_path.embedding_step(rows, calls, batch) / 1e3


def collection_step(rows: int, batch: int, calls: int) -> float:
  """Milliseconds per step of :mod:`benchmarks.model_peers`'s 26-feature model (tables up to ``rows``)."""
  from benchmarks import model_peers

  sizes = model_peers.Sizes(batch=batch, rows=rows)
  return model_peers.measure("jaxres", 3, calls, 0, sizes)["us_per_step"] / 1e3


def run(scale: float, calls: int) -> str:
  device = jax.devices()[0]
  lines = [f"# jaxres on {device.device_kind} ({device.platform}), JAX {jax.__version__}", ""]
  passed = check_tables() + check_embedding()
  lines += [f"Checked against NumPy on the device: {', '.join(passed)}.", ""]
  size = lambda n: max(1 << 8, int(n * scale))
  batch = size(BATCH)
  lines += [
    f"## G keys/s, batches of {batch:,} keys",
    "",
    "| entries | load | dim | find | insert | find_or_insert |",
    "|---|---|---|---|---|---|",
  ]
  for entries in map(size, ENTRIES):
    for load in LOADS:
      for dim in DIMS:
        g = throughput(entries, load, dim, batch, calls)
        lines.append(
          f"| {entries:,} | {load} | {dim} | "
          + " | ".join(f"{g[name]:.3f}" for name in ("find", "insert", "find_or_insert"))
          + " |"
        )
  lines += [
    "",
    HKV,
    "",
    "## Evicting find_or_insert on a full LRU table (dim 8), G keys/s",
    "",
    "| entries | G keys/s |",
    "|---|---|",
  ]
  lines += [f"| {e:,} | {evicting(e, batch, calls):.3f} |" for e in map(size, ENTRIES)]
  step_batch = max(256, int(4096 * min(1.0, scale * 64)))
  lines += [
    "",
    f"## Training steps of {step_batch} examples, ms per step",
    "",
    "| rows | DynamicEmbedding | 26-feature collection |",
    "|---|---|---|",
  ]
  # below full scale (a check of the harness) the first size alone: the 26-feature model compiles per size
  for rows in map(size, ROWS if scale >= 1 else ROWS[:1]):
    lines.append(
      f"| {rows:,} | {embedding_step(rows, step_batch, calls):.2f} "
      f"| {collection_step(rows, step_batch, calls):.2f} |"
    )
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--scale", type=float, default=1.0, help="every size times this (1: the full sizes)")
  parser.add_argument("--calls", type=int, default=CALLS, help="timed calls per figure")
  parser.add_argument("--out", type=Path)
  args = parser.parse_args(argv)
  text = run(args.scale, args.calls)
  print(text)
  if args.out is not None:
    args.out.write_text(text + "\n")


if __name__ == "__main__":
  sys.exit(main())
