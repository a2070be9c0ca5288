"""Small types the core passes instead of strings: how an upsert treats present and repeated keys,
and what a repeated key's one travelling row carries of each leaf."""

from __future__ import annotations

import enum


class Upsert(enum.Enum):
  """What an upsert writes (``insert`` or ``find_or_insert``).

  Examples:
    >>> Upsert.INSERT.keeps_present
    False
  """

  INSERT = ("insert", False)  # every named key takes its values; a key repeated in the batch: its last row
  FIND_OR_INSERT = ("find_or_insert", True)  # present keys keep theirs; a new key takes its first row's

  def __init__(self, _name: str, keeps_present: bool):
    self.keeps_present = keeps_present  # keys already present keep their values (the call returns them)


class Carry(enum.Enum):
  """What the one row a repeated key travels with carries of a leaf: its first or last row's
  value, or a reduction over all its rows (a scatter method: ``add``, ``multiply``, ``max``,
  ``min``).

  Examples:
    >>> Carry.ADD.reduces, Carry.LAST.reduces
    (True, False)
  """

  FIRST = "first"
  LAST = "last"
  ADD = "add"
  MULTIPLY = "multiply"
  MAX = "max"
  MIN = "min"

  @property
  def reduces(self) -> bool:
    return self not in (Carry.FIRST, Carry.LAST)

  def scatter(self, at, x):
    """``at`` (an ``array.at[index]``) reduced with ``x`` by this reduction; indices out of range
    are dropped."""
    if not self.reduces:
      raise ValueError(f"{self} is no reduction.")
    return getattr(at, self.value)(x, mode="drop")
