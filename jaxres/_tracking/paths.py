"""Object paths: local names joined by ``/``, escaped so that none collide.

``%``, ``/`` and ``.`` inside a local name are percent-escaped, so ``"a.b"``,
``"a"/"b"`` and ``"c/d"`` stay three different paths; ``.`` is escaped too
because storage layers (Orbax among them) join keys with dots.
"""

from __future__ import annotations

_ESCAPES = (("%", "%25"), ("/", "%2F"), (".", "%2E"))


def escape(name: str) -> str:
  """One local name, escaped for use in a path."""
  if not isinstance(name, str):
    raise TypeError(f"name: expected a non-empty str, got {name!r}.")
  if not name:
    raise ValueError("name: expected a non-empty str, got ''.")
  for raw, escaped in _ESCAPES:
    name = name.replace(raw, escaped)
  return name


def unescape(segment: str) -> str:
  """The local name of one escaped path segment (inverse of :func:`escape`)."""
  for raw, escaped in reversed(_ESCAPES):
    segment = segment.replace(escaped, raw)
  return segment


def relative(keys) -> str:
  """The relative path of a sequence of local names (each escaped)."""
  return "/".join(escape(key) for key in keys)


def by_relative(named: dict) -> dict:
  """``{relative path: value}`` of ``{local names (a tuple): value}``."""
  return {relative(keys): value for keys, value in named.items()}


def join(path: str, relative: str) -> str:
  """The path of ``relative`` (escaped segments) under ``path`` ("" is the root)."""
  return relative if not path else f"{path}/{relative}"
