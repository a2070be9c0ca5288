"""Reading files that jaxres did not necessarily write: confined, regular, bounded.

Every file jaxres reads back (a checkpoint's manifest, a saved model's
manifest, programs and state, a serving delta) may come from a damaged disk
or from someone else. The functions here are the one way such files are
opened:

* **confined**: a name from a manifest is a relative path of plain parts (no
  absolute path, no ``..``), and the file it names, symlinks resolved, lies
  inside the directory being read;
* **regular**: opened without blocking and checked to be a regular file, so
  a FIFO or a device in place of a file is refused instead of hanging;
* **bounded**: a ``.npy`` file's header is read first and checked (no
  objects, the dtype and shape expected, its data exactly as long as the file
  holds) before anything the size of its claim is allocated.

Every failure is a ``ValueError`` naming the file.
"""

from __future__ import annotations

import json
import os
import stat
import zlib
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

SEAL = "manifest_crc32"  # a JSON manifest's own checksum, a field of the document written
_NPY_HEADERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


def sealed(manifest: dict) -> dict:
  """``manifest`` with its own checksum (of its canonical JSON), which :func:`unsealed` checks."""
  return manifest | {SEAL: _checksum(manifest)}


def unsealed(manifest: Any, label: Any, *, required: bool = False) -> Any:
  """``manifest`` as read, without its checksum once that is checked.

  ``required``: the manifest's version is always written sealed, so a missing
  checksum is damage; otherwise a manifest without one (written before
  checksums) is taken as it is. Either way a field whose name differs from the
  checksum's in a letter or two is damage (a flipped bit would otherwise switch
  the check off).

  Raises:
    ValueError: naming ``label``: the manifest is not the one written (its checksum differs, is
      missing where ``required``, or its name is damaged).

  Examples:
    >>> unsealed(sealed({"rows": 3}), "m")
    {'rows': 3}
    >>> unsealed(sealed({"rows": 3}) | {"rows": 2}, "m")
    Traceback (most recent call last):
    ...
    ValueError: m: corrupted manifest (its checksum differs from the one written).
    >>> unsealed({"rows": 3, "manifest_crc33": 0}, "m")
    Traceback (most recent call last):
    ...
    ValueError: m: corrupted manifest (a field 'manifest_crc33' where its checksum 'manifest_crc32' belongs).
    >>> unsealed({"rows": 3}, "m", required=True)
    Traceback (most recent call last):
    ...
    ValueError: m: corrupted manifest (its checksum is missing; this version is always written with one).
  """
  if not isinstance(manifest, dict):
    return manifest
  for key in manifest:
    if key != SEAL and _near(key, SEAL):
      raise ValueError(f"{label}: corrupted manifest (a field {key!r} where its checksum {SEAL!r} belongs).")
  if SEAL not in manifest:
    if required:
      raise ValueError(
        f"{label}: corrupted manifest (its checksum is missing; this version is always written with one)."
      )
    return manifest
  manifest = dict(manifest)
  if manifest.pop(SEAL) != _checksum(manifest):
    raise ValueError(f"{label}: corrupted manifest (its checksum differs from the one written).")
  return manifest


def _near(key: Any, name: str) -> bool:
  """Whether ``key`` is ``name`` with one or two of its characters changed (bit flips keep the length)."""
  return isinstance(key, str) and len(key) == len(name) and sum(a != b for a, b in zip(key, name)) <= 2


def _checksum(manifest: dict) -> int:
  return zlib.crc32(json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode())


def directory_path(path: Any, name: str = "path") -> str:
  """``path`` (a str or os.PathLike) made absolute, where a directory is or may be made: neither it nor
  a folder above it is a file (a checkpoint or saved model written there would replace the file, or
  fail halfway with a bare ``OSError``).

  Raises:
    TypeError: ``path`` is not a str or os.PathLike (the error names ``name``).
    ValueError: ``path``, or a folder above it, is a file (naming ``name`` and that file).

  Examples:
    >>> import tempfile, os
    >>> file = tempfile.NamedTemporaryFile()
    >>> directory_path(os.path.join(file.name, "step"), "directory")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: directory: ... is a file; expected a directory (or a new path) there.
  """
  try:
    absolute = os.path.abspath(os.fspath(path))
  except TypeError:
    raise TypeError(f"{name}: expected a str or os.PathLike, got {path!r}.") from None
  for at in (absolute, *Path(absolute).parents):
    if os.path.lexists(at):
      if not os.path.isdir(at):
        raise ValueError(f"{name}: {at} is a file; expected a directory (or a new path) there.")
      break
  return absolute


def confined(root: Path, name: Any, what: str) -> Path:
  """``root / name`` for a ``name`` read from a manifest, once it is known to stay inside ``root``.

  Raises:
    ValueError: naming ``what``: ``name`` is not a relative path of plain
      parts, or what it names (symlinks followed) is outside ``root``.

  Examples:
    >>> from pathlib import Path
    >>> confined(Path("/srv/delta"), "emb/keys.npy", "array").as_posix()
    '/srv/delta/emb/keys.npy'
    >>> confined(Path("/srv/delta"), "../../etc/passwd", "array")
    Traceback (most recent call last):
    ...
    ValueError: /srv/delta: array '../../etc/passwd' is not a plain relative name inside the directory.
  """
  parts = name.split("/") if isinstance(name, str) else None
  if not parts or any(part in ("", ".", "..") or "\\" in part or "\0" in part for part in parts):
    raise ValueError(f"{root}: {what} {name!r} is not a plain relative name inside the directory.")
  path = root.joinpath(*parts)
  if not _resolved(path, f"{root}: {what} {name!r}").is_relative_to(_resolved(root, root)):
    raise ValueError(f"{root}: {what} {name!r} leads outside the directory (a symbolic link).")
  return path


def _resolved(path: Path, label: Any) -> Path:
  """``path`` with its symbolic links followed; a ``ValueError`` naming ``label`` for a loop of them
  (Python raises ``RuntimeError`` for one before 3.13, ``OSError`` after)."""
  try:
    return path.resolve()
  except (RuntimeError, OSError) as err:
    raise ValueError(f"{label}: its symbolic links cannot be followed ({err}).") from None


def open_regular(path: Path) -> BinaryIO:
  """``path`` opened for reading, once it is known to be a regular file (opened without blocking,
  so a FIFO in its place is refused rather than waited on).

  Raises:
    ValueError: naming ``path``: missing, unreadable, or not a regular file.
  """
  try:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
  except OSError as err:
    raise ValueError(f"{path}: cannot be read ({err.strerror or err}).") from None
  if not stat.S_ISREG(os.fstat(fd).st_mode):
    os.close(fd)
    raise ValueError(f"{path}: not a regular file.")
  return os.fdopen(fd, "rb")


def read_bytes(path: Path) -> bytes:
  """The bytes of the regular file ``path`` (see :func:`open_regular`)."""
  with open_regular(path) as f:
    return f.read()


def read_json(path: Path, what: str = "file") -> Any:
  """The JSON document in the regular file ``path`` (``what`` it is, for errors).

  Raises:
    ValueError: naming ``path``: not a regular file, or not UTF-8 JSON.
  """
  try:
    return json.loads(read_bytes(path).decode("utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
    raise ValueError(f"{path}: corrupted {what} ({type(err).__name__}: {err}).") from None


def load_npy(path: Path, dtype: Any = None, shape: Any = None) -> np.ndarray:
  """The array in the ``.npy`` file ``path``, its header checked before its data is read.

  ``dtype`` and ``shape``: what the array must be (``None``: anything without
  Python objects). The data must fill the rest of the file exactly, so no
  claim in a header allocates more than the file holds.

  Raises:
    ValueError: naming ``path``: not a regular file, a damaged header, another
      dtype or shape than expected, or data shorter or longer than its header says.

  Examples:
    >>> import tempfile, numpy as np
    >>> from pathlib import Path
    >>> file = Path(tempfile.mkdtemp()) / "a.npy"
    >>> np.save(file, np.arange(3, dtype=np.int32))
    >>> load_npy(file, "int32", [3]).tolist()
    [0, 1, 2]
    >>> load_npy(file, "int64", [3])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: ...a.npy: holds int32[3], expected int64[3].
  """
  with open_regular(path) as f:
    try:
      version = np.lib.format.read_magic(f)
      read_header = _NPY_HEADERS.get(version)
      if read_header is None:
        raise ValueError(f"format version {version}")
      found_shape, fortran, found_dtype = read_header(f)
    except Exception as err:  # NumPy parses a damaged header with Python's tokenizer: any error
      raise ValueError(f"{path}: not a readable .npy file ({type(err).__name__}: {err}).") from None
    if found_dtype.hasobject:
      raise ValueError(f"{path}: holds Python objects, which jaxres never writes.")
    try:
      want_dtype = found_dtype if dtype is None else np.dtype(dtype)
    except TypeError:
      raise ValueError(f"{path}: described as of dtype {dtype!r}, which is not a dtype.") from None
    want_shape = list(found_shape) if shape is None else list(shape)
    if found_dtype != want_dtype or list(found_shape) != want_shape:
      raise ValueError(f"{path}: holds {found_dtype}{list(found_shape)}, expected {want_dtype}{want_shape}.")
    nbytes = int(np.prod(found_shape, dtype=object)) * found_dtype.itemsize
    if os.fstat(f.fileno()).st_size - f.tell() != nbytes:
      raise ValueError(f"{path}: its data is not the {nbytes} bytes its header says.")
    data = bytearray(f.read(nbytes))
  return np.frombuffer(data, found_dtype).reshape(found_shape, order="F" if fortran else "C")


def check_tree(root: Path) -> None:
  """Checks that everything below the directory ``root`` is a directory or a regular file, and
  that no symbolic link there leads outside it (before a library reads the files on its own).

  Raises:
    ValueError: naming the first entry that is neither, or a link leaving ``root``.
  """
  top = _resolved(root, root)
  for directory, dirs, files in os.walk(root):
    for name in dirs + files:
      path = Path(directory, name)
      if not _resolved(path, path).is_relative_to(top):
        raise ValueError(f"{path}: a symbolic link leading outside {root}.")
      mode = path.stat().st_mode if path.exists() else 0
      if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
        raise ValueError(f"{path}: not a regular file or directory.")
