"""What is new about the lean storage (the slot is the row, issue 66): keys that collide in the same
two buckets still fill ``capacity`` (the overflow path), digest false matches, the slot slack bound,
the bytes a slot costs, and eviction among a key's two buckets (``size`` never above ``capacity``,
the victim the lowest-scored entry of the newcomer's two buckets, its slot the newcomer's). The
oracles are a dict and NumPy; the tables share two shapes (the oracle suites' ``CAPACITY``, and one
of 64 entries in buckets of 8) and batches of ``BATCH`` rows, so the programs are few. The policy
tests of eviction (HierarchicalKV's marks among them) run on this storage in ``test_eviction.py``."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracle import BATCH, CAPACITY

import jaxres as jr
from jaxres._core import memory
from jaxres._core.storages.lean import LeanTable
from jaxres._core.storages.lean.layout import geometry

COLLIDING_CAPACITY = 64  # in buckets of 8: 9 buckets, 72 slots


@functools.partial(jax.jit, static_argnums=0)  # one program a layout and shape, not one a call
def _buckets_of(layout, words):
  return layout.buckets_of(words)


def _hashes(table, candidates):
  """``(first, second, digest)`` of int32 ``candidates`` in ``table``'s layout (NumPy)."""
  words, _ = table.key_spec.encode(candidates)
  return (np.asarray(x) for x in _buckets_of(table.layout, words))


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


@pytest.mark.parametrize(
  ("key", "eviction", "most"),
  [(jnp.int64, None, 13), (jnp.int64, jr.LRU(), 17), (jnp.int32, jr.LRU(), 13)],
  ids=["int64", "int64_evicting", "int32_evicting"],
)
def test_bytes_a_slot_beyond_the_value_row(key, eviction, most):
  """With change stamps: the key's bytes (8 or 4), a digest byte and a 4-byte stamp a slot, a 4-byte
  score with eviction, plus a bucket's overflow count (4 bytes per 64 slots, or 128 in a table that
  evicts) and the counters: about 13.06 bytes a slot for int64 keys, 17.03 with eviction (issue 66's
  17-byte goal), 13.03 for int32 keys with eviction (its 13-byte goal)."""
  capacity = 1 << 20
  table = jax.eval_shape(lambda: LeanTable.create(capacity, key=key, value=jnp.float32, eviction=eviction))
  assert table.bucket_size == (64 if eviction is None else 128)
  index = memory.nbytes(table) - memory.nbytes(table.values) - memory.nbytes(table.default)
  per_slot = index / table.num_slots
  assert most < per_slot <= most + 4 / table.bucket_size + 1e-3, per_slot
  assert table.num_slots * (4 + per_slot) <= 1.03 * capacity * (4 + most + 0.1)


def test_options_without_meaning_here_are_refused_by_name():
  with pytest.raises(ValueError, match=r"^eviction_window: a LeanTable evicts among a new key's two buckets"):
    LeanTable.create(CAPACITY, key=jnp.int32, value=jnp.int32, eviction=jr.LRU(), eviction_window=4)
  with pytest.raises(TypeError, match=r"^eviction: expected None, jr.LRU\(\)"):
    LeanTable.create(CAPACITY, key=jnp.int32, value=jnp.int32, eviction="lru")


def _overflow_of(table, entries) -> tuple[np.ndarray, set]:
  """The overflow counts the live ``entries`` (their keys and slots) imply, and the keys that probed
  on: each entry in neither of its key's buckets counts in every bucket from its first up to (not
  including) its own (NumPy)."""
  first, second, _ = _hashes(table, entries.keys)
  bucket = entries.slots // table.bucket_size
  want, probed_on = np.zeros(table.num_buckets, np.int64), set()
  for key, f, s, b in zip(entries.keys.tolist(), first, second, bucket):
    if b not in (f, s):
      probed_on.add(key)
      for r in range((b - f) % table.num_buckets):
        want[(f + r) % table.num_buckets] += 1
  return want, probed_on


def test_a_full_evicting_table_never_holds_more_than_its_capacity():
  """A stream of new keys with random scores through a table of 64 entries in 72 slots (buckets of 8)
  that keys from few bucket pairs fill past their buckets: every call, against a dict of what each
  call reports, ``size`` is the live entries and never above ``capacity`` (the 8 free slots stay
  free: a full table evicts), every key offered is in the table or reported, and the overflow counts
  are those the entries' slots imply, also where the entry evicted had probed on past its buckets."""
  table = LeanTable.create(
    COLLIDING_CAPACITY, key=jnp.int32, value=jnp.int32, default=-1, bucket_size=8, eviction=jr.CustomScore()
  )
  rng = np.random.default_rng(0)
  candidates = np.arange(1 << 12, dtype=np.int32)
  first, _, _ = _hashes(table, candidates)
  pool = candidates[np.isin(first, [0, 1, 2])][:160]  # 3 first buckets of 9: most keys probe on
  model: dict[int, int] = {}
  probed_on, probed_on_victims = set(), 0
  for step in range(40):
    keys = rng.choice(pool, BATCH, replace=False)
    values = rng.integers(0, 1000, BATCH).astype(np.int32)
    scores = rng.integers(1, 1 << 20, BATCH).astype(np.uint32)
    if step % 8 == 7:
      table = table.remove(keys[:3])
      for key in keys[:3].tolist():
        model.pop(key, None)
    table, evicted = table.insert_and_evict(keys, values, scores=scores)
    gone = set(np.asarray(evicted.keys)[np.asarray(evicted.valid)].tolist())
    probed_on_victims += len(gone & probed_on)
    model.update(zip(keys.tolist(), values.tolist()))
    model = {k: v for k, v in model.items() if k not in gone}
    entries = table.live_entries()
    assert dict(zip(entries.keys.tolist(), entries.leaves[0].tolist())) == model, step
    assert int(table.size) == len(model) <= COLLIDING_CAPACITY, step
    overflow, probed_on = _overflow_of(table, entries)
    np.testing.assert_array_equal(np.asarray(table.overflow), overflow)
  assert int(table.size) == COLLIDING_CAPACITY and int(table.evictions) > 0 and probed_on_victims > 0
  assert int(table.dropped) == 0


def test_a_newcomer_takes_the_slot_of_the_lowest_scored_entry_of_its_two_buckets():
  """A full table in buckets of 8; each new key (its score above every entry's) evicts the entry of
  lowest score among the slots of its own two buckets (not the table's lowest), and sits in its slot."""
  table = LeanTable.create(
    COLLIDING_CAPACITY, key=jnp.int32, value=jnp.int32, default=-1, bucket_size=8, eviction=jr.CustomScore()
  )
  rng = np.random.default_rng(1)
  keys = rng.permutation(1 << 12)[: COLLIDING_CAPACITY + 16].astype(np.int32)
  held, newcomers = keys[:COLLIDING_CAPACITY], keys[COLLIDING_CAPACITY:]
  scores = rng.permutation(COLLIDING_CAPACITY).astype(np.uint32) + 1  # distinct: no ties
  for start in range(0, COLLIDING_CAPACITY, BATCH):
    part = slice(start, start + BATCH)
    table = table.insert(held[part], held[part], scores=scores[part])
  assert int(table.size) == COLLIDING_CAPACITY
  first, second, _ = _hashes(table, newcomers)
  for i, (key, a, b) in enumerate(zip(newcomers.tolist(), first, second)):
    before = table.live_entries()
    bucket = before.slots // table.bucket_size
    inside = (bucket == a) | (bucket == b)
    lowest = np.argmin(np.where(inside, before.scores, np.iinfo(np.uint32).max))
    table, evicted = table.insert_and_evict(
      np.array([key], np.int32), np.array([key], np.int32), scores=np.array([(1 << 20) + i], np.uint32)
    )
    assert np.asarray(evicted.valid).tolist() == [True]
    assert np.asarray(evicted.keys).tolist() == [before.keys[lowest]]
    assert np.asarray(evicted.scores).tolist() == [before.scores[lowest]]
    after = table.live_entries()
    assert after.slots[after.keys == key].tolist() == [before.slots[lowest]]
    assert int(table.size) == COLLIDING_CAPACITY
  np.testing.assert_array_equal(np.asarray(table.find(newcomers)), newcomers)
