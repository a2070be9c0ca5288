"""``python -m benchmarks.sharded``: a ShardedTable on 1, 2, 4 and 8 devices.

Fake CPU devices share this machine's cores, so a speed-up cannot exist here.
The run reports what holds on any backend: that a sharded table gives exactly
the results of an unsharded one, how evenly the entries spread, and the bytes
each key moves between devices in each routed call, read from the all-to-all
collectives of the compiled calls, against one request and one reply. Step
times are printed too, as what they are: every device's program sharing the
same cores.

It also times saving and restoring a table of ``--checkpoint-entries`` random
64-wide rows on 8 devices of one process and on 2 processes x 4 devices
(:mod:`benchmarks.multiprocess`), and from these measurements works out, on paper,
what 64 hosts of 8 devices would move per step and hold per shard for a
10^9-entry table of 64 float32 per row, and how long its checkpoint would take.

Options: ``--batch`` keys per step, ``--capacity``, ``--steps``,
``--checkpoint-entries``, ``--out``.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before any backend starts

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxres as jr  # noqa: E402
from benchmarks import multiprocess  # noqa: E402
from jaxres._core.sharding.routing import owner_of, round_rows, shard_capacity_for  # noqa: E402

DEVICES = (1, 2, 4, 8)
WIDTH = 8  # float32 features per row
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4}
_BYTES |= {"s64": 8, "u64": 8, "f64": 8}
_SHAPE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")


def zipf_ids(rng: np.random.Generator, n: int) -> np.ndarray:
  """Zipf-distributed 64-bit ids: a few very hot, a long tail."""
  ranks = rng.zipf(1.2, size=n).astype(np.uint64)
  return (ranks * np.uint64(0x9E3779B97F4A7C15)).view(np.int64)


def step(table, ids, counts):
  """A training-style step: ids get rows (new ids a zero row), the rows accumulate counts."""
  table, rows = table.find_or_insert(ids, jnp.zeros((ids.shape[0], WIDTH), jnp.float32))
  table = table.insert_or_apply(ids, jnp.broadcast_to(counts[:, None], rows.shape), jnp.add)
  return table, rows


def all_to_all_bytes(hlo: str) -> tuple[int, int]:
  """Bytes one device receives over the all-to-alls of a compiled (per-device) program.

  ``(first, later)``: those of the routing's first round (in the entry
  computation) and of one further round (the all-to-alls inside loops).
  """
  first = later = 0
  in_entry = False
  for line in hlo.splitlines():
    if line and not line.startswith(" ") and "{" in line:
      in_entry = line.startswith("ENTRY")
    if " all-to-all(" not in line or "=" not in line:
      continue
    result = line.split("=", 1)[1].split(" all-to-all(", 1)[0]
    total = sum(
      _BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
      for dtype, dims in _SHAPE.findall(result)
    )
    if in_entry:
      first += total
    else:
      later += total
  return first, later


def later_rounds(table, ids: np.ndarray, num_devices: int, once: bool) -> int:
  """Further routing rounds a call on ``ids`` takes, replayed on the host from the routing rule.

  ``once``: a device sends each distinct id once (reads, ``find_or_insert``);
  otherwise every row (``insert_or_apply`` with a fold that order changes).
  """
  if num_devices == 1:
    return 0
  per_device = -(-ids.size // num_devices)
  first, later = round_rows(per_device, num_devices)
  owner = np.asarray(owner_of(table.key_spec.encode(ids)[0], num_devices))  # the table's key words
  most = 0
  for device in range(num_devices):
    rows = owner[device * per_device : (device + 1) * per_device]
    if once:
      rows = rows[np.unique(ids[device * per_device : (device + 1) * per_device], return_index=True)[1]]
    count = np.bincount(rows, minlength=num_devices).max()
    most = max(most, -(-max(count - first, 0) // later))
  return most


CALLS = {  # the routed calls measured: (call, whether a device sends each distinct id once)
  "find": (lambda t, ids, values: t.find(ids), True),
  "find_or_insert": (lambda t, ids, values: t.find_or_insert(ids, values)[1], True),
  "insert_or_apply(add)": (lambda t, ids, values: t.insert_or_apply(ids, values, jnp.add), False),
}


def bytes_per_key(table, batches, num_devices: int) -> dict:
  """Bytes each key moves between devices in each routed call, and the ideal, read from the
  compiled programs: the first round's all-to-alls, and those of a further round times the
  most further rounds a batch needs.

  Each device receives these bytes, of which the block from itself crosses no link:
  (d - 1) / d of it, on each of the d devices. Each row's own bytes (one request and one
  reply) cross a link with the same odds: the ideal.
  """
  out = {}
  ids, _ = batches[0]
  values = jnp.zeros((ids.shape[0], WIDTH), jnp.float32)
  per_device = -(-ids.shape[0] // num_devices)
  for name, (call, once) in CALLS.items():
    first, later = all_to_all_bytes(jax.jit(call).lower(table, ids, values).compile().as_text())
    rounds = max(later_rounds(table, jr.keys.join64(np.asarray(b)), num_devices, once) for b, _ in batches)
    moved = (first + later * rounds) * (num_devices - 1) / ids.shape[0]
    ideal = first / (num_devices * round_rows(per_device, num_devices)[0]) * (num_devices - 1) / num_devices
    ratio = f" ({moved / ideal:.2f}x of {ideal:.0f}; {rounds} more rounds)" if ideal else ""
    out[f"{name} bytes/key"] = f"{moved:,.1f}{ratio}"
  return out


def run_steps(table, batches) -> dict:
  """Runs the jitted step over ``batches``: the per-step rows, final entries and median time."""
  jitted, rows, times = jax.jit(step), [], []
  for ids, counts in batches:
    start = time.perf_counter()
    table, out = jitted(table, ids, counts)
    out.block_until_ready()
    times.append(time.perf_counter() - start)
    rows.append(np.asarray(out))
  keys, values, valid = jax.device_get(table.export())
  live = np.asarray(valid)
  entries = dict(zip(np.asarray(keys)[live].tolist(), map(tuple, np.asarray(values)[live].tolist())))
  return {"table": table, "rows": rows, "entries": entries, "step ms": 1e3 * float(np.median(times[1:]))}


def run_one(num_devices: int, batches, capacity: int, reference: dict) -> dict:
  mesh = jax.make_mesh((num_devices,), ("shard",), devices=jax.devices()[:num_devices])
  value = jax.ShapeDtypeStruct((WIDTH,), jnp.float32)
  table = jr.ShardedTable.create(mesh, "shard", capacity, key=jnp.int64, value=value)
  run = run_steps(table, batches)
  sizes = np.asarray(run["table"].size_per_shard)
  same_rows = all(np.array_equal(a, b) for a, b in zip(run["rows"], reference["rows"], strict=True))
  return {
    "shard capacity": table.shard_capacity,
    "entries per shard (min-max)": f"{sizes.min():,}-{sizes.max():,}",
    "dropped": int(run["table"].dropped),
    **bytes_per_key(table, batches, num_devices),
    "step ms (median)": run["step ms"],
    "equals unsharded": same_rows and run["entries"] == reference["entries"],
  }


def checkpoint_rate(entries: int, width: int = 64, devices: int = 8) -> dict:
  """Seconds to save and restore a ShardedTable of ``entries`` random rows, bytes written, bytes per entry."""
  mesh = jax.make_mesh((devices,), ("shard",), devices=jax.devices()[:devices])
  value = jax.ShapeDtypeStruct((width,), jnp.float32)
  table = multiprocess.filled(
    jr.ShardedTable.create(mesh, "shard", entries, key=jnp.int64, value=value), entries, width
  )
  unsharded = jr.OpenAddressingTable.create(entries, key=jnp.int64, value=value)
  in_memory = sum(x.nbytes for x in jax.tree.leaves(unsharded)) / entries
  directory = tempfile.mkdtemp()
  try:
    path, saves = os.path.join(directory, "table"), []
    for _ in range(3):
      start = time.perf_counter()
      jr.Checkpoint(table=table).save(path)
      saves.append(time.perf_counter() - start)
    written = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)
    fresh = jr.Checkpoint(table=jr.ShardedTable.create(mesh, "shard", entries, key=jnp.int64, value=value))
    start = time.perf_counter()
    fresh.restore(path)
    jax.block_until_ready(fresh.table)
    restore = time.perf_counter() - start
  finally:
    shutil.rmtree(directory, ignore_errors=True)
  assert int(fresh.table.size) == entries
  return {
    "save s": sorted(saves)[1],
    "restore s": restore,
    "written": written,
    "entry bytes": in_memory,
    "entries": entries,
  }


def further_rounds(per_device: int, devices: int) -> int:
  """Further routing rounds a uniform batch needs, more likely than not, on ``devices`` devices.

  Each of the ``devices ** 2`` (device, owner) pairs carries a binomial number
  of rows, about Poisson with mean ``per_device / devices``; the count is the
  first number of rounds after which fewer than one pair in two is expected
  to have rows left.
  """
  first, later = round_rows(per_device, devices)
  mean = per_device / devices

  def beyond(limit: int) -> float:  # P(X > limit), X ~ Poisson(mean)
    top = min(per_device, int(mean + 40 * math.sqrt(mean) + 40))
    return sum(math.exp(k * math.log(mean) - mean - math.lgamma(k + 1)) for k in range(limit + 1, top + 1))

  rounds = 0
  while devices**2 * beyond(first + rounds * later) >= 0.5:
    rounds += 1
  return rounds


def multiprocess_report(measured: dict) -> str:
  """The two-process checkpoint measurement as a table."""
  lines = [
    f"Checkpoint of {measured['entries']:,} random rows of 64 float32 by 2 processes x 4 devices, each "
    "process writing its own shards (save: median of 3; restore: the second, the first compiles):",
    "",
    "| process | save s | restore s | first restore s | bytes written by the process |",
    "|---|---|---|---|---|",
  ]
  for p in measured["processes"]:
    lines.append(
      f"| {p['process']} | {p['save s']:.2f} | {p['restore s']:.2f} | {p['first restore s']:.2f} | "
      f"{p['written'] / 1e6:,.1f} MB |"
    )
  lines += ["", f"All files: {measured['total written'] / 1e6:,.1f} MB."]
  return "\n".join(lines) + "\n"


def at_scale(
  batch: int, rate: dict, measured: dict, hosts: int = 64, per_host: int = 8, entries: int = 10**9
) -> str:
  """The paper estimate for ``hosts x per_host`` devices, from the measured figures."""
  devices = hosts * per_host
  shard = shard_capacity_for(entries, devices)
  held = shard * rate["entry bytes"]
  request, reply = 8 + 1 + 256, 256  # find_or_insert: key words, mask, a 64-float row; the row back
  lines = [
    f"### At scale, on paper: {hosts} hosts x {per_host} devices, 10^9 entries of 64 float32",
    "",
    f"- Per shard: {shard:,} entries (the sizing rule), {held / 1e9:.2f} GB at the measured "
    f"{rate['entry bytes']:.0f} bytes per entry; {per_host * held / 1e9:.1f} GB per host.",
  ]
  for per_device in (batch, 4 * batch, 16 * batch):
    first, later = round_rows(per_device, devices)
    rounds = further_rounds(per_device, devices)
    moved = devices * (first + rounds * later) * (request + reply)
    ideal = per_device * (request + reply)
    lines.append(
      f"- `find_or_insert` of {per_device:,} distinct ids per device: {first} rows per owner in the first "
      f"round and {rounds} further round(s) of {later} (expected for a uniform batch): "
      f"{moved / 1e6:.2f} MB sent (and received) per device per call, {per_host * moved / 1e6:.1f} MB per "
      f"host, {moved / ideal:.2f}x one request and one reply."
    )
  per_entry = measured["total written"] / measured["entries"]
  slowest = max(measured["processes"], key=lambda p: p["save s"])
  per_process = slowest["written"] / slowest["save s"]  # bytes a second one process wrote
  seconds = per_host * shard * per_entry / per_process
  lines.append(
    f"- Checkpoint: {per_entry:.0f} bytes per entry written; at the {per_process / 1e6:.0f} MB/s that each "
    f"of 2 processes wrote its own shards at (measured), each host writing its {per_host} shards "
    f"({per_host * shard * per_entry / 1e9:.1f} GB) takes about {seconds:.0f} s, all hosts at once where "
    "the storage scales with them; no host holds more than its own shards."
  )
  return "\n".join(lines) + "\n"


def report(results: dict, reference_ms: float, batch: int, capacity: int, steps: int) -> str:
  metrics = list(next(iter(results.values())))
  head = "| devices | " + " | ".join(metrics) + " |"
  lines = [head, "|" + "---|" * (len(metrics) + 1)]
  for devices, row in results.items():
    cells = [
      f"{v:,.1f}"
      if isinstance(v, float)
      else f"{v:,}"
      if isinstance(v, int) and not isinstance(v, bool)
      else str(v)
      for v in row.values()
    ]
    lines.append(f"| {devices} | " + " | ".join(cells) + " |")
  return (
    f"## ShardedTable scaling: {steps} steps of {batch:,} Zipf ids (find_or_insert + insert_or_apply, "
    f"{WIDTH} float32 per row), capacity {capacity:,}, fake CPU devices\n\n" + "\n".join(lines) + "\n\n"
    f"The same steps on one unsharded OpenAddressingTable: {reference_ms:.1f} ms (median).\n"
  )


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=4096)
  parser.add_argument("--capacity", type=int, default=1 << 16)
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--checkpoint-entries", type=int, default=1 << 20)
  parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
  args = parser.parse_args(argv)
  rng = np.random.default_rng(0)
  batches = [
    (jr.keys.split64(zipf_ids(rng, args.batch)), jnp.asarray(rng.integers(1, 5, args.batch), jnp.float32))
    for _ in range(args.steps)
  ]
  value = jax.ShapeDtypeStruct((WIDTH,), jnp.float32)
  reference = run_steps(jr.OpenAddressingTable.create(args.capacity, key=jnp.int64, value=value), batches)
  results = {d: run_one(d, batches, args.capacity, reference) for d in DEVICES}
  text = report(results, reference["step ms"], args.batch, args.capacity, args.steps)
  rate = checkpoint_rate(args.checkpoint_entries)
  measured = multiprocess.measure(args.checkpoint_entries)
  text += (
    f"\nCheckpoint of {rate['entries']:,} random rows of 64 float32 on 8 devices, one process: save "
    f"{rate['save s']:.2f} s (median of 3), restore {rate['restore s']:.2f} s, "
    f"{rate['written'] / 1e6:,.0f} MB written.\n\n"
    + multiprocess_report(measured)
    + "\n"
    + at_scale(args.batch, rate, measured)
  )
  print(text)
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "sharded.md").write_text(text)
  if not all(r["equals unsharded"] for r in results.values()):
    raise SystemExit("a sharded run differs from the unsharded table")


if __name__ == "__main__":
  main()
