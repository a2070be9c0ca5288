"""Strings as fixed-width rows of uint32 words (exact and reversible).

A string of at most ``max_length`` UTF-8 bytes becomes ``string_width``
words: the bytes packed big-endian and zero-padded, then the byte length.
Comparing the words as unsigned integers, left to right, orders strings as
their UTF-8 bytes (which is code-point order), and the trailing length keeps
``"a"`` and ``"a\\0"`` apart.
"""

from __future__ import annotations

import numpy as np

from jaxres._errors import check_int


def string_width(max_length: int) -> int:
  """uint32 words per encoded string of at most ``max_length`` bytes."""
  return -(-max_length // 4) + 1


def check_max_length(max_length, name: str) -> int:
  """A maximum string length in UTF-8 bytes: an int in ``[1, 65536]``."""
  return check_int(max_length, name, low=1, high=1 << 16)


def encode(strings, max_length: int, name: str = "keys") -> np.ndarray:
  """str (or nested lists / arrays of str) -> uint32[..., string_width(max_length)].

  Raises:
    TypeError: an element is not a ``str`` or ``bytes``.
    ValueError: an element is longer than ``max_length`` UTF-8 bytes, ``bytes``
      that are not UTF-8, or a ``str`` holding a lone surrogate (no UTF-8 text).
  """
  items = np.asarray(strings, dtype=object)
  width = string_width(max_length)
  out = np.zeros((items.size, width), np.uint32)
  padded = np.zeros((items.size, (width - 1) * 4), np.uint8)
  for i, item in enumerate(items.reshape(-1)):
    if isinstance(item, str):
      try:
        data = item.encode("utf-8")
      except UnicodeEncodeError as err:  # a lone surrogate: no UTF-8 encoding exists
        raise ValueError(
          f"{name}: {item[:40]!r} holds {item[err.start : err.end]!r} at {err.start}, a lone surrogate, "
          "which no UTF-8 text holds (a str decoded with errors='surrogateescape', say)."
        ) from None
    elif isinstance(item, bytes):
      data = item
      try:
        data.decode("utf-8")
      except UnicodeDecodeError as err:
        raise ValueError(
          f"{name}: {item[:40]!r} is not UTF-8 text ({err.reason} at byte {err.start}); string tables "
          "hold text: decode the bytes, or store them in an integer table."
        ) from None
    else:
      raise TypeError(f"{name}: expected strings, got {type(item).__name__} {item!r}.")
    if len(data) > max_length:
      shown = item if len(item) <= 40 else item[:40] + "..."
      raise ValueError(
        f"{name}: {shown!r} is {len(data)} UTF-8 bytes, over this table's max length of {max_length}; "
        "create the table with a larger max length."
      )
    padded[i, : len(data)] = np.frombuffer(data, np.uint8)
    out[i, -1] = len(data)
  out[:, :-1] = padded.view(">u4").astype(np.uint32)
  return out.reshape((*items.shape, width))


def decode(words, name: str = "keys") -> np.ndarray:
  """uint32[..., width] -> NumPy array of ``str`` with the leading shape.

  Raises:
    ValueError: naming ``name``: a row that encodes no string (a length past
      its width, or bytes that are not UTF-8).
  """
  words = np.asarray(words, dtype=np.uint32)
  flat = words.reshape(-1, words.shape[-1])
  data = flat[:, :-1].astype(">u4").view(np.uint8).reshape(flat.shape[0], 4 * (flat.shape[1] - 1))
  out = np.empty(flat.shape[0], dtype=object)
  for i, (row, length) in enumerate(zip(data, flat[:, -1])):
    try:
      if length > len(row):
        raise ValueError(f"a length of {int(length)} bytes in rows of {len(row)}")
      out[i] = row[: int(length)].tobytes().decode("utf-8")
    except ValueError as err:  # UnicodeDecodeError too
      raise ValueError(f"{name}: row {i} encodes no UTF-8 string ({err}): corrupted.") from None
  return out.reshape(words.shape[:-1])
