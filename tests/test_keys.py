"""64-bit keys and values stay exact with jax_enable_x64 off and on.

This module runs in the main suite (x64 off, JAX's default) and again in a
subprocess with JAX_ENABLE_X64=1 (see ``test_x64_suite``), together with the
64-bit cases of the oracle tests and the stateful tables' dtype combinations.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from children import HANG_GUARD_S
from oracle import STORAGES

import jaxres as jr
from jaxres._core.encoding.key_specs import KeySpec

X64 = bool(jax.config.read("jax_enable_x64"))
EDGE_INT64 = np.array([-(2**63), -(2**32) - 1, -1, 0, 2**31, 2**32 + 7, 2**63 - 1], np.int64)


def test_split_join_round_trip():
  pairs = jr.keys.split64(EDGE_INT64)
  assert pairs.dtype == jnp.uint32 and pairs.shape == (7, 2)
  assert pairs[2].tolist() == [2**32 - 1, 2**32 - 1]  # -1: all ones
  np.testing.assert_array_equal(np.asarray(jr.keys.join64(pairs, np.int64)), EDGE_INT64)
  big = np.array([2**64 - 1, 2**63], np.uint64)
  np.testing.assert_array_equal(np.asarray(jr.keys.join64(jr.keys.split64(big), np.uint64)), big)
  with pytest.raises(TypeError, match="x"):
    jr.keys.split64(np.ones(2))
  with pytest.raises(TypeError, match="pairs"):
    jr.keys.join64(np.ones((2, 3), np.uint32))


@pytest.mark.parametrize(
  "key", [np.int32, np.uint32, np.int64, np.uint64, jax.ShapeDtypeStruct((2,), np.int64)], ids=str
)
def test_keys_decoded_on_the_host_equal_those_decoded_by_jax(key):
  spec = KeySpec.parse(key)
  info = np.iinfo(spec.dtype)
  keys = np.random.default_rng(0).integers(info.min, info.max, (3, 4, *spec.shape), spec.dtype, endpoint=True)
  keys.reshape(-1)[:2] = info.min, info.max
  words, batch = spec.encode(keys)
  host = spec.decode_host(words)
  assert batch == (3, 4) and host.dtype == spec.dtype and isinstance(host, np.ndarray)
  np.testing.assert_array_equal(host, keys)
  np.testing.assert_array_equal(np.asarray(spec.decode(jnp.asarray(words))), keys)


@pytest.mark.parametrize("storage", STORAGES)
def test_int64_keys_and_values_exact_on_the_host(storage):
  t = storage.create(16, key=jnp.int64, value=jnp.int64, default=-7)
  values = EDGE_INT64[::-1].copy()
  t = t.insert(EDGE_INT64, values)
  np.testing.assert_array_equal(np.asarray(t.find(EDGE_INT64)), values)
  # Keys differing only in the high word must not collide.
  assert not bool(t.contains(np.array([2**32], np.int64)))
  keys, got, valid = t.export()
  assert np.asarray(keys).dtype == np.int64 and np.asarray(got).dtype == np.int64
  order = np.argsort(np.asarray(keys)[np.asarray(valid)])
  np.testing.assert_array_equal(np.sort(np.asarray(keys)[np.asarray(valid)]), np.sort(EDGE_INT64))
  if storage is jr.SortedTable:
    np.testing.assert_array_equal(order, np.arange(7))


@pytest.mark.parametrize("storage", STORAGES)
def test_int64_keys_inside_jit(storage):
  t = storage.create(16, key=jnp.uint64, value=jnp.float32, default=0.0)
  keys = np.array([2**64 - 1, 1, 2**40], np.uint64)
  arg = jnp.asarray(keys) if X64 else jr.keys.split64(keys)

  @jax.jit
  def step(t, k):
    t = t.insert(k, jnp.array([1.0, 2.0, 3.0]))
    return t, t.find(k), t.export()[0]

  t, found, exported = step(t, arg)
  assert found.tolist() == [1.0, 2.0, 3.0]
  if X64:
    assert exported.dtype == jnp.uint64
    assert sorted(np.asarray(exported)[:3].tolist()) == sorted(keys.tolist())
  else:
    assert exported.dtype == jnp.uint32 and exported.shape == (16, 2)
    assert sorted(np.asarray(jr.keys.join64(exported[:3], np.uint64)).tolist()) == sorted(keys.tolist())


def test_truncated_int32_is_rejected_in_both_modes():
  t = jr.OpenAddressingTable.create(8, key=jnp.int64, value=jnp.float32)
  with pytest.raises(TypeError, match="keys"):
    t.insert(jnp.array([1, 2], jnp.int32), jnp.ones(2))
  with pytest.raises(TypeError, match="keys"):
    t.find(np.array([1, 2], np.int32))


def test_float64_values_follow_jax_precision():
  t = jr.OpenAddressingTable.create(8, key=jnp.int32, value=jnp.float64)
  t = t.insert(np.array([1], np.int32), np.array([0.1], np.float64))
  got = t.find(np.array([1], np.int32))
  assert got.dtype == (jnp.float64 if X64 else jnp.float32)
  assert float(got[0]) == (0.1 if X64 else float(np.float32(0.1)))


# The 64-bit tests again, in two processes (so xdist can run them side by side).
_X64_SELECTIONS = {
  "tables": [
    "test_keys.py",
    "test_table.py::test_random_operations_match_dict[kernels-int64-OpenAddressingTable]",
    "test_table.py::test_random_operations_match_dict[kernels-uint64-SortedTable]",
    "test_table.py::test_random_operations_match_dict[references-pair_int64-OpenAddressingTable]",
    "test_mutable_table.py::test_seed_dtype_combinations",
    "test_static_tables.py::test_vocabulary_with_integer_keys_inside_jit",
    "test_eviction.py::test_export_if_streams_the_matching_entries_first_chunk_by_chunk",
  ],
  "training": [
    "test_examples.py::test_restart_with_deferred_restore_continues_bitwise",
    "test_embedding.py::test_int64_ids_with_equal_low_words_get_distinct_rows",
    "test_string_ids.py::test_training_with_string_ids_equals_the_encoded_composite_key_run",
    "test_string_ids.py::test_the_collection_takes_string_tables",
    "test_eviction.py::test_runs_are_deterministic",
    "test_sharded.py::test_checkpoint_round_trip_8_4_8_devices",
    "test_memory.py::test_embedding_memory_sums_to_its_state_before_and_after_a_step",
    "test_memory.py::test_capacity_for_is_the_largest_capacity_that_fits",
  ],
}


@pytest.mark.slow
@pytest.mark.skipif(X64, reason="this is the launcher of the x64 run")
@pytest.mark.parametrize("group", sorted(_X64_SELECTIONS))
def test_x64_suite(group):
  """The 64-bit tests again, in a process with jax_enable_x64 on."""
  here = os.path.dirname(__file__)
  env = {**os.environ, "JAX_ENABLE_X64": "1"}
  selection = _X64_SELECTIONS[group]
  cmd = [
    sys.executable,
    "-m",
    "pytest",
    "-q",
    "-p",
    "no:xdist",
    "-p",
    "no:cacheprovider",
    "-k",
    "64 or not (random or seed_dtype)",  # the 64-bit kinds and dtype combinations
  ]
  result = subprocess.run(
    cmd + selection, cwd=here, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S
  )
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  assert " passed" in result.stdout
