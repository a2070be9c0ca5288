"""The README's tour runs as written."""

import re
from pathlib import Path

import numpy as np

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def tour_blocks() -> list[str]:
  tour = README[README.index("## A short tour") : README.index("## The demo")]
  return re.findall(r"```python\n(.*?)```", tour, flags=re.S)


def test_the_tour_runs(tmp_path):
  blocks = tour_blocks()
  assert len(blocks) == 4
  namespace = {}
  for block in blocks:
    exec(block.replace('"/tmp/run"', repr(str(tmp_path / "run"))), namespace)
  assert namespace["rows"].tolist() == [7.0, 2.0]
  assert namespace["table"].find(["banana", "kiwi"]).tolist() == [2**40, -1]
  assert np.isfinite(float(namespace["loss"]))
  restored, trained = namespace["fresh"].model.embedding, namespace["model"].embedding
  assert restored.size() == trained.size() > 0 and restored.stats() == trained.stats()
  for got, want in zip(restored.export(), trained.export()):
    assert got.tobytes() == want.tobytes()


def test_the_protocol_example_runs():
  section = README[README.index("### One protocol for every kind") : README.index("## Sharded tables")]
  (block,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
  namespace = {}
  exec(block, namespace)
  assert namespace["fresh"].model.tokenizer.ids == {"the": 0, "quick": 1, "fox": 2}
  assert namespace["status"].pending == []
