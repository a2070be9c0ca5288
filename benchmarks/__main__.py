"""``python -m benchmarks``: the core table benchmark (see benchmarks/core.py)."""

from benchmarks import core

core.main()
