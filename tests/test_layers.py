"""The package's layers: imports point one way (core -> shell -> tracking -> integrations), no cycles.

Inside the core, the sub-packages are layers too: encoding (keys and values as
words) -> kernels (the native kernels and their XLA references) -> the core's
own modules (the table API, call arguments, policies) -> storages (open
addressing, sorted arrays) -> sharding (a table over a mesh).

``python tests/test_layers.py`` prints the imports between folders.
"""

import ast
import collections
import functools
import graphlib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "jaxres"

# Each module may import from its own layer and the layers below it.
LAYERS = {
  "jaxres._errors": -1,
  "jaxres._core.constants": -0.5,
  "jaxres._core.encoding": 0,
  "jaxres._core.kernels": 0.1,
  "jaxres._core": 0.2,
  "jaxres._core.storages": 0.3,
  "jaxres._core.sharding": 0.4,
  "jaxres._persistence": 0.9,
  "jaxres.keys": 1,
  "jaxres._shell": 1,
  "jaxres._tracking": 2,
  "jaxres._integrations": 3,
  "jaxres._nn": 3,
  "jaxres._serving": 3,
  "jaxres.saved_model": 4,
  "jaxres": 4,
  "jaxres.examples": 5,
  "jaxres.demo": 6,
}
# Third-party packages whose APIs move fast, each kept to a few modules.
CONFINED = {
  "flax": {
    "jaxres._shell.resource",
    "jaxres._shell.donation",  # the nnx.Variable of tables, warning when nnx.jit copies one
    "jaxres._integrations.nnx",
    "jaxres._nn.embedding",
    "jaxres._nn.collection",  # an nnx.Module of embeddings
    "jaxres._nn.row_gradients",  # jr.value_and_grad: nnx.value_and_grad with the rows' gradients
    "jaxres._serving.served_state",
    "jaxres.examples",
    "jaxres.demo",
  },
  "orbax": {"jaxres._tracking.orbax_io"},
  "tensorflow": {"jaxres._serving.tf_savedmodel"},
}


@functools.cache
def modules() -> dict[str, Path]:
  out = {}
  for path in sorted(PACKAGE.rglob("*.py")):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return out


def imports(path: Path, known: set[str]) -> set[str]:
  """Every module ``path`` imports: jaxres modules by name, others by their top-level package."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found |= {alias.name for alias in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module:
      submodules = {f"{node.module}.{alias.name}" for alias in node.names} & known
      found |= submodules
      if len(submodules) < len(node.names):  # names defined in the module itself
        found.add(node.module)
  return {name if name.startswith("jaxres") else name.split(".")[0] for name in found}


def layer(module: str) -> str:
  return max((prefix for prefix in LAYERS if module == prefix or module.startswith(prefix + ".")), key=len)


@functools.cache
def graph() -> dict[str, set[str]]:
  known = set(modules())
  return {module: imports(path, known) for module, path in modules().items()}


def folder_edges() -> dict[tuple[str, str], int]:
  """``(importing layer, imported layer) -> number of imports`` between different layers."""
  edges = collections.Counter()
  for module, imported in graph().items():
    for target in imported:
      if target.startswith("jaxres") and layer(target) != layer(module):
        edges[layer(module), layer(target)] += 1
  return dict(sorted(edges.items()))


def test_imports_point_down_the_layers():
  upward = [
    f"{module} -> {target}"
    for module, imported in graph().items()
    for target in imported
    if target.startswith("jaxres") and LAYERS[layer(target)] > LAYERS[layer(module)]
  ]
  assert not upward, upward


def test_no_import_cycles_between_modules():
  imports_of = graph()
  local = {
    module: {t for t in imported if t in imports_of and t != module}
    for module, imported in imports_of.items()
  }
  graphlib.TopologicalSorter(local).prepare()  # raises CycleError


# What only the persistence side (and above) may know: other processes, checkpoints.
_PROCESS_AND_CHECKPOINT_APIS = (
  "multihost_utils",
  "process_count",
  "process_index",
  "process_local_data",
  "orbax",
)


def test_the_core_knows_nothing_of_checkpoints_or_processes():
  core = [m for m in modules() if m.startswith("jaxres._core")]
  assert not [
    (module, target)
    for module in core
    for target in graph()[module]
    if target.startswith("jaxres") and not target.startswith("jaxres._core") and target != "jaxres._errors"
  ]
  found = [
    (module, name)
    for module in core
    for name in _PROCESS_AND_CHECKPOINT_APIS
    if name in modules()[module].read_text()
  ]
  assert not found, found


def test_the_examples_and_the_demo_use_the_public_api_only():
  private = [
    f"{module} -> {target}"
    for module, imported in graph().items()
    if layer(module) in ("jaxres.examples", "jaxres.demo")
    for target in imported
    if target.startswith("jaxres._")
  ]
  assert not private, private


# The storage kinds are reached through their registry (jaxres._core.storages.registry); serving alone
# imports a storage: it reads the sorted storage's read-only form of every table.
STORAGE_IMPORTERS = {"jaxres._serving.served_state", "jaxres._serving.updates", "jaxres.saved_model"}


def test_only_the_registry_and_serving_import_the_storages():
  storages = {
    module
    for module in modules()
    if module.startswith("jaxres._core.storages.") and module != "jaxres._core.storages.registry"
  }
  importers = {
    module
    for module, imported in graph().items()
    if imported & storages and not module.startswith("jaxres._core.storages.")
  }
  assert importers <= STORAGE_IMPORTERS, sorted(importers - STORAGE_IMPORTERS)


def test_fast_moving_dependencies_are_confined():
  for package, allowed in CONFINED.items():
    users = {module for module, imported in graph().items() if package in imported}
    assert {layer(m) if layer(m) in allowed else m for m in users} <= allowed, (package, users)


if __name__ == "__main__":
  for (source, target), count in folder_edges().items():
    print(f"{source:22} -> {target:22} {count} imports")
