"""Runner tests: sharded == single-device step, kill/resume determinism, NaN handling, bad configs, CLI."""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from absl import flags
from ml_collections import config_flags
from runner_helpers import (
  ROOT,
  host,
  one_device_env,
  tiny_config,
  write_array_record,
  write_doc_tokens,
)

from experiments import schema
from experiments.runner import sharding, tracing, train_loop, trainer


def _one_step(config, devices, workdir):
  tr = trainer.Trainer(config, str(workdir), devices=devices)
  batch = next(tr.data_iter)
  m = tr.train_step(batch)
  out = float(m["loss"]), host(tr.state["params"])
  tr.close()
  return out


def test_sharded_step_matches_single_device(tmp_path):
  assert len(jax.devices()) == 8, "conftest should simulate 8 CPU devices"
  c1 = tiny_config()
  c1.mesh.data, c1.mesh.fsdp = 1, 1
  loss1, p1 = _one_step(c1, jax.devices()[:1], tmp_path / "one")
  c8 = tiny_config()
  c8.mesh.data, c8.mesh.fsdp, c8.mesh.tensor = 2, 4, 1
  tr = trainer.Trainer(c8, str(tmp_path / "eight"))
  # parameters really are sharded over fsdp (embed axis) and the batch over data x fsdp.
  specs = {str(s.spec) for s in jax.tree.leaves(tr.param_shardings)}
  assert any("fsdp" in s for s in specs), specs
  tr.close()
  loss8, p8 = _one_step(c8, None, tmp_path / "eight2")
  np.testing.assert_allclose(loss8, loss1, rtol=1e-5, atol=1e-5)
  for a, b in zip(jax.tree.leaves(p8), jax.tree.leaves(p1)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  # Tensor parallel: heads, MLP and vocabulary split over tensor=2 (with data=2 x fsdp=2).
  ct = tiny_config()
  ct.mesh.data, ct.mesh.fsdp, ct.mesh.tensor = 2, 2, 2
  tr = trainer.Trainer(ct, str(tmp_path / "tensor"))
  specs = {str(s.spec) for s in jax.tree.leaves(tr.param_shardings)}
  assert any("tensor" in s for s in specs), specs
  lossT = float(tr.train_step(next(tr.data_iter))["loss"])
  pT = host(tr.state["params"])
  tr.close()
  np.testing.assert_allclose(lossT, loss1, rtol=1e-5, atol=1e-5)
  for a, b in zip(jax.tree.leaves(pT), jax.tree.leaves(p1)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def _train_rows(workdir):
  """(step, loss) of every train row of metrics.jsonl, in file order (duplicates kept, to be caught)."""
  recs = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
  return [(r["step"], r["loss"]) for r in recs if r["split"] == "train"]


def _assert_same_run(wa, wb, tra, trb, n):
  """Two workdirs/trainers hold the same run: the same train rows (each step once) and final state."""
  ra, rb = _train_rows(wa), _train_rows(wb)
  assert [s for s, _ in ra] == [s for s, _ in rb] == list(range(1, n + 1)), (ra, rb)
  assert ra == rb  # bit-equal losses
  for key in ("params", "carry", "fstats"):
    a, b = host(tra.state[key]), host(trb.state[key])
    assert (a is None) == (b is None), key
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      np.testing.assert_array_equal(x, y, err_msg=key)


def test_sigterm_crash_and_resume_are_exact(tmp_path, capsys):
  """A run crashed after an unsaved step (its metric row already written), resumed, stopped by a real
  SIGTERM, resumed again: the same losses (one row per step), parameters and carried states as an
  uninterrupted run; a further run with a smaller num_steps warns and trains nothing."""

  def cfg():
    c = tiny_config("state_passing")
    c.train.state_reset_prob = 0.3
    c.checkpoint.enabled = True
    c.checkpoint.every_steps = 2
    c.data.prefetch = 2
    return c

  def with_hook(tr, at_call, action):
    calls = [0]
    inner = tr.train_step

    def step(local):
      calls[0] += 1
      if calls[0] == at_call:
        action()
      return inner(local)

    tr.train_step = step

  def crash():
    raise RuntimeError("simulated crash")

  n = 6
  straight = trainer.Trainer(cfg(), str(tmp_path / "a"))
  straight.run()
  wb = str(tmp_path / "b")
  tr = trainer.Trainer(cfg(), wb)
  with_hook(tr, 4, crash)  # steps 1-3 ran and logged; the last checkpoint is step 2
  with pytest.raises(RuntimeError, match="simulated crash"):
    tr.run()
  tr.close()
  assert [s for s, _ in _train_rows(wb)] == [1, 2, 3]
  tr = trainer.Trainer(cfg(), wb)
  # SIGTERM arrives during the 2nd step of this run (step 4): that step finishes, is saved, and the run stops
  with_hook(tr, 2, lambda: os.kill(os.getpid(), signal.SIGTERM))
  s = tr.run()
  tr.close()
  assert s["status"] == "preempted" and s["step"] == 4 and s["steps_this_run"] == 2, s
  assert "Resumed from checkpoint at step 2" in capsys.readouterr().out
  resumed = trainer.Trainer(cfg(), wb)
  s = resumed.run()
  assert s["status"] == "completed" and s["steps_this_run"] == n - 4, s
  _assert_same_run(tmp_path / "a", wb, straight, resumed, n)
  straight.close()
  resumed.close()

  short = cfg()
  short.train.num_steps = 3
  tr = trainer.Trainer(short, wb)
  s = tr.run()
  tr.close()
  assert s["steps_this_run"] == 0 and "beyond config.train.num_steps=3" in s["warning"]
  assert "nothing to train" in capsys.readouterr().out
  assert [st for st, _ in _train_rows(wb)] == list(range(1, n + 1))  # no rows dropped or added


def _damage(step_dir, how):
  """Damages a saved checkpoint step the way a fault would."""
  state = os.path.join(step_dir, "state")
  files = sorted(
    (os.path.join(d, f) for d, _, fs in os.walk(state) for f in fs), key=os.path.getsize
  )
  if how == "truncated":  # a disk or copy fault: the biggest array file cut in half
    with open(files[-1], "r+b") as f:
      f.truncate(os.path.getsize(files[-1]) // 2)
  else:  # a half-written copy: the array data and metadata files of the state are gone
    for f in files:
      if "manifest" in f or f.endswith(("_METADATA", ".ocdbt")) or os.sep + "d" + os.sep in f:
        os.remove(f)


# (an error: the abandoned reads of the failed restore must not print tracebacks; orbax_noise.py)
@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("strategy, how", [("tbtt", "truncated"), ("fitted_noise", "half_written")])
def test_carried_state_runs_resume_exactly_past_a_damaged_checkpoint(
  tmp_path, capsys, strategy, how
):
  """TBTT (over an .array_record token file) and fitted-noise runs: the final checkpoint is damaged
  after the run ended, so resuming the workdir detects it, sets it aside with a message, restarts from
  the previous checkpoint and must reproduce the run exactly (losses with one row per step, parameters,
  carried states / noise statistics); the damaged files are kept."""
  import shutil  # pylint: disable=g-import-not-at-top

  def cfg():
    if strategy == "tbtt":
      c = tiny_config("tbtt", kind="token_file", train_path=_array_record_docs(tmp_path), eos_id=1)
    else:
      c = tiny_config(strategy)
    c.checkpoint.enabled = True
    c.checkpoint.every_steps = 3
    c.mesh.data = 1  # one device compiles faster; the sharded resume is test_sigterm_crash_and_resume_are_exact's
    return c

  n, one = 6, jax.devices()[:1]
  straight = trainer.Trainer(cfg(), str(tmp_path / "a"), devices=one)
  straight.run()
  if strategy == "fitted_noise":
    assert int(straight.state["fstats"]["count"]) == n
  wb = tmp_path / "b"
  shutil.copytree(tmp_path / "a", wb)
  _damage(str(wb / "checkpoints" / str(n)), how)
  resumed = trainer.Trainer(cfg(), str(wb), devices=one)
  s = resumed.run()
  assert s["steps_this_run"] == n - 3, s
  err = capsys.readouterr().err
  assert f"Checkpoint step {n} in {wb}/checkpoints is unreadable" in err, err
  assert "falling back to the previous checkpoint" in err
  assert os.path.isdir(wb / "checkpoints.unreadable" / str(n))  # kept for inspection
  _assert_same_run(tmp_path / "a", wb, straight, resumed, n)
  straight.close()
  resumed.close()
  if how == "truncated":  # every checkpoint damaged: an error, never a silent restart from step 0
    wc = tmp_path / "c"
    shutil.copytree(tmp_path / "a", wc)
    for step in (3, n):
      _damage(str(wc / "checkpoints" / str(step)), how)
    tr = trainer.Trainer(cfg(), str(wc), devices=one)
    with pytest.raises(RuntimeError, match=r"none of the checkpoints \[3, 6\] .* restores"):
      tr.run()
    tr.close()
    assert sorted(os.listdir(wc / "checkpoints.unreadable")) == ["3", "6"]


def test_failed_restore_counts_only_orbax_abandoned_reads(monkeypatch):
  """Inside the window, orbax's abandoned reads are counted, any other unraisable exception reaches
  the previous hook, and the previous hook is back afterwards, also after a failure."""
  import types  # pylint: disable=g-import-not-at-top

  from experiments.runner import orbax_noise  # pylint: disable=g-import-not-at-top

  passed_on = []
  monkeypatch.setattr(sys, "unraisablehook", passed_on.append)
  previous = sys.unraisablehook
  closed = types.SimpleNamespace(exc_value=RuntimeError("Event loop is closed"), object=None)
  other = types.SimpleNamespace(exc_value=ValueError("from elsewhere"), object=None)
  with orbax_noise.abandoned_reads_dropped(settle_s=0.01) as failed:
    sys.unraisablehook(closed)
    sys.unraisablehook(other)
    failed.append(6)
  assert passed_on == [other] and sys.unraisablehook is previous
  with pytest.raises(KeyError):
    with orbax_noise.abandoned_reads_dropped(settle_s=0.01):
      raise KeyError("inside")
  assert sys.unraisablehook is previous
  # With `keep` (the Checkpointer's), a failed restore's hook stays in place for stragglers that
  # come after the quiet window, until the checkpointer closes; a restore that succeeds leaves none.
  kept = []
  with orbax_noise.abandoned_reads_dropped(settle_s=0.01, keep=kept):
    pass
  assert not kept and sys.unraisablehook is previous
  start = time.monotonic()  # (its exit does not wait for the quiet window: close does)
  with orbax_noise.abandoned_reads_dropped(settle_s=30.0, max_wait_s=30.0, keep=kept) as failed:
    failed.append(3)
  assert time.monotonic() - start < 10.0
  assert len(kept) == 1 and sys.unraisablehook is not previous
  sys.unraisablehook(closed)  # a straggler, after the window
  sys.unraisablehook(other)
  assert passed_on == [other, other] and kept[0][2]
  orbax_noise.release_hooks(kept, settle_s=0.01)
  assert not kept and sys.unraisablehook is previous


def _array_record_docs(tmp_path):
  """Random documents (each ending in eos=1) as an .array_record file."""
  path = tmp_path / "docs.array_record"
  if not path.exists():
    write_array_record(
      path,
      write_doc_tokens(
        str(tmp_path / "docs.npy"), num_docs=24, eos=1, vocab=32, min_len=10, max_len=50
      ),
    )
  return str(path)


def test_nan_loss_halts_or_skips(tmp_path):
  c = tiny_config()
  c.checkpoint.enabled = True
  tr = trainer.Trainer(c, str(tmp_path / "halt"))
  tr.run(stop_at=1)  # a good checkpoint at step 1
  tr.state["params"] = jax.tree.map(lambda x: x * np.nan, tr.state["params"])
  # Resuming would restore the good checkpoint; instead keep training the poisoned state in place.
  tr.maybe_restore = lambda: False
  with pytest.raises(
    train_loop.NonFiniteLossError,
    match="non-finite loss/gradients at step 2;.*Last good checkpoint: step 1",
  ):
    tr.run()
  assert tr.checkpointer.latest_step() == 1
  tr.close()

  c = tiny_config()
  c.train.nan_policy = "skip"
  tr = trainer.Trainer(c, str(tmp_path / "skip"))
  tr.state["params"]["embed"] = tr.state["params"]["embed"] * np.inf
  before = host(tr.state["params"])
  m = tr.train_step(next(tr.data_iter))
  assert float(m["finite"]) == 0.0 and tr.step() == 1
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(host(tr.state["params"]))):
    np.testing.assert_array_equal(a, b)
  tr.close()


@pytest.mark.parametrize(
  "mutate, match",
  [
    (lambda c: setattr(c.model, "mixer", "lstm"), r"config\.model\.mixer: invalid value .lstm."),
    (
      lambda c: setattr(c.optim, "learning_rate", -1.0),
      r"config\.optim\.learning_rate: must be positive",
    ),
    (
      lambda c: (setattr(c.mesh, "data", 3), setattr(c.mesh, "fsdp", 1)),
      r"config\.mesh: mesh .* has 3 devices",
    ),
    (
      lambda c: setattr(c.mesh, "fsdp", 3),
      r"config\.mesh: fixed axes .* do not divide the 8 devices",
    ),
    (lambda c: setattr(c.train, "initial_state", "magic"), r"config\.train\.initial_state"),
    (lambda c: setattr(c.train, "state_reset_prob", 1.5), r"config\.train\.state_reset_prob"),
  ],
)
def test_bad_config_values(mutate, match):
  c = tiny_config()
  mutate(c)
  with pytest.raises(schema.ConfigError, match=match):
    schema.check_mesh(schema.validate(c), 8)


def test_unknown_key_and_missing_data(tmp_path):
  c = tiny_config()
  with pytest.raises(AttributeError, match="learning_rat"):
    c.optim.learning_rat = 1.0  # base configs are locked
  with c.unlocked():
    c.train.bogus = 1
  with pytest.raises(schema.ConfigError, match=r"config\.train\.bogus: unknown key"):
    schema.validate(c)
  argv = ["prog", f"--config={ROOT}/configs/mqar.py:smoke", "--config.optim.bogus=3"]
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, flag_values=fv, lock_config=True, sys_argv=argv)
  with pytest.raises(
    AttributeError, match="bogus"
  ):  # the locked config refuses the key (not an unknown flag)
    fv(argv)
  c = tiny_config(kind="token_file", train_path=str(tmp_path / "missing.npy"))
  with pytest.raises(
    FileNotFoundError,
    match=r"train_path: data file not found: .*missing.npy.*make one with "
    r"`python -m experiments.data.make_token_file .*missing.npy`.*experiments.data.prepare",
  ):
    trainer.Trainer(c, str(tmp_path / "w"))


def test_cli_config_mistakes_are_one_line_with_one_exit_code(tmp_path):
  """Config file, config-arg and key mistakes: exit code 2 and a single 'Config error:' line naming the bad
  token and the valid choices (no traceback), before jax is even imported."""
  env = one_device_env()
  flagfile = tmp_path / "bad.flags"
  flagfile.write_text("--config=configs/nosuch.py:smoke\n")
  cases = [
    (
      ["--config=configs/nosuch.py"],
      r"no config file 'configs/nosuch.py'; available: .*configs/mqar.py",
    ),
    (
      [f"--flagfile={flagfile}"],
      r"no config file 'configs/nosuch.py' \(in 'configs/nosuch.py:smoke'\)",
    ),
    (
      ["--config=configs/mqar.py:smok"],
      r"configs/mqar.py:smok: unknown preset 'smok'; valid presets: smoke, "
      "default",
    ),
    (
      ["--config=configs/mqar.py:smoke,nosuchmixer", "--config.train.num_steps=2"],
      r"unknown token 'nosuchmixer'; .* mixer \(kdn_diag, .*\) and one initial state \(zero, .*tbtt\)",
    ),
    (["--config=configs/mqar.py:smoke,gla,kda"], r"more than one mixer \(gla, kda\)"),
    (
      ["--config=configs/mqar.py:smoke", "--config.optim.learning_rat=1"],
      r"unknown config key 'config.optim.learning_rat'",
    ),
    (
      ["--config=configs/mqar.py:smoke", "--config.train.num_steps=abc"],
      r"--config.train.num_steps=abc: ValueError: invalid literal",
    ),
  ]
  procs = [
    subprocess.Popen(
      [sys.executable, "-m", "experiments.train", *args, f"--workdir={tmp_path}/w"],
      cwd=ROOT,
      env=env,
      text=True,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
    )
    for args, _ in cases
  ]
  for p, (args, pattern) in zip(procs, cases):
    out, err = p.communicate(timeout=120)
    assert p.returncode == 2, (args, err[-2000:])
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Config error: "), (args, err[-2000:])
    assert re.search(pattern, lines[0]), (args, lines[0])
  assert not os.path.exists(tmp_path / "w")  # nothing was built


def test_cli_end_to_end(tmp_path):
  """The absl app: config file + overrides, outputs in the workdir; an unknown key fails naming it."""
  env = one_device_env()
  wd = tmp_path / "cli"
  # configs/mqar.flags (the committed flags file) then overrides: later flags win
  cmd = [
    sys.executable,
    "-m",
    "experiments.train",
    "--flagfile=configs/mqar.flags",
    f"--workdir={wd}",
    "--config.train.num_steps=3",
    "--config.train.log_every=1",
    "--config.data.eval_batch_size=8",
    "--config.train.eval_batches=1",
    "--config.model.num_layers=1",
    "--config.data.seq_len=32",
    "--config.data.global_batch_size=4",
    "--config.data.mqar.num_kv_pairs=4",
  ]
  r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "step 3/3" in r.stdout and "val accuracy" in r.stdout
  for f in ("metrics.jsonl", "summary.json", "loss.png", "tb"):
    assert os.path.exists(wd / f), f
  summary = json.load(open(wd / "summary.json"))
  assert summary["status"] == "completed"
  assert "first step done in" in r.stdout
  assert summary["steady_tokens_per_s"] > summary["tokens_per_s"] > 0  # compile excluded
  # model FLOPs: the count of the run's model, the steady tokens/s as TFLOP/s; no peak for a CPU
  from kdn_jax.models import flops  # pylint: disable=g-import-not-at-top

  run_cfg = json.load(open(wd / "config.json"))
  want = flops.flops_per_token(run_cfg["model"], run_cfg["data"]["seq_len"])["train"]
  assert summary["model_flops_per_token"] == pytest.approx(want)
  assert summary["steady_tflops_per_s_per_device"] == pytest.approx(
    summary["steady_tokens_per_s"] * want / 1e12
  )
  assert summary["device_kind"] == "cpu" and summary["mfu"] is None
  assert re.search(r"step 3/3 .*k tok/s .*TFLOP/s/device \| MFU n/a", r.stdout), r.stdout
  r = subprocess.run(
    cmd[:5] + ["--config.train.nonsense=1"],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert r.returncode == 2 and "nonsense" in r.stderr


@pytest.mark.parametrize(
  "flagfile", sorted(glob.glob(os.path.join(ROOT, "configs", "*.flags"))), ids=os.path.basename
)
def test_committed_flags_files_parse_to_valid_configs(flagfile):
  """Every configs/*.flags file parses (config file, arg, overrides) into a config that validates on 8
  devices, and none writes into the README quick start's workdir (a flags run would resume that run)."""
  argv = ["prog", f"--flagfile={flagfile}"]
  fv = flags.FlagValues()
  # sys_argv: config_flags reads the --config.* overrides from it, not from the argv parsed
  config_flags.DEFINE_config_file("config", None, flag_values=fv, lock_config=True, sys_argv=argv)
  flags.DEFINE_string("workdir", None, "", flag_values=fv)
  cwd = os.getcwd()
  os.chdir(
    ROOT
  )  # flags files name configs/ relative to the repository root, as the README runs them
  try:
    fv(argv)
    config = fv.config
  finally:
    os.chdir(cwd)
  schema.check_mesh(schema.validate(config), 8)
  readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
  readme_workdirs = set(re.findall(r"--workdir=(\S+)", readme))
  assert "/tmp/kdn_mqar_smoke" in readme_workdirs
  assert fv.workdir and fv.workdir not in readme_workdirs, fv.workdir


def _two_processes(*args, timeout=300):
  """Runs tests/multihost_train_process.py as jax.distributed processes 0 and 1 (each with one CPU
  device) on a free coordinator port; returns [(returncode, stdout, stderr)] per process."""
  import portpicker  # pylint: disable=g-import-not-at-top

  port = str(portpicker.pick_unused_port())
  env = one_device_env()
  script = os.path.join(ROOT, "tests", "multihost_train_process.py")
  procs = [
    subprocess.Popen(
      [sys.executable, script, str(i), port, *args],
      cwd=ROOT,
      env=env,
      text=True,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
    )
    for i in range(2)
  ]
  outs = []
  for p in procs:
    try:
      out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
    outs.append((p.returncode, out, err))
  return outs


def test_two_process_training_survives_a_kill(tmp_path):
  """2 jax.distributed CPU processes: host-side parameter init gives each its shards; a training run is
  SIGKILLed on both hosts mid-run (after an unsaved, logged step) and rerun: it resumes from the last
  checkpoint with the uninterrupted run's losses (one row per step), until SIGTERM on one host only
  stops both at one agreed step, with a checkpoint there."""
  n = 12
  first = _two_processes(str(tmp_path), "first")
  for i, (rc, out, err) in enumerate(first):
    assert rc == -signal.SIGKILL, (
      i,
      rc,
      err[-3000:],
    )  # killed in workdir b, after finishing workdir a
    assert f"status completed {n}" in out, (i, out[-2000:])
  assert [s for s, _ in _train_rows(tmp_path / "b")] == [
    1,
    2,
    3,
    4,
    5,
  ]  # step 5: logged, never saved

  second = _two_processes(str(tmp_path), "resume")
  stops = []
  for i, (rc, out, err) in enumerate(second):
    assert rc == 0, (i, err[-3000:])
    stops += re.findall(r"^status preempted (\d+)$", out, re.M)
  assert "Resumed from checkpoint at step 4" in second[0][1]
  assert len(stops) == 2 and stops[0] == stops[1], stops  # both stopped, at the same step
  stop = int(stops[0])
  assert 6 <= stop < n and os.path.isdir(tmp_path / "b" / "checkpoints" / str(stop)), stop
  ra, rb = _train_rows(tmp_path / "a"), _train_rows(tmp_path / "b")
  assert [s for s, _ in ra] == list(range(1, n + 1))
  assert rb == ra[:stop], (ra, rb)  # bit-equal losses, step 5 not repeated


def test_training_agrees_across_fast_paths(tmp_path):
  """The same short training run through impl='reference', 'chunked' and 'pallas' (interpret mode on CPU):
  the Pallas kernels really run (pallas_call in the traced model) and the losses agree step by step."""
  one = jax.devices()[:1]
  losses, jaxprs = {}, {}
  for impl in ("reference", "chunked", "pallas"):
    c = tiny_config(
      layer_pattern="kdn_diag"
    )  # attention takes no impl: one KDN layer keeps compiles short
    c.model.num_layers = 1
    c.model.impl = impl
    c.model.head_dim = c.model.chunk_size = (
      16  # sizes the kernels take (multiples of their 16-row blocks)
    )
    c.data.seq_len = 32
    c.mesh.data = 1
    tr = trainer.Trainer(c, str(tmp_path / impl), devices=one)
    batches = [next(tr.data_iter) for _ in range(3)]
    jaxprs[impl] = str(
      jax.make_jaxpr(lambda p, x: tr.merge(p, tr.rest)(x)[0])(
        tr.state["params"], batches[0]["inputs"]
      )
    )
    losses[impl] = [float(tr.train_step(b)["loss"]) for b in batches]
    tr.close()
  assert "pallas_call" in jaxprs["pallas"]
  assert "pallas_call" not in jaxprs["chunked"] and "pallas_call" not in jaxprs["reference"]
  assert losses["reference"][0] != losses["reference"][-1]  # training moved the parameters
  for impl in ("chunked", "pallas"):
    np.testing.assert_allclose(
      losses[impl], losses["reference"], rtol=2e-5, atol=2e-5, err_msg=impl
    )


def test_loss_positions_gives_the_same_loss_gradients_and_accuracy(tmp_path):
  """train.loss_positions reads the logits only at the scored positions: the same loss, gradients and
  validation numbers as every position; too few positions for the data is an error naming the key."""
  # One persistent XLA cache: the three Trainers build the same model (its init compiles once).
  results = []
  for count in (0, 2):  # tiny_config's MQAR rows score num_kv_pairs = 2 positions
    c = tiny_config()
    c.train.loss_positions = count
    tr = trainer.Trainer(c, str(tmp_path / f"p{count}"))
    batch = sharding.global_batch(next(tr.data_iter), tr.mesh)
    # jitted: one compile instead of op-by-op eager dispatch of the whole model and its backward pass.
    (loss, aux), grads = jax.jit(jax.value_and_grad(tr._loss_fn, has_aux=True))(
      tr.state["params"], tr.rest, batch, tr.state, jax.random.PRNGKey(0)
    )
    results.append((float(loss), float(aux["accuracy"]), host(grads), tr.evaluate()))
    assert float(aux["dropped"]) == 0.0
    tr.close()
  (l0, a0, g0, e0), (l1, a1, g1, e1) = results
  np.testing.assert_allclose(l1, l0, rtol=1e-6)
  assert a1 == a0 and e1["accuracy"] == e0["accuracy"]
  np.testing.assert_allclose(e1["loss"], e0["loss"], rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  c = tiny_config()
  c.train.loss_positions = 1
  with pytest.raises(
    schema.ConfigError, match=r"config\.train\.loss_positions: 1 is below the 2 scored"
  ):
    schema.validate(c)
  # Data whose rows score more positions than loss_positions stops training at the next log point.
  c = tiny_config()
  c.data.kind, c.data.seq_len = "copying", 16
  c.data.copying.copy_len = 7  # BOS x SEP x: 7 scored positions a row
  c.train.loss_positions = 4
  tr = trainer.Trainer(c, str(tmp_path / "copy"))
  with pytest.raises(
    ValueError, match=r"loss_positions=4: step 1 has rows with more scored positions"
  ):
    tr.run()
  tr.close()


def test_context_growth_names_what_was_added():
  """The first-step check: silent when jit's tracing context kept its size, else a warning that
  names the added values and the modules imported meanwhile (the step-2 recompile on GPUs)."""
  now = tracing.tracing_context()
  assert now[0] > 0 and (now[1] is None or now[0] == len(now[1]))
  assert tracing.context_growth(now, now) is None
  later = (
    now[0] + 1,
    None if now[1] is None else now[1] + ("some_new_context",),
    now[2] | {"some_plugin.lowering", "experiments.local"},
  )
  msg = tracing.context_growth(now, later)
  assert f"{now[0]} -> {now[0] + 1} values" in msg
  assert "some_plugin.lowering" in msg and "experiments.local" not in msg
  if now[1] is not None:
    assert "['some_new_context']" in msg
  assert "compiled again" in msg
