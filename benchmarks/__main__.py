"""``python -m benchmarks``: see benchmarks/run.py."""

from benchmarks import run

run.main()
