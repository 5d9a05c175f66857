"""The MQAR grid: every cell's config is valid and parameter-matched, bad grid arguments fail before any run,
and collection keeps the best completed learning rate (a stopped run never counts)."""

from __future__ import annotations

import json
import os

import pytest
from absl import app

from configs import mqar_grid
from experiments.runner import config_lib
from experiments.studies import mqar_grid as launcher
from kdn_jax.models.config import analytic_non_embedding


def test_every_cell_and_mixer_is_a_valid_matched_config():
  for cell in mqar_grid.CELLS:
    d, t, kv = mqar_grid.parse_cell(cell)
    budgets = []
    for mixer in mqar_grid.MIXERS:
      c = mqar_grid.get_config(f"{cell},{mixer}")
      config_lib.validate(c, num_devices=1)
      assert (c.model.d_model, c.data.seq_len, c.data.mqar.num_kv_pairs, c.model.mixer) == (
        d,
        t,
        kv,
        mixer,
      )
      budgets.append(analytic_non_embedding(c.model, int(c.model.mlp_hidden)))
    # Matched to kdn_diag through the MLP width, up to its rounding (one step of 8 SwiGLU units).
    step = 3 * d * c.model.num_layers * int(c.model.mlp_multiple)
    assert all(abs(b - budgets[0]) <= step for b in budgets), (cell, budgets, step)


def test_bad_cell_and_grid_arguments_name_what_is_expected():
  with pytest.raises(ValueError, match=r"cell 'd64_t256' is not d<d_model>_t<seq_len>_kv<pairs>"):
    mqar_grid.get_config("d64_t256,kda")
  with pytest.raises(app.UsageError, match=r"--mixers: unknown \['nosuch'\]"):
    launcher.check_grid(["d64_t256_kv16"], ["nosuch"], [1e-3])
  with pytest.raises(app.UsageError, match="--lrs"):
    launcher.check_grid(["d64_t256_kv16"], ["kda"], [0.0])


def test_middle_learning_rate_runs_first():
  assert launcher.run_order([1e-3, 3e-3, 1e-2])[0] == 3e-3


def _summary(root, cell, mixer, lr, status, acc):
  wd = launcher.run_dir(str(root), cell, mixer, lr)
  os.makedirs(wd)
  ev = {} if acc is None else {"accuracy": acc, "loss": 1.0}
  with open(os.path.join(wd, "summary.json"), "w") as f:
    json.dump(dict(status=status, eval=ev, step=10, num_steps=10, num_params=123), f)


def test_collect_keeps_the_best_completed_rate(tmp_path):
  cell = "d64_t256_kv16"
  _summary(tmp_path, cell, "kda", 1e-3, "completed", 0.5)
  _summary(tmp_path, cell, "kda", 3e-3, "completed", 0.8)
  _summary(tmp_path, cell, "kda", 1e-2, "preempted", None)
  _summary(tmp_path, cell, "gla", 1e-2, "preempted", None)
  grid = launcher.collect(str(tmp_path), [cell], ["kda", "gla"], [1e-3, 3e-3, 1e-2])
  assert grid["best"] == {f"{cell}/kda": dict(learning_rate=3e-3, accuracy=0.8, num_params=123)}
  status = {(r["mixer"], r["learning_rate"]): r["status"] for r in grid["runs"]}
  assert status[("gla", 1e-3)] == "missing" and status[("gla", 1e-2)] == "preempted"
  assert launcher.completed(launcher.run_dir(str(tmp_path), cell, "kda", 1e-3))
  assert not launcher.completed(launcher.run_dir(str(tmp_path), cell, "kda", 1e-2))


def test_sweep_jobs_are_one_process_per_cell_and_mixer(tmp_path):
  cell, lrs = "d64_t256_kv16", [1e-3, 3e-3, 1e-2]
  _summary(tmp_path, cell, "kda", 1e-3, "completed", 0.5)
  _summary(tmp_path, cell, "kda", 3e-3, "completed", 0.8)
  _summary(tmp_path, cell, "kda", 1e-2, "completed", 0.1)
  _summary(tmp_path, cell, "gla", 1e-3, "completed", 0.5)  # a sweep with one member done still runs
  n, todo = launcher.grid_jobs(str(tmp_path), [cell], ["kda", "gla"], lrs, sweep=True)
  assert n == 2 and [(j[1], j[2]) for j in todo] == [("gla", tuple(lrs))]
  cmd = launcher.train_command(str(tmp_path), cell, "gla", tuple(lrs), cpu=False)
  assert "--config.train.lr_sweep=(0.001,0.003,0.01,)" in cmd
  assert f"--workdir={launcher.sweep_dir(str(tmp_path), cell, 'gla')}" in cmd
  # each rate's folder is the member folder of the sweep, where collect reads it
  assert launcher.run_dir(str(tmp_path), cell, "gla", 3e-3) == os.path.join(
    str(tmp_path), cell, "gla", "lr0.003"
  )
  n, todo = launcher.grid_jobs(str(tmp_path), [cell], ["kda", "gla"], lrs, sweep=False)
  assert n == 6 and len(todo) == 2 and todo[0][2] == 3e-3
