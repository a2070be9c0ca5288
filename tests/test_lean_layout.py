"""What is new about the lean storage (the slot is the row, issue 66): keys that collide in the same
two buckets still fill ``capacity`` (the overflow path), digest false matches, the slot slack bound,
and the bytes a slot costs. The oracle is a dict; the tables share two shapes (the oracle suites'
``CAPACITY``, and one of 64 entries in buckets of 8) and batches of ``BATCH`` rows, so the programs
are few."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracle import BATCH, CAPACITY

from jaxres._core import memory
from jaxres._core.storages.lean import LeanTable
from jaxres._core.storages.lean.layout import geometry

COLLIDING_CAPACITY = 64  # in buckets of 8: 9 buckets, 72 slots


def _hashes(table, candidates):
  """``(first, second, digest)`` of int32 ``candidates`` in ``table``'s layout (NumPy)."""
  words, _ = table.key_spec.encode(candidates)
  return (np.asarray(x) for x in jax.jit(table.layout.buckets_of)(words))


def _in_batches(table, op, keys, *args):
  for start in range(0, len(keys), BATCH):
    table = getattr(table, op)(keys[start : start + BATCH], *(a[start : start + BATCH] for a in args))
  return table


def _find(table, keys):
  return np.concatenate([np.asarray(table.find(keys[s : s + BATCH])) for s in range(0, len(keys), BATCH)])


def test_keys_of_one_bucket_pair_fill_the_capacity():
  """Every key in the same two buckets: capacity - 16 of them probe on past both, and a table still
  holds capacity of them, finds them, drops the next one, and frees the overflow as they leave."""
  table = LeanTable.create(COLLIDING_CAPACITY, key=jnp.int32, value=jnp.float32, default=-1.0, bucket_size=8)
  assert (table.num_buckets, table.bucket_size) == (9, 8)
  candidates = np.arange(1 << 14, dtype=np.int32)
  first, second, _ = _hashes(table, candidates)
  pair = (first == first[0]) & (second == second[0])
  keys = candidates[pair][: COLLIDING_CAPACITY + BATCH]
  assert len(keys) == COLLIDING_CAPACITY + BATCH
  values = keys.astype(np.float32) / 2
  held, extra = keys[:COLLIDING_CAPACITY], keys[COLLIDING_CAPACITY:]
  table = _in_batches(table, "insert", held, values)
  assert int(table.size) == COLLIDING_CAPACITY and int(table.dropped) == 0
  assert int(np.asarray(table.overflow).max()) > 0  # keys went past their two buckets
  np.testing.assert_array_equal(_find(table, keys), np.where(np.isin(keys, held), values, -1.0))
  table = table.insert(extra, values[COLLIDING_CAPACITY:])  # full: every new key is dropped
  assert int(table.size) == COLLIDING_CAPACITY and int(table.dropped) == BATCH
  # Half of them leave; as many new ones take their place, wherever the free slots are.
  gone, stay = held[::2], held[1::2]
  table = _in_batches(table, "remove", gone)
  table = table.insert(extra, values[COLLIDING_CAPACITY:])
  want = {int(k): float(v) for k, v in zip(keys, values) if k not in set(gone.tolist())}
  np.testing.assert_array_equal(_find(table, keys), [want.get(int(k), -1.0) for k in keys])
  # Out through the slots and back in at them (a checkpoint): the same entries, found the same way.
  live = table.live_entries()
  back = table.placed(live.keys, live.leaves[0], None, live.slots)
  np.testing.assert_array_equal(np.asarray(back.overflow), np.asarray(table.overflow))
  np.testing.assert_array_equal(_find(back, keys), _find(table, keys))
  table = _in_batches(table, "remove", np.concatenate([stay, extra]))
  assert int(table.size) == 0 and not np.asarray(table.overflow).any()  # no tombstones, no overflow left
  assert (_find(table, keys) == -1.0).all()


def test_digest_false_matches_read_the_keys():
  """Keys of one bucket with one digest: each lookup meets every other one's digest (more matches than
  a probe reads at first) and must tell the keys apart by their words."""
  table = LeanTable.create(CAPACITY, key=jnp.int32, value=jnp.int32, default=-1)
  assert table.num_buckets == 1
  candidates = np.arange(1 << 16, dtype=np.int32)
  _, _, digest = _hashes(table, candidates)
  same = candidates[digest == digest[0]][: CAPACITY + BATCH]
  assert len(same) == CAPACITY + BATCH
  held, absent = same[:CAPACITY], same[CAPACITY:]
  table = table.insert(held[:BATCH], held[:BATCH] + 1).insert(held[BATCH:], held[BATCH:] + 1)
  assert int(table.size) == CAPACITY
  np.testing.assert_array_equal(table.find(held[:BATCH]), held[:BATCH] + 1)
  np.testing.assert_array_equal(table.find(absent), np.full(BATCH, -1))
  table = table.remove(held[1:3])
  want = np.where(np.isin(held[:BATCH], held[1:3]), -1, held[:BATCH] + 1)
  np.testing.assert_array_equal(table.find(held[:BATCH]), want)
  assert np.asarray(table.contains(absent)).sum() == 0


@pytest.mark.parametrize("key", [jnp.int32, jnp.int64, jax.ShapeDtypeStruct((2,), jnp.int64)])
def test_slots_stay_within_three_percent_of_the_capacity(key):
  """From 4096 entries to 2**20: at most 1.03 x capacity slots, at least 2 % more than it (a full
  table's buckets 98 % full), checked on shapes alone (no table allocated)."""
  capacities = [4096, 4097, 5000, 12345, 65536, 99991, 1 << 19, (1 << 20) - 1, 1 << 20]
  for capacity in capacities:
    table = jax.eval_shape(lambda c=capacity: LeanTable.create(c, key=key, value=jnp.float32))
    assert capacity + capacity // 50 <= table.num_slots <= 1.03 * capacity, capacity
    assert 32 <= table.bucket_size <= 64 and table.bucket_size % 4 == 0, capacity
  for capacity in range(4096, (1 << 20) + 1, 4093):  # the geometry alone, over the whole range
    num_buckets, bucket_size = geometry(capacity)
    assert capacity + capacity // 50 <= num_buckets * bucket_size <= 1.03 * capacity, capacity


def test_bytes_a_slot_beyond_the_value_row():
  """int64 keys with change stamps: 8 key bytes, a digest byte and a 4-byte stamp a slot, plus a
  bucket's overflow count (4 bytes per 64 slots) and the counters: about 13.06 bytes a slot."""
  capacity = 1 << 20
  table = jax.eval_shape(lambda: LeanTable.create(capacity, key=jnp.int64, value=jnp.float32))
  index = memory.nbytes(table) - memory.nbytes(table.values) - memory.nbytes(table.default)
  per_slot = index / table.num_slots
  assert 13 < per_slot <= 13 + 4 / table.bucket_size + 1e-3, per_slot
  assert table.num_slots * (4 + per_slot) <= 1.03 * capacity * (4 + 13.1)
