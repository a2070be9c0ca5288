"""``python -m benchmarks.eviction_ab BASE``: an evicting ``find_or_insert``, this checkout against
git revision ``BASE``, in one run.

The call: 4096 int64 keys, half of them new, on a full ``jr.LRU()`` table of
2^20 entries, jitted with the table donated (as ``benchmarks.eviction``
times it). ``BASE`` is checked out into a temporary git worktree and its
kernels built there (``setup.py build_ext --inplace``: a C++ compiler is
needed); then processes of the two codes alternate, ``--runs`` of each, every
process timing ``--calls`` calls after one that compiles. It prints the
median over processes of each process's median, the range of those, and the
ratio. Alternating processes put both codes under the same conditions: on a
shared VM the speed of memory drifts by half within minutes, and one process
of a code can run a third slower than the next.

Options: ``--window`` (this checkout's ``eviction_window``; default: the
table's default), ``--runs``, ``--calls``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Runs in either checkout (only APIs both have), prints the median call in microseconds.
WORKER = """
import json, statistics, sys, time
import jax, jax.numpy as jnp, numpy as np
import jaxres as jr
calls, window, batch, capacity = int(sys.argv[1]), int(sys.argv[2]), 4096, 1 << 20
rng = np.random.default_rng(7)
universe = rng.permutation(np.arange(capacity + calls * batch, dtype=np.int64) * 2654435761 + 1)
stored, fresh = universe[:capacity], universe[capacity:]
fill = jax.jit(lambda t, k: t.insert(k, jnp.zeros(k.shape[:1], jnp.int32)))
step = jax.jit(lambda t, k: t.find_or_insert(k, jnp.zeros(k.shape[:1], jnp.int32))[0], donate_argnums=0)
options = {"eviction_window": window} if window else {}
table = jr.OpenAddressingTable.create(capacity, key=jnp.int64, value=jnp.int32, eviction=jr.LRU(), **options)
for start in range(0, capacity, 1 << 16):
  table = fill(table, jr.keys.split64(stored[start:start + (1 << 16)]))
work = []
for i in range(calls + 1):
  keys = np.concatenate([rng.choice(stored, batch // 2), fresh[i * batch // 2:(i + 1) * batch // 2]])
  work.append(jax.device_put(jr.keys.split64(rng.permutation(keys))))
table = jax.block_until_ready(step(table, work[0]))
elapsed = []
for keys in work[1:]:
  begin = time.perf_counter()
  table = jax.block_until_ready(step(table, keys))
  elapsed.append(time.perf_counter() - begin)
assert int(table.size) == capacity and int(table.evictions) > 0
print(json.dumps(statistics.median(elapsed) * 1e6))
"""


def _median_call(root: Path, calls: int, window: int) -> float:
  env = dict(os.environ, PYTHONPATH=str(root))
  done = subprocess.run(
    [sys.executable, "-c", WORKER, str(calls), str(window)],
    cwd=root,
    env=env,
    capture_output=True,
    text=True,
    check=True,
  )
  return json.loads(done.stdout.strip().splitlines()[-1])


def compare(base: str, runs: int = 5, calls: int = 40, window: int = 0) -> dict:
  """``{"base": [us per process], "this": [...]}``, processes alternating."""
  with tempfile.TemporaryDirectory() as scratch:
    tree = Path(scratch) / "base"
    subprocess.run(
      ["git", "worktree", "add", "--detach", str(tree), base], cwd=ROOT, check=True, capture_output=True
    )
    try:
      subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tree, check=True, capture_output=True
      )
      codes = {"base": (tree, 0), "this": (ROOT, window)}
      times = {name: [] for name in codes}
      for run in range(runs):
        for name in list(codes)[:: 1 if run % 2 == 0 else -1]:
          root, own_window = codes[name]
          times[name].append(_median_call(root, calls, own_window))
    finally:
      subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
  return times


def report(base: str, times: dict, window: int) -> str:
  this_name = "this checkout" + (f", eviction_window={window}" if window else ", default window")
  base_median = statistics.median(times["base"])
  lines = [
    f"## Evicting find_or_insert (4096 keys, half new, full LRU table of 2^20): this checkout vs {base}",
    "",
    "| code | median | processes | ratio |",
    "|---|---|---|---|",
  ]
  for name, label in (("base", base), ("this", this_name)):
    median = statistics.median(times[name])
    spread = f"{min(times[name]):,.0f}-{max(times[name]):,.0f} us"
    lines.append(f"| {label} | {median:,.0f} us | {spread} | {median / base_median:.2f}x |")
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("base", help="git revision to compare against")
  parser.add_argument("--window", type=int, default=0, help="this checkout's eviction_window (0: default)")
  parser.add_argument("--runs", type=int, default=5)
  parser.add_argument("--calls", type=int, default=40)
  args = parser.parse_args(argv)
  print(report(args.base, compare(args.base, args.runs, args.calls, args.window), args.window))


if __name__ == "__main__":
  main()
