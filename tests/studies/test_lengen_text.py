"""The text length-generalisation study: its configs (configs/lengen_short.py), a tiny run end to end
on CPU on the generated toy corpus (pretrain, kept checkpoints, post-training, evaluations, resume),
and its renderer: reproduced from the JSON, and the verdict rules on constructed JSON."""

from __future__ import annotations

import json
import os

import pytest

from configs import lengen_short
from experiments import schema
from experiments.studies.lengen_text import render, study
from kdn_jax.models.config import analytic_non_embedding


def test_configs():
  c = lengen_short.get_config("t64,mamba2")
  m = c.model
  assert (m.num_layers, m.d_model, m.num_heads, m.head_dim, m.vocab_size) == (4, 256, 4, 64, 16384)
  assert m.tie_embeddings and m.mixer == "mamba2" and m.mamba2_variant == "faithful"
  total = analytic_non_embedding(m) + m.vocab_size * m.d_model
  assert 7e6 < total < 9e6, total
  assert (c.data.seq_len, c.data.global_batch_size, c.train.num_steps) == (64, 256, 5000)
  assert (c.optim.learning_rate, c.optim.warmup_steps) == (3e-3, 500)
  assert c.checkpoint.keep_steps == "1000,2500,5000" and c.train.initial_state == "zero"
  long = lengen_short.get_config("t64,mamba2_long").model
  assert (long.dt_min, long.dt_max) == (1e-4, 1e-2) and long.mamba2_variant == "faithful"
  official = lengen_short.get_config("t64,mamba2_official_long").model
  assert official.mamba2_variant == "official" and official.mlp_hidden == 0
  assert (official.dt_min, official.dt_max) == (1e-4, 1e-2)
  t128 = lengen_short.get_config("t128,gla")
  assert t128.data.seq_len * t128.data.global_batch_size == 64 * 256
  post = lengen_short.get_config("post,kdn_diag,tbtt")
  assert (post.train.num_steps, post.optim.learning_rate, post.train.initial_state) == (
    500,
    3e-4,
    "tbtt",
  )
  assert lengen_short.get_config("tiny,kda").model.d_model == 64
  with pytest.raises(schema.ConfigError, match="at most one arm"):
    lengen_short.get_config("t64,mamba2_long,gla")
  with pytest.raises(schema.ConfigError, match="unknown token 'lstm'"):
    lengen_short.get_config("t64,lstm")


def test_tiny_study_end_to_end_and_resume(tmp_path, capsys):
  plan = study.Plan(
    "tiny",
    ["gla"],
    ["state_passing"],
    workdir=str(tmp_path / "runs"),
    results=str(tmp_path / "res" / "lengen_text"),
    toy_corpus=True,
    pretrain_steps=5,
    post_steps=2,
    windows=4,
    chunk=256,
    max_len=512,
    resamples=200,
    overrides=["model.num_layers=1", "train.eval_batches=1"],
  )
  assert plan.keep_steps == [1, 2, 5]
  kinds = [(k, s) for k, s, _ in study.arm_work(plan, "gla")]
  assert kinds == [("train", "pretrain")] + [("eval", "pretrain")] * 3 + [
    ("train", "state_passing"),
    ("eval", "state_passing"),
  ]
  assert study.run_in_process(plan) == "done"
  out = capsys.readouterr().out
  assert "study: gla pretrain trained" in out and "ETA" in out and "PPL@512 / PPL@16" in out
  runs = render.load_runs(plan.results)
  assert [(r["stage"], r["step"]) for r in runs] == [
    ("pretrain", 1),
    ("pretrain", 2),
    ("pretrain", 5),
    ("state_passing", 2),
  ]
  sp = runs[-1]
  assert sp["init_from_step"] == 5 and sp["tokens"] == 7 * 8 * 16
  assert sp["long_split"] == "long_val" and plan.results.endswith("tiny_long_val")
  r = sp["ratio"]
  assert (r["units"], r["long_len"], r["train_len"]) == (4, 512, 16)
  assert r["lo"] <= r["estimate"] <= r["hi"]
  assert len(sp["position"]["bucket_ppl_lo"]) == len(sp["position"]["bucket_ppl"])
  assert study.arm_work(plan, "gla") == []  # a second call finds nothing to do
  md = render.render(str(tmp_path / "res"), str(tmp_path / "fig"))
  assert render.render_table(runs) in md and "- **gla**:" in md
  assert "in-domain long documents held out of train (long_val)" in md
  assert os.path.getsize(tmp_path / "fig" / "lengen_text_tiny_long_val_gla.png") > 1000
  assert render.render(str(tmp_path / "res"), str(tmp_path / "fig")) == md  # from the JSON alone


def test_plan_rejects_bad_arguments():
  with pytest.raises(ValueError, match="--arms"):
    study.Plan("tiny", ["lstm"])
  with pytest.raises(ValueError, match="--strategies"):
    study.Plan("tiny", ["gla"], ["warm"])
  with pytest.raises(ValueError, match="--preset"):
    study.Plan("huge")
  with pytest.raises(ValueError, match="--windows"):
    study.Plan("tiny", ["gla"], windows=1)
  with pytest.raises(ValueError, match="--override: unknown config key 'model.depth'"):
    study.Plan("tiny", ["gla"], overrides=["model.depth=3"])
  with pytest.raises(ValueError, match="--long_split"):
    study.Plan("tiny", ["gla"], long_split="long_test")


def test_a_missing_long_split_is_one_line_before_any_work(tmp_path):
  plan = study.Plan("t64", ["gla"], corpus_dir=str(tmp_path), workdir=str(tmp_path / "w"))
  with pytest.raises(ValueError, match=r"--long_split=long_val: .*long_val.npy does not exist; "):
    study.prepare_inputs(plan)
  assert not os.path.exists(tmp_path / "w")
  (tmp_path / "long_eval.npy").write_bytes(b"")
  study.prepare_inputs(study.Plan("t64", ["gla"], corpus_dir=str(tmp_path), long_split="long_eval"))


def _run(arm, stage, ratio, lo, hi, val_ppl=50.0, step=100):
  T, L = 64, 8192
  return {
    "study": "lengen_text",
    "preset": "t64",
    "arm": arm,
    "mixer": arm,
    "stage": stage,
    "step": step,
    "tokens": step * 16384,
    "val_ppl": val_ppl,
    "ratio": {"estimate": ratio, "lo": lo, "hi": hi, "train_len": T, "long_len": L, "units": 32},
    "position": {
      "max_len": L,
      "bucket_center": [1.0, 48.5, 6144.5],
      "bucket_ppl": [400.0, 60.0, 60.0 * ratio],
      "bucket_ppl_lo": [380.0, 55.0, 60.0 * lo],
      "bucket_ppl_hi": [420.0, 65.0, 60.0 * hi],
      "ppl_at": {str(T): 60.0, str(L): 60.0 * ratio},
    },
    "effrem": {"T": 1024, "t": [0, 512, 1023], "mean": [0.0, 0.01, 0.3]},
    "train_wall_s": 100.0,
    "eval_wall_s": 10.0,
  }


def test_verdict_rules_on_constructed_json(tmp_path):
  runs = [
    _run("gla", "pretrain", 1.6, 1.35, 1.9, step=1000),
    _run("gla", "pretrain", 1.7, 1.25, 2.1, step=5000),  # lower end below 1.3: not shown
    _run("gla", "zero", 1.45, 1.41, 1.5, step=500),
    _run("gla", "state_passing", 1.1, 1.05, 1.2, val_ppl=51.0, step=500),  # +2%: shown
    _run("gla", "tbtt", 1.1, 1.05, 1.2, val_ppl=52.0, step=500),  # +4%: not shown
    _run("kda", "pretrain", 1.05, 1.0, 1.1),
    _run("kda", "zero", 1.2, 1.1, 1.3, step=10),  # control below 1.4: no fix can be shown
    _run("kda", "state_passing", 1.0, 0.95, 1.05, step=10),
  ]
  root = tmp_path / "results" / "lengen_text" / "t64"
  root.mkdir(parents=True)
  for r in runs:
    (root / f"{r['arm']}.{r['stage']}.step{r['step']}.json").write_text(json.dumps(r))
  loaded = render.load_runs(str(root))
  assert [(r["arm"], r["stage"]) for r in loaded][:3] == [
    ("gla", "pretrain"),
    ("gla", "pretrain"),
    ("gla", "zero"),
  ]
  v = dict(zip(["gla", "kda"], render.verdicts(loaded)))
  assert "**failure shown** at step(s) 1000 (1.600 [1.350, 1.900])" in v["gla"]
  assert "5000" not in v["gla"].split("; control")[0]
  assert "state_passing **fix shown**" in v["gla"] and "tbtt no fix shown" in v["gla"]
  assert "+4.0% vs control" in v["gla"]
  assert v["kda"].startswith("- **kda**: no failure (largest ratio 1.050")
  assert "state_passing no fix shown" in v["kda"]
  table = render.render_table(loaded)
  assert "| 1.600 [1.350, 1.900] |  | 0.010 | failure shown |" in table  # no bands: no drift
  md = render.render(str(tmp_path / "results"), str(tmp_path / "fig"))
  assert "## 3c." in md and table in md and "paper" in table
  assert os.path.exists(tmp_path / "fig" / "lengen_text_t64_gla.png")


def test_drift_from_the_lowest_band_past_T():
  r = _run("gla", "pretrain", 1.2, 1.1, 1.3)
  r["position"]["ppl_at"] = {"64": 60.0, "128": 50.0, "256": 40.0, "512": 44.0, "8192": 72.0}
  ratio, n = render.drift(r)
  assert n == 256 and abs(ratio - 72.0 / 40.0) < 1e-12
  r["position"]["ppl_at"] = {"64": 60.0, "128": 50.0, "8192": 45.0}  # still falling at L
  assert render.drift(r) == (1.0, 128)
  r["position"]["ppl_at"] = {"64": 60.0, "256": 40.0, "8192": 72.0}
  assert "| 1.800 (from 256) |" in render.render_table([r])
