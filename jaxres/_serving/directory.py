"""The export directory of ``jr.saved_model`` (format ``"jaxres"``), written and read back.

::

  saved_model.json      what the directory holds: the signatures (inputs, outputs, which
                        state arrays each program takes), the state arrays (dtype, shape,
                        CRC-32), the platforms, the format version
  programs/<i>.jaxexport  each signature's serialized ``jax.export`` program
  state/<i>.npy         the serving state: the arrays the programs read (of an updatable
                        export's tables, only the rows in use: ``"rows"`` says how many
                        the programs take, the rest is padded with zeros at load)
  variables/            a full ``jr.Checkpoint`` of the object (children: ``model``)

A delta (:mod:`updates`) is a directory of named arrays (``<name>.npy``) and a
manifest describing them (:func:`write_files`, :func:`read_files`).

A directory is written under a temporary name beside ``path`` and renamed
into place, so an interrupted save leaves nothing at ``path``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import zlib
from pathlib import Path

import jax
import numpy as np

FORMAT = "jaxres.saved_model"
VERSION = 2  # 2: state arrays may hold only their rows in use ("rows"); written only where they do
READS = (1, 2)
MANIFEST = "saved_model.json"


def write(
  path: Path, manifest: dict, programs: list[bytes], state: list[np.ndarray], fill, rows: dict | None = None
) -> None:
  """Writes the directory at ``path``; ``fill(staged)`` adds to it first (see :func:`replace`).

  ``rows``: for the arrays of ``state`` (by index) that hold free rows, ``(in_use, total)``: only the
  first ``in_use`` rows are written, and the manifest says the programs take ``total``.
  """
  rows = rows or {}
  path.parent.mkdir(parents=True, exist_ok=True)
  staged = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
  try:
    (staged / "programs").mkdir()
    (staged / "state").mkdir()
    for i, blob in enumerate(programs):
      (staged / "programs" / f"{i}.jaxexport").write_bytes(blob)
    described = []
    for i, array in enumerate(state):
      in_use, total = rows.get(i, (len(array) if array.ndim else None, None))
      entry = _save(staged / "state" / f"{i}.npy", array[:in_use] if total else array)
      described.append(entry | ({"rows": total} if total else {}))
    fill(staged)
    version = VERSION if rows else 1  # what a jaxres without padded rows still reads
    text = json.dumps({"format": FORMAT, "version": version, **manifest, "state": described}, indent=1)
    (staged / MANIFEST).write_text(text)
    replace(staged, path)
  except BaseException:
    shutil.rmtree(staged, ignore_errors=True)
    raise


def _save(file: Path, array: np.ndarray) -> dict:
  np.save(file, array, allow_pickle=False)
  return {"dtype": array.dtype.name, "shape": list(array.shape), "crc32": zlib.crc32(array.tobytes())}


def write_files(path: Path, name: str, manifest: dict, arrays: dict[str, np.ndarray]) -> None:
  """Writes a directory of the named ``arrays`` (``<name>.npy``, names may hold ``/``) and the JSON
  ``manifest`` (as the file ``name``, with each array described), replacing one at ``path``."""
  path.parent.mkdir(parents=True, exist_ok=True)
  staged = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
  try:
    described = {}
    for key, array in arrays.items():
      (staged / key).parent.mkdir(parents=True, exist_ok=True)
      described[key] = _save(staged / f"{key}.npy", np.asarray(array))
    (staged / name).write_text(json.dumps(manifest | {"arrays": described}, indent=1))
    replace(staged, path)
  except BaseException:
    shutil.rmtree(staged, ignore_errors=True)
    raise


def read_files(path: Path, name: str, format: str, what: str) -> tuple[dict, dict[str, np.ndarray]]:
  """``(manifest, arrays)`` of a directory :func:`write_files` wrote with ``{"format": format}``
  (``what``: what such a directory is, for errors).

  Raises:
    ValueError: naming ``path``: no such manifest, another format, or a damaged file.
  """
  manifest = _manifest(path, name, format, what)
  try:
    arrays = {key: _array(path / f"{key}.npy", entry) for key, entry in manifest["arrays"].items()}
  except (OSError, KeyError, TypeError, ValueError, AttributeError) as err:
    raise ValueError(f"{path}: corrupted ({err}).") from None
  return manifest, arrays


def _manifest(path: Path, name: str, format: str, what: str) -> dict:
  file = path / name
  if not file.is_file():
    raise ValueError(f"{path}: not a {what} (no {name}).")
  try:
    manifest = json.loads(file.read_text())
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
    raise ValueError(f"{path}: corrupted {name} ({err}).") from None
  if not isinstance(manifest, dict) or manifest.get("format") != format:
    raise ValueError(f"{path}: {name} does not describe a {what}.")
  return manifest


def check_target(path, what: str = "saved model", holds=None) -> Path:
  """``path`` as a ``Path`` a saved model (or a ``what`` that ``holds(path)`` recognises) may be
  written to: new, empty, or an earlier one, to be replaced.

  Raises:
    TypeError: ``path`` is not a string or path.
    ValueError: it names a file, or a directory holding something else.
  """
  if not isinstance(path, (str, os.PathLike)):
    raise TypeError(f"path: expected a directory path, got {type(path).__name__}.")
  path = Path(path)
  if path.exists() and not path.is_dir():
    raise ValueError(f"path: {path} is a file; expected a directory to write the {what} to.")
  if path.is_dir() and any(path.iterdir()) and not (holds or _is_saved_model)(path):
    raise ValueError(f"path: {path} holds files that are not a {what}; choose an empty or new directory.")
  return path


def read_manifest(path: Path) -> dict:
  """The manifest of the saved model at ``path``.

  Raises:
    ValueError: naming ``path``: no jaxres saved model there.
  """
  return _manifest(path, MANIFEST, FORMAT, "jaxres saved model")


def _is_saved_model(path: Path) -> bool:
  return (path / MANIFEST).is_file() or (path / "saved_model.pb").is_file()


def replace(staged: Path, path: Path) -> None:
  """Moves the finished directory ``staged`` to ``path``, replacing an earlier saved model there."""
  if path.exists():
    old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old.", dir=path.parent))
    os.replace(path, old / "model")
    os.replace(staged, path)
    shutil.rmtree(old, ignore_errors=True)
  else:
    os.replace(staged, path)


def read(path: Path) -> tuple[dict, list[bytes], list[np.ndarray]]:
  """``(manifest, programs, state)`` of the directory at ``path``.

  Raises:
    ValueError: naming ``path``: not a jaxres export, a newer format version,
      or a damaged file (missing, unreadable, or not the bytes it was saved as).
  """
  manifest = read_manifest(path)
  if manifest.get("version") not in READS:
    raise ValueError(
      f"{path}: saved model format version {manifest.get('version')!r}; this jaxres reads versions "
      f"{', '.join(map(str, READS))}."
    )
  try:
    programs = [
      (path / "programs" / f"{i}.jaxexport").read_bytes() for i in range(len(manifest["signatures"]))
    ]
    state = [
      _padded(_array(path / "state" / f"{i}.npy", entry), entry) for i, entry in enumerate(manifest["state"])
    ]
  except (OSError, KeyError, TypeError, ValueError) as err:
    raise ValueError(f"{path}: corrupted saved model ({err}).") from None
  return manifest, programs, state


def _padded(array: np.ndarray, entry: dict) -> np.ndarray:
  """``array`` with the free rows the manifest ``entry`` says its programs take (zeros)."""
  total = entry.get("rows")
  if total is None:
    return array
  if not isinstance(total, int) or total < len(array):
    raise ValueError(f"rows {total!r} of an array of {len(array)} rows")
  return np.concatenate([array, np.zeros((total - len(array), *array.shape[1:]), array.dtype)])


def _array(file: Path, entry: dict) -> np.ndarray:
  array = np.load(file, allow_pickle=False)
  if array.dtype.name != entry["dtype"] or list(array.shape) != entry["shape"]:
    raise ValueError(
      f"{file.name} holds {array.dtype}{list(array.shape)}, saved as {entry['dtype']}{entry['shape']}"
    )
  if zlib.crc32(array.tobytes()) != entry["crc32"]:
    raise ValueError(f"{file.name} is not the array saved (CRC-32 differs)")
  return array


def host(arrays) -> list[np.ndarray]:
  """Device arrays as host NumPy arrays (gathered from every device they are split over)."""
  return [np.asarray(jax.device_get(x)) for x in arrays]
