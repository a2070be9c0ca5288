"""``jr.DynamicEmbedding``: embedding rows assigned to ids inside ``nnx.jit``, trained row by row."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx import reprlib
from jax.sharding import Mesh

from jaxres._core import display, memory
from jaxres._core.encoding import key_specs
from jaxres._core.policies import LRFU, check_policy
from jaxres._core.sharding.sharded_table import ShardedTable
from jaxres._core.storages import registry
from jaxres._core.table import check_capacity
from jaxres._errors import check_int
from jaxres._nn import admission, counters, embedding_steps, pooling, row_gradients, rowwise
from jaxres._nn.embedding_steps import Spec, replicated
from jaxres._nn.row_gradients import Lookup
from jaxres._shell.donation import TableVariable
from jaxres._shell.table_codecs import KeyCodec, is_string_dtype

_INITIALIZER = nnx.initializers.normal(0.01)
_EVICTION = LRFU()  # the default: see the embeddings guide, 'Defaults'


class EmbeddingState(nnx.Variable):
  """The tables and counters of a :class:`DynamicEmbedding` (not an ``nnx.Param``: no dense gradient)."""


class EmbeddingRows(EmbeddingState, TableVariable):
  """The table of a :class:`DynamicEmbedding`'s rows and their optimizer state.

  Its metadata ``row_optimizer`` and ``restore_rows_only`` let a checkpoint
  trained with another row optimizer be restored: the rows and scores kept,
  the optimizer state started afresh (see :func:`rows_only`); ``max_length``
  (string ids) lets a checkpoint of another one be refused by name.
  """


class EmbeddingStep(EmbeddingState):
  """The steps (``apply_gradients`` calls) of an embedding whose row optimizer needs them
  (:class:`jaxres.CatchUpAdam`, or an optax transformation with a schedule: see
  :mod:`~jaxres._nn.rowwise`): part of the optimizer state.

  Its metadata ``restore_rows_only`` lets a checkpoint without it (trained
  with another row optimizer) be restored: the count then starts afresh with
  every row's optimizer state.
  """


class EmbeddingCounters(EmbeddingState):
  """An embedding's counters (:mod:`jaxres._nn.counters`): ids admitted, lookups refused, ids evicted.

  Its metadata ``admits`` (``min_count > 1``) says how to read a checkpoint
  written before refusals were split by cause (see
  :func:`~jaxres._nn.counters.split_refusals`).
  """


class AdmissionCounts(EmbeddingState):
  """The occurrences of ids waiting for a row (:mod:`jaxres._nn.admission`), each stopping at ``min_count``.

  Its metadata ``min_count`` lets a checkpoint of counts in another integer
  dtype (written before counts stopped at ``min_count``, or with another
  ``min_count``) be restored: each count kept, at most ``min_count``.
  """


class RecentRows(nnx.Variable):
  """The rows the last lookup found, kept for :meth:`DynamicEmbedding.apply_gradients` (not checkpointed).

  Its value is ``None`` or ``(words, index, clock)``: the ids' key words, their
  value rows and the table's clock after the lookup. ``apply_gradients``
  uses the rows when it is given the same ids and the table has not changed
  since, and clears them.
  """

  checkpointed = False  # derived within a step: checkpoints leave it out (see jaxres._integrations.nnx)


class DynamicEmbedding(nnx.Module):
  """An embedding whose rows are given to ids as they arrive and trained by a row-wise optimizer.

  A hash table (:class:`jaxres.OpenAddressingTable`, or a
  :class:`jaxres.ShardedTable` over ``mesh``) maps each id to its value: the
  embedding row **and the row's optimizer state** (Adam's ``mu``, ``nu`` and
  its own ``count``). Calling the module looks ids up and gives new ids rows;
  the rows looked up are trained by differentiating with
  :func:`jaxres.value_and_grad` (the plain NNX step), or by
  :meth:`apply_gradients`. Both cost O(batch), whatever the capacity, eagerly
  and inside ``nnx.jit`` (donate the model, ``nnx.jit(..., donate_argnums=0)``,
  so the table is updated in place).

  - **New ids.** An id's first row is ``initializer(key, (features,))`` with a
    key derived from the seed and the id alone: the same row whatever the
    arrival order or the shard.
  - **Full table.** With ``eviction=jr.LRFU()`` (the default: recency and
    frequency), ``jr.LRU()`` or ``jr.LFU()`` a new id replaces the
    lowest-scored row near its position, row and optimizer state together
    (see ``jr.OpenAddressingTable``); with ``eviction=None`` new ids are
    refused once the table is full.
  - **Admission.** With ``min_count > 1``, an id gets a row at its
    ``min_count``-th occurrence, counted in a bounded table of
    ``admission_capacity`` ids, about 14.3 bytes a counted int64 id. It never
    admits early; once the counts are full, a new id takes the place of the
    id counted least recently among its candidates, whose count is lost, so
    an id may be admitted late.
  - **Refused ids** (not admitted yet, or a full table without eviction)
    read zeros and get no update; an evicted or refused id that comes back
    starts afresh.
  - **Weights** (``emb(ids, weights)``, a padded multi-hot batch): a weight
    of 0 marks padding, which is not looked up, inserted, counted or
    trained and reads zeros; every other row comes back scaled by its
    weight (so its gradient is too), for the caller to pool
    (:class:`jaxres.EmbeddingCollection` pools them itself).
  - **Shared rows** (``oov_buckets=n``): an id without a row of its own
    (not admitted yet, refused, evicted; in inference mode too) reads one
    of ``n`` shared rows, chosen by a hash of the id, instead of zeros, and
    its gradients train that row, summed with those of the other ids that
    read it (each shared row with its own optimizer state, as any row):
    the tail of the ids gets a trained, hashed embedding while frequent ids
    get their own. The shared rows are replicated on every device of
    ``mesh``, checkpointed and exported with the module.

  - **String ids** (``key=str``): exact, as strings of at most
    ``max_length`` UTF-8 bytes (two strings never share a row; a longer one
    is a ``ValueError``). Eagerly the module takes strings (NumPy arrays or
    lists); strings cannot enter ``jit``, so a jitted step takes their
    ``uint32`` rows, :meth:`encode` (``jr.keys.encode_strings(ids,
    max_length)``), made on the host before the call. :meth:`export` gives
    the strings back, and a served signature takes them as strings.

  Args:
    capacity: the rows the table holds (live ids at most).
    features: the width of a row.
    key: the id dtype (``jnp.int64`` by default: with ``jax_enable_x64``
      off, pass NumPy ``int64`` ids eagerly and ``jr.keys.split64`` word
      pairs inside ``jit``), ``int32``, ``uint32``, ``uint64``, or ``str``.
    max_length: for ``key=str``, the longest id in UTF-8 bytes (default 64);
      each id is stored as ``ceil(max_length / 4) + 1`` ``uint32`` words.
    optimizer: an elementwise ``optax.GradientTransformation`` (``sgd``,
      ``adam``, ``adagrad``, ``rmsprop``, ``lion``, chains of them), applied to
      each row with its own state (a learning-rate schedule reads the
      embedding's step, every row alike), or :class:`jaxres.CatchUpAdam`.
    eviction: ``jr.LRFU()`` (the default: the lowest loss of the policies on
      the quality tasks, stationary and drifting; see the embeddings guide),
      ``jr.LRU()``, ``jr.LFU()`` or ``None`` (a full table refuses new ids).
    min_count: occurrences an id needs to get a row (1: at once; at most 65,535).
    initializer: ``initializer(key, shape, dtype)``, as ``nnx.initializers``
      (``None``, the default: ``normal(0.01)``).
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
    name: how messages name the embedding (default: its ``repr``).
    storage: the table's storage kind: ``"open_addressing"`` (the default) or
      ``"lean"`` (the slot is the row: 17 bytes a slot beyond the row and its
      optimizer state, with eviction; not yet the default). A checkpoint of
      one kind restores into the other (its ids inserted anew).

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
    >>> padded = emb(np.array([7, 9]), weights=np.array([0.5, 0.0]))   # 9 is padding
    >>> np.allclose(padded, [0.5 * emb(np.array([7]))[0], [0, 0]]), emb.size()
    (True, 2)
    >>> emb.stats()
    {'admitted': 2, 'refused': 0, 'unadmitted': 0, 'full': 0, 'evictions': 0}
    >>> emb   # print(model) shows it on one line likewise, without its arrays
    jr.DynamicEmbedding(capacity=4, features=2, key=int64, size=2, optimizer=optax(stateless),
                        eviction=jr.LRFU(half_life=256), min_count=1)

    String ids: strings eagerly, their rows (:meth:`encode`) inside ``jit``:

    >>> words = jr.DynamicEmbedding(4, 2, key=str, max_length=8, optimizer=optax.sgd(1.0), rngs=nnx.Rngs(0))
    >>> rows = words(["fox", "owl", "fox"])
    >>> jitted = nnx.jit(lambda m, ids: m(ids), donate_argnums=0)(words, words.encode(["owl"]))
    >>> bool((jitted == rows[1]).all()), words.export()[0].tolist()
    (True, ['fox', 'owl'])
  """

  def __init__(
    self,
    capacity: int,
    features: int,
    *,
    key=jnp.int64,
    max_length: int | None = None,
    optimizer,
    eviction=_EVICTION,
    min_count: int = 1,
    initializer: Callable | None = None,
    rngs: nnx.Rngs,
    mesh: Mesh | None = None,
    axis: str | None = None,
    admission_capacity: int | None = None,
    deterministic: bool = False,
    restore_rows_only: bool = False,
    oov_buckets: int = 0,
    name: str | None = None,
    storage: str = registry.DEFAULT,
  ):
    capacity = check_capacity(capacity)
    storage_class = registry.writable(storage)
    ids = _id_codec(key, max_length)
    oov_buckets = check_int(oov_buckets, "oov_buckets", low=0)
    features = check_int(features, "features", low=1)
    min_count = admission.check_min_count(min_count)
    eviction = check_policy(eviction)
    if eviction is not None and eviction.takes_scores:
      raise ValueError(f"eviction: {eviction} needs scores from the caller; use jr.LRU() or jr.LFU().")
    if initializer is None:
      initializer = _INITIALIZER
    elif not callable(initializer):
      raise TypeError(f"initializer: expected initializer(key, shape, dtype), got {initializer!r}.")
    if not isinstance(rngs, nnx.Rngs):
      raise TypeError(f"rngs: expected an nnx.Rngs, got {rngs!r}.")
    if (mesh is None) != (axis is None):
      raise ValueError("mesh, axis: give both to shard the table, or neither.")
    if not isinstance(deterministic, bool):
      raise TypeError(f"deterministic: expected a bool, got {deterministic!r}.")
    if not isinstance(restore_rows_only, bool):
      raise TypeError(f"restore_rows_only: expected a bool, got {restore_rows_only!r}.")
    if name is not None and not isinstance(name, str):
      raise TypeError(f"name: expected a str, got {name!r}.")
    optimizer = rowwise.for_rows(optimizer, features)
    room = (
      capacity if admission_capacity is None else check_capacity(admission_capacity, "admission_capacity")
    )
    value = {"row": jax.ShapeDtypeStruct((features,), jnp.float32), "slots": optimizer.slots}
    default = jax.tree.map(lambda _: 0, value)
    if mesh is None:
      table = storage_class.create(capacity, key=ids.spec, value=value, default=default, eviction=eviction)
    else:
      table = ShardedTable.create(
        mesh,
        axis,
        capacity,
        key=ids.spec,
        value=value,
        default=default,
        storage=storage_class,
        eviction=eviction,
      )
    mesh = None if mesh is None else table.mesh  # the table's: its axes in Auto mode, as jit returns
    self._spec = Spec(optimizer, initializer, min_count, mesh)
    self._ids = ids  # how ids become the table's keys: strings as rows of uint32 words
    self.capacity, self.features, self.name = capacity, features, name
    label = f"the table of DynamicEmbedding {name!r}" if name else "the table of a DynamicEmbedding"
    self.table = EmbeddingRows(
      table,
      row_optimizer=optimizer,
      restore_rows_only=restore_rows_only,
      max_length=self.max_length,
      label=label,
    )
    counts = (
      replicated(admission.counter(room, ids.spec, min_count), mesh) if min_count > 1 else None
    )  # a copy on each device
    self.counts = None if counts is None else AdmissionCounts(counts, min_count=min_count)
    self.seed = EmbeddingState(jax.random.key_data(rngs.params()))
    self.counters = EmbeddingCounters(counters.zeros(), admits=min_count > 1)
    seed = self.seed.get_value()
    shared = embedding_steps.shared_rows(self._spec, seed, oov_buckets) if oov_buckets else None
    shared = replicated(shared, mesh)  # every device reads them: a copy on each
    self.shared = None if shared is None else EmbeddingState(shared)
    step = replicated(jnp.zeros((), jnp.int32), mesh) if optimizer.needs_step else None
    self.step = None if step is None else EmbeddingStep(step, restore_rows_only=restore_rows_only)
    self.recent = RecentRows(None)
    self.deterministic = deterministic

  def __call__(self, ids, weights=None) -> jax.Array:
    """``float32[*batch, features]``: the rows of ``ids``, new ids given rows (where refused: zeros,
    or their shared row with ``oov_buckets``).

    In training mode, inside :func:`jaxres.value_and_grad` (or
    :func:`jaxres.grad`), the rows returned take a step of the row optimizer
    with their gradients; inside plain ``nnx.value_and_grad`` (or ``jax.grad``),
    which would leave them untrained, it is a ``ValueError`` naming the
    embedding and :func:`jaxres.value_and_grad`.
    In inference mode (:attr:`deterministic`, set by ``model.eval()``) a pure
    read: ids without a row read zeros (or their shared row) and nothing in
    the module changes.

    Args:
      ids: ``key[*batch]`` (``uint32[*batch, 2]`` word pairs for 64-bit ids
        inside ``jit`` with ``jax_enable_x64`` off; for ``key=str``, strings
        eagerly and their rows, :meth:`encode`, inside ``jit``).
      weights: optional ``float[*batch]``: each row comes back scaled by its
        weight; a weight of 0 marks padding (not looked up, inserted,
        counted or trained; reads zeros).

    Raises:
      TypeError, ValueError: ids of another dtype, strings longer than
        ``max_length``, weights of another shape or dtype, or negative
        (nothing in the module changes).
    """
    words, batch = self.key_words(ids, "ids")
    weights = pooling.check_weights(weights, batch, "weights")
    flat = words.reshape(-1, self.key_spec.num_words)
    valid = None if weights is None else weights.reshape(-1) != 0
    rows = self.lookup_words(flat, valid).reshape(*batch, self.features)
    return rows if weights is None else rows * weights[..., None]

  def encode(self, ids) -> jax.Array:
    """``ids`` in the form this embedding takes inside ``jit``, made on the host before the call.

    Strings (``key=str``) become the ``uint32[*batch, W]`` rows of
    ``jr.keys.encode_strings(ids, max_length)``; 64-bit ids become
    ``uint32[*batch, 2]`` word pairs with ``jax_enable_x64`` off; other ids
    a JAX array of the key dtype. Encoded ids are returned as they are.

    Raises:
      TypeError, ValueError: ids this embedding does not take (strings
        longer than ``max_length`` included), naming ``ids``.

    Examples:
      >>> import optax, jaxres as jr
      >>> from flax import nnx
      >>> emb = jr.DynamicEmbedding(8, 2, key=str, max_length=8, optimizer=optax.sgd(0.1), rngs=nnx.Rngs(0))
      >>> rows = emb.encode(["fox", "héron"])
      >>> rows.dtype, rows.shape, jr.keys.decode_strings(rows).tolist()
      (dtype('uint32'), (2, 3), ['fox', 'héron'])
    """
    return self.encode_as(ids, "ids")

  def encode_as(self, ids, name: str) -> jax.Array:
    """:meth:`encode`, its errors naming ``name`` (a collection's feature)."""
    if self._ids.is_string:
      return jax.device_put(np.asarray(self._ids.encode(ids, name)))
    spec = self.key_spec
    spec.encode(ids, name)  # checked: raises on ids this embedding does not take
    if isinstance(ids, jax.Array):
      return ids
    ids = np.asarray(ids)
    if spec.wide and not key_specs.x64_enabled() and ids.dtype != np.uint32:
      return jax.device_put(np.ascontiguousarray(key_specs.split64_host(ids.astype(spec.dtype))))
    return jax.device_put(ids if ids.dtype == np.uint32 and spec.wide else ids.astype(spec.dtype))

  def key_words(self, ids, name: str = "ids") -> tuple[jax.Array | np.ndarray, tuple[int, ...]]:
    """``(uint32[*batch, W] key words, batch shape)`` of ``ids`` (as :meth:`__call__` takes them),
    checked; errors name ``name``."""
    return self.key_spec.encode(self._ids.encode(ids, name), name)

  def lookup_words(self, words: jax.Array, valid: jax.Array | None = None) -> jax.Array:
    """``float32[N, features]``: the rows of the ids of key words ``words`` (``uint32[N, W]``,
    from the table's ``key_spec``), not scaled; ``valid`` (``bool[N]``) marks those that are not padding.

    The lookup :meth:`__call__` makes (and :class:`jaxres.EmbeddingCollection`,
    once per table for all its features): in training mode it gives new ids
    rows and records the rows it located for their step.
    """
    table = self.table.get_value()
    shared = None if self.shared is None else self.shared.get_value()
    if self.deterministic:
      if (tape := row_gradients.active()) is not None:
        tape.note_inference()
      return embedding_steps.read(table, shared, words, valid)
    if not words.shape[0]:
      return jnp.zeros((0, self.features), jnp.float32)
    tape = row_gradients.active()
    if tape is None:
      row_gradients.refuse_if_differentiated(self._untrained_message())
    else:
      tape.admit(self)
    counts = None if self.counts is None else self.counts.get_value()
    # Eagerly inside a differentiated function, the arrays are not donated: the function may still
    # fail, and its arguments must then be as they were (under jit, donation is the caller's).
    embed = embedding_steps.embed if tape is None else embedding_steps.embed_keeping
    table, counts, tallies, rows, lookup = embed(
      self._spec, table, counts, self.counters.get_value(), self.seed.get_value(), words, valid, shared
    )
    self.table.set_value(table)
    if counts is not None:
      self.counts.set_value(counts)
    self.counters.set_value(tallies)
    if tape is not None:
      return tape.record(self, rows, lookup)
    self.recent.set_value((lookup.words, lookup.index, lookup.clock))
    return rows

  def apply_gradients(self, ids, row_grads, weights=None) -> None:
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
      row_grads: ``float[*batch, features]``, the gradient of the loss with
        respect to the rows the module returned.
      weights: the weights of the lookup, if it had any: the rows came back
        scaled by them (so their gradients are scaled alike), and padding
        (weight 0) is not trained.

    Raises:
      TypeError, ValueError: ids, gradients or weights of the wrong dtype or
        shape (the table is unchanged); ``ValueError`` in inference mode.
    """
    self._check_training("apply_gradients")
    table = self.table.get_value()
    words, batch = self.key_words(ids, "ids")
    grads = row_grads if isinstance(row_grads, jax.Array) else jax.device_put(np.asarray(row_grads))
    if not jnp.issubdtype(grads.dtype, jnp.floating):
      raise TypeError(f"row_grads: expected floating gradients, got {grads.dtype}.")
    if grads.shape != (*batch, self.features):
      raise ValueError(
        f"row_grads: expected shape {(*batch, self.features)} (one row per id), got {tuple(grads.shape)}."
      )
    weights = pooling.check_weights(weights, batch, "weights")
    recent = self.recent.get_value()
    self.recent.set_value(None)
    if not words.size:
      return
    grads = grads.astype(jnp.float32)
    valid = None
    if weights is not None:
      grads, valid = grads * weights[..., None], (weights != 0).reshape(-1)
    flat = words.reshape(-1, words.shape[-1])
    self._step(flat, grads.reshape(-1, self.features), embedding_steps.rows_of(table, flat, recent), valid)

  def step_rows(self, lookups: Sequence[Lookup], grads: Sequence[jax.Array]) -> None:
    """One optimizer step on the rows of ``lookups`` (made in a function :func:`jaxres.value_and_grad`
    differentiated), with their gradients (``float32[N, features]`` each): what
    :func:`jaxres.value_and_grad` calls.

    The rows are those each lookup located, while the table is as that lookup
    left it; after a later insert they are found again (see
    :func:`~jaxres._nn.embedding_steps.rows_of_lookups`).
    """
    self._check_training("step_rows")
    if len(lookups) != len(grads) or not lookups:
      raise ValueError(f"step_rows: expected a gradient per lookup, got {len(grads)} for {len(lookups)}.")
    words = jnp.concatenate([lookup.words for lookup in lookups])
    if not words.shape[0]:
      return
    index, valid = embedding_steps.rows_of_lookups(self.table.get_value(), tuple(lookups))
    self._step(words, jnp.concatenate([g.reshape(-1, self.features) for g in grads]), index, valid)

  def _step(self, words, grads, index, valid) -> None:
    shared = None if self.shared is None else self.shared.get_value()
    step = None if self.step is None else self.step.get_value()
    table, shared, step = embedding_steps.update(
      self._spec, self.table.get_value(), shared, step, words, grads, index, valid
    )
    self.table.set_value(table)
    if shared is not None:
      self.shared.set_value(shared)
    if step is not None:
      self.step.set_value(step)

  def _check_training(self, method: str) -> None:
    if self.deterministic:
      raise ValueError(
        f"{method}: the embedding is in inference mode (deterministic=True), where nothing "
        "changes it; call model.train() (or set deterministic=False) to train."
      )

  def _untrained_message(self) -> str:
    return (
      f"{self.name or repr(self)} looked up ids in training mode inside a function differentiated by "
      "nnx.value_and_grad, nnx.grad or jax.grad, which would leave its rows untrained: differentiate with "
      "jr.value_and_grad (or jr.grad), which takes the same arguments and also steps the rows looked up, "
      "or look the ids up outside the differentiated function and call apply_gradients."
    )

  # ------------------------------------------------------------- reading

  def size(self) -> int:
    """The number of ids that have a row."""
    return int(self.table.get_value().size)

  def export(self) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, rows)`` of every id with a row, as NumPy: ids in their exact dtype (``str`` ids as an
    array of Python strings), sorted (strings by code point)."""
    keys, values, valid = jax.device_get(self.table.get_value().export())
    valid = np.asarray(valid)
    ids, rows = np.asarray(keys)[valid], np.asarray(values["row"])[valid]
    # Composite ids element by element; string rows word by word, which is their code-point order.
    columns = ids.reshape(ids.shape[0], math.prod(ids.shape[1:])).T
    order = np.lexsort(columns[::-1])
    return self._ids.decode(ids[order]), rows[order]

  def stats(self) -> dict[str, int]:
    """``{"admitted", "refused", "unadmitted", "full", "evictions"}``: ids given rows; lookups given
    none, in all, while waiting for ``min_count`` and for a full table; ids evicted."""
    return counters.read(self.counters.get_value())

  def memory(self) -> dict[str, int]:
    """Bytes the module holds now, by part, summing to the bytes of ``nnx.state(emb)``.

    ``rows``: the embedding rows; ``optimizer``: their row optimizer's state
    (with its step count, if any); ``index``: the hash table's keys, slots,
    scores, change stamps and free rows; ``admission``: the counts of ids
    waiting for ``min_count``; ``shared``: the ``oov_buckets`` shared rows
    and their optimizer state; ``lookup``: the ids of the last training-mode
    lookup and the rows it found, kept for :meth:`apply_gradients` until it
    runs (``4 x (W + 1)`` bytes an id for ids of ``W`` key words, 12 with
    int64 ids, and 4 more; 0 after a step: :meth:`capacity_for`'s ``batch``
    leaves room for them); ``other``: counters and the seed. Every other part
    is sized by ``capacity`` whatever the number of ids held (on a mesh: over
    all devices, the admission counts and shared rows counted once).

    Examples:
      >>> import numpy as np, optax, jaxres as jr
      >>> from flax import nnx
      >>> emb = jr.DynamicEmbedding(1000, 16, optimizer=optax.sgd(0.1), rngs=nnx.Rngs(0))
      >>> emb.memory()
      {'rows': 64064, 'optimizer': 0, 'index': 48020, 'admission': 0, 'shared': 0, 'lookup': 0, 'other': 40}
      >>> rows = emb(np.arange(100))   # a training lookup with no step after it yet
      >>> emb.memory()["lookup"]       # 100 ids: two key words and a row each, and the clock
      1204
      >>> emb.apply_gradients(np.arange(100), np.zeros((100, 16), np.float32))
      >>> emb.memory()["lookup"]
      0
    """
    table = self.table.get_value()
    values = table.value_memory()
    parts = {
      "rows": values["row"],
      "optimizer": sum(jax.tree.leaves(values["slots"])) + memory.nbytes(nnx.state(self, EmbeddingStep)),
      "index": table.memory()["index"],
      "admission": memory.nbytes(None if self.counts is None else self.counts.get_value()),
      "shared": memory.nbytes(None if self.shared is None else self.shared.get_value()),
      "lookup": memory.nbytes(self.recent.get_value()),
    }
    parts["other"] = memory.nbytes(nnx.state(self)) - sum(parts.values())
    return parts

  @classmethod
  def capacity_for(
    cls,
    nbytes: int,
    features: int,
    *,
    optimizer,
    key=jnp.int64,
    min_count: int = 1,
    batch: int = 0,
    **options,
  ) -> int:
    """The largest ``capacity`` whose embedding holds at most ``nbytes`` (:meth:`memory`'s sum).

    Takes the arguments of the constructor but ``capacity`` and ``rngs``
    (``eviction``, ``admission_capacity``, ``oov_buckets``, ``mesh`` and
    ``axis``, ...): the module is built abstractly (``nnx.eval_shape``), a
    few times, and nothing is allocated. With ``min_count > 1`` and no
    ``admission_capacity``, the admission counts grow with the capacity and
    share the budget. The same arguments make a :class:`jaxres.TableConfig`
    (and :meth:`jaxres.TableConfig.capacity_for` sizes one). ``batch``: room
    left for the ids of a training lookup of that many ids that no step has
    followed yet (:meth:`memory`'s ``lookup``: eager ``emb(ids)`` before
    ``apply_gradients``); 0 (the default) sizes the module between steps.

    Raises:
      TypeError, ValueError: as the constructor, naming the argument; ``nbytes``
        negative or too small for a capacity of 1; ``batch`` negative.

    Examples:
      >>> import optax, jaxres as jr
      >>> c = jr.DynamicEmbedding.capacity_for(64 << 20, 16, optimizer=optax.adam(1e-3), eviction=jr.LRU())
      >>> c, round(c * 16 * 4 * 3 / (64 << 20), 2)  # share of rows of 16 floats and adam's two moments
      (275035, 0.79)
    """
    if "rngs" in options or "capacity" in options:
      raise TypeError(
        "capacity_for: takes neither capacity nor rngs (it searches the first, builds with its own)."
      )

    batch = check_int(batch, "batch", low=0)

    def bytes_at(capacity: int) -> int:
      build = lambda: cls(
        capacity, features, optimizer=optimizer, key=key, min_count=min_count, rngs=nnx.Rngs(0), **options
      )
      module = nnx.eval_shape(build)
      lookup = 4 * (batch * (module.key_spec.num_words + 1) + 1) if batch else 0  # words, rows, clock
      return memory.nbytes(nnx.state(module)) + lookup

    mesh, axis = options.get("mesh"), options.get("axis")
    smallest = 1 if mesh is None else ShardedTable.smallest_capacity(mesh, axis, options.get("eviction"))
    return memory.largest_capacity(bytes_at, nbytes, smallest=smallest)

  @property
  def key_spec(self):
    """How ids are encoded as key words (``uint32[*batch, W]``): the table's."""
    return self.table.get_value().key_spec

  @property
  def max_length(self) -> int | None:
    """The longest string id in UTF-8 bytes (``key=str``); ``None`` for integer ids."""
    return self._ids.max_length if self._ids.is_string else None

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

  # ------------------------------------------------------------- display

  def _facts(self, named: bool = True) -> dict[str, str]:
    """What a repr shows, as texts: no arrays, nor the row optimizer's internals. ``size`` is
    ``"traced"`` inside ``jit``; ``name`` is left out where unset or not ``named``."""
    table = self.table.get_value()
    facts = {"name": repr(self.name)} if named and self.name is not None else {}
    facts |= {"capacity": str(self.capacity), "features": str(self.features)}
    if self._ids.is_string:
      facts |= {"key": "str", "max_length": str(self.max_length)}
    else:
      facts["key"] = str(table.key_spec)
    facts |= {
      "size": display.count(table.size),
      "optimizer": self._spec.optimizer.name,
      "eviction": str(table.eviction),
      "min_count": str(self.min_count),
    }
    if self.shared is not None:
      facts["oov_buckets"] = str(self.oov_buckets)
    return facts

  def __repr__(self) -> str:
    return display.constructor("jr.DynamicEmbedding", self._facts())

  def __nnx_repr__(self):  # print() of a module holding this one: one line of facts
    yield reprlib.Object(type=type(self), same_line=True)
    for name, value in self._facts().items():
      yield reprlib.Attr(name, value, use_raw_value=True)

  def __treescope_repr__(self, path, subtree_renderer):  # nnx.display, treescope: the same line
    from treescope import rendering_parts

    return rendering_parts.build_one_line_tree_node(
      display.constructor(type(self).__name__, self._facts()), path
    )


def _id_codec(key, max_length: int | None) -> KeyCodec:
  """How ids of ``key`` become table keys; ``max_length`` only for ``key=str`` (default 64)."""
  if max_length is not None and not is_string_dtype(key):
    raise ValueError(f"max_length: only string ids (key=str) have a maximum length; got key={key!r}.")
  return KeyCodec(key, 64 if max_length is None else max_length, length_name="max_length")
