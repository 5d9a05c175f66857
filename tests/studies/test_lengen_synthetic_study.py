"""The synthetic length-generalisation study: a tiny run end to end on CPU (pretrain, TBTT
post-training,
topic_floor evaluations, resume), and its renderer on the JSON it wrote and on constructed JSON."""

from __future__ import annotations

import json
import os
import zlib

import numpy as np
import pytest

from experiments.studies import lengen_synthetic as study
from experiments.studies.results import lengen_synthetic as render


def test_tiny_study_end_to_end_and_resume(tmp_path, capsys):
  plan = study.Plan(
    "tiny",
    ["gla"],
    ["tbtt"],
    workdir=str(tmp_path / "runs"),
    results=str(tmp_path / "res" / "lengen_synthetic"),
    pretrain_steps=6,
    post_steps=2,
    documents=3,
    chunk=8192,
    resamples=200,
    overrides=["model.num_layers=1", "train.eval_batches=1"],
  )
  assert [k for k, *_ in study.mixer_work(plan, "gla")] == ["train", "eval", "train", "eval"]
  assert study.run_in_process(plan) == "done"
  out = capsys.readouterr().out
  assert "study: gla pretrain trained" in out and "ETA" in out
  runs = render.load_runs(plan.results)
  assert [(r["stage"], r["step"]) for r in runs] == [("pretrain", 6), ("tbtt", 2)]
  post = runs[1]
  assert post["init_from_step"] == 6 and post["tokens"] == 8 * 16 * 64
  tf = post["topic_floor"]
  assert (
    tf["documents"] == 3 and tf["length"] == 8192 and tf["verdict"] in ("failure", "no failure")
  )
  # an untrained-ish model is far above the floor everywhere, and never below it on average
  assert tf["early"]["estimate"] > 0 and tf["late"]["estimate"] > 0
  # a second call finds nothing to do
  assert study.mixer_work(plan, "gla") == []
  md = render.render(str(tmp_path / "res"), str(tmp_path / "fig"))
  assert "| gla | +2 tbtt |" in md and render.render_table(runs) in md
  assert os.path.exists(tmp_path / "fig" / "lengen_synthetic_tiny_gla.png")


def test_plan_rejects_bad_arguments():
  with pytest.raises(ValueError, match="--mixers"):
    study.Plan("tiny", ["lstm"])
  with pytest.raises(ValueError, match="--strategies"):
    study.Plan("tiny", ["gla"], ["warm"])
  with pytest.raises(ValueError, match="--max_len"):
    study.Plan("tiny", ["gla"], max_len=4096)
  with pytest.raises(ValueError, match="--preset"):
    study.Plan("huge")
  with pytest.raises(ValueError, match="--override: unknown config key 'model.depth'"):
    study.Plan("tiny", ["gla"], overrides=["model.depth=3"])


def _run(mixer, stage, early, late, step=100, seed=0, n=8):
  rng = np.random.default_rng(zlib.crc32(f"{mixer}/{stage}".encode()))
  e = early + rng.normal(0, 0.01, n)
  lt = late + rng.normal(0, 0.01, n)
  iv = lambda x: {
    "estimate": float(np.mean(x)),
    "lo": float(np.min(x)),
    "hi": float(np.max(x)),
    "level": 0.95,
    "resamples": 100,
    "units": n,
  }
  verdict = "failure" if late >= 3 * early else "no failure"
  return {
    "study": "lengen_synthetic",
    "preset": "tiny",
    "mixer": mixer,
    "stage": stage,
    "step": step,
    "tokens": step * 1024,
    "topic_floor": {
      "documents": n,
      "length": 8192,
      "train_len": 64,
      "threshold": 3.0,
      "early_window": [32, 64],
      "late_window": [4096, 8192],
      "early": iv(e),
      "late": iv(lt),
      "ratio": {
        "estimate": late / early,
        "lo": late / early - 0.5,
        "hi": late / early + 0.5,
        "level": 0.95,
        "resamples": 100,
        "units": n,
      },
      "verdict": verdict,
      "verdict_ci": verdict,
      "seed": seed,
      "bucket_center": [1.0, 48.5, 6144.5],
      "excess": {
        **iv(e),
        "estimate": [0.5, early, late],
        "lo": [0.4, early - 0.01, late - 0.01],
        "hi": [0.6, early + 0.01, late + 0.01],
      },
      "per_document": {"early": e.tolist(), "late": lt.tolist()},
      "claim": "the claim",
    },
  }


def test_renderer_on_constructed_json(tmp_path):
  runs = [
    _run("gla", "pretrain", 0.1, 0.5),
    _run("gla", "zero", 0.1, 0.45, step=10),
    _run("gla", "tbtt", 0.1, 0.12, step=10),
    _run("gla", "state_passing", 0.1, 0.2, step=10, seed=1),
  ]
  root = tmp_path / "results" / "lengen_synthetic" / "tiny"
  root.mkdir(parents=True)
  for r in runs:
    (root / f"{r['mixer']}.{r['stage']}.json").write_text(json.dumps(r))
  (root / "commands.json").write_text(
    json.dumps(
      {
        "protocol": "P",
        "calls": [
          {
            "command": "python -m experiments.studies.lengen_synthetic --preset=tiny",
            "status": "done",
            "wall_s": 120.0,
            "machine": "cpu",
          }
        ],
      }
    )
  )
  loaded = render.load_runs(str(root))
  assert [r["stage"] for r in loaded] == ["pretrain", "zero", "state_passing", "tbtt"]
  table = render.render_table(loaded)
  lines = table.splitlines()
  row = next(l for l in lines if "+10 tbtt" in l)
  assert "0.50 [4.50" not in row and "no failure" in row
  # the paired difference of the late excess against the zero control: 0.12 - 0.45
  cells = [c.strip() for c in row.split("|")]
  est, lo, hi = (
    float(v) for v in cells[7].replace("[", "").replace("]", "").replace(",", "").split()
  )
  assert abs(est - (-0.33)) < 0.02 and lo < est < hi
  assert "n/a (other documents)" in next(l for l in lines if "state_passing" in l)
  pre = next(l for l in lines if "pretrained" in l)
  assert "| failure | failure |" in pre and "5.00 [4.50, 5.50]" in pre
  md = render.render(str(tmp_path / "results"), str(tmp_path / "fig"))
  assert "### tiny preset" in md and "Protocol: P." in md and table in md
  assert (
    "Fix shown (control still fails, the intervention does not, by the intervals): "
    "state_passing, tbtt" in md
  )
  assert os.path.exists(tmp_path / "fig" / "lengen_synthetic_tiny_gla.png")
