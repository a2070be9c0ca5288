"""The documentation: every Python block of every page (and of the README) runs, twice, and the site
builds with warnings as errors (a broken reference fails)."""

import enum
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]


def blocks(page: Path) -> list[tuple[int, str]]:
  """``(line, code)`` of each ```python block of ``page``."""
  text = page.read_text()
  return [(text[: m.start()].count("\n") + 2, m[1]) for m in re.finditer(r"```python\n(.*?)```", text, re.S)]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_code_block_runs_twice(page, tmp_path, monkeypatch):
  """A page's blocks run in order in one namespace, in a temporary directory; a second run of the
  page (as a reader running it again) works as well: nothing depends on what the first left."""
  monkeypatch.chdir(tmp_path)
  for _ in range(2):
    namespace = {"__name__": "__docs__"}
    for line, code in blocks(page):
      exec(compile("\n" * (line - 1) + code, str(page), "exec"), namespace)


def test_the_site_builds_strictly(tmp_path):
  result = subprocess.run(
    [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
    cwd=ROOT,
    capture_output=True,
    text=True,
  )
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]


def _public():
  import inspect

  import jaxres as jr

  names = [
    (n, getattr(jr, n))
    for n in dir(jr)
    if not n.startswith("_") and not inspect.ismodule(getattr(jr, n))  # keys, saved_model: below
  ]
  names += [(f"keys.{n}", getattr(jr.keys, n)) for n in jr.keys.__all__]
  names += [(f"saved_model.{n}", getattr(jr.saved_model, n)) for n in ("save", "load", "Signature")]
  return names, inspect


def test_every_public_name_has_a_docstring_with_args_and_an_example():
  """Each public name documents its arguments (``Args:``, or ``Attributes:`` for a record; a table
  class through its ``create``) and shows a runnable example (the doctests run them)."""
  names, inspect = _public()
  missing = []
  for name, obj in names:
    doc = inspect.getdoc(obj) or ""
    if ">>>" not in doc:
      missing.append(f"{name}: no example")
    documented = getattr(obj, "create", obj)  # tables are made with create()
    try:
      params = [p for p in inspect.signature(documented).parameters if p not in ("self", "cls")]
    except (TypeError, ValueError):
      params = []
    is_enum = isinstance(obj, type) and issubclass(obj, enum.Enum)
    section = ("Args:", "Attributes:")
    if params and not is_enum and not any(s in (inspect.getdoc(documented) or "") + doc for s in section):
      missing.append(f"{name}: no Args")
  assert not missing, missing
