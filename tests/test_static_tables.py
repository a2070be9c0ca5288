"""StaticHashTable, the initializers and StaticVocabularyTable."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxres as jr
from jaxres._core.storages import registry

WHOLE, NUMBER = jr.TextFileIndex.WHOLE_LINE, jr.TextFileIndex.LINE_NUMBER


@pytest.fixture
def vocab_file(tmp_path):
  path = tmp_path / "vocab.tsv"
  path.write_text("emerson\t10\tlake\nlake\t20\tpalmer\npalmer\t30\t\n", encoding="utf-8")
  return path


@pytest.mark.parametrize("storage", sorted(registry.STORAGES))  # every registered kind
def test_static_hash_table_reads_and_is_immutable(storage):
  table = jr.StaticHashTable(
    jr.KeyValueInitializer(["b", "a", "ç"], [2, 1, 3]), default_value=-1, storage=storage
  )
  assert table.find(["a", "ç", "zz"]).tolist() == [1, 3, -1]
  values, found = table.lookup(["b", "x"])
  assert values.tolist() == [2, -1] and found.tolist() == [True, False]
  keys, values = table.export()
  assert keys.tolist() == ["a", "b", "ç"] and values.tolist() == [1, 2, 3]
  assert len(table) == 3
  with pytest.raises(TypeError, match="immutable"):
    table.insert(["d"], [4])
  with pytest.raises(TypeError, match="immutable"):
    table.remove(["a"])
  assert len(table) == 3


def test_static_hash_table_int_keys_string_values():
  table = jr.StaticHashTable(
    jr.KeyValueInitializer(np.array([2**40, -3], np.int64), ["big", "neg"]), default_value="?"
  )
  assert table.find(np.array([-3, 2**40, 0], np.int64)).tolist() == ["neg", "big", "?"]


def test_duplicate_keys_are_rejected():
  with pytest.raises(ValueError, match="duplicate"):
    jr.StaticHashTable(jr.KeyValueInitializer([1, 2, 1], [0, 1, 2]), default_value=-1)


def test_initializer_errors():
  with pytest.raises(ValueError, match="keys, values"):
    jr.KeyValueInitializer([1, 2], [1])
  with pytest.raises(TypeError, match="keys"):
    jr.KeyValueInitializer([1, "a"], [1, 2])


def test_text_file_whole_line_and_line_number(vocab_file):
  init = jr.TextFileInitializer(vocab_file, str, WHOLE, np.int64, NUMBER)
  keys, values = init.read()
  assert keys.tolist() == ["emerson\t10\tlake", "lake\t20\tpalmer", "palmer\t30\t"] and values.tolist() == [
    0,
    1,
    2,
  ]


def test_text_file_columns_and_vocab_size(vocab_file):
  table = jr.StaticHashTable(jr.TextFileInitializer(vocab_file, str, 0, np.int32, 1), default_value=0)
  assert table.find(["lake", "palmer", "asia"]).tolist() == [20, 30, 0]
  short = jr.TextFileInitializer(vocab_file, str, 0, np.int32, NUMBER, vocab_size=2)
  assert short.read()[0].tolist() == ["emerson", "lake"]
  reverse = jr.StaticHashTable(jr.TextFileInitializer(vocab_file, np.int32, 1, str, 2), default_value="")
  assert reverse.find(np.array([10, 30], np.int32)).tolist() == ["lake", ""]


def test_text_file_errors(vocab_file, tmp_path):
  with pytest.raises(ValueError, match=r"vocab.tsv:1: no column 3"):
    jr.TextFileInitializer(vocab_file, str, 3, np.int32, NUMBER).read()
  with pytest.raises(ValueError, match=r"vocab.tsv:1: cannot read 'emerson' as int32"):
    jr.TextFileInitializer(vocab_file, np.int32, 0, np.int32, NUMBER).read()
  with pytest.raises(ValueError, match="vocab_size is 5"):
    jr.TextFileInitializer(vocab_file, str, 0, np.int32, NUMBER, vocab_size=5).read()
  with pytest.raises(FileNotFoundError):
    jr.TextFileInitializer(tmp_path / "missing.txt", str, 0, np.int32, NUMBER).read()
  with pytest.raises(ValueError, match="key_index"):
    jr.TextFileInitializer(vocab_file, str, -5, np.int32, NUMBER)


def test_vocabulary_ids_and_oov_buckets(vocab_file):
  vocab = jr.StaticVocabularyTable(
    jr.TextFileInitializer(vocab_file, str, 0, np.int64, NUMBER), num_oov_buckets=4
  )
  assert vocab.vocab_size == 3 and vocab.size() == 7
  words = ["palmer", "emerson", "carl", "greg", "keith", "carl"]
  ids, in_vocab = vocab.lookup(words)
  assert ids.dtype == np.int64 and ids[:2].tolist() == [2, 0]
  assert all(3 <= i < 7 for i in ids[2:]) and ids[2] == ids[5]
  assert in_vocab.tolist() == [True, True, False, False, False, False]
  np.testing.assert_array_equal(vocab.find(words), ids)
  np.testing.assert_array_equal(vocab[words], ids)
  assert len(set(np.asarray(vocab.find([f"oov-{i}" for i in range(200)])).tolist())) == 4
  with pytest.raises(ValueError, match="num_oov_buckets"):
    jr.StaticVocabularyTable(jr.KeyValueInitializer(["a"], [0]), num_oov_buckets=0)
  with pytest.raises(TypeError, match="ids must be integers"):
    jr.StaticVocabularyTable(jr.KeyValueInitializer(["a"], [0.5]), num_oov_buckets=1)


def test_vocabulary_ids_are_stable_across_processes():
  code = (
    "import jaxres as jr; v = jr.StaticVocabularyTable(jr.KeyValueInitializer(['a', 'b'], [0, 1]), 1000);"
    "print(v.find(['x', 'yy', 'zzz', 'b']).tolist())"
  )
  here = jr.StaticVocabularyTable(jr.KeyValueInitializer(["a", "b"], [0, 1]), 1000)
  expected = np.asarray(here.find(["x", "yy", "zzz", "b"])).tolist()
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
  assert out.strip() == str(expected)
  assert expected[3] == 1 and len(set(expected[:3])) == 3


def test_vocabulary_with_integer_keys_inside_jit():
  vocab = jr.StaticVocabularyTable(
    jr.KeyValueInitializer(np.array([7, 9], np.int32), [0, 1]), num_oov_buckets=2
  )
  eager = np.asarray(vocab.find(np.array([9, 8, 7], np.int32)))
  traced, in_vocab = jax.jit(vocab.lookup)(jnp.array([9, 8, 7], jnp.int32))
  assert in_vocab.tolist() == [True, False, True]
  if not jax.config.read("jax_enable_x64"):
    traced = jr.keys.join64(traced, np.int64)  # int64 ids travel as word pairs inside jit
  np.testing.assert_array_equal(np.asarray(traced), eager)
  assert eager[[0, 2]].tolist() == [1, 0] and 2 <= eager[1] < 4
