"""ShardedTable on fake CPU devices, against the dict oracle and unsharded tables."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracle import KINDS, DictTable, Sharded, entries, mesh_of, run_random_operations

import jaxres as jr
from jaxres._core.sharding.routing import owner_of, shard_capacity_for

_KINDS = {k.name: k for k in KINDS}
_ROW = jax.ShapeDtypeStruct((2,), jnp.float32)


@pytest.mark.parametrize(
  ("storage", "kind"),
  [(jr.OpenAddressingTable, "int64"), (jr.SortedTable, "pair_int32")],
  ids=["OpenAddressingTable-int64", "SortedTable-pair_int32"],
)
def test_random_operations_match_dict(storage, kind):
  kind = _KINDS[kind]
  capacity = 256  # above the 240 keys drawn: no shard ever fills
  table, model = kind.create(Sharded(storage), capacity), DictTable(kind, capacity)
  run_random_operations(table, model, np.random.default_rng(7), steps=30)


def _zipf_ids(rng, n):
  """n 64-bit ids with Zipf frequencies (a few ids very hot, a long tail)."""
  ranks = rng.zipf(1.3, size=n).astype(np.uint64)
  return (ranks * np.uint64(0x9E3779B97F4A7C15)).view(np.int64)  # spread over the int64 range


def _step(table, ids, counts):
  """A training-style update: ids get rows, counts accumulate, every third id is forgotten."""
  table, rows = table.find_or_insert(ids, jnp.zeros((ids.shape[0], 2), jnp.float32))
  table = table.insert_or_apply(ids, jnp.stack([counts, counts], axis=1), jnp.add)
  table = table.remove(ids[::3])
  return table, rows, table.lookup(ids)


@pytest.mark.parametrize("mesh_shape", [(3,), (2, 4)], ids=["3", "2x4"])
def test_jitted_steps_match_an_unsharded_table(mesh_shape):
  names = ("shard",) if len(mesh_shape) == 1 else ("replica", "shard")
  mesh = jax.make_mesh(mesh_shape, names, devices=jax.devices()[: int(np.prod(mesh_shape))])
  sharded = jr.ShardedTable.create(mesh, "shard", 256, key=jnp.int64, value=_ROW)
  plain = jr.OpenAddressingTable.create(256, key=jnp.int64, value=_ROW)
  traces = []
  step = jax.jit(lambda *args: traces.append(1) or _step(*args))
  rng = np.random.default_rng(0)
  for _ in range(3):
    ids = jr.keys.split64(_zipf_ids(rng, 50))  # word pairs: the x64-off form inside jit
    counts = jnp.asarray(rng.integers(1, 5, 50), jnp.float32)
    sharded, *got = step(sharded, ids, counts)
    plain, *want = step(plain, ids, counts)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert entries(sharded) == entries(plain)
  assert int(sharded.size) == int(plain.size) == int(np.sum(sharded.size_per_shard))
  assert len(traces) == 2  # one per table type: later steps reuse the first compile


def test_full_shards_count_their_dropped_keys():
  keys = np.arange(1000, 1064, dtype=np.int32)
  empty = jr.ShardedTable.create(mesh_of(8), "shard", 16, key=jnp.int32, value=jnp.int32, shard_capacity=2)
  table = empty.insert(keys, keys)
  # Oracle: per shard, a loop admits that shard's first two keys in batch order.
  owner = np.asarray(owner_of(empty.key_spec.encode(keys)[0], 8))
  admitted = {int(k) for s in range(8) for k in keys[owner == s][:2]}
  dropped = [max(0, int(np.sum(owner == s)) - 2) for s in range(8)]
  assert set(entries(table)) == {(k,) for k in admitted}
  np.testing.assert_array_equal(table.dropped_per_shard, dropped)
  assert int(table.dropped) == len(keys) - len(admitted)


def test_a_zipf_stream_fits_the_sizing_rule():
  rng = np.random.default_rng(1)
  stream = _zipf_ids(rng, 8000)
  distinct, counts = np.unique(stream, return_counts=True)
  table = jr.ShardedTable.create(mesh_of(8), "shard", len(distinct), key=jnp.int64, value=jnp.int32)
  assert table.shard_capacity == shard_capacity_for(len(distinct), 8)
  add = jax.jit(lambda t, ids: t.insert_or_apply(ids, jnp.ones(ids.shape[0], jnp.int32), jnp.add))
  for batch in np.split(stream, 8):
    table = add(table, jr.keys.split64(batch))
  assert int(table.dropped) == 0 and int(table.size) == len(distinct)
  assert int(np.max(table.size_per_shard)) <= table.shard_capacity
  np.testing.assert_array_equal(table.find(distinct), counts)


def test_shard_capacity_rule():
  assert shard_capacity_for(8_000, 8) == 1_190  # mean 1000 + 6 standard deviations (sqrt 1000)
  assert shard_capacity_for(4, 2) == 4  # never above the total
  assert shard_capacity_for(1 << 30, 1) == 1 << 30


def test_checkpoint_round_trip_8_4_8_devices(tmp_path):
  rng = np.random.default_rng(2)
  keys = rng.integers(-(2**62), 2**62, 300, dtype=np.int64)
  rows = rng.normal(size=(300, 2)).astype(np.float32)

  def fresh(num_devices):
    return jr.ShardedTable.create(mesh_of(num_devices), "shard", 400, key=jnp.int64, value=_ROW)

  root = jr.AutoTrackable()
  root.table = fresh(8).insert(keys, rows)
  before = entries(root.table)
  jr.Checkpoint(model=root).save(tmp_path / "on8")
  (node,) = [e for e in jr.inspect_checkpoint(tmp_path / "on8") if e["path"] == "model/table"]
  shapes = {a["name"]: a["shape"] for a in node["arrays"]}
  # Live entries only: one block per shard, as wide as the fullest shard's live entries.
  widest = int(root.table.size_per_shard.max())
  assert shapes["blocks/keys"] == [8, widest, 2] and shapes["counts"] == [8] and widest < 300 // 4

  on4 = jr.AutoTrackable()
  on4.table = fresh(4)
  jr.Checkpoint(model=on4).restore(tmp_path / "on8").assert_consumed()
  assert on4.table.num_shards == 4 and entries(on4.table) == before
  jr.Checkpoint(model=on4).save(tmp_path / "on4")

  deferred = jr.AutoTrackable()
  status = jr.Checkpoint(model=deferred).restore(tmp_path / "on4")
  assert status.pending == ["model/table"]
  deferred.table = fresh(8)  # restored on attach, re-partitioned over 8 devices
  status.assert_consumed()
  assert entries(deferred.table) == before  # nothing lost, nothing duplicated
  np.testing.assert_array_equal(deferred.table.size_per_shard, root.table.size_per_shard)

  unsharded = jr.AutoTrackable()
  unsharded.table = jr.SortedTable.create(300, key=jnp.int64, value=_ROW)
  jr.Checkpoint(model=unsharded).restore(tmp_path / "on4").assert_consumed()
  assert entries(unsharded.table) == before


def test_restoring_into_a_table_that_cannot_hold_it_changes_nothing(tmp_path):
  root = jr.AutoTrackable()
  root.table = jr.ShardedTable.create(mesh_of(8), "shard", 64, key=jnp.int32, value=jnp.float32)
  root.table = root.table.insert(jnp.arange(40), jnp.ones(40))
  jr.Checkpoint(model=root).save(tmp_path / "c")
  small = jr.AutoTrackable()
  small.table = jr.OpenAddressingTable.create(8, key=jnp.int32, value=jnp.float32)
  with pytest.raises(ValueError, match="model/table: 40 entries do not fit"):
    jr.Checkpoint(model=small).restore(tmp_path / "c")
  assert int(small.table.size) == 0
  other = jr.AutoTrackable()
  other.table = jr.ShardedTable.create(mesh_of(8), "shard", 64, key=jnp.int64, value=jnp.float32)
  with pytest.raises(ValueError, match="model/table: keys: the checkpoint holds int32 keys, the table int64"):
    jr.Checkpoint(model=other).restore(tmp_path / "c")
  assert int(other.table.size) == 0


def test_bad_arguments_are_clear_errors():
  mesh = mesh_of(8)
  with pytest.raises(TypeError, match=r"mesh: expected a jax\.sharding\.Mesh"):
    jr.ShardedTable.create(jax.devices(), "shard", 16, key=jnp.int32, value=jnp.float32)
  with pytest.raises(ValueError, match="axis: 'rows' is not an axis"):
    jr.ShardedTable.create(mesh, "rows", 16, key=jnp.int32, value=jnp.float32)
  with pytest.raises(TypeError, match="storage: expected"):
    jr.ShardedTable.create(mesh, "shard", 16, key=jnp.int32, value=jnp.float32, storage=dict)
  with pytest.raises(ValueError, match="shard_capacity"):
    jr.ShardedTable.create(mesh, "shard", 16, key=jnp.int32, value=jnp.float32, shard_capacity=0)
  table = jr.ShardedTable.create(mesh, "shard", 16, key=jnp.int64, value=jnp.float32)
  table = table.insert(np.array([2**40]), np.array([1.0], np.float32))
  with pytest.raises(TypeError, match="keys"):
    table.insert(jnp.array([1], jnp.int32), jnp.array([2.0]))  # a truncated 64-bit key
  assert entries(table) == {(2**40,): [1.0]}


def test_scalars_empty_batches_and_dynamic_defaults():
  table = jr.ShardedTable.create(mesh_of(8), "shard", 16, key=jnp.int32, value=jnp.float32, default=-1.0)
  assert table.insert(jnp.zeros((0,), jnp.int32), jnp.zeros((0,))) is table
  table = table.insert(jnp.int32(5), jnp.float32(2.5))
  assert float(table.find(jnp.int32(5))) == 2.5
  assert table.find(jnp.array([[5, 6]])).tolist() == [[2.5, -1.0]]
  assert table.find(jnp.array([5, 6]), default=jnp.array([9.0, 8.0])).tolist() == [2.5, 8.0]
  assert table.contains(jnp.zeros((0,), jnp.int32)).shape == (0,)


def _skewed_batches(rng, pool, hot, n=512):
  """Batches where ``hot`` keys fill most rows (a few repeated very often), with padding rows."""
  for _ in range(3):
    keys = np.where(rng.random(n) < 0.7, rng.choice(hot, n), rng.choice(pool, n))
    yield keys, rng.random(n) < 0.9


def _same_calls(sharded, plain, keys, valid, rng):
  """Every routed call on both tables: outputs compared row by row, then returned tables."""
  n = keys.shape[0]
  floats = jnp.asarray(rng.standard_normal((n, 2)), jnp.float32)
  counts = jnp.asarray(rng.integers(-5, 5, (n, 2)), jnp.int32)
  outputs = []
  for name, call in [
    ("find_or_insert", lambda t: t.find_or_insert(keys, {"f": floats, "i": counts}, valid=valid)),
    ("insert", lambda t: (t.insert(keys[::2], {"f": floats[::2], "i": counts[::2]}), None)),
    ("apply float", lambda t: (t.insert_or_apply(keys, {"f": floats, "i": counts}, _add_f), None)),
    (
      "assign",
      lambda t: (t.assign(keys[1::3], {"f": floats[1::3], "i": counts[1::3]}, valid=valid[1::3]), None),
    ),
    ("remove", lambda t: (t.remove(keys[::7]), None)),
    ("find", lambda t: (t, t.find(keys))),
    ("contains", lambda t: (t, t.contains(keys))),
  ]:
    sharded, got = call(sharded)
    plain, want = call(plain)
    outputs.append((name, got, want))
  for name, got, want in outputs:
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
  assert entries(sharded) == entries(plain)
  return sharded, plain


def _add_f(old, new):  # folds floats in order (not an exact reduction), sums integers
  return {"f": old["f"] + new["f"], "i": old["i"] + new["i"]}


_VALUE = {"f": jax.ShapeDtypeStruct((2,), jnp.float32), "i": jax.ShapeDtypeStruct((2,), jnp.int32)}


@pytest.mark.parametrize("skew", ["hot keys", "one owner"])
def test_skewed_batches_equal_an_unsharded_table(skew):
  """Rows far beyond a device's share go to one owner: they take further routing rounds, and
  every output, entry and count equals an unsharded table's."""
  rng = np.random.default_rng(3)
  pool = rng.integers(-(2**40), 2**40, 2000)
  sharded = jr.ShardedTable.create(
    mesh_of(8), "shard", 1024, key=jnp.int64, value=_VALUE, shard_capacity=1024
  )
  if skew == "one owner":  # every key of the batch lives on shard 0
    pool = pool[np.asarray(owner_of(sharded.key_spec.encode(pool)[0], 8)) == 0]
    hot = pool[:40]
  else:
    hot = pool[:3]
  plain = jr.OpenAddressingTable.create(1024, key=jnp.int64, value=_VALUE)
  for keys, valid in _skewed_batches(rng, pool, hot):
    sharded, plain = _same_calls(sharded, plain, keys, valid, rng)


def test_repeated_keys_with_integer_sums_and_given_scores_equal_an_unsharded_table():
  """An exact reduction (integer add) travels once per key and device; given scores take the
  last occurrence's; full shards evict as full tables do, reporting on the same rows."""
  rng = np.random.default_rng(4)
  pool = rng.integers(0, 2**31, 1000)
  sharded = jr.ShardedTable.create(
    mesh_of(4), "shard", 4 * 64, key=jnp.int64, value=jnp.int32, eviction=jr.CustomScore(), shard_capacity=64
  )
  # The oracle: per shard, an unsharded table of 64 entries fed that shard's rows in batch order,
  # padded to the batch's length as the shard's own (the rounds of eviction follow the length).
  shards = [jr.OpenAddressingTable.create(64, key=jnp.int64, value=jnp.int32, eviction=jr.CustomScore())] * 4

  def padded(mask, *columns):
    order = np.argsort(~mask, kind="stable")  # the shard's rows first, in batch order
    return (*(c[order] for c in columns), np.arange(mask.size) < mask.sum())

  for _ in range(3):
    keys, more = rng.choice(pool, 400), rng.choice(pool, 200)
    values = rng.integers(-9, 9, 400).astype(np.int32)
    scores = rng.integers(0, 50, 400).astype(np.uint32)
    sharded = sharded.insert_or_apply(keys, values, jnp.add, scores=scores)
    sharded, evicted = sharded.insert_and_evict(more, values[:200], scores=scores[:200])
    owner, owner_more = (np.asarray(owner_of(sharded.key_spec.encode(k)[0], 4)) for k in (keys, more))
    want_keys, want_valid = np.zeros(200, np.int64), np.zeros(200, bool)
    for s in range(4):
      k, v, c, valid = padded(owner == s, keys, values, scores)
      shards[s] = shards[s].insert_or_apply(k, v, jnp.add, valid=valid, scores=c)
      mine = owner_more == s
      k, v, c, valid = padded(mine, more, values[:200], scores[:200])
      shards[s], part = shards[s].insert_and_evict(k, v, valid=valid, scores=c)
      want_keys[mine] = np.asarray(part.keys)[valid]
      want_valid[mine] = np.asarray(part.valid)[valid]
    np.testing.assert_array_equal(np.asarray(evicted.valid), want_valid)
    np.testing.assert_array_equal(np.asarray(evicted.keys), want_keys)
    assert want_valid.any()  # the shards were full and evicted
  want = {}
  for shard in shards:
    want.update(entries(shard))
  assert entries(sharded) == want
  np.testing.assert_array_equal(sharded.scores(pool), sum(np.asarray(s.scores(pool)) for s in shards))


@pytest.mark.parametrize("eviction", [None, jr.LRU()], ids=["plain", "LRU"])
def test_an_empty_sharded_table_round_trips(tmp_path, eviction):
  def root():
    root = jr.AutoTrackable()
    root.table = jr.ShardedTable.create(
      mesh_of(4), "shard", 16, key=jnp.int64, value=jnp.float32, eviction=eviction
    )
    return root

  path = jr.Checkpoint(model=root()).save(tmp_path / "ckpt")
  fresh = root()
  jr.Checkpoint(model=fresh).restore(path).assert_consumed()
  assert int(fresh.table.size) == 0
