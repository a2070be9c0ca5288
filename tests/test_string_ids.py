"""String ids (``key=str``) for jr.DynamicEmbedding and the collection's tables.

The oracles: a dict from string to row, and a reference run of the same
embedding keyed by the composite key ``uint32[width]`` fed the rows of
``jr.keys.encode_strings`` (what a string table stores): every result must
equal it bit for bit.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxres as jr

MAX = 12  # UTF-8 bytes: rows of 4 words
WIDTH = 4
FEATURES = 3
ADAM = optax.adam(0.1)
X64 = bool(jax.config.read("jax_enable_x64"))  # the training test runs again with it on (test_keys.py)
TRICKY = ["", "a", "a\0", "ab", "ba", "héllo", "日本語", "x" * MAX, "x" * (MAX - 1), "\U0001f600"]
VOCABULARY = TRICKY + [f"w{i}" for i in range(30)]


def _string_embedding(capacity=16, max_length=MAX, **kwargs):
  return jr.DynamicEmbedding(
    capacity, FEATURES, key=str, max_length=max_length, optimizer=ADAM, rngs=nnx.Rngs(0), **kwargs
  )


def _reference(capacity=16, **kwargs):
  key = jax.ShapeDtypeStruct((WIDTH,), jnp.uint32)
  return jr.DynamicEmbedding(capacity, FEATURES, key=key, optimizer=ADAM, rngs=nnx.Rngs(0), **kwargs)


class Model(nnx.Module):
  def __init__(self, emb):
    self.emb = emb
    self.head = nnx.Linear(FEATURES, 1, rngs=nnx.Rngs(1))

  def __call__(self, ids):
    return self.head(self.emb(ids))[..., 0]


def _loss(model, ids, labels):
  return jnp.mean((model(ids) - labels) ** 2)


@functools.partial(nnx.jit, donate_argnums=(0, 1))
def _step(model, optimizer, ids, labels):
  loss, grads = jr.value_and_grad(_loss)(model, ids, labels)
  optimizer.update(model, grads)
  return loss


def _state(model) -> list[bytes]:
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(nnx.state(model))]


def _summary(model) -> tuple:
  """What a restore must give back: ids, rows (with their optimizer state, through later steps),
  counters and the dense parameters."""
  ids, rows = model.emb.export()
  dense = [np.asarray(x).tobytes() for x in jax.tree.leaves(nnx.state(model, nnx.Param))]
  return ids.tolist(), rows.tobytes(), model.emb.stats(), dense


def _batches(steps, size=8, seed=0):
  rng = np.random.default_rng(seed)
  picks = [rng.choice(len(VOCABULARY), size) for _ in range(steps)]
  return [
    (np.array([VOCABULARY[i] for i in p], object), rng.normal(size=size).astype(np.float32)) for p in picks
  ]


def test_training_with_string_ids_equals_the_encoded_composite_key_run():
  """A jitted, donated step with jr.value_and_grad, on a table that evicts (LRU): the string run and
  the composite-key run agree bit for bit in every loss, row, id and counter."""
  runs = []
  for emb, encode in [
    (_string_embedding(eviction=jr.LRU()), None),
    (_reference(eviction=jr.LRU()), lambda ids: jr.keys.encode_strings(ids, MAX)),
  ]:
    model = Model(emb)
    optimizer = nnx.Optimizer(model, optax.adam(0.05), wrt=nnx.Param)
    encode = encode or model.emb.encode
    losses = [_step(model, optimizer, encode(ids), labels) for ids, labels in _batches(6)]
    runs.append((model, np.asarray(losses)))
  (strings, losses), (reference, expected) = runs
  assert losses.tobytes() == expected.tobytes()
  ids, rows = strings.emb.export()
  ref_ids, ref_rows = reference.emb.export()
  assert ids.dtype == object and all(isinstance(i, str) for i in ids)
  assert ids.tolist() == jr.keys.decode_strings(ref_ids).tolist() == sorted(ids.tolist())  # code-point order
  assert rows.tobytes() == ref_rows.tobytes()
  assert strings.emb.stats() == reference.emb.stats() and strings.emb.stats()["evictions"] > 0
  assert strings.emb.size() == len(ids) <= 16


def test_string_ids_are_exact_against_a_dict():
  """Distinct strings (a prefix, a trailing NUL, the empty string, the longest) get distinct rows;
  eager strings, jitted rows and the explicit apply_gradients agree with a dict of rows."""
  emb = _string_embedding(capacity=64, eviction=None, min_count=1)
  first = emb(np.array(TRICKY, object))  # a NumPy str array would drop the trailing NUL of "a\\0"
  ids, rows = emb.export()
  assert ids.tolist() == sorted(set(TRICKY))
  oracle = dict(zip(ids.tolist(), rows))
  assert len({row.tobytes() for row in rows}) == len(TRICKY)  # never a shared row
  assert all(np.array_equal(first[i], oracle[s]) for i, s in enumerate(TRICKY))
  emb.eval()
  jitted = nnx.jit(lambda m, r: m(r))(emb, emb.encode(TRICKY))
  assert np.asarray(jitted).tobytes() == np.asarray(first).tobytes()
  emb.train()
  grads = np.ones((3, FEATURES), np.float32)
  emb.apply_gradients(["a", "a", "ab"], grads)  # adam: one step per distinct id, the same size
  moved = dict(zip(*emb.export()))
  for s in TRICKY:
    changed = not np.array_equal(moved[s], oracle[s])
    assert changed == (s in ("a", "ab")), s
  np.testing.assert_allclose(moved["a"], oracle["a"] - 0.1, atol=1e-6)


def test_the_collection_takes_string_tables():
  tables = {
    "words": jr.TableConfig(32, FEATURES, optimizer=ADAM, key=str, max_length=MAX),
    "items": jr.TableConfig(32, FEATURES, optimizer=ADAM),
  }
  features = {
    "word": jr.FeatureConfig("words"),
    "title": jr.FeatureConfig("words", combiner="mean"),
    "item": jr.FeatureConfig("items"),
  }
  inputs = {
    "word": np.array(["fox", "héllo"]),
    "title": (
      np.array([["the", "fox", ""], ["owl", "", ""]]),
      np.array([[1.0, 1, 0], [1, 0, 0]], np.float32),
    ),
    "item": np.array([2**40, 7]),
  }
  eager, jitted = (jr.EmbeddingCollection(tables, features, rngs=nnx.Rngs(0)) for _ in range(2))
  out = eager(inputs)
  encoded = jitted.encode(inputs)
  assert encoded["word"].shape == (2, WIDTH) and encoded["title"][0].shape == (2, 3, WIDTH)
  assert encoded["item"].shape == ((2,) if X64 else (2, 2))  # int64 ids: word pairs with x64 off
  got = nnx.jit(lambda m, b: m(b))(jitted, encoded)
  for name in out:
    np.testing.assert_allclose(got[name], out[name], rtol=1e-6)
  for emb in (eager, jitted):
    ids, _ = emb.tables["words"].export()
    assert ids.tolist() == ["fox", "héllo", "owl", "the"]  # padding ("", weight 0) never inserted
  for a, b in zip(eager.tables["words"].export(), jitted.tables["words"].export()):
    assert np.asarray(a).tolist() == np.asarray(b).tolist()
  with pytest.raises(TypeError, match=r"inputs\['word'\].*strings"):
    jitted.encode({"word": np.array([1, 2])})
  with pytest.raises(ValueError, match="unknown features"):
    jitted.encode({"nope": ["a"]})
  short = {**inputs, "word": inputs["word"][:1]}  # string ids of one example for two (issue 68)
  batches = r"inputs\['item'\] has a batch of 2 and inputs\['word'\] of 1"
  with pytest.raises(ValueError, match=batches):
    eager(short)
  with pytest.raises(ValueError, match=batches):
    nnx.jit(lambda m, b: m(b))(jitted, jitted.encode(short))


def test_checkpoints_round_trip_string_ids(tmp_path):
  model = Model(_string_embedding(eviction=jr.LRU()))
  optimizer = nnx.Optimizer(model, optax.adam(0.05), wrt=nnx.Param)
  batches = _batches(4, seed=1)
  for ids, labels in batches[:3]:
    _step(model, optimizer, model.emb.encode(ids), labels)
  jr.Checkpoint(model=model).save(tmp_path / "ckpt")
  fresh = Model(_string_embedding(eviction=jr.LRU()))
  jr.Checkpoint(model=fresh).restore(tmp_path / "ckpt").assert_consumed()
  assert _summary(fresh) == _summary(model)
  assert isinstance(fresh.emb.export()[0][0], str)
  ids, labels = batches[3]
  losses = [
    _step(m, nnx.Optimizer(m, optax.adam(0.05), wrt=nnx.Param), m.emb.encode(ids), labels)
    for m in (model, fresh)
  ]
  assert np.asarray(losses[0]).tobytes() == np.asarray(losses[1]).tobytes()
  assert _summary(fresh) == _summary(model)  # the rows' optimizer state came back too
  other = Model(_string_embedding(max_length=32, eviction=jr.LRU()))
  before = _state(other)
  with pytest.raises(ValueError, match=f"max_length={4 * (WIDTH - 1)}"):
    jr.Checkpoint(model=other).restore(tmp_path / "ckpt")
  assert _state(other) == before


def test_both_serving_formats_take_raw_strings(tmp_path):
  tf = pytest.importorskip("tensorflow")
  model = Model(_string_embedding(eviction=jr.LRU()))
  optimizer = nnx.Optimizer(model, optax.adam(0.05), wrt=nnx.Param)
  for ids, labels in _batches(3, seed=2):
    _step(model, optimizer, model.emb.encode(ids), labels)

  def predict(m, ids):
    return {"score": m(ids), "rows": m.emb(ids)}

  spec = jax.ShapeDtypeStruct(("batch",), str)
  signature = jr.saved_model.Signature(predict, max_length=MAX, ids=spec)
  jr.saved_model.save(model, tmp_path / "jaxres", {"serving_default": signature})
  jr.saved_model.save(model, tmp_path / "tf", {"serving_default": signature}, format="tf")
  queries = np.array(["héllo", "never seen", "a\0", "a", "", "x" * MAX], object)
  model.eval()
  expected = jax.device_get(nnx.jit(predict)(model, model.emb.encode(queries)))
  model.train()
  assert np.asarray(expected["rows"]).any() and not np.asarray(expected["rows"])[1].any()  # unseen: zeros
  served = jr.saved_model.load(tmp_path / "jaxres").signatures["serving_default"]
  assert served.inputs == {"ids": spec}
  got = served(ids=queries)
  tf_got = tf.saved_model.load(str(tmp_path / "tf")).signatures["serving_default"](
    ids=tf.constant(queries.tolist())
  )
  for name in ("score", "rows"):
    assert np.asarray(got[name]).tobytes() == np.asarray(expected[name]).tobytes()
    assert tf_got[name].numpy().tobytes() == np.asarray(expected[name]).tobytes()
  with pytest.raises(ValueError, match="ids"):
    served(ids=np.array(["x" * (MAX + 1)]))
  wide = jr.saved_model.Signature(predict, ids=spec)  # max_length 64: rows wider than the table's
  with pytest.raises(ValueError, match=rf"Signature\(\.\.\., max_length={MAX}\)"):
    jr.saved_model.save(model, tmp_path / "wide", {"serving_default": wide})
  assert not (tmp_path / "wide").exists()


def test_bad_string_ids_are_named_and_change_nothing():
  emb = _string_embedding(min_count=2)
  emb(np.array(["fox", "fox", "owl"]))
  before, stats = _state(emb), emb.stats()
  rows = np.asarray(jr.keys.encode_strings(["fox"], MAX))
  forged = rows.copy()
  forged[0, -1] = MAX + 1  # a length word past the max
  for ids, error, match in [
    (["x" * (MAX + 1)], ValueError, r"ids: 'x+' is 13 UTF-8 bytes, over this table's max length of 12"),
    (["é" * 7], ValueError, "14 UTF-8 bytes"),
    (np.array([1, 2]), TypeError, r"ids: expected strings.*encode_strings.*got int64\[2\]"),
    (np.array([1.5]), TypeError, "ids: expected strings"),
    (["a", 3], TypeError, "ids: expected strings, got int 3"),
    ([b"\xff"], ValueError, "ids: .* is not UTF-8"),
    (["ok", "a\udcff"], ValueError, r"ids: 'a\\udcff' holds '\\udcff' at 1, a lone surrogate"),
    (np.asarray(jr.keys.encode_strings(["fox"], 32)), ValueError, r"max_length <= 12 \(rows of width <= 4"),
    (forged, ValueError, "length word says 13 bytes"),
  ]:
    with pytest.raises(error, match=match):
      emb(ids)
    with pytest.raises(error, match=match):
      emb.apply_gradients(ids, np.ones((len(ids), FEATURES), np.float32))
    with pytest.raises(error, match=match):
      emb.encode(ids)
  assert _state(emb) == before and emb.stats() == stats
  assert emb(np.zeros((0,), str)).shape == (0, FEATURES) and _state(emb) == before
  assert emb(jr.keys.encode_strings(["fox"], 8)).shape == (1, FEATURES)  # narrower rows are widened
  assert np.array_equal(emb.encode(rows), rows)


def test_mistakes_around_string_ids_say_what_to_do():
  ints = jr.DynamicEmbedding(8, FEATURES, optimizer=ADAM, rngs=nnx.Rngs(0))
  before = _state(ints)
  for strings in (np.array(["fox"]), ["fox"], np.array(["fox"], object)):
    with pytest.raises(TypeError, match=r"ids: expected .*key=str.*encode_strings"):
      ints(strings)
  assert _state(ints) == before
  composite = _reference()
  with pytest.raises(TypeError, match="key=str") as raised:
    composite(np.array(["fox"]))
  assert "astype" not in str(raised.value)
  with pytest.raises(TypeError, match=r"key: .*jr.DynamicEmbedding\(\.\.\., key=str"):
    jr.OpenAddressingTable.create(8, key=str, value=jnp.float32, default=0.0)
  with pytest.raises(ValueError, match="max_length: only string ids"):
    jr.DynamicEmbedding(8, FEATURES, max_length=8, optimizer=ADAM, rngs=nnx.Rngs(0))
  for bad, error in [(0, ValueError), (1.5, TypeError)]:
    with pytest.raises(error, match="max_length"):
      _string_embedding(max_length=bad)
  with pytest.raises(ValueError, match=r"tables\['w'\]: max_length"):
    jr.EmbeddingCollection(
      {"w": jr.TableConfig(8, 2, optimizer=ADAM, key=str, max_length=0)}, {}, rngs=nnx.Rngs(0)
    )
  wide = np.array([2**40, -1])
  assert np.array_equal(ints.encode(wide), wide if X64 else jr.keys.split64(wide))
  assert repr(_string_embedding()).startswith(
    "jr.DynamicEmbedding(capacity=16, features=3, key=str, max_length=12"
  )


def test_a_checkpoint_of_string_ids_that_are_not_utf8_is_refused_by_name(tmp_path):
  """A damaged or crafted checkpoint whose id rows decode to no string (bytes that are not UTF-8), or
  to strings longer than the restoring embedding's max_length (in rows of the same width), was
  restored, and export() failed afterwards; a MutableHashTable(str) refused the same. Refused at
  restore, naming the array; the embedding left as it was."""
  bad = np.asarray(jr.keys.encode_strings(["ab"], MAX)).copy()
  bad[0, 0] = 0xFFFE0000  # the two bytes of "ab" replaced by 0xFF 0xFE: no UTF-8 string
  longest = jr.keys.encode_strings(["x" * MAX], MAX)  # MAX bytes: one more than the restorer takes
  for rows, match in ((bad, "encodes no UTF-8 string"), (longest, "longer than max_length=11")):
    saved = _string_embedding()
    saved(jr.keys.encode_strings(["fine"], MAX))  # a training-mode lookup gives the ids rows
    saved(jnp.asarray(rows))
    jr.Checkpoint(model=saved).save(tmp_path / match)
    fresh = _string_embedding(max_length=MAX - 1)  # rows of WIDTH words too
    fresh(jr.keys.encode_strings(["kept"], MAX - 1))
    before = fresh.export()
    with pytest.raises(ValueError, match=match):
      jr.Checkpoint(model=fresh).restore(tmp_path / match)
    after = fresh.export()
    assert after[0].tolist() == before[0].tolist() == ["kept"] and np.array_equal(after[1], before[1])
