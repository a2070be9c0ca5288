"""The API reference shows jaxres as a user imports it: a Griffe extension, loaded by ``mkdocs.yml``.

mkdocstrings reads the code with Griffe, which knows each object by where it is defined
(``jaxres._core.table.Table``). Once the package is loaded, this extension:

- rewrites the docstrings' Sphinx roles (``:meth:`Table.find```, ``:class:`~jaxres.Table```,
  ``:attr:``, ``:func:``, ``:data:``, ``:mod:``, ``:exc:``, ``:obj:``, ``:const:``) into
  cross-references to the documented object (``[`Table.find`][jaxres.Table.find]``), a name resolved
  as Python would from the docstring's object (its class and bases, then its module's names), or
  into plain code when the target has no entry in the reference (a private helper, another library);
- shows a default that is a private constant (``initializer=_INITIALIZER``) as its value;
- points the names of signatures, annotations and bases at their public paths (``jaxres.Table``),
  leaves a private name that the reference does not document as plain text, and drops a private
  base class (a protocol the user never names) from a class's bases.

What the reference documents is what the package exports: ``jaxres.__all__``, the ``__all__`` of
each exported module, and the public members with docstrings of each exported class, ``__call__``
included (as mkdocstrings renders them with ``filters: ["!^_(?!_call__$)"]``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import griffe

PACKAGE = "jaxres"
ROLE = re.compile(r":(?:py:)?(?:meth|class|attr|func|data|mod|exc|obj|const):`(?P<body>[^`]+)`")
TITLED = re.compile(r"(?P<title>.*?)\s*<(?P<target>[^<>]+)>")
UNRESOLVED = (KeyError, ValueError, griffe.AliasResolutionError, griffe.CyclicAliasError)


class PublicReference(griffe.Extension):
  """Rewrites roles, signatures and bases of the ``jaxres`` package to its public names."""

  def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
    if pkg.name != PACKAGE:
      return
    public = documented_paths(pkg)
    objects = list(defined_objects(pkg))
    # Roles first: resolving one may walk a class's bases, which the second loop prunes.
    for obj in objects:
      if obj.docstring:
        obj.docstring.value = ROLE.sub(
          lambda m, obj=obj: reference(m["body"], obj, pkg, public), obj.docstring.value
        )
    for obj in objects:
      if obj.is_class:
        obj.bases = [base for base in obj.bases if shown(base, public)]
      if obj.is_function:
        for parameter in obj.parameters:
          parameter.default = constant_value(parameter.default, pkg, public) or parameter.default
      for expression in expressions(obj):
        publish(expression, public)


def documented_paths(pkg: griffe.Module) -> dict[str, str]:
  """``{canonical path: public path}`` of every object the reference documents."""
  paths: dict[str, str] = {}

  def add(public_path: str, obj: griffe.Object | griffe.Alias) -> None:
    target = obj.final_target if obj.is_alias else obj
    if target.path in paths:
      return
    paths[target.path] = public_path
    if target.is_module:
      members = {name: target[name] for name in target.exports or ()}
    elif target.is_class:
      members = {n: m for n, m in target.members.items() if not n.startswith("_") and m.has_docstrings}
    else:
      members = {}
    for name, member in members.items():
      add(f"{public_path}.{name}", member)

  add(pkg.path, pkg)
  del paths[pkg.path]  # the package itself has no entry of its own: its names do
  return paths


def defined_objects(obj: griffe.Object) -> Iterator[griffe.Object]:
  """``obj`` and every object defined inside it (not the names it imports)."""
  yield obj
  for member in obj.members.values():
    if not member.is_alias:
      yield from defined_objects(member)


def reference(body: str, owner: griffe.Object, pkg: griffe.Module, public: dict[str, str]) -> str:
  """The Markdown for one role's ``body``, written in ``owner``'s docstring."""
  titled = TITLED.fullmatch(body)
  target = titled["target"] if titled else body
  short = target.startswith("~")
  target = target.lstrip("~!.")
  name = target.removesuffix("()")
  title = titled["title"] if titled else (target.rsplit(".", 1)[-1] if short else target)
  path = public.get(canonical_path(name, owner, pkg) or "")
  return f"[`{title}`][{path}]" if path and not body.startswith("!") else f"`{title}`"


def canonical_path(name: str, owner: griffe.Object, pkg: griffe.Module) -> str | None:
  """Where the object that ``name`` names in ``owner``'s scope is defined, or None if unknown."""
  first, *rest = name.split(".")
  scope: griffe.Object | None = owner
  found = pkg if first == pkg.name else None
  while found is None and scope is not None:
    found = members(scope).get(first)
    scope = scope.parent
  try:
    for part in rest if found is not None else ():
      found = members(found.final_target if found.is_alias else found)[part]
    return None if found is None else (found.final_target if found.is_alias else found).path
  except UNRESOLVED:
    return None


def members(obj: griffe.Object) -> dict[str, griffe.Object | griffe.Alias]:
  """The names ``obj`` holds: a class's own and inherited members, a module's members and imports."""
  return obj.all_members if obj.is_class else obj.members


def expressions(obj: griffe.Object) -> Iterator[griffe.Expr]:
  """The expressions the reference shows for ``obj``: parameters, return type, value, bases."""
  parts: list = []
  if obj.is_function:
    parts = [obj.returns]
    for parameter in obj.parameters:
      parts += [parameter.annotation, parameter.default]
  elif obj.is_attribute:
    parts = [obj.annotation, obj.value]
  elif obj.is_class:
    parts = list(obj.bases)
  yield from (part for part in parts if isinstance(part, griffe.Expr))


def publish(expression: griffe.Expr, public: dict[str, str]) -> None:
  """Points each ``jaxres`` name of ``expression`` at its public path, or makes it plain text."""
  for name in expression.iterate(flat=True):
    if not isinstance(name, griffe.ExprName):
      continue
    path = name.canonical_path
    if path.split(".", 1)[0] != PACKAGE:
      continue
    if path in public:
      name.parent, _, name.name = public[path].rpartition(".")
    elif "._" in path:
      name.parent = None  # no public page to link: the name alone, unlinked


def constant_value(default: griffe.Expr | str | None, pkg: griffe.Module, public: dict[str, str]):
  """The value of a private, undocumented module constant that ``default`` names, else None."""
  if not isinstance(default, griffe.ExprName):
    return None
  path = default.canonical_path
  if path in public or not path.startswith(f"{PACKAGE}._"):
    return None
  try:
    constant = pkg.modules_collection[path]
  except UNRESOLVED:
    return None
  return constant.value if constant.is_attribute and isinstance(constant.value, griffe.Expr) else None


def shown(base: griffe.Expr | str, public: dict[str, str]) -> bool:
  """Whether a base class belongs in the reference: documented, or from another library."""
  path = base.canonical_path if isinstance(base, griffe.Expr) else base
  return path in public or not (path.startswith(f"{PACKAGE}.") and "._" in path)
