"""Soak: a million key operations on each storage against the dict oracle.

Random batches of every operation: 1,000 keys drawn from a fixed universe of
3,000 int64 keys spread over the whole range (so batches repeat keys and the
small capacity overflows), and for updates a random ``valid`` mask keeping 30
to 100% of the rows (a fixed shape, as in a jitted step: one compile per
operation and capacity). Resizes, full comparisons and checkpoint round trips
come in between. Every result is checked against :class:`oracle.DictTable`
as it comes.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from oracle import STORAGES, DictTable, Kind, assert_matches

import jaxres as jr

KIND = Kind("int64", jnp.int64, jnp.int32, -5)
OPERATIONS = 1_000_000
UNIVERSE = 3_000
CAPACITIES = (1024, 4096)  # the first overflows (dropped keys), the second never does
BATCH = 1000
FULL_CHECK_EVERY, RESIZE_EVERY, CHECKPOINT_EVERY = 50, 150, 400


def _add(old, new):
  return old + new


def _add_rows(old, new):
  return tuple(a + b for a, b in zip(old, new))


def _expected(rows) -> np.ndarray:
  return np.array([row[0] for row in rows], np.int32)


def _round_trip(table, capacity, storage, directory):
  root = jr.AutoTrackable()
  root.table = table
  path = jr.Checkpoint(model=root).save(directory)
  fresh = jr.AutoTrackable()
  status = jr.Checkpoint(model=fresh).restore(path)
  fresh.table = KIND.create(storage, capacity)  # restored on attach, into the new capacity
  status.assert_consumed()
  return fresh.table


def soak(storage, seed: int, directory) -> dict:
  """Runs the soak; returns what it did, for the closing figures."""
  rng = np.random.default_rng(seed)
  info = np.iinfo(np.int64)
  extremes = np.array([info.min, info.max, 0, 1, -1], np.int64)
  universe = np.unique(np.concatenate([extremes, rng.integers(info.min, info.max, UNIVERSE, np.int64)]))
  capacity = CAPACITIES[1]
  table, model = KIND.create(storage, capacity), DictTable(KIND, capacity)
  done = {"operations": 0, "calls": 0, "resizes": 0, "checkpoints": 0, "max_dropped": 0}
  step = 0
  while done["operations"] < OPERATIONS:
    step += 1
    keys = universe[rng.integers(0, universe.size, BATCH)]
    values = rng.integers(-1000, 1000, BATCH).astype(np.int32)
    valid = rng.random(BATCH) < rng.uniform(0.3, 1.0)
    kept_keys, kept_values = keys[valid], values[valid]
    op = rng.choice(
      ["insert", "find_or_insert", "apply", "remove", "lookup", "import"], p=[0.25, 0.2, 0.2, 0.2, 0.14, 0.01]
    )
    if op == "insert":
      table = table.insert(keys, values, valid)
      model.insert(kept_keys, kept_values)
    elif op == "find_or_insert":
      table, got = table.find_or_insert(keys, values, valid)
      want = _expected(model.find_or_insert(kept_keys, kept_values))
      np.testing.assert_array_equal(np.asarray(got)[valid], want)
    elif op == "apply":
      table = table.insert_or_apply(keys, values, _add, valid)
      model.insert_or_apply(kept_keys, kept_values, _add_rows)
    elif op == "remove":
      table = table.remove(keys, valid)
      model.remove(kept_keys)
    elif op == "lookup":  # find and contains in one call, on every row
      got, found = table.lookup(keys)
      np.testing.assert_array_equal(got, _expected(model.find(keys)))
      np.testing.assert_array_equal(found, model.contains(keys))
      valid = np.ones(BATCH, bool)
    else:
      table = table.import_(keys, values, valid)
      model.import_(keys, values, valid)
    done["operations"] += int(valid.sum())
    done["calls"] += 1
    assert (int(table.size), int(table.dropped)) == (len(model.data), model.dropped), f"step {step} ({op})"
    done["max_dropped"] = max(done["max_dropped"], model.dropped)
    if step % FULL_CHECK_EVERY == 0:
      assert_matches(table, model)
    if step % RESIZE_EVERY == 0:  # alternately shrink (removing keys until they fit) and grow
      capacity = CAPACITIES[0] if capacity == CAPACITIES[1] else CAPACITIES[1]
      if len(model.data) > capacity:
        kept = rng.choice(universe, capacity - 100, replace=False)
        doomed = np.setdiff1d(universe, kept)
        for start in range(0, doomed.size, BATCH):
          chunk = doomed[start : start + BATCH]
          table = table.remove(np.resize(chunk, BATCH), np.arange(BATCH) < chunk.size)
          model.remove(chunk)
          done["operations"] += chunk.size
      table = table.resize(capacity)
      model.capacity, model.dropped = capacity, 0
      done["resizes"] += 1
      assert_matches(table, model)
    if step % CHECKPOINT_EVERY == 0:
      capacity = int(rng.choice([c for c in CAPACITIES if c >= len(model.data)]))
      table = _round_trip(table, capacity, storage, directory / f"step{step}")
      model.capacity, model.dropped = capacity, 0
      done["checkpoints"] += 1
      assert_matches(table, model)
  assert_matches(table, model)
  return done


@pytest.mark.slow
@pytest.mark.parametrize("storage", STORAGES, ids=lambda s: s.__name__)
def test_a_million_operations_match_the_dict(storage, tmp_path):
  done = soak(storage, STORAGES.index(storage), tmp_path)
  assert done["operations"] >= OPERATIONS
  assert done["resizes"] >= 3 and done["checkpoints"] >= 3 and done["max_dropped"] > 0, done
