"""reStructuredText (the Linux kernel's Documentation/, Python's ``_sources``) to plain text."""

from __future__ import annotations

import re

from experiments.data.text_formats.common import tidy

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
