"""Resources: state pytrees with a create / initialize / destroy lifecycle."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxres._core.pytrees import leaf_names
from jaxres._shell.donation import TableVariable
from jaxres._shell.trackable import Commit, Trackable


class ResourceState(TableVariable):
  """The state pytree of a :class:`Resource`; ``nnx.jit`` traces and updates it (donate it: see
  :class:`jaxres.TableCopyWarning`)."""


class _Lifecycle:
  """Creation and destruction flags and the lock of one resource object."""

  def __init__(self, created: bool = False):
    self.lock = threading.RLock()
    self.created = created
    self.destroyed = False
    self.owner: int | None = None
    self.known = None  # what the resource's own last update knows of the state it made (subclasses)
    self.epoch = object()  # new whenever the state is rebuilt, not derived (subclasses: see LookupTable)


# id(resource) -> its lifecycle. Kept out of the object's attributes: NNX keys
# compiled functions by a module's attributes and, on a cache hit, copies the
# cached module's static attributes onto the one passed in, so an attribute
# with an identity would be swapped between resources. Entries go in
# ``__del__``.
_LIFECYCLES: dict[int, _Lifecycle] = {}


class Resource(Trackable, nnx.Module):
  """A stateful resource, the analogue of TensorFlow's ``TrackableResource``.

  Subclasses override ``_create_resource`` (returns the initial state pytree),
  and optionally ``_initialize`` (runs once, right after creation) and
  ``_destroy_resource`` (runs once, on :meth:`destroy` or when the resource
  is garbage collected). The state is created lazily on first access of
  :attr:`state`. A resource held by an ``nnx.Module`` is traced by
  ``nnx.jit``, and state assigned inside the jitted call persists after it.
  Checkpoints store the state's leaves (``state``, or ``state/<key path>``).

  Args:
    device: optional ``jax.Device`` or ``jax.sharding.Sharding``; the state
      is placed there on creation and on every assignment.

  Examples:
    >>> import jax.numpy as jnp, jaxres as jr
    >>> class DemoResource(jr.Resource):
    ...   def _create_resource(self):
    ...     return jnp.zeros(2)
    ...   def _initialize(self):
    ...     self.state = jnp.ones(2)
    >>> class DemoModule(jr.AutoTrackable):
    ...   def __init__(self):  # need not call super().__init__()
    ...     self.resource = DemoResource()
    ...   def increment(self, x):
    ...     return x + self.resource.state
    >>> DemoModule().increment(jnp.array([5.0, 1.0])).tolist()
    [6.0, 2.0]
  """

  def __init__(self, device=None):
    if device is not None and not isinstance(device, (jax.Device, jax.sharding.Sharding)):
      raise TypeError(f"device: expected a jax.Device or jax.sharding.Sharding, got {device!r}.")
    self._device = device
    _LIFECYCLES[id(self)] = _Lifecycle()

  def _life(self) -> _Lifecycle:
    life = _LIFECYCLES.get(id(self))
    if life is None:
      if "_device" not in vars(self):
        raise TypeError(f"{type(self).__name__}.__init__ must call super().__init__() (jr.Resource).")
      # A copy made by an NNX transform: it shares the state, never owns it.
      life = _LIFECYCLES.setdefault(id(self), _Lifecycle(created="_cell" in vars(self)))
    return life

  @property
  def device(self):
    """The device or sharding the state lives on (``None``: JAX's default)."""
    return self._device

  @property
  def created(self) -> bool:
    """Whether the state has been created."""
    return self._life().created

  @property
  def state(self) -> Any:
    """The current state pytree, created (and initialized) on first access.

    Raises:
      ValueError: the resource was destroyed.
    """
    life = self._life()
    with life.lock:
      if life.destroyed:
        raise ValueError(f"{type(self).__name__}: the resource was destroyed; create a new one.")
      if not life.created:
        self._cell = ResourceState(self._place(self._create_resource()), label=f"a {type(self).__name__}")
        life.created, life.owner = True, id(self)
        self._initialize()
      return self._cell.get_value()

  @state.setter
  def state(self, value: Any) -> None:
    with self._life().lock:
      self.state  # noqa: B018  (creates and initializes first)
      self._check_state(value)
      self._cell.set_value(self._place(value))

  def _replace_state(self, value: Any) -> None:
    """Makes ``value`` the state: the result of this resource's own update of its state (already
    checked and placed), so none of the setter's checks run. Call it holding the lock."""
    self._cell.set_value(value)

  def __setattr__(self, name: str, value: Any) -> None:
    # NNX vets attribute values before Python's descriptors run; `state` is
    # ours to store (in a ResourceState variable), whatever pytree it holds.
    if name == "state":
      type(self).state.fset(self, value)
    else:
      super().__setattr__(name, value)

  def destroy(self) -> None:
    """Runs ``_destroy_resource`` (once) and releases the state."""
    life = self._life()
    with life.lock:
      if life.destroyed:
        return
      life.destroyed = True
      if life.created:
        self._destroy_resource()
        vars(self).pop("_cell", None)

  def __del__(self):
    if _LIFECYCLES is None:  # interpreter shutdown: module globals are gone
      return
    life = _LIFECYCLES.get(id(self))
    try:
      if life is not None and life.owner == id(self) and not life.destroyed:
        self.destroy()
    finally:
      _LIFECYCLES.pop(id(self), None)

  # -------------------------------------------------------- checkpoints

  _checkpoint_kind = "resource"

  def _serialize_to_arrays(self) -> dict[str, Any]:
    # Copies taken under the lock: a writer's update may donate the state it replaces.
    with self._life().lock:
      state = self.state
      return dict(zip(leaf_names(state, "state"), (jnp.copy(x) for x in jax.tree.leaves(state))))

  def _restore_from_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
    """Makes the saved leaves the state, every one checked before the state changes."""
    current = self.state
    names = leaf_names(current, "state")
    if sorted(arrays) != sorted(names):
      raise TypeError(f"expected the arrays {names} of this resource's state, got {sorted(arrays)}.")
    leaves = []
    for name, old in zip(names, jax.tree.leaves(current)):
      new, old = np.asarray(arrays[name]), np.asarray(old)
      if new.shape != old.shape or new.dtype != old.dtype:
        raise ValueError(
          f"{name}: the checkpoint holds {new.dtype}{list(new.shape)}, "
          f"the state {old.dtype}{list(old.shape)}."
        )
      leaves.append(jnp.asarray(new))
    self.state = jax.tree.unflatten(jax.tree.structure(current), leaves)

  def _holds_arrays(self) -> bool:
    return True  # its state (without reading it back)

  def _prepare_restore(self, arrays: Mapping[str, np.ndarray]) -> Commit:
    """Restores through :meth:`_restore_from_arrays` (this class's, or a subclass's own) at commit;
    the undo puts the state from before back. A resource's state is an immutable pytree, so
    keeping the old one costs nothing."""

    def commit():
      with self._life().lock:
        old = self.state
      self._restore_from_arrays(arrays)
      return lambda: setattr(self, "state", old)

    return commit

  def _check_state(self, state) -> None:
    """Raises ``TypeError`` for a state this resource cannot hold (a pytree of arrays here)."""
    for leaf in jax.tree.leaves(state):
      if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, bool, int, float, complex)):
        raise TypeError(f"state: expected a pytree of arrays, got a leaf {leaf!r}.")

  def _place(self, state):
    return state if self._device is None else jax.device_put(state, self._device)

  def _create_resource(self) -> Any:
    """Returns the initial state pytree; subclasses must override it."""
    raise TypeError(f"{type(self).__name__} must define _create_resource() (jr.Resource).")

  def _initialize(self) -> None:
    """Runs once after creation; may assign ``self.state``."""

  def _destroy_resource(self) -> None:
    """Runs once when the resource is destroyed or garbage collected."""
