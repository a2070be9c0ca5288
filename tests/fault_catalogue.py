"""Single-bit flips of every file of a checkpoint, an incremental step or an export, read back.

Run as ``python fault_catalogue.py KIND SEED FLIPS [BITS]`` (``test_hostile_files.py``
runs it in a child process, so that a crash or a hang would be seen as one
rather than take the test run down). For each flip, a copy of the directory
gets one bit of one file flipped (files in turn, the bit drawn from
``SEED``); with ``BITS`` 2, every other trial flips a second bit too, in a
file drawn at random (two flips can switch a check off where one cannot);
then the copy is read back as a user would: ``refused`` (a ``ValueError``),
``exact`` (read back equal to what was saved), or anything else, which is a
fault: a silent wrong answer (``wrong <file>``) or another exception
(``<Exception> <file>``). Prints the counts as one JSON line.
"""

import collections
import json
import shutil
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np

import jaxres as jr

KEYS = np.arange(20, dtype=np.int64) * 7919 - 2**40


def _graph(filled: bool = False):
  root = jr.AutoTrackable()
  root.table = jr.MutableHashTable(np.int64, np.float32, default_value=0.0, initial_capacity=64)
  root.w = np.arange(6, dtype=np.float32).reshape(2, 3)
  if filled:
    root.table.insert(KEYS, np.arange(20, dtype=np.float32))
  return root


def _exact(root) -> bool:
  keys, values = root.table.export()
  return np.array_equal(keys, np.sort(KEYS)) and np.array_equal(values, np.argsort(np.argsort(KEYS)))


def _checkpoint(base: Path):
  path = Path(jr.Checkpoint(model=_graph(filled=True)).save(base / "ckpt"))

  def read(copy: Path) -> bool:
    root = _graph()
    jr.Checkpoint(model=root).restore(copy)
    return _exact(root) and np.array_equal(root.w, _graph().w)

  return path, read


def _step(base: Path):
  root = _graph()
  manager = jr.CheckpointManager(base / "steps", jr.Checkpoint(model=root), incremental=True)
  for step, part in enumerate(np.array_split(np.arange(20), 3)):
    root.table.insert(KEYS[part], part.astype(np.float32))
    manager.save(step)
  manager.close()

  def read(copy: Path) -> bool:
    steps = copy.parent / "steps-copy"
    shutil.rmtree(steps, ignore_errors=True)
    shutil.copytree(base / "steps", steps)
    shutil.rmtree(steps / "2")
    shutil.copytree(copy, steps / "2")
    fresh = _graph()
    reader = jr.CheckpointManager(steps, jr.Checkpoint(model=fresh))
    try:
      reader.restore(2)
    finally:
      reader.close()
    return _exact(fresh)

  return base / "steps" / "2", read


def _export(base: Path):
  root = _graph(filled=True)
  ids = jax.ShapeDtypeStruct(("n",), np.int64)
  signature = jr.saved_model.Signature(lambda obj, ids: obj.table.find(ids), ids=ids)
  jr.saved_model.save(root, base / "export", {"find": signature}, platforms=("cpu",))
  query = np.concatenate([KEYS, [1, 2]])
  expected = np.asarray(jr.saved_model.load(base / "export").signatures["find"](ids=query)["output"])

  def read(copy: Path) -> bool:
    out = jr.saved_model.load(copy).signatures["find"](ids=query)["output"]
    return np.array_equal(np.asarray(out), expected)

  return base / "export", read


KINDS = {"checkpoint": _checkpoint, "step": _step, "export": _export}


def _flip(file: Path, rng) -> None:
  data = bytearray(file.read_bytes())
  bit = int(rng.integers(8 * len(data)))
  data[bit // 8] ^= 1 << (bit % 8)
  file.write_bytes(bytes(data))


def main(kind: str, seed: int, flips: int, bits: int = 1) -> dict:
  base = Path(tempfile.mkdtemp(prefix="jaxres-faults-"))
  try:
    path, read = KINDS[kind](base)
    files = sorted(p.relative_to(path) for p in path.rglob("*") if p.is_file() and p.stat().st_size)
    rng = np.random.default_rng(seed)
    counts = collections.Counter()
    for trial in range(flips):
      copy = base / f"flip{trial}"
      shutil.copytree(path, copy)
      name = files[trial % len(files)]
      _flip(copy / name, rng)
      if trial % bits:
        _flip(copy / files[int(rng.integers(len(files)))], rng)
      try:
        counts["exact" if read(copy) else f"wrong {name}"] += 1
      except ValueError:
        counts["refused"] += 1
      except Exception as err:  # a fault: reported, not raised
        counts[f"{type(err).__name__} {name}"] += 1
      shutil.rmtree(copy)
    return dict(counts) | {"files": len(files)}
  finally:
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
  print(json.dumps(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *map(int, sys.argv[4:5]))))
