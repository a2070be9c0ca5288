"""The one module that talks to Orbax: flat dicts of arrays in and out.

Arrays are saved under opaque keys (``e0``, ``e1``, ...); object paths live in
the manifest, never in Orbax's keys, so Orbax's own key joining cannot mix up
names that contain dots. Orbax refuses empty arrays, so those are recreated
from their recorded shape and dtype instead of being stored.
"""

from __future__ import annotations

import os

import numpy as np
import orbax.checkpoint as ocp

ARRAYS_DIR = "arrays"


def spec_of(array: np.ndarray) -> dict:
  """The JSON description of an array entry."""
  return {"shape": list(array.shape), "dtype": str(array.dtype)}


def save_arrays(directory: str, arrays: dict[str, np.ndarray]) -> None:
  """Writes the non-empty ``arrays`` under ``directory/arrays``."""
  stored = {key: value for key, value in arrays.items() if value.size}
  if not stored:
    return
  checkpointer = ocp.StandardCheckpointer()
  try:
    checkpointer.save(os.path.join(os.path.abspath(directory), ARRAYS_DIR), stored)
    checkpointer.wait_until_finished()
  finally:
    checkpointer.close()


def load_arrays(directory: str, specs: dict[str, dict]) -> dict[str, np.ndarray]:
  """Reads the arrays described by ``specs`` (key -> :func:`spec_of`) as NumPy arrays.

  Raises:
    ValueError: an array is missing or its shape or dtype differs from ``specs``.
  """
  stored = {key for key, spec in specs.items() if np.prod(spec["shape"], dtype=np.int64)}
  restored = {}
  if stored:
    checkpointer = ocp.StandardCheckpointer()
    try:
      restored = checkpointer.restore(os.path.join(os.path.abspath(directory), ARRAYS_DIR))
    except Exception as err:
      raise ValueError(
        f"{directory}: cannot read the checkpoint's arrays ({type(err).__name__}: {err})."
      ) from err
    finally:
      checkpointer.close()
  out = {}
  for key, spec in specs.items():
    if key in stored:
      if key not in restored:
        raise ValueError(f"{directory}: array {key} is missing from the checkpoint.")
      value = np.asarray(restored[key])
    else:
      value = np.zeros(spec["shape"], spec["dtype"])
    if list(value.shape) != spec["shape"] or str(value.dtype) != spec["dtype"]:
      raise ValueError(f"{directory}: array {key} is {value.dtype}{list(value.shape)}, expected {spec}.")
    out[key] = value
  return out
