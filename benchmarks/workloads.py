"""The workloads, timed the same way for every peer on the same data.

* insert ``n`` distinct int64 keys into a fresh table, batches of 65536;
* find ``n`` queries (50% hits), batches of 65536, and in one call;
* find a 4096-key batch of queries, time per call;
* remove half of the keys, batches of 65536;
* the training-step pattern: insert then find a 4096-key batch (half known
  ids, half new) on a table holding ``n`` keys, time per call;
* per-call cost at a fixed 4096-key batch on tables of growing capacity (new
  batches, and one batch again and again).

Every timed loop runs once untimed first (compilation, tracing, warm caches),
then ``repeats`` timed runs: each metric is their median, with the range of the
runs kept in ``result["spread"]``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

BATCH = 65536
STEP_BATCH = 4096
STEPS = 50
RUNS = 3  # timed runs of every workload: their median is reported, with their range
_RESERVED = np.array([-(2**63), -(2**63) + 1], np.int64)  # TF DenseHashTable's empty/deleted keys


def distinct_keys(n: int, seed: int) -> np.ndarray:
  """``n`` distinct random int64 keys in random order (never a reserved key)."""
  rng = np.random.default_rng(seed)
  keys = np.unique(rng.integers(-(2**63), 2**63 - 1, size=int(n * 1.01) + 16, dtype=np.int64))
  keys = keys[~np.isin(keys, _RESERVED)]
  return rng.permutation(keys)[:n]


@dataclasses.dataclass
class Data:
  """Keys, misses and queries for ``n`` entries with rows of ``width`` floats."""

  n: int
  width: int

  def __post_init__(self):
    both = distinct_keys(2 * self.n + (RUNS + 1) * STEPS * STEP_BATCH // 2, seed=0)
    self.keys, self.misses = both[: self.n], both[self.n : 2 * self.n]
    self.fresh = both[2 * self.n :]  # new ids of the step workload, for the warm-up and each run
    hit = np.random.default_rng(1).random(self.n) < 0.5
    self.queries = np.where(hit, self.keys, self.misses)
    shape = (self.n, self.width) if self.width > 1 else (self.n,)
    self.values = np.random.default_rng(2).random(shape, dtype=np.float32)

  @property
  def capacity(self) -> int:
    """Room for every key, the step workload's new ids included."""
    return self.n + (RUNS + 1) * STEPS * STEP_BATCH // 2


def _times(run, repeats: int) -> list[float]:
  """Seconds of ``repeats`` timed runs, after one untimed run (compile, trace, warm up)."""
  run()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    run()
    times.append(time.perf_counter() - start)
  return times


def _record(result: dict, metric: str, values: list[float]) -> None:
  """The median of the runs as the metric, their range as its spread."""
  result[metric] = float(np.median(values))
  result.setdefault("spread", {})[metric] = (min(values), max(values))


def _rss() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def resident_bytes_per_entry(name: str, n: int, width: int) -> float:
  """Growth of a fresh process's resident memory per entry while a peer is built.

  Run in a subprocess (``python -m benchmarks.workloads NAME N WIDTH``): in the
  benchmark's own process, freed memory is reused and the growth hides.
  """
  command = [sys.executable, "-m", "benchmarks.workloads", name, str(n), str(width)]
  out = subprocess.run(command, capture_output=True, text=True, check=True, cwd=Path(__file__).parents[1])
  return float(out.stdout.split()[-1])


def _measure_memory(name: str, n: int, width: int) -> None:
  from benchmarks import peers

  peer = peers.make(name, width)
  data = Data(n, width)
  keys, values, capacity = data.keys, data.values, data.capacity
  del data
  gc.collect()
  ctypes.CDLL("libc.so.6").malloc_trim(0)  # give freed memory back, so that growth shows
  before = _rss()
  peer.build(capacity, keys, values, BATCH)
  print((_rss() - before) / n)


def measure(peer, data: Data, repeats: int = RUNS) -> dict[str, float]:
  """Throughputs (keys/s), the step's time per call (µs) and bytes per entry."""
  batches = [
    peer.batch(data.keys[i : i + BATCH], data.values[i : i + BATCH]) for i in range(0, data.n, BATCH)
  ]
  queries = [peer.batch(data.queries[i : i + BATCH], data.values[:1])[0] for i in range(0, data.n, BATCH)]
  result: dict[str, float] = {}

  if "insert" in peer.supports:

    def fill():
      peer.fresh(data.capacity)
      for keys, values in batches:
        peer.insert(keys, values)
      peer.wait()

    _record(result, "insert", [data.n / t for t in _times(fill, repeats)])
  result["bytes/entry"] = None
  if hasattr(peer, "table_bytes"):  # a table created for its entries, as TF's grow to theirs
    peer.build(data.n, data.keys, data.values, BATCH)
    result["bytes/entry"] = peer.table_bytes() / data.n
  peer.build(data.capacity, data.keys, data.values, BATCH)

  def find_all():
    for keys in queries:
      out = peer.find(keys)
    peer.wait(out)

  _record(result, "find", [data.n / t for t in _times(find_all, repeats)])
  everything = peer.batch(data.queries, data.values[:1])[0]

  def find_once():
    peer.wait(peer.find(everything))

  _record(result, "find_1call", [data.n / t for t in _times(find_once, repeats)])
  small = [
    peer.batch(data.queries[i : i + STEP_BATCH], data.values[:1])[0]
    for i in range(0, STEPS * STEP_BATCH, STEP_BATCH)
  ]

  def find_small():
    for keys in small:
      out = peer.find(keys)
    peer.wait(out)

  _record(result, "find_us", [t / len(small) * 1e6 for t in _times(find_small, repeats)])

  if "step" in peer.supports:
    half = STEP_BATCH // 2
    known = np.arange(STEPS * half) % data.n  # ids already in the table

    def step_batches(run: int):  # each run (and the warm-up, run -1) brings its own new ids
      fresh = data.fresh[(run + 1) * STEPS * half :]
      return [
        peer.batch(
          np.concatenate([data.keys[known[i * half : (i + 1) * half]], fresh[i * half : (i + 1) * half]]),
          data.values[:STEP_BATCH],
        )
        for i in range(STEPS)
      ]

    peer.wait(peer.step(*step_batches(-1)[0]))  # untimed: compile or trace
    step_times = []
    for run in range(repeats):
      steps = step_batches(run)
      start = time.perf_counter()
      for keys, values in steps:
        out = peer.step(keys, values)
      peer.wait(out)
      step_times.append((time.perf_counter() - start) / STEPS * 1e6)
    _record(result, "step_us", step_times)

  if "remove" in peer.supports:
    half_keys = data.keys[: data.n // 2]
    removals = [
      peer.batch(half_keys[i : i + BATCH], data.values[:1])[0] for i in range(0, len(half_keys), BATCH)
    ]
    remove_times = []
    for run in range(repeats):
      if run:  # untimed: the keys back
        peer.build(data.capacity, data.keys, data.values, BATCH)
      peer.remove(peer.batch(data.misses[:BATCH], data.values[:1])[0])  # untimed: absent keys, no change
      peer.wait()
      start = time.perf_counter()
      for keys in removals:
        peer.remove(keys)
      peer.wait()
      remove_times.append(time.perf_counter() - start)
    _record(result, "remove", [len(half_keys) / t for t in remove_times])
  return result


def per_call(peer, capacity: int, calls: int = 50) -> dict[str, float]:
  """µs per call of a 4096-key find and insert+find on a table half full at ``capacity``.

  Each call takes a new batch, except in ``find_again_us``, where one batch is
  found over and over: the same work with its lines in cache, which separates
  the cache misses of a larger table from its page walks and its work.
  """
  n = capacity // 2
  keys = distinct_keys(n + calls * STEP_BATCH, seed=3)
  values = np.ones(n + calls * STEP_BATCH, np.float32)
  peer.build(capacity + calls * STEP_BATCH, keys[:n], values[:n], BATCH)
  rng = np.random.default_rng(4)
  known = [peer.batch(rng.choice(keys[:n], STEP_BATCH), values[:STEP_BATCH])[0] for _ in range(calls)]
  result = {}

  def finds():
    for k in known:
      out = peer.find(k)
    peer.wait(out)

  result["find_us"] = float(np.median(_times(finds, RUNS))) / calls * 1e6

  def finds_again():  # one batch, its lines in cache: the misses of new batches left out
    for _ in range(calls):
      out = peer.find(known[0])
    peer.wait(out)

  result["find_again_us"] = float(np.median(_times(finds_again, RUNS))) / calls * 1e6
  if "step" in peer.supports:
    half = STEP_BATCH // 2
    new = keys[n:]
    steps = [
      peer.batch(
        np.concatenate([keys[i * half : (i + 1) * half], new[i * half : (i + 1) * half]]), values[:STEP_BATCH]
      )
      for i in range(calls)
    ]
    out = peer.step(*steps[0])
    peer.wait(out)
    start = time.perf_counter()
    for k, v in steps[1:]:
      out = peer.step(k, v)
    peer.wait(out)
    result["step_us"] = (time.perf_counter() - start) / (calls - 1) * 1e6
  return result


if __name__ == "__main__":
  _measure_memory(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
