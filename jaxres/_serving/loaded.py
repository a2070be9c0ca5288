"""A saved model loaded back: its signatures, callable by input name, with no model code."""

from __future__ import annotations

import jax
import numpy as np

from jaxres._serving.signature import Input


class LoadedSignature:
  """One signature of a loaded model: ``signature(**inputs) -> {name: array}``.

  Inputs are checked against the saved specs (names, dtypes, shapes; a named
  dimension takes any size, the same in every input naming it), then passed
  in the form the program was traced with (64-bit integers as word pairs with
  ``jax_enable_x64`` off, strings encoded).
  """

  def __init__(
    self, name: str, inputs: tuple[Input, ...], outputs: list[str], max_length: int, exported, state
  ):
    self.name = name
    self.outputs = list(outputs)
    self._inputs = inputs
    self._max_length = max_length
    self._state = state
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
  """What :func:`jaxres.saved_model.load` returns: ``signatures`` by name, and ``platforms``."""

  def __init__(self, path, signatures: dict[str, LoadedSignature], platforms: tuple[str, ...]):
    self.path = path
    self.signatures = signatures
    self.platforms = platforms

  def __repr__(self) -> str:
    return (
      f"LoadedModel({str(self.path)!r}, signatures={sorted(self.signatures)}, platforms={self.platforms})"
    )
