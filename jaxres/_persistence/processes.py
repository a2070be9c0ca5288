"""Several processes (``jax.distributed``): what each holds, and the few exchanges between them.

In a multi-process run a global ``jax.Array`` may be partly on other hosts. A
checkpoint writes and reads such arrays row by row of their first axis: each
process holds the rows of its own devices (:class:`Blocks`), and only small
things (counts, checksums) or what a process must hold whole anyway (an
unsharded table) are exchanged. With one process every function here is the
plain single-host operation.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec


@dataclasses.dataclass(frozen=True)
class Blocks:
  """The rows (first-axis indices) of a global array that this process read; other processes hold the rest.

  Attributes:
    shape: the whole array's shape.
    dtype: its dtype.
    rows: row index -> that row (``shape[1:]``), for the rows this process holds.
  """

  shape: tuple[int, ...]
  dtype: np.dtype
  rows: dict[int, np.ndarray]


def is_partitioned(x) -> bool:
  """Whether ``x`` is a ``jax.Array`` that this process holds only part of."""
  return isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated


def host_copies(values: list, kinds: str) -> list[np.ndarray | jax.Array]:
  """A copy of each value: a NumPy array, except a global array split by rows over several processes
  whose dtype is of ``kinds`` (``np.dtype.kind`` letters), which stays one (copied where it lives)
  so that each process writes its own rows. Other arrays partly on other processes are gathered."""
  copies = []
  for value in values:
    if is_partitioned(value):
      if rows_only(value) and value.dtype.kind in kinds:
        copies.append(jnp.copy(value))
        continue
      value = multihost_utils.process_allgather(value, tiled=True)
    copies.append(np.array(value, copy=True))
  return copies


def rows_only(x: jax.Array) -> bool:
  """Whether ``x`` is split along its first axis only (so each process holds whole rows)."""
  return x.ndim > 0 and all(
    all(
      index.start in (None, 0) and index.stop in (None, dim)
      for index, dim in zip(shard.index[1:], x.shape[1:])
    )
    for shard in x.addressable_shards
  )


def local_rows(x: jax.Array) -> dict[int, np.ndarray]:
  """The rows of ``x`` this process holds, as NumPy arrays by row index."""
  rows = {}
  for shard in x.addressable_shards:
    start = shard.index[0].start or 0
    data = np.asarray(shard.data)
    for offset in range(data.shape[0]):
      rows.setdefault(start + offset, data[offset])
  return rows


def whole(blocks: Blocks) -> np.ndarray:
  """The whole array of which every process holds some rows (every process calls this together)."""
  rows = np.zeros(blocks.shape, blocks.dtype)
  held = np.zeros(blocks.shape[0], bool)
  for index, row in blocks.rows.items():
    rows[index], held[index] = row, True
  every, owner = everywhere(rows), everywhere(held).argmax(axis=0)  # the first process holding each row
  return every[owner, np.arange(blocks.shape[0])]


def everywhere(x: np.ndarray) -> np.ndarray:
  """``[processes, *x.shape]``: ``x`` of every process (it must have the same shape and dtype on each)."""
  if jax.process_count() == 1:
    return x[None]
  flat = np.ascontiguousarray(x).view(np.uint8)  # exact for any dtype, also 64-bit ones with x64 off
  gathered = np.asarray(multihost_utils.process_allgather(flat))
  return gathered.view(x.dtype).reshape(jax.process_count(), *x.shape)


def gather_rows(arrays: list[np.ndarray]) -> list[np.ndarray]:
  """Each array's rows of all processes, concatenated in process order (the arrays may differ in length)."""
  if jax.process_count() == 1:
    return arrays
  counts = everywhere(np.array([len(a) for a in arrays], np.int64))  # [processes, arrays]
  out = []
  for i, array in enumerate(arrays):
    width = int(counts[:, i].max())
    padded = np.zeros((width, *array.shape[1:]), array.dtype)
    padded[: len(array)] = array
    every = everywhere(padded)
    out.append(np.concatenate([every[p, : counts[p, i]] for p in range(len(every))]))
  return out


def replicated(x: jax.Array) -> np.ndarray:
  """A (small) global array as a NumPy array on every process."""
  if x.is_fully_addressable:
    return np.asarray(x)
  mesh = x.sharding.mesh
  return np.asarray(jax.jit(lambda y: y, out_shardings=NamedSharding(mesh, PartitionSpec()))(x))


def reading_sharding(rows: int) -> NamedSharding:
  """How processes split the rows of a partitioned array they read: whole rows, about evenly.

  One device of each process holds ``rows / n`` rows, ``n`` the largest number
  of processes that divides ``rows`` (JAX shards evenly); the others read none.
  """
  count = math.gcd(rows, jax.process_count())
  first = {}
  for device in jax.devices():
    first.setdefault(device.process_index, device)
  devices = np.array([first[p] for p in sorted(first)][:count])
  return NamedSharding(Mesh(devices, ("processes",)), PartitionSpec("processes"))


def barrier(name: str) -> None:
  """Waits until every process got here (nothing to wait for with one)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def is_primary() -> bool:
  """Whether this process writes what only one process must (manifests, renames)."""
  return jax.process_index() == 0


def agreed(value: int) -> int:
  """Process 0's ``value`` (``0 <= value < 2**31``), on every process."""
  if jax.process_count() == 1:
    return value
  return int(multihost_utils.broadcast_one_to_all(np.int32(value)))
