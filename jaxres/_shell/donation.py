"""Catching the jitted call that copied a whole table because it was not donated.

``nnx.jit`` hands every variable of its arguments back as an output of the
compiled program. Unless the argument was donated (``donate_argnums``), XLA
must write each output to a new buffer: a step that touches a few rows of a
million-row table copies the whole table, every call, in silence (at 2^20
rows, 193 ms against 3.3 ms donated). A variable holding a table
(:class:`TableVariable`) checks, as ``nnx.jit`` writes the result back, whether
its storage moved while the old buffer is still alive, and warns once per
table with :class:`TableCopyWarning`.
"""

from __future__ import annotations

import warnings

import jax
from flax import nnx
from jax.core import Tracer


class TableCopyWarning(UserWarning):
  """A jitted call copied a whole table because the argument holding it was not donated.

  Raised once per table (by the ``warnings`` module's registry) when
  ``nnx.jit`` hands back a table in a new buffer while the old one is still
  alive. Donate the arguments that hold models and optimizers:
  ``nnx.jit(step, donate_argnums=(0, 1))``. Donated, it still appears when
  something else holds the table's buffer: on CPU ``np.asarray`` of one of its
  arrays is a view that pins it (take ``np.array``, a copy). To silence it:
  ``warnings.filterwarnings("ignore", category=jr.TableCopyWarning)``.

  Examples:
    >>> import warnings, jax.numpy as jnp, jaxres as jr
    >>> from flax import nnx
    >>> class Counts(nnx.Module):
    ...   def __init__(self):
    ...     self.table = jr.MutableHashTable(jnp.int32, jnp.int32, default_value=0)
    >>> model = Counts()
    >>> with warnings.catch_warnings(record=True) as caught:
    ...   warnings.simplefilter("always")
    ...   nnx.jit(lambda m: m.table.insert(jnp.array([1]), jnp.array([5])))(model)
    >>> [w.category.__name__ for w in caught]
    ['TableCopyWarning']
    >>> step = nnx.jit(lambda m: m.table.insert(jnp.array([2]), jnp.array([7])), donate_argnums=0)
    >>> step(model)  # donated: no copy, no warning
    >>> model.table.find(jnp.array([1, 2])).tolist()
    [5, 7]
  """


class TableVariable(nnx.Variable):
  """An ``nnx.Variable`` holding a table: warns once when ``nnx.jit`` returns a copy of it.

  Its metadata ``label`` (optional) names the table in the warning.
  """

  def set_raw_value(self, value, **kwargs):
    old = self.get_raw_value()
    super().set_raw_value(value, **kwargs)  # first: a warning turned into an error loses no update
    warn_if_copied(self, old, value)


def warn_if_copied(variable: nnx.Variable, old, new) -> None:
  """Warns when ``new`` holds the table of ``old`` in another buffer while ``old`` is still alive.

  The table is its largest array; about 30 us a call (one step), the cost of flattening it.
  """
  before, after = jax.tree.leaves(old), jax.tree.leaves(new)
  if not before or len(before) != len(after):
    return
  k = max(range(len(before)), key=lambda i: getattr(before[i], "size", 0))
  b, a = before[k], after[k]
  if not (_concrete(b) and _concrete(a)) or b.shape != a.shape or b.is_deleted():
    return
  if _pointer(b) == _pointer(a):
    return
  label = variable.get_metadata().get("label") or type(variable).__name__
  old_bytes = sum(x.nbytes for x in before if isinstance(x, jax.Array))
  warnings.warn(
    f"jaxres: a jitted call handed back a copy of {label} ({old_bytes / 2**20:.1f} MiB), because the "
    "argument holding it was not donated: every such call copies the whole table, however few rows it "
    "touches. Donate the arguments holding the model and optimizer, e.g. "
    "nnx.jit(step, donate_argnums=(0, 1)).",
    TableCopyWarning,
    stacklevel=2,
  )


def _concrete(x) -> bool:
  """Whether ``x`` is an array with buffers (not a tracer, not a NumPy array)."""
  return isinstance(x, jax.Array) and not isinstance(x, Tracer)


def _pointer(array: jax.Array) -> int:
  """The address of the array's first buffer on its device (of its first shard when sharded)."""
  try:
    return array.unsafe_buffer_pointer()
  except jax.errors.JaxRuntimeError:  # an array over several devices
    return array.addressable_shards[0].data.unsafe_buffer_pointer()
