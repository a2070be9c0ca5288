"""The CPU kernels (``jaxres/_core/kernels`` and each storage folder's ``kernels.cc``) give exactly
what their XLA references give.

Each kernel is compared bit for bit with its reference on tables grown by random
operations (hypothesis), and whole runs with the kernels off (``JAXRES_KERNELS=0``,
in a subprocess) leave the same tables and results as runs with them on. The
oracle and hypothesis suites (test_table, test_stateful, test_transforms) run
each test with the kernels on (the default on CPU) and on the references alone
(the ``kernels`` fixture of conftest). That evicting calls write their values in place (no copy
of the value array) is one of the O(batch) guards of test_costs.
"""

import functools
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from children import HANG_GUARD_S
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxres as jr
from jaxres._core.kernels import claims, grouping, native, row_ops
from jaxres._core.modes import Upsert
from jaxres._core.storages.lean import LeanTable, probing
from jaxres._core.storages.lean import eviction as lean_eviction
from jaxres._core.storages.lean import placing as lean_placing
from jaxres._core.storages.open_addressing import eviction_rounds, placing
from jaxres._core.storages.storage import Storage

ROOT = Path(__file__).resolve().parents[1]
KEYS = {1: jnp.uint32, 2: jax.ShapeDtypeStruct((2,), jnp.int32), 3: jax.ShapeDtypeStruct((3,), jnp.uint32)}


def test_the_kernels_are_built_and_on():
  assert native.BUILT, "pip install did not compile the kernels (is a C++ compiler installed?)"
  assert native.ENABLED == (os.environ.get("JAXRES_KERNELS", "1") != "0")


@functools.partial(jax.jit, static_argnames="reference")
def _locate(table, words, reference):
  return table._follow_chains(table.buckets, words) if reference else table._locate(words)


@functools.partial(jax.jit, static_argnames=("reference", "last"))
def _owner(words, mask, reference, last):
  return claims._owner_per_key(words, mask, last) if reference else claims.owner_per_key(words, mask, last)


@functools.partial(jax.jit, static_argnames="reference")
def _upsert(table, words, active, reference):
  args = (table.buckets, words, active, table.free_rows, table.size)
  if reference:
    return placing._upsert_reference(table.layout, table._follow_chains, *args)
  return placing.upsert_slots(table.layout, *args, table._follow_chains)


def _grown_table(num_words, bucket_size, capacity, seed):
  """A table after random inserts and removes, with keys from a small pool (long probe chains)."""
  rng = np.random.default_rng(seed)
  table = jr.OpenAddressingTable.create(
    capacity, key=KEYS[num_words], value=jnp.float32, bucket_size=bucket_size
  )
  pool = rng.integers(0, 2**32, (3 * capacity, num_words), dtype=np.uint32)
  for _ in range(4):
    keys = pool[rng.integers(0, len(pool), 16)]
    table = _insert_words(table, jnp.asarray(keys))
    table = _remove_words(table, jnp.asarray(pool[rng.integers(0, len(pool), 6)]))
  return table, pool


@jax.jit
def _insert_rows(table, words, leaves):
  return table._upsert_rows(words, leaves, None, Upsert.INSERT)[0]


def _insert_words(table, words):
  return _insert_rows(table, words, [jnp.zeros(words.shape[0], jnp.float32)])


@jax.jit
def _remove_words(table, words):
  return table._remove_rows(words, None)


def _assert_same(kernel, reference):
  for a, b in zip(jax.tree.leaves(kernel), jax.tree.leaves(reference)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.skipif(not native.ENABLED, reason="kernels off")
def test_batches_split_over_the_thread_pool_cover_every_row():
  """A batch over several kernel threads whose size they do not divide (3 * 8192 + 7 rows): every
  row is located, looked up and placed as its reference does. (The last rows of such a batch were
  once left to none of the threads.)"""
  n = 3 * 8192 + 7
  rng = np.random.default_rng(11)
  table = jr.OpenAddressingTable.create(2 * n, key=jnp.int64, value=jnp.float32)
  words = jnp.asarray(rng.integers(0, 2**32, (n, 2), dtype=np.uint32))
  active = jnp.ones(n, bool)
  kernel, reference = _upsert(table, words, active, False), _upsert(table, words, active, True)
  _assert_same(kernel, reference)
  full = _insert_words(table, words)
  _assert_same(_locate(full, words, False), _locate(full, words, True))
  assert bool(jnp.all(_locate(full, words, False)[0]))


@pytest.mark.skipif(not native.ENABLED, reason="kernels off")
@settings(max_examples=25, deadline=None)
@given(
  num_words=st.sampled_from([1, 2, 3]),
  bucket_size=st.sampled_from([1, 2, 4, 7, 8, 14]),
  seed=st.integers(0, 2**16),
)
def test_kernels_equal_their_references(num_words, bucket_size, seed):
  table, pool = _grown_table(num_words, bucket_size, capacity=64, seed=seed)
  rng = np.random.default_rng(seed + 1)
  # A batch of 96 rows: present keys, absent ones and repeats.
  words = jnp.asarray(pool[rng.integers(0, len(pool), 96)])
  _assert_same(_locate(table, words, False), _locate(table, words, True))

  mask = jnp.asarray(rng.random(96) < 0.9)
  for last in (False, True):
    _assert_same(_owner(words, mask, False, last), _owner(words, mask, True, last))

  # Upserts: the whole batch (more rows than room: the new keys are admitted as they fit), and
  # as many rows as fit (the kernel locates the keys as it places them).
  room = table.capacity - int(table.size)
  for active in (mask, mask & (jnp.cumsum(mask) <= room)):
    _assert_same(_upsert(table, words, active, False), _upsert(table, words, active, True))


@functools.partial(jax.jit, static_argnames="reference")
def _lookup(table, words, defaults, reference):
  return Storage._lookup_rows(table, words, defaults) if reference else table._lookup_rows(words, defaults)


@functools.partial(jax.jit, static_argnames="reference")
def _search(table, words, reference):
  return table._bisect(words) if reference else table._search(words)


# Value specs and defaults: several leaves (the kernel's general copy), and one leaf of 4 or 8
# bytes per row (its copies of a width known at compile time) or of another width.
VALUES = {
  "three leaves": (
    {"row": jax.ShapeDtypeStruct((5,), jnp.float32), "id": jnp.int32, "half": jnp.float16},
    {"row": -1.0, "id": -2, "half": 0.5},
  ),
  "4 bytes": (jnp.float32, -1.0),
  "8 bytes": (jax.ShapeDtypeStruct((2,), jnp.int32), -3),
  "2 bytes": (jnp.float16, 0.5),
}


# Every pair of (num_words, bucket_size, value) meets in one of these sixteen configurations.
LOOKUP_CONFIGS = [
  ((i + j) % 3 + 1, bucket_size, value)
  for i, bucket_size in enumerate([1, 4, 7, 14])
  for j, value in enumerate(VALUES)
]


@pytest.mark.skipif(not native.ENABLED, reason="kernels off")
@pytest.mark.parametrize(("num_words", "bucket_size", "value"), LOOKUP_CONFIGS)
@settings(max_examples=2, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_lookup_kernel_equals_its_reference(num_words, bucket_size, value, seed):
  """Values of several dtypes, widths and leaf counts; per-row, shared and no defaults (contains)."""
  rng = np.random.default_rng(seed)
  spec, default = VALUES[value]
  table = jr.OpenAddressingTable.create(
    48, key=KEYS[num_words], value=spec, default=default, bucket_size=bucket_size
  )
  pool = rng.integers(0, 2**32, (120, num_words), dtype=np.uint32)
  for _ in range(3):
    keys = pool[rng.integers(0, len(pool), 24)]
    values = [(rng.random((24, *d.shape)) * 20 - 10).astype(d.dtype) for d in table.default]
    table = _insert_rows(table, jnp.asarray(keys), [jnp.asarray(v) for v in values])
    table = _remove_words(table, jnp.asarray(pool[rng.integers(0, len(pool), 8)]))
  words = jnp.asarray(pool[rng.integers(0, len(pool), 80)])
  per_row = [jnp.asarray((rng.random((80, *d.shape)) * 20 - 10).astype(d.dtype)) for d in table.default]
  for defaults in (per_row, list(table.default), []):
    kernel, reference = _lookup(table, words, defaults, False), _lookup(table, words, defaults, True)
    _assert_same(kernel, reference)
  assert 0 < int(np.sum(reference[1])) < 80  # hits and misses


@functools.partial(jax.jit, static_argnames="reference")
def _lean_reads(table, words, defaults, reference):
  """``(hit, slot)`` and ``(values, found)`` of a lean table: the kernels, or the XLA references alone."""
  if not reference:
    return table._locate(words), table._lookup_rows(words, defaults)
  with native.references():
    return probing.locate(table.layout, *table._arrays(), words), table._lookup_rows(words, defaults)


# Bucket sizes of the lean layout: 16-slot digest blocks with and without a tail of 4 or 8 slots,
# buckets below one block, and the default (17 buckets of 4 for 64 entries); every value spec.
LEAN_CONFIGS = [
  ((i + j) % 3 + 1, bucket_size, value)
  for i, bucket_size in enumerate([4, 8, 20, None])
  for j, value in enumerate(VALUES)
]


@pytest.mark.skipif(not native.ENABLED, reason="kernels off")
@pytest.mark.parametrize(("num_words", "bucket_size", "value"), LEAN_CONFIGS)
@settings(max_examples=2, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_lean_read_kernels_equal_their_references(num_words, bucket_size, value, seed):
  """Locate and lookup of a lean table grown full by random inserts and removes (4-slot buckets: keys
  probed past both of theirs), for present keys, absent ones and repeats, with digest matches of keys
  a bucket does not hold; per-row, shared and no defaults (contains)."""
  rng = np.random.default_rng(seed)
  spec, default = VALUES[value]
  table = LeanTable.create(64, key=KEYS[num_words], value=spec, default=default, bucket_size=bucket_size)
  pool = rng.integers(0, 2**32, (200, num_words), dtype=np.uint32)
  for round in range(5):  # the last one fills the table
    keys = pool[rng.integers(0, len(pool), 40)] if round < 4 else pool[:96]
    values = [(rng.random((len(keys), *d.shape)) * 20 - 10).astype(d.dtype) for d in table.default]
    table = _insert_rows(table, jnp.asarray(keys), [jnp.asarray(v) for v in values])
    if round < 4:
      table = _remove_words(table, jnp.asarray(pool[rng.integers(0, len(pool), 8)]))
  words = jnp.asarray(np.concatenate([pool, pool[rng.integers(0, len(pool), 56)]]))
  per_row = [jnp.asarray((rng.random((256, *d.shape)) * 20 - 10).astype(d.dtype)) for d in table.default]
  for defaults in (per_row, list(table.default), []):
    kernel, reference = _lean_reads(table, words, defaults, False), _lean_reads(table, words, defaults, True)
    _assert_same(kernel, reference)
  hit = np.asarray(reference[0][0])
  assert 0 < hit.sum() < 256  # hits and misses
  assert int(table.size) == 64
  if bucket_size == 4:  # 64 entries in 68 slots
    assert int(jnp.sum(table.overflow)) > 0  # keys probed past both their buckets
  elif bucket_size == 20:  # absent keys whose digests match slots of their buckets (40 / 255 a key)
    layout = table.layout
    first, second, digest = layout.buckets_of(words)
    both = layout.digest_words(table.digests, jnp.stack([first, second], axis=1))
    matches = jax.lax.population_count(layout.matching(both, digest[:, None]))
    assert np.asarray(jnp.sum(matches, axis=(1, 2)))[~hit].sum() > 0


@pytest.mark.skipif(not native.ENABLED, reason="kernels off")
@pytest.mark.parametrize(("bucket_size", "num_words", "width"), [(100, 1, 4), (128, 2, 1)])
def test_lean_read_kernels_equal_their_references_past_64_slots(bucket_size, num_words, width):
  """Buckets of more than 64 slots (an evicting table's): keys whose digests match past the 64th slot
  of a bucket, in tables of several such buckets filled to capacity, found where the reference finds
  them; rows of 16 bytes (4 float32) and of 4."""
  rng = np.random.default_rng(bucket_size)
  value = jax.ShapeDtypeStruct((width,), jnp.float32)
  table = LeanTable.create(400, key=KEYS[num_words], value=value, default=-1.0, bucket_size=bucket_size)
  assert table.layout.num_buckets >= 4
  pool = rng.choice(2**32, (800, num_words), replace=False).astype(np.uint32)
  rows = rng.random((400, width)).astype(np.float32)
  table = _insert_rows(table, jnp.asarray(pool[:400]), [jnp.asarray(rows)])
  assert int(table.size) == 400
  words = jnp.asarray(pool)  # present, then absent
  for defaults in ([], list(table.default)):
    kernel, reference = _lean_reads(table, words, defaults, False), _lean_reads(table, words, defaults, True)
    _assert_same(kernel, reference)
  (hit, slot), (values, _) = (jax.tree.map(np.asarray, x) for x in reference)
  assert hit[:400].all() and not hit[400:].any()
  assert (slot[:400] % bucket_size >= 64).sum() > 50  # keys past the 64th slot of their bucket
  np.testing.assert_array_equal(values[0], np.concatenate([rows, np.full((400, width), -1.0, np.float32)]))


@pytest.mark.skipif(not native.ENABLED, reason="kernels off")
def test_lean_reads_call_their_kernels():
  """On CPU a lean table's find and contains run the lookup kernel, and ``_locate`` the locate kernel."""
  table = LeanTable.create(64, key=jnp.int32, value=jnp.float32)
  text = jax.jit(lambda t, k: (t.find(k), t.contains(k))).lower(table, jnp.arange(4)).as_text()
  assert "jaxres_lean_lookup" in text
  words = jnp.zeros((4, 1), jnp.uint32)
  assert "jaxres_lean_locate" in jax.jit(lambda t, w: t._locate(w)).lower(table, words).as_text()


def _both_ways(fn, *args):
  """``fn(*args)`` traced with the kernels, then with the XLA references alone."""
  with native.references():
    reference = fn(*args)
  return fn(*args), reference


@functools.partial(jax.jit, static_argnames=("layout", "capacity"))
def _lean_upsert(layout, digests, keys, overflow, words, active, size, capacity):
  return lean_placing.upsert_slots(layout, digests, keys, overflow, words, active, size, capacity)


@functools.partial(jax.jit, static_argnames="mode")
def _lean_write(table, words, leaves, active, mode, given_scores):
  """A whole insert or find_or_insert: ``(table, values, evicted)``."""
  return table._upsert_rows(words, leaves, active, mode, given_scores)


@jax.jit
def _lean_claim(table, words, active):
  """find_or_insert_rows' claim: ``(table, rows, found, placed, evicted)``."""
  return table._claim_rows(words, active)


def _grown_lean_table(num_words, bucket_size, seed, eviction=None):
  """A lean table of 64 entries after random inserts and removes (their keys from a pool of 200),
  then filled with the pool's first keys; with its pool and a rng."""
  rng = np.random.default_rng(seed)
  table = LeanTable.create(
    64, key=KEYS[num_words], value=jnp.float32, bucket_size=bucket_size, eviction=eviction
  )
  pool = rng.integers(0, 2**32, (200, num_words), dtype=np.uint32)
  for round in range(4):
    keys = pool[rng.integers(0, len(pool), 40)] if round < 3 else pool[:80]
    table = _insert_rows(table, jnp.asarray(keys), [jnp.asarray(rng.random(len(keys)), jnp.float32)])
    if round < 3:
      table = _remove_words(table, jnp.asarray(pool[rng.integers(0, len(pool), 8)]))
  return table, pool, rng


# Bucket sizes of the lean layout (as LEAN_CONFIGS) with every key width.
LEAN_WRITE_CONFIGS = [(i % 3 + 1, bucket_size) for i, bucket_size in enumerate([4, 8, 20, None, 4, 8])]


@pytest.mark.skipif(not native.ENABLED, reason="kernels off")
@pytest.mark.parametrize(("num_words", "bucket_size"), LEAN_WRITE_CONFIGS)
@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 2**16), removed=st.sampled_from([0, 1, 5, 20, 40]))  # a shape: a program each
def test_lean_upsert_kernel_equals_its_reference(num_words, bucket_size, seed, removed):
  """Placement in a lean table (``placing.upsert_slots``), with ``removed`` entries removed from a full
  one: a batch of present keys, new ones and repeats, some rows masked out, whole (more new keys
  than room: the rest dropped) and as many rows as fit; 4-slot buckets probe past both of a key's."""
  table, pool, rng = _grown_lean_table(num_words, bucket_size, seed)
  table = _remove_words(table, jnp.asarray(pool[rng.permutation(len(pool))[:removed]]))
  words = jnp.asarray(pool[rng.integers(0, len(pool), 96)])
  mask = jnp.asarray(rng.random(96) < 0.9)
  room = table.capacity - int(table.size)
  for active in (mask, mask & (jnp.cumsum(mask) <= room)):
    args = (table.layout, *table._arrays(), words, active, table.size, table.capacity)
    kernel, reference = _both_ways(_lean_upsert, *args)
    _assert_same(kernel, reference)
  assert int(reference.dropped) == 0
  full = _both_ways(_lean_upsert, table.layout, *table._arrays(), words, mask, table.size, table.capacity)[1]
  assert int(full.dropped) > 0  # the whole batch overflowed
  # The whole insert: slots, values (the last row of each key), size and dropped.
  leaves = [jnp.asarray(rng.random(96), jnp.float32)]
  for mode in (Upsert.INSERT, Upsert.FIND_OR_INSERT):
    _assert_same(*_both_ways(_lean_write, table, words, leaves, mask, mode, None))
  _assert_same(*_both_ways(_lean_claim, table, words, mask))


@pytest.mark.skipif(not native.ENABLED, reason="kernels off")
@pytest.mark.parametrize(("bucket_size", "num_words"), [(100, 1), (128, 2)])
def test_lean_upsert_kernel_places_past_64_slots_as_its_reference(bucket_size, num_words):
  """Buckets of more than 64 slots (an evicting table's): new keys placed in half-full buckets, whose
  free slots lie on both sides of the 64th, where the reference places them; more new keys than room."""
  rng = np.random.default_rng(bucket_size)
  table = LeanTable.create(400, key=KEYS[num_words], value=jnp.float32, bucket_size=bucket_size)
  pool = rng.choice(2**32, (900, num_words), replace=False).astype(np.uint32)
  table = _insert_rows(table, jnp.asarray(pool[:200]), [jnp.zeros(200, jnp.float32)])
  words = jnp.asarray(pool[rng.permutation(500)])  # 200 present, 300 new: 100 more than room
  args = (table.layout, *table._arrays(), words, jnp.ones(500, bool), table.size, table.capacity)
  kernel, reference = _both_ways(_lean_upsert, *args)
  _assert_same(kernel, reference)
  assert int(reference.dropped) == 100 and int(reference.found.sum()) == 200
  placed = np.asarray(reference.slot)[np.asarray(reference.admitted)]
  assert (placed % bucket_size >= 64).sum() > 30 and (placed % bucket_size < 64).sum() > 30


@pytest.mark.skipif(not native.ENABLED, reason="kernels off")
@pytest.mark.parametrize("bucket_size", [4, None])
def test_lean_upsert_kernel_probes_on_as_its_reference(bucket_size):
  """An empty table of 4,096 entries filled by one batch of 4,096 distinct keys and 200 repeats (4-slot
  buckets: many keys find both their buckets full and probe on, raising overflow counts), then its
  rows split over the thread pool (3 * 8192 + 7 rows, present and new keys)."""
  rng = np.random.default_rng(3)
  table = LeanTable.create(4096, key=jnp.int64, value=jnp.float32, bucket_size=bucket_size)
  fresh = np.unique(rng.integers(0, 2**32, (4300, 2), dtype=np.uint32), axis=0)[:4096]
  words = jnp.asarray(np.concatenate([fresh, fresh[rng.integers(0, 4096, 200)]])[rng.permutation(4296)])
  args = (table.layout, *table._arrays(), words, jnp.ones(4296, bool), table.size, table.capacity)
  kernel, reference = _both_ways(_lean_upsert, *args)
  _assert_same(kernel, reference)
  assert int(jnp.sum(reference.admitted)) == 4296
  if bucket_size == 4:
    assert int(jnp.sum(reference.overflow)) > 0
  table = _insert_words(table, words)
  n = 3 * 8192 + 7
  many = jnp.asarray(np.concatenate([fresh, rng.integers(0, 2**32, (n - 4096, 2), dtype=np.uint32)]))
  args = (table.layout, *table._arrays(), many, jnp.ones(n, bool), table.size, table.capacity)
  kernel, reference = _both_ways(_lean_upsert, *args)
  _assert_same(kernel, reference)
  assert int(jnp.sum(reference.found)) == 4096


@functools.partial(jax.jit, static_argnames=("layout", "protect"))
def _lean_evict(layout, digests, keys, overflow, scores, words, pending, new_score, named, protect):
  named = named if protect else None
  return lean_eviction.evict(layout, digests, keys, overflow, scores, words, pending, new_score, named)


@pytest.mark.skipif(not native.ENABLED, reason="kernels off")
@pytest.mark.parametrize(("num_words", "bucket_size"), [(1, 4), (2, 8), (3, None), (2, 4)])
@pytest.mark.parametrize("protect", [False, True])
@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_lean_evict_kernel_equals_its_reference(num_words, bucket_size, protect, seed):
  """Eviction rounds (``eviction.evict``) on a full lean table with random scores (ties included):
  new keys evict the lowest entry of their two buckets, lose claims and choose again, are refused,
  or displace a key placed earlier in the call; victims placed by probing on lower their overflow
  counts. Protected: the slots the call names are never evicted."""
  table, pool, rng = _grown_lean_table(num_words, bucket_size, seed, eviction=jr.CustomScore())
  live = np.flatnonzero(np.asarray(table._slots()[1]))
  scores = np.full(table.num_slots, np.iinfo(np.uint32).max, np.uint32)  # free slots: never evicted
  scores[live] = rng.integers(0, 6, len(live), dtype=np.uint32)
  fresh = np.unique(rng.integers(0, 2**32, (48, num_words), dtype=np.uint32), axis=0)
  words = jnp.asarray(np.concatenate([pool[rng.integers(0, len(pool), 24)], fresh]))
  with native.references():
    found, slot = jax.jit(LeanTable._locate)(table, words)
  pending = ~found & jnp.asarray(rng.random(words.shape[0]) < 0.9)
  new_score = jnp.asarray(rng.integers(0, 8, words.shape[0], dtype=np.uint32))
  if not protect:  # as under LRU: every key of the call has one score
    new_score = jnp.full(words.shape[0], 4, jnp.uint32)
  named = jnp.where(found, slot, -1)
  args = (table.layout, *table._arrays(), jnp.asarray(scores), words, pending, new_score, named)
  kernel = _lean_evict(*args, protect=protect)
  with native.references():
    reference = _lean_evict(*args, protect=protect)
  _assert_same(kernel, reference)
  assert int(np.sum(reference.placed | reference.displaced)) > 0  # evictions happened
  assert int(np.sum(reference.refused)) > 0
  if protect:  # named entries kept their slots and scores
    kept = np.asarray(named)[np.asarray(named) >= 0]
    np.testing.assert_array_equal(np.asarray(reference.scores)[kept], scores[kept])


@pytest.mark.skipif(not native.ENABLED, reason="kernels off")
@pytest.mark.parametrize("protect", [False, True])
def test_a_large_lean_eviction_equals_its_reference(protect):
  """A batch of 4096 new keys into a full table of 32 buckets of 128: many rows a bucket, so rows
  share the buckets they read within a round and across rounds (the kernel reads a bucket's lowest
  score once until a winner writes it), scores with ties."""
  rng = np.random.default_rng(7)
  table = LeanTable.create(4000, key=KEYS[2], value=jnp.float32, eviction=jr.CustomScore())
  table = _insert_rows(
    table, jnp.asarray(rng.integers(0, 2**32, (4000, 2), dtype=np.uint32)), [jnp.ones(4000)]
  )
  live = np.flatnonzero(np.asarray(table._slots()[1]))
  scores = np.full(table.num_slots, np.iinfo(np.uint32).max, np.uint32)
  scores[live] = rng.integers(0, 50, len(live), dtype=np.uint32)
  words = jnp.asarray(rng.integers(0, 2**32, (4096, 2), dtype=np.uint32))
  new_score = jnp.asarray(
    rng.integers(0, 60, 4096, dtype=np.uint32) if protect else np.full(4096, 40, np.uint32)
  )
  named = jnp.asarray(np.where(rng.random(4096) < 0.5, rng.choice(live, 4096), -1).astype(np.int32))
  args = (table.layout, *table._arrays(), jnp.asarray(scores), words, jnp.ones(4096, bool), new_score, named)
  kernel = _lean_evict(*args, protect=protect)
  with native.references():
    reference = _lean_evict(*args, protect=protect)
  _assert_same(kernel, reference)
  assert 1000 < int(np.sum(reference.placed)) and int(np.sum(reference.refused)) > 0


@pytest.mark.skipif(not native.ENABLED, reason="kernels off")
@pytest.mark.parametrize(("num_words", "bucket_size"), [(1, 4), (2, None), (3, 8)])
@pytest.mark.parametrize("policy", ["LRU", "LFU", "CustomScore"])
@settings(max_examples=2, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_lean_evicting_writes_equal_their_references(num_words, bucket_size, policy, seed):
  """Whole evicting inserts and find_or_inserts of a full lean table (tables, values and evicted
  entries), with repeats and masked rows, and given scores under ``CustomScore``."""
  table, pool, rng = _grown_lean_table(num_words, bucket_size, seed, eviction=getattr(jr, policy)())
  fresh = rng.integers(0, 2**32, (48, num_words), dtype=np.uint32)
  words = jnp.asarray(np.concatenate([pool[rng.integers(0, len(pool), 40)], fresh, fresh[:8]]))
  n = words.shape[0]
  mask = jnp.asarray(rng.random(n) < 0.9)
  given_scores = jnp.asarray(rng.integers(0, 2**31, n, dtype=np.uint32)) if policy == "CustomScore" else None
  leaves = [jnp.asarray(rng.random(n), jnp.float32)]
  for mode in (Upsert.INSERT, Upsert.FIND_OR_INSERT):
    kernel, reference = _both_ways(_lean_write, table, words, leaves, mask, mode, given_scores)
    _assert_same(kernel, reference)
    assert int(reference[0].evictions) > int(table.evictions)
  if given_scores is None:
    _assert_same(*_both_ways(_lean_claim, table, words, mask))


@pytest.mark.skipif(not native.ENABLED, reason="kernels off")
def test_lean_writes_call_their_kernels():
  """On CPU a lean table's insert runs the upsert kernel, and an evicting insert the evict kernel; under
  ``references()`` neither."""
  table = LeanTable.create(64, key=jnp.int32, value=jnp.float32, eviction=jr.LFU())
  insert = jax.jit(lambda t, k: t.insert_and_evict(k, jnp.ones(4)))
  text = insert.lower(table, jnp.arange(4)).as_text()
  assert "jaxres_lean_upsert" in text and "jaxres_lean_evict" in text
  with native.references():
    text = insert.lower(table, jnp.arange(4)).as_text()
  assert "jaxres_lean" not in text


@pytest.mark.skipif(not native.ENABLED, reason="kernels off")
def test_lean_write_kernels_refuse_key_rows_of_another_width():
  """Key rows narrower than the table's keys are an error of the kernels, not reads past their end."""
  table = LeanTable.create(64, key=jnp.int64, value=jnp.float32, eviction=jr.LFU())
  words, n = jnp.zeros((4, 1), jnp.uint32), 4
  with pytest.raises(Exception, match="jaxres_lean_upsert: expected key rows as wide as the table's keys"):
    jax.block_until_ready(
      _lean_upsert(table.layout, *table._arrays(), words, jnp.ones(n, bool), table.size, table.capacity)
    )
  scores, pending = jnp.zeros(table.num_slots, jnp.uint32), jnp.ones(n, bool)
  args = (table.layout, *table._arrays(), scores, words, pending, jnp.ones(n, jnp.uint32), jnp.full(n, -1))
  with pytest.raises(Exception, match="jaxres_lean_evict: expected key rows as wide as the table's keys"):
    jax.block_until_ready(_lean_evict(*args, protect=True))


# Capacities (shapes: each is a program) at the edges a search meets: one row, powers of two and their
# neighbours, a sample block's length (64) and past it. Hypothesis draws the data; the programs of these
# shapes (39 with the key widths) are compiled once (JAX's persistent cache), not anew for each drawn.
SEARCH_CAPACITIES = [1, 2, 3, 7, 8, 9, 31, 32, 33, 63, 64, 65, 70]


@pytest.mark.skipif(not native.ENABLED, reason="kernels off")
@settings(max_examples=20, deadline=None)
@given(
  num_words=st.sampled_from([1, 2, 3]),
  capacity=st.sampled_from(SEARCH_CAPACITIES),
  seed=st.integers(0, 2**16),
)
def test_search_kernel_equals_its_reference(num_words, capacity, seed):
  """Lower bounds in sorted tables of every fill (empty, partly full, full, with tombstones)."""
  rng = np.random.default_rng(seed)
  table = jr.SortedTable.create(capacity, key=KEYS[num_words], value=jnp.float32)
  pool = rng.integers(0, 4, (2 * capacity + 4, num_words), dtype=np.uint32) * (2**30)  # ties in leading words
  pool[:, -1] = rng.integers(0, 2**32, len(pool), dtype=np.uint32)
  words = jnp.asarray(np.concatenate([pool, rng.integers(0, 2**32, (9, num_words), dtype=np.uint32)]))
  _assert_same(_search(table, words, False), _search(table, words, True))
  for _ in range(rng.integers(1, 4)):
    keys = jnp.asarray(pool[rng.integers(0, len(pool), capacity)])
    table = _insert_rows(table, keys, [jnp.zeros(capacity, jnp.float32)])
    table = _remove_words(table, jnp.asarray(pool[rng.integers(0, len(pool), 3)]))
    _assert_same(_search(table, words, False), _search(table, words, True))


@pytest.mark.skipif(not native.ENABLED, reason="kernels off")
@pytest.mark.parametrize("num_words", [1, 2, 3])
def test_sampled_search_of_large_tables_equals_its_reference(num_words):
  """Tables of 4,096 rows or more are searched through a sample of every 64th row first:
  keys below, above and between the rows, equal leading words, every block's edges."""
  rng = np.random.default_rng(num_words)
  table = jr.SortedTable.create(6000, key=KEYS[num_words], value=jnp.float32)
  pool = rng.integers(0, 3, (5000, num_words), dtype=np.uint32) * (2**31)  # ties in leading words
  pool[:, -1] = rng.integers(1, 2**32 - 1, 5000, dtype=np.uint32)
  table = _insert_rows(table, jnp.asarray(pool), [jnp.zeros(5000, jnp.float32)])
  count = int(table.count)
  assert count >= 4096
  rows = np.asarray(table.keys)[:count]
  edges = rows[np.clip(np.arange(0, count + 64, 64)[:, None] + [-1, 0, 1], 0, count - 1).reshape(-1)]
  bumped = edges.copy()
  bumped[:, -1] += 1  # just above each edge row (between rows)
  extremes = np.array([[0] * num_words, [2**32 - 1] * num_words], np.uint32)
  words = jnp.asarray(np.concatenate([edges, bumped, extremes, rows[rng.integers(0, count, 300)]]))
  kernel, reference = _search(table, words, False), _search(table, words, True)
  _assert_same(kernel, reference)
  assert 0 < int(np.sum(reference[0])) < words.shape[0]


@pytest.mark.skipif(not native.ENABLED, reason="kernels off")
@pytest.mark.parametrize("num_words", [1, 2, 3])
@pytest.mark.parametrize("spread", ["even", "consecutive", "two clusters"])
def test_sampled_search_equals_its_reference_however_keys_spread(num_words, spread):
  """The sample's directory splits on the bits its keys do not share: keys spread evenly,
  consecutive keys (one shared prefix) and two far clusters all give the reference's bounds,
  for keys in the table, between its rows and outside its range."""
  rng = np.random.default_rng(7)
  pool = rng.integers(0, 2**32, (5000, num_words), dtype=np.uint32)
  if spread == "consecutive":
    pool[:] = 12345
    pool[:, -1] = 10**6 + 3 * rng.permutation(5000)
  elif spread == "two clusters":
    pool[:, 0] = np.where(rng.random(5000) < 0.5, 7, 2**32 - 7)
  table = jr.SortedTable.create(5000, key=KEYS[num_words], value=jnp.float32)
  table = _insert_rows(table, jnp.asarray(pool), [jnp.zeros(5000, jnp.float32)])
  rows = np.asarray(table.keys)[: int(table.count)]
  near = rows[rng.integers(0, len(rows), 600)]
  near[:300, -1] += rng.integers(0, 3, 300, dtype=np.uint32)  # on and just above rows
  everywhere = rng.integers(0, 2**32, (600, num_words), dtype=np.uint32)
  words = jnp.asarray(np.concatenate([near, everywhere, np.roll(near, 1, axis=1)]))
  kernel, reference = _search(table, words, False), _search(table, words, True)
  _assert_same(kernel, reference)
  assert 0 < int(np.sum(reference[0])) < words.shape[0]


@pytest.mark.skipif(not native.ENABLED, reason="kernels off")
@settings(max_examples=20, deadline=None)
@given(values=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=64), as_mask=st.booleans())
def test_prefix_sum_kernel_equals_numpy_cumsum(values, as_mask):
  """Running totals of int32 (wrapping like XLA's adds) and of masks, at a few padded lengths."""
  x = np.array(values + [0] * (-len(values) % 16), np.int32)
  x = x % 2 == 1 if as_mask else x
  with np.errstate(over="ignore"):
    expected = np.cumsum(x.astype(np.int32), dtype=np.int32)
  np.testing.assert_array_equal(jax.jit(claims.prefix_sum)(jnp.asarray(x)), expected)


@pytest.mark.skipif(not native.ENABLED, reason="kernels off")
@pytest.mark.parametrize(("num_words", "bucket_size"), [(1, 7), (1, 14), (2, 4), (2, 8), (2, 2)])
@pytest.mark.parametrize("capacity", [4096, 3000])
def test_large_batches_with_lost_claims_equal_the_reference(num_words, bucket_size, capacity):
  """2048 rows at once, some of present keys: many new keys lose their claim to another slot in
  the same scratch cell and retry in later rounds, some move on from full buckets; repeats meet
  on one slot. At capacity 3000 not every new key fits, and the first ones are admitted."""
  rng = np.random.default_rng(num_words * 10 + bucket_size)
  table = jr.OpenAddressingTable.create(
    capacity, key=KEYS[num_words], value=jnp.float32, bucket_size=bucket_size
  )
  present = rng.integers(0, 2**32, (1536, num_words), dtype=np.uint32)
  table = _insert_words(table, jnp.asarray(present))
  words = rng.integers(0, 2**32, (2048, num_words), dtype=np.uint32)
  words[1::7] = words[::7][: len(words[1::7])]  # repeats
  words[::11] = present[: len(words[::11])]
  words = jnp.asarray(words)
  active = jnp.ones(2048, bool)
  kernel, reference = _upsert(table, words, active, False), _upsert(table, words, active, True)
  _assert_same(kernel, reference)
  new = {tuple(w) for w in np.asarray(words)} - {tuple(w) for w in present}
  assert int(reference.dropped) == max(0, len(new) - (capacity - 1536))
  for last in (False, True):
    _assert_same(
      _owner(words, reference.admitted, False, last), _owner(words, reference.admitted, True, last)
    )


def _free_score_highest(table, scores):
  """``scores`` with every free slot's set to the highest, as a table keeps them (eviction_rounds)."""
  live = np.asarray(table.layout.occupancy(table.buckets[:, table.layout.mask_column])).reshape(-1)
  return jnp.asarray(np.where(live, scores, np.iinfo(np.uint32).max).astype(np.uint32))


@functools.partial(jax.jit, static_argnames=("reference", "layout", "window", "capacity"))
def _evict(layout, flat, scores, words, pending, new_score, named, reference, window=4, capacity=48):
  evict = eviction_rounds._evict_reference if reference else eviction_rounds.evict
  # As a table keeps them: floors with fixed windows wider than a bucket, else none.
  floors = eviction_rounds.floors_of(layout, scores) if (window or 1) > 1 else jnp.zeros((0,), jnp.uint32)
  return evict(layout, flat, scores, floors, words, pending, new_score, named, window, capacity)


def _assert_same_evictions(layout, kernel, reference):
  """The kernel's outcome is the reference's, bit for bit, and both keep every bucket's floor exact."""
  _assert_same(kernel, reference)
  if reference.floors.size:
    _assert_same(reference.floors, eviction_rounds.floors_of(layout, reference.scores))


# Each configuration compiles its own kernel call and reference (seconds each): every pair of
# values of (num_words, bucket_size, protect, window) meets in one of these nine, and the per-call
# window (None) runs with both capacities. Hypothesis draws the data.
EVICT_CONFIGS = [
  (1, 1, False, 1, 48),
  (2, 1, True, 32, 48),
  (2, 1, False, None, 4096),
  (2, 4, False, 1, 48),
  (1, 4, True, 32, 48),
  (1, 4, True, None, 48),
  (2, 8, True, 1, 48),
  (1, 8, False, 32, 48),
  (1, 8, True, None, 4096),
]


@pytest.mark.skipif(not native.ENABLED, reason="kernels off")
@pytest.mark.parametrize(("num_words", "bucket_size", "protect", "window", "capacity"), EVICT_CONFIGS)
@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_evict_kernel_equals_its_reference(num_words, bucket_size, protect, window, capacity, seed):
  """A full table's entries with random scores (ties included), a batch of present and new keys:
  new keys evict in either window, take free slots or their victims', lose claims and choose
  again, or are refused. Per-call windows (``None``) as wide as the pending rows' share of
  ``capacity`` makes them (16 or 1 here)."""
  rng = np.random.default_rng(seed)
  table = jr.OpenAddressingTable.create(
    48, key=KEYS[num_words], value=jnp.float32, bucket_size=bucket_size, eviction=jr.CustomScore()
  )
  stored = np.unique(rng.integers(0, 2**32, (48, num_words), dtype=np.uint32), axis=0)
  table = _insert_rows(table, jnp.asarray(stored), [jnp.zeros(len(stored), jnp.float32)])
  fresh = np.unique(rng.integers(0, 2**32, (40, num_words), dtype=np.uint32), axis=0)
  words = jnp.asarray(np.concatenate([stored[rng.integers(0, len(stored), 24)], fresh]))
  found, slot = _locate(table, words, True)
  scores = _free_score_highest(table, rng.integers(0, 6, table.num_slots, dtype=np.uint32))
  pending = ~found & jnp.asarray(rng.random(words.shape[0]) < 0.9)
  new_score = jnp.asarray(rng.integers(0, 8, words.shape[0], dtype=np.uint32))
  if not protect:  # unprotected, as under LRU: every key of the call has one score
    new_score = jnp.full(words.shape[0], 4, jnp.uint32)
  named = jnp.where(found, slot, -1) if protect else None
  args = (table.layout, table.buckets.reshape(-1), scores, words, pending, new_score, named)
  kernel, reference = (
    _evict(*args, reference=False, window=window, capacity=48 if window else capacity),
    _evict(*args, reference=True, window=window, capacity=48 if window else capacity),
  )
  _assert_same_evictions(table.layout, kernel, reference)
  assert int(np.sum(reference.placed)) > 0  # evictions happened


@pytest.mark.skipif(not native.ENABLED, reason="kernels off")
@pytest.mark.parametrize("protect", [False, True])
@pytest.mark.parametrize("window", [4, None])
def test_large_evicting_batches_equal_the_reference(protect, window):
  """3000 new keys on a full table of 4096 entries: claims lost to other victims in the same
  scratch cell, victims shared by several keys, rows beyond the first half-batch round; with a
  fixed window and with the per-call one (16 buckets here)."""
  rng = np.random.default_rng(5)
  table = jr.OpenAddressingTable.create(4096, key=KEYS[2], value=jnp.float32, eviction=jr.CustomScore())
  stored = rng.integers(0, 2**32, (4096, 2), dtype=np.uint32)
  table = _insert_rows(table, jnp.asarray(stored), [jnp.zeros(4096, jnp.float32)])
  words = jnp.asarray(np.concatenate([stored[:1000], rng.integers(0, 2**32, (3000, 2), dtype=np.uint32)]))
  found, slot = _locate(table, words, True)
  scores = _free_score_highest(table, rng.integers(0, 100, table.num_slots, dtype=np.uint32))
  new_score = jnp.asarray(rng.integers(0, 120, words.shape[0], dtype=np.uint32))
  if not protect:  # unprotected, as under LRU: every key of the call has one score
    new_score = jnp.full(words.shape[0], 50, jnp.uint32)
  named = jnp.where(found, slot, -1) if protect else None
  args = (table.layout, table.buckets.reshape(-1), scores, words, ~found, new_score, named)
  kernel, reference = (
    _evict(*args, reference=False, window=window, capacity=4096),
    _evict(*args, reference=True, window=window, capacity=4096),
  )
  _assert_same_evictions(table.layout, kernel, reference)
  assert int(np.sum(reference.placed)) > 1000 and int(np.sum(reference.refused)) > 0


@pytest.mark.skipif(not native.ENABLED, reason="kernels off")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int8, jnp.uint32, jnp.float16])
@pytest.mark.parametrize("shape", [(50,), (50, 3), (50, 2, 5)])
def test_read_rows_kernel_equals_take(dtype, shape):
  """Rows of leaves of several dtypes and widths, indices out of range clipped as jnp.take does."""
  rng = np.random.default_rng(len(shape))
  leaf = jnp.asarray(rng.integers(-100, 100, shape)).astype(dtype)
  index = jnp.asarray(rng.integers(-5, 60, 37), jnp.int32)
  (same,), (got,) = jax.jit(row_ops.read_rows)([leaf], index)
  np.testing.assert_array_equal(np.asarray(same), np.asarray(leaf))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.take(leaf, index, axis=0, mode="clip")))


@pytest.mark.skipif(not native.ENABLED, reason="kernels off")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int8, jnp.uint32, jnp.float16])
@pytest.mark.parametrize("shape", [(50,), (50, 3), (50, 2, 5)])
def test_take_rows_kernel_equals_take(dtype, shape):
  rng = np.random.default_rng(len(shape))
  leaf = jnp.asarray(rng.integers(-100, 100, shape)).astype(dtype)
  index = jnp.asarray(rng.integers(-5, 60, (37,)), jnp.int32)
  (got,) = jax.jit(row_ops.take_rows)([leaf], index)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.take(leaf, index, axis=0, mode="clip")))


@pytest.mark.skipif(not native.ENABLED, reason="kernels off")
@settings(max_examples=25, deadline=None)
@given(
  seed=st.integers(0, 2**16),
  n=st.sampled_from([1, 2, 17, 64, 65, 300]),  # 48 shapes with the widths and dtypes; both sides of 64
  groups=st.sampled_from([1, 3, 40, 1 << 20, 2**31 - 1]),
  dtype=st.sampled_from([np.float32, np.float64]),
  width=st.sampled_from([(), (1,), (5,), (2, 3)]),
)
def test_group_sums_kernel_equals_its_reference(seed, n, groups, dtype, width):
  """Bit for bit: groups repeated many times (deep trees), rows of no group, values of every scale."""
  rng = np.random.default_rng(seed)
  group_of = rng.integers(0, groups, n).astype(np.int32)
  group_of[rng.random(n) < 0.1] = -1
  scale = 10.0 ** rng.integers(-30, 30, (n, *[1] * len(width)))
  x = (rng.normal(size=(n, *width)) * scale).astype(dtype)
  kernel = jax.jit(grouping.group_sums)(group_of, x)
  reference = jax.jit(grouping._group_sums)(group_of, x)
  _assert_same(kernel, reference)
  live = sorted(set(group_of[group_of >= 0].tolist()))
  assert np.asarray(kernel[0]).tolist() == live + [-1] * (n - len(live))


@pytest.mark.skipif(not native.ENABLED, reason="kernels off")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int8, jnp.float16])
@pytest.mark.parametrize("shape", [(40,), (40, 3), (40, 2, 5)])
def test_write_rows_kernel_equals_its_reference_and_a_loop(dtype, shape):
  """Rows written in batch order: repeated indices (the last masked one wins), masked rows and
  indices out of range (dropped), checked against the XLA reference and a Python loop."""
  rng = np.random.default_rng(len(shape))
  leaf = np.asarray(rng.integers(-100, 100, shape)).astype(dtype)
  index = rng.integers(-3, 45, 90).astype(np.int32)
  index[::9] = index[1::9][: len(index[::9])]  # repeats
  new = np.asarray(rng.integers(-100, 100, (90, *shape[1:]))).astype(dtype)
  mask = rng.random(90) < 0.8
  expected = leaf.copy()
  for i in range(90):
    if mask[i] and 0 <= index[i] < shape[0]:
      expected[index[i]] = new[i]
  (got,) = jax.jit(row_ops.write_rows)([jnp.asarray(leaf)], index, [jnp.asarray(new)], jnp.asarray(mask))
  np.testing.assert_array_equal(np.asarray(got), expected)
  (reference,) = jax.jit(row_ops._write_rows_reference)(index, mask, leaf, new)
  np.testing.assert_array_equal(np.asarray(reference), expected)
  # several leaves in one call: each gets its own rows
  other, other_rows = leaf[::-1].copy(), new[::-1].copy()
  both = jax.jit(row_ops.write_rows)([jnp.asarray(leaf), jnp.asarray(other)], index, [new, other_rows], mask)
  np.testing.assert_array_equal(np.asarray(both[0]), expected)
  expected_other = other.copy()
  for i in range(90):
    if mask[i] and 0 <= index[i] < shape[0]:
      expected_other[index[i]] = other_rows[i]
  np.testing.assert_array_equal(np.asarray(both[1]), expected_other)


_RUN = """
import sys, numpy as np, jax, jax.numpy as jnp
import jaxres as jr
rng = np.random.default_rng(7)
out = {}
pair = jax.ShapeDtypeStruct((2,), jnp.uint32)
runs = [("i32", jnp.int32, (700,), 8, None), ("pair", pair, (700, 2), 4, None),
        ("sorted", pair, (700, 2), None, None),
        ("lru", pair, (700, 2), 8, jr.LRU()), ("lfu", jnp.int32, (700,), 8, jr.LFU())]
for name, key, shape, bucket_size, eviction in runs:
  value = jax.ShapeDtypeStruct((3,), jnp.float32)
  if bucket_size is None:
    t = jr.SortedTable.create(300, key=key, value=value)
  else:
    t = jr.OpenAddressingTable.create(300, key=key, value=value, bucket_size=bucket_size, eviction=eviction)
  pool = rng.integers(0, 2**31 - 1, shape).astype(np.int32 if key == jnp.int32 else np.uint32)
  for step in range(12):
    k = pool[rng.integers(0, 700, 64)]
    v = rng.random((64, 3), dtype=np.float32)
    t, got = t.find_or_insert(k, v)
    out[f"{name}/foi{step}"] = np.asarray(got)
    t = t.insert(pool[rng.integers(0, 700, 32)], rng.random((32, 3), dtype=np.float32))
    t = t.remove(pool[rng.integers(0, 700, 24)])
    t = t.assign(pool[rng.integers(0, 700, 16)], rng.random((16, 3), dtype=np.float32))
  for i, leaf in enumerate(jax.tree.leaves(t)):
    out[f"{name}/leaf{i}"] = np.asarray(leaf)
  out[f"{name}/counts"] = np.array([int(t.size), int(t.dropped), int(getattr(t, "evictions", 0))])
  out[f"{name}/find"] = np.asarray(t.find(pool))
  out[f"{name}/contains"] = np.asarray(t.contains(pool))
np.savez(sys.argv[1], **out)
"""


def _run(tmp_path, kernels: str):
  path = tmp_path / f"run{kernels}.npz"
  env = {**os.environ, "JAXRES_KERNELS": kernels, "JAX_PLATFORMS": "cpu"}
  subprocess.run([sys.executable, "-c", _RUN, str(path)], check=True, env=env, cwd=ROOT, timeout=HANG_GUARD_S)
  return dict(np.load(path))


def test_kernels_on_and_off_leave_identical_tables(tmp_path):
  on, off = _run(tmp_path, "1"), _run(tmp_path, "0")
  assert on.keys() == off.keys()
  for name in on:
    np.testing.assert_array_equal(on[name], off[name], err_msg=name)
  assert on["i32/counts"][0] > 250  # the tables filled up: dropped keys and full buckets were exercised
  assert on["i32/counts"][1] > 0
  assert on["lru/counts"][2] > 0 and on["lfu/counts"][2] > 0  # full tables evicted


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_a_cpu_process_exports_table_calls_for_other_platforms(platform):
  """The kernel or its reference is chosen when a program is lowered, so this CPU-only process
  exports a table call for another platform with no kernel in it."""
  table = jr.OpenAddressingTable.create(8, key=jnp.int32, value=jnp.float32)
  keys = jnp.arange(4, dtype=jnp.int32)
  step = jax.jit(lambda t, k: t.find_or_insert(k, k * 1.0)[1])
  step(table, keys)  # traced and compiled for this CPU first
  exported = jax.export.export(step, platforms=[platform])(table, keys)
  assert "jaxres_" not in exported.mlir_module()
