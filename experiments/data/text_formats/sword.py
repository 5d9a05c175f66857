"""SWORD modules' exports to documents: mod2imp's IMP entries, their OSIS / ThML / GBF verse markup
to text, and the entries grouped into one document per book or chapter."""

from __future__ import annotations

import hashlib
import html
import html.parser
import re
from collections.abc import Iterable, Iterator

from experiments.data.text_formats.common import MIN_CHARS, tidy

_IMP_KEY = re.compile(r"^(.*\S)\s+(\d+):(\d+)$")


def imp_entries(lines: Iterable[str]) -> Iterator[tuple[str, str]]:
  """(key, raw text) of each entry of a mod2imp export: ``$$$Key`` header lines followed by the text."""
  key, body = None, []
  for line in lines:
    if line.startswith("$$$"):
      if key is not None:
        yield key, "".join(body).rstrip("\r\n")
      key, body = line[3:].strip(), []
    elif key is not None:
      body.append(line)
  if key is not None:
    yield key, "".join(body).rstrip("\r\n")


_OSIS_DROP = re.compile(
  r'<note\b[^>]*?(?<!/)>.*?</note>|<(RF|FN)>.*?<(Rf|Fn)>|<foreign\b[^>]*type="x-strongs"[^>]*>.*?'
  r"</foreign>",
  re.S | re.I,
)


def osis_to_text(s: str) -> str:
  """OSIS / ThML / GBF verse markup to text: notes (footnotes, cross references) dropped, paragraph-ish
  tags become line breaks, every other tag is removed, entities decoded."""
  s = _OSIS_DROP.sub("", s)
  # only paragraph divs break lines (milestones, book/chapter divs do not)
  s = re.sub(
    r'<div\b[^>]*type="(?:x-p|paragraph|introduction|section|majorSection)"[^>]*>', "\n\n", s
  )
  s = re.sub(r"<title\b[^>]*>", "\n\n", s)
  s = re.sub(r"</title>", "\n\n", s)
  s = re.sub(r"<(?:p|/p|lb|br|CM|Pp|PP|Ps)\b[^>]*>", "\n\n", s, flags=re.I)
  s = re.sub(r"<(?:/?lg|l|/l)\b[^>]*>", "\n", s)
  s = re.sub(r"<[^>]*>", "", s)
  s = html.unescape(s)
  s = re.sub(r"[ \t]+", " ", s)
  s = re.sub(r" *\n *", "\n", s)
  return s


def _norm_para(p: str) -> str:
  return re.sub(r"\s+", " ", p).strip().lower()


def sword_documents(
  entries: Iterable[tuple[str, str]],
  module: str,
  group: str = "book",
  commentary: bool = False,
  dedupe: bool | None = None,
) -> Iterator[dict]:
  """Documents from IMP entries: one per book (``group='book'``) or per chapter (``'chapter'``), each
  chapter under a ``<Book> <chapter>`` heading line.

  Bible texts (``commentary=False``) join a chapter's verses into running text. Commentaries keep each
  entry's paragraphs; with ``dedupe`` (the default for commentaries) an entry identical to an earlier one
  and any paragraph already seen in the module are dropped (normalised paragraphs of >= 80 chars across
  the module, shorter ones such as "Verses 1-5" headings within the document): some commentaries attach
  a chapter's whole commentary to each of its verses.
  """
  dedupe = commentary if dedupe is None else dedupe
  seen_entries: set[bytes] = set()
  seen_paras: set[bytes] = set()
  cur_name, parts, cur_chapter = None, [], None

  def flush():
    text = tidy(re.sub(r" *\n *", "\n", re.sub(r"[ \t]+", " ", "".join(parts))))
    return (
      {"name": cur_name, "text": text} if cur_name is not None and len(text) >= MIN_CHARS else None
    )

  for key, raw in entries:
    m = _IMP_KEY.match(key)
    if not m:
      continue  # [ Module Heading ], [ Testament 1 Heading ]
    book, chapter = m.group(1), int(m.group(2))
    name = f"{module}/{book}" if group == "book" else f"{module}/{book} {chapter}"
    if name != cur_name:
      doc = flush()
      if doc:
        yield doc
      cur_name, parts, cur_chapter = name, [], None
    if not raw.strip():
      continue
    if dedupe:
      h = hashlib.blake2b(raw.strip().encode(), digest_size=16).digest()
      if h in seen_entries:
        continue
      seen_entries.add(h)
    text = osis_to_text(raw)
    if dedupe:
      kept = []
      for para in re.split(r"\n\s*\n", text):
        norm = _norm_para(para)
        if not norm:
          continue
        scope = "" if len(norm) >= 80 else cur_name
        h = hashlib.blake2b(f"{scope}\x00{norm}".encode(), digest_size=16).digest()
        if h not in seen_paras:
          seen_paras.add(h)
          kept.append(para.strip())
      text = "\n\n".join(kept)
    if not text.strip():
      continue
    if chapter != cur_chapter:
      cur_chapter = chapter
      if chapter > 0:
        parts.append(f"\n\n{book} {chapter}\n\n")
    parts.append(f"\n\n{text.strip()}\n\n" if commentary else text + " ")
  doc = flush()
  if doc:
    yield doc
