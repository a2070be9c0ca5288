"""``jr.EmbeddingCollection``: many sparse features over a few dynamic tables, each table located once.

A recommender's model has tens of sparse features: one id per example (the
user, the item) or a padded row of ids (the last 50 items, a bag of tags),
pooled or not. Each feature reads one table (:class:`TableConfig`); features
may share a table (a vocabulary of items read by the item and by the
history). A call looks every table up **once**: the ids of all its features
in one lookup of its :class:`~jaxres.DynamicEmbedding`, so a shared table's
rows are trained by every feature that reads them, and the step costs one
probe per id.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx import reprlib, visualization
from jax.sharding import Mesh

from jaxres._core import display, memory
from jaxres._core.policies import LRFU
from jaxres._core.storages import registry
from jaxres._errors import check_int
from jaxres._nn import admission, pooling
from jaxres._nn.embedding import DynamicEmbedding


@dataclasses.dataclass(frozen=True)
class TableConfig:
  """One table of a :class:`EmbeddingCollection`: the arguments of a :class:`jaxres.DynamicEmbedding`.

  Args:
    capacity: the rows the table holds (live ids at most).
    features: the width of a row.
    optimizer: the rows' optimizer: an elementwise optax transformation
      (``optax.adam(1e-3)``, applied row by row) or :class:`jaxres.CatchUpAdam`.
    key: the id dtype (``jnp.int64`` by default), or ``str`` (string ids).
    max_length: for ``key=str``, the longest id in UTF-8 bytes (default 64).
    eviction: ``jr.LRFU()`` (the default), ``jr.LRU()``, ``jr.LFU()`` or ``None`` (a full table
      refuses new ids).
    min_count: occurrences an id needs to get a row.
    admission_capacity: ids the admission count holds (default ``capacity``).
    initializer: ``initializer(key, shape, dtype)`` of new rows (``None``:
      ``DynamicEmbedding``'s, ``normal(0.01)``).
    oov_buckets: shared rows read (and trained) by ids without a row of their own.
    storage: the table's storage kind, ``"open_addressing"`` (the default) or ``"lean"``.

  Examples:
    >>> import optax, jaxres as jr
    >>> jr.TableConfig(1 << 20, 32, optimizer=optax.adam(1e-3)).capacity
    1048576
    >>> jr.TableConfig(1 << 16, 8, optimizer=optax.adam(1e-3), key=str, max_length=32).max_length
    32
  """

  capacity: int
  features: int
  optimizer: Any = dataclasses.field(kw_only=True)
  key: Any = dataclasses.field(default=jnp.int64, kw_only=True)
  max_length: int | None = dataclasses.field(default=None, kw_only=True)
  eviction: Any = dataclasses.field(default=LRFU(), kw_only=True)
  min_count: int = dataclasses.field(default=1, kw_only=True)
  admission_capacity: int | None = dataclasses.field(default=None, kw_only=True)
  initializer: Callable | None = dataclasses.field(default=None, kw_only=True)
  oov_buckets: int = dataclasses.field(default=0, kw_only=True)
  storage: str = dataclasses.field(default=registry.DEFAULT, kw_only=True)

  def __post_init__(self):
    check_int(self.capacity, "capacity", low=1)
    check_int(self.features, "features", low=1)
    admission.check_min_count(self.min_count)
    check_int(self.oov_buckets, "oov_buckets", low=0)
    registry.writable(self.storage)

  def _embedding_options(self) -> dict[str, Any]:
    """The arguments of the table's :class:`jaxres.DynamicEmbedding` (but rngs, mesh and axis)."""
    return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}

  @classmethod
  def capacity_for(
    cls, nbytes: int, features: int, *, optimizer, mesh=None, axis=None, batch: int = 0, **options
  ) -> int:
    """The largest ``capacity`` whose table, built from a config of these arguments, holds at most
    ``nbytes`` (its :meth:`jaxres.DynamicEmbedding.memory` sum): this config's defaults
    (``jr.LRFU()`` eviction among them), sized as :meth:`jaxres.DynamicEmbedding.capacity_for` does.

    Args:
      nbytes: the budget of the table.
      features: the width of a row.
      optimizer: the rows' optimizer, as for the config.
      mesh: the collection's mesh, where it is sharded.
      axis: the mesh axis the collection is sharded over.
      batch: room for a training lookup of that many ids no step has followed yet (see
        :meth:`jaxres.DynamicEmbedding.capacity_for`).
      **options: the config's other fields (``key``, ``eviction``, ``min_count``, ...).

    Raises:
      TypeError, ValueError: as the config and ``DynamicEmbedding.capacity_for``, naming the argument.

    Examples:
      >>> import optax, jaxres as jr
      >>> c = jr.TableConfig.capacity_for(16 << 20, 16, optimizer=optax.adam(1e-3))
      >>> c == jr.DynamicEmbedding.capacity_for(16 << 20, 16, optimizer=optax.adam(1e-3), eviction=jr.LRFU())
      True
      >>> config = jr.TableConfig(c, 16, optimizer=optax.adam(1e-3))   # every default kept
    """
    if "capacity" in options:
      raise TypeError("capacity_for: takes no capacity (it searches for it).")
    settings = cls(1, features, optimizer=optimizer, **options)._embedding_options()
    del settings["capacity"], settings["features"]
    return DynamicEmbedding.capacity_for(nbytes, features, mesh=mesh, axis=axis, batch=batch, **settings)


@dataclasses.dataclass(frozen=True)
class FeatureConfig:
  """One sparse feature of a :class:`EmbeddingCollection`: the table it reads and how it pools.

  Args:
    table: the name of the table.
    combiner: how a multi-hot feature's rows (``ids`` of shape ``[batch, L]``)
      become one per example: ``"sum"`` (of weight x row), ``"mean"`` (that sum
      divided by the sum of the weights), ``"sqrtn"`` (divided by the root of
      the sum of the squared weights), or ``None`` (unpooled: ``[batch, L,
      features]``, each row scaled by its weight). A one-id feature (``ids``
      of shape ``[batch]``) is a bag of one: without weights it returns its
      row whatever the combiner.

  Examples:
    >>> import jaxres as jr
    >>> jr.FeatureConfig("items", combiner="mean")
    FeatureConfig(table='items', combiner='mean')
  """

  table: str
  combiner: str | None = "sum"

  def __post_init__(self):
    if not isinstance(self.table, str):
      raise TypeError(f"table: expected a table's name, got {self.table!r}.")
    pooling.check_combiner(self.combiner, "combiner")


class EmbeddingCollection(nnx.Module):
  """Sparse features over dynamic embedding tables: one id or a padded multi-hot row per example, pooled.

  ``tables`` maps names to :class:`TableConfig`\\ s, ``features`` names to
  :class:`FeatureConfig`\\ s naming a table each. Calling the collection with
  a dict of features (``ids``, or ``(ids, weights)``) returns a dict of rows:
  ``float32[batch, features]`` for a pooled feature, ``[batch, L, features]``
  for an unpooled one. Each table is located **once** per call: the ids of
  all its features go through one lookup of its
  :class:`~jaxres.DynamicEmbedding` (so features sharing a table share and
  train its rows), at O(batch) whatever the capacities.

  A weight of 0 marks padding: that id is not looked up, inserted, counted
  for admission or trained, and reads zeros. Other weights scale their row's
  contribution to the pooled row, and so its gradient.

  Everything a :class:`~jaxres.DynamicEmbedding` does, the collection's
  tables do: differentiating with :func:`jaxres.value_and_grad` trains the rows
  looked up, ``model.eval()`` makes lookups pure reads, ``jr.Checkpoint``
  saves them (deferred restore and incremental saves included),
  ``jr.saved_model`` exports them. ``emb.tables[name]`` is a table's
  ``DynamicEmbedding`` (``size()``, ``export()``, ``stats()``).

  Args:
    tables: table name -> :class:`TableConfig` (a mapping, or ``(name,
      config)`` pairs).
    features: feature name -> :class:`FeatureConfig` (likewise).
    rngs: ``nnx.Rngs``: each table's seed of new rows is drawn from its
      ``params`` stream, tables in order of name.
    mesh: shard every table over ``axis`` of this mesh (give both or neither).
    axis: the mesh axis.

  Raises:
    TypeError, ValueError: a feature naming a table that is not given, a
      table given twice with different settings, settings a
      ``DynamicEmbedding`` refuses (the message names the table).

  Examples:
    >>> import numpy as np, optax, jaxres as jr
    >>> from flax import nnx
    >>> emb = jr.EmbeddingCollection(
    ...     {"items": jr.TableConfig(1024, 4, optimizer=optax.adam(1e-3))},
    ...     {"item": jr.FeatureConfig("items"), "history": jr.FeatureConfig("items", combiner="mean")},
    ...     rngs=nnx.Rngs(0))
    >>> history = np.array([[7, 8, 0], [9, 0, 0]])
    >>> out = emb({"item": np.array([7, 9]), "history": (history, np.array([[1.0, 1, 0], [1, 0, 0]]))})
    >>> out["item"].shape, out["history"].shape
    ((2, 4), (2, 4))
    >>> bool(np.allclose(out["history"][1], out["item"][1]))   # 9 alone: its mean is its row
    True
    >>> emb.tables["items"].size()                               # 7, 8, 9; padding (0) never inserted
    3
  """

  def __init__(
    self,
    tables: Mapping[str, TableConfig] | Iterable[tuple[str, TableConfig]],
    features: Mapping[str, FeatureConfig] | Iterable[tuple[str, FeatureConfig]],
    *,
    rngs: nnx.Rngs,
    mesh: Mesh | None = None,
    axis: str | None = None,
  ):
    tables = _named(tables, "tables", TableConfig, _differs_in_width)
    features = _named(features, "features", FeatureConfig, lambda a, b: "")
    if not tables:
      raise ValueError("tables: expected at least one table.")
    for name, feature in features.items():
      if feature.table not in tables:
        raise ValueError(
          f"features[{name!r}]: reads the table {feature.table!r}, which is not among the tables "
          f"{sorted(tables)}."
        )
    built = {}
    for name in sorted(tables):
      try:
        built[name] = DynamicEmbedding(
          **tables[name]._embedding_options(),
          rngs=rngs,
          mesh=mesh,
          axis=axis,
          name=f"table {name!r} of a jr.EmbeddingCollection",
        )
      except (TypeError, ValueError) as err:
        raise type(err)(f"tables[{name!r}]: {err}") from err
    self.tables = nnx.data(built)  # a dict: a table named 'items' must not hide a method
    self._features = tuple((name, features[name]) for name in sorted(features))  # static: hashable

  @property
  def features(self) -> dict[str, FeatureConfig]:
    """Feature name -> :class:`FeatureConfig`."""
    return dict(self._features)

  def __call__(self, inputs: Mapping[str, Any]) -> dict[str, jax.Array]:
    """The rows of each feature of ``inputs``: ``{name: float32[batch, features]}`` (pooled), or
    ``[batch, L, features]`` (unpooled, ``combiner=None``).

    Args:
      inputs: feature name -> ``ids`` or ``(ids, weights)``: ``ids`` of the
        table's key dtype, ``[batch]`` (one id per example) or ``[batch, L]``
        (multi-hot, padded), as word pairs (``uint32[..., 2]``) inside ``jit``
        for 64-bit ids with ``jax_enable_x64`` off, and as their rows inside
        ``jit`` for string ids (:meth:`encode`); ``weights`` ``float[batch]``
        or ``float[batch, L]``, 0 for padding. A subset of the features may be given.

    Raises:
      TypeError, ValueError: an unknown feature, ids of a dtype the table
        does not take or of another rank, weights of another shape or
        negative, features of different batch sizes (the message names the
        features; nothing is looked up).
    """
    self._check_features(inputs)
    looked_up = {name: self._parse(name, inputs[name]) for name in sorted(inputs)}  # all checked first
    _check_one_batch(looked_up)
    rows = {}
    for table_name, table in self.tables.items():
      names = [name for name in looked_up if self.features[name].table == table_name]
      if not names:
        continue
      words = jnp.concatenate([looked_up[name].words for name in names])
      weights = [looked_up[name].weights for name in names]
      valid = None
      if any(w is not None for w in weights):
        valid = jnp.concatenate([jnp.ones(looked_up[n].size, bool) if w is None else w.reshape(-1) != 0
                                 for n, w in zip(names, weights)])  # fmt: skip
      found = table.lookup_words(words, valid)
      start = 0
      for name in names:
        feature = looked_up[name]
        rows[name] = self._pool(name, feature, found[start : start + feature.size])
        start += feature.size
    return {name: rows[name] for name in inputs}

  def _check_features(self, inputs) -> None:
    if not isinstance(inputs, Mapping):
      raise TypeError(f"inputs: expected a dict of feature name -> ids or (ids, weights), got {inputs!r}.")
    unknown = sorted(set(inputs) - set(self.features), key=str)
    if unknown:
      raise ValueError(f"inputs: unknown features {unknown}; the collection has {sorted(self.features)}.")

  def _parse(self, name: str, value) -> _Feature:
    ids, weights = value if isinstance(value, tuple) and len(value) == 2 else (value, None)
    table = self.tables[self.features[name].table]
    words, batch = table.key_words(ids, f"inputs[{name!r}]")
    if len(batch) not in (1, 2):
      raise ValueError(
        f"inputs[{name!r}]: expected ids of shape [batch] or [batch, L] (multi-hot), got {batch}."
      )
    weights = pooling.check_weights(weights, batch, f"inputs[{name!r}] weights")
    return _Feature(words.reshape(-1, words.shape[-1]), weights, tuple(batch))

  def encode(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
    """``inputs`` (as :meth:`__call__` takes them) with each feature's ids in the form its table takes
    inside ``jit`` (:meth:`jaxres.DynamicEmbedding.encode`: string ids as rows, 64-bit ids as word
    pairs with ``jax_enable_x64`` off), weights kept: made on the host, before a jitted step.

    Raises:
      TypeError, ValueError: an unknown feature, or ids its table does not take (naming the feature).

    Examples:
      >>> import numpy as np, optax, jaxres as jr
      >>> from flax import nnx
      >>> emb = jr.EmbeddingCollection(
      ...     {"words": jr.TableConfig(64, 4, optimizer=optax.sgd(0.1), key=str, max_length=12)},
      ...     {"word": jr.FeatureConfig("words"), "title": jr.FeatureConfig("words", combiner="mean")},
      ...     rngs=nnx.Rngs(0))
      >>> batch = emb.encode({"word": ["fox"], "title": (np.array([["the", "fox"]]), np.ones((1, 2)))})
      >>> batch["word"].shape, batch["title"][0].shape       # uint32 rows of 4 words
      ((1, 4), (1, 2, 4))
      >>> out = nnx.jit(lambda m, b: m(b), donate_argnums=0)(emb, batch)
      >>> emb.tables["words"].export()[0].tolist()
      ['fox', 'the']
    """
    self._check_features(inputs)
    encoded = {}
    for name, value in inputs.items():
      table = self.tables[self.features[name].table]
      if isinstance(value, tuple) and len(value) == 2:
        encoded[name] = (table.encode_as(value[0], f"inputs[{name!r}]"), value[1])
      else:
        encoded[name] = table.encode_as(value, f"inputs[{name!r}]")
    return encoded

  def _pool(self, name: str, feature: _Feature, found: jax.Array) -> jax.Array:
    combiner, width = self.features[name].combiner, found.shape[-1]
    rows = found.reshape(*feature.batch, width)
    if feature.weights is not None:
      rows = rows * feature.weights[..., None]
    if len(feature.batch) == 1:
      if feature.weights is None or combiner in (None, "sum"):
        return rows
      return pooling.pool(rows[:, None], feature.weights[:, None], combiner)
    return pooling.pool(rows, feature.weights, combiner)

  def memory(self) -> dict[str, int]:
    """Bytes the collection holds now, by part, summing to the bytes of ``nnx.state(emb)``: each
    part (``rows``, ``optimizer``, ``index``, ...) summed over the tables, as
    :meth:`jaxres.DynamicEmbedding.memory` gives it for one (``emb.tables[name].memory()``).

    Examples:
      >>> import optax, jaxres as jr
      >>> from flax import nnx
      >>> tables = {"items": jr.TableConfig(1000, 8, optimizer=optax.sgd(0.1)),
      ...           "users": jr.TableConfig(100, 4, optimizer=optax.adagrad(0.1))}
      >>> emb = jr.EmbeddingCollection(tables, {"item": jr.FeatureConfig("items")}, rngs=nnx.Rngs(0))
      >>> parts = emb.memory()
      >>> parts["rows"] == (1000 + 1) * 8 * 4 + (100 + 1) * 4 * 4, parts["optimizer"]  # and adagrad's sums
      (True, 1616)
    """
    parts: dict[str, int] = {}
    for table in self.tables.values():
      for part, held in table.memory().items():
        parts[part] = parts.get(part, 0) + held
    parts["other"] += memory.nbytes(nnx.state(self)) - sum(parts.values())
    return parts

  def _facts(self) -> dict[str, str]:
    """What a repr shows: each table on a line (as its embedding shows itself), and the table and
    combiner of each feature."""
    tables = ",\n".join(
      f"  {name!r}: {display.constructor('DynamicEmbedding', table._facts(named=False))}"
      for name, table in self.tables.items()
    )
    features = ", ".join(f"{name!r}: ({f.table!r}, {f.combiner!r})" for name, f in self.features.items())
    return {"tables": f"{{\n{tables}\n}}", "features": f"{{{features}}}"}

  def __repr__(self) -> str:
    return display.constructor("jr.EmbeddingCollection", self._facts(), lines=True)

  def __nnx_repr__(self):  # print() of a module holding this one: a line per table, no arrays
    yield reprlib.Object(type=type(self))
    for name, value in self._facts().items():
      yield reprlib.Attr(name, value, use_raw_value=True)

  def __treescope_repr__(self, path, subtree_renderer):  # nnx.display, treescope: each table on a line
    return visualization.render_object_constructor(
      type(self), {"tables": self.tables, "features": self.features}, path, subtree_renderer
    )


@dataclasses.dataclass(frozen=True)
class _Feature:
  """One feature of a call, checked: its ids' key words (flat), weights and batch shape."""

  words: jax.Array  # uint32[size, W]
  weights: jax.Array | None  # float32[*batch]
  batch: tuple[int, ...]

  @property
  def size(self) -> int:
    return self.words.shape[0]


def _check_one_batch(features: dict[str, _Feature]) -> None:
  """The features of one call are rows of the same examples: their batches must agree."""
  sizes = {name: feature.batch[0] for name, feature in features.items()}
  first = next(iter(sizes), None)
  for name, size in sizes.items():
    if size != sizes[first]:
      raise ValueError(
        f"inputs: the features of one call are the same examples, but inputs[{first!r}] has a batch of "
        f"{sizes[first]} and inputs[{name!r}] of {size}."
      )


def _named(given, argument: str, kind: type, conflict: Callable[[Any, Any], str]) -> dict:
  """``given`` (a mapping, or ``(name, value)`` pairs) as a dict of ``kind``\\ s, a name given twice
  with other settings refused (``conflict`` says how they differ)."""
  pairs = given.items() if isinstance(given, Mapping) else given
  try:
    pairs = list(pairs)
  except TypeError:
    raise TypeError(f"{argument}: expected a dict of name -> {kind.__name__}, got {given!r}.") from None
  named = {}
  for pair in pairs:
    if not (isinstance(pair, tuple) and len(pair) == 2):
      raise TypeError(f"{argument}: expected (name, {kind.__name__}) pairs, got {pair!r}.")
    name, value = pair
    if not isinstance(name, str) or not name:
      raise TypeError(f"{argument}: expected names that are non-empty strings, got {name!r}.")
    if not isinstance(value, kind):
      raise TypeError(f"{argument}[{name!r}]: expected a jr.{kind.__name__}, got {value!r}.")
    if name in named and named[name] != value:
      difference = conflict(named[name], value) or "with other settings"
      raise ValueError(f"{argument}[{name!r}]: given twice, {difference}.")
    named[name] = value
  return named


def _differs_in_width(a: TableConfig, b: TableConfig) -> str:
  return f"with {a.features} and {b.features} features" if a.features != b.features else ""
