"""How a :class:`jaxres.DynamicEmbedding` restores checkpoints written otherwise than it would save.

**Trained with another row optimizer.** A checkpoint stores each row with
its optimizer state (``values/row`` and ``values/slots/<i>`` arrays, see
:mod:`jaxres._persistence.saved_entries`).
Restored into an embedding whose row optimizer keeps other state, the rows
(and ids, scores, counters) can be kept and every row's optimizer state
started afresh: :func:`rows_only` rewrites the arrays so, and the handle
registered here for :class:`EmbeddingRows` does it when the embedding was
created with ``restore_rows_only=True``; otherwise it names the option.

**String ids of another maximum length** (``key=str``): stored as rows of
another number of words, they are refused with a ``ValueError`` that says
which ``max_length`` takes them.

**Counters from before refusals were split** by cause (three counters where
there are four): :class:`CountersHandle` reads them with
:func:`jaxres._nn.counters.split_refusals`.

**Admission counts of another integer dtype** (``int32`` before counts
stopped at ``min_count``; ``uint8`` or ``uint16`` with another ``min_count``):
:class:`AdmissionCountsHandle` reads them with :func:`counts_as`.
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np

from jaxres._core.encoding import strings
from jaxres._integrations.nnx import VariableHandle
from jaxres._nn import counters
from jaxres._nn.embedding import AdmissionCounts, EmbeddingCounters, EmbeddingRows, EmbeddingStep
from jaxres._nn.rowwise import RowOptimizer
from jaxres._persistence import saved_entries
from jaxres._persistence.processes import Blocks
from jaxres._tracking import handles

_SLOT = re.compile(r"(.*)values/slots/\d+")
_ROW = re.compile(r"(.*)values/row")


def trained_with_another_optimizer(arrays, optimizer: RowOptimizer) -> bool:
  """Whether ``arrays`` are an embedding table's with other per-row optimizer state than ``optimizer``'s."""
  rows = [name for name in arrays if _ROW.fullmatch(name)]
  if not rows or any(tuple(arrays[n].shape)[-1:] != (optimizer.features,) for n in rows):
    return False  # not an embedding's rows, or rows of another width: not an optimizer's doing
  want = [(s.shape, np.dtype(s.dtype)) for s in optimizer.slots]
  for prefix in {_ROW.fullmatch(name)[1] for name in rows}:
    slots = sorted((n for n in arrays if _SLOT.fullmatch(n) and _SLOT.fullmatch(n)[1] == prefix), key=_index)
    got = [(tuple(arrays[n].shape)[_lead(prefix) :], np.dtype(arrays[n].dtype)) for n in slots]
    if got != want:
      return True
  return False


def rows_only(arrays, optimizer: RowOptimizer) -> dict:
  """``arrays`` of an embedding table with every row's optimizer state replaced by ``optimizer``'s
  initial state for that row (ids, rows, scores and counters as they were)."""
  out = {name: array for name, array in arrays.items() if not _SLOT.fullmatch(name)}
  for name, rows in arrays.items():
    match = _ROW.fullmatch(name)
    if match is None:
      continue
    prefix = match[1]
    for i, slot in enumerate(_fresh(rows, optimizer, _lead(prefix))):
      out[f"{prefix}values/slots/{i}"] = slot
  return out


def _fresh(rows, optimizer: RowOptimizer, lead: int) -> list:
  """The initial optimizer state of ``rows`` (``[*lead dims, n, features]``, or :class:`Blocks`)."""
  if isinstance(rows, Blocks):  # this process's shards of a global array
    parts = {i: _fresh(row, optimizer, 1) for i, row in rows.rows.items()}
    return [
      Blocks((*rows.shape[:2], *s.shape), np.dtype(s.dtype), {i: part[k] for i, part in parts.items()})
      for k, s in enumerate(optimizer.slots)
    ]
  rows = np.asarray(rows)
  lead = rows.shape[:-1]
  if not rows.size:
    return [np.zeros((*lead, *s.shape), s.dtype) for s in optimizer.slots]
  state = optimizer.init(jnp.asarray(rows.reshape(-1, rows.shape[-1])))
  return [np.asarray(leaf).reshape(*lead, *s.shape) for leaf, s in zip(state, optimizer.slots)]


def _lead(prefix: str) -> int:
  """Leading dimensions before one entry's shape: ``[n]``, or ``[shards, width]`` in blocks."""
  return 2 if prefix == "blocks/" else 1


def _index(name: str) -> int:
  return int(name.rsplit("/", 1)[1])


class EmbeddingRowsHandle(VariableHandle):
  """The rows table of an embedding: restored as any table's, or rows only (see the module)."""

  def restore(self, arrays):
    _check_string_ids(arrays, self.obj.get_value().key_spec, self.obj.get_metadata().get("max_length"))
    optimizer = self.obj.get_metadata()["row_optimizer"]
    if trained_with_another_optimizer(arrays, optimizer):
      if not self.obj.get_metadata()["restore_rows_only"]:
        raise TypeError(
          "the checkpoint's embedding rows were trained with another row optimizer (other optimizer "
          "state per row); to keep its ids, rows and scores and start every row's optimizer state "
          "afresh, create the jr.DynamicEmbedding with restore_rows_only=True."
        )
      arrays = rows_only(arrays, optimizer)
    return super().restore(arrays)


def _check_string_ids(arrays, key_spec, max_length: int | None) -> None:
  """Raises ``ValueError`` when the saved string ids are rows of another width than the table's, or
  when a row encodes no UTF-8 string of at most ``max_length`` bytes (a damaged or crafted checkpoint:
  accepted, the table could not be exported or looked up by string again)."""
  if max_length is None:
    return
  for name, array in arrays.items():
    if saved_entries.field_of(name) != "keys":
      continue
    words = tuple(array.shape)[-1:]
    if words != key_spec.shape:
      fits = f"max_length={4 * (words[0] - 1)}" if words and words[0] > 1 else "string ids"
      raise ValueError(
        f"the checkpoint's string ids are rows of {words[0] if words else 0} words, this embedding's "
        f"(max_length={max_length}) of {key_spec.shape[0]}: create it with {fits}, as when it was saved."
      )
    parts = array.rows.values() if isinstance(array, Blocks) else [array]  # this process's shards
    for part in parts:
      rows = np.asarray(part, np.uint32).reshape(-1, words[0])
      if rows.size and int(rows[:, -1].max()) > max_length:
        raise ValueError(f"{name}: a string id longer than max_length={max_length} bytes: corrupted.")
      strings.decode(rows, name)


class EmbeddingStepHandle(VariableHandle):
  """The step count of a row optimizer: with ``restore_rows_only``, a checkpoint may lack it
  (trained with an optimizer that counts no steps), and the count then starts afresh."""

  def holds_values(self) -> bool:
    return not self.obj.get_metadata()["restore_rows_only"]


class CountersHandle(VariableHandle):
  """An embedding's counters: restored as any array, or from a checkpoint of three counters."""

  def restore(self, arrays):
    saved = arrays.get("value")
    if saved is not None and tuple(np.shape(saved)) == (3, 2):
      arrays = {"value": counters.split_refusals(np.asarray(saved), self.obj.get_metadata()["admits"])}
    return super().restore(arrays)


def counts_as(arrays, dtype, min_count: int) -> dict:
  """``arrays`` of an admission count table with its saved counts (``values``) in ``dtype``, each at
  most ``min_count`` (an id counted that often is admitted at its next occurrence).

  Raises:
    ValueError: a negative count (a damaged or crafted checkpoint), named.

  Examples:
    >>> import numpy as np
    >>> arrays = {"keys": np.array([7, 9]), "values": np.array([1, 300], np.int32)}
    >>> counts_as(arrays, np.uint8, 2)["values"]
    array([1, 2], dtype=uint8)
  """
  saved = arrays.get("values")
  if saved is None or isinstance(saved, Blocks) or np.dtype(saved.dtype) == dtype:
    return arrays
  saved = np.asarray(saved)
  if saved.dtype.kind not in "iu":
    return arrays  # not counts: the table's own check names it
  if saved.size and saved.min() < 0:
    raise ValueError(f"values: a negative admission count ({saved.min()}): corrupted.")
  return arrays | {"values": np.minimum(saved, min_count).astype(dtype)}


class AdmissionCountsHandle(VariableHandle):
  """An embedding's admission counts: restored as any table's, counts of another integer dtype
  converted (:func:`counts_as`)."""

  def restore(self, arrays):
    (leaf,) = self.obj.get_value().value_spec.leaves
    return super().restore(counts_as(arrays, np.dtype(leaf.dtype), self.obj.get_metadata()["min_count"]))


handles.register(EmbeddingRows, EmbeddingRowsHandle.of)
handles.register(AdmissionCounts, AdmissionCountsHandle.of)
handles.register(EmbeddingStep, EmbeddingStepHandle.of)
handles.register(EmbeddingCounters, CountersHandle.of)
