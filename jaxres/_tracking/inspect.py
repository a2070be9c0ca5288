"""Reading a checkpoint's object graph without loading its arrays."""

from __future__ import annotations

from jaxres._persistence import files, replacing
from jaxres._tracking import manifest, orbax_io


def inspect_checkpoint(path) -> list[dict]:
  """The object graph of a checkpoint: one entry per object path, arrays unread.

  Each entry has ``path``, ``kind`` (the kind of object: ``trackable``,
  ``table``, ``resource``, ``nnx``, ``array``, ``pytree``, ``list``, ``tuple``,
  ``dict``, ...; ``alias`` for a second path of an object saved elsewhere),
  ``type`` (its class), and ``arrays``: a list of ``{"name", "shape",
  "dtype"}``. An alias entry names the path it shares (``of``). In an
  incremental step, an object saved as what changed since the step before has
  ``"delta": True``, and an array kept from an earlier step names it (``"step"``).

  Args:
    path: a checkpoint directory (``Checkpoint.save``'s, or a
      ``CheckpointManager`` step's).

  Returns:
    The entries, sorted by path.

  Examples:
    >>> import tempfile, jax.numpy as jnp, jaxres as jr
    >>> root = jr.AutoTrackable()
    >>> root.step = jnp.array(3)
    >>> path = jr.Checkpoint(model=root).save(tempfile.mkdtemp() + "/ckpt")
    >>> [(e["path"], e["kind"]) for e in jr.inspect_checkpoint(path)]
    [('', 'trackable'), ('model', 'trackable'), ('model/step', 'array')]
    >>> jr.inspect_checkpoint(path)[2]["arrays"]
    [{'name': 'value', 'shape': [], 'dtype': 'int32'}]
  """
  directory = files.directory_path(path)
  read = lambda where: manifest.check(orbax_io.read_manifest(where), directory, incremental=True)
  contents = replacing.read_whole(directory, read)
  specs = contents["arrays"]
  entries = []
  for node_path, node in sorted(contents["nodes"].items()):
    if "alias" in node:
      target = contents["nodes"][node["alias"]]
      entries.append(
        {"path": node_path, "kind": "alias", "type": target["type"], "of": node["alias"], "arrays": []}
      )
      continue
    arrays = [
      {"name": name, "shape": specs[key]["shape"], "dtype": specs[key]["dtype"]}
      | ({"step": specs[key]["step"]} if "step" in specs[key] else {})
      for name, key in node["arrays"].items()
    ]
    entry = {"path": node_path, "kind": node["kind"], "type": node["type"], "arrays": arrays}
    entries.append(entry | ({"delta": True} if node.get("delta") else {}))
  return entries
