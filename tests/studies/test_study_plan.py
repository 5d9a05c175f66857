"""The study driver's plan records (experiments/studies/study_plan.py) on the text study's real plan
with training and evaluation mocked: results stay outside the repository, a changed plan is
refused with its difference named, another plan's result is never reused, and what is skipped is
said."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from experiments.data import corpus, token_files
from experiments.runner.logging_utils import write_json
from experiments.studies import study_driver, study_plan
from experiments.studies.lengen_text import study as lengen_text

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _fake_study(calls):
  """lengen_text's work list with a training that writes what the trainer leaves (a completed
  summary, the kept checkpoints) and an evaluation that writes a JSON its ``evaluated`` accepts."""

  def train(plan, arm, stage):
    wd = plan.run_dir(arm, stage)
    steps = plan.keep_steps if stage == "pretrain" else [plan.post_steps]
    for s in steps:
      os.makedirs(os.path.join(wd, "checkpoints", str(s), "state"), exist_ok=True)
    write_json(os.path.join(wd, "summary.json"), {"status": "completed", "step": steps[-1]})
    calls.append(("train", arm, stage))
    return {"status": "completed"}

  def evaluate(plan, arm, stage):
    step = study_driver.next_eval_step(plan, arm, stage, lengen_text.evaluated)
    if step is None:
      return None
    out = {
      "step": step,
      "ratio": {"units": plan.windows},
      "position": {"max_len": plan.max_len},
      "long_split": plan.long_split,
    }
    write_json(study_driver.result_path(plan, arm, stage, step), out)
    calls.append(("eval", arm, stage, step))
    return f"{arm} {stage} @ step {step} evaluated"

  return study_driver.Study(
    module="experiments.studies.lengen_text",
    unit="arm",
    work=lengen_text.arm_work,
    train=train,
    evaluate=evaluate,
  )


def _plan(tmp_path, **kw):
  args = dict(
    workdir=str(tmp_path / "runs"),
    toy_corpus=True,
    pretrain_steps=5,
    post_steps=2,
    windows=4,
    max_len=512,
    resamples=200,
  )
  return lengen_text.Plan("tiny", ["gla"], ["state_passing"], **(args | kw))


def _run(plan, calls):
  lengen_text.write_toy_corpus(plan.corpus_dir, long_len=plan.max_len + 1)
  return study_driver.run(_fake_study(calls), plan, plan.arms, 1, [])


def _git_status():
  return subprocess.run(
    ["git", "status", "--porcelain", "--untracked-files=all"],
    cwd=REPO,
    capture_output=True,
    text=True,
    check=True,
  ).stdout


@pytest.mark.skipif(study_plan.REPO is None, reason="needs the code to run from a git clone")
def test_a_study_in_a_temporary_folder_leaves_the_repository_as_it_was(tmp_path, capsys):
  before = _git_status()
  plan = _plan(tmp_path)
  assert plan.results == str(tmp_path / "runs" / "results" / "tiny_long_val")
  calls = []
  assert _run(plan, calls) == ("done", True)
  assert [c[:3] for c in calls] == [("train", "gla", "pretrain")] + [
    ("eval", "gla", "pretrain")
  ] * 3 + [("train", "gla", "state_passing"), ("eval", "gla", "state_passing")]
  study_driver.write_commands(_fake_study([]), plan, [], "done", 1.0, "cpu", "P")
  r = json.loads((tmp_path / "runs/results/tiny_long_val/gla.pretrain.step5.json").read_text())
  ident = study_plan.read(str(tmp_path / "runs" / "gla" / study_plan.PLAN_FILE))
  assert r["plan_hash"] == study_plan.identity_hash(ident) and r["plan"]["pretrain_steps"] == 5
  assert ident["configs"]["state_passing"]["train"]["init_from"] == "<workdir>/gla/pretrain"
  assert ident["corpus_manifest"] and ident["settings"]["long_path"] == (
    "<workdir>/toy_corpus/long_val.npy"
  )
  assert _git_status() == before
  # a second call does nothing and says what it skipped and why
  calls.clear()
  assert _run(plan, calls) == ("done", False) and calls == []
  out = capsys.readouterr().out
  assert "study: gla: skipped, done by this plan: pretrain trained (5 steps); state_passing " in out
  assert "4 results of this plan kept (gla.pretrain.step1.json" in out
  with pytest.raises(study_plan.PlanError, match=r"^--results: .* is inside the repository"):
    study_driver.run(
      _fake_study([]), _plan(tmp_path, results=os.path.join(REPO, "x")), ["gla"], 1, []
    )
  assert not os.path.exists(os.path.join(REPO, "x"))


def test_a_changed_plan_is_refused_naming_the_difference(tmp_path):
  calls = []
  _run(_plan(tmp_path), calls)
  with pytest.raises(
    study_plan.PlanError,
    match=r"^--workdir: .*/runs/gla was made by another plan: keep_steps \[1, 2, 5\] -> \[1, 3, 6\], "
    r"post_steps 2 -> 3, pretrain_steps 5 -> 6 \(and \d+ more\); use another --workdir",
  ):
    _run(_plan(tmp_path, pretrain_steps=6, post_steps=3), calls)
  with pytest.raises(study_plan.PlanError, match=r"windows 4 -> 5"):
    _run(_plan(tmp_path, windows=5), calls)
  # an override reaches the run configs only: named there
  with pytest.raises(study_plan.PlanError, match=r"configs.pretrain.model.num_layers 2 -> 1"):
    _run(_plan(tmp_path, overrides=["model.num_layers=1"]), calls)
  # runs without a plan record are not continued either
  os.remove(tmp_path / "runs" / "gla" / study_plan.PLAN_FILE)
  with pytest.raises(study_plan.PlanError, match="holds runs without a plan record"):
    _run(_plan(tmp_path), calls)


def test_another_plans_result_is_never_reused(tmp_path):
  shared = str(tmp_path / "shared")
  calls = []
  _run(_plan(tmp_path, results=shared), calls)
  # a new workdir and the same results folder, another plan: refused before any work
  other = _plan(tmp_path, workdir=str(tmp_path / "runs2"), results=shared, windows=5)
  with pytest.raises(study_plan.PlanError, match=r"^--results: .*gla.*\.json was made by another "):
    _run(other, calls)
  assert not os.path.exists(tmp_path / "runs2" / "gla")
  # a result its study accepts but that carries another plan's hash is evaluated again
  plan = _plan(tmp_path, results=shared)
  study_plan.lock(_fake_study([]), plan, ["gla"])
  assert lengen_text.arm_work(plan, "gla") == []
  path = study_driver.result_path(plan, "gla", "pretrain", 2)
  write_json(path, dict(study_plan.read(path), plan_hash="0" * 16))
  assert [(k, s) for k, s, _ in lengen_text.arm_work(plan, "gla")] == [("eval", "pretrain")]
  assert study_driver.next_eval_step(plan, "gla", "pretrain", lengen_text.evaluated) == 2
  # an unchecked plan reuses nothing
  fresh = _plan(tmp_path, results=shared)
  assert len(lengen_text.arm_work(fresh, "gla")) == 4


def test_the_text_study_checks_only_the_split_it_evaluates(tmp_path):
  plan = _plan(tmp_path)
  lengen_text.write_toy_corpus(plan.corpus_dir, long_len=600)
  os.remove(os.path.join(plan.corpus_dir, "long_eval.npy"))
  c = plan.config("gla", "pretrain")
  assert c.data.long_eval_path == plan.long_path
  corpus.resolve(c)
  token_files.check_run_files(c)  # raised for the missing long_eval.npy when the corpus filled it


def test_publish_replaces_only_the_arms_it_ran(tmp_path, monkeypatch):
  plan = _plan(tmp_path)
  _run(plan, [])
  monkeypatch.setattr(study_plan, "REPO", str(tmp_path / "clone"))
  dest = tmp_path / "clone" / "docs" / "results" / "lengen_text" / "tiny_long_val"
  dest.mkdir(parents=True)
  (dest / "gla.pretrain.step9.json").write_text("{}")  # another plan's step: replaced
  (dest / "kda.zero.json").write_text("{}")  # another arm: kept
  assert study_plan.publish(_fake_study([]), plan, ["gla"]) == str(dest)
  assert sorted(os.listdir(dest)) == sorted(
    ["kda.zero.json"]
    + [f"gla.pretrain.step{s}.json" for s in (1, 2, 5)]
    + ["gla.state_passing.json"]
  )
