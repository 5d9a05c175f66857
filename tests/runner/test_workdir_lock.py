"""One run per workdir (experiments/runner/workdir_lock.py): a second run exits at start with one line
while the first trains on untouched; a lock left by a dead run is taken over."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import jax
import pytest
from runner_helpers import ROOT, one_device_env, tiny_config

from experiments import schema
from experiments.runner import trainer, workdir_lock


def _lock_of(workdir):
  return json.load(open(os.path.join(workdir, workdir_lock.LOCK_NAME)))


def _write_lock(workdir, pid, host=None, start=None):
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, workdir_lock.LOCK_NAME), "w", encoding="utf-8") as f:
    json.dump(
      {"pid": pid, "host": host or socket.gethostname(), "start": start, "since": "earlier"}, f
    )


def test_live_owner_refuses_dead_owner_is_taken_over(tmp_path):
  wd = str(tmp_path / "w")
  path = workdir_lock.acquire(wd)
  assert _lock_of(wd)["pid"] == os.getpid()
  assert workdir_lock.acquire(wd) == path  # this process again (several Trainers of one workdir)
  workdir_lock.release(path)
  assert os.path.exists(path)
  workdir_lock.release(path)
  assert not os.path.exists(path)

  other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
  try:
    start = workdir_lock._start_time(other.pid)  # pylint: disable=protected-access
    _write_lock(wd, other.pid, start=start)
    with pytest.raises(
      workdir_lock.WorkdirInUseError,
      match=rf"in use by another run \(pid {other.pid} on {socket.gethostname()}",
    ):
      workdir_lock.acquire(wd)
    if start is not None:  # the same pid, another start time: the pid was reused, the owner is gone
      _write_lock(wd, other.pid, start=start + 1)
      workdir_lock.release(workdir_lock.acquire(wd))
  finally:
    other.kill()
    other.wait()
  _write_lock(wd, other.pid, start=start)  # its owner has exited
  path = workdir_lock.acquire(wd)
  assert _lock_of(wd)["pid"] == os.getpid()
  workdir_lock.release(path)

  _write_lock(wd, 1, host="some-other-host")  # cannot be checked from here: honoured
  with pytest.raises(workdir_lock.WorkdirInUseError, match=rf"delete {path}"):
    workdir_lock.acquire(wd)
  with open(path, "w", encoding="utf-8") as f:  # torn by a crash mid-write, long ago
    f.write('{"pid": ')
  os.utime(path, (time.time() - 60, time.time() - 60))
  workdir_lock.release(workdir_lock.acquire(wd))
  assert not os.path.exists(path)


def test_second_run_on_a_busy_workdir_exits_with_one_line(tmp_path):
  """A training holds its workdir: the same command started meanwhile (another process, through the
  command line) exits 2 with one line naming the owner, before building anything; the first run then
  trains to the end with each metric row once, and frees the workdir."""
  c = tiny_config()
  c.mesh.data = 1
  c.checkpoint.enabled = True
  wd = tmp_path / "w"
  tr = trainer.Trainer(c, str(wd), devices=jax.devices()[:1])
  try:
    assert _lock_of(wd)["pid"] == os.getpid()
    argv = ["--config=configs/mqar.py:smoke", f"--workdir={wd}"]
    r = subprocess.run(
      [sys.executable, os.path.join(ROOT, "tests", "train_cli_batch.py"), json.dumps([argv])],
      cwd=ROOT,
      env=one_device_env(),
      capture_output=True,
      text=True,
      timeout=300,
    )
    second = json.loads(r.stdout.strip().splitlines()[-1])
    lines = second["stderr"].strip().splitlines()
    assert second["returncode"] == 2 and len(lines) == 1, second
    assert lines[0].startswith(
      f"Config error: {wd} is in use by another run (pid {os.getpid()} on "
    ), lines
    assert sorted(os.listdir(wd)) == [
      "checkpoints",
      "run.lock",
    ]  # the second run wrote nothing (the first writes config.json once it starts)
    assert not os.listdir(wd / "checkpoints")
    s = tr.run()
  finally:
    tr.close()
  assert s["status"] == "completed"
  rows = [json.loads(line) for line in open(wd / "metrics.jsonl")]
  assert [x["step"] for x in rows if x["split"] == "train"] == list(range(1, c.train.num_steps + 1))
  assert not os.path.exists(wd / workdir_lock.LOCK_NAME)


def test_trainer_refuses_a_workdir_held_by_a_live_process(tmp_path):
  other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
  try:
    _write_lock(str(tmp_path / "w"), other.pid)
    with pytest.raises(schema.ConfigError, match="is in use by another run"):
      trainer.Trainer(tiny_config(), str(tmp_path / "w"), devices=jax.devices()[:1])
  finally:
    other.kill()
    other.wait()
