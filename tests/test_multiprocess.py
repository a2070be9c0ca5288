"""A ShardedTable over two local processes (jax.distributed, 4 CPU devices each, gloo)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

WORKER = """
import json, sys
import jax
process_id, port = int(sys.argv[1]), sys.argv[2]
jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process_id)
import jax.numpy as jnp, numpy as np
import jaxres as jr

mesh = jax.make_mesh((jax.device_count(),), ("shard",))  # 8 devices, 4 per process
table = jr.ShardedTable.create(mesh, "shard", 256, key=jnp.int64, value=jnp.int32)
keys = np.arange(-50, 50, dtype=np.int64) * 2**40  # the same batch on every process
table = table.insert(keys, np.arange(100, dtype=np.int32))
table, rows = table.find_or_insert(np.array([-50 * 2**40, 7], np.int64), np.array([-1, 77], np.int32))
table = table.remove(keys[::2])
found = table.find(np.array([keys[0], keys[1], 7], np.int64))
replicated = lambda x: np.asarray(x.addressable_shards[0].data).tolist()
print(json.dumps({
  "devices": [jax.device_count(), jax.local_device_count()],
  "size": int(table.size), "rows": replicated(rows), "found": replicated(found),
}))
"""


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_share_one_table():
  port = str(_free_port())
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
  workers = [
    subprocess.Popen(
      [sys.executable, "-c", WORKER, str(i), port],
      cwd=ROOT,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in range(2)
  ]
  outputs = [w.communicate(timeout=300) for w in workers]
  for worker, (_, err) in zip(workers, outputs):
    assert worker.returncode == 0, err[-3000:]
  results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
  # Oracle: 100 keys inserted, one more by find_or_insert, the 50 even positions removed.
  expected = {"devices": [8, 4], "size": 51, "rows": [0, 77], "found": [0, 1, 77]}
  assert results == [expected, expected]
