"""jr.saved_model: exported signatures served in fresh processes without the model's code; inference mode.

Each served program runs in a child process that cannot import this module
(where the models are defined): its outputs must equal, bit for bit, those of
the original function on the original object in inference mode.
"""

import collections
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from children import HANG_GUARD_S
from flax import nnx
from oracle import mesh_of, same_bits
from tower import ADAM, FEATURES, IDS, Model, predict, train_step

import jaxres as jr

BLOCKER = """
import importlib.abc, sys
class _Refuse(importlib.abc.MetaPathFinder):
  def __init__(self, names): self.names = names
  def find_spec(self, name, path=None, target=None):
    if name.split(".")[0] in self.names:
      raise ImportError(f"{name} is blocked in this process")
    return None
sys.meta_path.insert(0, _Refuse(set(sys.argv[1].split(","))))
"""
SERVE_JAXRES = (
  BLOCKER
  + """
import numpy as np, jaxres as jr
served = jr.saved_model.load(sys.argv[2])
inputs = dict(np.load(sys.argv[3], allow_pickle=False))
inputs = {k: (v.astype(object) if v.dtype.kind == "U" else v) for k, v in inputs.items()}
out = served.signatures[sys.argv[5]](**inputs)
np.savez(sys.argv[4], **{k: np.asarray(v) for k, v in out.items()})
"""
)
SERVE_TF = (
  BLOCKER
  + """
import numpy as np, tensorflow as tf
loaded = tf.saved_model.load(sys.argv[2])
inputs = {k: tf.constant(v) for k, v in dict(np.load(sys.argv[3], allow_pickle=False)).items()}
out = loaded.signatures[sys.argv[5]](**inputs)
np.savez(sys.argv[4], **{k: v.numpy() for k, v in out.items()})
"""
)


def _pool(n=300):
  return (np.arange(n, dtype=np.int64) * 7919 + 2**40) * np.where(np.arange(n) % 2, 1, -1)


def _trained(model=None, steps=6, seed=0):
  model = Model() if model is None else model
  optimizer = nnx.Optimizer(model, ADAM, wrt=nnx.Param)
  rng = np.random.default_rng(seed)
  for _ in range(steps):
    ids = rng.choice(_pool(), (32, 2))
    train_step(model, optimizer, jr.keys.split64(ids), jnp.asarray(rng.normal(size=32), jnp.float32))
  return model


def _serve(path, name, inputs, tmp_path, script=SERVE_JAXRES, block=(__name__, "oracle", "tower")):
  """Runs signature ``name`` of the saved model at ``path`` in a fresh process; its outputs."""
  data, out = tmp_path / "inputs.npz", tmp_path / "outputs.npz"
  np.savez(data, **inputs)
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
  command = [sys.executable, "-c", script, ",".join(block), str(path), str(data), str(out), name]
  done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=HANG_GUARD_S)
  assert done.returncode == 0, done.stderr[-3000:]
  return dict(np.load(out))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  model = _trained()
  path = tmp_path_factory.mktemp("export") / "model"
  jr.saved_model.save(model, path, {"serving_default": jr.saved_model.Signature(predict, ids=IDS)})
  return model, path


def test_inference_mode_changes_nothing():
  model = _trained(Model(capacity=16, min_count=2))
  before = [np.asarray(x).copy() for x in jax.tree.leaves(nnx.state(model))]
  stats = model.emb.stats()
  model.eval()
  assert model.emb.deterministic
  unseen = np.arange(10, 40, dtype=np.int64).reshape(-1, 2)
  rows = model.emb(unseen)
  assert not np.asarray(rows).any()  # ids without a row read zeros
  nnx.jit(lambda m, ids: m(ids))(model, jr.keys.split64(np.concatenate([unseen, _pool()[:8].reshape(-1, 2)])))
  after = [np.asarray(x) for x in jax.tree.leaves(nnx.state(model))]
  assert all(a.tobytes() == b.tobytes() for a, b in zip(before, after))
  assert model.emb.stats() == stats
  with pytest.raises(ValueError, match="inference mode"):
    model.emb.apply_gradients(unseen, np.ones((*unseen.shape, FEATURES), np.float32))
  model.train()
  assert not model.emb.deterministic
  model.emb(unseen)
  assert model.emb.stats() != stats  # training mode inserts again


def test_saving_leaves_the_object_as_it_was(tmp_path):
  """Exporting swaps tables for their read-only form in a copy, never in the object saved."""
  model = _trained()
  before = jax.tree.leaves(nnx.state(model))
  jr.saved_model.save(model, tmp_path / "m", {"serving_default": jr.saved_model.Signature(predict, ids=IDS)})
  assert type(model.emb.table.get_value()) is jr.OpenAddressingTable
  after = jax.tree.leaves(nnx.state(model))
  assert len(before) == len(after) and all(a is b for a, b in zip(before, after))
  assert not model.emb.deterministic  # still in training mode


def test_saving_keeps_the_programs_the_process_has_traced(tmp_path):
  """Exporting traces the XLA references (no kernel) as programs of their own: a function jitted and
  called before the save is not traced again after it (the save once cleared JAX's caches)."""
  traces = []

  @jax.jit
  def find(table, words):
    traces.append(words.shape)
    return table.find(words)

  table = jr.OpenAddressingTable.create(64, key=jnp.int64, value=jnp.float32)
  words = jr.keys.split64(np.arange(4))
  before = find(table, words)
  signatures = {"serving_default": jr.saved_model.Signature(predict, ids=IDS)}
  jr.saved_model.save(_trained(), tmp_path / "m", signatures)
  same_bits(find(table, words), before)
  assert traces == [words.shape]


def test_served_outputs_equal_the_function_bitwise(exported, tmp_path):
  model, path = exported
  served = jr.saved_model.load(path)
  assert served.signatures["serving_default"].inputs == {"ids": IDS}
  model.eval()
  rng = np.random.default_rng(1)
  for batch in (1, 7, 4096):
    ids = np.where(
      rng.random((batch, 2)) < 0.7, rng.choice(_pool(), (batch, 2)), rng.integers(-(2**62), 2**62, (batch, 2))
    )
    expected = nnx.jit(predict)(model, jr.keys.split64(ids))
    for got in (
      served.signatures["serving_default"](ids=ids),
      _serve(path, "serving_default", {"ids": ids}, tmp_path),
    ):
      assert sorted(got) == ["rows", "score"]
      for name in got:
        same_bits(got[name], expected[name])
  assert np.asarray(expected["rows"]).any() and np.abs(ids).max() > 2**32
  model.train()


def test_the_serving_state_holds_rows_only(exported):
  model, path = exported
  manifest = json.loads((path / "saved_model.json").read_text())
  live = model.emb.size()
  shapes = [tuple(entry["shape"]) for entry in manifest["state"]]
  assert (live, FEATURES) in shapes  # the rows of the live ids, exactly
  wide = [s for s in shapes if len(s) == 2 and s[1] == FEATURES]
  assert wide == [(live, FEATURES)]  # no optimizer slots (mu, nu)
  state_bytes = sum((path / "state" / f"{i}.npy").stat().st_size for i in range(len(shapes)))
  checkpoint_bytes = sum(f.stat().st_size for f in (path / "variables").rglob("*") if f.is_file())
  assert state_bytes < checkpoint_bytes / 2


def test_variables_are_the_training_checkpoint(exported):
  model, path = exported
  fresh = Model()
  jr.Checkpoint(model=fresh).restore(path / "variables").assert_consumed()
  same_bits(fresh.emb.export()[1], model.emb.export()[1])


def test_strings_in_and_int64_out(tmp_path):
  words = ["apple", "banana", "kiwi", "mango", "fig"]
  vocab = jr.StaticVocabularyTable(jr.KeyValueInitializer(words, np.arange(5, dtype=np.int64) + 2**40), 3)
  spec = jax.ShapeDtypeStruct(("n",), str)
  sig = jr.saved_model.Signature(lambda v, word: {"id": v.find(word)}, word=spec)
  jr.saved_model.save(vocab, tmp_path / "vocab", {"ids": sig})
  queries = np.array(["kiwi", "zzz", "apple", "Äpfel"])
  got = _serve(tmp_path / "vocab", "ids", {"word": queries}, tmp_path)["id"]
  expected = jax.jit(lambda w: vocab.find(w))(jr.keys.encode_strings(queries.tolist(), 64))
  same_bits(got, expected)
  assert jr.keys.join64(got, np.int64).tolist()[0] == 2**40 + 2
  loaded = jr.saved_model.load(tmp_path / "vocab").signatures["ids"]
  with pytest.raises(TypeError, match="word"):
    loaded(word=np.array([1, 2]))
  with pytest.raises(ValueError, match="word"):
    loaded(word=np.array(["x" * 65]))


def test_an_autotrackable_of_tables_and_arrays(tmp_path):
  """Whatever jr.Checkpoint saves: here an AutoTrackable holding a stateful table, a functional
  table in a dict and an array, its type (and methods) kept for the signature."""

  class Root(jr.AutoTrackable):
    def score(self, ids):
      return self.table.find(ids) * self.scale + self.parts["bias"].find(ids)

  root = Root()
  root.table = jr.MutableHashTable(np.int64, np.float32, default_value=-1.0)
  root.table.insert(np.array([5, 2**40]), np.array([1.5, 2.5], np.float32))
  bias = jr.OpenAddressingTable.create(64, key=jnp.int64, value=jnp.float32, default=0.0)
  root.parts = {"bias": bias.insert(jr.keys.split64(np.array([5])), jnp.array([0.25]))}
  root.scale = jnp.array(2.0)
  assert _served_scores(root, np.array([5, 2**40, 7]), tmp_path).tolist() == [3.25, 5.0, -2.0]
  assert len(root.table) == 2  # the object itself is untouched


def _served_scores(root, ids, tmp_path):
  """``root.score`` exported (64-bit ids of any count) and served in another process: its answers to
  ``ids``, checked bit for bit against the function run here."""
  spec = jax.ShapeDtypeStruct(("n",), jnp.int64)
  signature = jr.saved_model.Signature(type(root).score, ids=spec)
  jr.saved_model.save(root, tmp_path / "root", {"score": signature})
  got = _serve(tmp_path / "root", "score", {"ids": ids}, tmp_path)["output"]
  same_bits(got, jax.jit(root.score)(jr.keys.split64(ids)))
  return got


Stats = collections.namedtuple("Stats", "mean scale")


def test_every_kind_checkpoints_hold_is_served_as_its_handle_says(tmp_path):
  """Serving walks the graph through the tracking layer's handles, as checkpoints do: a named
  tuple of arrays (a pytree value; the isinstance walk before took it for a tuple of children and
  could not rebuild it), a jr.Resource in a tuple (served as an NNX module: read-only, inference
  mode), a functional table in a list, all below an AutoTrackable subclass."""

  class Root(jr.AutoTrackable):
    def score(self, ids):
      (counts,) = self.held
      return (counts.find(ids) + self.tables[0].find(ids) - self.stats.mean) * self.stats.scale

  root = Root()
  root.stats = Stats(jnp.array(0.5), np.float32(4.0))
  counts = jr.MutableHashTable(np.int64, np.float32, default_value=0.0)
  counts.insert(np.array([3, 2**41]), np.array([1.0, 2.0], np.float32))
  root.held = (counts,)
  table = jr.OpenAddressingTable.create(64, key=jnp.int64, value=jnp.float32, default=0.0)
  root.tables = [table.insert(jr.keys.split64(np.array([3])), jnp.array([0.25]))]
  assert _served_scores(root, np.array([3, 2**41, 9]), tmp_path).tolist() == [3.0, 6.0, -2.0]
  assert len(counts) == 2 and root.stats.scale == 4.0  # the object itself is untouched


def test_a_sharded_table_is_served_unsharded(tmp_path):
  mesh = mesh_of(4)
  model = _trained(Model(capacity=256, mesh=mesh, axis="shard"))
  jr.saved_model.save(model, tmp_path / "m", {"serving_default": jr.saved_model.Signature(predict, ids=IDS)})
  ids = _pool()[:14].reshape(7, 2)
  model.eval()
  expected = jax.device_get(nnx.jit(predict)(model, jr.keys.split64(ids)))
  got = _serve(tmp_path / "m", "serving_default", {"ids": ids}, tmp_path)
  np.testing.assert_allclose(got["rows"], expected["rows"], rtol=0, atol=0)
  np.testing.assert_allclose(got["score"], expected["score"], rtol=1e-6)


def test_bad_signatures_are_refused_and_nothing_is_written(tmp_path):
  table = jr.MutableHashTable(np.int64, np.float32, default_value=-1.0)
  table.insert(np.array([1, 2]), np.ones(2, np.float32))
  spec = jax.ShapeDtypeStruct(("batch",), jnp.int64)

  def writes(t, ids):
    t.insert(ids, jnp.ones(ids.shape[:-1], jnp.float32))
    return t.find(ids)

  with pytest.raises(ValueError, match=r"'grow'.*changes"):
    jr.saved_model.save(table, tmp_path / "w", {"grow": jr.saved_model.Signature(writes, ids=spec)})
  with pytest.raises(TypeError, match="'text'"):
    jr.saved_model.save(
      table, tmp_path / "w", {"text": jr.saved_model.Signature(lambda t, ids: "no", ids=spec)}
    )
  with pytest.raises(TypeError, match="signatures"):
    jr.saved_model.save(table, tmp_path / "w", {"f": lambda t: t})
  with pytest.raises(TypeError, match="ids"):
    jr.saved_model.Signature(lambda t, ids: ids, ids=(3,))
  with pytest.raises(ValueError, match="platforms"):
    jr.saved_model.save(
      table, tmp_path / "w", {"f": jr.saved_model.Signature(lambda t, i: i, i=spec)}, platforms=("gpu9",)
    )
  with pytest.raises(ValueError, match="format"):
    jr.saved_model.save(
      table, tmp_path / "w", {"f": jr.saved_model.Signature(lambda t, i: i, i=spec)}, format="onnx"
    )
  assert not (tmp_path / "w").exists() and len(table) == 2


def test_damaged_or_foreign_directories_are_refused(exported, tmp_path):
  _, path = exported
  with pytest.raises(ValueError, match="not a jaxres saved model"):
    jr.saved_model.load(tmp_path)
  copies = {}
  for damage in ("manifest", "foreign", "version", "state bytes", "program"):
    copy = tmp_path / damage.replace(" ", "_")
    subprocess.run(["cp", "-r", str(path), str(copy)], check=True)
    copies[damage] = copy
  (copies["manifest"] / "saved_model.json").write_text("{not json")
  manifest = json.loads((path / "saved_model.json").read_text())
  (copies["foreign"] / "saved_model.json").write_text(json.dumps({**manifest, "format": "other"}))
  (copies["version"] / "saved_model.json").write_text(json.dumps({**manifest, "version": 99}))
  state = copies["state bytes"] / "state" / "0.npy"
  data = bytearray(state.read_bytes())
  data[-1] ^= 0xFF
  state.write_bytes(bytes(data))
  (copies["program"] / "programs" / "0.jaxexport").unlink()
  for copy in copies.values():
    with pytest.raises(ValueError, match=str(copy)):
      jr.saved_model.load(copy)


def test_the_tensorflow_savedmodel_serves_without_jax(exported, tmp_path):
  pytest.importorskip("tensorflow")
  model, _ = exported
  path = tmp_path / "tf"
  jr.saved_model.save(
    model, path, {"serving_default": jr.saved_model.Signature(predict, ids=IDS)}, format="tf"
  )
  ids = np.concatenate([_pool()[:10], np.array([3, 2**45])]).reshape(6, 2)
  model.eval()
  expected = jax.device_get(nnx.jit(predict)(model, jr.keys.split64(ids)))
  got = _serve(
    path, "serving_default", {"ids": ids}, tmp_path, SERVE_TF, ("jax", "jaxlib", "jaxres", __name__)
  )
  for name in ("rows", "score"):
    same_bits(got[name], expected[name])
  model.train()
  words = ["apple", "banana"]
  vocab = jr.StaticVocabularyTable(jr.KeyValueInitializer(words, np.array([4, 2**40], np.int64)), 2)
  sig = jr.saved_model.Signature(
    lambda v, w: {"id": v.find(w)}, max_length=16, w=jax.ShapeDtypeStruct(("n",), str)
  )
  jr.saved_model.save(vocab, tmp_path / "tfv", {"ids": sig}, format="tf")
  queries = np.array(["banana", "zz", "apple"])
  got = _serve(tmp_path / "tfv", "ids", {"w": queries}, tmp_path, SERVE_TF, ("jax", "jaxlib", "jaxres"))["id"]
  expected = jax.jit(vocab.find)(jr.keys.encode_strings(queries.tolist(), 16))
  same_bits(got, expected)


def test_the_loaded_signature_checks_its_inputs(exported):
  _, path = exported
  sig = jr.saved_model.load(path).signatures["serving_default"]
  with pytest.raises(TypeError, match="missing"):
    sig()
  with pytest.raises(TypeError, match="unknown"):
    sig(ids=np.zeros((1, 2), np.int64), other=1)
  with pytest.raises(TypeError, match="ids"):
    sig(ids=np.zeros((1, 2), np.float32))
  with pytest.raises(ValueError, match="ids"):
    sig(ids=np.zeros((1, 3), np.int64))
  assert sig(ids=np.zeros((0, 2), np.int64))["score"].shape == (0,)
  assert repr(sig).startswith("LoadedSignature('serving_default'")


_SERVE_WITH_X64 = """
import sys, numpy as np, jax, jaxres as jr
assert jax.config.jax_enable_x64
ids = np.array([5, 2**40, 7, -(2**62)], np.int64)
served = jr.saved_model.load(sys.argv[1]).signatures["score"](ids=ids)["output"]
root = jr.AutoTrackable()
root.table = jr.MutableHashTable(np.int64, np.float32, default_value=-1.0)
root.table.insert(ids[:2], np.array([1.5, 2.5], np.float32))
spec = jax.ShapeDtypeStruct(("n",), np.int64)
signature = jr.saved_model.Signature(lambda r, ids: r.table.find(ids), ids=spec)
jr.saved_model.save(root, sys.argv[2], {"score": signature})
print(np.asarray(served).tolist())
"""


def test_an_export_made_with_x64_off_serves_with_it_on_and_the_reverse_is_refused_by_name(tmp_path):
  """int64 inputs are traced as word pairs with jax_enable_x64 off: the export records it, so a process
  with it on serves the export as it was traced (the pairs split on the host); an export traced with
  int64 arrays cannot be served where JAX holds none: load names the signature, the input and the
  setting, before the first request."""
  ids = np.array([5, 2**40, 7, -(2**62)], np.int64)
  root = jr.AutoTrackable()
  root.table = jr.MutableHashTable(np.int64, np.float32, default_value=-1.0)
  root.table.insert(ids[:2], np.array([1.5, 2.5], np.float32))
  spec = jax.ShapeDtypeStruct(("n",), np.int64)
  signature = jr.saved_model.Signature(lambda r, ids: r.table.find(ids), ids=spec)
  jr.saved_model.save(root, tmp_path / "off", {"score": signature})
  expected = root.table.find(ids)
  env = {**os.environ, "JAX_ENABLE_X64": "1", "JAX_PLATFORMS": "cpu"}
  done = subprocess.run(
    [sys.executable, "-c", _SERVE_WITH_X64, str(tmp_path / "off"), str(tmp_path / "on")],
    env=env,
    capture_output=True,
    text=True,
    timeout=HANG_GUARD_S,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  assert json.loads(done.stdout.strip().splitlines()[-1]) == np.asarray(expected).tolist()
  with pytest.raises(ValueError, match="signature 'score', input 'ids': exported with jax_enable_x64 on"):
    jr.saved_model.load(tmp_path / "on")


def test_numpy_64_bit_state_is_exported_as_its_programs_take_it(tmp_path):
  """An object's NumPy float64/int64/uint64 arrays, x64 off: the programs take them as JAX converts
  them (32 bits); the export wrote them as they were and could never be loaded ("state 0 is
  float64[3]; its programs take float32[3]"). Served as the function computes them in this process."""
  root = jr.AutoTrackable()
  root.scale = np.array([0.1, 2.5, -3.0], np.float64)
  root.offset = np.array([7, -2, 2**40], np.int64)
  root.mask = np.array([1, 0, 1], np.uint64)

  def fn(r, x):
    return {"y": x * r.scale + r.offset, "m": jnp.add(r.mask, 1)}

  spec = jax.ShapeDtypeStruct((3,), jnp.float32)
  jr.saved_model.save(root, tmp_path / "export", {"f": jr.saved_model.Signature(fn, x=spec)})
  x = np.array([1.0, 2.0, 3.0], np.float32)
  served = jr.saved_model.load(tmp_path / "export").signatures["f"](x=x)
  expected = fn(root, jnp.asarray(x))  # eagerly: JAX converts the arrays as it does in the program
  for name in ("y", "m"):
    same_bits(served[name], expected[name])
