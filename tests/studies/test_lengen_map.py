"""The length-generalisation map: its cell shapes and order, a tiny cell end to end on CPU (pretrain,
kept checkpoints, evaluation JSON, the fix stage), resume of a half-finished map on a fresh disk
without rerunning finished work, the band ratio's bootstrap coverage, and the renderer and its fix
rule on constructed JSON."""

from __future__ import annotations

import json
import math
import os
import shutil

import jax
import numpy as np
import pytest

from configs import lengen_map as cfg
from experiments.evaluation import band_ratio
from experiments.studies import study_driver, study_plan
from experiments.studies.lengen_map import render, study


def test_shapes_hold_their_counts_and_cells_come_in_the_stated_order(tmp_path):
  for size in ("500k", "2m", "8m"):
    for arm in cfg.ARMS:
      n = cfg.non_embedding(arm, size)
      assert abs(n / cfg.SIZES[size] - 1) <= cfg.TOLERANCE, (arm, size, n)
  # official Mamba-2 holds the larger state per layer at the same size
  assert cfg.state_elements("mamba2", "2m") > cfg.state_elements("gla", "2m")
  plan = study.Plan("gpu", workdir=str(tmp_path / "w"))
  assert len(plan.cells) == 4 * 3 * 2 * 2
  assert plan.cells[:3] == (
    "mamba2_long.2m.t64.s0",
    "mamba2_long.2m.t64.s1",
    "mamba2_long.500k.t64.s0",
  )
  ts = [study.parse_cell(c)[2] for c in plan.cells]
  assert ts == sorted(ts)  # every T=64 cell before any T=256 cell
  assert plan.cells.index("mamba2_long.8m.t64.s0") < plan.cells.index("mamba2.2m.t64.s0")
  assert plan.cells.index("mamba2.2m.t64.s0") < plan.cells.index("gla.2m.t64.s0")
  # checkpoints at the budgets the size reaches (8m capped at 100 tokens per parameter)
  cell = "gla.500k.t64.s0"
  n, tps = plan.non_embedding(cell), plan.tokens_per_step(cell)
  assert tps == 32768
  assert plan.keep_steps(cell) == [round(b * n / tps) for b in (25, 50, 100, 200, 400)]
  assert plan.cell_budgets("gla.8m.t256.s1") == [25, 50, 100]
  post = plan.config(cell, "tbtt")
  assert post.train.init_from.endswith(f"checkpoints/{plan.keep_steps(cell)[-1]}")
  assert post.optim.learning_rate == pytest.approx(0.1 * cfg.LR["500k"])
  assert post.train.num_steps == round(0.02 * plan.keep_steps(cell)[-1])
  assert plan.config(cell, "pretrain").seed == plan.config(cell, "pretrain").data.shuffle_seed == 0


def test_plan_rejects_bad_arguments(tmp_path):
  with pytest.raises(ValueError, match="--cells"):
    study.Plan("tiny", cells=["gla.tiny.16.s0"])
  with pytest.raises(ValueError, match="--eval_len"):
    study.Plan("tiny", eval_len=300)
  with pytest.raises(ValueError, match="--caps"):
    study.Plan("tiny", caps=["huge:3"])
  with pytest.raises(ValueError, match="--arms"):
    study.Plan("tiny", arms=["lstm"])


def test_tiny_cell_end_to_end_with_its_fix(tmp_path, monkeypatch, capsys):
  # every cell "fails" here, so that the fix stage runs on the tiny cell
  monkeypatch.setattr(render, "FAIL_R", 0.0)
  monkeypatch.setattr(render, "FAIL_LO", 0.0)
  plan = study.Plan(
    "tiny",
    strategies=["zero", "tbtt"],
    fix=True,
    workdir=str(tmp_path / "runs"),
    results=str(tmp_path / "res"),
    toy_corpus=True,
    resamples=200,
  )
  study.prepare_inputs(plan)
  (cell,) = plan.cells
  assert plan.keep_steps(cell) == [6, 12] and plan.steps(cell, "tbtt") == 1
  assert [k for k, *_ in study.cell_work(plan, cell)] == ["train", "eval", "eval"]
  assert study_driver.run_in_process(study.STUDY, plan, plan.cells) == "done"
  assert "ETA" in capsys.readouterr().out
  runs = render.load_runs(plan.results)
  assert [(r["stage"], r["step"]) for r in runs] == [
    ("pretrain", 6),
    ("pretrain", 12),
    ("tbtt", 1),
    ("zero", 1),
  ]
  r = runs[1]
  assert np.shape(r["band_nll"]) == (plan.windows, len(r["eval"]["band_edges"]) - 1)
  assert r["state_norm"]["t"] == [8, 16, 32, 64, 128, 256]
  heads = plan.config(cell, "pretrain").model.num_heads
  assert np.shape(r["state_norm"]["layers"]) == (1, 6, heads)  # layers x t x heads
  assert all(v > 0 for v in r["time_constants"][0]["tau_median"])
  assert r["ratio"] == render.ratio_of(r, resamples=200)  # recomputable from the stored windows
  assert r["tokens_per_param"] == pytest.approx(12 * 128 / plan.non_embedding(cell))
  assert runs[2]["tokens"] == r["tokens"] and runs[2]["post_tokens"] == 128
  assert study.cell_work(plan, cell) == []  # a second call finds nothing to do


def _fake_measure(plan, workdir, step):
  del workdir, step
  return {
    "eval": {"windows": plan.windows, "length": plan.eval_len, "seed": plan.seed},
    "ratio": {"estimate": 1.0, "lo": 0.9, "hi": 1.1},
  }


def test_resume_merges_a_half_finished_map_without_rerunning_finished_work(tmp_path, monkeypatch):
  monkeypatch.setattr(study, "measure", _fake_measure)
  trained, evaluated = [], []
  stop_after = {"gla.tiny.t16.s1": 6}  # s1 "hits the deadline" after its first kept checkpoint

  def fake_train(plan, cell, stage):
    wd = plan.run_dir(cell, stage)
    trained.append(cell)
    last = stop_after.pop(cell, plan.steps(cell, stage))
    for s in plan.keep_steps(cell):
      if s <= last:
        os.makedirs(os.path.join(wd, "checkpoints", str(s), "state"), exist_ok=True)
    if last < plan.steps(cell, stage):
      return None
    with open(os.path.join(wd, "summary.json"), "w", encoding="utf-8") as f:
      json.dump({"status": "completed", "step": last}, f)
    return {"status": "completed"}

  def fake_evaluate(plan, cell, stage):
    line = study.evaluate_next(plan, cell, stage)
    if line:
      evaluated.append((cell, line.split("@ step ")[1].split()[0]))
    return line

  fake = study_driver.Study(study.STUDY.module, "cell", study.cell_work, fake_train, fake_evaluate)
  results = str(tmp_path / "results")

  def plan(workdir):
    return study.Plan("tiny", seeds="0,1", workdir=str(tmp_path / workdir), results=results)

  p = plan("disk1")
  # the first stretch: s0 done; s1 stopped after its first checkpoint (the deadline)
  assert study_driver.run_in_process(fake, p, p.cells) == "deadline"
  assert trained == ["gla.tiny.t16.s0", "gla.tiny.t16.s1"]
  assert evaluated == [("gla.tiny.t16.s0", "6"), ("gla.tiny.t16.s0", "12")]
  # the same disk: the checkpoint on disk is evaluated before the training goes on
  assert [k for k, *_ in study.cell_work(p, "gla.tiny.t16.s1")] == ["eval", "train", "eval"]
  stop_after["gla.tiny.t16.s1"] = 6
  assert study_driver.run_in_process(fake, p, p.cells) == "deadline"
  assert evaluated[-1] == ("gla.tiny.t16.s1", "6")
  kept = {f: os.stat(os.path.join(results, f)).st_mtime_ns for f in os.listdir(results)}
  # a fresh machine: the disk is gone, the results came back
  shutil.rmtree(tmp_path / "disk1")
  trained.clear()
  evaluated.clear()
  p2 = plan("disk2")
  study_plan.lock(fake, p2, p2.cells)  # results count once checked against the plan
  assert study.cell_work(p2, "gla.tiny.t16.s0") == []
  cleared = []  # jax's caches are dropped after every arm (memory mappings: study_driver)
  monkeypatch.setattr(jax, "clear_caches", lambda: cleared.append(1))
  assert study_driver.run_in_process(fake, p2, p2.cells) == "done"
  assert len(cleared) == len(p2.cells) == 2
  assert trained == ["gla.tiny.t16.s1"]  # s0 is not trained again
  assert evaluated == [("gla.tiny.t16.s1", "12")]  # nor s1's first checkpoint evaluated again
  for f, t in kept.items():
    if f.endswith(".json") and f != "commands.json":
      assert os.stat(os.path.join(results, f)).st_mtime_ns == t, f
  names = sorted(f for f in os.listdir(results) if f.startswith("gla."))
  assert names == sorted(
    f"gla.tiny.t16.s{s}.pretrain.step{k}.json" for s in (0, 1) for k in (6, 12)
  )


def _bands(rng, n, log_r, noise=0.05, window_sd=0.3, train_len=64, length=8192, window=None):
  """[n, bands] band NLL: a window effect shared by every band, a floor of 2.0 over the reference
  bands, the early bands above it, and the last band log_r above the floor."""
  edges = band_ratio.band_edges(length)
  nb = len(edges) - 1
  ref = band_ratio.reference_bands(edges, train_len)
  base = np.full(nb, 2.2)
  base[ref] = [2.0, 2.05, 2.1][: len(ref)]
  base[-1] = 2.0 + log_r
  w = rng.normal(0, window_sd, (n, 1)) if window is None else window
  return base + w + rng.normal(0, noise, (n, nb)), edges


def test_band_ratio_bootstrap_covers_the_true_ratio_and_pairs_checkpoints():
  rng = np.random.default_rng(0)
  cover, cover_change, width_paired, width_unpaired = 0, 0, [], []
  trials = 150
  for i in range(trials):
    x, edges = _bands(rng, 64, math.log(1.3))
    iv = band_ratio.ratio(x, edges, 64, resamples=300, seed=i)
    cover += iv["lo"] <= 1.3 <= iv["hi"]
    # a later checkpoint on the same windows (same window effect): R grows by 1.2
    w = rng.normal(0, 0.3, (64, 1))
    a, _ = _bands(rng, 64, math.log(1.3), window=w)
    b, _ = _bands(rng, 64, math.log(1.3 * 1.2), window=w)
    ch = band_ratio.change(a, b, edges, 64, resamples=300, seed=i)
    cover_change += ch["lo"] <= 1.2 <= ch["hi"]
    width_paired.append(math.log(ch["hi"] / ch["lo"]))
    ia = band_ratio.ratio(a, edges, 64, resamples=300, seed=i)
    ib = band_ratio.ratio(b, edges, 64, resamples=300, seed=i + 1)
    width_unpaired.append(math.log(ia["hi"] / ia["lo"]) + math.log(ib["hi"] / ib["lo"]))
  assert 0.88 <= cover / trials <= 1.0, cover / trials
  assert 0.88 <= cover_change / trials <= 1.0, cover_change / trials
  assert np.mean(width_paired) < np.mean(width_unpaired)
  # the trend over checkpoints scored on the same windows: R's factor per doubling of tokens
  cover_trend = 0
  for i in range(60):
    w = rng.normal(0, 0.3, (128, 1))
    ck = [_bands(rng, 128, math.log(1.1) + k * math.log(1.15), window=w)[0] for k in range(4)]
    tr = band_ratio.trend(ck, [0, 1, 2, 3], edges, 64, resamples=200, seed=i)
    cover_trend += tr["lo"] <= 1.15 <= tr["hi"]
  assert cover_trend / 60 >= 0.85, cover_trend / 60


def _run(arm, size, seed, stage, step, tpp, log_r, rng, train_len=64):
  x, edges = _bands(rng, 32, log_r, train_len=train_len, length=1024)
  r = {
    "study": "lengen_map",
    "cell": f"{arm}.{size}.t{train_len}.s{seed}",
    "arm": arm,
    "size": size,
    "train_len": train_len,
    "seed": seed,
    "stage": stage,
    "strategy": "zero" if stage == "pretrain" else stage,
    "step": step,
    "tokens_per_param": tpp,
    "eval": {"hash": "h", "band_edges": edges, "windows": 32, "length": 1024},
    "band_nll": x.tolist(),
    "state_norm": {"t": [8, 16, 32], "layers": [[[1.0, 2.0], [1.5, 2.5], [2.0, 3.0]]]},
    "time_constants": [{"path": "blocks/0", "tau_median": [10.0, 100.0], "tau_max": [20, 200]}],
  }
  r["ratio"] = render.ratio_of(r, resamples=200)
  return r


def _fix_runs(rng, control_r, sp_r, seeds=(0, 1)):
  runs = []
  for s in seeds:
    runs += [
      _run("gla", "2m", s, "pretrain", k, tpp, math.log(2.0), rng) for k, tpp in ((1, 25), (2, 50))
    ]
    runs.append(_run("gla", "2m", s, "zero", 1, 50, math.log(control_r), rng))
    runs.append(_run("gla", "2m", s, "state_passing", 1, 50, math.log(sp_r), rng))
  return runs


def test_fix_verdict_follows_the_rule():
  rng = np.random.default_rng(1)
  seeds = render.cells(_fix_runs(rng, 2.0, 1.05))[("gla", "2m", 64)]
  assert render.cell_verdict(seeds, 200) == "fails"
  fv = render.fix_verdict(seeds, 200)
  assert fv["verdict"] == "fix shown"
  sp = [row for row in fv["rows"] if row["strategy"] == "state_passing"]
  assert len(sp) == 2 and all("cost" in row for row in sp)
  seeds = render.cells(_fix_runs(rng, 2.0, 1.3))[("gla", "2m", 64)]
  assert render.fix_verdict(seeds, 200)["verdict"] == "not shown"
  seeds = render.cells(_fix_runs(rng, 1.1, 1.05))[("gla", "2m", 64)]
  assert render.fix_verdict(seeds, 200)["verdict"] == "the control recovers"
  # one seed is not a cell verdict
  one = render.cells(_fix_runs(rng, 2.0, 1.05, seeds=(0,)))[("gla", "2m", 64)]
  assert render.cell_verdict(one, 200) == "incomplete"


def test_renderer_from_stored_json(tmp_path):
  from experiments.runner.logging_utils import write_json

  rng = np.random.default_rng(2)
  folder = tmp_path / "lengen_map" / "gpu"
  folder.mkdir(parents=True)
  runs = _fix_runs(rng, 2.0, 1.05)
  runs += [_run("kdn_diag", "500k", s, "pretrain", 1, 25, 0.0, rng) for s in (0, 1)]
  for r in runs:
    name = f"{r['cell']}.{r['stage']}" + (f".step{r['step']}" if r["stage"] == "pretrain" else "")
    write_json(str(folder / f"{name}.json"), r)
  write_json(str(folder / "commands.json"), {"protocol": "p", "calls": [
    {"command": "python -m experiments.studies.lengen_map --preset=gpu", "status": "done",
     "wall_s": 5.0, "machine": "H100"}]})  # fmt: skip
  md = render.render(str(tmp_path), str(tmp_path / "fig"))
  assert "3d." in md and "python -m experiments.studies.lengen_map --preset=gpu" in md
  assert "| gla | 2m | 64 | 0 |" in md and "fails" in md and "fix shown" in md
  assert "| kdn_diag | 500k | 64 |" in md and "passes" in md
  for name in ("heatmap", "ppl_curves", "state_norms"):
    assert os.path.exists(tmp_path / "fig" / f"lengen_map_gpu_{name}.png")
