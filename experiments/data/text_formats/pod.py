"""Perl's POD (plain old documentation) to plain text."""

from __future__ import annotations

import html
import html.parser
import re

from experiments.data.text_formats.common import tidy

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
