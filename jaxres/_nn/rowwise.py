"""Row-wise optimizers: an elementwise optax transformation applied to table rows one by one.

Each row keeps its own optimizer state (Adam's ``mu``, ``nu`` and ``count``)
next to it, so an update touches only the rows given, whatever the table's
capacity, and a row never updated keeps its state as initialised ("lazy"
semantics, as TensorFlow's LazyAdam).

Schedules follow the embedding's step, not the row's: a learning rate given as
a schedule (``optax.adam(optax.exponential_decay(...))``, ``optax.scale_by_schedule``,
``optax.inject_hyperparams``) is evaluated at the number of ``apply_gradients``
calls before this one, as for dense parameters and as :class:`jaxres.CatchUpAdam`
does, so an id first met late in training takes the decayed rate of that step.
Adam's bias corrections count the row's own updates (lazy Adam's).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax


@dataclasses.dataclass(frozen=True, eq=False)
class RowOptimizer:
  """An optax transformation vectorised over rows, its per-row state as flat leaves.

  Build one with :meth:`wrap`, which checks that the transformation works
  row by row. Two are equal when their transformations are built alike
  (``optax.adam(0.01)`` twice: the same functions with equal settings; see
  :func:`structure_key`), so a model given a new but equal optimizer reuses
  its compiled steps.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> opt = RowOptimizer.wrap(optax.sgd(0.5), features=2)
    >>> rows = jnp.ones((3, 2))
    >>> rows, slots = opt.update(jnp.full((3, 2), 2.0), rows, opt.init(rows))
    >>> rows.tolist()
    [[0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]
  """

  transformation: optax.GradientTransformation
  features: int
  treedef: jax.tree_util.PyTreeDef  # of one row's optimizer state
  slots: tuple[jax.ShapeDtypeStruct, ...]  # one row's state leaves

  @classmethod
  def wrap(cls, optimizer, features: int) -> RowOptimizer:
    """Checks ``optimizer`` on a row of ``features`` float32 values.

    Raises:
      TypeError: ``optimizer`` is not an ``optax.GradientTransformation``.
      ValueError: it cannot work row by row: it fails on a row, needs extra
        arguments (a loss value), keeps state that is not per element (a
        history, factored moments), or mixes the elements of a row (a norm
        clip).
    """
    if not isinstance(optimizer, optax.GradientTransformation):
      raise TypeError(
        f"optimizer: expected an optax.GradientTransformation such as optax.adam(1e-3), or "
        f"jr.CatchUpAdam(1e-3), got {optimizer!r}."
      )
    row = jax.ShapeDtypeStruct((features,), jnp.float32)
    try:
      state = jax.eval_shape(optimizer.init, row)
      updates, _ = jax.eval_shape(optimizer.update, row, state, row)
    except Exception as err:
      raise ValueError(
        f"optimizer: it fails on one row of {features} float32 values ({type(err).__name__}: {err}); "
        "jr.DynamicEmbedding updates rows one by one with update(grads, state, params) only."
      ) from err
    leaves, treedef = jax.tree.flatten(state)
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
      if leaf.shape not in ((), (features,)):
        raise ValueError(
          f"optimizer: its state {jax.tree_util.keystr(path)} has shape {leaf.shape} for a row of "
          f"{features}: not one value per element (or per row), so it cannot be kept per row."
        )
    if updates.shape != (features,):
      raise ValueError(f"optimizer: its updates have shape {updates.shape}, expected ({features},).")
    slots = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves)
    optimizer_ = cls(optimizer, features, treedef, slots)
    if not _elementwise(optimizer_):
      raise ValueError(
        "optimizer: the update of an element depends on other elements of its row (a norm clip or a "
        "normalisation); jr.DynamicEmbedding takes elementwise transformations (sgd, adam, adagrad, "
        "rmsprop, lion, clip, chains of them)."
      )
    return optimizer_

  @functools.cached_property
  def name(self) -> str:
    """A short description for reprs. An optax transformation has no name of its own: this names
    the optax states each row keeps (``optax(scale_by_adam)`` for ``adam`` or ``adamw``,
    ``optax(scale_by_rss)`` for ``adagrad``, ``optax(stateless)`` for ``sgd``).
    """
    state = jax.eval_shape(self.transformation.init, jax.ShapeDtypeStruct((self.features,), jnp.float32))
    named = _named_states(state)
    if named:
      return f"optax({', '.join(named)})"
    leaves = len(jax.tree.leaves(state))
    return f"optax({leaves} state arrays per row)" if leaves else "optax(stateless)"

  def __repr__(self) -> str:  # not the transformation's functions and tree structure
    return f"RowOptimizer({self.name}, features={self.features})"

  def __eq__(self, other) -> bool:
    return isinstance(other, RowOptimizer) and self._key == other._key

  def __hash__(self) -> int:
    return hash(self._key)

  @functools.cached_property
  def _key(self):
    return (structure_key(self.transformation), self.features)

  @functools.cached_property
  def needs_step(self) -> bool:
    """Whether the transformation holds a schedule (see the module): the embedding then counts its
    steps and passes the current one to :meth:`update`."""
    state = jax.eval_shape(self.transformation.init, jax.ShapeDtypeStruct((self.features,), jnp.float32))
    return any(_is_schedule(x) for x in jax.tree.leaves(state, is_leaf=_is_schedule))

  def init(self, rows: jax.Array) -> list[jax.Array]:
    """The initial state leaves of ``rows`` (``[n, features]``): leaves ``[n, *slot_shape]``."""
    return jax.tree.leaves(jax.vmap(self.transformation.init)(rows))

  def update(self, grads: jax.Array, rows: jax.Array, slots, step=None) -> tuple[jax.Array, list[jax.Array]]:
    """One step for each row: ``(rows, slots)`` after the gradients ``grads`` (``[n, features]``).

    ``step``: the embedding's step count, this step included (``None`` unless :attr:`needs_step`).
    Schedules read ``step - 1``, the steps before this one (optax's count); the row's schedule count
    then records ``step``, its last update's. Every other state counts the row's own updates.
    """

    def one(grad, row, leaves):
      state = jax.tree.unflatten(self.treedef, leaves)
      if step is not None:
        state = _at_step(state, step - 1)
      updates, state = self.transformation.update(grad, state, row)
      return optax.apply_updates(row, updates), jax.tree.leaves(state)

    return jax.vmap(one)(grads, rows, list(slots))


# optax states whose ``count`` a schedule reads (the learning rate of ``optax.adam(schedule)`` is a
# scale_by_schedule; inject_hyperparams evaluates its schedules at its count).
_SCHEDULE_STATES = (
  optax.ScaleByScheduleState,
  optax.InjectHyperparamsState,
  optax.InjectStatefulHyperparamsState,
)


def _is_schedule(x) -> bool:
  return isinstance(x, _SCHEDULE_STATES)


def _at_step(state, count):
  """``state`` with the count of every schedule in it at ``count`` (the steps before this one)."""

  def at(x):
    return x._replace(count=jnp.asarray(count, x.count.dtype)) if _is_schedule(x) else x

  return jax.tree.map(at, state, is_leaf=_is_schedule)


def _named_states(state) -> list[str]:
  """The optax states (named tuples such as ``ScaleByAdamState``) in ``state`` that hold arrays of
  their own, outermost first, by the name of the transformation keeping them (``scale_by_adam``)."""
  if isinstance(state, dict):
    return [name for value in state.values() for name in _named_states(value)]
  if not isinstance(state, (tuple, list)):
    return []
  own = hasattr(state, "_fields") and any(isinstance(x, jax.ShapeDtypeStruct) for x in state)
  name = re.sub(r"(?<!^)(?=[A-Z])", "_", type(state).__name__.removesuffix("State")).lower()
  return [name] * own + [name for value in state for name in _named_states(value)]


@functools.lru_cache(maxsize=64)  # by RowOptimizer's equality: one check per optimizer built alike and width
def _elementwise(optimizer: RowOptimizer) -> bool:
  """Whether no element's update depends on other elements of its row (a norm clip's does): the
  update's Jacobian at a probe row, computed by one compiled program (eagerly, each of its
  operations would compile one)."""
  transformation, features = optimizer.transformation, optimizer.features

  def jacobian(probe):
    state = transformation.init(probe)
    return jax.jacfwd(lambda g: transformation.update(g, state, probe)[0])(probe * 10)

  probe = np.linspace(-3.0, 5.0, features, dtype=np.float32)  # large: norm clips engage
  # Compiled ahead and called on the host probe: concrete under a trace too (nnx.eval_shape of a
  # model), where jax.ensure_compile_time_eval would run it an operation at a time.
  values = np.asarray(jax.jit(jacobian).lower(probe).compile()(probe))
  return not np.any(values[~np.eye(features, dtype=bool)] != 0)


def for_rows(optimizer, features: int):
  """The row optimizer of ``optimizer`` for rows of ``features`` values.

  An object with a ``for_rows(features)`` method (:class:`jaxres.CatchUpAdam`)
  builds its own; an optax transformation is wrapped by :meth:`RowOptimizer.wrap`.
  Either has ``features``, ``slots`` (one row's state leaves), ``init(rows)``,
  ``update(grads, rows, slots, step)``, ``needs_step``: whether the
  embedding must count its steps and pass the current one, and ``name``: a
  short description for reprs.
  """
  if hasattr(optimizer, "for_rows"):
    return optimizer.for_rows(features)
  return RowOptimizer.wrap(optimizer, features)


def structure_key(x, _seen: frozenset = frozenset()):
  """A hashable key, equal for values built alike: functions by their code, defaults and the
  contents of their closures (an optax transformation is a pair of such closures), partials by
  their function and arguments, containers by their items, arrays by their contents, other
  objects by their own equality (identity, for most).

  Examples:
    >>> import optax
    >>> structure_key(optax.adam(0.01)) == structure_key(optax.adam(0.01))
    True
    >>> structure_key(optax.adam(0.01)) == structure_key(optax.adam(0.02))
    False
  """
  if id(x) in _seen:
    return ("cycle",)
  seen = _seen | {id(x)}
  if isinstance(x, types.FunctionType):
    cells = tuple(_contents(cell) for cell in x.__closure__ or ())
    parts = (x.__defaults__, x.__kwdefaults__, cells)
    return ("function", x.__code__, *(structure_key(part, seen) for part in parts))
  if isinstance(x, functools.partial):
    return ("partial", *(structure_key(part, seen) for part in (x.func, x.args, x.keywords)))
  if isinstance(x, (tuple, list)):
    return (type(x), tuple(structure_key(item, seen) for item in x))
  if isinstance(x, dict):
    return (type(x), tuple((k, structure_key(v, seen)) for k, v in sorted(x.items(), key=repr)))
  if isinstance(x, (np.ndarray, np.generic)) or (
    isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
  ):
    array = np.asarray(x)
    return ("array", array.shape, str(array.dtype), array.tobytes())
  try:
    hash(x)
  except TypeError:
    return ("object", _Identity(x))  # unhashable: by identity (kept alive with the key)
  return ("value", type(x), x)


class _Identity:
  """An object compared and hashed by identity (for one that cannot be hashed)."""

  def __init__(self, obj):
    self.obj = obj

  def __eq__(self, other) -> bool:
    return isinstance(other, _Identity) and other.obj is self.obj

  def __hash__(self) -> int:
    return id(self.obj)


_EMPTY = object()  # the contents of a closure cell not assigned yet


def _contents(cell):
  try:
    return cell.cell_contents
  except ValueError:
    return _EMPTY
