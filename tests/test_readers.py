"""Readers beside writers (issue 56, point 4): a checkpoint or export read while another process
replaces it is read whole, from one save, and the reader writes nothing."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import jaxres as jr
from jaxres._persistence import replacing

ROOT = Path(__file__).resolve().parents[1]


def _save(path: Path, step: int) -> None:
  """A directory ``path`` as a save would leave it: files ``a`` and ``b``, both ``step``."""
  staged = Path(replacing.staging_dir(path))
  for name in "ab":
    (staged / name).write_text(str(step))
  replacing.replace(staged, path)


def _both(where) -> tuple[str, str]:
  a = Path(where, "a").read_text()
  b = Path(where, "b").read_text()
  if a != b:
    raise ValueError(f"{where}: a of step {a}, b of step {b} (corrupted)")
  return a, b


def test_a_read_that_met_a_replace_is_read_again_whole(tmp_path):
  path, calls = tmp_path / "saved", []
  _save(path, 1)

  def read(where):
    calls.append(where)
    a = Path(where, "a").read_text()
    if len(calls) == 1:  # another process replaces the directory between the two files
      _save(path, 2)
    return a, Path(where, "b").read_text()

  assert replacing.read_whole(path, read) == ("2", "2")  # not ("1", "2"): read again
  assert len(calls) == 2


def test_a_read_that_failed_on_a_replaced_directory_is_read_again(tmp_path):
  path, calls = tmp_path / "saved", []
  _save(path, 1)

  def read(where):
    calls.append(where)
    if len(calls) == 1:
      _save(path, 2)
    return _both(where) if len(calls) > 1 else (Path(where, "a").read_text(), Path(where, "c").read_text())

  assert replacing.read_whole(path, read) == ("2", "2")


def test_a_read_that_fails_on_a_directory_in_place_raises_at_once(tmp_path):
  path, calls = tmp_path / "saved", []
  _save(path, 1)
  (path / "b").write_text("9")  # damaged, and nobody replaces it
  with pytest.raises(ValueError, match="corrupted"):
    replacing.read_whole(path, lambda where: calls.append(where) or _both(where))
  assert len(calls) == 1


def test_a_save_between_its_renames_is_read_from_its_retired_copy_and_nothing_is_written(tmp_path):
  path = tmp_path / "saved"
  _save(path, 1)
  retired = tmp_path / ".saved.old-x1"  # a save retired it and has not yet renamed its own in
  retired.mkdir()
  os.rename(path, retired / "previous")
  before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
  assert replacing.read_whole(path, _both) == ("1", "1")
  assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_a_directory_replaced_during_every_read_is_an_os_error_naming_it(tmp_path):
  path, step = tmp_path / "saved", [1]
  _save(path, 1)

  def read(where):
    result = _both(where)
    step[0] += 1
    _save(path, step[0])
    return result

  with pytest.raises(OSError, match=f"{path}: replaced by another process during each of 3 reads"):
    replacing.read_whole(path, read, attempts=3)


# A writer process: saves a checkpoint and an export of one graph over the same two paths, again and
# again, each save holding arrays a and b of its step (argv: the folder, the number of saves).
_WRITER = textwrap.dedent(
  """
  import sys
  import numpy as np, jax, jaxres as jr
  folder, saves = sys.argv[1], int(sys.argv[2])
  root = jr.AutoTrackable()
  x = jax.ShapeDtypeStruct((), np.float32)
  signature = {"both": jr.saved_model.Signature(lambda obj, x: {"a": obj.a + x, "b": obj.b + x}, x=x)}
  for step in range(1, saves + 1):
    root.a = np.full(1000, step, np.float32)
    root.b = np.full(1000, step, np.float32)
    jr.Checkpoint(model=root).save(folder + "/ckpt")
    jr.saved_model.save(root, folder + "/export", signature, platforms=("cpu",))
    print(step, flush=True)
  """
)


def test_checkpoints_and_exports_read_while_another_process_replaces_them_are_whole(tmp_path):
  root = jr.AutoTrackable()
  root.a = root.b = np.zeros(1000, np.float32)
  env = {**os.environ, "PYTHONPATH": str(ROOT)}
  command = [sys.executable, "-c", _WRITER, str(tmp_path), "12"]
  writer = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  reads = 0
  try:
    assert writer.stdout.readline().strip() == "1"  # both exist now
    while writer.poll() is None:
      jr.Checkpoint(model=root).restore(tmp_path / "ckpt").assert_consumed()
      assert np.array_equal(root.a, root.b) and len(set(np.asarray(root.a).tolist())) == 1
      served = jr.saved_model.load(tmp_path / "export")
      out = served.signatures["both"](x=jnp.float32(0.0))
      a, b = out["a"], out["b"]
      assert np.array_equal(a, b) and len(set(np.asarray(a).tolist())) == 1
      reads += 1
  finally:
    if writer.poll() is None:
      writer.kill()
    out, err = writer.communicate()
  assert writer.returncode == 0, err[-3000:]
  assert reads >= 1 and out.split()[-1] == "12"
  assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "export"]  # readers wrote nothing
