"""What the tests that start child processes share."""


def progress(lines):
  """A child's complete ``saving k`` / ``saved k`` lines as ``(word, k)``.

  Anything else is skipped: a line cut short by a kill (no newline) and
  whatever a library in the child printed to stdout (CI once met a one-word line).
  """
  for line in lines:
    word, _, step = line.partition(" ")
    if word in ("saving", "saved") and line.endswith("\n") and step.strip().isdigit():
      yield word, int(step)
