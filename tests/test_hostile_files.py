"""Files from a damaged disk or an attacker (issue 45): every file jaxres reads back is checked
before anything changes.

Each test damages or crafts one kind of file the way a flipped bit, a hostile
writer or a long run would, and asserts a ``ValueError`` naming the file (or
an exact restore), with the served model or the restored objects left as
they were. Manifests are re-sealed with their checksum (``reseal``) where a
test stands for an attacker, who can recompute it: the cross-checks must
hold without the checksum.
"""

import errno
import fcntl
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest
from children import HANG_GUARD_S
from test_faults import _full_disk
from test_serving_deltas import CPU, SIGNATURES, Trainer, _answers, _same_answers
from tower import Model

import jaxres as jr
from jaxres._persistence import files
from jaxres._tracking import checkpoint_manager, increments, manifest, orbax_io, ownership


def reseal(file, edit):
  """Edits the JSON manifest ``file`` (``edit(data)`` in place) and writes it sealed anew."""
  data = json.loads(file.read_text())
  data.pop(files.SEAL, None)
  edit(data)
  file.write_text(json.dumps(files.sealed(data)))


@pytest.fixture(scope="module")
def served_pair(tmp_path_factory):
  """An updatable export at step 2 and the delta of step 3 (read-only: tests copy what they damage)."""
  root = tmp_path_factory.mktemp("served")
  trainer = Trainer(Model(64))
  trainer.train(2)
  jr.saved_model.save(trainer.model, root / "export", SIGNATURES, updatable=True, step=2, platforms=CPU)
  trainer.train(1)
  jr.saved_model.save_delta(trainer.model, root / "delta", since=root / "export", step=3)
  return root


def _copy(served_pair, tmp_path, name="delta"):
  return shutil.copytree(served_pair / name, tmp_path / name, symlinks=True)


def _refused(served_pair, delta, match):
  """``update(delta)`` raises a ValueError matching ``match`` and leaves the served model as it was."""
  served = jr.saved_model.load(served_pair / "export")
  before = _answers(served)
  with pytest.raises(ValueError, match=match):
    served.update(delta)
  assert served.step == 2
  _same_answers(_answers(served), before)


def _unseal(file, how):
  """Writes the JSON manifest ``file`` without its checksum (``how="drop"``) or with the checksum's
  field name one bit off (``"flip"``): what a flipped bit in the name does."""
  data = json.loads(file.read_text())
  seal = data.pop(files.SEAL)
  if how == "flip":
    data[files.SEAL[:-1] + chr(ord(files.SEAL[-1]) ^ 1)] = seal
  file.write_text(json.dumps(data))


@pytest.mark.parametrize("how", ["drop", "flip"])
def test_an_export_or_delta_whose_seal_is_gone_is_refused(served_pair, tmp_path, how):
  """Exports (format 3) and deltas (format 2) are always sealed: a manifest without its checksum, or
  whose checksum field lost a bit of its name, is damage, not an unsealed manifest of an earlier
  release."""
  export = _copy(served_pair, tmp_path, "export")
  assert json.loads((export / "saved_model.json").read_text())["version"] == 3
  _unseal(export / "saved_model.json", how)
  with pytest.raises(ValueError, match="corrupted manifest"):
    jr.saved_model.load(export)
  delta = _copy(served_pair, tmp_path)
  assert json.loads((delta / "delta.json").read_text())["version"] == 2
  _unseal(delta / "delta.json", how)
  _refused(served_pair, delta, "corrupted manifest")


@pytest.mark.parametrize("name", ["../outside", "/tmp/outside", "tables/../../outside", "tables//0"])
def test_a_delta_naming_files_outside_its_directory_is_refused(served_pair, tmp_path, name):
  delta = _copy(served_pair, tmp_path)
  words = np.load(delta / "tables" / "0" / "words.npy")
  np.save(tmp_path / "outside.npy", words)  # what an escape would read, were names not confined

  def rename(data):
    data["arrays"][name] = data["arrays"].pop("tables/0/words")

  reseal(delta / "delta.json", rename)
  _refused(served_pair, delta, "not a plain relative name")


def test_a_symlink_leaving_the_delta_is_refused(served_pair, tmp_path):
  delta = _copy(served_pair, tmp_path)
  file = delta / "tables" / "0" / "words.npy"
  shutil.move(file, tmp_path / "words.npy")
  os.symlink(tmp_path / "words.npy", file)
  _refused(served_pair, delta, "outside the directory")


def test_a_loop_of_symlinks_is_refused_by_name(served_pair, tmp_path):
  """A file replaced by a loop of symbolic links, in a delta and in a checkpoint: a ValueError naming
  it (a bare RuntimeError before)."""
  delta = _copy(served_pair, tmp_path)
  file = delta / "tables" / "0" / "words.npy"
  os.remove(file)
  os.symlink(tmp_path / "loop", file)
  os.symlink(file, tmp_path / "loop")
  _refused(served_pair, delta, "words.npy'?: its symbolic links cannot be followed")
  root = jr.AutoTrackable()
  root.x = np.ones(3)
  path = jr.Checkpoint(model=root).save(tmp_path / "ckpt")
  metadata = os.path.join(path, "manifest", "metadata")
  os.remove(metadata)
  os.symlink(metadata, metadata)
  with pytest.raises(ValueError, match="metadata: its symbolic links cannot be followed"):
    jr.Checkpoint(model=jr.AutoTrackable()).restore(path)


def test_a_fifo_in_place_of_a_file_is_refused_without_waiting(served_pair, tmp_path):
  delta = _copy(served_pair, tmp_path)
  os.remove(delta / "tables" / "0" / "words.npy")
  os.mkfifo(delta / "tables" / "0" / "words.npy")
  _refused(served_pair, delta, "not a regular file")
  root = jr.AutoTrackable()
  root.x = np.ones(3)
  path = jr.Checkpoint(model=root).save(tmp_path / "ckpt")
  metadata = os.path.join(path, "manifest", "metadata")
  os.remove(metadata)
  os.mkfifo(metadata)
  with pytest.raises(ValueError, match="not a regular file"):
    jr.Checkpoint(model=jr.AutoTrackable()).restore(path)


def test_crafted_sizes_are_refused_before_allocating(served_pair, tmp_path):
  delta = _copy(served_pair, tmp_path)
  file = delta / "tables" / "0" / "words.npy"
  with open(file, "wb") as f:  # a header claiming 64 GiB, and no data
    np.lib.format.write_array_header_1_0(f, {"descr": "<u4", "fortran_order": False, "shape": (2**33, 2)})
  reseal(delta / "delta.json", lambda d: d["arrays"]["tables/0/words"].update(shape=[2**33, 2]))
  _refused(served_pair, delta, "not the 68719476736 bytes its header says")

  delta = _copy(served_pair, tmp_path / "b")
  reseal(delta / "delta.json", lambda d: d["lineage"]["tables"][0].update(slots_total=2**40))
  _refused(served_pair, delta, "slots_total")

  export = _copy(served_pair, tmp_path, "export")
  reseal(export / "saved_model.json", lambda d: [e.update(rows=2**40) for e in d["state"] if "rows" in e])
  with pytest.raises(ValueError, match="corrupted"):
    jr.saved_model.load(export)


def test_a_delta_that_moves_or_grows_served_arrays_is_refused(served_pair, tmp_path):
  for i, edit in enumerate(
    [
      lambda t: t.update(capacity=t["capacity"] * 4),
      lambda t: t["fields"].update(keys=t["fields"]["count"]),
      lambda t: t.update(values=list(reversed(t["values"]))),
    ]
  ):
    delta = _copy(served_pair, tmp_path / str(i))
    reseal(delta / "delta.json", lambda d, edit=edit: edit(d["lineage"]["tables"][0]))
    _refused(served_pair, delta, "not the served model's")


def test_a_delta_holding_a_key_twice_is_refused(served_pair, tmp_path):
  delta = _copy(served_pair, tmp_path)
  file = delta / "tables" / "0" / "words.npy"
  words = np.load(file)
  assert len(words) >= 2
  words[1] = words[0]
  np.save(file, words)
  reseal(
    delta / "delta.json",
    lambda d: d["arrays"]["tables/0/words"].update(crc32=files.zlib.crc32(words.tobytes())),
  )
  _refused(served_pair, delta, "a key twice")


def test_single_bit_flips_of_a_delta_are_refused_or_exact(served_pair, tmp_path):
  """200 seeded flips over every file of a delta: each is refused (the model left as it was) or
  the update is exact; none answers wrongly, crashes or hangs."""
  reference = jr.saved_model.load(served_pair / "export")
  reference.update(served_pair / "delta")
  expected = _answers(reference)
  rng = np.random.default_rng(0)
  paths = sorted(
    p.relative_to(served_pair / "delta") for p in (served_pair / "delta").rglob("*") if p.is_file()
  )
  served = jr.saved_model.load(served_pair / "export")
  before = _answers(served)
  refused = 0
  for trial in range(200):
    delta = _copy(served_pair, tmp_path / str(trial))
    file = delta / paths[trial % len(paths)]
    data = bytearray(file.read_bytes())
    bit = int(rng.integers(8 * len(data)))
    data[bit // 8] ^= 1 << (bit % 8)
    file.write_bytes(bytes(data))
    try:
      served.update(delta)
    except ValueError:
      refused += 1
      assert served.step == 2
      continue
    _same_answers(_answers(served), expected)
    served = jr.saved_model.load(served_pair / "export")
  _same_answers(_answers(served), before)
  assert refused >= 190  # checksums cover every byte that matters


def test_flipped_bits_of_an_export_are_refused(served_pair, tmp_path):
  export = _copy(served_pair, tmp_path, "export")
  program = export / "programs" / "0.jaxexport"
  data = bytearray(program.read_bytes())
  data[len(data) // 2] ^= 4
  program.write_bytes(bytes(data))
  with pytest.raises(ValueError, match="CRC-32"):
    jr.saved_model.load(export)
  export = _copy(served_pair, tmp_path / "b", "export")
  text = (export / "saved_model.json").read_text()
  (export / "saved_model.json").write_text(text.replace('"rows"', '"rowz"', 1))
  with pytest.raises(ValueError, match="checksum"):
    jr.saved_model.load(export)


def _manager_steps(tmp_path, steps, incremental=True, **options):
  root = jr.AutoTrackable()
  root.table = jr.MutableHashTable(np.int64, np.float32, default_value=0.0, initial_capacity=64)
  manager = jr.CheckpointManager(tmp_path, jr.Checkpoint(model=root), incremental=incremental, **options)
  for step in range(steps):
    root.table.insert(np.array([step]), np.array([float(step)], np.float32))
    manager.save(step)
  manager.wait_until_finished()
  return root, manager


def test_a_step_whose_lineage_was_rewritten_is_refused(tmp_path):
  root, manager = _manager_steps(tmp_path, 3)
  metadata = tmp_path / "2" / "manifest" / "metadata"
  original = metadata.read_text()
  reseal(metadata, lambda d: d.update(parent=0))  # "needs" still says [0, 1]
  with pytest.raises(ValueError, match="needs"):
    manager.restore(2)
  metadata.write_text(original.replace('"parent": 1', '"parent": 0'))  # a flipped bit, not resealed
  with pytest.raises(ValueError, match="checksum"):
    manager.restore(2)
  metadata.write_text(original)
  root.table.remove(np.array([2]))
  manager.restore(2)
  assert root.table.find(np.array([0, 1, 2])).tolist() == [0.0, 1.0, 2.0]
  manager.close()


def test_long_chains_compose_in_a_loop():
  """A chain of 2,000 incremental steps (beyond Python's recursion limit) is followed and checked
  in a loop."""
  node = {"kind": "trackable", "type": "t", "arrays": {}, "children": []}
  whole = manifest.build({"": node}, {})

  def load(step):
    if step == 0:
      return whole, {}
    contents = whole | {"format": manifest.INCREMENTAL_FORMAT, "parent": step - 1, "needs": list(range(step))}
    return manifest.check(files.sealed(contents), str(step), incremental=True), {}

  contents, arrays = increments.materialize(2000, load)
  assert contents["nodes"] == {"": node} and arrays == {}


def test_by_default_chains_are_bounded_and_old_ones_go(tmp_path):
  root, manager = _manager_steps(tmp_path, 20, max_to_keep=1)
  steps = manager.all_steps()
  assert steps[-1] == 19 and len(steps) <= jr.CheckpointManager.FULL_EVERY
  root.table.remove(np.arange(20))
  manager.restore()
  assert root.table.find(np.arange(20)).tolist() == [float(i) for i in range(20)]
  manager.close()


def test_a_manager_that_only_reads_deletes_nothing(tmp_path):
  _, manager = _manager_steps(tmp_path, 4, incremental=False)  # whole steps: none needs another
  manager.close()
  root = jr.AutoTrackable()
  root.table = jr.MutableHashTable(np.int64, np.float32, default_value=0.0, initial_capacity=64)
  reader = jr.CheckpointManager(tmp_path, jr.Checkpoint(model=root), max_to_keep=2)
  assert reader.all_steps() == [0, 1, 2, 3] and reader.latest_step() == 3
  reader.restore()
  reader.wait_until_finished()
  reader.close()
  assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [0, 1, 2, 3]


def _export(obj, path):
  twice = jr.saved_model.Signature(lambda obj, x: obj.scale * x, x=jax.ShapeDtypeStruct((2,), np.float32))
  jr.saved_model.save(obj, path, {"twice": twice}, platforms=CPU)


def test_a_save_killed_while_replacing_an_export_is_recovered(tmp_path, monkeypatch):
  obj = jr.AutoTrackable()
  obj.scale = jax.numpy.float32(2.0)
  _export(obj, tmp_path / "export")
  rename = os.rename

  def killed_before_the_new_one(src, dst):  # the old export is retired, then the process dies
    if os.fspath(dst) == os.fspath(tmp_path / "export"):
      raise KeyboardInterrupt
    rename(src, dst)

  monkeypatch.setattr(os, "rename", killed_before_the_new_one)
  obj.scale = jax.numpy.float32(3.0)
  with pytest.raises(KeyboardInterrupt):
    _export(obj, tmp_path / "export")
  monkeypatch.undo()
  assert not (tmp_path / "export").exists()
  served = jr.saved_model.load(tmp_path / "export")  # the export retired is read where it lies
  assert served.signatures["twice"](x=np.ones(2, np.float32))["output"].tolist() == [2.0, 2.0]
  assert not (tmp_path / "export").exists()  # a reader writes nothing
  _export(obj, tmp_path / "export")  # the next save puts it in place, then replaces it
  served = jr.saved_model.load(tmp_path / "export")
  assert served.signatures["twice"](x=np.ones(2, np.float32))["output"].tolist() == [3.0, 3.0]
  assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_what_killed_saves_left_is_removed_by_the_next_save_there(tmp_path):
  obj = jr.AutoTrackable()
  obj.scale = jax.numpy.float32(2.0)
  for name, save in (("export", _export), ("ckpt", lambda o, p: jr.Checkpoint(model=o).save(p))):
    save(obj, tmp_path / name)
    for stale in (f".{name}.saving-12", f".{name}.saving-12.orbax-checkpoint-tmp", f".{name}.old-x/previous"):
      (tmp_path / stale).mkdir(parents=True)
    save(obj, tmp_path / name)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(f".{name}.")) == []


def test_saves_while_threads_write_succeed_and_hold_a_state_the_table_had(tmp_path):
  """Three writers insert their own keys in order (thread t: t * 10**6 + i, value i) while the main
  thread saves: every save succeeds, and every checkpoint holds, of each writer, a prefix of its
  keys (a state the table really had, never a mix of two)."""
  root = jr.AutoTrackable()
  root.table = jr.MutableHashTable(np.int64, np.int64, default_value=-1, initial_capacity=16)
  stop = threading.Event()

  def write(t):
    i = 0
    while not stop.is_set():
      root.table.insert(np.array([t * 10**6 + i]), np.array([i]))
      i += 1

  writers = [threading.Thread(target=write, args=(t,)) for t in range(3)]
  for w in writers:
    w.start()
  manager = jr.CheckpointManager(tmp_path / "steps", jr.Checkpoint(model=root), incremental=True)
  try:
    for step in range(8):
      jr.Checkpoint(model=root).save(tmp_path / f"ckpt{step}")
      manager.save(step)
  finally:
    stop.set()
    for w in writers:
      w.join()
  manager.wait_until_finished()
  paths = [lambda r, s=s: jr.Checkpoint(model=r).restore(tmp_path / f"ckpt{s}") for s in range(8)]
  paths += [lambda r, s=s: manager.restore(s) for s in range(8)]
  for restore in paths:
    fresh = jr.AutoTrackable()
    fresh.table = jr.MutableHashTable(np.int64, np.int64, default_value=-1)
    manager.checkpoint = jr.Checkpoint(model=fresh)
    restore(fresh)
    keys, values = fresh.table.export()
    for t in range(3):
      mine = np.sort(keys[keys // 10**6 == t] - t * 10**6)
      assert mine.tolist() == list(range(len(mine)))
    assert np.array_equal(values, keys % 10**6)
  manager.close()


def test_string_keys_are_utf8_on_the_way_in_and_in_checkpoints(tmp_path):
  table = jr.MutableHashTable(str, np.float32, default_value=0.0)
  table.insert(["a"], np.ones(1, np.float32))
  with pytest.raises(ValueError, match=r"keys: b'\\xff\\xfe' is not UTF-8"):
    table.insert([b"\xff\xfe"], np.ones(1, np.float32))
  table.insert([b"caf\xc3\xa9"], np.full(1, 2.0, np.float32))  # UTF-8 bytes are text
  keys, _ = table.export()
  assert keys.tolist() == ["a", "café"] and "café" in repr(table)
  # Rows that encode no string (written as words, bypassing the text) are refused at restore.
  rows = np.array(jr.keys.encode_strings(["xy"], 8))
  rows[0, 0] = 0xFFFE0000
  table.insert(rows, np.ones(1, np.float32))
  root = jr.AutoTrackable()
  root.table = table
  path = jr.Checkpoint(model=root).save(tmp_path / "ckpt")
  fresh = jr.AutoTrackable()
  fresh.table = jr.MutableHashTable(str, np.float32, default_value=0.0)
  fresh.table.insert(["kept"], np.ones(1, np.float32))
  with pytest.raises(ValueError, match="encodes no UTF-8 string"):
    jr.Checkpoint(model=fresh).restore(path)
  assert fresh.table.export()[0].tolist() == ["kept"]


@pytest.mark.parametrize(
  ("edit", "match"),
  [
    (lambda spec: spec.update(dtype="ant32"), "dtype 'ant32'"),
    (lambda spec: spec.pop("dtype"), "dtype None"),
    (lambda spec: spec.update(shape=[2**62, -1]), "shape"),
    (lambda spec: spec.update(crc32="x"), "checksum"),
    (lambda spec: spec.update(step=3, key="e0"), "kept in step 3, which a whole checkpoint"),
  ],
  ids=["unknown_dtype", "no_dtype", "bad_shape", "bad_checksum", "kept_in_another_step"],
)
def test_malformed_array_descriptions_are_named(tmp_path, edit, match):
  root = jr.AutoTrackable()
  root.x = np.arange(3.0)
  path = jr.Checkpoint(model=root).save(tmp_path / "ckpt")
  reseal(tmp_path / "ckpt" / "manifest" / "metadata", lambda d: [edit(s) for s in d["arrays"].values()])
  fresh = jr.AutoTrackable()
  fresh.x = np.zeros(3)
  with pytest.raises(ValueError, match=f"corrupted manifest \\(array e0: {match}"):
    jr.Checkpoint(model=fresh).restore(path)
  assert fresh.x.tolist() == [0.0, 0.0, 0.0]


def test_a_crafted_array_shape_is_refused_before_it_is_allocated(tmp_path, monkeypatch):
  """Before: a manifest and Orbax's own record both claiming 2^40 float64s raised MemoryError (8.00 TiB)."""
  root = jr.AutoTrackable()
  root.x = np.arange(3.0)
  path = jr.Checkpoint(model=root).save(tmp_path / "ckpt")
  huge = [1 << 40]
  reseal(tmp_path / "ckpt" / "manifest" / "metadata", lambda d: d["arrays"]["e0"].update(shape=huge))
  recorded = orbax_io._stored_arrays
  monkeypatch.setattr(  # what Orbax recorded, crafted to agree
    orbax_io, "_stored_arrays", lambda *a: {k: ((1 << 40,), dtype) for k, (_, dtype) in recorded(*a).items()}
  )
  fresh = jr.AutoTrackable()
  fresh.x = np.zeros(3)
  with pytest.raises(ValueError, match=r"array e0 is float64\[1099511627776\], 8192.0 GiB: more than"):
    jr.Checkpoint(model=fresh).restore(path)
  assert fresh.x.tolist() == [0.0, 0.0, 0.0]


# A trainer in a process of its own: saves step argv[2] in directory argv[1], then goes on as the test says.
_WRITER = """
import multiprocessing, os, signal, sys, time, numpy as np, jaxres as jr
root = jr.AutoTrackable()
root.x = np.arange(3)
manager = jr.CheckpointManager(sys.argv[1], jr.Checkpoint(model=root))
manager.save(int(sys.argv[2]))
manager.wait_until_finished()
"""

_OTHER_WRITER = (
  _WRITER
  + """
print("saved", flush=True)
sys.stdin.readline()  # holds the directory until told to go
manager.close()
"""
)


def test_one_writer_per_manager_directory(tmp_path):
  root = jr.AutoTrackable()
  root.x = np.arange(3)
  other = subprocess.Popen(
    [sys.executable, "-c", _OTHER_WRITER, str(tmp_path), "100"],
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    text=True,
  )
  try:
    assert other.stdout.readline().strip() == "saved"
    manager = jr.CheckpointManager(tmp_path, jr.Checkpoint(model=root))
    assert manager.all_steps() == [100]  # reading takes nothing
    with pytest.raises(ValueError, match="another CheckpointManager"):
      manager.save(101)
    assert manager.all_steps() == [100]
  finally:
    other.communicate("go\n")
  manager.save(101)  # the other one closed
  # In one process, a newer manager takes over (a restarted trainer); the older one may not save.
  newer = jr.CheckpointManager(tmp_path, jr.Checkpoint(model=root))
  newer.save(102)
  with pytest.raises(ValueError, match="a newer CheckpointManager"):
    manager.save(103)
  newer.close()
  manager.close()
  assert jr.CheckpointManager(tmp_path, jr.Checkpoint(model=root)).all_steps() == [100, 101, 102]


_FORKING_WRITER = (
  _WRITER
  + """
child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(3600,))  # a data loader
child.start()
with open(sys.argv[3], "w") as f:
  f.write(str(child.pid))
os.kill(os.getpid(), signal.SIGKILL)  # the trainer dies; its child lives on
"""
)


def test_the_lock_dies_with_the_trainer_not_with_its_forked_children(tmp_path):
  """Before: a child forked by the trainer kept the flock after the trainer was killed, and the
  restarted trainer was refused for as long as the child lived."""
  pid_file = tmp_path.parent / f"{tmp_path.name}.child"
  command = [sys.executable, "-W", "ignore", "-c", _FORKING_WRITER, str(tmp_path), "0", str(pid_file)]
  subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=HANG_GUARD_S)
  child = int(pid_file.read_text())
  try:
    os.kill(child, 0)  # still alive
    root = jr.AutoTrackable()
    root.x = np.arange(3)
    restarted = jr.CheckpointManager(tmp_path, jr.Checkpoint(model=root))
    restarted.save(1)
    restarted.close()
    assert restarted.all_steps() == [0, 1]
  finally:
    os.kill(child, signal.SIGKILL)


def test_a_filesystem_without_flock_saves_with_a_warning(tmp_path, monkeypatch):
  """Before: on a filesystem without flock (ENOLCK) no manager could save, told another process was."""

  def no_locks(fd, operation):
    raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

  monkeypatch.setattr(ownership.fcntl, "flock", no_locks)
  root = jr.AutoTrackable()
  root.x = np.arange(3)
  manager = jr.CheckpointManager(tmp_path, jr.Checkpoint(model=root))
  with pytest.warns(jr.UnlockedDirectoryWarning, match=f"{tmp_path}.* cannot be locked"):
    manager.save(0)
  manager.save(1)  # warned once
  manager.close()
  assert manager.all_steps() == [0, 1]


def test_a_directory_removed_and_made_again_is_locked_afresh(tmp_path):
  """Before: the trainer kept its lock on the removed directory, so a second writer could take the new
  one beside it."""
  root = jr.AutoTrackable()
  root.x = np.arange(3)
  manager = jr.CheckpointManager(tmp_path / "run", jr.Checkpoint(model=root))
  manager.save(0)
  manager.wait_until_finished()
  shutil.rmtree(tmp_path / "run")
  os.makedirs(tmp_path / "run")
  manager.save(1)
  manager.wait_until_finished()
  probe = os.open(tmp_path / "run", os.O_RDONLY)
  try:
    with pytest.raises(BlockingIOError):  # what another process's manager meets: refused
      fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
  finally:
    os.close(probe)
  manager.close()
  assert manager.all_steps() == [1]


def _resident_bytes() -> int:
  with open("/proc/self/status") as f:
    return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


def test_restores_that_wait_do_not_pile_up(tmp_path):
  """40 restores of a checkpoint whose 16 MB entry nothing attaches: each newer restore supersedes the
  one before (it holds everything that one would give), so the arrays kept stay those of one; the
  older statuses stay pending until the attach, which matches them all. (The entry is large beside
  what else a worker of the suite allocates meanwhile: 46 MB was seen in a 5 GB worker.)"""
  saved = jr.AutoTrackable()
  saved.big = np.arange(1 << 21, dtype=np.float64)  # 16 MB
  path = jr.Checkpoint(model=saved).save(tmp_path / "ckpt")
  root = jr.AutoTrackable()
  checkpoint = jr.Checkpoint(model=root)
  statuses = [checkpoint.restore(path) for _ in range(5)]
  gc.collect()
  after_5 = _resident_bytes()
  statuses += [checkpoint.restore(path) for _ in range(35)]
  gc.collect()
  assert _resident_bytes() - after_5 < 160 << 20  # not 35 x 16 MB
  assert statuses[0].pending == statuses[-1].pending == ["model/big"]
  root.big = np.zeros(1 << 21)  # attached: the newest restore fills it, and every status follows
  assert np.array_equal(root.big, saved.big)
  assert statuses[0].pending == statuses[-1].pending == []
  statuses[0].assert_consumed()
  statuses[-1].assert_consumed()


def test_fault_catalogue_of_checkpoints_steps_and_exports():
  """100 seeded trials over every file of a checkpoint, an incremental step and an export, half of them
  one flipped bit and half two (``fault_catalogue.py``, in child processes so that a crash or a hang
  shows as one): each is refused with a ValueError or read back exactly; none answers wrongly or
  raises anything else."""
  script = os.path.join(os.path.dirname(__file__), "fault_catalogue.py")
  children = {
    kind: subprocess.Popen([sys.executable, script, kind, "0", "100", "2"], stdout=subprocess.PIPE, text=True)
    for kind in ("checkpoint", "step", "export")
  }
  for kind, child in children.items():
    out, _ = child.communicate(timeout=HANG_GUARD_S)  # a run takes well under a minute
    assert child.returncode == 0, f"{kind}: the reader crashed (exit {child.returncode})"
    counts = json.loads(out.strip().splitlines()[-1])
    files = counts.pop("files")
    assert set(counts) <= {"refused", "exact"}, (kind, counts)
    assert counts["refused"] + counts["exact"] == 100 and counts["refused"] >= files // 3, (kind, counts)


class _MemoryStore:
  """The manager's step store, in memory (the manager's own logic over thousands of saves, without
  Orbax's I/O of about 0.15 s a save): ``loads`` counts the steps read."""

  def __init__(self, directory):
    self.directory, self.steps, self.loads = directory, {}, 0

  def save(self, step, contents, arrays):  # sealed, as orbax_io writes it
    self.steps[step] = (files.sealed(contents), {key: np.array(a) for key, a in arrays.items()})

  def load(self, step, check):
    self.loads += 1
    contents, arrays = self.steps[step]
    return check(contents, str(step)), dict(arrays)

  def all_steps(self, reload=False):
    return sorted(self.steps)

  def refresh(self):
    pass

  def remove_unfinished(self):
    pass

  def delete(self, step):
    del self.steps[step]

  def path(self, step):
    return f"{self.directory}/{step}"

  def wait(self):
    pass

  def close(self):
    pass


def test_two_thousand_incremental_saves_keep_restores_bounded(tmp_path, monkeypatch):
  """2,000 incremental saves with the defaults and max_to_keep=3: the steps kept stay below
  max_to_keep + FULL_EVERY, the latest restores exactly, reading at most FULL_EVERY steps."""
  monkeypatch.setattr(checkpoint_manager, "StepStore", _MemoryStore)
  root = jr.AutoTrackable()
  root.table = jr.MutableHashTable(np.int64, np.float32, default_value=0.0, initial_capacity=4096)
  manager = jr.CheckpointManager(tmp_path, jr.Checkpoint(model=root), max_to_keep=3, incremental=True)
  kept = []
  for step in range(2000):
    root.table.insert(np.array([step % 3000]), np.array([float(step)], np.float32))
    manager.save(step)
    kept.append(len(manager._store.steps))
  assert max(kept) <= 3 + jr.CheckpointManager.FULL_EVERY
  expected = root.table.export()
  root.table.remove(np.arange(100))
  manager._store.loads = 0
  manager.restore()
  assert manager._store.loads <= jr.CheckpointManager.FULL_EVERY
  keys, values = root.table.export()
  assert np.array_equal(keys, expected[0]) and np.array_equal(values, expected[1])


def test_a_full_disk_while_exporting_names_the_file_and_keeps_the_export(served_pair, tmp_path):
  """A state array that cannot be written (files limited to 64 KiB): an OSError naming the file, not
  NumPy's "N requested and M written", and the export already at the path is left as it was."""
  export = _copy(served_pair, tmp_path, "export")
  obj = jr.AutoTrackable()
  obj.scale = jax.numpy.float32(3.0)
  obj.big = np.random.default_rng(0).random(1 << 17, np.float32)  # 512 KiB the program reads
  uses_big = jr.saved_model.Signature(
    lambda obj, x: obj.scale * x + obj.big[:2], x=jax.ShapeDtypeStruct((2,), np.float32)
  )
  with _full_disk(64 << 10), pytest.raises(OSError, match=r"state/\d+\.npy: could not be written"):
    jr.saved_model.save(obj, export, {"twice": uses_big}, platforms=CPU)
  assert jr.saved_model.load(export).step == 2
  assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".export.")) == []


def test_crafted_checkpoint_shapes_allocate_nothing(tmp_path):
  """A manifest (sealed anew) claiming 8 TiB for an array: refused against what the checkpoint
  stored before anything is allocated, for a checkpoint and a manager's step."""
  root = jr.AutoTrackable()
  root.x = np.arange(3.0)
  path = jr.Checkpoint(model=root).save(tmp_path / "ckpt")
  manager = jr.CheckpointManager(tmp_path / "steps", jr.Checkpoint(model=root))
  manager.save(0)
  manager.close()
  for metadata in (
    tmp_path / "ckpt" / "manifest" / "metadata",
    tmp_path / "steps" / "0" / "manifest" / "metadata",
  ):
    reseal(metadata, lambda d: [s.update(shape=[2**40]) for s in d["arrays"].values()])
  fresh = jr.AutoTrackable()
  fresh.x = np.zeros(3)
  with pytest.raises(ValueError, match=r"array e0 is described as float64\[1099511627776\] but stored as"):
    jr.Checkpoint(model=fresh).restore(path)
  with pytest.raises(ValueError, match=r"described as float64\[1099511627776\] but stored as"):
    jr.CheckpointManager(tmp_path / "steps", jr.Checkpoint(model=fresh)).restore(0)
  assert fresh.x.tolist() == [0.0, 0.0, 0.0]
