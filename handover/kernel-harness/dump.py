"""A half-full lean table of int64 keys and a batch of 4,096 keys (half present), as the kernels see
them, written here for ``harness.cc`` and ``find.cc``: ``python dump.py [capacity]`` (2^16 default)."""

import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxres as jr
from jaxres._core.storages import registry

capacity = int(sys.argv[1]) if len(sys.argv) > 1 else 1 << 16
rng = np.random.default_rng(capacity)
live = rng.integers(-(2**62), 2**62, capacity // 2)
value = jax.ShapeDtypeStruct((4,), jnp.float32)
table = registry.storage("lean").create(capacity, key=jnp.int64, value=value)
table = table.insert(jr.keys.split64(live), np.ones((len(live), 4), np.float32))
keys = np.concatenate([live[rng.integers(0, len(live), 2048)], rng.integers(-(2**62), 2**62, 2048)])
batch = np.asarray(table.key_spec.encode(jr.keys.split64(keys))[0], np.uint32)  # the table's key words
for name in ("digests", "keys", "overflow"):
  np.asarray(getattr(table, name)).astype(np.uint32).tofile(f"{name}.bin")
batch.tofile("batch.bin")
with open("meta.txt", "w") as meta:
  shape = f"{table.num_buckets} {table.bucket_size} {table.keys.shape[0]} {table.keys.shape[1]}"
  meta.write(f"{shape} {batch.shape[0]} {int(table.size)} {table.capacity}\n")
