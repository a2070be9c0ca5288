"""The CPU kernels of ``kernels.cc``, each standing in for an XLA reference on CPU.

``pip install`` compiles ``kernels.cc`` against the XLA FFI headers that jaxlib
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
import threading
from collections.abc import Callable

import jax
from jax import lax

try:
  from jaxres._core.kernels import _kernels
except ImportError:  # built without a C++ compiler: the references everywhere
  _kernels = None

BUILT = _kernels is not None
ENABLED = BUILT and os.environ.get("JAXRES_KERNELS", "1") != "0"

if ENABLED:
  for _name, _capsule in _kernels.targets().items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")


_TRACING = threading.local()


@contextlib.contextmanager
def references():
  """Traces the XLA references alone within the block: a program with no kernel in it (no custom
  call), which any JAX process (or TensorFlow, through jax2tf) can run on any platform.

  JAX's caches of traced functions are cleared on entry and on exit: a
  function traced before with the kernels (or within the block without them)
  would otherwise be reused as it was.
  """
  before = getattr(_TRACING, "references", False)
  jax.clear_caches()
  _TRACING.references = True
  try:
    yield
  finally:
    _TRACING.references = before
    jax.clear_caches()


def on_cpu(target: str, reference: Callable, results, *args, aliases=None, **attrs) -> tuple:
  """``reference(*args)`` (a tuple of arrays), computed by the kernel ``target`` on CPU.

  ``results``: the ``jax.ShapeDtypeStruct`` of each of the reference's
  outputs; ``aliases``: ``{argument: result}`` pairs the kernel updates in
  place; ``attrs``: the kernel's static attributes.
  """
  if not ENABLED or getattr(_TRACING, "references", False):
    return tuple(reference(*args))
  call = jax.ffi.ffi_call(target, results, vmap_method="sequential", input_output_aliases=aliases)
  return lax.platform_dependent(*args, cpu=lambda *a: tuple(call(*a, **attrs)), default=reference)
