"""The base of the checkpointed object graph: named children and the save/restore protocol.

The whole protocol, in one place. Every kind of object saves and restores
itself through three methods (a new kind defines those it needs):

* ``_trackable_children()``: the objects it holds, by local name;
* ``_serialize_to_arrays()``: its own state as ``{name: array}``;
* ``_restore_from_arrays(arrays)``: that state put back.

The tracking layer calls them through two more, whose defaults serve every kind:

* ``_prepare_restore(arrays) -> commit``: the restore in two steps, so that a
  restore failing anywhere leaves every object as it was. ``commit()``
  restores and returns the function that undoes it. The default keeps a copy
  of the arrays from before; a resource keeps its old state instead.
* ``_holds_arrays()``: whether the object has arrays of its own (a restore
  reports an object that has, and that the checkpoint lacks).

an object whose state can be saved as a delta (incremental saves) says so:

* ``_serialize_changes_to_arrays(since) -> (mark, arrays)``: where it stands
  now (any value the next call gets back as ``since``, ``None``: no deltas)
  and its state as a delta since ``since``, ``arrays`` ``None`` to be saved
  whole (the default: always whole);

and an object that holds children may say how they are put in place:

* ``_replace_trackable_child(name, value)``: a restored value (an array, a
  functional table, a tuple) in place of the child ``name``;
* ``_defer_restore(name, new_queue)``: the queue of restores waiting for a
  child not attached yet (only a kind that sees attachments can have one).

The tracking layer walks the graph through these, checks what it reads,
schedules deferred restores and keeps the load status; it knows no kind's
internals. Objects that are not trackables (arrays, containers, functional
tables, NNX objects) get the same protocol from adapters registered per type
in ``jaxres._tracking.handles``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import numpy as np

Commit = Callable[[], Callable[[], None]]  # changes the object; returns what undoes the change


class Trackable:
  """An object of the checkpointed graph: named children, and its own state as arrays.

  Subclass it to checkpoint an object with state of its own (a tokenizer's
  vocabulary, a Python counter): ``_serialize_to_arrays`` returns the state as
  named arrays of numbers or bools, ``_restore_from_arrays`` puts it back. Restore calls it only
  after the arrays were read and checked against the checkpoint's checksums,
  and with deferred restore, load-status accounting and error handling as
  for every built-in kind: when it raises, the object is left as it was (its
  arrays from before are restored) and the error names the object's path.

  Examples:
    >>> import tempfile, numpy as np, jaxres as jr
    >>> class Tokenizer(jr.Trackable):
    ...   def __init__(self, words=()):
    ...     self.ids = {word: i for i, word in enumerate(words)}
    ...   def _serialize_to_arrays(self):  # arrays of numbers: the words as UTF-8 lines
    ...     return {"words": np.frombuffer("\\n".join(self.ids).encode(), np.uint8)}
    ...   def _restore_from_arrays(self, arrays):
    ...     words = arrays["words"].tobytes().decode().split("\\n")
    ...     self.ids = {word: i for i, word in enumerate(words)}
    >>> root = jr.AutoTrackable()
    >>> root.tokenizer = Tokenizer(["the", "quick", "fox"])
    >>> path = jr.Checkpoint(model=root).save(tempfile.mkdtemp() + "/ckpt")
    >>> fresh = jr.Checkpoint(model=jr.AutoTrackable())
    >>> status = fresh.restore(path)
    >>> fresh.model.tokenizer = Tokenizer()  # restored here, on attach
    >>> fresh.model.tokenizer.ids
    {'the': 0, 'quick': 1, 'fox': 2}
  """

  # Checkpoints of one kind restore into objects of the same kind only (an
  # array where a table was saved is refused). Kinds whose checkpoints are
  # interchangeable share a label.
  _checkpoint_kind: ClassVar[str] = "trackable"

  def _trackable_children(self) -> dict[str, Any]:
    """The children by local name. Values that cannot be checkpointed (numbers, strings) are skipped."""
    return {}

  def _serialize_to_arrays(self) -> Mapping[str, Any]:
    """This object's own state as ``{name: array}`` (NumPy or JAX arrays; children excluded)."""
    return {}

  def _serialize_changes_to_arrays(self, since: Any) -> tuple[Any, Mapping[str, Any] | None]:
    """``(mark, delta)``: for an incremental save, where the state stands now and what changed since
    the ``mark`` of the previous save (``since``; ``None``: none). By default ``(None, None)``:
    saved whole every time."""
    del since
    return None, None

  def _restore_from_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
    """Puts back the state :meth:`_serialize_to_arrays` saved (NumPy arrays, read and checked).

    Raises:
      TypeError, ValueError: the arrays are not this object's (another kind,
        other names, shapes or dtypes).
    """
    if arrays:
      raise TypeError(f"expected no arrays (a {type(self).__name__} has none), got {sorted(arrays)}.")

  def _prepare_restore(self, arrays: Mapping[str, np.ndarray]) -> Commit:
    """The restore in two steps: returns ``commit``, which restores (through
    :meth:`_restore_from_arrays`) and returns a function that undoes it, so that a restore failing
    on a later object leaves every object as it was. The undo restores a copy of the arrays
    :meth:`_serialize_to_arrays` gave just before (also when the restore itself raises).
    """

    def commit():
      snapshot = {name: np.array(value, copy=True) for name, value in self._serialize_to_arrays().items()}
      try:
        self._restore_from_arrays(arrays)
      except BaseException:
        self._restore_from_arrays(snapshot)
        raise
      return lambda: self._restore_from_arrays(snapshot)

    return commit

  def _holds_arrays(self) -> bool:
    """Whether this object has arrays of its own now (children excluded)."""
    return bool(self._serialize_to_arrays())

  def _replace_trackable_child(self, name: str, value: Any) -> None:
    """Puts ``value`` in place of the child ``name`` (a restored array, functional table or tuple).

    Raises:
      TypeError: the child is not held in the attribute ``name`` (a kind that keeps children
        elsewhere defines this method).
    """
    if getattr(self, name, None) is not self._trackable_children().get(name):
      raise TypeError(
        f"a {type(self).__name__} keeps this child elsewhere than in its attribute {name!r}; "
        "define _replace_trackable_child to restore it."
      )
    setattr(self, name, value)

  def _defer_restore(self, name: str, new_queue: Callable[[], Any]) -> Any | None:
    """The queue of restores waiting for a child ``name`` to be attached, or ``None``.

    The queue (made by ``new_queue()`` the first time) has one method,
    ``attach(value, place) -> bool``: it restores ``value``, calls
    ``place(restored)`` as its last step (so that a failure anywhere leaves
    everything as it was) and returns whether the queue is done with. This
    kind cannot tell when a child is attached, so it returns ``None`` (the
    path stays pending).
    """
    del name, new_queue
    return None


class AutoTrackable(Trackable):
  """A :class:`Trackable` whose public attributes are its children, in assignment order.

  Attributes holding trackables, NNX objects (``nnx.Module``, ``nnx.Optimizer``),
  tables, arrays, pytrees of arrays, or lists, tuples and dicts of these are
  checkpointed; other values (numbers, strings) and names starting with ``_``
  are not. Subclasses need not call ``super().__init__()``. An object attached
  under a path that a restore is waiting for is restored on attach.

  Examples:
    >>> import jax.numpy as jnp, jaxres as jr
    >>> root = jr.AutoTrackable()
    >>> root.step = jnp.array(7)
    >>> root.layers = [jr.AutoTrackable(), jr.AutoTrackable()]
    >>> list(root._trackable_children())
    ['step', 'layers']
  """

  def __setattr__(self, name: str, value: Any) -> None:
    queue = self.__dict__.get("_jaxres_deferred", {}).get(name)
    if queue is None:
      self._assign_child(name, value)
    elif queue.attach(value, lambda restored: self._assign_child(name, restored)):  # raises, changing nothing
      self.__dict__["_jaxres_deferred"].pop(name, None)

  def _assign_child(self, name: str, value: Any) -> None:
    object.__setattr__(self, name, value)
    if not name.startswith("_") and name in self.__dict__:  # a property keeps its value elsewhere
      self.__dict__.setdefault("_jaxres_children", {}).setdefault(name, None)

  def __delattr__(self, name: str) -> None:
    object.__delattr__(self, name)
    self.__dict__.get("_jaxres_children", {}).pop(name, None)

  def _trackable_children(self) -> dict[str, Any]:
    return {
      name: self.__dict__[name] for name in self.__dict__.get("_jaxres_children", {}) if name in self.__dict__
    }

  def _replace_trackable_child(self, name: str, value: Any) -> None:
    object.__setattr__(self, name, value)  # in place: keeps the order, runs no restore

  def _defer_restore(self, name: str, new_queue: Callable[[], Any]) -> Any:
    queues = self.__dict__.setdefault("_jaxres_deferred", {})
    if name not in queues:
      queues[name] = new_queue()
    return queues[name]
