"""One signature as a ``jax.export`` program of the serving state and the signature's inputs.

The program takes the arrays of the serving state it reads (found by tracing:
a first export, on a concrete batch, reports which arguments the computation
uses; the program then takes those alone) and the inputs in their traced form, with named
dimensions as symbolic shapes, so one program serves every batch size. It is
traced with the XLA references of the CPU kernels (``native.references``): no
custom call, so stock JAX (and TensorFlow, through jax2tf) runs it on every
platform it was lowered for.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxres._core.kernels import native
from jaxres._serving import served_state
from jaxres._serving.signature import Signature


@dataclasses.dataclass
class Program:
  """A signature exported: the program, the state arrays it takes (by index) and its output names."""

  exported: jax.export.Exported
  state: list[int]  # indices into the serving state's leaves, in the order the program takes them
  outputs: list[str]


def export(name: str, signature: Signature, state: tuple, platforms) -> Program:
  """``signature`` over the serving state ``(leaves, names, rebuild)`` (see :func:`served_state.split`).

  Raises:
    ValueError: the signature changes the object, or its dimensions cannot
      be traced symbolically.
    TypeError: its outputs are not arrays or a dict of them.
  """
  leaves, names, rebuild = state
  inputs = signature.parsed
  dims = sorted({d for i in inputs for d in i.dims if isinstance(d, str)})
  scope = jax.export.SymbolicScope()
  sizes = dict(zip(dims, jax.export.symbolic_shape(",".join(dims), scope=scope))) if dims else {}
  input_specs = [i.traced(sizes, signature.max_length) for i in inputs]
  # Which state arrays the signature reads is found on a concrete batch: an export with symbolic
  # dimensions keeps every argument.
  concrete_specs = [i.traced(dict.fromkeys(dims, 2), signature.max_length) for i in inputs]
  # As JAX takes the object's arrays when the function runs: a NumPy float64 array, x64 off, as float32.
  state_specs = [jax.ShapeDtypeStruct(x.shape, jax.dtypes.canonicalize_dtype(x.dtype)) for x in leaves]
  outputs: list[str] = []

  def traced(taken: list[int]):
    def fn(state, args):
      full = [jnp.zeros(s.shape, s.dtype) for s in state_specs]  # arrays it does not read: traced away
      for index, x in zip(taken, state, strict=True):
        full[index] = x
      obj = rebuild(full)
      out = _as_outputs(name, signature.fn(obj, **{i.name: x for i, x in zip(inputs, args, strict=True)}))
      changed = served_state.changed_paths(obj, full, names)
      if changed:
        raise ValueError(
          f"signature {name!r}: it changes {', '.join(changed[:3])}; a served signature only reads the "
          "object (inference mode), never inserts, removes or assigns."
        )
      outputs[:] = sorted(out)
      return {k: out[k] for k in outputs}

    return fn

  everything = list(range(len(leaves)))
  with native.references():
    first = jax.export.export(jax.jit(traced(everything)), platforms=platforms)(state_specs, concrete_specs)
    read = [i for i in first.module_kept_var_idx if i < len(leaves)]
    exported = jax.export.export(jax.jit(traced(read)), platforms=platforms)(
      [state_specs[i] for i in read], input_specs
    )
  return Program(exported, read, list(outputs))


def _as_outputs(name: str, out) -> dict:
  if not isinstance(out, dict):
    out = {"output": out}
  for key, value in out.items():
    if not isinstance(key, str) or not isinstance(value, jax.Array):
      raise TypeError(
        f"signature {name!r}: expected outputs that are arrays or a dict of named arrays, got {key!r}: "
        f"{type(value).__name__}."
      )
  return out
