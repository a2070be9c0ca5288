"""The public surface: names, docstrings, lint and the demo."""

import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import jaxres as jr
from jaxres import demo
from jaxres._core.storages import registry

ROOT = Path(__file__).resolve().parents[1]


def test_every_public_name_is_exported_and_documented():
  for name in jr.__all__:
    obj = getattr(jr, name)
    assert inspect.getdoc(obj), f"jr.{name} has no docstring"
    if inspect.isclass(obj):
      for attr, member in vars(obj).items():
        if not attr.startswith("_") and callable(member):
          assert inspect.getdoc(member), f"jr.{name}.{attr} has no docstring"
  for name in jr.keys.__all__:
    assert inspect.getdoc(getattr(jr.keys, name)), f"jr.keys.{name} has no docstring"


def test_every_storage_implements_the_protocol():
  for storage in registry.STORAGES.values():
    assert issubclass(storage, jr.Table)
    assert not inspect.isabstract(storage)


def test_ruff_clean():
  pytest.importorskip("ruff", reason="ruff comes with the test extra")
  for args in (["check"], ["format", "--check"]):
    cmd = [sys.executable, "-m", "ruff", *args, "jaxres", "tests", "benchmarks"]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_demo_trains_checkpoints_and_resumes_bitwise(tmp_path, capsys):
  workdir = tmp_path / "run"
  export = tmp_path / "export"
  args = ["--steps", "6", "--capacity", "256", "--workdir", str(workdir), "--export", str(export)]
  assert demo.main(args) == 0
  out = capsys.readouterr().out
  assert "(load 1.00)" in out and "evicted (LRU)" in out  # 256 rows fill within the first steps
  assert "restart from step 4: restored ['model', 'optimizer']" in out
  assert "2 resumed losses bitwise equal to the uninterrupted run: yes" in out
  assert sorted(p.name for p in workdir.iterdir()) == ["2", "4", "6"]
  assert jr.saved_model.load(str(export)).signatures["serving_default"] is not None
  assert out.count("answers bitwise equal to the model's: yes") == 2  # exported, then kept fresh
  assert "fresh: 100 more training steps sent to the served model as a delta" in out
  with pytest.raises(SystemExit):  # the demo never resumes someone else's run
    demo.main(["--workdir", str(workdir)])
  assert "--workdir" in capsys.readouterr().err
