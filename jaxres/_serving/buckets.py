"""The batch sizes a served signature is compiled for, and requests padded up to them.

A saved program takes its named dimensions as symbolic sizes, and XLA
compiles it anew for every concrete size. A loaded signature therefore pads
each request's *batch dimension* up to the smallest of a few batch sizes
(1, 4, 16, 64, 256 and 1024 by default) and cuts the results back, so that
those few programs serve every request; a request larger than the largest
size is answered in chunks of the largest.

The batch dimension is the named dimension every output starts with, given
by the inputs, each input and output naming it at most once (every output
exactly once). Padding rows are zeros in the programs' input form (the id 0,
the empty string, ``False``): the programs only read the serving state, so a
padding row changes nothing, and its results are dropped. This needs each
output row to depend only on the same row of the inputs, as a batch of
independent requests does.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np

from jaxres._errors import check_int

DEFAULT = tuple(4**k for k in range(6))  # 1, 4, 16, 64, 256, 1024
LARGEST = 1 << 20


def check(batch_sizes, name: str = "batch_sizes") -> tuple[int, ...] | None:
  """``batch_sizes`` as a sorted tuple of distinct ints in ``[1, 2**20]``, or ``None`` (no padding).

  Raises:
    TypeError: not ``None`` nor a non-empty sequence of ints (naming ``name``).
    ValueError: a size out of range or repeated (naming ``name``).
  """
  if batch_sizes is None:
    return None
  if isinstance(batch_sizes, (str, bytes)) or not isinstance(batch_sizes, Sequence) or not batch_sizes:
    raise TypeError(f"{name}: expected a non-empty sequence of ints (or None), got {batch_sizes!r}.")
  sizes = [check_int(size, name, low=1, high=LARGEST) for size in batch_sizes]
  if len(set(sizes)) != len(sizes):
    raise ValueError(f"{name}: sizes must be distinct, got {list(batch_sizes)}.")
  return tuple(sorted(sizes))


def batch_dimension(inputs, out_dims: dict[str, list[str]]) -> str | None:
  """The dimension name a request is padded along (see the module's docstring), or ``None``."""
  leading = {dims[0] for dims in out_dims.values() if dims}
  if len(leading) != 1 or any(not dims for dims in out_dims.values()):
    return None
  (name,) = leading
  named = [d for i in inputs for d in i.dims]
  if name not in named or any(i.dims.count(name) > 1 for i in inputs):
    return None
  if any(sum(name in d for d in dims) != 1 for dims in out_dims.values()):  # once, not inside an expression
    return None
  return name


def bucket(size: int, sizes: tuple[int, ...]) -> int:
  """The smallest of ``sizes`` that holds ``size`` rows (``size`` at most the largest)."""
  return sizes[bisect.bisect_left(sizes, size)]


def chunks(size: int, largest: int) -> list[slice]:
  """``size`` rows as consecutive chunks of at most ``largest`` (one, empty, for ``size == 0``)."""
  return [slice(start, min(start + largest, size)) for start in range(0, max(size, 1), largest)]


def pad(x: np.ndarray, axis: int, size: int) -> np.ndarray:
  """``x`` with zeros appended along ``axis`` up to ``size``."""
  if x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return np.pad(x, widths)


def take(x: np.ndarray, axis: int, rows: slice) -> np.ndarray:
  """The ``rows`` of ``x`` along ``axis``."""
  return x[(slice(None),) * axis + (rows,)]
