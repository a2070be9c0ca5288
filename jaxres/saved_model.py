"""Export a trained object with named signatures, and serve it without its code (``jr.saved_model``).

The seeds' ``tf.saved_model.save`` / ``load`` on ``jax.export``: each signature
is a function of the object (traced in inference mode) and named inputs,
exported once for every listed platform with named dimensions as symbolic
shapes; the directory holds those programs, the *serving state* they read
(tables as sorted arrays of their live entries, only the value leaves the
signatures read: no optimizer slots, scores, admission counts or free
capacity) and ``variables/``, a full ``jr.Checkpoint`` of the object
(``jr.Checkpoint(model=...).restore(path / "variables")`` resumes training).
``load`` needs JAX and jaxres, not the code that built the object.

Examples:
  >>> import tempfile, jax, jax.numpy as jnp, numpy as np, jaxres as jr
  >>> table = jr.MutableHashTable(np.int64, np.float32, default_value=-1.0)
  >>> table.insert(np.array([7, 2**40]), np.array([0.5, 1.5], np.float32))
  >>> spec = jax.ShapeDtypeStruct(("batch",), jnp.int64)
  >>> path = tempfile.mkdtemp() + "/export"
  >>> lookup = jr.saved_model.Signature(lambda t, ids: t.find(ids), ids=spec)
  >>> jr.saved_model.save(table, path, {"lookup": lookup})
  >>> served = jr.saved_model.load(path)
  >>> served.signatures["lookup"](ids=np.array([2**40, 3]))["output"].tolist()
  [1.5, -1.0]
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

from jaxres._serving import directory, program, served_state
from jaxres._serving.loaded import LoadedModel, LoadedSignature
from jaxres._serving.signature import Input, Signature
from jaxres._tracking.checkpoint import Checkpoint

__all__ = ["LoadedModel", "LoadedSignature", "Signature", "load", "save"]

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
FORMATS = ("jaxres", "tf")


def save(obj, path, signatures, *, platforms=("cpu", "cuda"), format: str = "jaxres") -> None:
  """Exports ``obj`` with its ``signatures`` to the directory ``path``.

  Args:
    obj: what ``jr.Checkpoint`` saves: an NNX object (a model, a jaxres
      table or embedding), a ``jr.AutoTrackable``, a functional table, or
      lists, tuples and dicts of these; each signature reads it in inference
      mode (``eval()``), its tables in read-only form.
    path: the directory to write (new, empty, or an earlier saved model,
      replaced whole).
    signatures: ``{name: jr.saved_model.Signature(fn, **inputs)}``.
    platforms: the platforms every program is lowered for (``"cpu"``,
      ``"cuda"``, ``"rocm"``, ``"tpu"``); lowering needs no such device.
    format: ``"jaxres"`` (load with :func:`load`) or ``"tf"``, a TensorFlow
      SavedModel that stock TensorFlow serves without JAX or jaxres (needs
      ``tensorflow``, never a dependency of jaxres).

  Raises:
    TypeError: bad arguments (naming them), or a signature that changes the
      object or returns something other than arrays (naming it); nothing is
      written.
    ValueError: bad argument values (naming them); nothing is written.

  Examples:
    >>> import tempfile, jax, numpy as np, jaxres as jr
    >>> table = jr.SortedTable.create(8, key=np.int32, value=np.float32, default=-1.0)
    >>> table = table.insert(np.array([3], np.int32), np.array([0.5], np.float32))
    >>> ids = jax.ShapeDtypeStruct(("batch",), np.int32)
    >>> path = tempfile.mkdtemp() + "/export"
    >>> find = jr.saved_model.Signature(lambda t, ids: t.find(ids), ids=ids)
    >>> jr.saved_model.save(table, path, {"find": find})
    >>> jr.saved_model.load(path).signatures["find"](ids=np.array([3, 4], np.int32))["output"].tolist()
    [0.5, -1.0]
  """
  path = directory.check_target(path)
  signatures = _check_signatures(signatures)
  platforms = _check_platforms(platforms)
  if format not in FORMATS:
    raise ValueError(f"format: expected one of {FORMATS}, got {format!r}.")
  state = served_state.split(served_state.serving_copy(obj))
  leaves = state[0]
  programs = {name: program.export(name, sig, state, platforms) for name, sig in signatures.items()}
  used = sorted({i for p in programs.values() for i in p.state})
  position = {leaf: k for k, leaf in enumerate(used)}
  state = directory.host(leaves[i] for i in used)

  def checkpoint(staged: Path) -> None:
    Checkpoint(model=obj).save(staged / ("variables" if format == "jaxres" else "jaxres_variables"))

  if format == "tf":
    from jaxres._serving import tf_savedmodel  # imports TensorFlow: only for this format

    tf_savedmodel.write(path, signatures, programs, position, state, checkpoint)
    return
  manifest = {
    "platforms": list(platforms),
    "signatures": [
      {
        "name": name,
        "inputs": [i.to_json() for i in signatures[name].parsed],
        "outputs": p.outputs,
        "max_length": signatures[name].max_length,
        "state": [position[i] for i in p.state],
      }
      for name, p in programs.items()
    ],
  }
  blobs = [bytes(p.exported.serialize()) for p in programs.values()]
  directory.write(path, manifest, blobs, state, checkpoint)


def load(path) -> LoadedModel:
  """The saved model at ``path`` (format ``"jaxres"``): ``load(path).signatures[name](**inputs)``.

  Args:
    path: a directory :func:`save` wrote.

  Returns:
    The model, whose ``signatures`` call the saved programs by input name.

  Examples:
    >>> import tempfile, jax, numpy as np, jaxres as jr
    >>> path = tempfile.mkdtemp() + "/export"
    >>> twice = jr.saved_model.Signature(lambda obj, x: 2 * x, x=jax.ShapeDtypeStruct((2,), np.float32))
    >>> jr.saved_model.save(jr.AutoTrackable(), path, {"twice": twice})
    >>> jr.saved_model.load(path).signatures["twice"](x=np.ones(2, np.float32))["output"].tolist()
    [2.0, 2.0]

  Raises:
    TypeError: ``path`` is not a path.
    ValueError: naming ``path``: missing, not a jaxres saved model, a newer
      format version, damaged, or lowered for none of this process's platforms.
  """
  if not isinstance(path, (str, os.PathLike)):
    raise TypeError(f"path: expected a directory path, got {type(path).__name__}.")
  path = Path(path)
  manifest, blobs, state = directory.read(path)
  platform = jax.default_backend()
  platforms = tuple(manifest.get("platforms", ()))
  if platform not in platforms and not (platform == "gpu" and {"cuda", "rocm"} & set(platforms)):
    raise ValueError(f"{path}: lowered for {platforms}, not for this process's platform {platform!r}.")
  arrays = [jax.numpy.asarray(x) for x in state]
  signatures = {}
  try:
    for entry, blob in zip(manifest["signatures"], blobs, strict=True):
      inputs = tuple(Input.from_json(i) for i in entry["inputs"])
      exported = jax.export.deserialize(bytearray(blob))
      taken = [arrays[k] for k in entry["state"]]
      signatures[entry["name"]] = LoadedSignature(
        entry["name"], inputs, entry["outputs"], entry["max_length"], exported, taken
      )
  except (KeyError, TypeError, ValueError, IndexError) as err:
    raise ValueError(f"{path}: corrupted saved model ({err}).") from None
  return LoadedModel(path, signatures, platforms)


def _check_signatures(signatures) -> dict[str, Signature]:
  if not isinstance(signatures, dict) or not signatures:
    raise TypeError(f"signatures: expected {{name: jr.saved_model.Signature}}, got {signatures!r}.")
  for name, sig in signatures.items():
    if not isinstance(name, str) or not name:
      raise TypeError(f"signatures: names must be non-empty strings, got {name!r}.")
    if not isinstance(sig, Signature):
      raise TypeError(f"signatures[{name!r}]: expected a jr.saved_model.Signature, got {type(sig).__name__}.")
  return dict(signatures)


def _check_platforms(platforms) -> tuple[str, ...]:
  if isinstance(platforms, str) or not all(isinstance(p, str) for p in platforms) or not platforms:
    raise TypeError(
      f"platforms: expected a tuple of platform names such as ('cpu', 'cuda'), got {platforms!r}."
    )
  unknown = [p for p in platforms if p not in PLATFORMS]
  if unknown:
    raise ValueError(f"platforms: unknown {unknown}; expected some of {PLATFORMS}.")
  return tuple(dict.fromkeys(platforms))
