"""Shared pieces of the results renderers: JSON loading, markdown tables, matplotlib."""

from __future__ import annotations

import json
import os


def load(path: str):
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def exists(*parts) -> bool:
  return os.path.exists(os.path.join(*parts))


def table(header: list[str], rows: list[list]) -> str:
  def cell(v):
    if isinstance(v, float):
      return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)

  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
  return "\n".join(lines)


def plt():
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as p  # pylint: disable=g-import-not-at-top

  return p


def save(fig, fig_dir: str, name: str) -> str:
  """Saves into fig_dir; returns the path relative to docs/ (RESULTS.md's folder)."""
  os.makedirs(fig_dir, exist_ok=True)
  fig.tight_layout()
  fig.savefig(os.path.join(fig_dir, name), dpi=110)
  plt().close(fig)
  return f"results/figures/{name}"
