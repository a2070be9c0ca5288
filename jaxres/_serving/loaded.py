"""A saved model loaded back: its signatures, callable by input name, with no model code."""

from __future__ import annotations

import collections
import os
from pathlib import Path

import jax
import numpy as np

from jaxres._serving import buckets, updates
from jaxres._serving.signature import Input

# Compiled programs a served signature keeps (the most recently used): where requests are not padded
# to batch sizes, a program per request size would otherwise be kept for good (2 MB each).
PROGRAMS_KEPT = 32


class LoadedSignature:
  """One signature of a loaded model: ``signature(**inputs) -> {name: array}``.

  Inputs are checked against the saved specs (names, dtypes, shapes; a named
  dimension takes any size, the same in every input naming it), then passed
  in the form the program was traced with (64-bit integers as word pairs with
  ``jax_enable_x64`` off, strings encoded).

  Loaded with ``batch_sizes`` (see :func:`jaxres.saved_model.load`), each
  request's batch dimension (the named dimension every output starts with)
  is padded with zeros up to the smallest of :attr:`batch_sizes` that holds
  it, and the results are cut back: one compiled program per batch
  size serves every request (the padding rows' results dropped). A request
  larger than the largest size runs in chunks of the largest. Other named
  dimensions compile a program for each size they take. A signature keeps
  the 32 programs it used last; an older size compiles again when it returns.

  Attributes:
    name: the signature's name in the model's ``signatures``.
    outputs: the names of the outputs, the keys of each call's result.

  Examples:
    >>> import tempfile, jax, numpy as np, jaxres as jr
    >>> table = jr.OpenAddressingTable.create(64, key=np.int32, value=np.float32, default=-1.0)
    >>> table = table.insert(np.array([1, 2], np.int32), np.array([0.5, 1.5], np.float32))
    >>> ids = jax.ShapeDtypeStruct(("n",), np.int32)
    >>> path = tempfile.mkdtemp() + "/export"
    >>> signature = jr.saved_model.Signature(lambda t, ids: t.find(ids), ids=ids)
    >>> jr.saved_model.save(table, path, {"find": signature})
    >>> find = jr.saved_model.load(path).signatures["find"]
    >>> find.inputs, find.outputs
    ({'ids': ShapeDtypeStruct(shape=('n',), dtype=int32)}, ['output'])
    >>> find(ids=np.array([2, 5], np.int32))["output"].tolist()
    [1.5, -1.0]
  """

  def __init__(
    self,
    name: str,
    inputs: tuple[Input, ...],
    outputs: list[str],
    max_length: int,
    exported,
    places,
    batch_sizes: tuple[int, ...] | None = None,
  ):
    self.name = name
    self.outputs = list(outputs)
    self._inputs = inputs
    self._max_length = max_length
    self._places = list(places)  # which arrays of the serving state the program takes, in order
    self._state: list = []
    self._exported = exported
    # By the sizes of ``_dims``, the most recently used last; at most PROGRAMS_KEPT.
    self._programs: collections.OrderedDict[tuple[int, ...], jax.stages.Compiled] = collections.OrderedDict()
    self._dims = sorted({d for i in inputs for d in i.dims if isinstance(d, str)})
    self._out_dims = {
      k: [str(d) for d in a.shape] for k, a in zip(self.outputs, exported.out_avals, strict=True)
    }
    self._batch = buckets.batch_dimension(inputs, self._out_dims) if batch_sizes else None
    self._batch_sizes = batch_sizes if self._batch else None

  @property
  def inputs(self) -> dict[str, jax.ShapeDtypeStruct]:
    """``{name: jax.ShapeDtypeStruct}``: the inputs as callers give them (named dimensions as names)."""
    return {i.name: i.spec() for i in self._inputs}

  @property
  def batch_sizes(self) -> tuple[int, ...] | None:
    """The batch sizes requests are padded to; ``None`` where each size runs a program of its own
    (loaded with ``batch_sizes=None``, or no named dimension that every output starts with)."""
    return self._batch_sizes

  def __call__(self, **inputs) -> dict[str, jax.Array]:
    """The signature's outputs for ``inputs``.

    Raises:
      TypeError: an input is missing, unknown, or of the wrong dtype (naming it).
      ValueError: an input of the wrong shape (naming it).
    """
    names = [i.name for i in self._inputs]
    missing, unknown = [n for n in names if n not in inputs], sorted(set(inputs) - set(names))
    if missing or unknown:
      raise TypeError(f"{self.name}: expected inputs {names}; missing {missing}, unknown {unknown}.")
    sizes: dict[str, int] = {}
    for i in self._inputs:
      i.check(inputs[i.name], sizes)
    args = [i.encode(inputs[i.name], self._max_length) for i in self._inputs]
    if self._batch is None or sizes[self._batch] <= self._batch_sizes[-1]:
      out = self._run(args, sizes)
    else:  # in chunks of the largest batch size
      parts = []
      for rows in buckets.chunks(sizes[self._batch], self._batch_sizes[-1]):
        chunk = [self._rows(i, x, rows) for i, x in zip(self._inputs, args, strict=True)]
        parts.append(self._run(chunk, sizes | {self._batch: rows.stop - rows.start}))
      out = {k: self._joined(k, [p[k] for p in parts]) for k in self.outputs}
    host = {k: v for k, v in out.items() if not isinstance(v, jax.Array)}  # cut or joined
    return out | jax.device_put(host) if host else out

  def _rows(self, i: Input, x: np.ndarray, rows: slice) -> np.ndarray:
    return buckets.take(x, i.dims.index(self._batch), rows) if self._batch in i.dims else x

  def _joined(self, name: str, parts: list) -> np.ndarray:
    return np.concatenate([np.asarray(p) for p in parts], axis=self._out_dims[name].index(self._batch))

  def _run(self, args: list[np.ndarray], sizes: dict[str, int]) -> dict:
    """The outputs for ``args`` of named ``sizes``: padded to a compiled program's, cut back on the host."""
    target = {d: max(size, 1) for d, size in sizes.items()}  # a program's named dimensions are at least 1
    if self._batch is not None:
      target[self._batch] = buckets.bucket(sizes[self._batch], self._batch_sizes)
    padded = {d for d in sizes if target[d] != sizes[d]}
    for k, i in enumerate(self._inputs):
      for axis, d in enumerate(i.dims):
        if d in padded:
          args[k] = buckets.pad(args[k], axis, target[d])
    out = self._program(tuple(target[d] for d in self._dims))(self._state, args)
    if not padded:
      return out
    out = jax.device_get(out)
    return {
      k: v[tuple(slice(0, sizes[d]) if d in padded else slice(None) for d in self._out_dims[k])]
      for k, v in out.items()
    }

  def _program(self, key: tuple[int, ...]) -> jax.stages.Compiled:
    """The program compiled for the named dimensions' sizes ``key`` (compiled now if it is not yet)."""
    program = self._programs.get(key)
    if program is None:
      sizes = dict(zip(self._dims, key))
      state = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in self._state]
      args = [i.traced(sizes, self._max_length) for i in self._inputs]
      # A jit of its own: JAX's caches keep what they traced, lowered and compiled for a function
      # while it lives; this one's go with the program when it leaves ``_programs``.
      program = self._programs[key] = jax.jit(self._exported.call).lower(state, args).compile()
      if len(self._programs) > PROGRAMS_KEPT:  # the least recently used goes (compiled again if it returns)
        self._programs.popitem(last=False)
    self._programs.move_to_end(key)
    return program

  def _precompile(self) -> None:
    """Compiles the programs whose sizes are known now: each batch size's, or the one of fixed shapes."""
    if not self._dims:
      self._program(())
    elif self._dims == [self._batch]:
      for size in self._batch_sizes:
        self._program((size,))

  def _take(self, state: list) -> None:
    """Reads its arrays from the serving ``state`` (device arrays), as :class:`LoadedModel` holds it."""
    self._state = [state[k] for k in self._places]

  def __repr__(self) -> str:
    return f"LoadedSignature({self.name!r}, inputs={self.inputs})"


class LoadedModel:
  """What :func:`jaxres.saved_model.load` returns: ``signatures`` by name, and ``platforms``.

  A model exported with ``updatable=True`` also has a ``step`` and takes the
  deltas of later steps in place (:meth:`update`).

  Attributes:
    path: the directory it was loaded from.
    signatures: ``{name: LoadedSignature}``, each callable with its named inputs.
    platforms: the platforms the programs were exported for (``("cpu", "cuda")``).

  Examples:
    >>> import tempfile, jax, numpy as np, jaxres as jr
    >>> table = jr.OpenAddressingTable.create(64, key=np.int32, value=np.float32, default=-1.0)
    >>> table = table.insert(np.array([1, 2], np.int32), np.array([0.5, 1.5], np.float32))
    >>> ids = jax.ShapeDtypeStruct(("n",), np.int32)
    >>> path = tempfile.mkdtemp() + "/export"
    >>> signature = jr.saved_model.Signature(lambda t, ids: t.find(ids), ids=ids)
    >>> jr.saved_model.save(table, path, {"find": signature})
    >>> served = jr.saved_model.load(path)
    >>> sorted(served.signatures), served.platforms, served.step
    (['find'], ('cpu', 'cuda'), None)
    >>> served.signatures["find"](ids=np.array([2, 5], np.int32))["output"].tolist()
    [1.5, -1.0]
  """

  def __init__(
    self,
    path,
    signatures: dict[str, LoadedSignature],
    platforms: tuple[str, ...],
    state: list[np.ndarray],
    lineage: dict | None,
    precompile: bool = True,
  ):
    self.path = path
    self.signatures = signatures
    self.platforms = platforms
    self._host = list(state) if lineage is not None else None  # what deltas are applied to
    read = sorted({k for s in signatures.values() for k in s._places})
    self._device = {k: jax.device_put(state[k]) for k in read}
    self._lineage = lineage
    for signature in signatures.values():
      signature._take(self._device)
      if precompile:
        signature._precompile()

  @property
  def step(self) -> int | None:
    """The training step served (``None``: exported without ``updatable=True``)."""
    return None if self._lineage is None else self._lineage["step"]

  def update(self, delta) -> None:
    """Applies the delta at ``delta`` (:func:`jaxres.saved_model.save_delta`) in place.

    The signatures then answer as a model exported at the delta's step
    would, from the same compiled programs (nothing is reloaded or
    recompiled). Each table changed is rebuilt on the host: one pass over
    its served rows and a sort of its entries.

    Raises:
      TypeError: ``delta`` is not a path.
      ValueError: naming the directory: the model was exported without
        ``updatable=True``; not a delta, or a damaged one; a delta of
        another model, of a step not after the one served, or one that
        does not follow the step served (apply those in between first); a
        table that would outgrow its room. The model is left as it was.
    """
    if not isinstance(delta, (str, os.PathLike)):
      raise TypeError(f"delta: expected a directory path, got {type(delta).__name__}.")
    if self._lineage is None:
      raise ValueError(f"{self.path}: exported without updatable=True; it takes no deltas.")
    changed, lineage = updates.applied(self._host, self._lineage, Path(delta))
    for k, x in changed.items():  # the compiled programs take the arrays as they are
      before = self._host[k]
      if np.shape(x) != np.shape(before) or np.asarray(x).dtype != before.dtype:
        raise ValueError(
          f"{delta}: corrupted delta (it makes served state {k} {np.asarray(x).dtype}{list(np.shape(x))}; "
          f"the model's programs take {before.dtype}{list(before.shape)}). The model is left as it was."
        )
    device = {k: jax.device_put(x) for k, x in changed.items() if k in self._device}
    for k, x in changed.items():
      self._host[k] = x
    self._device |= device
    self._lineage = lineage
    for signature in self.signatures.values():
      signature._take(self._device)

  def __repr__(self) -> str:
    return (
      f"LoadedModel({str(self.path)!r}, signatures={sorted(self.signatures)}, platforms={self.platforms})"
    )
