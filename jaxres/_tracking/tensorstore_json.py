"""Works around a reference leak in TensorStore's Python bindings that Orbax hits on every save and restore.

TensorStore turns its JSON into Python objects with ``JsonToPyObject``
(``python/tensorstore/json_type_caster.cc``), which fills each dict with
``PyDict_SetItem(dict, key.release(), value.release())``; ``PyDict_SetItem``
does not steal references, so every key and value of every dict that a
``to_json()`` returns keeps one reference too many and is never freed (with
everything it holds). Orbax calls ``ts.Spec.to_json`` and
``ts.KvStore.Spec.to_json`` several times per array on every save, metadata
read and restore (``build_kvstore_tspec``, ``array_metadata_from_tensorstore``):
about 35 KB per save and restore of a small checkpoint, without bound.

:func:`install` wraps those two methods so that the extra reference of each
dict key and value is released, after checking once on a probe that this
TensorStore leaks exactly one reference per key and value; with a TensorStore
that does not (a fixed one), nothing is changed.
"""

from __future__ import annotations

import ctypes
import functools
import sys
import threading

import tensorstore as ts

# A prototype of its own: ``ctypes.pythonapi.Py_DecRef``'s argtypes are shared with the whole process.
_decref = ctypes.PYFUNCTYPE(None, ctypes.py_object)(("Py_DecRef", ctypes.pythonapi))

_lock = threading.Lock()
_installed = False


def _release(value) -> None:
  """Drops the reference TensorStore leaked on every key and value of the dicts in ``value``."""
  if isinstance(value, dict):
    for key, item in value.items():
      _release(item)
      _decref(key)
      _decref(item)
  elif isinstance(value, list):
    for item in value:
      _release(item)


def _leaked_references() -> tuple[int, int]:
  """How many references too many the probe's key and value hold (0, 0 on a TensorStore without the leak,
  or one whose answer is not as expected: then nothing is changed)."""
  try:
    spec = ts.KvStore.Spec({"driver": "memory", "path": "jaxres-probe/"})
    out, again = spec.to_json(), spec.to_json()
    key = next(k for k in out if k == "path")
    value = out[key]
    if any(k is key for k in again) or again["path"] is value:
      return 0, 0  # objects shared between results (a cache): their counts say nothing of a leak
  except Exception:  # a TensorStore that answers otherwise: nothing to release
    return 0, 0
  fresh_key, fresh_value = "".join(["pa", "th"]), "".join(["jaxres-", "probe/"])
  reference = {fresh_key: fresh_value}  # held like ``out`` holds its key and value, leaking nothing
  # Each count: the dict's reference, the local name and ``getrefcount``'s argument (+ any leaked).
  key_extra = sys.getrefcount(key) - sys.getrefcount(fresh_key)
  value_extra = sys.getrefcount(value) - sys.getrefcount(fresh_value)
  del reference
  return key_extra, value_extra


def _wrap(cls) -> None:
  to_json = cls.to_json

  @functools.wraps(to_json)
  def released(self, *args, **kwargs):
    out = to_json(self, *args, **kwargs)
    _release(out)
    return out

  cls.to_json = released


def install() -> bool:
  """Wraps ``ts.Spec.to_json`` and ``ts.KvStore.Spec.to_json`` (once) if this TensorStore leaks;
  returns whether the wrappers are in place."""
  global _installed
  with _lock:
    if not _installed and _leaked_references() == (1, 1):
      for cls in (ts.Spec, ts.KvStore.Spec):
        _wrap(cls)
      _installed = True
    return _installed
