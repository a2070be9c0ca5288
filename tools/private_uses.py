"""Cross-file uses of private members inside ``jaxres``: ``python tools/private_uses.py``.

A use ``x._name`` in one file counts when ``_name`` is defined (as a method, attribute or
assignment ``self._name = ...``) only in other files, and outside the using file's class
hierarchies: no class of the using file shares a ``jaxres`` base class with a class defining it
(so a ``ShardedTable`` driving its shards through the ``Table`` hierarchy's row methods is one
hierarchy; a shell object reaching into a core table is not). Prints each use and the total: the
number issue 29 wants at 0 (protocol hooks of ``jr.Trackable``, which API.md names, excepted).
"""

from __future__ import annotations

import ast
import collections
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "jaxres"
PROTOCOL = {
  "_trackable_children",
  "_serialize_to_arrays",
  "_serialize_changes_to_arrays",
  "_restore_from_arrays",
  "_prepare_restore",
  "_holds_arrays",
  "_replace_trackable_child",
  "_defer_restore",
  "_checkpoint_kind",
}


def definitions(tree: ast.Module) -> tuple[set[str], dict[str, set[str]], dict[str, list[str]]]:
  """Private names defined in a file, per class ``{class: names}``, and each class's bases."""
  defined, per_class, bases = set(), collections.defaultdict(set), {}
  for node in ast.walk(tree):
    if isinstance(node, ast.ClassDef):
      bases[node.name] = [ast.unparse(b).split(".")[-1] for b in node.bases]
      for item in ast.walk(node):
        name = None
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
          name = item.name
        elif isinstance(item, ast.Attribute) and isinstance(item.ctx, ast.Store):
          name = item.attr
        elif isinstance(item, ast.Name) and isinstance(item.ctx, ast.Store):
          name = item.id
        if name and name.startswith("_") and not name.startswith("__"):
          per_class[node.name].add(name)
          defined.add(name)
    elif isinstance(node, (ast.FunctionDef, ast.Assign)) and node in tree.body:
      names = (
        [node.name]
        if isinstance(node, ast.FunctionDef)
        else [t.id for t in node.targets if isinstance(t, ast.Name)]
      )
      defined |= {n for n in names if n.startswith("_") and not n.startswith("__")}
  return defined, per_class, bases


def main() -> None:
  files = sorted(PACKAGE.rglob("*.py"))
  trees = {f: ast.parse(f.read_text()) for f in files}
  info = {f: definitions(t) for f, t in trees.items()}
  owners = collections.defaultdict(set)  # name -> classes defining it
  class_bases = {}
  for _, per_class, bases in info.values():
    class_bases.update(bases)
    for cls, names in per_class.items():
      for name in names:
        owners[name].add(cls)

  def ancestors(cls: str) -> set[str]:
    seen, stack = set(), [cls]
    while stack:
      c = stack.pop()
      if c not in seen:
        seen.add(c)
        stack += class_bases.get(c, [])
    return seen

  def roots(classes: set[str]) -> set[str]:
    """The jaxres classes at the top of the hierarchies of ``classes``."""
    found = set().union(*(ancestors(c) for c in classes)) if classes else set()
    return {c for c in found if c in class_bases and not set(class_bases[c]) & set(class_bases)}

  total = 0
  for f, tree in trees.items():
    defined, per_class, _ = info[f]
    mine = roots(set(per_class))
    for node in ast.walk(tree):
      if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
        continue
      name = node.attr
      if name in defined or name in PROTOCOL or not owners.get(name):
        continue
      if roots(owners[name]) & mine:
        continue
      total += 1
      print(f"{f.relative_to(PACKAGE.parent)}:{node.lineno}: {ast.unparse(node)}")
  print(f"{total} cross-file uses of private members")


if __name__ == "__main__":
  main()
