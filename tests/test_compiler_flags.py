"""The bitwise promises under the compiler flags users run.

The suite compiles with fewer optimisations (``conftest.py``); these tests train
every variant a bitwise promise compares (``compiler_flags_run.py``) in a process
under XLA's default flags, and in one without FMA instructions
(``--xla_cpu_max_isa=AVX``), as ``docs/guides/embeddings.md`` ("Bit for bit, and
where it rounds") states them:

- whatever the flags, the same ids keep rows (eviction and admission are exact),
  a resumed run is bitwise the uninterrupted one and a served export answers
  bitwise as the model;
- under the default flags, XLA contracts multiplies and adds into FMA instructions
  as each program's fusion allows, so the rows of the CPU kernels and of their XLA
  references, or of sharded and unsharded tables, may round differently: within
  the stated tolerance;
- without FMA instructions, every variant is bitwise equal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

RUN = os.path.join(os.path.dirname(__file__), "compiler_flags_run.py")
SUITE_FLAGS = ("--xla_backend_optimization_level=", "--xla_llvm_disable_expensive_passes=")
# docs/guides/embeddings.md: rows of unit scale agree to 1e-6 after a few steps (measured: 3 ulps,
# 1.5e-8 at most, over this run's 6 Adam steps).
RTOL, ATOL = 1e-6, 1e-7
COMPARED = {"references": "kernels", "resumed": "kernels", "two_shards": "roomy", "eight_shards": "roomy"}


def _train(*flags: str) -> dict:
  kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(SUITE_FLAGS)]
  env = dict(os.environ, XLA_FLAGS=" ".join([*kept, *flags]))
  done = subprocess.run([sys.executable, RUN], env=env, capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  out = json.loads(done.stdout)
  assert not any(f.startswith(SUITE_FLAGS) for f in out["flags"].split()), out["flags"]
  return out


def _rows(table: dict) -> np.ndarray:
  return np.frombuffer(bytes.fromhex(table["rows"]), np.float32)


def _check(out: dict, rounding: bool) -> None:
  """Asserts the promises of one run (``rounding``: rows of different programs may round apart)."""
  for variant, against in COMPARED.items():
    for name, table in out[variant].items():
      want = out[against][name]
      assert table["ids"] == want["ids"], (variant, name)  # the same ids hold rows: eviction is exact
      got, expected = _rows(table), _rows(want)
      if variant == "resumed" or not rounding:
        assert got.tobytes() == expected.tobytes(), (variant, name)
      else:
        np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL, err_msg=f"{variant} {name}")
  for name, answer in out["serving"]["served"].items():
    assert answer == out["serving"]["in_process"][name], name


@pytest.mark.slow
def test_under_the_default_flags_rows_agree_to_the_stated_tolerance():
  _check(_train(), rounding=True)


@pytest.mark.slow
def test_without_fma_instructions_every_variant_is_bitwise_equal():
  _check(_train("--xla_cpu_max_isa=AVX"), rounding=False)
