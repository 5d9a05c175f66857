"""What every converter of the corpus's formats ends with: ``tidy`` and the shortest document kept."""

from __future__ import annotations

import re

MIN_CHARS = 200  # documents shorter than this (after cleaning) are dropped


def tidy(text: str) -> str:
  """Strips trailing spaces, collapses runs of blank lines, trims the ends."""
  text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\u00a0", " ")
  text = re.sub(r"[ \t]+\n", "\n", text)
  text = re.sub(r"\n{3,}", "\n\n", text)
  return text.strip()
