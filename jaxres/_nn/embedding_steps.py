"""The jitted programs of a :class:`jaxres.DynamicEmbedding`: a lookup, a read, a step of the rows.

Each takes the module's arrays and returns the new ones (donated: an eager
call updates them in place; inside ``jit`` the caller donates the model).
Every id is located once per lookup (its value row, ``index``), and the step
writes to the rows located, so both cost O(batch) whatever the capacity.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxres._core import constants, ordering
from jaxres._core.encoding.hashing import hash_words
from jaxres._core.kernels import grouping
from jaxres._core.table import Table
from jaxres._nn import admission, counters
from jaxres._nn.catch_up import RowAdam
from jaxres._nn.row_gradients import Lookup
from jaxres._nn.rowwise import RowOptimizer


@dataclasses.dataclass(frozen=True)
class Spec:
  """What the jitted programs need to know of an embedding, static."""

  optimizer: RowOptimizer | RowAdam
  initializer: Callable
  min_count: int
  mesh: Mesh | None = None  # of a sharded table (its admission counts are replicated over it)

  @property
  def features(self) -> int:
    return self.optimizer.features


def _embed(spec: Spec, table: Table, counts, tallies, seed, words, valid, shared):
  """One lookup: ``(table, counts, counters, rows, lookup)``, each id located once in ``table``.

  ``valid`` (``bool[N]`` or ``None`` for all) marks the ids that are not
  padding; the others are not looked up, counted or given rows, and read
  zeros. ``lookup`` is the :class:`~jaxres._nn.row_gradients.Lookup` of the
  rows' step.
  """
  keys = table.key_spec.decode(words)
  before = table.size
  if counts is None:
    admitted = valid
  else:
    found = table.find_rows(keys) >= 0
    waiting = ~found if valid is None else ~found & valid
    counts, admitted = _admit(spec, counts, keys, words, waiting)
    admitted = admitted | (found if valid is None else found & valid)
  table, handles = table.find_or_insert_rows(keys, valid=admitted)
  index = handles.index if admitted is None else jnp.where(admitted, handles.index, -1)
  table = _write_initial_values(spec, table, seed, words, index, handles.inserted)
  # Rows are read after the write, from the array it returns: a read of the array before it
  # would have to be kept alive next to the written one, and XLA would copy it whole.
  values = table.read_rows(index)
  present = index >= 0
  evictions = jnp.sum(handles.evicted.valid & present, dtype=jnp.int32)  # placed ids, their victims reported
  admitted_ids = table.size - before + evictions
  looked_up = jnp.ones_like(present) if valid is None else valid
  unadmitted = jnp.int32(0) if admitted is None else jnp.sum(looked_up & ~admitted, dtype=jnp.int32)
  full = jnp.sum(looked_up & ~present, dtype=jnp.int32) - unadmitted
  tallies = counters.add(tallies, jnp.stack([admitted_ids, unadmitted, full, evictions]))
  rows = with_shared(values["row"], present, words, shared)
  if valid is not None:
    rows = jnp.where(valid[:, None], rows, 0.0)
  clock = table.clock + jnp.uint32(0)
  return table, counts, tallies, rows, Lookup(words, index, looked_up, clock)


# The module's arrays are donated: an eager call updates them in place (under jit, the caller donates).
embed = jax.jit(_embed, static_argnames=("spec",), donate_argnames=("table", "counts", "tallies"))
# Without donation: eagerly inside a differentiated function, whose failure must leave them as they were.
embed_keeping = jax.jit(_embed, static_argnames=("spec",))


def _admit(spec: Spec, counts: Table, keys, words, waiting):
  """:func:`admission.admit`; over a mesh, every device counts the whole batch in its copy of the
  counts (left to the partitioner, a batch split over the devices would update the counts by a
  capacity-sized sum over them)."""
  count = functools.partial(admission.admit, min_count=spec.min_count)
  if spec.mesh is None:
    return count(counts, keys, words, waiting)
  everywhere = PartitionSpec()
  return jax.shard_map(count, mesh=spec.mesh, in_specs=everywhere, out_specs=everywhere)(
    counts, keys, words, waiting
  )


@jax.jit
def read(table: Table, shared, words, valid) -> jax.Array:
  """Inference: the rows of present ids, zeros (or shared rows) elsewhere, zeros for padding; only reads."""
  index = table.find_rows(table.key_spec.decode(words))
  rows = with_shared(table.read_rows(index)["row"], index >= 0, words, shared)
  return rows if valid is None else jnp.where(valid[:, None], rows, 0.0)


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("table", "shared"))
def update(spec: Spec, table: Table, shared, step, words, grads, index, valid):
  """``(table, shared, step)`` after one optimizer step on the rows of ``words``.

  ``index``: the ids' value rows from their lookup, or ``None`` to find them;
  ``valid`` (``bool[N]`` or ``None``): the ids that are not padding, the only
  ones trained (their own rows, or with shared rows those of ids without one).
  """
  step = None if step is None else step + 1
  if index is None:
    index = table.find_rows(table.key_spec.decode(words))
  if valid is not None:
    index = jnp.where(valid, index, -1)
  rows, total = grouping.group_sums(index, grads)  # each row once, its ids' sum
  table = _step_rows(spec, table, step, rows, total)
  if shared is not None:  # the ids without a row of their own train their shared rows alike
    without = index < 0 if valid is None else (index < 0) & valid
    groups, total = grouping.group_sums(jnp.where(without, shared_of(words, shared), -1), grads)
    taken = jnp.maximum(groups, 0)
    taken_slots = [s[taken] for s in shared["slots"]]
    new_rows, slots = spec.optimizer.update(total, shared["row"][taken], taken_slots, step)
    at = jnp.where(groups >= 0, groups, shared["row"].shape[0])  # distinct groups: no conflicting writes
    shared = {
      "row": shared["row"].at[at].set(new_rows, mode="drop"),
      "slots": tuple(s.at[at].set(new, mode="drop") for s, new in zip(shared["slots"], slots)),
    }
  return table, shared, step


def _step_rows(spec: Spec, table: Table, step, rows, total) -> Table:
  """``table`` after the optimizer's step on ``rows`` (distinct rows in ascending order, then ``-1``)
  with their gradients ``total``.

  A batch of ``N`` ids often has far fewer distinct rows (repeated ids,
  padding), so the step runs on chunks of a quarter of ``N`` (or of the
  table's rows, if fewer) until every distinct row had its step: a loop,
  whose carry updates the table in place.
  """
  n = rows.shape[0]
  chunk = max(1, -(-min(n, table.num_rows) // 4))
  rows = jnp.concatenate([rows, jnp.full(-n % chunk, -1, jnp.int32)])
  count = jnp.sum(rows >= 0, dtype=jnp.int32)

  def take_step(carry):
    start, table = carry
    taken = jax.lax.dynamic_slice(rows, (start,), (chunk,))
    sums = jnp.take(total, start + jnp.arange(chunk), axis=0, mode="clip")  # past N: rows of -1
    values = table.read_rows(taken)
    new_rows, slots = spec.optimizer.update(sums, values["row"], values["slots"], step)
    valid = ordering.after(taken >= 0, *jax.tree.leaves(values))  # rows read before written: in place
    table = table.write_rows(taken, {"row": new_rows, "slots": tuple(slots)}, valid=valid)
    return start + chunk, table

  _, table = jax.lax.while_loop(lambda carry: carry[0] < count, take_step, (jnp.int32(0), table))
  return table


@jax.jit
def rows_of_lookups(table: Table, lookups) -> tuple[jax.Array, jax.Array]:
  """``(index, valid)`` of the ids of ``lookups`` (concatenated) on ``table`` now.

  A lookup's rows stand while the table's clock is the one it left; after a
  later insert (another lookup, say) its ids are found again: an id that had
  a row keeps the row it has now, or is dropped (evicted since: the row it
  read is gone); an id that had none (refused: it read zeros or its shared
  row) still has none, so its gradient goes where its read came from.
  """
  index, valid = [], []
  for lookup in lookups:
    keys = table.key_spec.decode(lookup.words)
    found = jax.lax.cond(
      lookup.clock == table.clock, lambda i=lookup.index: i, lambda k=keys: table.find_rows(k)
    )
    had = lookup.index >= 0
    index.append(jnp.where(had, found, -1))
    valid.append(lookup.valid & ~(had & (found < 0)))
  return jnp.concatenate(index), jnp.concatenate(valid)


def rows_of(table: Table, words, recent) -> jax.Array | None:
  """The value rows of ``words`` when the last lookup (``recent``) was of these ids, on this table;
  else ``None`` (:func:`update` finds them)."""
  if recent is None or recent[0].shape != words.shape:
    return None
  return _recent_rows(table, words, *recent)


@jax.jit  # eager, one program for each table and batch (an eager cond would be traced anew every call)
def _recent_rows(table: Table, words, recent_words, index, clock) -> jax.Array:
  same = jnp.all(recent_words == words) & (clock == table.clock)
  return jax.lax.cond(same, lambda: index, lambda: table.find_rows(table.key_spec.decode(words)))


def initial_value(spec: Spec, seed: jax.Array, id_words: jax.Array) -> dict:
  """The row and optimizer state a new id starts with (``id_words``: ``uint32[N, W]``): a function
  of the seed and the id alone."""
  base = jax.random.wrap_key_data(seed)

  def row(one_id):
    key = base
    for w in range(one_id.shape[0]):
      key = jax.random.fold_in(key, one_id[w])
    return spec.initializer(key, (spec.features,), jnp.float32)

  rows = jax.vmap(row)(id_words)
  return {"row": rows, "slots": tuple(spec.optimizer.init(rows))}


def _write_initial_values(spec: Spec, table: Table, seed, words, index, new) -> Table:
  """``table`` with the initial value of each ``new`` id written to its row ``index``.

  Drawing a row costs a random key per id, and a warm table meets few new
  ids: they are drawn and written in chunks of a sixteenth of the batch, as
  many as there are new ids (a loop, whose carry updates the table in place).
  """
  n = words.shape[0]
  chunk = max(1, -(-n // 16))
  (positions,) = jnp.nonzero(new, size=n + (-n % chunk), fill_value=-1)
  count = jnp.sum(new, dtype=jnp.int32)

  def draw(carry):
    start, table = carry
    at = jax.lax.dynamic_slice(positions, (start,), (chunk,))
    taken = jnp.maximum(at, 0)
    values = initial_value(spec, seed, words[taken])
    return start + chunk, table.write_rows(jnp.where(at >= 0, index[taken], -1), values)

  _, table = jax.lax.while_loop(lambda carry: carry[0] < count, draw, (jnp.int32(0), table))
  return table


def shared_rows(spec: Spec, seed: jax.Array, n: int) -> dict:
  """``n`` shared rows and their optimizer state, drawn from the seed (apart from any id's row)."""
  key = jax.random.fold_in(jax.random.wrap_key_data(seed), constants.SHARED_ROW_SEED)
  rows = spec.initializer(key, (n, spec.features), jnp.float32)
  return {"row": rows, "slots": tuple(spec.optimizer.init(rows))}


def shared_of(words: jax.Array, shared: dict) -> jax.Array:
  """``int32[N]``: the shared row each id reads (a hash of its words)."""
  n = shared["row"].shape[0]
  return (hash_words(words, seed=constants.SHARED_ROW_SEED) % jnp.uint32(n)).astype(jnp.int32)


def with_shared(rows: jax.Array, present: jax.Array, words: jax.Array, shared: dict | None) -> jax.Array:
  """``rows`` where ``present``; elsewhere each id's shared row, or zeros without any."""
  other = 0.0 if shared is None else shared["row"][shared_of(words, shared)]
  return jnp.where(present[:, None], rows, other)


def replicated(tree, mesh: Mesh | None):
  """``tree`` with a copy on every device of ``mesh`` (as it is without one)."""
  if tree is None or mesh is None:
    return tree
  return jax.device_put(tree, NamedSharding(mesh, PartitionSpec()))
