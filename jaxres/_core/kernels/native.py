"""The CPU kernels (the library ``_kernels``), each standing in for an XLA reference on CPU.

``pip install`` compiles the kernel files (``module.cc`` and ``shared.cc`` here, each
storage folder's ``kernels.cc``) into one library against the XLA FFI headers that jaxlib
ships (see ``setup.py``). Each kernel computes exactly what its reference
computes, the same results bit for bit, and replaces it only where XLA runs on
CPU: a program lowered for GPU or TPU runs the reference (also one a CPU-only
process lowers for them, with ``jax.export``: the choice is made at lowering). Without a compiler
at install time, or with ``JAXRES_KERNELS=0`` in the environment, every
backend runs the references.

Examples:
  >>> from jaxres._core.kernels import native
  >>> isinstance(native.ENABLED, bool)
  True
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

import jax
import jax.extend
import jax.numpy as jnp
from jax import lax
from jax.interpreters import batching, mlir

try:
  from jaxres._core.kernels import _kernels
except ImportError:  # built without a C++ compiler: the references everywhere
  _kernels = None

BUILT = _kernels is not None
ENABLED = BUILT and os.environ.get("JAXRES_KERNELS", "1") != "0"

if ENABLED:
  for _name, _capsule in _kernels.targets().items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")


# Whether programs traced here take the references alone: part of the key of JAX's caches of traced,
# lowered and compiled programs (a ``jax.make_user_context``), so that a function traced both ways
# keeps both programs, and entering or leaving :func:`references` costs nothing.
_REFERENCES = jax.make_user_context(default_value=False)


@contextlib.contextmanager
def references():
  """Traces the XLA references alone within the block: a program with no kernel in it (no custom
  call), which any JAX process (or TensorFlow, through jax2tf) can run on any platform.

  The choice is part of the key of JAX's caches: a function jitted outside the
  block and called within it is traced again, and each program is kept for
  later calls of its own kind (nothing is cleared; ``jr.saved_model.save``,
  which traces within the block, leaves a training step's program cached).

  Examples:
    >>> import jax, jax.numpy as jnp, jaxres as jr
    >>> from jaxres._core.kernels import native
    >>> table = jr.OpenAddressingTable.create(8, key=jnp.int32, value=jnp.float32)
    >>> find = jax.jit(lambda t, k: t.find(k)[0])
    >>> with native.references():
    ...   text = find.lower(table, jnp.arange(2)).as_text()
    >>> "custom_call" in text
    False
  """
  with _REFERENCES(True):
    yield


def kernels_traced() -> bool:
  """Whether a program traced here calls the kernels on CPU: built, enabled, not within :func:`references`."""
  return ENABLED and not _REFERENCES.value


def on_cpu(target: str, reference: Callable, results, *args, aliases=None, **attrs) -> tuple:
  """``reference(*args)`` (a tuple of arrays), computed by the kernel ``target`` on CPU.

  ``results``: the ``jax.ShapeDtypeStruct`` of each of the reference's
  outputs; ``aliases``: ``{argument: result}`` pairs the kernel updates in
  place; ``attrs``: the kernel's static attributes.

  The choice is made when the program is lowered, per platform (one primitive
  with a CPU lowering rule, the kernel, and a default one, the reference): a
  program lowered for the CPU alone never traces the reference.
  """
  if not kernels_traced():
    return tuple(reference(*args))
  params = {
    "target": target,
    "reference": reference,
    "results": tuple(jax.ShapeDtypeStruct(r.shape, r.dtype) for r in results),
    "aliases": tuple(sorted((aliases or {}).items())),
    "attrs": tuple(sorted(attrs.items())),
  }
  return tuple(_KERNEL.bind(*args, **params))


_KERNEL = jax.extend.core.Primitive("jaxres_kernel")
_KERNEL.multiple_results = True


@_KERNEL.def_abstract_eval
def _abstract(*args, results, **_):
  del args
  return [jax.core.ShapedArray(r.shape, r.dtype) for r in results]


@_KERNEL.def_impl
def _eager(*args, **params):
  return jax.jit(lambda *a: _KERNEL.bind(*a, **params))(*args)


def _kernel_lowering(ctx, *args, target, aliases, attrs, **_):
  return jax.ffi.ffi_lowering(target, operand_output_aliases=dict(aliases))(ctx, *args, **dict(attrs))


def _reference_lowering(ctx, *args, reference, **_):
  return mlir.lower_fun(lambda *a: tuple(reference(*a)), multiple_results=True)(ctx, *args)


def _batched(args, dims, **params):
  """Under ``vmap``, one call per element (as ``ffi_call``'s ``vmap_method="sequential"``)."""
  mapped = [i for i, d in enumerate(dims) if d is not None]

  def one(xs):
    full = list(args)
    for i, x in zip(mapped, xs):
      full[i] = x
    return tuple(_KERNEL.bind(*full, **params))

  out = lax.map(one, [jnp.moveaxis(args[i], dims[i], 0) for i in mapped])
  return list(out), [0] * len(out)


mlir.register_lowering(_KERNEL, _reference_lowering)
mlir.register_lowering(_KERNEL, _kernel_lowering, platform="cpu")
batching.primitive_batchers[_KERNEL] = _batched
