"""Object paths: local names joined by ``/``, escaped so that none collide.

``%``, ``/`` and ``.`` inside a local name are percent-escaped, so ``"a.b"``,
``"a"/"b"`` and ``"c/d"`` stay three different paths; ``.`` is escaped too
because storage layers (Orbax among them) join keys with dots.
"""

from __future__ import annotations

_ESCAPES = (("%", "%25"), ("/", "%2F"), (".", "%2E"))


def escape(name: str) -> str:
  """One local name, escaped for use in a path."""
  if not isinstance(name, str) or not name:
    raise ValueError(f"name: expected a non-empty str, got {name!r}.")
  for raw, escaped in _ESCAPES:
    name = name.replace(raw, escaped)
  return name


def join(*names: str) -> str:
  """A path from local names: ``join("model", "a.b") == "model/a%2Eb"``."""
  return "/".join(escape(n) for n in names)


def child(path: str, name: str) -> str:
  """The path of ``name`` under ``path`` ("" is the root)."""
  return escape(name) if not path else f"{path}/{escape(name)}"


def names(path: str) -> list[str]:
  """The local names of a path (inverse of :func:`join`)."""
  if not path:
    return []
  out = []
  for part in path.split("/"):
    for raw, escaped in reversed(_ESCAPES):
      part = part.replace(escaped, raw)
    out.append(part)
  return out
