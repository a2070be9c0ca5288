"""What the tests that start child processes share."""

# How long a test waits for a child process (or a notebook's cell) before calling it hung. A hang
# guard only, never a speed check: the longest child takes a few minutes on a quiet machine, and a
# loaded one (a shared CI runner, the suite's own xdist workers) must never fail a test by being
# slow. Every wait on a child in the suite uses it.
HANG_GUARD_S = 3600


def progress(lines):
  """A child's complete ``saving k`` / ``saved k`` lines as ``(word, k)``.

  Anything else is skipped: a line cut short by a kill (no newline) and
  whatever a library in the child printed to stdout (CI once met a one-word line).
  """
  for line in lines:
    word, _, step = line.partition(" ")
    if word in ("saving", "saved") and line.endswith("\n") and step.strip().isdigit():
      yield word, int(step)
