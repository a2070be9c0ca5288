"""The tables under test, behind one small interface.

Every peer holds one table and offers ``fresh``, ``insert``, ``find``,
``remove`` and ``step`` (insert then find, the training-step pattern) on one
batch, and ``wait`` to block until queued work is done. Batches arrive in the
peer's own array type (converted before timing), so only table work is timed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import jaxres as jr


@functools.partial(jax.jit, donate_argnums=0)
def _insert(table, keys, values):
  return table.insert(keys, values)


@jax.jit
def _find(table, keys):
  return table.find(keys)


@functools.partial(jax.jit, donate_argnums=0)
def _remove(table, keys):
  return table.remove(keys)


@functools.partial(jax.jit, donate_argnums=0)
def _step(table, keys, values):
  table = table.insert(keys, values)
  return table, table.find(keys)


class Peer:
  """What every peer shares: which workloads it supports, and building a full table."""

  name: str
  supports = frozenset({"insert", "find", "remove", "step"})

  def fresh(self, capacity: int) -> None:
    """An empty table in place of the old one, whose memory is given back first (timed with inserts)."""
    self.table = None
    self.table = self._empty(capacity)

  def build(self, capacity: int, keys: np.ndarray, values: np.ndarray, batch: int) -> None:
    """A fresh table holding these entries (not timed)."""
    self.fresh(capacity)
    for i in range(0, len(keys), batch):
      self.insert(*self.batch(keys[i : i + batch], values[i : i + batch]))
    self.wait()


class Jaxres(Peer):
  """A jaxres functional table; updates are jitted with the table donated (in place)."""

  def __init__(self, storage, width: int):
    self.name, self.storage, self.width = f"jaxres {storage.__name__}", storage, width
    self.table = None

  def _empty(self, capacity: int):
    value = jax.ShapeDtypeStruct((self.width,) if self.width > 1 else (), jnp.float32)
    return self.storage.create(capacity, key=jnp.int64, value=value, default=0.0)

  def batch(self, keys: np.ndarray, values: np.ndarray):
    return jnp.asarray(keys), jnp.asarray(values)

  def insert(self, keys, values) -> None:
    self.table = _insert(self.table, keys, values)

  def find(self, keys):
    return _find(self.table, keys)

  def remove(self, keys) -> None:
    self.table = _remove(self.table, keys)

  def step(self, keys, values):
    self.table, found = _step(self.table, keys, values)
    return found

  def wait(self, result=None) -> None:
    jax.block_until_ready((self.table, result))

  def size(self) -> int:
    return int(self.table.size)

  def table_bytes(self) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(self.table))


class TensorFlow(Peer):
  """``tf.lookup`` tables: ``MutableHashTable``, ``DenseHashTable`` or ``StaticHashTable``."""

  EMPTY_KEY, DELETED_KEY = -(2**63), -(2**63) + 1  # reserved by DenseHashTable; never in the data

  def __init__(self, kind: str, width: int):
    import tensorflow as tf

    self.tf, self.kind, self.width = tf, kind, width
    self.name = f"TF {kind}"
    self.table = None
    if kind == "StaticHashTable":
      self.supports = frozenset({"find"})

  def build(self, capacity: int, keys: np.ndarray, values: np.ndarray, batch: int) -> None:
    if self.kind != "StaticHashTable":
      return super().build(capacity, keys, values, batch)
    lookup = self.tf.lookup
    initializer = lookup.KeyValueTensorInitializer(self.tf.constant(keys), self.tf.constant(values))
    self.table = lookup.StaticHashTable(initializer, default_value=self._default())

  def _default(self):
    return self.tf.zeros([self.width]) if self.width > 1 else self.tf.constant(0.0)

  def _empty(self, capacity: int):
    tf, lookup = self.tf, self.tf.lookup
    if self.kind == "MutableHashTable":
      return lookup.experimental.MutableHashTable(tf.int64, tf.float32, default_value=self._default())
    return lookup.experimental.DenseHashTable(
      tf.int64,
      tf.float32,
      default_value=self._default(),
      empty_key=self.EMPTY_KEY,
      deleted_key=self.DELETED_KEY,
    )

  def batch(self, keys: np.ndarray, values: np.ndarray):
    return self.tf.constant(keys), self.tf.constant(values)

  def insert(self, keys, values) -> None:
    self.table.insert(keys, values)

  def find(self, keys):
    return self.table.lookup(keys)

  def remove(self, keys) -> None:
    self.table.remove(keys)

  def step(self, keys, values):
    # Eager ops: faster than a tf.function here (about 680 against 880 µs per step).
    self.table.insert(keys, values)
    return self.table.lookup(keys)

  def wait(self, result=None) -> None:
    if result is not None:
      result.numpy()

  def size(self) -> int:
    return int(self.table.size())


class PythonDict(Peer):
  """A Python ``dict`` from int to float (or to a NumPy row)."""

  def __init__(self, width: int):
    self.name, self.width, self.table = "Python dict", width, {}

  def _empty(self, capacity: int):
    return {}

  def batch(self, keys: np.ndarray, values: np.ndarray):
    return keys.tolist(), list(values) if self.width > 1 else values.tolist()

  def insert(self, keys, values) -> None:
    self.table.update(zip(keys, values))

  def find(self, keys):
    get, default = self.table.get, np.zeros(self.width, np.float32) if self.width > 1 else 0.0
    return [get(k, default) for k in keys]

  def remove(self, keys) -> None:
    pop = self.table.pop
    for k in keys:
      pop(k, None)

  def step(self, keys, values):
    self.insert(keys, values)
    return self.find(keys)

  def wait(self, result=None) -> None:
    pass

  def size(self) -> int:
    return len(self.table)


def make(name: str, width: int):
  """A peer by name: jaxres-oa, jaxres-sorted, tf-mutable, tf-dense, tf-static or dict."""
  return {
    "jaxres-oa": lambda: Jaxres(jr.OpenAddressingTable, width),
    "jaxres-sorted": lambda: Jaxres(jr.SortedTable, width),
    "tf-mutable": lambda: TensorFlow("MutableHashTable", width),
    "tf-dense": lambda: TensorFlow("DenseHashTable", width),
    "tf-static": lambda: TensorFlow("StaticHashTable", width),
    "dict": lambda: PythonDict(width),
  }[name]()
