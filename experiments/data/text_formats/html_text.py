"""Rendered HTML pages (Python's documentation) to plain text."""

from __future__ import annotations

import html
import html.parser
import re

from experiments.data.text_formats.common import tidy

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
