"""The PNGs say what they show and can be read: position_ppl's title names the run, checkpoint and
data; legends sit beside the axes, never over a curve; topic_floor's shaded windows are in its legend;
loss.png has a title and plain log ticks; an overlay of many curves takes its colours from a colour map."""

from __future__ import annotations

import json
import re

import matplotlib.figure
import numpy as np
import pytest

from experiments.evaluation import plots
from experiments.evaluation import topic_floor as floor_lib
from experiments.runner import logging_utils, plot_style


@pytest.fixture
def figures(monkeypatch):
  """Every figure saved during the test, drawn (so legends and tick labels have their places)."""
  saved, real = [], matplotlib.figure.Figure.savefig

  def savefig(fig, *a, **kw):
    fig.canvas.draw()
    saved.append(fig)
    return real(fig, *a, **kw)

  monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
  return saved


def _legend_beside(ax):
  legend, box = ax.get_legend(), ax.get_window_extent()
  return legend is not None and legend.get_window_extent().x0 >= box.x1


def test_position_ppl_title_and_legend(figures, tmp_path):
  centers = [1.5, 3.5, 7.5, 15.5, 31.5, 63.5]
  res = {
    "bucket_center": centers,
    "bucket_ppl": [40.0, 20.0, 12.0, 9.0, 9.5, 11.0],
    "train_len": 16,
    "p_star": 9.0,
    "p_star_log_se": 0.01,
    "sequences": 4,
    "max_len": 64,
    "data": "/tmp/kdn_corpus/long_val.npy",
    "meta": {"workdir": "/tmp/lm_sp/", "step": 300},
  }
  plots.position_ppl(res, str(tmp_path / "p.png"))
  (ax,) = figures[0].axes
  assert ax.get_title().splitlines() == [
    "lm_sp @ step 300: /tmp/kdn_corpus/long_val.npy",
    "4 sequences of 64 tokens",
  ]
  assert _legend_beside(ax)


def test_topic_floor_windows_in_the_legend(figures, tmp_path):
  rng = np.random.default_rng(0)
  length = floor_lib.LATE[1]
  model, floor = rng.uniform(1, 2, (6, length)), rng.uniform(0.5, 1, (6, length))
  res = floor_lib.analyse(model, floor, 16, resamples=50)
  res["meta"] = {"workdir": "/tmp/topic", "step": 7}
  plots.topic_floor(res, str(tmp_path / "t.png"))
  (ax,) = figures[0].axes
  labels = [t.get_text() for t in ax.get_legend().get_texts()]
  a, b = res["early_window"]
  assert f"early window: positions {a + 1}-{b}" in labels
  assert any(l.startswith("late window: positions ") for l in labels)
  assert ax.get_title().startswith("topic @ step 7")
  assert _legend_beside(ax)


def test_loss_png_title_and_plain_log_ticks(figures, tmp_path):
  rows = [{"step": s, "split": "train", "loss": 8.0 * 0.9**s} for s in range(1, 20)]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  cfg = {"model": {"mixer": "kdn_diag", "layer_pattern": ""}, "data": {"kind": "mqar"}}
  (tmp_path / "config.json").write_text(json.dumps(cfg))
  logging_utils.plot_loss(str(tmp_path))
  (ax,) = figures[0].axes
  assert ax.get_title() == f"{tmp_path.name}: kdn_diag on mqar, loss"
  ticks = [t.get_text() for t in ax.get_yticklabels() + ax.get_yticklabels(minor=True)]
  shown = [t for t in ticks if t]
  assert shown and all(re.fullmatch(r"[0-9.]+", t) for t in shown), shown


def test_many_curves_take_a_colour_map():
  assert plot_style.curve_colors(3) == ["C0", "C1", "C2"]
  colors = plot_style.curve_colors(6)
  assert len({tuple(c) for c in colors}) == 6
  lightness = [sum(c[:3]) for c in colors]  # viridis: dark -> light, in the curves' order
  assert lightness == sorted(lightness)
