"""``jr.saved_model.save(..., format="tf")``: a TensorFlow SavedModel that stock TensorFlow serves.

Each signature's program (see :mod:`program`: no custom call) runs in
TensorFlow through JAX's jax2tf native serialization (an ``XlaCallModule`` op
holding the program), its serving state as TensorFlow variables. The inputs
are turned into the program's traced form with stock TensorFlow ops, in the
SavedModel itself, so that a server needs neither JAX nor jaxres: 64-bit
integers split into word pairs (``tf.bitcast``), strings packed into rows as
``jr.keys.encode_strings`` packs them (``tf.io.decode_raw``), floats cast.
The object's training checkpoint is written to ``jaxres_variables/`` (the
SavedModel's own ``variables/`` holds the serving state).

TensorFlow is imported here alone, and only for this format.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import tensorflow as tf
from jax.experimental import jax2tf

from jaxres._core.encoding import strings
from jaxres._persistence import replacing
from jaxres._serving.signature import Input


def write(path: Path, signatures, programs, position, state, checkpoint) -> None:
  """Writes the SavedModel at ``path`` (as :func:`directory.write`, staged then moved into place)."""
  module = tf.Module()
  module.state = [tf.Variable(x, trainable=False, name=f"state_{k}") for k, x in enumerate(state)]
  concrete = {}
  for name, sig in signatures.items():
    concrete[name] = _serving_function(module, sig, programs[name], position)
  replacing.remove_stale(path)
  staged = Path(replacing.staging_dir(path))
  try:
    tf.saved_model.save(module, str(staged), signatures=concrete)
    checkpoint(staged)
    replacing.replace(staged, path)
  except BaseException:
    shutil.rmtree(staged, ignore_errors=True)
    raise


def _serving_function(module, signature, program, position):
  inputs: tuple[Input, ...] = signature.parsed
  taken = [module.state[position[i]] for i in program.state]
  traced = [i.traced({d: d for d in i.dims if isinstance(d, str)}, signature.max_length) for i in inputs]
  polymorphic = [
    [None] * len(taken),
    ["(" + ", ".join(str(d) for d in spec.shape) + ")" for spec in traced],
  ]
  call = jax2tf.convert(
    program.exported.call,
    polymorphic_shapes=polymorphic,
    native_serialization_platforms=program.exported.platforms,
    with_gradient=False,
  )
  specs = [
    tf.TensorSpec([None if isinstance(d, str) else d for d in i.dims], _tf_dtype(i), name=i.name)
    for i in inputs
  ]

  def serve(*args):
    encoded = [_encode(i, x, t, signature.max_length) for i, x, t in zip(inputs, args, traced, strict=True)]
    return call([v.read_value() for v in taken], encoded)

  return tf.function(serve, input_signature=specs, autograph=False).get_concrete_function()


def _tf_dtype(i: Input):
  return tf.string if i.is_string else tf.as_dtype(i.dtype)


def _encode(i: Input, x, traced, max_length: int):
  """An input tensor in the program's traced form, with stock TensorFlow ops."""
  if i.is_string:
    return _encode_strings(x, max_length)
  if i.is_wide:
    pairs = tf.bitcast(x, tf.uint32)  # [..., 2]: the words in memory order
    return pairs[..., ::-1] if np.little_endian else pairs  # the high word first
  return tf.cast(x, tf.as_dtype(traced.dtype))


def _encode_strings(x, max_length: int):
  """``strings.encode`` in TensorFlow: UTF-8 bytes big-endian in words, zero-padded, then the length."""
  width = strings.string_width(max_length)
  length = tf.strings.length(x)  # bytes
  check = tf.debugging.assert_less_equal(
    length, max_length, message=f"a string input is longer than its max_length of {max_length} bytes"
  )
  with tf.control_dependencies([check]):
    data = tf.io.decode_raw(x, tf.uint8, fixed_length=4 * (width - 1))
  quads = tf.cast(tf.reshape(data, tf.concat([tf.shape(x), [width - 1, 4]], 0)), tf.uint32)
  words = quads[..., 3]
  for byte, shift in ((0, 24), (1, 16), (2, 8)):
    words = tf.bitwise.bitwise_or(
      words, tf.bitwise.left_shift(quads[..., byte], tf.constant(shift, tf.uint32))
    )
  return tf.concat([words, tf.cast(length, tf.uint32)[..., None]], axis=-1)
