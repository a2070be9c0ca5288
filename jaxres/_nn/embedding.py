"""``jr.DynamicEmbedding``: embedding rows assigned to ids inside ``nnx.jit``, trained row by row."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxres._core import constants
from jaxres._core.encoding.hashing import hash_words
from jaxres._core.kernels import grouping
from jaxres._core.policies import check_policy
from jaxres._core.sharding.sharded_table import ShardedTable
from jaxres._core.storages.open_addressing import OpenAddressingTable
from jaxres._core.table import Table, check_capacity
from jaxres._errors import check_int
from jaxres._nn import admission, rowwise
from jaxres._nn.catch_up import RowAdam

_INITIALIZER = nnx.initializers.normal(0.01)
_STATS = ("admitted", "refused", "evictions")


class EmbeddingState(nnx.Variable):
  """The tables and counters of a :class:`DynamicEmbedding` (not an ``nnx.Param``: no dense gradient)."""


class EmbeddingRows(EmbeddingState):
  """The table of a :class:`DynamicEmbedding`'s rows and their optimizer state.

  Its metadata ``row_optimizer`` and ``restore_rows_only`` let a checkpoint
  trained with another row optimizer be restored: the rows and scores kept,
  the optimizer state started afresh (see :func:`rows_only`).
  """


class EmbeddingStep(EmbeddingState):
  """The steps (``apply_gradients`` calls) of an embedding whose row optimizer needs them
  (:class:`jaxres.CatchUpAdam`): part of the optimizer state.

  Its metadata ``restore_rows_only`` lets a checkpoint without it (trained
  with another row optimizer) be restored: the count then starts afresh with
  every row's optimizer state.
  """


class RecentRows(nnx.Variable):
  """The rows the last lookup found, kept for :meth:`DynamicEmbedding.apply_gradients` (not checkpointed).

  Its value is ``None`` or ``(words, index, clock)``: the ids' key words, their
  value rows and the table's clock after the lookup. ``apply_gradients``
  uses the rows when it is given the same ids and the table has not changed
  since, and clears them.
  """

  checkpointed = False  # derived within a step: checkpoints leave it out (see jaxres._integrations.nnx)


@dataclasses.dataclass(frozen=True)
class _Spec:
  """What the jitted steps need to know, static."""

  optimizer: rowwise.RowOptimizer | RowAdam
  initializer: Callable
  min_count: int

  @property
  def features(self) -> int:
    return self.optimizer.features


class DynamicEmbedding(nnx.Module):
  """An embedding whose rows are given to ids as they arrive and trained by a row-wise optimizer.

  A hash table (:class:`jaxres.OpenAddressingTable`, or a
  :class:`jaxres.ShardedTable` over ``mesh``) maps each id to its value: the
  embedding row **and the row's optimizer state** (Adam's ``mu``, ``nu`` and
  its own ``count``). Calling the module looks ids up and gives new ids rows;
  :meth:`apply_gradients` updates the rows of a batch's ids only. Both cost
  O(batch), whatever the capacity, eagerly and inside ``nnx.jit`` (donate the
  model, ``nnx.jit(..., donate_argnums=0)``, so the table is updated in
  place).

  - **New ids.** An id's first row is ``initializer(key, (features,))`` with a
    key derived from the seed and the id alone: the same row whatever the
    arrival order or the shard.
  - **Full table.** With ``eviction=jr.LRU()`` (or ``jr.LFU()``) a new id
    replaces the lowest-scored row near its position, row and optimizer
    state together (see ``jr.OpenAddressingTable``); with ``eviction=None``
    new ids are refused once the table is full.
  - **Admission.** With ``min_count > 1``, an id gets a row at its
    ``min_count``-th occurrence, counted in a bounded table of
    ``admission_capacity`` ids (:mod:`jaxres._nn.admission`: it never
    admits early; it may admit late when more than ``admission_capacity``
    unadmitted ids arrive between two occurrences of an id).
  - **Refused ids** (not admitted yet, or a full table without eviction)
    read zeros and get no update; an evicted or refused id that comes back
    starts afresh.
  - **Shared rows** (``oov_buckets=n``): an id without a row of its own
    (not admitted yet, refused, evicted; in inference mode too) reads one
    of ``n`` shared rows, chosen by a hash of the id, instead of zeros, and
    :meth:`apply_gradients` trains that row with the summed gradients of
    the ids that read it (each with its own optimizer state, as any row):
    the tail of the ids gets a trained, hashed embedding while frequent ids
    get their own. The shared rows are replicated on every device of
    ``mesh``, checkpointed and exported with the module.

  Args:
    capacity: the rows the table holds (live ids at most).
    features: the width of a row.
    key: the id dtype (``jnp.int64`` by default: with ``jax_enable_x64``
      off, pass NumPy ``int64`` ids eagerly and ``jr.keys.split64`` word
      pairs inside ``jit``), ``int32``, ``uint32`` or ``uint64``.
    optimizer: an elementwise ``optax.GradientTransformation`` (``sgd``,
      ``adam``, ``adagrad``, ``rmsprop``, ``lion``, chains of them), applied to
      each row with its own state.
    eviction: ``None``, ``jr.LRU()`` or ``jr.LFU()``.
    min_count: occurrences an id needs to get a row (1: at once).
    initializer: ``initializer(key, shape, dtype)``, as ``nnx.initializers``
      (default: ``normal(0.01)``).
    rngs: ``nnx.Rngs``; its ``params`` stream gives the seed of new rows.
    mesh: shard the table over ``axis`` of this mesh (give both or neither).
    axis: the mesh axis the table is sharded over.
    admission_capacity: ids the admission count holds (default ``capacity``).
    deterministic: inference mode (NNX's convention, as ``nnx.Dropout``:
      ``model.eval()`` sets it, ``model.train()`` clears it): a lookup only
      reads, and :meth:`apply_gradients` raises.
    oov_buckets: the number of shared rows read by ids without their own
      (0: none, such ids read zeros).
    restore_rows_only: restore a checkpoint trained with another row
      optimizer (other optimizer state per row, say adam's into sgd's): its
      ids, rows, scores and counters are kept, and every row's optimizer
      state starts afresh, as a new row's does. Without it such a
      checkpoint is a ``TypeError`` saying so.

  Examples:
    >>> import numpy as np, optax, jaxres as jr
    >>> from flax import nnx
    >>> emb = jr.DynamicEmbedding(4, 2, optimizer=optax.sgd(1.0), rngs=nnx.Rngs(0))
    >>> ids = np.array([7, 2**40, 7])
    >>> rows = emb(ids)
    >>> rows.shape, emb.size()
    ((3, 2), 2)
    >>> emb.apply_gradients(ids, np.ones((3, 2), np.float32))   # 7 twice: its gradient is 2
    >>> np.allclose(emb(ids) - rows, [[-2, -2], [-1, -1], [-2, -2]])
    True
    >>> emb.stats()
    {'admitted': 2, 'refused': 0, 'evictions': 0}
  """

  def __init__(
    self,
    capacity: int,
    features: int,
    *,
    key=jnp.int64,
    optimizer,
    eviction=None,
    min_count: int = 1,
    initializer: Callable = _INITIALIZER,
    rngs: nnx.Rngs,
    mesh: Mesh | None = None,
    axis: str | None = None,
    admission_capacity: int | None = None,
    deterministic: bool = False,
    restore_rows_only: bool = False,
    oov_buckets: int = 0,
  ):
    capacity = check_capacity(capacity)
    oov_buckets = check_int(oov_buckets, "oov_buckets", low=0)
    features = check_int(features, "features", low=1)
    min_count = check_int(min_count, "min_count", low=1)
    eviction = check_policy(eviction)
    if eviction is not None and eviction.takes_scores:
      raise ValueError(f"eviction: {eviction} needs scores from the caller; use jr.LRU() or jr.LFU().")
    if not callable(initializer):
      raise TypeError(f"initializer: expected initializer(key, shape, dtype), got {initializer!r}.")
    if not isinstance(rngs, nnx.Rngs):
      raise TypeError(f"rngs: expected an nnx.Rngs, got {rngs!r}.")
    if (mesh is None) != (axis is None):
      raise ValueError("mesh, axis: give both to shard the table, or neither.")
    if not isinstance(deterministic, bool):
      raise TypeError(f"deterministic: expected a bool, got {deterministic!r}.")
    if not isinstance(restore_rows_only, bool):
      raise TypeError(f"restore_rows_only: expected a bool, got {restore_rows_only!r}.")
    optimizer = rowwise.for_rows(optimizer, features)
    value = {"row": jax.ShapeDtypeStruct((features,), jnp.float32), "slots": optimizer.slots}
    default = jax.tree.map(lambda _: 0, value)
    if mesh is None:
      table = OpenAddressingTable.create(capacity, key=key, value=value, default=default, eviction=eviction)
    else:
      table = ShardedTable.create(
        mesh, axis, capacity, key=key, value=value, default=default, eviction=eviction
      )
    self._spec = _Spec(optimizer, initializer, min_count)
    self.capacity, self.features = capacity, features
    self.table = EmbeddingRows(table, row_optimizer=optimizer, restore_rows_only=restore_rows_only)
    room = (
      capacity if admission_capacity is None else check_capacity(admission_capacity, "admission_capacity")
    )
    self.counts = EmbeddingState(admission.counter(room, key)) if min_count > 1 else None
    self.seed = EmbeddingState(jax.random.key_data(rngs.params()))
    self.counters = EmbeddingState(jnp.zeros((len(_STATS), 2), jnp.uint32))  # 64-bit: (high, low) words
    shared = _shared_rows(self._spec, self.seed.get_value(), oov_buckets) if oov_buckets else None
    mesh = None if mesh is None else table.mesh  # the table's: its axes in Auto mode, as jit returns
    shared = _replicated(shared, mesh)  # every device reads them: a copy on each
    self.shared = None if shared is None else EmbeddingState(shared)
    step = _replicated(jnp.zeros((), jnp.int32), mesh) if optimizer.needs_step else None
    self.step = None if step is None else EmbeddingStep(step, restore_rows_only=restore_rows_only)
    self.recent = RecentRows(None)
    self.deterministic = deterministic

  def __call__(self, ids) -> jax.Array:
    """``float32[*batch, features]``: the rows of ``ids``, new ids given rows (where refused: zeros,
    or their shared row with ``oov_buckets``).

    In inference mode (:attr:`deterministic`, set by ``model.eval()``) a pure
    read: ids without a row read zeros (or their shared row) and nothing in
    the module changes.
    """
    table = self.table.get_value()
    words, batch = table.key_spec.encode(ids, "ids")
    shared = None if self.shared is None else self.shared.get_value()
    if self.deterministic:
      flat = words.reshape(-1, table.key_spec.num_words)
      return _read(table, shared, flat).reshape(*batch, self.features)
    if not words.size:
      return jnp.zeros((*batch, self.features), jnp.float32)
    counts = None if self.counts is None else self.counts.get_value()
    flat = words.reshape(-1, words.shape[-1])
    table, counts, counters, rows, recent = _embed(
      self._spec,
      table,
      counts,
      self.counters.get_value(),
      self.seed.get_value(),
      flat,
      shared,
    )
    self.table.set_value(table)
    if counts is not None:
      self.counts.set_value(counts)
    self.counters.set_value(counters)
    self.recent.set_value(recent)
    return rows.reshape(*batch, self.features)

  def apply_gradients(self, ids, row_grads) -> None:
    """One optimizer step on the rows of ``ids``, with the gradients of those rows.

    Gradients of an id that occurs several times are summed (in a fixed
    order, so results are bitwise reproducible), then each distinct id's row
    and optimizer state take one update. Ids without a row are skipped, or
    with ``oov_buckets`` their gradients are summed into their shared rows,
    which take one update each; other rows are not touched.

    Called with the ids of the last lookup (``rows = emb(ids)`` then
    ``emb.apply_gradients(ids, ...)``, the training step), it writes to the
    rows that lookup found instead of finding the ids again.

    Args:
      ids: the ids of the rows (as for calling the module).
      row_grads: ``float[*batch, features]``, e.g. the gradient of the loss
        with respect to the rows the module returned.

    Raises:
      TypeError, ValueError: ids or gradients of the wrong dtype or shape
        (the table is unchanged); ``ValueError`` in inference mode.
    """
    if self.deterministic:
      raise ValueError(
        "apply_gradients: the embedding is in inference mode (deterministic=True), where nothing "
        "changes it; call model.train() (or set deterministic=False) to train."
      )
    table = self.table.get_value()
    words, batch = table.key_spec.encode(ids, "ids")
    grads = jnp.asarray(row_grads) if not isinstance(row_grads, jax.Array) else row_grads
    if not jnp.issubdtype(grads.dtype, jnp.floating):
      raise TypeError(f"row_grads: expected floating gradients, got {grads.dtype}.")
    if grads.shape != (*batch, self.features):
      raise ValueError(
        f"row_grads: expected shape {(*batch, self.features)} (one row per id), got {tuple(grads.shape)}."
      )
    recent = self.recent.get_value()
    self.recent.set_value(None)
    if not words.size:
      return
    flat = grads.reshape(-1, self.features).astype(jnp.float32)
    shared = None if self.shared is None else self.shared.get_value()
    step = None if self.step is None else self.step.get_value()
    table, shared, step = _update(
      self._spec, table, shared, step, words.reshape(-1, words.shape[-1]), flat, recent
    )
    self.table.set_value(table)
    if shared is not None:
      self.shared.set_value(shared)
    if step is not None:
      self.step.set_value(step)

  # ------------------------------------------------------------- reading

  def size(self) -> int:
    """The number of ids that have a row."""
    return int(self.table.get_value().size)

  def export(self) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, rows)`` of every id with a row, as NumPy: ids in their exact dtype, sorted."""
    keys, values, valid = jax.device_get(self.table.get_value().export())
    valid = np.asarray(valid)
    ids, rows = np.asarray(keys)[valid], np.asarray(values["row"])[valid]
    columns = ids.reshape(ids.shape[0], math.prod(ids.shape[1:])).T  # composite ids: element by element
    order = np.lexsort(columns[::-1])
    return ids[order], rows[order]

  def stats(self) -> dict[str, int]:
    """``{"admitted", "refused", "evictions"}``: ids given rows, lookups given none, ids evicted."""
    words = np.asarray(jax.device_get(self.counters.get_value())).astype(np.uint64)
    return {name: int((high << np.uint64(32)) | low) for name, (high, low) in zip(_STATS, words)}

  @property
  def eviction(self):
    """The eviction policy (``None``: a full table refuses new ids)."""
    return self.table.get_value().eviction

  @property
  def min_count(self) -> int:
    return self._spec.min_count

  @property
  def oov_buckets(self) -> int:
    """The shared rows read by ids without their own (0: none)."""
    return 0 if self.shared is None else int(self.shared.get_value()["row"].shape[0])

  def __repr__(self) -> str:
    shared = f", oov_buckets={self.oov_buckets}" if self.shared is not None else ""
    return (
      f"jr.DynamicEmbedding(capacity={self.capacity}, features={self.features}, "
      f"eviction={self.eviction}, min_count={self.min_count}{shared})"
    )


def _add64(words: jax.Array, amounts: jax.Array) -> jax.Array:
  """64-bit counters as ``(high, low)`` uint32 words, plus non-negative int32 ``amounts``."""
  low = words[:, 1] + amounts.astype(jnp.uint32)
  high = words[:, 0] + (low < words[:, 1]).astype(jnp.uint32)
  return jnp.stack([high, low], axis=1)


def _initial_values(spec: _Spec, seed: jax.Array, words: jax.Array, new: jax.Array) -> dict:
  """The row and optimizer state each new id starts with: a function of the seed and the id alone.

  Only the ``new`` rows need one, and drawing a row costs a random key per
  id: the rows are drawn for the smallest of a few batch fractions that holds
  every new row (a warm table has few), and other rows get zeros, which nothing reads.
  """
  base = jax.random.wrap_key_data(seed)

  def row(id_words):
    key = base
    for w in range(id_words.shape[0]):
      key = jax.random.fold_in(key, id_words[w])
    return spec.initializer(key, (spec.features,), jnp.float32)

  n = words.shape[0]
  sizes = sorted({max(1, n >> shift) for shift in (6, 4, 2)} - {n})

  def some(size):
    def draw():
      (index,) = jnp.nonzero(new, size=size, fill_value=n)
      drawn = jax.vmap(row)(words[jnp.minimum(index, n - 1)])
      return jnp.zeros((n, spec.features), jnp.float32).at[index].set(drawn, mode="drop")

    return draw

  count = jnp.sum(new, dtype=jnp.int32)
  branch = jnp.sum(count > jnp.array(sizes, jnp.int32), dtype=jnp.int32)
  rows = jax.lax.switch(branch, [*(some(size) for size in sizes), lambda: jax.vmap(row)(words)])
  return {"row": rows, "slots": tuple(spec.optimizer.init(rows))}


def _shared_rows(spec: _Spec, seed: jax.Array, n: int) -> dict:
  """``n`` shared rows and their optimizer state, drawn from the seed (apart from any id's row)."""
  key = jax.random.fold_in(jax.random.wrap_key_data(seed), constants.SHARED_ROW_SEED)
  rows = spec.initializer(key, (n, spec.features), jnp.float32)
  return {"row": rows, "slots": tuple(spec.optimizer.init(rows))}


def _shared_of(words: jax.Array, shared: dict) -> jax.Array:
  """``int32[N]``: the shared row each id reads (a hash of its words)."""
  n = shared["row"].shape[0]
  return (hash_words(words, seed=constants.SHARED_ROW_SEED) % jnp.uint32(n)).astype(jnp.int32)


def _with_shared(rows: jax.Array, present: jax.Array, words: jax.Array, shared: dict | None) -> jax.Array:
  """``rows`` where ``present``; elsewhere each id's shared row, or zeros without any."""
  other = 0.0 if shared is None else shared["row"][_shared_of(words, shared)]
  return jnp.where(present[:, None], rows, other)


# The module's arrays are donated: an eager call updates them in place (under jit, the caller donates).
@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("table", "counts", "counters"))
def _embed(spec: _Spec, table: Table, counts, counters, seed, words, shared):
  """One lookup: ``(table, counts, counters, rows, recent)``, each id located once in ``table``.

  ``recent`` is what :class:`RecentRows` keeps: ``(words, index, clock)``.
  """
  keys = table.key_spec.decode(words)
  before = table.size
  if counts is None:
    admitted = None
  else:
    found = table.find_rows(keys) >= 0
    counts, admitted = admission.admit(counts, keys, words, ~found, spec.min_count)
    admitted = admitted | found
  table, handles = table.find_or_insert_rows(keys, valid=admitted)
  index = handles.index
  initial = _initial_values(spec, seed, words, handles.inserted)
  table = table.write_rows(index, initial, valid=handles.inserted)
  # Rows are read after the write, from the array it returns: a read of the array before it
  # would have to be kept alive next to the written one, and XLA would copy it whole.
  values = table.read_rows(index)
  present = index >= 0  # admitted ids only: `valid` masked the others
  evictions = jnp.sum(handles.evicted.valid & present, dtype=jnp.int32)  # placed ids, their victims reported
  admitted_ids = table.size - before + evictions
  refused = jnp.sum(~present, dtype=jnp.int32)
  counters = _add64(counters, jnp.stack([admitted_ids, refused, evictions]))
  rows = _with_shared(values["row"], present, words, shared)
  return table, counts, counters, rows, (words, index, table.clock + jnp.uint32(0))


@jax.jit
def _read(table: Table, shared, words) -> jax.Array:
  """Inference: the rows of present ids, zeros (or shared rows) elsewhere; only the rows are read."""
  index = table.find_rows(table.key_spec.decode(words))
  return _with_shared(table.read_rows(index)["row"], index >= 0, words, shared)


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("table", "shared"))
def _update(spec: _Spec, table: Table, shared, step, words, grads, recent):
  """``(table, shared, step)`` after one optimizer step on the rows of ``words``."""
  step = None if step is None else step + 1
  index = _rows_of(table, words, recent)
  rows, total = grouping.group_sums(index, grads)  # each row once, its ids' sum
  values = table.read_rows(rows)
  new_rows, slots = spec.optimizer.update(total, values["row"], values["slots"], step)
  table = table.write_rows(rows, {"row": new_rows, "slots": tuple(slots)}, valid=rows >= 0)
  if shared is not None:  # the ids without a row of their own train their shared rows alike
    groups, total = grouping.group_sums(jnp.where(index < 0, _shared_of(words, shared), -1), grads)
    taken = jnp.maximum(groups, 0)
    taken_slots = [s[taken] for s in shared["slots"]]
    new_rows, slots = spec.optimizer.update(total, shared["row"][taken], taken_slots, step)
    at = jnp.where(groups >= 0, groups, shared["row"].shape[0])  # distinct groups: no conflicting writes
    shared = {
      "row": shared["row"].at[at].set(new_rows, mode="drop"),
      "slots": tuple(s.at[at].set(new, mode="drop") for s, new in zip(shared["slots"], slots)),
    }
  return table, shared, step


def _replicated(tree, mesh: Mesh | None):
  """``tree`` with a copy on every device of ``mesh`` (as it is without one)."""
  if tree is None or mesh is None:
    return tree
  return jax.device_put(tree, NamedSharding(mesh, PartitionSpec()))


def _rows_of(table: Table, words, recent) -> jax.Array:
  """The value rows of ``words``: those of the last lookup when it was of these ids, on this table."""
  if recent is None or recent[0].shape != words.shape:
    return table.find_rows(table.key_spec.decode(words))
  recent_words, index, clock = recent
  same = jnp.all(recent_words == words) & (clock == table.clock)
  return jax.lax.cond(same, lambda: index, lambda: table.find_rows(table.key_spec.decode(words)))
