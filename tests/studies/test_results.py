"""docs/RESULTS.md is exactly what the renderers make of the committed JSON (never hand-edited), and every
figure it names exists."""

from __future__ import annotations

import os
import re

from experiments.studies import render_results

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_results_md_is_rendered_from_the_committed_json(tmp_path):
  md = render_results.render(os.path.join(ROOT, "docs", "results"), str(tmp_path))
  with open(os.path.join(ROOT, "docs", "RESULTS.md"), encoding="utf-8") as f:
    committed = f.read()
  assert md == committed, (
    "docs/RESULTS.md is stale: run python -m experiments.studies.render_results"
  )
  figures = re.findall(r"\]\((results/figures/[^)]+\.png)\)", md)
  assert figures
  for fig in figures:
    assert os.path.exists(tmp_path / os.path.basename(fig)), fig
    assert os.path.exists(os.path.join(ROOT, "docs", fig)), fig
