"""How the tracking layer sees each object of the graph: one :class:`Handle` per object.

A handle gives the object's kind, children and arrays, and restores it. The
walkers (:mod:`saving`, :mod:`restoring`) only use handles, so they know no
kind's internals. Each type's handle is registered for it (:func:`register`;
a subclass gets its closest base's):

* a :class:`jaxres.Trackable` implements the protocol itself (:class:`TrackableHandle`);
* a functional table is a value restored by replacing it (:class:`TableHandle`);
* JAX and NumPy arrays (:class:`ArrayHandle`);
* NNX objects and variables (registered by ``jaxres._integrations.nnx``).

Lists, tuples and dicts holding such objects are containers of children, and
other pytrees of arrays one value (the handles below).

Objects for which :func:`handle_for` returns ``None`` (numbers, strings,
callables) are not part of the graph.

Serving walks the same handles (``jaxres._serving.served_state``): each gives
its object as a served signature reads it (:meth:`Handle.serving_copy`) and
the arrays a signature takes as arguments (:meth:`Handle.serving_split`).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from jax.core import Tracer

from jaxres import _errors as errors
from jaxres._core.pytrees import leaf_names
from jaxres._core.table import Table
from jaxres._persistence import table_arrays
from jaxres._shell.trackable import AutoTrackable, Commit, Trackable
from jaxres._tracking import paths

ARRAY_TYPES = (jax.Array, np.ndarray, np.generic)
CONTAINERS = (list, tuple, dict)

Served = Callable[[Table], Table]  # a table as a served signature reads it (its read-only form)
# ``(leaves, names, rebuild)``: the arrays an object holds, their paths, and ``rebuild(leaves)``, an
# object like it holding those leaves (under a trace: the traced values).
Split = tuple[list, list[str], Callable[[list], Any]]


@functools.singledispatch
def _registered(obj: Any) -> Handle | None:
  """The handle registered for ``type(obj)`` (or its closest registered base), else ``None``."""
  del obj
  return None


def register(cls: type, factory: Callable[[Any], Handle]) -> None:
  """Makes ``factory(obj)`` the handle of objects of ``cls`` (and its subclasses)."""
  _registered.register(cls)(factory)


def _has_handle(cls: type) -> bool:
  return _registered.dispatch(cls) is not _registered.dispatch(object)


def type_name(obj: Any) -> str:
  return f"{type(obj).__module__}.{type(obj).__qualname__}"


class Handle:
  """One object of the graph as the tracking layer sees it.

  Attributes:
    obj: the object.
    type: its type's full name (saved with it, to name it in messages).
    kind: a label saved with the object; a restore refuses another kind.
    shared: the object has an identity: saved once, its other paths become
      aliases (values such as arrays are saved at every path instead).
    strict: every child must be checkpointable (containers): a child that is
      not raises at save instead of being skipped.
    takes_parts: :meth:`restore` takes arrays of which each process read
      some rows (``processes.Blocks``, a sharded table's shards); others get
      NumPy arrays.
  """

  kind = ""
  shared = True
  strict = False
  takes_parts = False

  def __init__(self, obj: Any):
    self.obj = obj
    self.type = type_name(obj)

  def children(self) -> dict[str, Any]:
    """Children by relative path (escaped segments joined by ``/``)."""
    return {}

  def arrays(self) -> Mapping[str, Any]:
    """The object's own state as named arrays."""
    return {}

  def holds_values(self) -> bool:
    """Whether the object may hold arrays of its own (else only its children do)."""
    return False

  def changes(self, since: Any) -> tuple[Any, Mapping[str, Any] | None]:
    """``(mark, delta)`` for an incremental save: where the object stands now (``None``: it gives no
    deltas) and its arrays as a delta since the ``mark`` of the previous save, ``since`` (``delta``
    ``None``: save :meth:`arrays` whole)."""
    del since
    return None, None

  def restore(self, arrays: Mapping[str, np.ndarray]) -> tuple[Any, Commit | None]:
    """Checks ``arrays``; returns the object for this place afterwards, and the commit that changes it.

    Objects are changed in place by the commit (and returned as they are);
    values are returned anew (with no commit): whoever holds them replaces them.
    """
    if arrays:
      raise TypeError(f"expected no arrays (a {type(self.obj).__name__} has none), got {sorted(arrays)}.")
    return self.obj, None

  def replace(self, replaced: dict[str, Any]) -> tuple[Any, list[Commit]]:
    """Puts restored values in place of the children ``replaced`` (relative path -> new value).

    Returns the object for this place afterwards and the commits that do it.
    """
    raise TypeError(f"a {type(self.obj).__name__} cannot replace its children {sorted(replaced)}.")

  def defer(self, relative: str, new_queue: Callable[[], Any]) -> Any | None:
    """The queue of restores waiting for a child at ``relative`` to be attached, or ``None``."""
    del relative, new_queue
    return None

  def serving_copy(self, served: Served, copy_child: Callable[[Any], Any]) -> Any:
    """The object as a served signature reads it: each table as ``served(table)``, modules in
    inference mode, arrays shared (``copy_child``: the same for a child). The default: the object
    itself (arrays, and objects that keep their state to themselves)."""
    del served, copy_child
    return self.obj

  def serving_split(self, path: str, split_child: Callable[[Any, str], Split]) -> Split:
    """The arrays a served signature takes for this object, named from ``path`` (``split_child(child,
    path)``: the same for a child). The default: none, the object kept as it is."""
    del path, split_child
    return [], [], lambda leaves: self.obj


def flattened(state: Any, path: str, merge: Callable[[Any], Any] = lambda tree: tree) -> Split:
  """:meth:`Handle.serving_split` of a pytree of arrays (``merge``: the object rebuilt from it)."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(state)
  names = [_join(path, jax.tree_util.keystr(p, simple=True, separator="/")) for p, _ in flat]
  return [x for _, x in flat], names, lambda leaves: merge(jax.tree.unflatten(treedef, list(leaves)))


def composed(children: Mapping[str, Any], path: str, split_child, build: Callable[[dict], Any]) -> Split:
  """:meth:`Handle.serving_split` of an object made of ``children`` (name -> child):
  ``build({name: rebuilt child})`` makes it anew."""
  parts = {name: split_child(child, _join(path, name)) for name, child in children.items()}

  def rebuild(leaves):
    rebuilt, start = {}, 0
    for name, (part, _, rebuild_part) in parts.items():
      rebuilt[name] = rebuild_part(leaves[start : start + len(part)])
      start += len(part)
    return build(rebuilt)

  leaves = [x for part, _, _ in parts.values() for x in part]
  return leaves, [n for _, names, _ in parts.values() for n in names], rebuild


def _join(path: str, name: str) -> str:
  return f"{path}/{name}" if path and name else path or name


class TrackableHandle(Handle):
  """A :class:`jaxres.Trackable`: the object implements the protocol itself."""

  def __init__(self, obj: Trackable):
    super().__init__(obj)
    self.kind = obj._checkpoint_kind
    self._names: dict[str, str] = {}

  def children(self) -> dict[str, Any]:
    named = {(name,): child for name, child in self.obj._trackable_children().items()}
    children = paths.by_relative(named)
    self._names.update(zip(children, (name for (name,) in named)))
    return children

  def arrays(self) -> Mapping[str, Any]:
    return self.obj._serialize_to_arrays()

  def changes(self, since):
    return self.obj._serialize_changes_to_arrays(since)

  def holds_values(self) -> bool:
    return self.obj._holds_arrays()

  def restore(self, arrays):
    return self.obj, self.obj._prepare_restore(arrays)

  def replace(self, replaced):
    current = self.obj._trackable_children()
    commits = []
    for relative, new in replaced.items():
      name = self._name(relative)
      commits.append(setting(functools.partial(self._put, relative, name), current[name], new))
    return self.obj, commits

  def _put(self, relative: str, name: str, value: Any) -> None:
    try:
      self.obj._replace_trackable_child(name, value)
    except Exception as err:
      raise errors.at_path(relative, err) from err

  def defer(self, relative, new_queue):
    return self.obj._defer_restore(self._name(relative), new_queue)

  def _name(self, relative: str) -> str:
    return self._names.get(relative) or paths.unescape(relative)


class TableHandle(Handle):
  """A functional table: a value saved as its live entries (:mod:`table_arrays`), restored as a new table."""

  kind = table_arrays.KIND
  shared = False
  takes_parts = True

  def arrays(self):
    return table_arrays.to_arrays(self.obj)

  def changes(self, since):
    return table_arrays.changes(self.obj, since)

  def holds_values(self) -> bool:
    return True

  def restore(self, arrays):
    return table_arrays.from_arrays(self.obj, arrays), None

  def serving_copy(self, served, copy_child):
    return served(self.obj)

  def serving_split(self, path, split_child):
    return flattened(self.obj, path)


class ArrayHandle(Handle):
  """A JAX or NumPy array (or NumPy scalar): restored as a new array of the same type and placement."""

  kind = "array"
  shared = False

  def arrays(self):
    return {"value": self.obj}

  def holds_values(self) -> bool:
    return True

  def restore(self, arrays):
    if sorted(arrays) != ["value"]:
      raise TypeError(f"expected one array (an array was saved here), got {sorted(arrays)}.")
    return _like(self.obj, arrays["value"], "value"), None

  def serving_split(self, path, split_child):
    return flattened(self.obj, path)


class PytreeHandle(Handle):
  """Any other pytree whose leaves are all arrays (named tuples, registered dataclasses, optax states)."""

  kind = "pytree"
  shared = False

  def arrays(self):
    return dict(zip(leaf_names(self.obj, "value"), jax.tree.leaves(self.obj)))

  def holds_values(self) -> bool:
    return True

  def restore(self, arrays):
    leaves, treedef = jax.tree.flatten(self.obj)
    names = leaf_names(self.obj, "value")
    if sorted(arrays) != sorted(names):
      raise TypeError(f"expected the arrays {names} of a {type(self.obj).__name__}, got {sorted(arrays)}.")
    return jax.tree.unflatten(treedef, [_like(old, arrays[n], n) for old, n in zip(leaves, names)]), None


class ContainerHandle(Handle):
  """A list or dict of checkpointable objects: its items are children, replaced in place."""

  strict = True

  def __init__(self, obj: list | dict):
    super().__init__(obj)
    self.kind = type(obj).__name__
    self._keys = _item_keys(obj)

  def children(self):
    return {relative: self.obj[key] for relative, key in self._keys.items()}

  def replace(self, replaced):
    keys = [self._keys[relative] for relative in replaced]
    return self.obj, [
      setting(functools.partial(self.obj.__setitem__, key), self.obj[key], new)
      for key, new in zip(keys, replaced.values())
    ]

  def serving_copy(self, served, copy_child):
    return self._made_of([copy_child(self.obj[key]) for key in self._indices()])

  def serving_split(self, path, split_child):
    children = {str(key): self.obj[key] for key in self._indices()}  # distinct: _item_keys checked
    return composed(children, path, split_child, lambda rebuilt: self._made_of(list(rebuilt.values())))

  def _indices(self) -> list:
    return list(self.obj) if isinstance(self.obj, dict) else list(range(len(self.obj)))

  def _made_of(self, items: list) -> list | dict:
    """A new container of this one's kind holding ``items`` in its order."""
    return dict(zip(self._indices(), items, strict=True)) if isinstance(self.obj, dict) else items


class TupleHandle(Handle):
  """A tuple of checkpointable objects: immutable, so a restored item makes a new tuple."""

  kind = "tuple"
  shared = False
  strict = True

  def children(self):
    return {str(i): item for i, item in enumerate(self.obj)}

  def replace(self, replaced):
    return tuple(replaced.get(str(i), item) for i, item in enumerate(self.obj)), []

  def serving_copy(self, served, copy_child):
    return tuple(copy_child(item) for item in self.obj)

  def serving_split(self, path, split_child):
    return composed(self.children(), path, split_child, lambda rebuilt: tuple(rebuilt.values()))


class AutoTrackableHandle(TrackableHandle):
  """A :class:`jaxres.AutoTrackable`: served as a copy (its type and methods) holding its children served."""

  def serving_copy(self, served, copy_child):
    return self._with({name: copy_child(child) for name, child in self.obj._trackable_children().items()})

  def serving_split(self, path, split_child):
    return composed(self.obj._trackable_children(), path, split_child, self._with)

  def _with(self, children: dict[str, Any]) -> AutoTrackable:
    copied = copy.copy(self.obj)
    for name, child in children.items():
      copied._replace_trackable_child(name, child)
    return copied


def handle_for(obj: Any, *, containers: bool = True, _within: frozenset = frozenset()) -> Handle | None:
  """The handle of ``obj``, or ``None`` when it is not part of the graph.

  With ``containers=False`` lists, tuples and dicts of arrays are one pytree
  value (as inside an ``nnx.Variable``) rather than containers of children.

  Raises:
    TypeError: ``obj`` mixes arrays with what cannot be checkpointed (a pytree
      with a float leaf, or a trackable inside a pytree that is no container).

  (``_within``: the containers being examined around ``obj``; a container
  holding itself is not content on its own account.)
  """
  handle = _registered(obj)
  if handle is not None:
    return handle
  if containers and type(obj) in CONTAINERS:
    within = _within | {id(obj)}
    items = obj.values() if isinstance(obj, dict) else obj
    if not any(id(item) not in within and _is_content(item, within) for item in items):
      return None
    return TupleHandle(obj) if isinstance(obj, tuple) else ContainerHandle(obj)
  special = [x for x in jax.tree.leaves(obj, is_leaf=_is_special) if x is not obj and _is_special(x)]
  if special:
    raise TypeError(
      f"a {type(obj).__name__} holding a {type(special[0]).__name__} cannot be checkpointed; "
      "hold trackables, tables and modules in lists, tuples or dicts."
    )
  leaves = jax.tree.leaves(obj)
  arrays = [isinstance(x, ARRAY_TYPES) for x in leaves]
  if not any(arrays) or (len(leaves) == 1 and leaves[0] is obj):
    return None
  if not all(arrays):
    other = next(x for x, is_array in zip(leaves, arrays) if not is_array)
    raise TypeError(f"a {type(obj).__name__} of arrays and {type(other).__name__}s cannot be checkpointed.")
  return PytreeHandle(obj)


def _is_special(x: Any) -> bool:
  """Objects with handles of their own (arrays aside), which a generic pytree must not take apart."""
  return _has_handle(type(x)) and not isinstance(x, ARRAY_TYPES)


def _is_content(item: Any, within: frozenset) -> bool:
  try:
    return handle_for(item, _within=within) is not None
  except TypeError:
    return True  # checkpointable in part: the item's own path will name the problem


def _item_keys(obj: list | dict) -> dict[str, Any]:
  """Relative path -> list index or dict key."""
  if isinstance(obj, list):
    return {str(i): i for i in range(len(obj))}
  keys = {}
  for key in obj:
    if isinstance(key, bool) or not isinstance(key, (str, int)) or key == "":
      raise TypeError(f"dict keys must be non-empty str or int to be checkpointed, got {key!r}.")
    relative = paths.escape(str(key))
    if relative in keys:
      raise TypeError(f"dict keys {keys[relative]!r} and {key!r} have the same name {str(key)!r}.")
    keys[relative] = key
  return keys


def setting(set_value: Callable[[Any], None], old: Any, new: Any) -> Commit:
  """The commit that calls ``set_value(new)``; its undo calls ``set_value(old)``."""

  def commit():
    set_value(new)
    return lambda: set_value(old)

  return commit


def _like(old: Any, saved: np.ndarray, name: str) -> Any:
  """``saved`` as an array like ``old``: same shape and dtype (checked), type and placement."""
  saved = np.asarray(saved)
  dtype = np.dtype(getattr(old, "dtype", None) or np.asarray(old).dtype)
  if saved.shape != np.shape(old) or saved.dtype != dtype:
    raise ValueError(
      f"{name}: the checkpoint holds {saved.dtype}{list(saved.shape)}, "
      f"the object is {dtype}{list(np.shape(old))}."
    )
  if isinstance(old, jax.Array):
    return jax.device_put(saved, old.sharding if old.committed else None)
  if isinstance(old, np.generic):
    return saved[()]
  return np.array(saved)


register(Trackable, TrackableHandle)
register(AutoTrackable, AutoTrackableHandle)
register(Table, TableHandle)
for _array_type in (*ARRAY_TYPES, Tracer):  # a traced array (a served signature's state) too
  register(_array_type, ArrayHandle)
