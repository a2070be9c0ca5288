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

from jaxres._core.storages.sorted import read_only
from jaxres._persistence import files
from jaxres._serving import buckets, directory, program, served_state, updates
from jaxres._serving.loaded import LoadedModel, LoadedSignature
from jaxres._serving.signature import Input, Signature
from jaxres._tracking.checkpoint import Checkpoint

__all__ = ["LoadedModel", "LoadedSignature", "Signature", "load", "save", "save_delta"]

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
BATCH_SIZES = buckets.DEFAULT  # a choice of batch_sizes (load; save with format 'tf'): 1, 4, 16, ..., 1024
FORMATS = ("jaxres", "tf")


def save(
  obj,
  path,
  signatures,
  *,
  platforms=("cpu", "cuda"),
  format: str = "jaxres",
  updatable: bool = False,
  step: int | None = None,
  batch_sizes=None,
) -> None:
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
    updatable: serve each table with room for its training table's capacity,
      so that the loaded model takes the deltas of later steps
      (:func:`save_delta`, :meth:`LoadedModel.update`) without recompiling;
      the directory still holds only the live entries (format ``"jaxres"``).
    step: with ``updatable``, the training step exported (deltas follow it;
      default 0).
    batch_sizes: format ``"tf"``: the batch sizes each signature pads
      requests to inside the SavedModel, as :func:`load` does (default
      ``None``: no padding); TensorFlow compiles each on its first request.
      Format ``"jaxres"`` takes them at :func:`load`.

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
  if not isinstance(updatable, bool):
    raise TypeError(f"updatable: expected a bool, got {updatable!r}.")
  if updatable and format != "jaxres":
    raise ValueError(f"updatable: only a saved model of format 'jaxres' takes deltas, not {format!r}.")
  if step is not None and not updatable:
    raise ValueError("step: only an updatable export (updatable=True) records the step deltas follow.")
  step = _check_step(0 if step is None else step)
  batch_sizes = buckets.check(batch_sizes)
  if format == "jaxres" and batch_sizes is not None:
    raise ValueError("batch_sizes: a 'jaxres' export takes them at load (jr.saved_model.load).")
  recorder = updates.Recorder() if updatable else None
  state = served_state.split(served_state.serving_copy(obj, recorder or read_only))
  leaves, names, _ = state
  programs = {name: program.export(name, sig, state, platforms) for name, sig in signatures.items()}
  used = sorted({i for p in programs.values() for i in p.state})
  position = {leaf: k for k, leaf in enumerate(used)}
  state = directory.host(leaves[i] for i in used)

  def checkpoint(staged: Path) -> None:
    Checkpoint(model=obj).save(staged / ("variables" if format == "jaxres" else "jaxres_variables"))

  if format == "tf":
    from jaxres._serving import tf_savedmodel  # imports TensorFlow: only for this format

    tf_savedmodel.write(path, signatures, programs, position, state, checkpoint, batch_sizes)
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
  rows = None
  if recorder is not None:
    manifest["updates"], extra, rows = updates.lineage(recorder, leaves, names, position, step)
    state += extra
  blobs = [bytes(p.exported.serialize()) for p in programs.values()]
  directory.write(path, manifest, blobs, state, checkpoint, rows)
  if recorder is not None:
    updates.written(manifest["updates"], obj)


def save_delta(obj, path, since, *, step: int) -> None:
  """Writes what changed in ``obj`` since the updatable export or delta at ``since``, for
  :meth:`LoadedModel.update` of a model serving ``since``'s step.

  Of each table, the entries inserted or changed since (read from its change
  stamps, O(changed) entries and one bit per slot) and which slots hold an
  entry now, so that the served model drops those removed or evicted; a table
  rebuilt since (grown, re-sharded, or a sorted table) comes whole, and so
  does every table when ``since`` was not written by this process from this
  same ``obj`` (a restarted trainer's first delta). Other arrays the
  signatures read come whole where their bytes changed.

  Args:
    obj: the object exported to ``since``'s chain, trained further.
    path: the directory to write (new, empty, or an earlier delta, replaced).
    since: the export (``save(..., updatable=True)``) or the delta this one follows.
    step: this delta's training step, after ``since``'s.

  Raises:
    TypeError: bad arguments (naming them).
    ValueError: ``since`` is not an updatable export or a delta; ``obj`` is
      another model (other arrays or tables); ``step`` is not after
      ``since``'s; a table holds more entries than the served model has
      room for (export it again). Nothing is written.

  Examples:
    >>> import tempfile, jax, numpy as np, jaxres as jr
    >>> table = jr.OpenAddressingTable.create(64, key=np.int32, value=np.float32, default=-1.0)
    >>> table = table.insert(np.array([1, 2], np.int32), np.array([0.5, 1.5], np.float32))
    >>> ids = jax.ShapeDtypeStruct(("n",), np.int32)
    >>> find = jr.saved_model.Signature(lambda t, ids: t.find(ids), ids=ids)
    >>> root = tempfile.mkdtemp()
    >>> jr.saved_model.save(table, root + "/export", {"find": find}, updatable=True, step=0)
    >>> served = jr.saved_model.load(root + "/export")
    >>> table = table.insert(np.array([3], np.int32), np.array([2.5], np.float32))
    >>> table = table.remove(np.array([1], np.int32))
    >>> jr.saved_model.save_delta(table, root + "/delta", since=root + "/export", step=1)
    >>> served.update(root + "/delta")
    >>> served.step, served.signatures["find"](ids=np.array([1, 2, 3], np.int32))["output"].tolist()
    (1, [-1.0, 1.5, 2.5])
  """
  path = updates.check_target(path)
  if not isinstance(since, (str, os.PathLike)):
    raise TypeError(f"since: expected the path of an export or a delta, got {type(since).__name__}.")
  updates.write_delta(obj, path, Path(since), _check_step(step))


def _check_step(step) -> int:
  if not isinstance(step, int) or isinstance(step, bool) or step < 0:
    raise TypeError(f"step: expected an int >= 0, got {step!r}.")
  return step


def load(path, *, batch_sizes=None, precompile: bool = True) -> LoadedModel:
  """The saved model at ``path`` (format ``"jaxres"``): ``load(path).signatures[name](**inputs)``.

  By default a signature runs its program at each request's own shape:
  results equal the original function's at that shape, bitwise, and XLA
  compiles a program the first time each batch size comes (0.5-1 s). With
  ``batch_sizes`` (e.g. :data:`BATCH_SIZES`: 1, 4, 16, 64, 256, 1024), each
  request's batch dimension (the named dimension every output of a
  signature starts with) is padded with zeros up to the smallest size that
  holds it and the results are cut back; a request larger than the largest
  size runs in chunks of the largest. No request then waits for a compile,
  but each output row must depend only on the same row of the inputs (as
  for a batch of independent requests), and the results are the function's
  on the padded batch: equal to a run at the exact size up to float rounding
  (XLA may round a float op of one shape differently from another's), so
  padding is opt-in.

  Args:
    path: a directory :func:`save` wrote.
    batch_sizes: the batch sizes requests are padded to, each compiled once
      (:data:`BATCH_SIZES`: 1, 4, 16, 64, 256 and 1024, so that a request
      runs fewer than 4 times its rows); default ``None``: no padding, each
      batch size compiles a program of its own on first use (a signature
      keeps the 32 it used last: an older size compiles again).
    precompile: compile each batch size's program now (default), so that no
      request waits for a compilation; ``False``: each on its first use. A
      signature with other named dimensions compiles on first use of each
      of their sizes.

  Returns:
    The model, whose ``signatures`` call the saved programs by input name.

  Examples:
    >>> import tempfile, jax, numpy as np, jaxres as jr
    >>> path = tempfile.mkdtemp() + "/export"
    >>> twice = jr.saved_model.Signature(lambda obj, x: 2 * x, x=jax.ShapeDtypeStruct((2,), np.float32))
    >>> jr.saved_model.save(jr.AutoTrackable(), path, {"twice": twice})
    >>> jr.saved_model.load(path).signatures["twice"](x=np.ones(2, np.float32))["output"].tolist()
    [2.0, 2.0]
    >>> rows = jr.saved_model.Signature(lambda obj, x: x + 1, x=jax.ShapeDtypeStruct(("batch", 2), np.int32))
    >>> jr.saved_model.save(jr.AutoTrackable(), path, {"rows": rows})
    >>> served = jr.saved_model.load(path, batch_sizes=(8, 64)).signatures["rows"]  # two programs compiled
    >>> served.batch_sizes, served(x=np.ones((3, 2), np.int32))["output"].shape  # 3 rows run as 8
    ((8, 64), (3, 2))

  Raises:
    TypeError: ``path`` is not a path; ``batch_sizes`` is not a sequence of
      ints or ``None``; ``precompile`` is not a bool.
    ValueError: a batch size out of ``[1, 2**20]`` or repeated; naming
      ``path``: missing, a file, not a jaxres saved model, a newer format version,
      damaged, or lowered for none of this process's platforms; a 64-bit
      integer input exported with ``jax_enable_x64`` on, in a process where it
      is off (an export made with it off serves in either setting).
  """
  path = Path(files.directory_path(path))
  batch_sizes = buckets.check(batch_sizes)
  if not isinstance(precompile, bool):
    raise TypeError(f"precompile: expected a bool, got {precompile!r}.")
  manifest, blobs, stored = directory.read(path)
  platform = jax.default_backend()
  platforms = tuple(manifest.get("platforms", ()))
  if platform not in platforms and not (platform == "gpu" and {"cuda", "rocm"} & set(platforms)):
    raise ValueError(f"{path}: lowered for {platforms}, not for this process's platform {platform!r}.")
  signatures, takes, servable = {}, {}, {}  # takes: what the programs take of each state array
  try:
    for entry, blob in zip(manifest["signatures"], blobs, strict=True):
      inputs = servable[entry["name"]] = tuple(Input.from_json(i) for i in entry["inputs"])
      exported = jax.export.deserialize(bytearray(blob))
      places = entry["state"]
      for k, aval in zip(places, exported.in_avals[: len(places)], strict=True):
        if takes.setdefault(k, aval) != aval:
          raise ValueError(f"programs take state {k} in two shapes")
      signatures[entry["name"]] = LoadedSignature(
        entry["name"], inputs, entry["outputs"], entry["max_length"], exported, places, batch_sizes
      )
  except (KeyError, TypeError, ValueError, IndexError) as err:
    raise ValueError(f"{path}: corrupted saved model ({err}).") from None
  for name, inputs in servable.items():
    for each in inputs:
      each.check_servable(name)
  state = directory.padded(path, manifest, stored, takes)
  return LoadedModel(path, signatures, platforms, state, manifest.get("updates"), precompile)


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
