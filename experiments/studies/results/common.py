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


def interval(d: dict, digits: int = 3) -> str:
  """An estimate with its interval: '1.234 [1.100, 1.400]'."""
  return f"{d['estimate']:.{digits}f} [{d['lo']:.{digits}f}, {d['hi']:.{digits}f}]"


def short_count(n: int) -> str:
  """A count in three significant digits with a unit: 82M, 1.5k."""
  for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
    if n >= scale:
      return f"{n / scale:.3g}{unit}"
  return str(n)


def study_runs(folder: str, study: str) -> list[dict]:
  """The per-run JSON of ``study`` in ``folder`` that share one evaluation set (the most common
  ``eval.hash``): runs are paired only on identical examples."""
  if not os.path.isdir(folder):
    return []
  runs = [
    load(os.path.join(folder, f))
    for f in sorted(os.listdir(folder))
    if f.endswith(".json") and f not in ("commands.json", "throughput.json")
  ]
  runs = [r for r in runs if isinstance(r, dict) and r.get("study") == study]
  if not runs:
    return []
  hashes = [r["eval"]["hash"] for r in runs]
  main = max(set(hashes), key=hashes.count)
  return [r for r in runs if r["eval"]["hash"] == main]


def preset_runs(root: str, load_runs):
  """(preset, its folder, its runs) for each folder under ``root`` with runs, in name order;
  ``load_runs(folder)`` reads a folder's runs."""
  for preset in sorted(os.listdir(root)):
    pdir = os.path.join(root, preset)
    runs = load_runs(pdir) if os.path.isdir(pdir) else []
    if runs:
      yield preset, pdir, runs


def commands_lines(folder: str) -> list[str]:
  """The protocol and every call of a study's ``commands.json`` in ``folder`` (nothing without
  one), as markdown lines: each call made some of the results shown."""
  if not exists(folder, "commands.json"):
    return []
  cmds = load(os.path.join(folder, "commands.json"))
  out = [f"Protocol: {cmds.get('protocol', '')}.", ""]
  for c in cmds.get("calls", []):
    where = f" on {c['machine']}" if c.get("machine") else ""
    out.append(f"- `{c['command']}`: {c['status']} in {c['wall_s']:.0f} s{where}")
  return out + [""]


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
