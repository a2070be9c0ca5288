"""Reading a checkpoint's object graph without loading its arrays."""

from __future__ import annotations

from jaxres._tracking import storage
from jaxres._tracking.checkpoint import read_manifest

_ARRAY_FIELDS = ("value", "keys")


def inspect_checkpoint(path) -> list[dict]:
  """The object graph of a checkpoint: one entry per object path, arrays unread.

  Each entry has ``path``, ``kind`` (``table``, ``table_value`` for a
  functional table, ``resource``, ``module``, ``trackable``, ``array``,
  ``pytree`` or ``alias``), ``type``, and
  ``arrays``: a list of ``{"name", "shape", "dtype"}``. An alias entry names
  the path it shares (``of``).

  Example:
    >>> import tempfile, jax.numpy as jnp, jaxres as jr
    >>> root = jr.AutoTrackable()
    >>> root.step = jnp.array(3)
    >>> path = jr.Checkpoint(model=root).save(tempfile.mkdtemp() + "/ckpt")
    >>> [(e["path"], e["kind"]) for e in jr.inspect_checkpoint(path)]
    [('', 'trackable'), ('model', 'trackable'), ('model/step', 'array')]
    >>> jr.inspect_checkpoint(path)[2]["arrays"]
    [{'name': 'value', 'shape': [], 'dtype': 'int32'}]
  """
  manifest = read_manifest(storage.absolute_path(path))
  specs = manifest["arrays"]
  entries = []
  for node_path in sorted(manifest["nodes"]):
    node = manifest["nodes"][node_path]
    entry = {"path": node_path, "kind": node["kind"], "type": node.get("type", "")}
    if node["kind"] == "alias":
      entry["of"] = node["of"]
    entry["arrays"] = [
      {"name": name, "shape": specs[key]["shape"], "dtype": specs[key]["dtype"]}
      for name, key in _array_refs(node)
    ]
    entries.append(entry)
  return entries


def _array_refs(node: dict) -> list[tuple[str, str]]:
  refs = [(field, node[field]) for field in _ARRAY_FIELDS if field in node]
  refs += [(f"values/{i}", key) for i, key in enumerate(node.get("values", []))]
  refs += sorted(node.get("variables", {}).items())
  for i, shard in enumerate(node.get("shards", [])):  # a functional table, shard by shard
    refs += [(f"shards/{i}/{name}", key) for name, key in _array_refs(shard)]
  if "layout" in node:
    refs += _layout_refs(node["layout"], "")
  return refs


def _layout_refs(layout: dict, prefix: str) -> list[tuple[str, str]]:
  ((tag, body),) = layout.items()
  if tag == "leaf":
    return [(prefix or "value", body)]
  items = body.items() if tag == "dict" else enumerate(body)
  return [ref for key, sub in items for ref in _layout_refs(sub, f"{prefix}/{key}" if prefix else str(key))]
