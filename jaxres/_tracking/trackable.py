"""Named dependencies between objects: the base of the checkpointed object graph.

A :class:`Trackable` knows its children by local name. :class:`AutoTrackable`
records them on attribute assignment, also in subclasses whose ``__init__``
never calls ``super().__init__()`` (the bookkeeping is created on first use),
and restores a child attached under a path that a checkpoint restore queued.
"""

from __future__ import annotations

from typing import Any

import jax


def _is_trackable_value(value: Any) -> bool:
  """Whether an attribute value is part of the object graph."""
  if isinstance(value, Trackable):
    return True
  from flax import nnx

  if isinstance(value, nnx.Pytree):  # nnx.Module, nnx.Optimizer, ...
    return True
  leaves = jax.tree.leaves(value)
  return bool(leaves) and all(isinstance(x, jax.Array) for x in leaves)


class Trackable:
  """An object with named children (other trackables, modules or arrays).

  Example:
    >>> import jax.numpy as jnp, jaxres as jr
    >>> root = jr.AutoTrackable()
    >>> root.step = jnp.array(7)
    >>> sorted(root._trackable_children())
    ['step']
  """

  def _trackable_children(self) -> dict[str, Any]:
    """The children by local name, in assignment order."""
    return {}


class AutoTrackable(Trackable):
  """A :class:`Trackable` whose attributes become its children when assigned.

  Attributes whose values are trackables, NNX objects (``nnx.Module`` s,
  ``nnx.Optimizer`` s), arrays or pytrees
  of arrays are tracked; names starting with ``_`` and other values are not.
  """

  def __setattr__(self, name: str, value: Any) -> None:
    deferred = self.__dict__.get("_jaxres_deferred", {}).get(name)
    if deferred is not None:
      # Restore-on-attach; a mismatch raises here, before anything changes.
      value = deferred.restore(value)
      del self.__dict__["_jaxres_deferred"][name]
    object.__setattr__(self, name, value)
    children = self.__dict__.setdefault("_jaxres_children", {})
    children.pop(name, None)
    if not name.startswith("_") and _is_trackable_value(value):
      children[name] = None

  def __delattr__(self, name: str) -> None:
    object.__delattr__(self, name)
    self.__dict__.get("_jaxres_children", {}).pop(name, None)

  def _trackable_children(self) -> dict[str, Any]:
    return {name: getattr(self, name) for name in self.__dict__.get("_jaxres_children", {})}
