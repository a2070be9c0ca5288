"""Table initializers: where a static table's keys and values come from."""

from __future__ import annotations

import enum
import errno
import os

import numpy as np

from jaxres._errors import check_int


def _host_array(data, name: str):
  """Keys or values given by the user -> (NumPy array, dtype or ``str``)."""
  arr = np.asarray(data, dtype=object if _all_strings(data) else None)
  if arr.dtype == object:
    if not _all_strings(arr.reshape(-1).tolist()):
      raise TypeError(f"{name}: expected numbers or strings, got a mixture.")
    return arr, str
  if arr.dtype.kind not in "biuf":
    raise TypeError(f"{name}: expected numbers or strings, got dtype {arr.dtype}.")
  return arr, arr.dtype


def _all_strings(data) -> bool:
  items = (
    np.asarray(data, dtype=object).reshape(-1).tolist() if not isinstance(data, (str, bytes)) else [data]
  )
  return bool(items) and all(isinstance(x, (str, bytes)) for x in items)


class KeyValueInitializer:
  """Keys and values given as arrays (the analogue of ``KeyValueTensorInitializer``).

  Args:
    keys: 1-D integers or strings.
    values: 1-D values of the same length (numbers or strings).
    key_dtype: optional dtype to cast the keys to (``str`` for strings).
    value_dtype: optional dtype to cast the values to (``str`` for strings).

  Examples:
    >>> import jaxres as jr
    >>> init = jr.KeyValueInitializer(["cat", "dog"], [0, 1])
    >>> jr.StaticHashTable(init, default_value=-1).find(["dog", "cow"]).tolist()
    [1, -1]
  """

  def __init__(self, keys, values, key_dtype=None, value_dtype=None):
    keys, inferred_key = _host_array(keys, "keys")
    values, inferred_value = _host_array(values, "values")
    if keys.ndim != 1 or values.shape[:1] != keys.shape:
      raise ValueError(
        f"keys, values: expected 1-D keys and as many values, got {keys.shape} and {values.shape}."
      )
    self.key_dtype = key_dtype if key_dtype is not None else inferred_key
    self.value_dtype = value_dtype if value_dtype is not None else inferred_value
    self._keys = keys if self.key_dtype is str else keys.astype(self.key_dtype)
    self._values = values if self.value_dtype is str else values.astype(self.value_dtype)

  def read(self) -> tuple[np.ndarray, np.ndarray]:
    """``(keys, values)`` as host arrays."""
    return self._keys, self._values


class TextFileIndex(enum.IntEnum):
  """Special column indices for :class:`TextFileInitializer`.

  Examples:
    >>> import jaxres as jr
    >>> int(jr.TextFileIndex.LINE_NUMBER), int(jr.TextFileIndex.WHOLE_LINE)
    (-1, -2)
  """

  WHOLE_LINE = -2
  LINE_NUMBER = -1


class TextFileInitializer:
  """Keys and values read from a text file, one entry per line.

  Each of ``key_index`` and ``value_index`` is a column number (columns are
  split by ``delimiter``), ``TextFileIndex.WHOLE_LINE`` or
  ``TextFileIndex.LINE_NUMBER`` (counting from 0), as in TensorFlow's
  ``TextFileInitializer``.

  Args:
    filename: path of a UTF-8 text file.
    key_dtype: ``str`` or an integer dtype.
    key_index: where the key of each line comes from.
    value_dtype: ``str`` or an integer / float dtype.
    value_index: where the value of each line comes from.
    delimiter: column separator.
    vocab_size: read only the first ``vocab_size`` lines (the file must have them).

  Examples:
    >>> import pathlib, tempfile, numpy as np, jaxres as jr
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "vocab.txt"
    >>> _ = path.write_text("the\\nquick\\nfox\\n")
    >>> whole, number = jr.TextFileIndex.WHOLE_LINE, jr.TextFileIndex.LINE_NUMBER
    >>> init = jr.TextFileInitializer(path, str, whole, np.int64, number)
    >>> init.read()[1].tolist()
    [0, 1, 2]
  """

  def __init__(
    self,
    filename,
    key_dtype,
    key_index: int,
    value_dtype,
    value_index: int,
    *,
    delimiter: str = "\t",
    vocab_size: int | None = None,
  ):
    if not isinstance(filename, (str, os.PathLike)):
      raise TypeError(f"filename: expected a path, got {filename!r}.")
    key_index, value_index = (
      check_int(
        index, name, low=TextFileIndex.WHOLE_LINE, expected="a column number >= 0, WHOLE_LINE or LINE_NUMBER"
      )
      for name, index in (("key_index", key_index), ("value_index", value_index))
    )
    if vocab_size is not None:
      vocab_size = check_int(vocab_size, "vocab_size", low=0)
    self.filename = os.fspath(filename)
    self.key_dtype, self.value_dtype = key_dtype, value_dtype
    self.key_index, self.value_index = key_index, value_index
    self.delimiter, self.vocab_size = delimiter, vocab_size

  def read(self) -> tuple[np.ndarray, np.ndarray]:
    """``(keys, values)`` parsed from the file.

    Raises:
      FileNotFoundError: no such file.
      ValueError: a line lacks the column, a field does not parse, or the file
        has fewer than ``vocab_size`` lines.
    """
    if not os.path.isfile(self.filename):
      raise FileNotFoundError(errno.ENOENT, "filename: no such file", self.filename)
    with open(self.filename, encoding="utf-8") as f:
      lines = f.read().splitlines()
    if self.vocab_size is not None:
      if len(lines) < self.vocab_size:
        raise ValueError(
          f"{self.filename}: vocab_size is {self.vocab_size} but the file has {len(lines)} lines."
        )
      lines = lines[: self.vocab_size]
    keys = [self._field(line, number, self.key_index, self.key_dtype) for number, line in enumerate(lines)]
    values = [
      self._field(line, number, self.value_index, self.value_dtype) for number, line in enumerate(lines)
    ]
    return _typed(keys, self.key_dtype), _typed(values, self.value_dtype)

  def _field(self, line: str, number: int, index: int, dtype):
    if index == TextFileIndex.LINE_NUMBER:
      text = str(number)
    elif index == TextFileIndex.WHOLE_LINE:
      text = line
    else:
      columns = line.split(self.delimiter)
      if index >= len(columns):
        raise ValueError(f"{self.filename}:{number + 1}: no column {index} in {line!r}.")
      text = columns[index]
    if dtype is str:
      return text
    try:
      return np.dtype(dtype).type(float(text) if np.dtype(dtype).kind == "f" else int(text))
    except (ValueError, OverflowError):
      raise ValueError(f"{self.filename}:{number + 1}: cannot read {text!r} as {np.dtype(dtype)}.") from None


def _typed(items, dtype) -> np.ndarray:
  return np.array(items, dtype=object) if dtype is str else np.array(items, dtype=dtype).reshape(len(items))
