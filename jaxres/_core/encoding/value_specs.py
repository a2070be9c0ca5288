"""Value specifications: pytrees of per-entry arrays and their storage form."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxres._core.encoding import key_specs

# What JAX stores a 64-bit float leaf as when x64 is off.
_NARROWED = {np.dtype(np.float64): np.dtype(np.float32), np.dtype(np.complex128): np.dtype(np.complex64)}


# The leaf dtypes a Python number may stand for (as a weakly typed JAX scalar does).
_PYTHON_NUMBER_KINDS = {bool: "b", int: "iufc", float: "fc", complex: "c"}


def _is_spec_leaf(x) -> bool:
  return isinstance(x, jax.ShapeDtypeStruct) or _as_dtype(x) is not None


def _as_dtype(x):
  if isinstance(x, (list, tuple, dict)) or x is None:
    return None
  try:
    return np.dtype(x)
  except TypeError:
    return None


@dataclasses.dataclass(frozen=True)
class LeafSpec:
  """One value leaf: its user-facing dtype and per-entry shape.

  With ``jax_enable_x64`` off, a 64-bit integer leaf is stored as uint32 word
  pairs (``wide``) so that it stays exact; a ``float64`` leaf is stored as
  ``float32`` (JAX's own canonicalisation) and so loses precision.
  """

  dtype: np.dtype
  shape: tuple[int, ...]
  wide: bool

  @property
  def storage_dtype(self) -> np.dtype:
    if self.wide:
      return np.dtype(np.uint32)
    return np.dtype(jax.dtypes.canonicalize_dtype(self.dtype))

  @property
  def storage_shape(self) -> tuple[int, ...]:
    return (*self.shape, 2) if self.wide else self.shape

  def __str__(self) -> str:
    return f"{self.dtype}{list(self.shape)}"

  def accepts(self, dtype) -> bool:
    """Whether stored entries of ``dtype`` are this leaf's values (exported with x64 on or off).

    With ``jax_enable_x64`` off a ``float64`` leaf holds ``float32`` values,
    so either dtype is accepted for it.
    """
    dtype = np.dtype(dtype)
    return dtype == self.dtype or dtype == _NARROWED.get(self.dtype, self.dtype)

  def to_storage(self, x, batch: tuple[int, ...], name: str, broadcast: bool) -> jax.Array | np.ndarray:
    """One user leaf -> storage array of shape ``batch + storage_shape`` (NumPy for host values).

    ``broadcast`` allows any shape that broadcasts (defaults); otherwise the
    leaf must have shape ``batch + shape`` exactly, or be a scalar.
    """
    if self.wide:
      arr = self._wide_to_pairs(x, name)
      lead = arr.shape[:-1]
    else:
      arr = self._narrow(x, name)
      lead = arr.shape
    target = batch + self.shape
    if not (lead == target or lead == () or broadcast):
      raise ValueError(f"{name}: expected shape {target} ({self}), got {lead}.")
    try:
      return (jnp if isinstance(arr, jax.Array) else np).broadcast_to(arr, batch + self.storage_shape)
    except ValueError:
      raise ValueError(f"{name}: shape {lead} does not broadcast to {target} ({self}).") from None

  def _narrow(self, x, name):
    if type(x) in _PYTHON_NUMBER_KINDS:  # a Python number takes the leaf's dtype, if it fits
      return self._python_number(x, name)
    arr = x if isinstance(x, jax.Array) else np.asarray(x)
    src = np.dtype(arr.dtype)
    ok = src == self.dtype or np.can_cast(src, self.dtype, "same_kind")
    if src.kind == "b" and self.dtype.kind != "b":
      ok = False
    if not ok or src.kind not in "biufc":
      raise TypeError(
        f"{name}: expected values of dtype {self.dtype}, got {src}; cast explicitly if intended."
      )
    if src.kind in "iu" and self.dtype.kind in "iu" and not np.can_cast(src, self.dtype, "safe"):
      self._check_range(arr, name)
    return arr.astype(self.storage_dtype)

  def _python_number(self, x, name):
    if self.dtype.kind not in _PYTHON_NUMBER_KINDS[type(x)]:
      raise TypeError(
        f"{name}: expected values of dtype {self.dtype}, got the Python {type(x).__name__} {x!r}."
      )
    if isinstance(x, int) and self.dtype.kind in "iu":
      self._check_range(np.asarray(x, object), name)
    return np.asarray(x, self.dtype).astype(self.storage_dtype)

  def _check_range(self, arr, name):
    """Raises ``ValueError`` unless every integer of ``arr`` (host, or a concrete array) fits the dtype."""
    if key_specs.is_traced(arr) or not np.size(arr):
      return
    info = np.iinfo(self.dtype)
    low, high = (int(v) for v in jax.device_get((arr.min(), arr.max())))
    if low < info.min or high > info.max:
      bad = low if low < info.min else high
      raise ValueError(f"{name}: {bad} does not fit {self.dtype} (its values run {info.min}..{info.max}).")

  def _wide_to_pairs(self, x, name):
    if isinstance(x, jax.Array):
      if x.dtype == np.uint32 and x.shape[-1:] == (2,):
        return x
      if x.dtype == self.dtype:
        return key_specs.split64_jax(x)
      raise TypeError(
        f"{name}: expected {self.dtype} values (NumPy on the host) or uint32 word pairs "
        f"inside jit, got {x.dtype}."
      )
    if isinstance(x, (np.ndarray, np.generic)):
      arr = np.asarray(x)
      if arr.dtype == np.uint32 and arr.shape[-1:] == (2,):
        return arr
      if arr.dtype.kind not in "iu" or not np.can_cast(arr.dtype, self.dtype, "safe"):
        raise TypeError(f"{name}: expected {self.dtype} values, got {arr.dtype}.")
      arr = arr.astype(self.dtype)
    else:
      arr = key_specs.host_integers(x, self.dtype, name)
    return key_specs.split64_host(arr)

  def from_storage(self, x):
    return key_specs.decode_wide(x, self.dtype) if self.wide else x


@dataclasses.dataclass(frozen=True)
class ValueSpec:
  """Static description of a table's values: a pytree of :class:`LeafSpec`."""

  treedef: jax.tree_util.PyTreeDef
  leaves: tuple[LeafSpec, ...]

  @classmethod
  def parse(cls, value) -> ValueSpec:
    flat, treedef = jax.tree.flatten(value, is_leaf=_is_spec_leaf)
    if not flat:
      raise TypeError(f"value: expected a dtype, ShapeDtypeStruct or pytree of them, got {value!r}.")
    leaves = []
    for leaf in flat:
      if isinstance(leaf, jax.ShapeDtypeStruct):
        dtype, shape = np.dtype(leaf.dtype), tuple(leaf.shape)
      elif (dtype := _as_dtype(leaf)) is not None:
        shape = ()
      else:
        raise TypeError(f"value: expected a dtype or jax.ShapeDtypeStruct leaf, got {leaf!r}.")
      if dtype.kind not in "biufc":
        raise TypeError(f"value: unsupported dtype {dtype}.")
      wide = dtype.kind in "iu" and dtype.itemsize == 8 and not key_specs.x64_enabled()
      leaves.append(LeafSpec(dtype, shape, wide))
    return cls(treedef, tuple(leaves))

  def __str__(self) -> str:
    if self.treedef.num_leaves == 1 and not self.treedef.children():
      return str(self.leaves[0])
    return str(jax.tree.unflatten(self.treedef, [str(leaf) for leaf in self.leaves]))

  def spread(self, default):
    """A single scalar default stands for every leaf of a pytree value."""
    if jax.tree.structure(default).num_leaves == 1 and len(self.leaves) > 1:
      return jax.tree.unflatten(self.treedef, [default] * len(self.leaves))
    return default

  def _flatten(self, values, name: str) -> list:
    if self.treedef == jax.tree.structure(0):
      return [values]
    flat, treedef = jax.tree.flatten(values)
    if treedef != self.treedef:
      raise TypeError(f"{name}: expected a pytree of structure {self.treedef}, got {treedef}.")
    return flat

  def to_storage(self, values, batch, name: str, broadcast: bool = False) -> list:
    """A user value pytree -> flat storage arrays ``batch + storage_shape`` (NumPy for host values)."""
    flat = self._flatten(values, name)
    return [s.to_storage(x, batch, name, broadcast) for s, x in zip(self.leaves, flat)]

  def from_storage(self, leaves):
    """Flat storage arrays -> the user's pytree (64-bit leaves decoded)."""
    return jax.tree.unflatten(self.treedef, [s.from_storage(x) for s, x in zip(self.leaves, leaves)])

  def empty(self, batch: tuple[int, ...]) -> list[jax.Array]:
    return [jnp.zeros(batch + s.storage_shape, s.storage_dtype) for s in self.leaves]
