"""Which files of ``jaxres`` a call passes through: ``python tools/trace_calls.py``.

Traces two calls with ``sys.setprofile``: the first eager ``MutableHashTable.insert`` down to the
storage write, and ``Checkpoint.save`` of a model holding a ``DynamicEmbedding`` down to the Orbax
write. For each it prints the number of ``jaxres`` files entered and of file switches (calls
from one ``jaxres`` file into another, the nearest ``jaxres`` frame up the stack being the
caller): how far a reader must jump to follow the call.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

PACKAGE = str(Path(__file__).resolve().parents[1] / "jaxres")


def trace(fn) -> tuple[list[str], int]:
  """Runs ``fn()``; returns the ``jaxres`` files it entered, in order of first entry, and the
  number of switches between them."""
  files: list[str] = []
  switches = 0

  def profile(frame, event, arg):
    nonlocal switches
    if event != "call" or not frame.f_code.co_filename.startswith(PACKAGE):
      return
    name = os.path.relpath(frame.f_code.co_filename, os.path.dirname(PACKAGE))
    if name not in files:
      files.append(name)
    caller = frame.f_back
    while caller is not None and not caller.f_code.co_filename.startswith(PACKAGE):
      caller = caller.f_back
    if caller is not None and caller.f_code.co_filename != frame.f_code.co_filename:
      switches += 1

  sys.setprofile(profile)
  try:
    fn()
  finally:
    sys.setprofile(None)
  return files, switches


def main() -> None:
  import numpy as np
  import optax
  from flax import nnx

  import jaxres as jr

  table = jr.MutableHashTable(key_dtype=np.int64, value_dtype=np.float32, default_value=0.0)
  keys, values = np.arange(512, dtype=np.int64), np.ones(512, np.float32)
  insert = trace(lambda: table.insert(keys, values))

  class Model(nnx.Module):
    def __init__(self):
      self.emb = jr.DynamicEmbedding(1024, 8, optimizer=optax.adam(1e-3), rngs=nnx.Rngs(0))

  model = Model()
  optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  model.emb(np.arange(16, dtype=np.int64))
  checkpoint = jr.Checkpoint(model=model, optimizer=optimizer)
  with tempfile.TemporaryDirectory() as directory:
    save = trace(lambda: checkpoint.save(os.path.join(directory, "ckpt")))
  for label, (files, switches) in (("MutableHashTable.insert", insert), ("Checkpoint.save", save)):
    print(f"{label}: {len(files)} files, {switches} switches")
    for name in files:
      print(f"  {name}")


if __name__ == "__main__":
  main()
