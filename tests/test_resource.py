"""jr.Resource lifecycle and jr.ResourceManager sharing (seeds 000 and 003)."""

import gc
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxres as jr


class DemoResource(jr.Resource):
  """The seed's DemoResource: a 2-vector, zeros on creation, ones once initialized."""

  def __init__(self, log=None, device=None):
    super().__init__(device=device)
    self.log = [] if log is None else log

  def _create_resource(self):
    self.log.append("create")
    return jnp.zeros(2)

  def _initialize(self):
    self.log.append("initialize")
    self.state = jnp.ones(2)

  def _destroy_resource(self):
    self.log.append("destroy")


class DemoModule(jr.AutoTrackable):
  def __init__(self):  # deliberately no super().__init__()
    self.resource = DemoResource()

  def increment(self, x):
    return x + self.resource.state


def test_seed_demo_module():
  demo = DemoModule()
  assert demo.increment(jnp.array([5.0, 1.0])).tolist() == [6.0, 2.0]
  assert list(demo._trackable_children()) == ["resource"]
  assert jax.jit(demo.increment)(jnp.array([1.0, 1.0])).tolist() == [2.0, 2.0]


def test_lifecycle_runs_each_step_once_in_order():
  log = []
  r = DemoResource(log)
  assert log == [] and not r.created  # lazy
  assert r.state.tolist() == [1.0, 1.0]
  r.state = r.state + 1
  assert r.state.tolist() == [2.0, 2.0]
  assert log == ["create", "initialize"]
  r.destroy()
  r.destroy()
  assert log == ["create", "initialize", "destroy"]
  with pytest.raises(ValueError, match="destroyed"):
    r.state  # noqa: B018


def test_destroyed_exactly_once_at_garbage_collection():
  log = []
  r = DemoResource(log)
  r.state  # noqa: B018
  ref = weakref.ref(r)
  del r
  gc.collect()
  assert ref() is None and log.count("destroy") == 1
  never_created = []
  DemoResource(never_created)
  gc.collect()
  assert never_created == []


def test_resource_in_nnx_jit_persists_and_is_destroyed_once():
  log = []

  class Model(nnx.Module):
    def __init__(self):
      self.counter = DemoResource(log)

  model = Model()
  model.counter.state  # noqa: B018  (create eagerly)
  traces = []

  @nnx.jit
  def step(model, x):
    traces.append(1)
    model.counter.state = model.counter.state + x
    return model.counter.state

  step(model, jnp.ones(2))
  assert step(model, jnp.ones(2)).tolist() == [3.0, 3.0]
  assert model.counter.state.tolist() == [3.0, 3.0] and len(traces) == 1
  gc.collect()
  assert "destroy" not in log  # NNX's temporary copies do not destroy the state
  del model
  gc.collect()
  assert log.count("destroy") == 1


def test_device_placement():
  device = jax.devices()[-1]
  r = DemoResource(device=device)
  assert r.state.devices() == {device}
  r.state = np.arange(2.0)
  assert r.state.devices() == {device}
  sharding = jax.sharding.SingleDeviceSharding(device)
  assert DemoResource(device=sharding).state.sharding == sharding
  with pytest.raises(TypeError, match="device"):
    DemoResource(device="gpu:0")


def test_missing_create_and_missing_super_init():
  class NoCreate(jr.Resource):
    pass

  with pytest.raises(TypeError, match="_create_resource"):
    NoCreate().state  # noqa: B018

  class NoSuper(jr.Resource):
    def __init__(self):
      pass

    def _create_resource(self):
      return jnp.zeros(1)

  with pytest.raises(TypeError, match="super"):
    NoSuper().state  # noqa: B018


def test_manager_shares_by_container_and_name():
  mgr = jr.ResourceManager()
  a = mgr.lookup_or_create("", "table", DemoResource)
  assert mgr.lookup_or_create("", "table", DemoResource) is a
  assert mgr.lookup("", "table") is a
  assert mgr.lookup_or_create("other", "table", DemoResource) is not a
  assert mgr.lookup_or_create("", "", DemoResource) is not mgr.lookup_or_create("", "", DemoResource)
  assert mgr.names("") == ["table"]
  with pytest.raises(KeyError):
    mgr.lookup("", "missing")
  mgr.delete("", "table")
  with pytest.raises(KeyError):
    mgr.lookup("", "table")
  with pytest.raises(KeyError):
    mgr.delete("", "table")
  with pytest.raises(TypeError, match="shared_name"):
    mgr.lookup_or_create("", None, DemoResource)


def test_manager_verify_fn_rejects_incompatible_requests():
  mgr = jr.ResourceManager()
  table = mgr.lookup_or_create("", "t", lambda: jr.OpenAddressingTable)  # a class: weakly referenceable

  def verify(existing):
    if existing is not table:
      raise ValueError("incompatible")

  assert mgr.lookup_or_create("", "t", lambda: None, verify) is table

  def reject(existing):
    raise ValueError("capacity differs")

  with pytest.raises(ValueError, match="capacity differs"):
    mgr.lookup_or_create("", "t", lambda: None, reject)
  with pytest.raises(TypeError, match="weakly"):
    mgr.lookup_or_create("", "n", lambda: 3)


def test_manager_entries_are_weak():
  mgr = jr.ResourceManager()
  r = mgr.lookup_or_create("c", "r", DemoResource)
  del r
  gc.collect()
  with pytest.raises(KeyError):
    mgr.lookup("c", "r")
  assert mgr.names("c") == []


def test_manager_race_creates_exactly_one():
  mgr = jr.ResourceManager()
  created, results = [], []
  barrier = threading.Barrier(8)

  def create():
    created.append(1)
    return DemoResource()

  def worker():
    barrier.wait()
    for _ in range(50):
      results.append(mgr.lookup_or_create("", "shared", create))

  threads = [threading.Thread(target=worker) for _ in range(8)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert len(created) == 1 and len({id(r) for r in results}) == 1
