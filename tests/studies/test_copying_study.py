"""The copying study: a tiny cell end to end on CPU (training, a post-training, per-string scores
teacher-forced and free-running on the shared strings, resume), its plan's arms and sizes, and its
renderer's intervals and verdicts on constructed JSON."""

from __future__ import annotations

import os
import shutil
import zlib

import numpy as np
import pytest

from configs import copying as study_config
from experiments.runner.logging_utils import write_json
from experiments.studies import study_plan
from experiments.studies.copying import render, study


def _tiny(tmp_path, **kw):
  args = dict(
    strategies=["state_passing"],
    workdir=str(tmp_path / "runs"),
    results=str(tmp_path / "res"),
    lengths=[50, 64],
    examples=3,
    batch=2,
  )
  return study.Plan("tiny", **{**args, **kw})


def test_tiny_study_end_to_end_and_resume(tmp_path, capsys):
  plan = _tiny(tmp_path)
  (cell,) = plan.cells
  assert cell == "mamba2.tiny.zero.s0"
  assert [k for k, *_ in study.cell_work(plan, cell)] == ["train", "eval", "train", "eval"]
  assert study.study_driver.run_in_process(study.STUDY, plan, plan.cells) == "done"
  assert "ETA" in capsys.readouterr().out
  runs = render.load_runs(plan.results)
  assert [(r["stage"], r["step"], r["train"]) for r in runs] == [
    ("pretrain", 4, "zero"),
    ("state_passing", 1, "zero"),
  ]
  assert runs[0]["eval"]["hash"] == runs[1]["eval"]["hash"]
  assert runs[1]["strategy"] == "state_passing" and runs[0]["strategy"] == "zero"
  for r in runs:
    assert [c["copy_len"] for c in r["cells"]] == [50, 64]
    for c in r["cells"]:
      n = c["copy_len"]
      for mode, acc in (("teacher_forced", "char_acc_tf"), ("free_running", "char_acc_fr")):
        counts = [int(v) for v in c[mode].split()]
        assert len(counts) == 3 and all(0 <= v <= n for v in counts)
        assert c[acc] == pytest.approx(sum(counts) / (3 * n))
  assert study.cell_work(plan, cell) == []  # a second call finds nothing to do
  # a lost evaluation is redone from the kept run, without training again, to the same scores
  sp_json = study.study_driver.result_path(plan, cell, "state_passing")
  before = study.study_driver.read_json(sp_json)
  os.remove(sp_json)
  assert [(k, s) for k, s, _ in study.cell_work(plan, cell)] == [("eval", "state_passing")]
  assert study.study_driver.run_in_process(study.STUDY, plan, plan.cells) == "done"
  assert study.study_driver.read_json(sp_json)["cells"] == before["cells"]
  # a fresh machine with the results carried back: nothing to train or evaluate again
  shutil.rmtree(plan.workdir)
  again = _tiny(tmp_path)
  study_plan.lock(study.STUDY, again, again.cells)
  assert study.cell_work(again, cell) == []
  # a plan that changes the evaluation is another plan: its results folder is refused
  other = _tiny(tmp_path, examples=4)
  with pytest.raises(study_plan.PlanError, match="examples"):
    study_plan.lock(study.STUDY, other, other.cells)
  assert "**mamba2 tiny**" in render.render_tables(runs, resamples=100)


def test_plan_arms_sizes_and_post_training():
  plan = study.Plan("gpu", arms=["mamba2"], sizes=["45m", "5m"], seeds="0,1", sequences=1_000_000)
  # smaller sizes first, then zero / sp / cap, then the seed
  assert plan.cells[:3] == ("mamba2.5m.zero.s0", "mamba2.5m.zero.s1", "mamba2.5m.sp.s0")
  assert plan.cells[-1] == "mamba2.45m.cap.s1"
  zero, sp, cap = "mamba2.45m.zero.s1", "mamba2.45m.sp.s1", "mamba2.45m.cap.s1"
  pre = plan.config(zero, "pretrain")
  assert pre.model.mamba2_variant == "official" and pre.model.mixer == "mamba2"
  assert pre.train.initial_state == "zero" and pre.seed == pre.data.shuffle_seed == 1
  assert (pre.data.copying.min_copy_len, pre.data.copying.copy_len) == (50, 100)
  assert plan.steps(zero, "pretrain") * pre.data.global_batch_size >= 1_000_000
  s = plan.config(sp, "pretrain")
  assert s.train.initial_state == "state_passing" and s.train.state_reset_prob == 0.1
  c = plan.config(cap, "pretrain")
  assert c.data.copying.copy_len == 300 and c.data.seq_len == 602
  assert plan.tokens_per_step(cap) == 3 * plan.tokens_per_step(zero) - 4 * 128
  post = plan.config(zero, "state_passing")
  assert post.train.init_from == plan.run_dir(zero, "pretrain")
  assert post.train.initial_state == "state_passing"
  assert post.optim.learning_rate == pytest.approx(0.1 * pre.optim.learning_rate)
  assert plan.steps(zero, "state_passing") == round(0.1 * plan.steps(zero, "pretrain"))
  assert plan.post_strategies(zero) == ("zero", "state_passing")
  assert plan.post_strategies(sp) == plan.post_strategies(cap) == ()
  # kdn_diag at the count of Mamba-2, every size within 10% of its target
  for size in ("5m", "15m", "45m"):
    for arm in study_config.ARMS:
      n = study_config.non_embedding(arm, size)
      assert abs(n / study_config.SIZES[size] - 1) < 0.1, (arm, size, n)


def test_evaluation_strings_are_fixed_by_their_seed():
  (sets_a, ha), (_, hb) = study.eval_strings((50, 60), 4, 0), study.eval_strings((50, 60), 4, 1)
  assert ha != hb
  (n, ex), (m, _) = sets_a
  assert (n, m) == (50, 60) and ex["inputs"].shape == (4, 101)
  # BOS x SEP x: the copied half repeats the string
  np.testing.assert_array_equal(ex["inputs"][:, 52:], ex["inputs"][:, 1:50])
  a = study.Plan("tiny", lengths=[50], examples=2)
  b = study.Plan("tiny", cells=["kdn_diag.tiny.cap.s3"], lengths=[50], examples=2)
  assert study.eval_strings(a.lengths, a.examples, a.eval_seed) == study.eval_strings(
    b.lengths, b.examples, b.eval_seed
  )


def test_plan_rejects_bad_arguments():
  with pytest.raises(ValueError, match="--cells"):
    study.Plan("tiny", cells=["mamba2.tiny.zero"])
  with pytest.raises(ValueError, match="--cells"):
    study.Plan("tiny", cells=["gla.tiny.zero.s0"])
  with pytest.raises(ValueError, match="--sizes"):
    study.Plan("tiny", sizes=["1b"])
  with pytest.raises(ValueError, match="--trains"):
    study.Plan("tiny", trains=["tbtt"])
  with pytest.raises(ValueError, match="--strategies"):
    study.Plan("tiny", strategies=["warm"])
  with pytest.raises(ValueError, match="--post_fraction"):
    study.Plan("tiny", post_fraction=0.0)
  with pytest.raises(ValueError, match="--lengths"):
    study.Plan("tiny", lengths=[0])
  with pytest.raises(ValueError, match="--override"):
    study.Plan("tiny", overrides=["model.nope=1"])
  with pytest.raises(study_config.common.ConfigError, match="unknown arm 'gla'"):
    study_config.get_config("5m,gla,l100")
  with pytest.raises(study_config.common.ConfigError, match="l<max> with max > 50"):
    study_config.get_config("5m,mamba2,l40")
  assert study_config.get_config("cpu").data.copying.copy_len == 100  # the older presets stay


def _run(train, stage, seed, acc_by_len, n=200, digest="h"):
  rng = np.random.default_rng(zlib.crc32(f"{train}.{stage}.{seed}".encode()))
  cells = []
  for L, acc in acc_by_len.items():
    right = [int(v) for v in rng.binomial(L, acc, size=n)]
    text = " ".join(map(str, right))
    cells.append({"copy_len": L, "teacher_forced": text, "free_running": text})
  return {
    "study": "copying",
    "arm": "mamba2",
    "size": "45m",
    "train": train,
    "stage": stage,
    "seed": seed,
    "sequences": 1_000_000,
    "non_embedding_params": 44_946_940,
    "eval": {"hash": digest},
    "cells": cells,
  }


def _study(zero, sp, cap, post_sp, trained=0.99):
  runs = []
  for s in range(3):
    runs += [
      _run("zero", "pretrain", s, {100: trained, 300: zero}),
      _run("sp", "pretrain", s, {100: trained, 300: sp}),
      _run("zero", "zero", s, {100: trained, 300: zero}),
      _run("zero", "state_passing", s, {100: trained, 300: post_sp}),
      _run("cap", "pretrain", s, {100: trained, 300: cap}),
    ]
  return runs


def test_verdicts_follow_the_rules():
  v = render.verdicts(_study(0.3, 0.5, 0.9, 0.3), "mamba2", "45m", "teacher_forced", resamples=300)
  assert v["sp - zero"][1] == "ahead" and v["sp - zero"][0]["lo"] > 0.1
  assert v["zero+sp - zero+zero"][1] == "tied"
  assert v["cap - zero"][1] == "length failure"
  v = render.verdicts(_study(0.3, 0.2, 0.35, 0.5), "mamba2", "45m", "free_running", resamples=300)
  assert v["sp - zero"][1] == "behind" and v["zero+sp - zero+zero"][1] == "ahead"
  assert v["cap - zero"][1] == "capacity"
  # a zero run that copies L=300 has no loss to explain; one that fails its range is not learnt
  v = render.verdicts(_study(0.95, 0.95, 0.95, 0.95), "mamba2", "45m", "teacher_forced")
  assert v["cap - zero"][1] == "no loss"
  v = render.verdicts(_study(0.1, 0.1, 0.1, 0.1, trained=0.5), "mamba2", "45m", "teacher_forced")
  assert {call for _, call in v.values()} == {"not learnt"}


def test_render_from_stored_json(tmp_path):
  folder = tmp_path / "results" / "copying" / "gpu"
  folder.mkdir(parents=True)
  runs = _study(0.3, 0.5, 0.9, 0.3)
  for i, r in enumerate(runs + [_run("zero", "pretrain", 9, {100: 1.0}, digest="other")]):
    write_json(str(folder / f"{i}.json"), r)
  assert len(render.load_runs(str(folder))) == len(runs)  # one evaluation set
  md = render.render(str(tmp_path / "results"), str(tmp_path / "fig"))
  assert md.startswith("## 4c. Copying at the paper's scale")
  assert "length failure" in md and "0.27 ± 0.03" in md and "zero+sp" in md
  assert os.path.exists(tmp_path / "fig" / "copying_study_gpu_mamba2_45m.png")


def test_measure_throughput_times_each_training_range(tmp_path):
  plan = study.Plan(
    "tiny",
    trains=["zero", "cap"],
    workdir=str(tmp_path / "runs"),
    results=str(tmp_path / "res"),
  )
  out = study.measure_throughput(plan, steps=2)
  assert [r["shape"] for r in out["rows"]] == ["mamba2.tiny.l100", "mamba2.tiny.l300"]
  zero, cap = out["rows"]
  assert set(zero["cell_minutes"]) == {"mamba2.tiny.zero.s0"}
  assert cap["tokens_per_step"] == 8 * 602 and zero["tokens_per_s"] > 0
  # the zero cell's minutes count its post-trainings too
  steps = plan.steps("mamba2.tiny.zero.s0", "pretrain") + 2 * plan.steps(
    "mamba2.tiny.zero.s0", "zero"
  )
  assert zero["cell_minutes"]["mamba2.tiny.zero.s0"] == pytest.approx(
    steps * zero["tokens_per_step"] / zero["tokens_per_s"] / 60
  )
  assert study.study_driver.read_json(str(tmp_path / "res" / "throughput.json")) == out
