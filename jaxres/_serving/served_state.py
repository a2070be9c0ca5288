"""The object a served signature reads: a copy in inference mode, its tables in read-only form.

The copy shares the object's arrays (nothing is copied but the tables, which
are compacted): each NNX module is put in inference mode (``eval()``: an
embedding's lookup only reads), and each ``jr.Table`` (held by a variable, as
an embedding's table or a stateful table's state, or directly) becomes its
read-only form, a sorted table of exactly its live entries
(``sorted_arrays.read_only``). What the signatures then read of that state is
found by tracing them; the rest (optimizer slots, scores, admission counts,
counters) is never saved.

The object may be an NNX object, a ``jr.AutoTrackable`` (its children are
served, the object keeps its type and methods), a list, tuple or dict of
these, a functional table or an array: whatever ``jr.Checkpoint`` saves. The
walk is the checkpoints' own: each object's handle (``jaxres._tracking.handles``,
registered per type) says how it is served.
"""

from __future__ import annotations

from typing import Any

from jaxres._core.storages.sorted import read_only
from jaxres._tracking import handles


def serving_copy(obj, served: handles.Served = read_only) -> Any:
  """``obj`` as a signature reads it: modules in inference mode, each table as ``served(table)``
  (its read-only form), the tables taken in a fixed order (the same for objects alike).

  Each object says how through its handle (:meth:`handles.Handle.serving_copy`); what is not
  part of the checkpointed graph, or cannot be checkpointed, is read as it is."""
  handle = _handle(obj)
  return obj if handle is None else handle.serving_copy(served, lambda child: serving_copy(child, served))


def split(obj, path: str = "") -> handles.Split:
  """``(leaves, names, rebuild)``: the arrays ``obj`` holds, their paths, and ``rebuild(leaves)``,
  an object like ``obj`` holding those leaves (under a trace: the traced values)."""
  handle = _handle(obj)
  if handle is None:
    return [], [], lambda new: obj  # not state (a number, a string, a function): kept as it is
  return handle.serving_split(path, split)


def _handle(obj) -> handles.Handle | None:
  try:
    return handles.handle_for(obj)
  except TypeError:  # not checkpointable: the export's checkpoint of it names the problem
    return None


def changed_paths(obj, leaves: list, names: list[str]) -> list[str]:
  """The paths where ``obj`` (built from ``leaves``) no longer holds them: what a signature changed."""
  now, _, _ = split(obj)
  if len(now) != len(leaves):
    return ["its structure"]
  return [name for name, a, b in zip(names, now, leaves, strict=True) if a is not b]
