"""A run config is checked once: keys, values and data files where it is loaded
(experiments/config_checks.py), the mesh against the devices in the Trainer; a Trainer built from a
config nobody checked still gets the value checks, with the same one-line errors."""

from __future__ import annotations

import json
import os

import pytest
from runner_helpers import run_one_device, tiny_config

from experiments import config_checks, schema
from experiments.runner import trainer

# `python -m experiments.train` with each check counted and Trainer.run stubbed out (the counts are
# what building the run costs; training adds no checks)
_COUNTED_TRAIN = """
import json, sys
from absl import app
from experiments import schema, train
from experiments.data import token_files
from experiments.runner import trainer

calls = {"check_keys": 0, "check_values": 0, "check_mesh": 0, "check_run_files": 0}

def counted(owner, name, top_level=lambda *a, **k: True):
  real = getattr(owner, name)
  def wrapper(*args, **kwargs):
    calls[name] += bool(top_level(*args, **kwargs))
    return real(*args, **kwargs)
  setattr(owner, name, wrapper)

counted(schema, "check_keys", lambda config, schema=None, prefix="": not prefix)  # (it recurses)
for name in ("check_values", "check_mesh"):
  if hasattr(schema, name):
    counted(schema, name)
counted(token_files, "check_run_files")
trainer.Trainer.run = lambda self: {"status": "completed"}
sys.argv = ["train", "--config=configs/mqar.py:smoke", "--workdir=" + sys.argv[1]]
try:
  app.run(train.main, flags_parser=train._parse_flags)
except SystemExit as e:
  print(json.dumps(dict(calls, exit=e.code)))
"""


def test_train_checks_each_key_once(tmp_path):
  r = run_one_device(["-c", _COUNTED_TRAIN, str(tmp_path / "w")], timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  counts = json.loads(r.stdout.strip().splitlines()[-1])
  assert counts == {
    "check_keys": 1,
    "check_values": 1,
    "check_mesh": 1,
    "check_run_files": 1,
    "exit": 0,
  }, counts


@pytest.mark.parametrize(
  "mutate, line",
  [
    (
      lambda c: setattr(c.optim, "learning_rate", -1.0),
      "config.optim.learning_rate: must be positive, got -1.0",
    ),
    (
      lambda c: setattr(c.train, "learning_rate", 1e-3),
      "config.train.learning_rate: unknown key (did you mean 'config.optim.learning_rate'?)",
    ),
  ],
)
def test_a_trainer_checks_a_config_nobody_checked(tmp_path, mutate, line):
  c = tiny_config()
  with c.unlocked():
    mutate(c)
  with pytest.raises(schema.ConfigError) as loaded:
    config_checks.check(c)
  with pytest.raises(schema.ConfigError) as built:
    trainer.Trainer(c, str(tmp_path / "w"))
  assert str(loaded.value) == str(built.value) == line
  assert not os.path.exists(tmp_path / "w")  # refused before the workdir was touched


def test_a_config_changed_after_its_check_is_checked_again(monkeypatch):
  calls = []
  real = schema.check_values
  monkeypatch.setattr(schema, "check_values", lambda c: (calls.append(1), real(c))[1])
  c = tiny_config()
  c.optim.learning_rate = 0.0123  # content no other test checked
  config_checks.check(c)
  config_checks.check(c)
  assert len(calls) == 1
  c.optim.learning_rate = -1.0
  with pytest.raises(schema.ConfigError, match=r"^config\.optim\.learning_rate: must be positive"):
    config_checks.check(c)
  assert len(calls) == 2
