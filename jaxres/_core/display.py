"""Readable reprs of tables and modules: a few facts and entries as text, or an HTML table in notebooks."""

from __future__ import annotations

import html

import jax
import numpy as np

_MAX_CHARS = 60


def _short(value) -> str:
  text = repr(value)
  return text if len(text) <= _MAX_CHARS else text[: _MAX_CHARS - 4] + " ..."


def first_entries(keys, values, count: int) -> list[tuple[str, str]]:
  """``(key, value)`` texts of the first ``count`` entries of host arrays, long ones truncated.

  ``values`` is an array or a pytree of arrays with the entries on axis 0.
  """
  return [
    (
      _short(np.asarray(keys[i]).tolist()),
      _short(jax.tree.map(lambda v, i=i: np.asarray(v[i]).tolist(), values)),
    )
    for i in range(min(count, len(keys)))
  ]


def text(name: str, entries: list[tuple[str, str]], size: int) -> str:
  """``{k: v, k: v, ...}`` after ``name``: the text repr."""
  more = ", ..." if size > len(entries) else ""
  return f"{name}, size={size}, {{{', '.join(f'{k}: {v}' for k, v in entries)}{more}}})"


def constructor(name: str, facts: dict[str, str], *, lines: bool = False) -> str:
  """``name(k=v, k=v)``: the facts on one line, or one a line (``lines``), their own lines indented.

  Examples:
    >>> inner = constructor("Outer", {"a": constructor("Inner", {"b": "1", "c": "2"}), "d": "3"}, lines=True)
    >>> print(constructor("Outermost", {"e": inner}, lines=True))
    Outermost(
      e=Outer(
        a=Inner(b=1, c=2),
        d=3
      )
    )
  """
  if not lines:
    return f"{name}({', '.join(f'{k}={v}' for k, v in facts.items())})"
  body = ",\n".join(f"  {k}={v}".replace("\n", "\n  ") for k, v in facts.items())
  return f"{name}(\n{body}\n)"


def count(value) -> str:
  """The text of a count held in an array, or ``"traced"`` where it is not known (inside ``jit``,
  or of an abstract module)."""
  try:
    return str(int(value))
  except TypeError:  # a tracer (jax's ConcretizationTypeError) or a ShapeDtypeStruct
    return "traced"


def html_table(title: str, facts: dict[str, str], entries: list[tuple[str, str]], size: int) -> str:
  """An HTML summary: the title, facts such as dtypes and size, and the first entries."""
  head = " &middot; ".join(f"{html.escape(k)} <code>{html.escape(v)}</code>" for k, v in facts.items())
  rows = "".join(
    f"<tr><td style='text-align:left'><code>{html.escape(k)}</code></td>"
    f"<td style='text-align:left'><code>{html.escape(v)}</code></td></tr>"
    for k, v in entries
  )
  if size > len(entries):
    rows += f"<tr><td colspan='2' style='text-align:left'>&hellip; {size - len(entries):,} more</td></tr>"
  table = f"<table><tr><th>key</th><th>value</th></tr>{rows}</table>" if entries else ""
  return f"<div><b>{html.escape(title)}</b> {head}{table}</div>"
