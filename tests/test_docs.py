"""The documentation: every Python block of every page (and of the README) runs, twice, and the site
builds with warnings as errors (a broken reference fails)."""

import enum
import importlib.util
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


@pytest.mark.filterwarnings("error::jaxres.TableCopyWarning")  # a page's steps donate their tables
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
  """The site builds with warnings as errors, and reads as a user sees it (one build, several
  checks: building takes most of the time)."""
  site = tmp_path / "site"
  result = subprocess.run(
    [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
    cwd=ROOT,
    capture_output=True,
    text=True,
  )
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
  pages = {str(p.relative_to(site).parent): p.read_text() for p in site.rglob("index.html")}
  problems = [
    *raw_roles(pages),
    *private_names(pages),
    *broken_code_spans(pages),
    *unhighlighted_blocks(pages),
    *missing_from_the_reference(pages["api"]),
    *blocks_wider_than_the_page(site),
  ]
  assert not problems, problems


def blocks_wider_than_the_page(site) -> list[str]:
  """Every code block scrolls sideways inside the page: the theme scrolls the highlighted ones alone,
  so the site's own style sheet must scroll the rest (plain text, an example's output)."""
  sheets = "".join(p.read_text() for p in (site / "css").glob("*.css"))
  rule = re.search(r"\.rst-content pre\s*\{[^}]*overflow-x:\s*auto", sheets)
  return [] if rule else ["no style rule scrolls the code blocks (.rst-content pre { overflow-x: auto })"]


ROLE = re.compile(r":(?:py:)?(?:meth|class|attr|func|data|mod|exc|obj|const|ref):")
# Pages about the implementation itself, which name its private modules on purpose.
INTERNALS = ("architecture", "measurements", "reliability")


def raw_roles(pages: dict[str, str]) -> list[str]:
  """Sphinx roles shown as text (tools/api_reference.py turns the docstrings' roles into links)."""
  return [f"{page}: raw role {m[0]}" for page, html in pages.items() for m in ROLE.finditer(html)]


def private_names(pages: dict[str, str]) -> list[str]:
  """Private paths (``jaxres._core...``) anywhere in a user's page, link titles included, and
  private classes among a class's bases in the reference."""
  found = [
    f"{page}: private name {m[0]!r}"
    for page, html in pages.items()
    if page not in INTERNALS
    for m in re.finditer(r"jaxres\._\w*|\b_core\b", html)
  ]
  private_classes = {
    cls.__name__
    for name, module in list(sys.modules.items())
    if name.startswith("jaxres.")
    for cls in vars(module).values()
    if inspect.isclass(cls) and cls.__module__.startswith("jaxres.")
  } - {name.rsplit(".", 1)[-1] for name, _ in _public()}
  for bases in re.findall(r"Bases: (.*?)</p>", pages["api"], re.S):
    names = set(re.sub(r"<[^>]+>", "", bases).replace(",", " ").split())
    found += [f"api: private base {name}" for name in sorted(names & private_classes)]
  return found


def broken_code_spans(pages: dict[str, str]) -> list[str]:
  """Backticks left in the text: a code span that Markdown did not close (a line of a paragraph
  starting with ``+`` or ``-`` inside one makes a list item and turns the spans inside out)."""
  found = []
  for page, html in pages.items():
    text = re.sub(r"<(pre|code|script|style)\b.*?</\1>|<[^>]+>", "", html, flags=re.S)
    found += [
      f"{page}: stray backtick near {text[max(0, m.start() - 60) : m.end() + 20]!r}"
      for m in re.finditer("`", text)
    ]
  return found


def unhighlighted_blocks(pages: dict[str, str]) -> list[str]:
  """Code shown without highlighting: each docstring example of the reference, and as many blocks of
  a page as its source has ```python blocks, hold Pygments' token classes."""
  found = []
  for page, html in pages.items():
    highlighted = len(
      re.findall(r'<div class="[^"]*highlight[^"]*"><pre><span></span><code><span class="', html)
    )
    source = ROOT / "docs" / ("index.md" if page == "." else f"{page}.md")
    expected = html.count("<pre") if page == "api" else len(blocks(source)) if source.exists() else 0
    if highlighted < expected:
      found.append(f"{page}: {expected - highlighted} of {expected} code blocks not highlighted")
  return found


def missing_from_the_reference(api: str) -> list[str]:
  """Every public name, and every public method or property of a public class, has an entry."""
  import jaxres as jr

  entries = set(re.findall(r'id="(jaxres\.[\w.]+)"', api))
  names = [(f"jaxres.{n}", getattr(jr, n)) for n in jr.__all__]
  for module in (jr.keys, jr.saved_model):
    names += [(f"{module.__name__}.{n}", getattr(module, n)) for n in module.__all__]
  for path, obj in list(names):
    if inspect.isclass(obj):
      names += [
        (f"{path}.{attr}", member)
        for attr, member in vars(obj).items()
        if (not attr.startswith("_") or attr == "__call__")  # a module's __call__: how it is used
        and (inspect.isfunction(member) or isinstance(member, (classmethod, staticmethod, property)))
        and member.__doc__
      ]
  return [f"{path} has no entry" for path, _ in names if path not in entries]


def test_a_role_links_to_the_entry_that_documents_its_target():
  """tools/api_reference.py resolves a role's target as Python would from the docstring's object
  (here ``Table.insert``): its class, inherited members, its module, the package; the link goes to
  the entry that documents it (an inherited method: its class's entry), plain code where the
  reference has none (a private helper, another library, Sphinx's ``!``)."""
  import griffe

  spec = importlib.util.spec_from_file_location("api_reference", ROOT / "tools" / "api_reference.py")
  tool = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(tool)
  pkg = griffe.load("jaxres", search_paths=[str(ROOT)], resolve_aliases=False)
  public = tool.documented_paths(pkg)
  insert = pkg["Table"].final_target.members["insert"]
  expected = {
    "find": "[`find`][jaxres.Table.find]",
    "find()": "[`find()`][jaxres.Table.find]",
    "~jaxres.Table.find": "[`find`][jaxres.Table.find]",
    "the lookup <Table.find>": "[`the lookup`][jaxres.Table.find]",
    "MutableHashTable.find": "[`MutableHashTable.find`][jaxres.LookupTable.find]",
    "jaxres.saved_model.LoadedModel.update": (
      "[`jaxres.saved_model.LoadedModel.update`][jaxres.saved_model.LoadedModel.update]"
    ),
    "jaxres.keys": "[`jaxres.keys`][jaxres.keys]",
    "!jaxres.Table": "`jaxres.Table`",
    "jax.shard_map": "`jax.shard_map`",
    "Table._claim": "`Table._claim`",
    "NoSuchName.find": "`NoSuchName.find`",
  }
  assert {body: tool.reference(body, insert, pkg, public) for body in expected} == expected


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
  names += [(f"saved_model.{n}", getattr(jr.saved_model, n)) for n in jr.saved_model.__all__]
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
