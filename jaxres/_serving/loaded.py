"""A saved model loaded back: its signatures, callable by input name, with no model code."""

from __future__ import annotations

import os
from pathlib import Path

import jax
import numpy as np

from jaxres._serving import updates
from jaxres._serving.signature import Input


class LoadedSignature:
  """One signature of a loaded model: ``signature(**inputs) -> {name: array}``.

  Inputs are checked against the saved specs (names, dtypes, shapes; a named
  dimension takes any size, the same in every input naming it), then passed
  in the form the program was traced with (64-bit integers as word pairs with
  ``jax_enable_x64`` off, strings encoded).

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
    self, name: str, inputs: tuple[Input, ...], outputs: list[str], max_length: int, exported, places
  ):
    self.name = name
    self.outputs = list(outputs)
    self._inputs = inputs
    self._max_length = max_length
    self._places = list(places)  # which arrays of the serving state the program takes, in order
    self._state: list = []
    self._call = jax.jit(exported.call)
    self._out_dims = {
      k: [str(d) for d in a.shape] for k, a in zip(self.outputs, exported.out_avals, strict=True)
    }

  @property
  def inputs(self) -> dict[str, jax.ShapeDtypeStruct]:
    """``{name: jax.ShapeDtypeStruct}``: the inputs as callers give them (named dimensions as names)."""
    return {i.name: i.spec() for i in self._inputs}

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
    empty = sorted(d for d, size in sizes.items() if size == 0)
    if empty:  # a program's named dimensions are at least 1: run a batch of one, keep none of it
      return self._empty(inputs, empty)
    args = [i.encode(inputs[i.name], self._max_length) for i in self._inputs]
    return self._call(self._state, args)

  def _take(self, state: list) -> None:
    """Reads its arrays from the serving ``state`` (device arrays), as :class:`LoadedModel` holds it."""
    self._state = [state[k] for k in self._places]

  def _empty(self, inputs: dict, empty: list[str]) -> dict[str, jax.Array]:
    padded = {}
    for i in self._inputs:
      shape = [1 if d in empty else size for d, size in zip(i.dims, np.shape(inputs[i.name]))]
      padded[i.name] = np.full(shape, "", object) if i.is_string else np.zeros(shape, i.dtype)
    out = self(**padded)
    cut = {}
    for name, value in out.items():
      index = tuple(slice(0, 0) if d in empty else slice(None) for d in self._out_dims[name])
      cut[name] = value[index]
    return cut

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
  ):
    self.path = path
    self.signatures = signatures
    self.platforms = platforms
    self._host = list(state) if lineage is not None else None  # what deltas are applied to
    read = sorted({k for s in signatures.values() for k in s._places})
    self._device = {k: jax.numpy.asarray(state[k]) for k in read}
    self._lineage = lineage
    for signature in signatures.values():
      signature._take(self._device)

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
    device = {k: jax.numpy.asarray(x) for k, x in changed.items() if k in self._device}
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
