"""``python -m benchmarks.eviction``: eviction quality and cost, measured side by side.

* **LRU quality**: Zipf(a=1.1) ids over 10^6 distinct int64 values, 2*10^6
  accesses through jitted ``find_or_insert`` in batches of 4096, capacity
  2^16: the hit ratio against an exact LRU cache of the same capacity fed the
  same stream one key at a time (goal: within 0.005).
* **HierarchicalKV's eviction cases**, on a table of 2^17 entries with
  caller-given scores: its "customized correct rate" (12 rounds of as many
  new keys as the table holds, rising scores: the share of the table holding
  the last round; HKV's bar 0.964) and its dual-bucket "eviction quality at
  full load" (5 such batches with random scores: the share of the table
  holding the top keys by score; HKV's bar 0.995), by default (windows per
  call: 32 buckets for these batches of a whole capacity, HKV's 2 x 128
  candidates) and with ``eviction_window`` fixed at 1, 4 and 32.
* **LFU quality**: the same stream into an LFU table: the share of the 1,000
  most frequent ids present at the end (goal: >= 0.95).
* **Cost**: ``find_or_insert`` of 4096 keys, half of them new, on a full LRU
  table, against the same call on a half-full table without eviction, in the
  same run (goal: <= 1.5x), and the bytes the scores take per slot (goal: <= 4).
* **Sharded**: the quality workloads on a ``ShardedTable`` over 8 (fake CPU)
  devices, each shard evicting among its own entries.

Options: ``--scale`` (1.0: the sizes above; smaller for a quick run), ``--calls``
(timed calls per run), ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before any backend starts

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxres as jr  # noqa: E402

BATCH = 4096
_SCRAMBLE = np.uint64(0x9E3779B97F4A7C15)


def zipf_stream(rng: np.random.Generator, accesses: int, distinct: int, a: float = 1.1) -> np.ndarray:
  """``int64[accesses]``: Zipf(a) ranks over ``distinct`` values, scrambled over 64 bits."""
  weights = np.arange(1, distinct + 1, dtype=np.float64) ** -a
  cdf = np.cumsum(weights) / weights.sum()
  ranks = np.searchsorted(cdf, rng.random(accesses), side="right").astype(np.uint64)
  return ((ranks + np.uint64(1)) * _SCRAMBLE).view(np.int64)


def exact_lru_hits(stream: np.ndarray, capacity: int) -> int:
  """Hits of an exact LRU cache fed the stream one key at a time."""
  cache, hits = collections.OrderedDict(), 0
  for key in stream.tolist():
    if key in cache:
      hits += 1
      cache.move_to_end(key)
    else:
      cache[key] = None
      if len(cache) > capacity:
        cache.popitem(last=False)
  return hits


def table_hits(table, stream: np.ndarray) -> tuple[int, object]:
  """Hits of ``find_or_insert`` in batches: a key present before the call, or earlier in its batch."""

  @jax.jit
  def step(table, pairs):
    present = table.contains(pairs)
    table, _ = table.find_or_insert(pairs, jnp.zeros(pairs.shape[:1], jnp.int32))
    return table, present

  hits = 0
  for start in range(0, stream.size - BATCH + 1, BATCH):
    keys = stream[start : start + BATCH]
    table, present = step(table, jr.keys.split64(keys))
    first = np.zeros(BATCH, bool)
    first[np.unique(keys, return_index=True)[1]] = True
    hits += int(np.sum(np.asarray(present) | ~first))
  return hits, table


def create(policy, capacity: int, devices: int = 1):
  if devices == 1:
    return jr.OpenAddressingTable.create(
      capacity, key=jnp.int64, value=jnp.int32, default=-1, eviction=policy
    )
  mesh = jax.make_mesh((devices,), ("shard",), devices=jax.devices()[:devices])
  return jr.ShardedTable.create(
    mesh, "shard", capacity, key=jnp.int64, value=jnp.int32, default=-1, eviction=policy
  )


def quality(stream: np.ndarray, capacity: int, devices: int = 1) -> dict:
  used = stream[: stream.size // BATCH * BATCH]
  lru_hits, _ = table_hits(create(jr.LRU(), capacity, devices), used)
  _, lfu = table_hits(create(jr.LFU(), capacity, devices), used)
  counts = collections.Counter(used.tolist())
  top = np.array([key for key, _ in counts.most_common(1000)], np.int64)
  return {
    "lru_hit": lru_hits / used.size,
    "lfu_top": float(np.mean(np.asarray(lfu.contains(top)))),
  }


WINDOWS = (None, 1, 4, 32)  # eviction_window: the default (per call), one bucket, HKV's bar, HKV's geometry


def hkv_cases(capacity: int) -> dict:
  """HierarchicalKV's two eviction-quality cases at each of ``WINDOWS``:
  ``{("correct_rate" or "full_load", window): share}``."""

  @jax.jit
  def insert(table, pairs, scores):
    return table.insert(pairs, jnp.zeros(pairs.shape[:1], jnp.int32), scores=scores)

  def live(table):
    keys, _, valid = table.export()
    return np.asarray(keys)[np.asarray(valid)]

  def create(**options):
    return jr.OpenAddressingTable.create(
      capacity, key=jnp.int64, value=jnp.int32, eviction=jr.CustomScore(), **options
    )

  figures = {}
  rng = np.random.default_rng(0)
  scores = rng.integers(1, 2**32, 5 * capacity, dtype=np.uint64).astype(np.uint32)
  distinct = rng.permutation(5 * capacity).astype(np.int64) * 7919 - 2**40
  best = distinct[np.argsort(scores, kind="stable")[::-1][:capacity]]
  for window in WINDOWS:
    options = {} if window is None else {"eviction_window": window}
    table = create(**options)
    for r in range(12):  # rounds of new keys with rising scores: score = key
      keys = np.random.default_rng(r).permutation(np.arange(r * capacity, (r + 1) * capacity, dtype=np.int64))
      table = insert(table, jr.keys.split64(keys), keys.astype(np.uint32))
    figures["correct_rate", window] = float(np.mean(live(table) >= 11 * capacity))
    table = create(**options)
    for b in range(5):  # batches of new keys with random scores
      part = slice(b * capacity, (b + 1) * capacity)
      table = insert(table, jr.keys.split64(distinct[part]), scores[part])
    figures["full_load", window] = np.intersect1d(live(table), best).size / capacity
  return figures


def cost(capacity: int, calls: int, repeats: int = 3) -> dict:
  """Median ``find_or_insert`` time of 4096 keys, half new: full LRU table vs half-full plain table."""
  rng = np.random.default_rng(7)
  universe = rng.permutation(np.arange(capacity + calls * BATCH, dtype=np.int64) * 2654435761 + 1)
  stored, fresh = universe[:capacity], universe[capacity:]

  def batches(present_pool):
    out = []
    for i in range(calls):
      keys = np.concatenate(
        [rng.choice(present_pool, BATCH // 2), fresh[i * BATCH // 2 : (i + 1) * BATCH // 2]]
      )
      out.append(jr.keys.split64(rng.permutation(keys)))
    return out

  @jax.jit
  def fill(table, pairs):
    return table.insert(pairs, jnp.zeros(pairs.shape[:1], jnp.int32))

  step = jax.jit(lambda t, k: t.find_or_insert(k, jnp.zeros(k.shape[:1], jnp.int32))[0], donate_argnums=0)
  times = {"evicting": [], "plain": []}
  for _ in range(repeats):
    for name, policy, count in (("evicting", jr.LRU(), capacity), ("plain", None, capacity // 2)):
      table = jr.OpenAddressingTable.create(capacity, key=jnp.int64, value=jnp.int32, eviction=policy)
      for start in range(0, count, 1 << 16):
        table = fill(table, jr.keys.split64(stored[start : min(count, start + (1 << 16))]))
      work = batches(stored[:count])
      table = step(table, work[0])  # compile
      jax.block_until_ready(table)
      elapsed = []
      for pairs in work[1:]:
        begin = time.perf_counter()
        table = jax.block_until_ready(step(table, pairs))
        elapsed.append(time.perf_counter() - begin)
      times[name].append(statistics.median(elapsed))
      if policy is not None:
        assert int(table.size) == capacity and int(table.evictions) > 0
        bytes_per_slot = (table.slot_scores.nbytes + table.bucket_floors.nbytes) / table.num_slots
  evicting, plain = statistics.median(times["evicting"]), statistics.median(times["plain"])
  return {
    "evicting_us": evicting * 1e6,
    "plain_us": plain * 1e6,
    "ratio": evicting / plain,
    "spread": (min(times["evicting"]) * 1e6, max(times["evicting"]) * 1e6),
    "score_bytes": bytes_per_slot,
  }


def report(scale: float, calls: int = 25) -> str:
  accesses, distinct, capacity = (
    int(2_000_000 * scale),
    int(1_000_000 * scale),
    max(BATCH, int((1 << 16) * scale)),
  )
  stream = zipf_stream(np.random.default_rng(0), accesses, distinct)
  exact = exact_lru_hits(stream[: stream.size // BATCH * BATCH], capacity) / (stream.size // BATCH * BATCH)
  one, eight = quality(stream, capacity), quality(stream, capacity, devices=8)
  costs = cost(max(1 << 12, int((1 << 20) * scale)), calls=calls)
  hkv = hkv_cases(max(1 << 12, int((1 << 17) * scale)))

  def met(ok: bool) -> str:
    return "yes" if ok else "**no**"

  cost_size = max(1 << 12, int((1 << 20) * scale))
  title = f"## Eviction: {accesses:,} Zipf(1.1) accesses over {distinct:,} ids, capacity {capacity:,}"
  timed = f"{costs['evicting_us']:,.0f} us (runs {costs['spread'][0]:,.0f}-{costs['spread'][1]:,.0f})"
  rows = [
    (
      "LRU hit ratio",
      f"{one['lru_hit']:.4f}",
      f"exact LRU {exact:.4f}",
      "within 0.005",
      abs(one["lru_hit"] - exact) <= 0.005,
    ),
    ("LFU: top-1,000 ids kept", f"{one['lfu_top']:.3f}", "", ">= 0.95", one["lfu_top"] >= 0.95),
    (
      "LRU hit ratio, 8 shards",
      f"{eight['lru_hit']:.4f}",
      f"exact LRU {exact:.4f}",
      "within 0.005 (each shard evicts among its own)",
      abs(eight["lru_hit"] - exact) <= 0.005,
    ),
    ("LFU: top-1,000 kept, 8 shards", f"{eight['lfu_top']:.3f}", "", ">= 0.95", eight["lfu_top"] >= 0.95),
    (
      "find_or_insert, 4096 keys (half new), full LRU table",
      timed,
      f"half-full, no eviction: {costs['plain_us']:,.0f} us",
      f"<= 1.5x ({costs['ratio']:.2f}x)",
      costs["ratio"] <= 1.5,
    ),
    (
      "bytes of scores per slot, floors included (default window)",
      f"{costs['score_bytes']:.0f}",
      "",
      "<= 4",
      costs["score_bytes"] <= 4,
    ),
    (
      "HKV customized correct rate (last round kept), default / eviction_window=1 / 4 / 32",
      " / ".join(f"{hkv['correct_rate', w]:.4f}" for w in WINDOWS),
      "HKV 0.964",
      ">= 0.964 (default)",
      hkv["correct_rate", None] >= 0.964,
    ),
    (
      "HKV eviction quality at full load (top keys kept), default / eviction_window=1 / 4 / 32",
      " / ".join(f"{hkv['full_load', w]:.4f}" for w in WINDOWS),
      "HKV 0.995 (dual buckets)",
      ">= 0.995 (default)",
      hkv["full_load", None] >= 0.995,
    ),
  ]
  lines = [
    f"{title}, batches of {BATCH}",
    "",
    "| measure | jaxres | reference | goal | met |",
    "|---|---|---|---|---|",
  ]
  lines += [f"| {name} | {got} | {ref} | {goal} | {met(ok)} |" for name, got, ref, goal, ok in rows]
  lines += [
    "",
    f"Cost measured on tables of {cost_size:,} entries: medians of 3 runs of {calls - 1} calls each "
    "(the first call of a run compiles), tables donated. HKV cases on tables of "
    f"{max(1 << 12, int((1 << 17) * scale)):,} entries, keys int64, scores given.",
  ]
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--scale", type=float, default=1.0)
  parser.add_argument("--calls", type=int, default=25)
  parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "eviction.md")
  args = parser.parse_args(argv)
  text = report(args.scale, args.calls)
  print(text)
  if args.scale == 1.0:
    args.out.write_text(text + "\n")


if __name__ == "__main__":
  main()
