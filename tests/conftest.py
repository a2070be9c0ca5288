import os
import sys

# Tests import the shared oracle as a plain module.
sys.path.insert(0, os.path.dirname(__file__))

import pytest

from jaxres._core.kernels import native


@pytest.fixture(scope="module", params=["kernels", "references"])
def kernels(request):
  """Runs a module's tests twice: with the CPU kernels (the default), and on their XLA references
  alone (what a GPU or TPU runs), so the oracle suites check both. JAX caches the programs of
  each mode apart (see ``native.references``): the tests of other modules reuse both."""
  if request.param == "kernels":
    yield
  else:
    with native.references():
      yield
