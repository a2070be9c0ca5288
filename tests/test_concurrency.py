"""Concurrency: Python threads sharing one table, and racing the ResourceManager.

Each thread owns a disjoint key range, so at every moment the table's
entries in that range must equal the thread's own dict, and the final state
is known exactly.
"""

import collections
import threading

import numpy as np
import pytest
from oracle import stateful_step

import jaxres as jr

THREADS = 8
OPERATIONS = 10_000  # in all, across the threads
KEYS_PER_THREAD = 400


def _run_threads(worker) -> list:
  """Runs ``worker(t)`` on THREADS threads released together; returns their exceptions."""
  barrier = threading.Barrier(THREADS)
  errors = []

  def run(t):
    try:
      barrier.wait()
      worker(t)
    except BaseException as err:  # reported by the test
      errors.append(err)

  threads = [threading.Thread(target=run, args=(t,)) for t in range(THREADS)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  return errors


@pytest.mark.slow
def test_eight_threads_mix_every_operation_on_one_table():
  # It grows twice meanwhile (1024 -> 4096); batches of 1-8 keys share one compiled shape.
  table = jr.MutableHashTable(np.int64, np.int64, default_value=-1, initial_capacity=1024)
  models = [{} for _ in range(THREADS)]
  counts = [dict.fromkeys(["insert", "remove", "find", "lookup", "export"], 0) for _ in range(THREADS)]

  def worker(t):
    rng = np.random.default_rng(t)
    low = t * 2**40 - 2**42  # disjoint ranges, negative and beyond 32 bits
    mine = models[t]
    for _ in range(OPERATIONS // THREADS):
      keys = low + rng.integers(0, KEYS_PER_THREAD, int(rng.integers(1, 9)))
      op = rng.choice(["insert", "remove", "find", "lookup", "export"], p=[0.4, 0.2, 0.2, 0.15, 0.05])
      counts[t][op] += 1
      if op in ("insert", "remove", "find"):
        stateful_step(table, mine, op, keys, rng.integers(-(2**62), 2**62, keys.size), default=-1)
      elif op == "lookup":
        values, found = table.lookup(keys)
        assert found.tolist() == [k in mine for k in keys.tolist()]
        assert values.tolist() == [mine.get(k, -1) for k in keys.tolist()]
      else:
        all_keys, all_values = table.export()
        assert (np.diff(all_keys) > 0).all()  # sorted, each key once
        in_range = (all_keys >= low) & (all_keys < low + KEYS_PER_THREAD)
        assert dict(zip(all_keys[in_range].tolist(), np.asarray(all_values)[in_range].tolist())) == mine

  assert _run_threads(worker) == []
  expected = {k: v for model in models for k, v in model.items()}
  keys, values = table.export()
  assert dict(zip(keys.tolist(), np.asarray(values).tolist())) == expected
  assert len(table) == len(expected) and table.capacity > 1024
  assert sum(sum(c.values()) for c in counts) == OPERATIONS
  assert all(min(c.values()) > 0 for c in counts)  # every thread ran every operation


def test_threads_counting_with_insert_or_apply_lose_no_update():
  """Concurrent read-modify-writes of the same keys: every increment lands (the table grows meanwhile)."""
  import jax.numpy as jnp

  table = jr.MutableHashTable(np.int64, np.int32, default_value=0, initial_capacity=16)
  want = collections.Counter()
  lock = threading.Lock()

  def worker(t):
    rng = np.random.default_rng(100 + t)
    for _ in range(OPERATIONS // THREADS // 5):
      keys = rng.integers(0, 64, int(rng.integers(1, 9))) * 2**40
      table.insert_or_apply(keys, np.ones(keys.size, np.int32), jnp.add)
      with lock:
        want.update(keys.tolist())

  assert _run_threads(worker) == []
  keys, counts = table.export()
  assert dict(zip(keys.tolist(), counts.tolist())) == dict(want)


def test_resource_manager_race_under_load():
  mgr = jr.ResourceManager()
  created, verified, held = [], [], []  # entries are weak: hold what the threads got
  lock = threading.Lock()

  def make_table():
    with lock:
      created.append(threading.get_ident())
    return jr.MutableHashTable(np.int64, np.int32, default_value=-1, initial_capacity=1024)

  def verify(existing):
    assert existing.capacity >= 1024
    with lock:
      verified.append(1)

  def worker(t):
    rng = np.random.default_rng(t)
    for i in range(40):
      table = mgr.lookup_or_create("tables", "shared", make_table, verify_fn=verify)
      held.append(table)
      table.insert(np.array([t * 1000 + i], np.int64), np.array([t], np.int32))
      # Churn on another name: create, look up, delete, while the others do the same.
      name = f"churn{rng.integers(0, 3)}"
      mgr.lookup_or_create("churn", name, jr.AutoTrackable)
      try:
        mgr.lookup("churn", name)
        mgr.delete("churn", name)
      except KeyError:
        pass  # another thread deleted it first

  assert _run_threads(worker) == []
  table = mgr.lookup("tables", "shared")
  assert all(t is table for t in held) and len(held) == THREADS * 40
  assert len(created) == 1 and len(verified) == THREADS * 40 - 1
  keys, values = table.export()
  expected = {t * 1000 + i: t for t in range(THREADS) for i in range(40)}
  assert dict(zip(keys.tolist(), values.tolist())) == expected
