"""Routing the rows of a batch to the shards that own their keys, and their results back.

The primitives of :class:`jaxres.ShardedTable`'s calls (see its module for the
whole flow): which shard owns a key (:func:`owner_of`), how much headroom a
shard gets (:func:`shard_capacity_for`), the rows a device sends each owner per
round (:func:`round_rows`), what a repeated key's one travelling row carries
(:func:`travelling`), and the rounds of ``all_to_all`` that deliver requests
and replies in batch order (:class:`Route`). Nothing here knows a storage or a
checkpoint.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxres._core import constants
from jaxres._core.encoding.hashing import hash_words
from jaxres._core.modes import Carry

_HEADROOM_SIGMAS = 6


def shard_capacity_for(capacity: int, num_shards: int) -> int:
  """Per-shard capacity so that ``capacity`` distinct keys fit.

  A uniform hash gives each shard a binomial number of distinct keys, mean
  ``capacity / num_shards``; six standard deviations of headroom make an
  overflow a one-in-a-billion event. How *often* keys occur (a Zipf stream)
  does not matter: only distinct keys take room.

  Examples:
    >>> shard_capacity_for(1 << 20, 8), shard_capacity_for(16, 8)
    (133245, 11)
  """
  mean = capacity / num_shards
  return min(capacity, math.ceil(mean + _HEADROOM_SIGMAS * math.sqrt(mean)))


def owner_of(words: jax.Array, num_shards: int) -> jax.Array:
  """int32[N]: the shard that owns each key row."""
  return (hash_words(words, seed=constants.ROUTING_SEED) % np.uint32(num_shards)).astype(jnp.int32)


def travelling(x, which: Carry, last, others):
  """The leaf a key's first row carries: its own, its last row's, or a reduction of all."""
  if which is Carry.FIRST:
    return x
  if which is Carry.LAST:
    return x[last]
  return which.scatter(x.at[others], x)  # a scatter reduction into the first row


class Route(NamedTuple):
  """Where a device's travelling rows go: each owner's rows in batch order, numbered by ``position``.

  A round carries, to every owner, the rows of positions ``[start, start + size)``;
  the owner keeps the rows from device ``s`` at ``s * per_device + position``,
  so it sees them in batch order whatever the rounds. Buffers hold ``size``
  rows per owner, never the worst case.
  """

  owner: jax.Array  # int32[per_device]
  position: jax.Array  # int32[per_device]: rank among this device's travelling rows for that owner
  travels: jax.Array  # bool[per_device]
  count: jax.Array  # int32[num_shards]: travelling rows per owner
  axis: str

  @classmethod
  def of(cls, owner, travels, num_shards: int, axis: str) -> Route:
    mine = (owner[:, None] == jnp.arange(num_shards, dtype=jnp.int32)) & travels[:, None]
    rank = jnp.cumsum(mine, axis=0, dtype=jnp.int32)
    position = jnp.take_along_axis(rank, owner[:, None], axis=1)[:, 0] - 1
    return cls(owner, position, travels, rank[-1], axis)

  def _sent(self, start, size):
    return self.travels & (self.position >= start) & (self.position < start + size)

  def _cells(self, size: int):
    """Each buffer cell's source device and offset in its ``size``-row block."""
    cells = jnp.arange(self.count.shape[0] * size, dtype=jnp.int32)
    return cells // size, cells % size

  def deliver(self, arrays, start, size: int, received):
    """One round of requests: ``arrays`` (per row) into the owners' ``received`` (per source row)."""
    num_shards, per_device = self.count.shape[0], self.owner.shape[0]
    cell = jnp.where(self._sent(start, size), self.owner * size + self.position - start, num_shards * size)
    source, offset = self._cells(size)
    at = jnp.where(start + offset < per_device, source * per_device + start + offset, num_shards * per_device)
    out = []
    for x, acc in zip(arrays, received, strict=True):
      buffer = jnp.zeros((num_shards * size, *x.shape[1:]), x.dtype).at[cell].set(x, mode="drop")
      out.append(acc.at[at].set(all_to_all(buffer, self.axis, num_shards), mode="drop"))
    return out

  def reply(self, outputs, start, size: int, results):
    """One round of replies: the owners' ``outputs`` back into each row's ``results``."""
    num_shards, per_device = self.count.shape[0], self.owner.shape[0]
    source, offset = self._cells(size)
    take = source * per_device + jnp.minimum(start + offset, per_device - 1)
    cell = jnp.clip(self.owner * size + self.position - start, 0, num_shards * size - 1)
    sent = self._sent(start, size)
    out = []
    for y, result in zip(outputs, results, strict=True):
      back = all_to_all(y[take], self.axis, num_shards)[cell]
      out.append(jnp.where(sent.reshape(-1, *[1] * (y.ndim - 1)), back, result))
    return out


def round_rows(per_device: int, num_shards: int) -> tuple[int, int]:
  """Rows a device sends each owner in the first routing round, and in each further one.

  A device's ``per_device`` rows spread binomially over ``num_shards`` owners;
  the first round holds the mean and three standard deviations, which covers
  nearly every batch, and the rows beyond go in rounds a quarter that size.
  The first round's bytes stay within 2x of the rows' own whenever the mean is
  at least 9 rows.

  Examples:
    >>> round_rows(512, 8), round_rows(2048, 2), round_rows(3, 8)
    ((88, 22), (1120, 280), (3, 1))
  """
  mean = per_device / num_shards
  first = max(1, min(per_device, math.ceil(mean + 3 * math.sqrt(mean))))
  return first, -(-first // 4)


def all_to_all(x, axis: str, num_shards: int):
  """Block ``d`` of ``x`` (split into ``num_shards`` row blocks) goes to device ``d``."""
  blocks = x.reshape(num_shards, x.shape[0] // num_shards, *x.shape[1:])
  return lax.all_to_all(blocks, axis, 0, 0).reshape(x.shape)
