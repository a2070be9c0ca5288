"""Served signatures pad each request's batch to a few compiled batch sizes: no compile per size.

Requests of many sizes (empty, bucket edges, between them, above the largest)
must answer bit for bit as the original function on the batch as served
(padded with zero rows, in chunks of the largest size), and as it on the
unpadded batch up to float rounding (XLA may round a float op of one shape
differently from another's; rows gathered without arithmetic are exact); no
program may be compiled after load: counted with ``jax.monitoring``'s
backend-compile events (and, for TensorFlow, with the XLA modules it dumps).
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from oracle import compilations, same_bits
from tower import IDS, Model, predict

import jaxres as jr
from jaxres._serving import loaded

SIZES = (0, 1, 4, 5, 7, 16, 17, 40)  # batch sizes (1, 4, 16): edges, between, above the largest
BUCKETS = (1, 4, 16)


def _ids(rng, n):
  return rng.integers(-(2**40), 2**40, (n, 2)) * np.where(rng.random((n, 2)) < 0.5, 1, 3)


def _trained():
  model = Model(capacity=64)
  model.emb(_ids(np.random.default_rng(0), 30))  # rows for these ids
  return model


def scored(model, ids, valid, hot):
  """Several inputs on one batch: a mask, and multi-hot ids with a trailing hot dimension."""
  out = predict(model, ids)
  pooled = model.emb(hot).sum(-2)  # [batch, features]
  return {"score": jnp.where(valid, out["score"], -1.0), "rows": out["rows"], "pooled": pooled}


VALID = jax.ShapeDtypeStruct(("batch",), bool)
SCORED = jr.saved_model.Signature(
  scored, ids=IDS, valid=VALID, hot=jax.ShapeDtypeStruct(("batch", 3), jnp.int64)
)


def _request(rng, n, known):
  ids = np.where(rng.random((n, 2)) < 0.7, rng.choice(known, (n, 2)), _ids(rng, n))
  hot = np.where(rng.random((n, 3)) < 0.7, rng.choice(known, (n, 3)), _ids(rng, n).repeat(2, 1)[:, :3])
  return {"ids": ids, "valid": rng.random(n) < 0.8, "hot": hot}


def _as_served(inputs, sizes):
  """The request as the served programs run it: chunks of the largest of ``sizes``, each padded with
  zero rows to the smallest size that holds it; with each chunk's count of real rows."""
  n, largest = len(inputs["ids"]), sizes[-1]
  chunks = []
  for start in range(0, max(n, 1), largest):
    part = {k: v[start : start + largest] for k, v in inputs.items()}
    rows = len(part["ids"])
    size = min(b for b in sizes if b >= rows)
    chunks.append(
      (
        {k: np.concatenate([v, np.zeros((size - rows, *v.shape[1:]), v.dtype)]) for k, v in part.items()},
        rows,
      )
    )
  return chunks


def _expected(model, inputs, sizes=None):
  """The original function on the request: unpadded (``sizes=None``), or as served with batch
  ``sizes`` (each chunk padded, the results cut back and joined)."""
  chunks = _as_served(inputs, sizes) if sizes else [(inputs, len(inputs["ids"]))]
  model.eval()
  try:
    outs = []
    for chunk, rows in chunks:
      traced = {k: jr.keys.split64(v) if v.dtype == np.int64 else v for k, v in chunk.items()}
      outs.append({k: v[:rows] for k, v in jax.device_get(nnx.jit(scored)(model, **traced)).items()})
  finally:
    model.train()
  return {k: np.concatenate([o[k] for o in outs]) for k in outs[0]}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  model = _trained()
  path = tmp_path_factory.mktemp("buckets") / "model"
  jr.saved_model.save(model, path, {"scored": SCORED}, platforms=("cpu",))
  known = model.emb.export()[0]  # ids with a row
  assert len(known) > 20
  return model, path, known


def test_every_size_answers_bitwise_and_nothing_compiles_after_load(exported):
  model, path, known = exported
  jr.saved_model.load(path, batch_sizes=BUCKETS, precompile=False)  # what loading compiles besides
  with compilations() as compiled:
    served = jr.saved_model.load(path, batch_sizes=BUCKETS)
  assert len(compiled) == len(BUCKETS)  # one program per batch size, at load
  signature = served.signatures["scored"]
  assert signature.batch_sizes == BUCKETS
  rng = np.random.default_rng(1)
  requests = {n: _request(rng, n, known) for n in SIZES}
  with compilations() as compiled:
    answers = {n: signature(**requests[n]) for n in SIZES}
    again = signature(**requests[5])  # the same request twice: the same answer
  assert not compiled
  for n in SIZES:  # bitwise the function's on the padded batch; as unpadded but for float rounding
    expected = _expected(model, requests[n], BUCKETS)
    unpadded = _expected(model, requests[n]) if n else expected  # the model takes no empty batch
    assert sorted(answers[n]) == ["pooled", "rows", "score"]
    for name, value in answers[n].items():
      assert isinstance(value, jax.Array)
      same_bits(value, expected[name])
      np.testing.assert_allclose(value, unpadded[name], rtol=1e-6, atol=1e-7)
    same_bits(answers[n]["rows"], unpadded["rows"])  # no arithmetic: exact
  for name in again:
    same_bits(again[name], answers[5][name])
  assert np.asarray(answers[40]["rows"]).any() and (np.asarray(answers[40]["score"]) == -1.0).any()


def test_padding_compiles_each_batch_size_once_on_first_use(exported):
  _, path, known = exported
  jr.saved_model.load(path, batch_sizes=(8, 32), precompile=False)  # what loading compiles besides
  with compilations() as compiled:
    signature = jr.saved_model.load(path, batch_sizes=(8, 32), precompile=False).signatures["scored"]
    assert not compiled
    rng = np.random.default_rng(2)
    counts = []
    for n in (3, 8, 1, 20, 32, 70):  # 8, 8, 8, 32, 32, then 32 + 32 + 8
      signature(**_request(rng, n, known))
      counts.append(len(compiled))
  assert counts == [1, 1, 1, 2, 2, 2]


def test_by_default_nothing_is_padded_and_each_size_compiles(exported):
  """The default keeps the contract's bitwise equality at every request's own shape."""
  _, path, known = exported
  signature = jr.saved_model.load(path).signatures["scored"]
  assert signature.batch_sizes is None
  rng = np.random.default_rng(3)
  with compilations() as compiled:
    for n in (2, 3, 2):
      signature(**_request(rng, n, known))
  assert len(compiled) == 2


def test_signatures_without_a_batch_dimension_are_not_padded(tmp_path):
  """An output reduced over the batch, or no named dimension: served at the sizes given."""
  signatures = {
    "total": jr.saved_model.Signature(lambda o, x: x.sum(), x=jax.ShapeDtypeStruct(("batch",), jnp.int32)),
    "pairs": jr.saved_model.Signature(
      lambda o, x: x[:, None] + x[None, :], x=jax.ShapeDtypeStruct(("batch",), jnp.int32)
    ),
    "fixed": jr.saved_model.Signature(lambda o, x: x * 2, x=jax.ShapeDtypeStruct((3,), jnp.int32)),
  }
  jr.saved_model.save(jr.AutoTrackable(), tmp_path / "m", signatures, platforms=("cpu",))
  with compilations() as compiled:
    served = jr.saved_model.load(tmp_path / "m", batch_sizes=(4,))
  assert len(compiled) == 1  # the program of fixed shapes
  assert [served.signatures[k].batch_sizes for k in ("total", "pairs", "fixed")] == [None, None, None]
  x = np.arange(5, dtype=np.int32)
  assert int(served.signatures["total"](x=x)["output"]) == 10
  np.testing.assert_array_equal(served.signatures["pairs"](x=x)["output"], x[:, None] + x[None, :])
  with compilations() as compiled:
    np.testing.assert_array_equal(served.signatures["fixed"](x=x[:3])["output"], 2 * x[:3])
  assert not compiled


def test_string_ids_are_padded_as_empty_strings(tmp_path):
  vocab = jr.StaticVocabularyTable(jr.KeyValueInitializer(["apple", ""], np.array([4, 2**40], np.int64)), 2)
  words = jax.ShapeDtypeStruct(("n",), str)
  sig = jr.saved_model.Signature(lambda v, w: {"id": v.find(w)}, max_length=8, w=words)
  jr.saved_model.save(vocab, tmp_path / "v", {"ids": sig}, platforms=("cpu",))
  signature = jr.saved_model.load(tmp_path / "v", batch_sizes=(2, 8)).signatures["ids"]
  rng = np.random.default_rng(4)
  queries = [rng.choice(["apple", "banana", "", "zz"], n).tolist() for n in (0, 1, 3, 9)]
  with compilations() as compiled:
    answers = [signature(w=np.array(query, object))["id"] for query in queries]
  assert not compiled
  for query, got in zip(queries, answers):
    same_bits(got, jax.jit(vocab.find)(jr.keys.encode_strings(query, 8)))
  empty = np.asarray(jr.keys.split64(np.array([2**40]))).tolist()  # the empty string's id, as words
  assert answers[-1].tolist().count(empty[0]) == queries[-1].count("") > 0  # a key like any other


def test_bad_batch_sizes_are_refused(exported, tmp_path):
  model, path, _ = exported
  bad_sizes = (
    ([], TypeError),
    ("16", TypeError),
    ((4, 2.0), TypeError),
    ((0, 4), ValueError),
    ((4, 4), ValueError),
  )
  for bad, error in bad_sizes:
    with pytest.raises(error, match="batch_sizes"):
      jr.saved_model.load(path, batch_sizes=bad)
    with pytest.raises(error, match="batch_sizes"):
      jr.saved_model.save(model, tmp_path / "tf", {"scored": SCORED}, format="tf", batch_sizes=bad)
  with pytest.raises(TypeError, match="precompile"):
    jr.saved_model.load(path, precompile=1)
  with pytest.raises(ValueError, match=r"batch_sizes.*load"):
    jr.saved_model.save(model, tmp_path / "j", {"scored": SCORED}, batch_sizes=(8,))
  assert not (tmp_path / "tf").exists() and not (tmp_path / "j").exists()


SERVE_TF = """
import os, sys, importlib.abc
class _Refuse(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path=None, target=None):
    if name.split(".")[0] in ("jax", "jaxlib", "jaxres"):
      raise ImportError(f"{name} is blocked in this process")
sys.meta_path.insert(0, _Refuse())
import numpy as np, tensorflow as tf
dump = os.environ["XLA_FLAGS"].split("=", 1)[1]
def compiled():
  return sum(f.endswith("after_optimizations.txt") for f in os.listdir(dump)) if os.path.isdir(dump) else 0
signature = tf.saved_model.load(sys.argv[1]).signatures["scored"]
inputs = dict(np.load(sys.argv[2]))
for size in (4, 16):  # warm up: one request per batch size
  zeros = {k: tf.zeros((size, *v.shape[1:]), v.dtype) for k, v in inputs.items()}
  signature(**zeros)
warm = compiled()
out = {}
sizes = list(map(int, sys.argv[4].split(",")))
for n in sizes:
  got = signature(**{k: tf.constant(v[:n]) for k, v in inputs.items()})
  out |= {f"{k}_{n}": v.numpy() for k, v in got.items()}
after = compiled() - warm
unpadded = tf.saved_model.load(sys.argv[5]).signatures["scored"]
chunks = dict(np.load(sys.argv[6]))  # "<n>_<chunk>_<input>": the requests as padded
for key in sorted({k.rsplit("_", 1)[0] for k in chunks}):
  got = unpadded(**{name: tf.constant(chunks[f"{key}_{name}"]) for name in inputs})
  out |= {f"unpadded_{key}_{k}": v.numpy() for k, v in got.items()}
np.savez(sys.argv[3], warm=warm, after=after, **out)
"""


def test_the_tensorflow_savedmodel_compiles_each_batch_size_once(exported, tmp_path):
  pytest.importorskip("tensorflow")
  model, _, known = exported
  path, unpadded = tmp_path / "tf", tmp_path / "tf_unpadded"
  jr.saved_model.save(model, path, {"scored": SCORED}, platforms=("cpu",), format="tf", batch_sizes=(4, 16))
  jr.saved_model.save(model, unpadded, {"scored": SCORED}, platforms=("cpu",), format="tf", batch_sizes=None)
  sizes = (1, 4, 5, 16, 17, 40)
  inputs = _request(np.random.default_rng(5), max(sizes), known)
  np.savez(tmp_path / "in.npz", **inputs)
  served = {n: _as_served({k: v[:n] for k, v in inputs.items()}, (4, 16)) for n in sizes}
  chunks = {
    f"{n}_{c}_{k}": v for n in sizes for c, (chunk, _) in enumerate(served[n]) for k, v in chunk.items()
  }
  np.savez(tmp_path / "chunks.npz", **chunks)
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_dump_to={tmp_path / 'dump'}"}
  command = [sys.executable, "-c", SERVE_TF, str(path), str(tmp_path / "in.npz"), str(tmp_path / "out.npz")]
  done = subprocess.run(
    [*command, ",".join(map(str, sizes)), str(unpadded), str(tmp_path / "chunks.npz")],
    capture_output=True,
    text=True,
    env=env,
    timeout=600,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  out = dict(np.load(tmp_path / "out.npz"))
  assert (int(out["warm"]), int(out["after"])) == (2, 0)
  for n in sizes:  # bitwise the unpadded SavedModel's on the padded chunks; TensorFlow's XLA may
    expected = _expected(model, {k: v[:n] for k, v in inputs.items()})  # round off JAX's in the last bits
    for name in ("score", "rows", "pooled"):
      parts = [out[f"unpadded_{n}_{c}_{name}"][:rows] for c, (_, rows) in enumerate(served[n])]
      same_bits(out[f"{name}_{n}"], np.concatenate(parts))
      np.testing.assert_allclose(out[f"{name}_{n}"], expected[name], rtol=1e-6, atol=1e-7)


def test_a_signature_keeps_its_most_recently_used_programs(tmp_path, monkeypatch):
  """Without batch sizes each request size compiles a program; a signature kept every one for good
  (300 MB over 150 sizes). It keeps the PROGRAMS_KEPT it used last (here 3): a size that returns
  after the others pushed it out compiles again, a recent one does not."""
  monkeypatch.setattr(loaded, "PROGRAMS_KEPT", 3)
  table = jr.OpenAddressingTable.create(16, key=np.int32, value=np.float32, default=-1.0)
  table = table.insert(np.arange(4, dtype=np.int32), np.arange(4, dtype=np.float32))
  ids = jax.ShapeDtypeStruct(("n",), np.int32)
  signature = jr.saved_model.Signature(lambda t, ids: t.find(ids), ids=ids)
  jr.saved_model.save(table, tmp_path / "export", {"find": signature})
  find = jr.saved_model.load(tmp_path / "export").signatures["find"]
  counts = []
  with compilations() as compiled:
    for n in (1, 2, 3, 1, 4, 2, 4, 1):  # kept after each: 1; 1 2; 1 2 3; 2 3 1; 3 1 4; 1 4 2; 1 2 4; ...
      assert find(ids=np.arange(n, dtype=np.int32))["output"].tolist() == list(map(float, range(n)))
      counts.append(len(compiled))
  assert counts == [1, 2, 3, 3, 4, 5, 5, 5]
