"""``LoadStatus``: what a restore matched, and what is still waiting for an object."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxres._tracking.identity import IdentityMap
from jaxres._tracking.manifest import Reader

_PARTIAL_HINT = "To accept a partial restore, call `expect_partial()` on the status instead of asserting."


class Ledger:
  """What a restore (or one step of it) has done; merged into the restore's ledger on success.

  Checkpoint paths are canonical (aliases resolved); program paths are where
  objects sit in the restored graph.
  """

  def __init__(self):
    self.consumed: set[str] = set()  # checkpoint paths an object was found for
    self.matched: set[str] = set()  # program paths of the objects found
    self.pending: set[str] = set()  # program paths waiting for an object
    self.extra: set[str] = set()  # program paths of objects the checkpoint has no value for
    self.sharing: set[str] = set()  # program paths shared otherwise than in the checkpoint
    self.objects = IdentityMap()  # object -> the checkpoint path it was restored from
    self.first_object: dict[
      str, Callable[[], Any]
    ] = {}  # checkpoint path -> the first object restored from it

  def merge(self, other: Ledger) -> None:
    self.consumed |= other.consumed
    self.matched |= other.matched
    self.pending |= other.pending
    self.extra |= other.extra
    self.sharing |= other.sharing
    self.objects.update(other.objects)
    for path, ref in other.first_object.items():
      self.first_object.setdefault(path, ref)


class LoadStatus:
  """What a :meth:`Checkpoint.restore` matched, and what is still waiting.

  Every ``assert_*`` method raises ``AssertionError`` naming the paths at
  fault and otherwise returns the status, so calls can be chained. Objects
  attached later under a pending path are restored then, and the status
  follows.

  Attributes:
    pending: the program paths still waiting for an object to be attached.

  Examples:
    >>> import tempfile, jax.numpy as jnp, jaxres as jr
    >>> root = jr.AutoTrackable()
    >>> root.step = jnp.array(3)
    >>> path = jr.Checkpoint(model=root).save(tempfile.mkdtemp() + "/ckpt")
    >>> status = jr.Checkpoint(model=jr.AutoTrackable()).restore(path)
    >>> status.pending
    ['model/step']
    >>> _ = status.expect_partial()
  """

  def __init__(self, reader: Reader, ledger: Ledger):
    self._reader, self._ledger = reader, ledger

  @property
  def pending(self) -> list[str]:
    """Sorted paths still waiting for an object to be attached."""
    return sorted(self._ledger.pending)

  def assert_consumed(self) -> LoadStatus:
    """Every checkpointed value found an object, and every object a value.

    Objects that hold no values themselves (containers) are not required.
    """
    unused = sorted(p for p in self._reader.valued() if p not in self._ledger.consumed)
    if unused:
      raise AssertionError(
        f"{self._reader.label}: checkpoint values with no object: {unused}. Attach objects under "
        f"these paths (they are restored on attach). {_PARTIAL_HINT}"
      )
    return self.assert_existing_objects_matched()

  def assert_existing_objects_matched(self) -> LoadStatus:
    """Every object of the restored graph had a checkpointed value, shared as in the checkpoint."""
    if self._ledger.extra:
      raise AssertionError(
        f"{self._reader.label}: objects with no checkpointed value: {sorted(self._ledger.extra)}. "
        f"{_PARTIAL_HINT}"
      )
    if self._ledger.sharing:
      raise AssertionError(
        f"{self._reader.label}: objects shared differently from the checkpoint at: "
        f"{sorted(self._ledger.sharing)}"
      )
    return self

  def assert_nontrivial_match(self) -> LoadStatus:
    """At least one object besides the root was restored."""
    if not self._ledger.matched - {""}:
      raise AssertionError(f"{self._reader.label}: nothing but the root matched the checkpoint.")
    return self

  def expect_partial(self) -> LoadStatus:
    """Declares that a partial restore is intended (nothing is reported)."""
    return self

  def __repr__(self) -> str:
    return f"LoadStatus({self._reader.label!r}, matched={len(self._ledger.matched)}, pending={self.pending})"
