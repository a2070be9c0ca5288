"""``jr.value_and_grad`` and ``jr.grad``: NNX's, and every embedding row looked up takes its step.

An embedding's rows are not ``nnx.Param``\\ s (a table of a million rows has
no dense gradient), so ``nnx.value_and_grad`` cannot give them gradients.
These drop-ins can, for the rows a differentiated function looked up:

1. ``fn`` is evaluated once abstractly (``nnx.eval_shape``: the modules in
   its arguments as shapes, nothing changes) to find the lookups it makes in
   training mode, and the shape of the rows each returns.
2. ``fn`` is differentiated by ``nnx.value_and_grad`` with one more argument:
   a zero array per lookup, which the lookup adds to the rows it returns (a
   :class:`Tape` hands them out). The gradient of that argument is the
   gradient of the rows.
3. Each embedding then takes one step of its row optimizer on the rows its
   lookups found (:meth:`jaxres.DynamicEmbedding.step_rows`): the rows the
   lookup located, no second probe, as ``apply_gradients`` would.

Lookups find the tape with :func:`active`. An embedding looked up in training
mode with no tape while JAX differentiates (inside plain ``nnx.value_and_grad``,
say) is a ``ValueError`` (:func:`refuse_if_differentiated`): rows are never
left untrained without a word.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import jax
import jax.extend
import jax.numpy as jnp
from flax import nnx


class Lookup(NamedTuple):
  """What a lookup leaves for its rows' step (arrays: they leave the differentiated function)."""

  words: jax.Array  # uint32[N, W]: the ids' key words
  index: jax.Array  # int32[N]: the value row each id was given (-1: none)
  valid: jax.Array  # bool[N]: not padding
  clock: jax.Array  # uint32[]: the table's clock after the lookup (its rows hold while it stands)


class TakesRowSteps(Protocol):
  """An embedding whose lookups a :class:`Tape` records (:class:`jaxres.DynamicEmbedding`)."""

  def step_rows(self, lookups: Sequence[Lookup], grads: Sequence[jax.Array]) -> None:
    """One step of the row optimizer on the rows of ``lookups``, with ``grads`` (``[N, features]`` each)."""


class Tape:
  """The lookups a function made while differentiated: where each embedding is, and its rows' gradient sink.

  Args:
    args: the function's arguments (embeddings are named by their path among them).
    sinks: one zero array per lookup, added to its rows; ``None`` while the
      lookups are being found (then their shapes are recorded instead).
  """

  def __init__(self, args: tuple, sinks: Sequence[jax.Array] | None = None):
    self._args, self._sinks = args, sinks
    self._paths: dict[int, tuple] | None = None
    self.keys: list[tuple] = []  # (path, n-th lookup of that embedding), in lookup order
    self.shapes: list[jax.ShapeDtypeStruct] = []
    self.lookups: list[Lookup] = []
    self.inference_lookups = 0  # lookups of embeddings in inference mode (read only, not recorded)

  def note_inference(self) -> None:
    """Counts a lookup made in inference mode (its rows take no step)."""
    self.inference_lookups += 1

  def admit(self, embedding: TakesRowSteps) -> None:
    """Raises ``ValueError`` before ``embedding`` changes if it is not reachable from the arguments."""
    self._path(embedding)

  def record(self, embedding: TakesRowSteps, rows: jax.Array, lookup: Lookup) -> jax.Array:
    """``rows`` as the lookup returns them: plus their sink, through which their gradient flows."""
    path = self._path(embedding)
    key = (path, sum(1 for p, _ in self.keys if p == path))
    k = len(self.keys)
    self.keys.append(key)
    self.lookups.append(lookup)
    if self._sinks is None:
      self.shapes.append(jax.ShapeDtypeStruct(rows.shape, rows.dtype))
      return rows
    if k >= len(self._sinks) or self._sinks[k].shape != rows.shape:
      raise ValueError(_CHANGED)
    return rows + self._sinks[k]

  def _path(self, embedding) -> tuple:
    if self._paths is None:
      self._paths = {}
      for path, node in nnx.iter_graph(self._args):
        self._paths.setdefault(id(node), path)
    path = self._paths.get(id(embedding))
    if path is None:
      raise ValueError(
        f"{embedding!r} was looked up by the function jr.value_and_grad differentiates, but it is not "
        "reachable from the function's arguments: pass the model that holds it as an argument (a lookup "
        "inside a transform within the function, nnx.jit, nnx.remat or nnx.scan, sees a copy of the "
        "model, which jr.value_and_grad cannot step: look the ids up outside such transforms)."
      )
    return path


_CHANGED = (
  "jr.value_and_grad: the function looked up other embeddings, or rows of other shapes, when it was "
  "differentiated than when it was traced to find its lookups; its lookups must depend on the shapes "
  "of its arguments alone."
)


class InferenceModeWarning(UserWarning):
  """``jr.value_and_grad`` (or ``jr.grad``) differentiated a function whose every embedding looked
  up in inference mode: no row is trained, which is almost always a forgotten ``model.train()``
  after an evaluation. Given once each time the function is traced (under ``nnx.jit``, once per
  compiled step).

  Examples:
    >>> import warnings, jax.numpy as jnp, numpy as np, optax, jaxres as jr
    >>> from flax import nnx
    >>> emb = jr.DynamicEmbedding(16, 2, optimizer=optax.sgd(0.5), rngs=nnx.Rngs(0))
    >>> emb.eval()
    >>> with warnings.catch_warnings(record=True) as caught:
    ...   warnings.simplefilter("always")
    ...   _ = jr.grad(lambda emb, ids: jnp.sum(emb(ids)))(emb, np.array([7]))
    >>> [w.category.__name__ for w in caught]
    ['InferenceModeWarning']
  """


_ALL_IN_INFERENCE = (
  "jr.value_and_grad: every embedding {name} looked up is in inference mode (deterministic=True, as "
  "model.eval() sets it), so no embedding row is trained; call model.train() before training."
)

_TAPES = threading.local()


def active() -> Tape | None:
  """The tape of the innermost ``jr.value_and_grad`` tracing a function on this thread, if any."""
  stack = getattr(_TAPES, "stack", ())
  return stack[-1] if stack else None


@contextlib.contextmanager
def _recording(tape: Tape):
  stack = getattr(_TAPES, "stack", ())
  _TAPES.stack = (*stack, tape)
  try:
    yield tape
  finally:
    _TAPES.stack = stack


def refuse_if_differentiated(message: str) -> None:
  """Raises ``ValueError(message)`` when JAX is differentiating the code calling it (``jax.grad``,
  ``nnx.value_and_grad``, ``jax.jvp``, ... anywhere up the current trace's parents).

  An embedding looked up in training mode there, with no tape, would return
  rows that no gradient can reach: they are not parameters.
  """
  trace = jax.extend.core.find_top_trace(())
  while trace is not None:
    if type(trace).__name__ in _AUTODIFF_TRACES:
      raise ValueError(message)
    trace = getattr(trace, "parent_trace", None)


_AUTODIFF_TRACES = ("JVPTrace", "LinearizeTrace")  # forward mode, and the linearization of grad and vjp


def value_and_grad(
  fn: Callable | None = None, argnums: Any = 0, has_aux: bool = False, **options
) -> Callable:
  """As ``nnx.value_and_grad``; in addition, every jaxres embedding row ``fn`` looks up takes its step.

  The rows of each :class:`jaxres.DynamicEmbedding` (alone or in a
  :class:`jaxres.EmbeddingCollection`) that ``fn`` looked up in training mode
  take one step of their row optimizer with their gradients, exactly as
  :meth:`~jaxres.DynamicEmbedding.apply_gradients` would, at O(batch) (the
  rows each lookup located, no second probe). The returned gradients are
  ``nnx.value_and_grad``'s: the dense parameters only, for the
  ``nnx.Optimizer``. So the step a Flax user writes changes in this one name.

  ``fn`` is traced twice (once abstractly, to find its lookups), so its
  lookups must depend on the shapes of its arguments alone, and the
  embeddings it looks up must be reachable from its arguments. Use it inside
  ``nnx.jit``, as any training step.

  Args:
    fn: the function to differentiate; its arguments at ``argnums`` as for
      ``nnx.value_and_grad`` (a model, whose ``nnx.Param``\\ s are
      differentiated).
    argnums: as ``nnx.value_and_grad``: an int, an ``nnx.DiffState`` or a
      sequence of them.
    has_aux: ``fn`` returns ``(loss, aux)``.
    **options: passed to ``nnx.value_and_grad`` (``holomorphic``,
      ``allow_int``, ...).

  Returns:
    A function of ``fn``'s arguments returning ``(loss, grads)`` (or
    ``((loss, aux), grads)``), as ``nnx.value_and_grad``'s.

  Examples:
    >>> import jax.numpy as jnp, numpy as np, optax, jaxres as jr
    >>> from flax import nnx
    >>> class Model(nnx.Module):
    ...   def __init__(self):
    ...     self.emb = jr.DynamicEmbedding(16, 2, optimizer=optax.sgd(1.0), rngs=nnx.Rngs(0))
    ...     self.head = nnx.Linear(2, 1, rngs=nnx.Rngs(1))
    >>> model = Model()
    >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    >>> def loss_fn(model, ids):
    ...   return jnp.sum(model.emb(ids))          # d loss / d row = 1 for every id looked up
    >>> ids = np.array([3, 4, 3])
    >>> before = np.asarray(model.emb(ids))
    >>> loss, grads = jr.value_and_grad(loss_fn)(model, ids)
    >>> _ = optimizer.update(model, grads)      # the dense parameters, as with nnx.value_and_grad
    >>> np.round(np.asarray(model.emb(ids)) - before, 3).tolist()   # 3 twice: its gradient is 2
    [[-2.0, -2.0], [-1.0, -1.0], [-2.0, -2.0]]
  """
  if fn is None:
    return functools.partial(value_and_grad, argnums=argnums, has_aux=has_aux, **options)
  return _with_row_steps(fn, argnums, has_aux, options, return_value=True)


def grad(fn: Callable | None = None, argnums: Any = 0, has_aux: bool = False, **options) -> Callable:
  """As ``nnx.grad``; in addition, every jaxres embedding row ``fn`` looks up takes its step.

  :func:`value_and_grad` without the value: see there how the rows are found and stepped.

  Args:
    fn: the function to differentiate, as for ``nnx.grad``.
    argnums: as ``nnx.grad``: an int, an ``nnx.DiffState`` or a sequence of them.
    has_aux: ``fn`` returns ``(loss, aux)``.
    **options: passed to ``nnx.grad``.

  Returns:
    A function of ``fn``'s arguments returning ``grads`` (or ``(grads, aux)``), as ``nnx.grad``'s:
    the dense parameters only.

  Examples:
    >>> import jax.numpy as jnp, numpy as np, optax, jaxres as jr
    >>> from flax import nnx
    >>> emb = jr.DynamicEmbedding(16, 2, optimizer=optax.sgd(0.5), rngs=nnx.Rngs(0))
    >>> before = np.asarray(emb(np.array([7])))
    >>> grads = jr.grad(lambda emb, ids: jnp.sum(emb(ids)))(emb, np.array([7]))
    >>> np.asarray(emb(np.array([7])) - before).tolist()
    [[-0.5, -0.5]]
  """
  if fn is None:
    return functools.partial(grad, argnums=argnums, has_aux=has_aux, **options)
  return _with_row_steps(fn, argnums, has_aux, options, return_value=False)


def _with_row_steps(fn: Callable, argnums, has_aux: bool, options: dict, *, return_value: bool) -> Callable:
  differentiate = nnx.value_and_grad if return_value else nnx.grad
  many = not isinstance(argnums, (int, nnx.DiffState))
  listed = tuple(argnums) if many else (argnums,)

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    if kwargs:  # as nnx.value_and_grad: keyword arguments bound to their positions
      bound = inspect.signature(fn).bind(*args, **kwargs)
      if bound.kwargs:
        raise TypeError(
          f"{fn.__name__}: keyword-only arguments cannot be differentiated: {sorted(bound.kwargs)}."
        )
      args = bound.args
    found, out = _lookups_of(fn, args)
    if not found.keys:
      if found.inference_lookups:
        name = getattr(fn, "__name__", repr(fn))
        warnings.warn(_ALL_IN_INFERENCE.format(name=name), InferenceModeWarning, stacklevel=2)
      return differentiate(fn, argnums=argnums, has_aux=has_aux, **options)(*args)
    _check_output(fn, out, has_aux)
    positions = _positions(listed, len(args))

    def with_sinks(*args_and_sinks):
      *inner, sinks = args_and_sinks
      tape = Tape(tuple(inner), sinks)
      with _recording(tape):
        out = fn(*inner)
      if tape.keys != found.keys:
        raise ValueError(_CHANGED)
      loss, aux = out if has_aux else (out, None)
      return loss, (aux, tape.lookups)

    sinks = [jnp.zeros(s.shape, s.dtype) for s in found.shapes]
    differentiated = differentiate(with_sinks, argnums=(*positions, len(args)), has_aux=True, **options)
    out = differentiated(*args, sinks)
    if return_value:
      (loss, (aux, lookups)), grads = out
    else:
      grads, (aux, lookups) = out
    *grads, row_grads = grads
    _step(args, found.keys, lookups, row_grads)
    grads = tuple(grads) if many else grads[0]
    if return_value:
      return ((loss, aux) if has_aux else loss), grads
    return (grads, aux) if has_aux else grads

  return wrapper


def _lookups_of(fn: Callable, args: tuple) -> tuple[Tape, Any]:
  """``(tape, out)`` of ``fn(*args)`` evaluated abstractly: its training-mode lookups, keyed, with
  their shapes, and the shapes of what it returns.

  Arguments holding NNX objects are made abstract (nothing in them changes);
  the others stay as they are, so that checks of their values (weights, say)
  fail here, before anything has changed.
  """
  graph_at = [i for i, arg in enumerate(args) if _holds_graph_nodes(arg)]
  tapes, outs = [], []

  def trace(*graph_args):
    full = list(args)
    for i, arg in zip(graph_at, graph_args):
      full[i] = arg
    tape = Tape(tuple(full))
    tapes.append(tape)
    with _recording(tape):
      outs.append(fn(*full))  # only its structure, shapes and dtypes are read

  nnx.eval_shape(trace, *(args[i] for i in graph_at))
  return tapes[-1], outs[-1]


def _check_output(fn: Callable, out, has_aux: bool) -> None:
  """Raises, before the function runs for real (and changes its embeddings), what differentiating
  its output would: it must be a real scalar (and an aux with ``has_aux``)."""
  name = getattr(fn, "__name__", repr(fn))
  if has_aux:
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
      raise TypeError(
        f"{name}: with has_aux=True, expected the function to return (loss, aux), got {type(out)}."
      )
    out = out[0]
  if not isinstance(out, (jax.Array, float)) or jnp.shape(out) != ():
    shape = jnp.shape(out) if isinstance(out, jax.Array) else type(out).__name__
    raise TypeError(f"{name}: expected the function to return a scalar loss to differentiate, got {shape}.")
  if not jnp.issubdtype(jnp.result_type(out), jnp.inexact):
    raise TypeError(f"{name}: expected a floating point loss to differentiate, got {jnp.result_type(out)}.")


def _positions(argnums: tuple, count: int) -> tuple:
  """``argnums`` with negative positions counted from the end of ``count`` arguments (one more,
  the sinks, is appended after them)."""
  positioned = []
  for argnum in argnums:
    if isinstance(argnum, nnx.DiffState):
      argnum = dataclasses.replace(
        argnum, argnum=argnum.argnum % count if argnum.argnum < 0 else argnum.argnum
      )
    elif isinstance(argnum, int) and argnum < 0:
      argnum = argnum % count
    positioned.append(argnum)
  return tuple(positioned)


def _holds_graph_nodes(arg) -> bool:
  is_node = lambda x: isinstance(x, (nnx.Pytree, nnx.Variable))
  return any(is_node(x) for x in jax.tree.leaves(arg, is_leaf=is_node))


def _step(args: tuple, keys: list[tuple], lookups: list[Lookup], grads: list[jax.Array]) -> None:
  """Each embedding looked up (by its path among ``args``) steps the rows of its lookups."""
  by_path: dict[tuple, list[int]] = {}
  for k, (path, _) in enumerate(keys):
    by_path.setdefault(path, []).append(k)
  nodes = dict(nnx.iter_graph(args))
  for path, ks in by_path.items():
    nodes[path].step_rows([lookups[k] for k in ks], [grads[k] for k in ks])
