"""Immutable tables built once from an initializer, and vocabularies with OOV buckets."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxres._core import constants
from jaxres._core.encoding import key_specs
from jaxres._core.storages import registry
from jaxres._errors import check_int
from jaxres._shell.initializers import KeyValueInitializer, TextFileInitializer
from jaxres._shell.lookup_table import LookupTable

_MAX_OOV_BUCKETS = 2**31 - 1


def _longest(keys) -> int:
  return max([len(str(k).encode("utf-8")) for k in keys.tolist()] + [1])


class StaticHashTable(LookupTable):
  """An immutable table filled from an initializer (``tf.lookup.StaticHashTable``).

  Reads are those of :class:`MutableHashTable` (``find``, ``lookup``,
  ``contains``, ``export``); ``insert`` and ``remove`` raise ``TypeError``.

  Args:
    initializer: a :class:`KeyValueInitializer` or :class:`TextFileInitializer`.
    default_value: value for missing keys.
    storage: ``"sorted"`` (default: compact, read-only) or ``"open_addressing"``.
    device: optional ``jax.Device`` or sharding.
    max_key_length: for string keys, the longest lookup key accepted (default:
      64 bytes, or the longest key of the initializer if that is longer).

  Raises:
    ValueError: the initializer holds the same key twice.

  Examples:
    >>> import jaxres as jr
    >>> table = jr.StaticHashTable(jr.KeyValueInitializer([1, 2], ["one", "two"]), default_value="?")
    >>> table.find([2, 3]).tolist()
    ['two', '?']
  """

  def __init__(
    self, initializer, default_value, *, storage: str = registry.READ_ONLY, device=None, max_key_length=None
  ):
    _check_initializer(initializer)
    keys, values = initializer.read()
    if max_key_length is None:
      max_key_length = max(64, _longest(keys)) if initializer.key_dtype is str else 64
    max_value_length = max(64, _longest(values)) if initializer.value_dtype is str else 64
    super().__init__(
      initializer.key_dtype,
      initializer.value_dtype,
      default_value,
      initial_capacity=max(1, len(keys)),
      storage=storage,
      device=device,
      max_key_length=max_key_length,
      max_value_length=max_value_length,
    )
    self._initializer = initializer
    self.state  # noqa: B018  (build now: bad data fails here)

  def _create_resource(self):
    keys, values = self._initializer.read()
    table = self._empty(self._initial_capacity)
    if len(keys):
      table = table.import_(self._key_codec.encode(keys), self._value_codec.encode(values))
      if int(table.size) != len(keys):
        raise ValueError(f"initializer: {len(keys) - int(table.size)} duplicate key(s); keys must be unique.")
    return table

  def insert(self, keys, values):
    """Always raises: a static table is immutable."""
    raise TypeError(f"{type(self).__name__} is immutable; use jr.MutableHashTable to insert keys.")

  def remove(self, keys):
    """Always raises: a static table is immutable."""
    raise TypeError(f"{type(self).__name__} is immutable; use jr.MutableHashTable to remove keys.")


class StaticVocabularyTable(StaticHashTable):
  """Keys to ids, with out-of-vocabulary keys hashed into extra buckets.

  A key of the vocabulary maps to its value in the initializer (its id); any
  other key maps to ``vocab_size + fingerprint(key) % num_oov_buckets``. The
  fingerprint is a fixed hash of the key's encoding, so ids are stable across
  runs and processes (they differ from TensorFlow's Fingerprint64 ids).

  Reads like every stateful table: ``find`` (and ``vocab[keys]``) gives ids,
  ``lookup`` gives ``(ids, in_vocab)``. (TensorFlow's ``lookup`` returns the
  ids alone.) Ids are ``int64``, exact: NumPy arrays on the host with
  ``jax_enable_x64`` off, word pairs inside ``jit`` (see :mod:`jaxres.keys`);
  ``jr.keys.to_int32(ids)`` gives the ``int32`` ids that ``nnx.Embed`` and
  indexing take, inside ``jit`` or not.

  Args:
    initializer: keys (strings or integers) and their integer ids.
    num_oov_buckets: number of buckets for unknown keys (>= 1).
    storage: as for :class:`StaticHashTable`.
    device: as for :class:`StaticHashTable`.
    max_key_length: as for :class:`StaticHashTable`.

  Examples:
    >>> import jaxres as jr
    >>> vocab = jr.StaticVocabularyTable(jr.KeyValueInitializer(["a", "b"], [0, 1]), num_oov_buckets=3)
    >>> ids, in_vocab = vocab.lookup(["b", "a", "zebra"])
    >>> ids[:2].tolist(), 2 <= int(ids[2]) < 5, in_vocab.tolist()
    ([1, 0], True, [True, True, False])
    >>> vocab[["zebra"]].tolist() == vocab.find(["zebra"]).tolist()
    True
  """

  def __init__(
    self,
    initializer,
    num_oov_buckets: int,
    *,
    storage: str = registry.READ_ONLY,
    device=None,
    max_key_length=None,
  ):
    num_oov_buckets = check_int(num_oov_buckets, "num_oov_buckets", low=1, high=_MAX_OOV_BUCKETS)
    _check_initializer(initializer)
    if initializer.value_dtype is str or np.dtype(initializer.value_dtype).kind not in "iu":
      raise TypeError(f"initializer: ids must be integers, got {initializer.value_dtype}.")
    super().__init__(initializer, -1, storage=storage, device=device, max_key_length=max_key_length)
    self.num_oov_buckets = num_oov_buckets

  @property
  def vocab_size(self) -> int:
    """Keys in the vocabulary (ids of unknown keys start here)."""
    return int(super().size())

  def size(self) -> int:
    """``vocab_size + num_oov_buckets``: the number of distinct ids."""
    return self.vocab_size + self.num_oov_buckets

  def find(self, keys):
    """Ids of ``keys``: a vocabulary key's id, or its out-of-vocabulary bucket's."""
    return self.lookup(keys)[0]

  def lookup(self, keys):
    """``(ids, in_vocab)``: the ids of ``keys`` and whether each key is in the vocabulary."""
    with self._life().lock:
      table = self._current()
      encoded = self._key_codec.encode(keys)
      ids, found = table.lookup(encoded)
      bucket = table.key_spec.hash(encoded, seed=constants.OOV_SEED) % np.uint32(self.num_oov_buckets)
      oov = bucket + table.size.astype(jnp.uint32)
    if key_specs.x64_enabled():
      return jnp.where(found, ids, oov.astype(jnp.int64)), found
    if key_specs.is_traced(found):  # word pairs: high word 0, low word the id
      pairs = jnp.stack([jnp.zeros_like(oov), oov], axis=-1)
      return jnp.where(found[..., None], ids, pairs), found
    return np.where(np.asarray(found), ids, np.asarray(oov).astype(np.int64)), found


def _check_initializer(initializer) -> None:
  if not isinstance(initializer, (KeyValueInitializer, TextFileInitializer)):
    raise TypeError(
      f"initializer: expected a jr.KeyValueInitializer or jr.TextFileInitializer, got {initializer!r}."
    )
