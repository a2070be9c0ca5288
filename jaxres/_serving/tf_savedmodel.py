"""``jr.saved_model.save(..., format="tf")``: a TensorFlow SavedModel that stock TensorFlow serves.

Each signature's program (see :mod:`program`: no custom call) runs in
TensorFlow through JAX's jax2tf native serialization (an ``XlaCallModule`` op
holding the program), its serving state as TensorFlow variables. The inputs
are turned into the program's traced form with stock TensorFlow ops, in the
SavedModel itself, so that a server needs neither JAX nor jaxres: 64-bit
integers split into word pairs (``tf.bitcast``), strings packed into rows as
``jr.keys.encode_strings`` packs them (``tf.io.decode_raw``), floats cast.
The batch is then padded to one of the export's batch sizes as a loaded
signature pads it (:mod:`buckets`; chunks of the largest in a ``tf.map_fn``),
so that TensorFlow, which compiles the ``XlaCallModule`` for each shape it
meets, compiles each batch size once (on its first request).
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
from jaxres._serving import buckets
from jaxres._serving.signature import Input


def write(path: Path, signatures, programs, position, state, checkpoint, batch_sizes) -> None:
  """Writes the SavedModel at ``path`` (as :func:`directory.write`, staged then moved into place).

  ``batch_sizes``: the batch sizes requests are padded to (see :mod:`buckets`), or ``None``.
  """
  module = tf.Module()
  module.state = [tf.Variable(x, trainable=False, name=f"state_{k}") for k, x in enumerate(state)]
  concrete = {}
  for name, sig in signatures.items():
    concrete[name] = _serving_function(module, sig, programs[name], position, batch_sizes)
  replacing.remove_stale(path)
  staged = Path(replacing.staging_dir(path))
  try:
    tf.saved_model.save(module, str(staged), signatures=concrete)
    checkpoint(staged)
    replacing.replace(staged, path)
  except BaseException:
    shutil.rmtree(staged, ignore_errors=True)
    raise


def _serving_function(module, signature, program, position, batch_sizes):
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

  out_dims = {k: [str(d) for d in a.shape] for k, a in zip(program.outputs, program.exported.out_avals)}
  batch = buckets.batch_dimension(inputs, out_dims) if batch_sizes else None
  out_dtypes = {k: tf.as_dtype(a.dtype) for k, a in zip(program.outputs, program.exported.out_avals)}

  def state():
    return [v.read_value() for v in taken]

  def serve(*args):
    encoded = [_encode(i, x, t, signature.max_length) for i, x, t in zip(inputs, args, traced, strict=True)]
    if batch is None:
      return call(state(), encoded)
    axes = [i.dims.index(batch) if batch in i.dims else None for i in inputs]
    return _in_buckets(lambda xs: call(state(), xs), encoded, axes, batch_sizes, out_dtypes)

  return tf.function(serve, input_signature=specs, autograph=False).get_concrete_function()


def _in_buckets(call, args, axes, batch_sizes, out_dtypes):
  """``call(args)`` with the batch (axis ``axes[k]`` of ``args[k]``; ``None``: not batched) padded
  with zeros to the smallest of ``batch_sizes`` that holds it, or to chunks of the largest, and the
  results (batch first) cut back: the program runs at those sizes alone."""
  n = next(tf.shape(x, out_type=tf.int64)[a] for x, a in zip(args, axes) if a is not None)
  sizes = tf.constant(batch_sizes, tf.int64)
  size = sizes[tf.minimum(tf.searchsorted(sizes, n[None])[0], len(batch_sizes) - 1)]
  chunks = tf.maximum((n + size - 1) // size, 1)
  padded = []
  for x, a in zip(args, axes):
    if a is not None:
      x = tf.pad(x, [[0, 0]] * a + [[0, chunks * size - n]] + [[0, 0]] * (x.shape.rank - a - 1))
    padded.append(x)

  def chunk(k):  # one program call site for all the chunks: each size compiles once
    rows = tf.range(k * size, (k + 1) * size)
    return call([x if a is None else tf.gather(x, rows, axis=a) for x, a in zip(padded, axes)])

  out = tf.map_fn(chunk, tf.range(chunks), fn_output_signature=out_dtypes)
  return {k: tf.reshape(v, tf.concat([[-1], tf.shape(v)[2:]], 0))[:n] for k, v in out.items()}


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
