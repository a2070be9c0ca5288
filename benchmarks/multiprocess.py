"""A checkpoint saved and restored by two processes of 4 CPU devices each (jax.distributed, gloo).

:func:`measure` starts two workers (``python -m benchmarks.multiprocess``)
that fill one ShardedTable of random 64-wide rows over their 8 devices, save
it together three times and restore it twice into an empty table of the same
mesh (the first restore compiles the import); each reports its times. Each
process writes its own shards' files (``arrays/ocdbt.process_<i>``), so the
bytes it wrote are read from there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax  # starts no backend: the workers configure theirs first
import jax.numpy as jnp
import numpy as np

import jaxres as jr

ROOT = Path(__file__).resolve().parents[1]
WIDTH = 64


def filled(table, entries: int, width: int = WIDTH):
  """``table`` with ``entries`` random keys of ``width`` random float32 each (the same on every process)."""
  rng = np.random.default_rng(1)
  keys = rng.permutation(np.arange(entries, dtype=np.int64) * 7919 + 1)
  fill = jax.jit(lambda t, k, v: t.insert(k, v))
  for start in range(0, entries, 1 << 16):
    ids = jr.keys.split64(keys[start : start + (1 << 16)])
    table = fill(table, ids, jnp.asarray(rng.standard_normal((ids.shape[0], width)), jnp.float32))
  return jax.block_until_ready(table)


def measure(entries: int) -> dict:
  """Per-process save and restore seconds and bytes written, for ``entries`` rows on 2 x 4 devices.

  Example (not run by the doctests: two processes):
    ``measure(1 << 14)["processes"][0]`` has ``"save s"``, ``"first restore s"``,
    ``"restore s"``, ``"size"`` and ``"written"``.
  """
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = str(s.getsockname()[1])
  directory = tempfile.mkdtemp()
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
  try:
    workers = [
      subprocess.Popen(
        [sys.executable, "-m", "benchmarks.multiprocess", str(i), port, directory, str(entries)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
      )
      for i in range(2)
    ]
    outputs = [w.communicate(timeout=1800) for w in workers]
    for worker, (_, err) in zip(workers, outputs):
      if worker.returncode:
        raise RuntimeError(err[-3000:])
    arrays = Path(directory) / "table" / "arrays"
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    for i, result in enumerate(results):
      own = arrays / f"ocdbt.process_{i}"
      result["written"] = sum(f.stat().st_size for f in own.rglob("*") if f.is_file())
    total = sum(f.stat().st_size for f in (Path(directory) / "table").rglob("*") if f.is_file())
    return {"processes": results, "total written": total, "entries": entries}
  finally:
    shutil.rmtree(directory, ignore_errors=True)


def _worker(process: int, port: str, directory: str, entries: int) -> None:
  jax.config.update("jax_num_cpu_devices", 4)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process)
  mesh = jax.make_mesh((jax.device_count(),), ("shard",))
  value = jax.ShapeDtypeStruct((WIDTH,), jnp.float32)

  def empty():
    return jr.ShardedTable.create(mesh, "shard", entries, key=jnp.int64, value=value)

  table = filled(empty(), entries)
  path, saves = os.path.join(directory, "table"), []
  for _ in range(3):
    start = time.perf_counter()
    jr.Checkpoint(table=table).save(path)
    saves.append(time.perf_counter() - start)
  restores = []
  for _ in range(2):  # the first compiles the import
    fresh = jr.Checkpoint(table=empty())
    start = time.perf_counter()
    fresh.restore(path)
    jax.block_until_ready(fresh.table)
    restores.append(time.perf_counter() - start)
  result = {"process": process, "save s": sorted(saves)[1], "first restore s": restores[0]}
  print(json.dumps(result | {"restore s": restores[1], "size": int(fresh.table.size)}))


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("process", type=int)
  parser.add_argument("port")
  parser.add_argument("directory")
  parser.add_argument("entries", type=int)
  args = parser.parse_args()
  _worker(args.process, args.port, args.directory, args.entries)
