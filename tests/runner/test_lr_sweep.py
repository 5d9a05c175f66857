"""The learning-rate sweep (experiments/runner/lr_sweep.py): each member trains as the single run at its rate would,
a stopped sweep resumes exactly, a member whose state is poisoned is frozen and reported while the others
finish, and each member's folder is a plain run that init_from and evaluate's loader read."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

from experiments import schema
from experiments.runner import checkpoint as ckpt_lib
from experiments.runner import lr_sweep, train_loop, trainer
from tests.runner_helpers import tiny_config

RATES = (3e-3, 1e-2)


def _losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [(r["step"], r["split"], r["loss"]) for r in map(json.loads, f)]


def _tiny(strategy="zero"):
  return tiny_config(
    strategy, layer_pattern="kdn_diag"
  )  # one compiled layer body: the suite's time


def _sweep_config(strategy="zero"):
  c = _tiny(strategy)
  c.train.lr_sweep = RATES
  c.checkpoint.enabled = True
  return c


def test_seeded_members_train_as_single_runs_resume_and_freeze_when_non_finite(tmp_path):
  """One seeded sweep under state_passing (one compiled program: the suite's time): the member (lr, s)
  is the single run with seed = data.shuffle_seed = s at rate lr (its own initial parameters, data
  order and carried states), through a stop and a resume; its folder holds a plain run's final
  checkpoint; a member whose state is poisoned is frozen and reported while the others finish."""
  members = ((1e-2, 1), (3e-3, 2))
  single = {}
  for lr, seed in members:  # each member's rate is scaled the same way: two of the four
    c = _tiny("state_passing")
    c.optim.learning_rate = lr
    c.seed = c.data.shuffle_seed = seed
    tr = trainer.Trainer(c, str(tmp_path / f"single{lr}_{seed}"))
    tr.run()
    tr.close()
    single[(lr, seed)] = _losses(tmp_path / f"single{lr}_{seed}")
  assert single[members[0]][0][2] != single[members[1]][0][2]  # the seeds start apart

  c = _sweep_config("state_passing")
  c.train.seeds = "1,2"
  wd = str(tmp_path / "sweep")
  tr = lr_sweep.make_trainer(c, wd)
  assert isinstance(tr, lr_sweep.SweepTrainer)
  assert [m for m in tr.members] == [(3e-3, 1), (3e-3, 2), (1e-2, 1), (1e-2, 2)]
  assert tr.run(stop_at=3)["status"] == "preempted"
  tr.close()
  tr = lr_sweep.make_trainer(c, wd)  # resumes params, optimizer, carried states and both streams
  assert tr.run()["status"] == "completed"
  tr.close()

  for i, (lr, seed) in enumerate(tr.members):
    member = schema.sweep_member_dir(wd, lr, seed)
    got = _losses(member)
    assert [g[:2] for g in got] == [(s, "train") for s in range(1, 7)] + [
      (6, "eval")
    ]  # none repeated
    if (lr, seed) in single:
      np.testing.assert_allclose([g[2] for g in got], [w[2] for w in single[(lr, seed)]], rtol=2e-5)
    with open(os.path.join(member, "config.json")) as f:
      cfg = json.load(f)
    assert (cfg["seed"], cfg["data"]["shuffle_seed"], cfg["optim"]["learning_rate"]) == (
      seed,
      seed,
      lr,
    )
    assert cfg["train"]["seeds"] == "" and cfg["train"]["lr_sweep"] == []
    # The member's folder holds a plain run's final checkpoint: parameters restore as init_from reads them.
    abstract = jax.eval_shape(lambda: tr.member_state(0)["params"])
    params, step = ckpt_lib.restore_params(member, abstract)
    assert step == 6
    np.testing.assert_array_equal(
      np.asarray(params["embed"]), np.asarray(tr.member_state(i)["params"]["embed"])
    )
  with open(os.path.join(wd, "summary.json")) as f:
    assert [m["status"] for m in json.load(f)["members"]] == ["completed"] * 4

  c.train.seeds = "1,3"
  with pytest.raises(schema.ConfigError, match=r"holds a sweep over seeds \(1, 2\)"):
    lr_sweep.SweepTrainer(c, wd)

  # The same program again (compiled once): a non-finite member.
  c.train.seeds = "1,2"
  c.checkpoint.enabled = False
  _a_non_finite_member_is_frozen_and_reported_while_the_others_finish(c, tmp_path)


def _a_non_finite_member_is_frozen_and_reported_while_the_others_finish(c, tmp_path):
  tr = lr_sweep.SweepTrainer(c, str(tmp_path / "poisoned"))
  poison = tr.members.index((1e-2, 1))
  emb = tr.state["params"]["embed"]
  tr.state["params"]["embed"] = emb.at[poison].multiply(np.inf)  # poison one member only
  poisoned = np.asarray(tr.state["params"]["embed"][poison])
  summary = tr.run()
  tr.close()
  assert summary["status"] == "completed"
  np.testing.assert_array_equal(np.asarray(tr.state["params"]["embed"][poison]), poisoned)
  statuses = {}
  for lr, seed in tr.members:
    member = schema.sweep_member_dir(str(tmp_path / "poisoned"), lr, seed)
    with open(os.path.join(member, "summary.json")) as f:
      s = json.load(f)
    statuses[(lr, seed)] = (s["status"], s.get("diverged_at_step"))
  assert statuses == {
    (3e-3, 1): ("completed", None),
    (3e-3, 2): ("completed", None),
    (1e-2, 1): ("diverged", 1),
    (1e-2, 2): ("completed", None),
  }

  # Every member non-finite halts the sweep like a single run.
  tr = lr_sweep.SweepTrainer(c, str(tmp_path / "all"))
  tr.state["params"]["embed"] = tr.state["params"]["embed"] * np.inf
  with pytest.raises(train_loop.NonFiniteLossError, match="every learning rate of the sweep"):
    tr.run()
  tr.close()


def test_bad_rates_and_a_changed_sweep_are_config_errors(tmp_path):
  c = _tiny()
  c.train.lr_sweep = (1e-3, 1e-3)
  with pytest.raises(
    schema.ConfigError, match=r"config\.train\.lr_sweep: must be distinct positive"
  ):
    schema.validate(c)
  c.train.lr_sweep = (1e-3, -1.0)
  with pytest.raises(schema.ConfigError, match=r"config\.train\.lr_sweep"):
    schema.validate(c)
  c = _sweep_config()
  tr = lr_sweep.SweepTrainer(c, str(tmp_path / "sweep"))
  tr.save(force=True)  # a checkpoint of the sweep at step 0 (what a resume reads first)
  tr.close()
  c.train.lr_sweep = (1e-3,)
  with pytest.raises(schema.ConfigError, match=r"holds a sweep over \(0\.003, 0\.01\)"):
    lr_sweep.SweepTrainer(c, str(tmp_path / "sweep"))
  c.train.lr_sweep = RATES
  for bad in ("0,0", "1,x", "-1"):
    c.train.seeds = bad
    with pytest.raises(
      schema.ConfigError, match=r"config\.train\.seeds: expected distinct non-negative"
    ):
      schema.validate(c)
