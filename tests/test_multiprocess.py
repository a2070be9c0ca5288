"""Sharded tables over two local processes (jax.distributed, 4 CPU devices each, gloo).

Each test starts two worker processes that run one script together; they
print one JSON line each. Checkpoints written by both are then restored here,
in the test's own process (8 CPU devices), onto other meshes.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from children import HANG_GUARD_S, progress
from multiprocess_table import KEYS, VALUE, changed, empty_table, table_at
from oracle import entries, mesh_of

import jaxres as jr
from jaxres._persistence import files

ROOT = Path(__file__).resolve().parents[1]

PRELUDE = """
import json, sys
import jax
from children import HANG_GUARD_S  # the tests' folder is the working directory
process_id, port, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(  # JAX's own limits (300 s) on the other process starting and finishing: guards
  f"localhost:{port}", num_processes=2, process_id=process_id,
  initialization_timeout=HANG_GUARD_S, shutdown_timeout_seconds=HANG_GUARD_S,
)
import jax.numpy as jnp, numpy as np
import jaxres as jr

sys.path.insert(0, ".")  # the tests' folder
mesh = jax.make_mesh((jax.device_count(),), ("shard",))  # 8 devices, 4 per process
replicated = lambda x: np.asarray(x.addressable_shards[0].data).tolist()
"""

SHARE_ONE_TABLE = """
def share_one_table():
  table = jr.ShardedTable.create(mesh, "shard", 256, key=jnp.int64, value=jnp.int32)
  keys = np.arange(-50, 50, dtype=np.int64) * 2**40  # the same batch on every process
  table = table.insert(keys, np.arange(100, dtype=np.int32))
  table, rows = table.find_or_insert(np.array([-50 * 2**40, 7], np.int64), np.array([-1, 77], np.int32))
  table = table.remove(keys[::2])
  found = table.find(np.array([keys[0], keys[1], 7], np.int64))
  return {
    "devices": [jax.device_count(), jax.local_device_count()],
    "size": int(table.size), "rows": replicated(rows), "found": replicated(found),
  }

shared = share_one_table()  # printed by the script that follows (the same two processes)
"""

SAVE_TOGETHER = """
from jaxres._tracking import orbax_io
from multiprocess_table import VALUE, changed, empty_table, table_at
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec
by_rows = NamedSharding(mesh, PartitionSpec("shard"))
root = jr.AutoTrackable()
root.table, root.step = table_at(0, mesh), jnp.array(0)
root.weights = jax.device_put(np.arange(16, dtype=np.float32).reshape(8, 2), by_rows)  # over both processes
jr.Checkpoint(model=root).save(path + "/ckpt")
del root.weights
manager = jr.CheckpointManager(path + "/run", jr.Checkpoint(model=root), max_to_keep=2)
for step in (1, 2, 3):
  root.table, root.step = table_at(step, mesh), jnp.array(step)
  manager.save(step)
manager.wait_until_finished()

fresh = jr.AutoTrackable()
status = jr.CheckpointManager(path + "/run", jr.Checkpoint(model=fresh)).restore()
fresh.table, fresh.step = empty_table(mesh), jnp.array(-1)  # restored on attach, by both processes
status.assert_consumed()
jr.Checkpoint(model=fresh).save(path + "/again")  # what they restored, for the test to read

single = jr.AutoTrackable()  # saved by the test's own process, on 8 devices
single.table, single.step = empty_table(mesh), jnp.array(-1)
jr.Checkpoint(model=single).restore(path + "/single").assert_consumed()
jr.Checkpoint(model=single).save(path + "/single_again")

weights = jr.AutoTrackable()
weights.weights = jax.device_put(np.zeros((8, 2), np.float32), by_rows)
# Whole on each process:
weights.table = jr.OpenAddressingTable.create(400, key=jnp.int64, value=VALUE, eviction=jr.LRU())
jr.Checkpoint(model=weights).restore(path + "/ckpt").expect_partial()
gathered = np.asarray(multihost_utils.process_allgather(weights.weights, tiled=True)).tolist()
del weights.weights
jr.Checkpoint(model=weights).save(path + "/unsharded_again")

bigger = jr.AutoTrackable()  # another capacity: the entries go to their owners through the routing
bigger.table = jr.ShardedTable.create(mesh, "shard", 1000, key=jnp.int64, value=VALUE, eviction=jr.LRU())
jr.Checkpoint(model=bigger).restore(path + "/ckpt").expect_partial()
jr.Checkpoint(model=bigger).save(path + "/bigger_again")
# A table whose replicas are the two processes (each holds all 4 shards), restored at another capacity.
replicas = jax.make_mesh((2, 4), ("replica", "shard"))
copies = jr.AutoTrackable()
copies.table = table_at(2, replicas)
jr.Checkpoint(model=copies).save(path + "/replicas")
copies.table = jr.ShardedTable.create(replicas, "shard", 600, key=jnp.int64, value=VALUE, eviction=jr.LRU())
jr.Checkpoint(model=copies).restore(path + "/replicas").assert_consumed()
jr.Checkpoint(model=copies).save(path + "/replicas_again")

# Incremental steps: each process writes its own shards' changes, and composes its own at restore.
steady = jr.AutoTrackable()
steady.table, steady.step = table_at(0, mesh), jnp.array(0)
chain = jr.CheckpointManager(path + "/incremental", jr.Checkpoint(model=steady), incremental=True)
chain.save(0)
for step in (1, 2, 3):
  steady.table, steady.step = changed(steady.table, step), jnp.array(step)
  chain.save(step)
chain.wait_until_finished()
for step in (1, 2, 3):  # each step composed by both processes, each reading its own shards
  composed = jr.AutoTrackable()
  composed.table, composed.step = empty_table(mesh), jnp.array(-1)
  jr.CheckpointManager(path + "/incremental", jr.Checkpoint(model=composed)).restore(step).assert_consumed()
  jr.Checkpoint(model=composed).save(path + f"/composed_{step}")
steps = [json.load(open(f"{path}/incremental/{s}/manifest/metadata")) for s in (0, 1, 2, 3)]
incremental_formats = [contents["format"] for contents in steps]
contents = json.load(open(path + "/ckpt/manifest/metadata"))
key = contents["nodes"]["model/table"]["arrays"]["blocks/keys"]
blocks = orbax_io.load_arrays(path + "/ckpt", contents["arrays"])[key]
print(json.dumps({
  "shared": shared, "steps": manager.all_steps(), "size": int(fresh.table.size), "step": int(fresh.step),
  "clock": [int(fresh.table.clock), int(root.table.clock)], "rows_read": sorted(blocks.rows),
  "weights": gathered, "formats": incremental_formats, "incremental_size": int(steady.table.size),
}))
"""


SAVE_FOREVER = """
from multiprocess_table import table_at
root = jr.AutoTrackable()
manager = jr.CheckpointManager(path, jr.Checkpoint(model=root))
for step in range(1, 1000):
  root.table = table_at(step % 3, mesh)
  print("saving", step, flush=True)
  manager.save(step)
  manager.wait_until_finished()
  print("saved", step, flush=True)
"""


def _check_incremental_steps(results, tmp_path):
  """Each process wrote its own shards' changes; the chain restores on two processes and on one."""
  expected = [table_at(0, mesh_of(8))]
  for step in (1, 2, 3):
    expected.append(changed(expected[-1], step))
  for result in results:
    assert result["formats"][0] != result["formats"][1]  # a whole step, then deltas
    assert len(set(result["formats"][1:])) == 1 and result["incremental_size"] == int(expected[3].size)
  for step in (1, 2, 3):
    for source in (f"composed_{step}", None):  # composed by the two processes, or here
      root = jr.AutoTrackable()
      root.table, root.step = empty_table(mesh_of(4)), jnp.array(-1)
      if source is None:
        jr.CheckpointManager(tmp_path / "incremental", jr.Checkpoint(model=root)).restore(
          step
        ).assert_consumed()
      else:
        jr.Checkpoint(model=root).restore(tmp_path / source).assert_consumed()
      assert int(root.step) == step and entries(root.table) == entries(expected[step]), (step, source)
      np.testing.assert_array_equal(root.table.scores(KEYS), expected[step].scores(KEYS))


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _start(script: str, path) -> list[subprocess.Popen]:
  port = str(_free_port())
  # The suite's compiler flags and cache (conftest), without a device count: each worker has 4 devices.
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
  env = os.environ | {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(flags)}
  return [
    subprocess.Popen(
      [sys.executable, "-c", PRELUDE + script, str(i), port, str(path)],
      cwd=ROOT / "tests",
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in range(2)
  ]


def _run_together(script: str, path="") -> list[dict]:
  workers = _start(script, path)
  outputs = [w.communicate(timeout=HANG_GUARD_S) for w in workers]
  for worker, (_, err) in zip(workers, outputs):
    assert worker.returncode == 0, err[-3000:]
  return [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]


@pytest.mark.slow
def test_two_processes_share_one_table_save_it_together_and_restore_it_onto_other_meshes(tmp_path):
  single = jr.AutoTrackable()
  single.table, single.step = table_at(1, mesh_of(8)), jnp.array(1)
  jr.Checkpoint(model=single).save(tmp_path / "single")  # for the workers to restore
  results = _run_together(SHARE_ONE_TABLE + SAVE_TOGETHER, tmp_path)
  # One table over both processes: 100 keys inserted, one more by find_or_insert, the 50 even positions
  # removed; the same answers on each.
  expected = {"devices": [8, 4], "size": 51, "rows": [0, 77], "found": [0, 1, 77]}
  assert [result.pop("shared") for result in results] == [expected, expected]
  clock = int(table_at(3, mesh_of(8)).clock)
  for process, result in enumerate(results):
    assert result["steps"] == [2, 3]  # max_to_keep=2 over three steps
    assert result["step"] == 3 and result["size"] == 300 and result["clock"] == [clock, clock]
    assert result["rows_read"] == [4 * process + i for i in range(4)]  # each process reads its own shards
    assert result["weights"] == np.arange(16.0).reshape(8, 2).tolist()  # an array split over processes
  _check_incremental_steps(results, tmp_path)
  for name in ("ocdbt.process_0", "ocdbt.process_1"):  # and each wrote its own
    assert any(f.is_file() and f.stat().st_size for f in (tmp_path / "ckpt" / "arrays" / name).rglob("*"))

  # Saved by both processes (after restoring it from one process, for single_again): restored here.
  for path, step in (("ckpt", 0), ("again", 3), ("single_again", 1)):
    saved = entries(table_at(step, mesh_of(8)))
    unsharded = jr.OpenAddressingTable.create(400, key=jnp.int64, value=VALUE)
    restored = []
    for target in (empty_table(mesh_of(8)), empty_table(mesh_of(4)), unsharded):
      root = jr.AutoTrackable()
      root.table, root.step = target, jnp.array(-1)
      if path == "ckpt":
        root.weights = np.zeros((8, 2), np.float32)
      jr.Checkpoint(model=root).restore(tmp_path / path).assert_consumed()
      if path == "ckpt":
        np.testing.assert_array_equal(root.weights, np.arange(16.0).reshape(8, 2))
      assert entries(root.table) == saved and int(root.step) == step, (path, root.table)
      restored.append(root.table)
    # On the saved layout every entry is back in its slot (also after two processes restored it).
    (keys, _, _, live), (want, _, _, want_live) = (
      t.export_batch(0, t.num_slots) for t in (restored[0], table_at(step, mesh_of(8)))
    )
    np.testing.assert_array_equal(live, want_live)
    np.testing.assert_array_equal(np.asarray(keys)[np.asarray(live)], np.asarray(want)[np.asarray(live)])

  # Restored by two processes into an unsharded table (every process takes all shards) and into a
  # sharded table of another capacity (each process's shards go to their new owners).
  # And a table replicated over the two processes, restored by them at another capacity.
  for path, step in (("unsharded_again", 0), ("bigger_again", 0), ("replicas_again", 2)):
    whole = jr.AutoTrackable()
    whole.table = jr.OpenAddressingTable.create(400, key=jnp.int64, value=VALUE, eviction=jr.LRU())
    jr.Checkpoint(model=whole).restore(tmp_path / path).assert_consumed()
    assert entries(whole.table) == entries(table_at(step, mesh_of(8))), path
    np.testing.assert_array_equal(whole.table.scores(KEYS), table_at(step, mesh_of(8)).scores(KEYS))

  later = jr.AutoTrackable()
  status = jr.CheckpointManager(tmp_path / "run", jr.Checkpoint(model=later)).restore()
  later.table, later.step = empty_table(mesh_of(4)), jnp.array(-1)  # deferred, onto 4 devices of one process
  status.assert_consumed()
  assert entries(later.table) == entries(table_at(3, mesh_of(4))) and int(later.step) == 3
  assert int(later.table.clock) == clock

  # A shard whose bytes differ from its checksum: a ValueError naming the checkpoint, nothing changed.
  # (The manifest is sealed anew: its own checksum would catch the edit first.)
  manifest = json.loads((tmp_path / "ckpt" / "manifest" / "metadata").read_text())
  manifest.pop(files.SEAL)
  key = manifest["nodes"]["model/table"]["arrays"]["blocks/keys"]
  manifest["arrays"][key]["crc32"][5] ^= 1
  (tmp_path / "ckpt" / "manifest" / "metadata").write_text(json.dumps(files.sealed(manifest)))
  before = entries(later.table)
  with pytest.raises(ValueError, match=f"{tmp_path / 'ckpt'}: array {key} is corrupted"):
    jr.Checkpoint(model=later).restore(tmp_path / "ckpt")
  assert entries(later.table) == before


@pytest.mark.slow
def test_a_process_killed_during_a_save_leaves_the_previous_step_latest(tmp_path):
  workers = _start(SAVE_FOREVER, tmp_path)
  saved = 0
  try:
    for word, step in progress(workers[1].stdout):
      if word == "saved":
        saved = step
      elif step >= 3:  # two complete steps, then kill process 1 during the next save
        time.sleep(0.05)
        workers[1].send_signal(signal.SIGKILL)
        break
  finally:
    time.sleep(1.0)
    for worker in workers:
      worker.kill()
      worker.communicate()
  assert saved >= 2
  fresh = jr.AutoTrackable()
  manager = jr.CheckpointManager(tmp_path, jr.Checkpoint(model=fresh))
  latest = manager.latest_step()
  assert latest in (saved, saved + 1)  # the save in flight is complete or invisible
  status = manager.restore()
  fresh.table = empty_table(mesh_of(8))
  status.assert_consumed()
  assert entries(fresh.table) == entries(table_at(latest % 3, mesh_of(8)))
  manager.close()


SAVE_AND_COUNT = """
def loopback():  # bytes through the loopback interface, which the two processes talk over
  with open("/proc/net/dev") as f:
    return int(next(l.split(":")[1].split()[0] for l in f if l.strip().startswith("lo:")))

def moved(save):  # the least of 3 saves (other processes on the machine only add)
  counts = []
  for _ in range(3):
    before = loopback()
    save()
    counts.append(loopback() - before)
  return min(counts)

row = jax.ShapeDtypeStruct((32,), jnp.float32)
table = jr.ShardedTable.create(mesh, "shard", 1 << 15, key=jnp.int64, value=row)
keys = np.arange(30_000, dtype=np.int64) * 7919
table = table.insert(keys, np.ones((30_000, 32), np.float32))
root = jr.AutoTrackable()
root.table = table
raw = sum(x.nbytes for x in jax.tree.leaves(table))
step = iter(range(100))
whole = jr.CheckpointManager(path + "/whole", jr.Checkpoint(model=root))
steps = jr.CheckpointManager(path + "/steps", jr.Checkpoint(model=root), incremental=True)
steps.save(next(step))
steps.wait_until_finished()

def incremental():
  root.table = root.table.insert(keys[:100], np.full((100, 32), 2.0, np.float32))
  steps.save(next(step))
  steps.wait_until_finished()

def whole_step():
  whole.save(next(step))
  whole.wait_until_finished()

out = {
  "checkpoint": moved(lambda: jr.Checkpoint(model=root).save(path + "/ckpt")) / raw,
  "manager": moved(whole_step) / raw,
  "incremental": moved(incremental) / raw,
}
whole.close()
steps.close()
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.skipif(
  not os.path.exists("/proc/net/dev"), reason="counts bytes through Linux's loopback interface"
)
def test_saves_move_no_shard_to_a_process_that_does_not_write_it(tmp_path):
  """Two processes saving a sharded table (about 5 MB) each write their own shards: the bytes that
  travel between them per save (all the loopback interface carries) stay below 0.4x the table, for
  Checkpoint.save and whole and incremental manager steps (a vmap over the shards once gathered
  whole tables: 5.5x)."""
  for moved in _run_together(SAVE_AND_COUNT, tmp_path):
    assert max(moved.values()) < 0.4, moved
