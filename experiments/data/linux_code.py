"""The Linux kernel's C sources (Debian's ``linux-source-6.1``) as a code corpus source.

One document per ``.c`` / ``.h`` file, named by its path in the tree. Three rules drop files, in this
order, and :func:`select_files` counts what each one dropped:

- ``generated_path``: a path with a folder named ``asic_reg`` (AMD's and Habana's register maps, exported
  from the chips' register databases: ~395 MB, a third of the kernel's C, in files of ``#define
  regFOO 0x1234`` / ``FOO__BAR_MASK 0x0000ff00L`` lines);
- ``data_lines``: a file of at least ``DATA_MIN_LINES`` non-blank lines of which at least
  ``DATA_LINE_FRACTION`` are data lines: ``#define NAME <number>`` or a line of nothing but numeric
  literals and punctuation (firmware blobs, register and calibration tables, generated headers outside
  ``asic_reg``). What a model learns from them is to copy numbers, and they would otherwise hold a
  large share of the tokens;
- ``duplicate``: a file whose bytes equal those of an earlier file (paths in sorted order; the tools/
  copies of kernel headers, per-architecture copies), so no text is in two splits.

Files that are not valid UTF-8 are decoded with replacement characters (a handful of Latin-1 comments).
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import re
import tarfile
from collections.abc import Iterable, Iterator

from experiments.data.corpus_fetch import SourceUnavailable, apt_tree, cpu_workers
from experiments.data.corpus_sources import Source

PACKAGE = "linux-source-6.1"
SUFFIXES = (".c", ".h")
GENERATED_DIRS = frozenset({"asic_reg"})
DATA_LINE_FRACTION = 0.5
DATA_MIN_LINES = 64  # below this a file of constants is an ordinary small header, and costs nothing
CACHE_MB = 280  # <cache> after a build: the 139 MB .deb and its dpkg -x tree
RULES = ("generated_path", "data_lines", "duplicate")

# Possessive quantifiers throughout: a near-miss line (numbers, then a name) must fail in linear time,
# not by trying every way to split a digit run.
_NUM = r"(?:0[xX][0-9a-fA-F]++|\d++)[uUlL]*+"
_PUNCT = r"[ \t{}(),;|<>+*~-]*+"
_COMMENT = r"(?:/\*.*?\*/|//.*+)?"
# A data line: `#define NAME <number>` (optionally cast or parenthesised), or numbers and punctuation only.
_DATA_LINE = re.compile(
  r"^[ \t]*+(?:#[ \t]*+define[ \t]++\w++[ \t]++(?:\([A-Za-z_][\w ]*+\))?+"
  + _PUNCT
  + _NUM
  + r"[ \t)]*+|"
  + _PUNCT
  + r"(?:"
  + _NUM
  + _PUNCT
  + r")++)"
  + _COMMENT
  + r"[ \t]*+\r?$",
  re.M,
)
_NONBLANK = re.compile(r"^[ \t]*\S", re.M)


def data_line_counts(text: str) -> tuple[int, int]:
  """(data lines, non-blank lines) of a C file; see the module docstring for a data line."""
  return len(_DATA_LINE.findall(text)), len(_NONBLANK.findall(text))


def drop_reason(path: str, text: str) -> str | None:
  """Which generated-file rule drops ``path`` (``generated_path`` / ``data_lines``), or None to keep it."""
  if GENERATED_DIRS.intersection(path.split("/")[:-1]):
    return "generated_path"
  data, lines = data_line_counts(text)
  if lines >= DATA_MIN_LINES and data >= DATA_LINE_FRACTION * lines:
    return "data_lines"
  return None


def _reasons(batch: list[tuple[str, bytes]]) -> list[str | None]:
  return [drop_reason(p, b.decode("utf-8", errors="replace")) for p, b in batch]


def drop_reasons(files: list[tuple[str, bytes]], workers: int = 1) -> list[str | None]:
  """:func:`drop_reason` of every ``(path, bytes)``; the regex scan of ~0.8 GB runs on ``workers``
  processes (it is a third of a build's time on one core)."""
  batches = [files[i : i + 256] for i in range(0, len(files), 256)]
  if workers <= 1 or len(batches) <= 1:
    return [r for b in batches for r in _reasons(b)]
  ctx = multiprocessing.get_context(
    "spawn"
  )  # (fork would copy a process whose XLA threads may hold locks)
  with ctx.Pool(min(workers, len(batches))) as pool:
    return [r for rs in pool.imap(_reasons, batches) for r in rs]


def select_files(members: Iterable[tuple[str, bytes]], workers: int = 1) -> Iterator[dict]:
  """Documents ``{'name': path, 'text'}`` of the ``.c`` / ``.h`` files among ``(path, bytes)`` pairs that
  pass the rules (paths sorted, so which of two identical files stays does not depend on tar order).

  Returns (as the generator's value) ``{'files': n, 'bytes': b, 'kept': {...}, 'dropped': {rule:
  {'files', 'bytes', 'examples'}}}``, which the corpus builder records in its manifest.
  """
  files = sorted((p, b) for p, b in members if p.endswith(SUFFIXES))
  stats = {
    "files": len(files),
    "bytes": sum(len(b) for _, b in files),
    "rules": {
      "generated_path": f"a folder named one of {sorted(GENERATED_DIRS)}",
      "data_lines": f">= {DATA_MIN_LINES} non-blank lines, >= {DATA_LINE_FRACTION:.0%} of them "
      "'#define NAME <number>' or numbers and punctuation only",
      "duplicate": "the same bytes as an earlier file (sorted paths)",
    },
    "dropped": {r: {"files": 0, "bytes": 0, "examples": []} for r in RULES},
    "kept": {"files": 0, "bytes": 0},
  }
  seen = set()
  for (path, data), reason in zip(files, drop_reasons(files, workers)):
    if reason is None:
      digest = hashlib.sha256(data).digest()
      reason = "duplicate" if digest in seen else None
      seen.add(digest)
    bucket = stats["kept"] if reason is None else stats["dropped"][reason]
    bucket["files"] += 1
    bucket["bytes"] += len(data)
    if reason is None:
      yield {"name": path, "text": data.decode("utf-8", errors="replace")}
    else:
      bucket["examples"] = sorted(bucket["examples"] + [(len(data), path)], reverse=True)[:5]
  for bucket in stats["dropped"].values():  # the largest files each rule dropped
    bucket["examples"] = [f"{path} ({n // 1000} KB)" for n, path in bucket["examples"]]
  return stats


def tarball_members(
  tarball: str, suffixes: tuple[str, ...] = SUFFIXES
) -> Iterator[tuple[str, bytes]]:
  """(path without the top folder, bytes) of the regular files with ``suffixes`` in a (compressed) tar,
  read as a stream (nothing is unpacked to disk)."""
  with tarfile.open(tarball, "r|*") as tf:
    for m in tf:
      if m.isfile() and m.name.endswith(suffixes):
        path = m.name.split("/", 1)[-1]
        yield path, tf.extractfile(m).read()


def linux_source_tarball(tree: str) -> str:
  """The kernel tarball inside a ``dpkg -x`` tree of linux-source-*."""
  d = os.path.join(tree, "usr", "src")
  found = (
    sorted(f for f in os.listdir(d) if f.startswith("linux-source")) if os.path.isdir(d) else []
  )
  if not found:
    raise SourceUnavailable(f"no usr/src/linux-source-*.tar.* in {tree}")
  return os.path.join(d, found[-1])


def linux_c_documents(cache_dir: str, package: str = PACKAGE) -> Iterator[dict]:
  tarball = linux_source_tarball(apt_tree(package, cache_dir))
  return (yield from select_files(tarball_members(tarball), workers=cpu_workers()))


def linux_c_source(package: str = PACKAGE) -> Source:
  return Source(
    "linux_c",
    lambda cache_dir: linux_c_documents(cache_dir, package),
    description=f"the Linux kernel's .c/.h files ({package}), generated files and duplicates "
    "dropped, one document per file",
  )
