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
into place (:mod:`jaxres._persistence.replacing`): an interrupted save never
leaves a partial directory at ``path``, and one killed while replacing an
earlier directory is recovered by the next save or load there.
"""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxres._persistence import files, replacing

FORMAT = "jaxres.saved_model"
# 2: state arrays may hold only their rows in use ("rows"); 3: always sealed (files.sealed; earlier
# versions are read sealed or not)
VERSION = 3
READS = (1, 2, 3)
SEALED_SINCE = 3  # the first version whose manifests are all sealed (files.sealed): required from it on
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
  replacing.remove_stale(path)
  staged = Path(replacing.staging_dir(path))
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
    checksums = [zlib.crc32(blob) for blob in programs]
    contents = {"format": FORMAT, "version": VERSION, **manifest, "state": described, "programs": checksums}
    text = json.dumps(files.sealed(contents), indent=1)
    (staged / MANIFEST).write_text(text)
    replacing.replace(staged, path)
  except BaseException:
    shutil.rmtree(staged, ignore_errors=True)
    raise


def _save(file: Path, array: np.ndarray) -> dict:
  try:
    np.save(file, array, allow_pickle=False)
  except OSError as err:  # a full disk: NumPy's message names no file
    raise OSError(f"{file}: could not be written ({err}); nothing was replaced.") from err
  return {"dtype": array.dtype.name, "shape": list(array.shape), "crc32": zlib.crc32(array.tobytes())}


def write_files(path: Path, name: str, manifest: dict, arrays: dict[str, np.ndarray]) -> None:
  """Writes a directory of the named ``arrays`` (``<name>.npy``, names may hold ``/``) and the JSON
  ``manifest`` (as the file ``name``, with each array described), replacing one at ``path``."""
  path.parent.mkdir(parents=True, exist_ok=True)
  replacing.remove_stale(path)
  staged = Path(replacing.staging_dir(path))
  try:
    described = {}
    for key, array in arrays.items():
      (staged / key).parent.mkdir(parents=True, exist_ok=True)
      described[key] = _save(staged / f"{key}.npy", np.asarray(array))
    (staged / name).write_text(json.dumps(files.sealed(manifest | {"arrays": described}), indent=1))
    replacing.replace(staged, path)
  except BaseException:
    shutil.rmtree(staged, ignore_errors=True)
    raise


def read_files(
  path: Path, name: str, format: str, what: str, versions: tuple[int, ...], sealed_since: int
) -> tuple[dict, dict[str, np.ndarray]]:
  """``(manifest, arrays)`` of a directory :func:`write_files` wrote with ``{"format": format}`` and
  a version among ``versions``, sealed from version ``sealed_since`` on (``what``: what such a
  directory is, for errors). The arrays' names are confined to ``path`` and their files read as
  :func:`files.load_npy` does.

  Raises:
    ValueError: naming ``path``: no such manifest, another format or version, or a damaged file.
    OSError: another process replaced ``path`` during each read (see :func:`replacing.read_whole`).
  """
  read = lambda where: _read_files(Path(where), name, format, what, versions, sealed_since)
  return replacing.read_whole(path, read)


def _read_files(path: Path, name: str, format: str, what: str, versions: tuple[int, ...], sealed_since: int):
  manifest = _manifest(path, name, format, what, versions, sealed_since)
  described = manifest.get("arrays")
  if not isinstance(described, dict):
    raise ValueError(f"{path / name}: corrupted (no arrays described).")
  arrays = {
    key: _array(files.confined(path, f"{key}.npy", "array"), entry) for key, entry in described.items()
  }
  return manifest, arrays


def _manifest(
  path: Path, name: str, format: str, what: str, versions: tuple[int, ...], sealed_since: int
) -> dict:
  """The manifest ``name`` in ``path``: of ``format``, of one of ``versions``, and the one written
  (its checksum checked last, so that a newer version is said as such; every manifest of version
  ``sealed_since`` or later has one)."""
  file = path / name
  if not file.exists():
    raise ValueError(f"{path}: not a {what} (no {name}).")
  manifest = files.read_json(file, "manifest")
  if not isinstance(manifest, dict) or manifest.get("format") != format:
    raise ValueError(f"{path}: {name} does not describe a {what}.")
  if manifest.get("version") not in versions:
    raise ValueError(
      f"{path}: {what} format version {manifest.get('version')!r}; this jaxres reads versions "
      f"{', '.join(map(str, versions))}."
    )
  return files.unsealed(manifest, file, required=manifest["version"] >= sealed_since)


def check_target(path, what: str = "saved model", holds=None) -> Path:
  """``path`` as a ``Path`` a saved model (or a ``what`` that ``holds(path)`` recognises) may be
  written to: new, empty, or an earlier one, to be replaced.

  Raises:
    TypeError: ``path`` is not a string or path.
    ValueError: it, or a folder above it, is a file; or it is a directory holding something else.
  """
  path = Path(files.directory_path(path))
  if path.is_dir() and any(path.iterdir()) and not (holds or _is_saved_model)(path):
    raise ValueError(f"path: {path} holds files that are not a {what}; choose an empty or new directory.")
  return path


def read_manifest(path: Path) -> dict:
  """The manifest of the saved model at ``path``.

  Raises:
    ValueError: naming ``path``: no jaxres saved model there.
  """
  return replacing.read_whole(path, lambda where: _saved_model_manifest(Path(where)))


def _saved_model_manifest(path: Path) -> dict:
  return _manifest(path, MANIFEST, FORMAT, "jaxres saved model", READS, SEALED_SINCE)


def _is_saved_model(path: Path) -> bool:
  return (path / MANIFEST).is_file() or (path / "saved_model.pb").is_file()


def read(path: Path) -> tuple[dict, list[bytes], list[np.ndarray]]:
  """``(manifest, programs, state)`` of the directory at ``path``; an array of ``state`` that holds
  only its rows in use is padded by :func:`padded`, once its shape is checked against its programs.

  Raises:
    ValueError: naming ``path``: not a jaxres export, a newer format version,
      or a damaged file (missing, unreadable, or not the bytes it was saved as).
    OSError: another process replaced ``path`` during each read (see :func:`replacing.read_whole`).
  """
  return replacing.read_whole(path, lambda where: _read(Path(where)))


def _read(path: Path) -> tuple[dict, list[bytes], list[np.ndarray]]:
  manifest = _saved_model_manifest(path)
  signatures, described = manifest.get("signatures"), manifest.get("state")
  if not isinstance(signatures, list) or not isinstance(described, list):
    raise ValueError(f"{path / MANIFEST}: corrupted (no signatures or state described).")
  programs = [files.read_bytes(path / "programs" / f"{i}.jaxexport") for i in range(len(signatures))]
  checksums = manifest.get("programs")  # written since programs carry checksums
  if checksums is not None and checksums != [zlib.crc32(blob) for blob in programs]:
    raise ValueError(f"{path}: corrupted saved model (a program is not the one saved: CRC-32 differs).")
  state = [_array(path / "state" / f"{i}.npy", entry) for i, entry in enumerate(described)]
  return manifest, programs, state


def padded(
  path: Path, manifest: dict, state: list[np.ndarray], takes: dict[int, jax.ShapeDtypeStruct]
) -> list:
  """The ``state`` :func:`read` gave, each array checked against what its programs take (``takes``:
  by index, the shape and dtype of the programs' argument) and padded with zeros to the rows the
  manifest says they take. Nothing is allocated before the check.

  Raises:
    ValueError: naming ``path`` and the array: an array is not what its
      programs take, or one that no program takes would have more rows than
      the largest one they take.
  """
  out = []
  # An array no program takes (kept for deltas) has no more rows than the largest one they take.
  bound = max((want.shape[0] for want in takes.values() if want.shape), default=0)
  for i, (array, entry) in enumerate(zip(state, manifest["state"], strict=True)):
    total = entry.get("rows")
    want = takes.get(i)
    if total is not None and (
      not isinstance(total, int) or total < len(array) or (want is None and total > bound)
    ):
      raise ValueError(f"{path / MANIFEST}: corrupted (state {i}: rows {total!r} of {len(array)}).")
    shape = (array.shape if total is None else (total, *array.shape[1:])) if array.ndim else ()
    if want is not None and (tuple(want.shape) != tuple(shape) or np.dtype(want.dtype) != array.dtype):
      raise ValueError(
        f"{path / MANIFEST}: corrupted (state {i} is {array.dtype}{list(shape)}; its programs take "
        f"{np.dtype(want.dtype)}{list(want.shape)})."
      )
    if total is not None:
      array = np.concatenate([array, np.zeros((total - len(array), *array.shape[1:]), array.dtype)])
    out.append(array)
  return out


def _array(file: Path, entry: Any) -> np.ndarray:
  """The array in ``file`` once it is the one described by its manifest ``entry``."""
  if not isinstance(entry, dict) or not isinstance(entry.get("shape"), list) or "crc32" not in entry:
    raise ValueError(f"{file}: corrupted manifest entry {entry!r}.")
  array = files.load_npy(file, entry.get("dtype"), entry["shape"])
  if zlib.crc32(array.tobytes()) != entry["crc32"]:
    raise ValueError(f"{file}: not the array saved (CRC-32 differs).")
  return array


def host(arrays) -> list[np.ndarray]:
  """Arrays as host NumPy arrays (gathered from every device they are split over), in the dtype the
  programs take them in: a NumPy ``float64``/``int64``/``uint64`` array of the object, with
  ``jax_enable_x64`` off, as JAX converts it when the function runs (``float32``, ...)."""
  return [np.asarray(jax.device_get(x), jax.dtypes.canonicalize_dtype(x.dtype)) for x in arrays]
