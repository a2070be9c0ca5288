"""The documentation: every Python block of every page (and of the README) runs, twice, and the site
builds with warnings as errors (a broken reference fails)."""

import enum
import inspect
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


def test_every_code_block_of_the_site_is_one_the_tests_run():
  """The site's code blocks are all Python (run above): commands to type are given in the text."""
  other = [
    (str(page.relative_to(ROOT)), fence)
    for page in PAGES[:-1]
    for fence in re.findall(r"^```(\w*)$", page.read_text(), re.M)
    if fence not in ("python", "")
  ]
  assert not other, other


def _public():
  import jaxres as jr

  names = [
    (n, getattr(jr, n))
    for n in dir(jr)
    if not n.startswith("_") and not inspect.ismodule(getattr(jr, n))  # keys, saved_model: below
  ]
  names += [(f"keys.{n}", getattr(jr.keys, n)) for n in jr.keys.__all__]
  names += [(f"saved_model.{n}", getattr(jr.saved_model, n)) for n in ("save", "load", "Signature")]
  return names


def test_every_public_name_has_a_docstring_with_args_and_an_example():
  """Each public name documents its arguments (``Args:``, or ``Attributes:`` for a record; a table
  class through its ``create``), a function what it returns (``Returns:``, unless nothing), and
  shows a runnable example (the doctests run them)."""
  names = _public()
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
    returns = inspect.signature(obj).return_annotation if inspect.isfunction(obj) else None
    if inspect.isfunction(obj) and returns not in (None, "None") and "Returns:" not in doc:
      missing.append(f"{name}: no Returns")
  assert not missing, missing
