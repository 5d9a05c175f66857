"""Checkpoint integrity: array checksums verified at restore (a flipped bit or overwritten bytes that
orbax restores silently are set aside like an unreadable checkpoint), a full disk during a save (one
line, non-zero exit, the workdir resumes), and a stale summary.json repaired by a rerun."""

from __future__ import annotations

import glob
import json
import os
import shutil

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from runner_helpers import ROOT, run_one_device, tiny_config

from experiments import schema
from experiments.runner import array_checksum, trainer
from experiments.runner import checkpoint as ckpt_lib


def _state(seed):
  """A train-state-like tree of every dtype a train state holds."""
  k = jax.random.split(jax.random.PRNGKey(seed), 3)
  return {
    "params": {"w": jax.random.normal(k[0], (48, 40)), "b": jax.random.normal(k[1], (40,))},
    "opt_state": {
      "nu": jnp.abs(jax.random.normal(k[2], (48, 40))) * 1e-3,
      "count": jnp.asarray(seed, jnp.int32),
    },
    "rng": jax.random.PRNGKey(seed + 7),
    "flag": jnp.asarray(True),
    "half": jnp.ones((8,), jnp.bfloat16),
  }


def _iterator():
  return iter(grain.MapDataset.range(64).batch(4).to_iter_dataset())


def _abstract(state):
  dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=dev), state)


def _data_files(step_dir):
  return sorted(
    glob.glob(os.path.join(step_dir, "state", "**", "d", "*"), recursive=True), key=os.path.getsize
  )


def _silent_bit_flip(step_dir, original):
  """Flips one bit of the largest array data file where orbax restores without an error but with other
  values (found by trying: most positions are such); returns the keys of the arrays it changed."""
  path = _data_files(step_dir)[-1]
  data = open(path, "rb").read()
  for pos in range(len(data) // 3, len(data), max(len(data) // 40, 1)):
    flipped = bytearray(data)
    flipped[pos] ^= 0x10
    with open(path, "wb") as f:
      f.write(bytes(flipped))
    try:
      got = ocp.PyTreeCheckpointer().restore(os.path.join(step_dir, "state"))
    except Exception:  # pylint: disable=broad-except  (detected by orbax itself: try another position)
      continue
    changed = [
      k
      for k, v in original.items()
      if not np.array_equal(np.asarray(got[k]), np.asarray(v), equal_nan=True)
    ]
    if changed:
      return changed
  raise AssertionError(
    "no bit flip restored silently: orbax now detects them (keep the test meaningful)"
  )


@pytest.mark.parametrize("how", ["bit_flip", "garbage"])
def test_damaged_array_data_is_set_aside(tmp_path, capsys, how):
  """A step whose array bytes were damaged after the save is set aside (moved to checkpoints.unreadable/)
  and the previous step restored with its exact arrays; damaged parameters are refused as an init_from
  source too."""
  d = str(tmp_path / "checkpoints")
  states = [_state(1), _state(2)]
  ck = ckpt_lib.Checkpointer(d, keep=3, async_save=False)
  it = _iterator()
  for step, st in zip((1, 2), states):
    next(it)
    ck.save(step, st, it, {"step": step})
  ck.close()
  step_dir = os.path.join(d, "2")
  abstract = _abstract(states[0])
  if how == "bit_flip":
    changed = _silent_bit_flip(step_dir, ckpt_lib.flatten(states[1]))
    # init_from reads the parameters only: refused when the flip hit one of them, exact otherwise
    if any(k.startswith("params|") for k in changed):
      with pytest.raises(ckpt_lib.CheckpointCorruptError, match="differ from their saved checksum"):
        ckpt_lib.restore_params(step_dir, abstract["params"])
    else:
      got, _ = ckpt_lib.restore_params(step_dir, abstract["params"])
      for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(states[1]["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  else:  # 64 random bytes over the middle of the largest data file
    path = _data_files(step_dir)[-1]
    with open(path, "r+b") as f:
      f.seek(os.path.getsize(path) // 2)
      f.write(np.random.default_rng(0).bytes(64))
  ck = ckpt_lib.Checkpointer(d, keep=3, async_save=False)
  step, restored, record = ck.restore_latest(abstract, _iterator())
  ck.close()
  assert step == 1 and record["step"] == 1
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(states[0])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  err = capsys.readouterr().err
  assert f"Checkpoint step 2 in {d} is unreadable" in err, err
  if how == "bit_flip":
    assert "CheckpointCorruptError" in err and "differ from their saved checksum" in err, err
  assert os.path.isdir(f"{d}.unreadable/2") and not os.path.exists(step_dir)


def test_checksums_are_sharding_independent_and_see_every_bit():
  """The same array on one device and over 8 (sharded rows) has one checksum; any one flipped bit, and two
  swapped words, change it; every dtype of a train state is covered."""
  x = jax.random.normal(jax.random.PRNGKey(0), (16, 24))
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
  sharded = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d")))
  one = array_checksum.checksums({"x": x})["x"]
  assert array_checksum.checksums({"x": sharded})["x"] == one
  bits = np.asarray(x).view(np.uint32).ravel()
  for i, b in [(0, 0), (100, 31), (383, 17)]:
    flipped = bits.copy()
    flipped[i] ^= np.uint32(1 << b)
    assert array_checksum.checksums({"x": flipped.view(np.float32).reshape(x.shape)})["x"] != one
  swapped = bits.copy()
  swapped[[3, 4]] = swapped[
    [4, 3]
  ]  # (the plain sum is unchanged by a swap: the weighted one sees it)
  assert (
    array_checksum.checksums({"x": swapped.view(np.float32).reshape(x.shape)})["x"][1] != one[1]
  )
  sums = array_checksum.checksums(ckpt_lib.flatten(_state(3)))
  assert set(sums) == set(ckpt_lib.flatten(_state(3))) and all(len(v) == 2 for v in sums.values())


def test_full_disk_during_a_save_is_one_line_and_resumable(tmp_path):
  """A save that cannot be written (file size limited below the checkpoint's data file, as a full disk
  fails a write): one 'Checkpoint error:' line, a non-zero exit, no partial step listed; the same command
  then trains the run to the end."""
  wd = tmp_path / "run"
  argv = [
    "--config=configs/mqar.py:smoke",
    f"--workdir={wd}",
    "--config.train.num_steps=4",
    "--config.checkpoint.every_steps=2",
    "--config.train.log_every=1",
    "--config.model.num_layers=1",
    "--config.data.seq_len=32",
    "--config.data.global_batch_size=4",
    "--config.data.mqar.num_kv_pairs=4",
    "--config.data.eval_batch_size=8",
    "--config.train.eval_batches=1",
    "--config.logging.plot=False",
    "--config.logging.tensorboard=False",
    "--config.model.impl=reference",
    "--config.model.d_model=32",
    "--config.model.head_dim=16",
    "--config.data.read_threads=1",
    "--config.data.prefetch=0",
  ]
  cases = [{"argv": argv, "fsize_limit": 20_000}, argv]
  r = run_one_device([os.path.join(ROOT, "tests", "train_cli_batch.py"), json.dumps(cases)])
  assert r.returncode == 0, r.stderr[-3000:]
  full, resumed = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
  lines = full["stderr"].strip().splitlines()
  assert full["returncode"] == 3, full["stderr"][-3000:]
  assert len(lines) == 1, full["stderr"][-3000:]
  assert lines[0].startswith(
    f"Checkpoint error: saving step 2 to {wd}/checkpoints failed: File too large"
  ), lines
  assert "rerun the same command to resume" in lines[0]
  assert resumed["returncode"] == 0, resumed["stderr"][-3000:]
  summary = json.load(open(wd / "summary.json"))
  assert summary["status"] == "completed" and summary["step"] == 4
  rows = [json.loads(line) for line in open(wd / "metrics.jsonl")]
  assert [x["step"] for x in rows if x["split"] == "train"] == [1, 2, 3, 4]  # each step once
  assert sorted(os.listdir(wd / "checkpoints")) == ["2", "4"] and not os.path.exists(
    wd / "run.lock"
  )


def test_rerun_repairs_a_stale_summary(tmp_path, capsys):
  """A run killed between its final checkpoint and summary.json: the rerun, which has nothing to train,
  rebuilds the summary from the checkpoint (the same validation numbers); a current summary is left alone."""

  def cfg():
    c = tiny_config()
    c.checkpoint.enabled = True
    c.checkpoint.every_steps = 3
    c.mesh.data = 1
    return c

  one = jax.devices()[:1]
  wd = tmp_path / "run"
  tr = trainer.Trainer(cfg(), str(wd), devices=one)
  done = tr.run()
  tr.close()
  path = wd / "summary.json"
  for stale in ({"status": "preempted", "step": 3}, None):
    if stale is None:
      os.remove(path)
    else:
      path.write_text(json.dumps(stale))
    tr = trainer.Trainer(cfg(), str(wd), devices=one)
    s = tr.run()
    tr.close()
    assert s["repaired"] and s["steps_this_run"] == 0
    fixed = json.load(open(path))
    assert fixed["status"] == "completed" and fixed["step"] == 6 and fixed["repaired"]
    assert fixed["eval"] == done["eval"], (fixed["eval"], done["eval"])
    assert fixed["train"]["loss"] == done["train"]["loss"]
    assert "Rebuilt" in capsys.readouterr().out
  before = path.read_text()
  tr = trainer.Trainer(cfg(), str(wd), devices=one)
  s = tr.run()
  tr.close()
  assert "repaired" not in s and path.read_text() == before
  # a damaged init_from source is refused by name
  c = cfg()
  c.train.init_from = str(wd)
  shutil.rmtree(wd / "checkpoints" / "6" / "state")
  with pytest.raises(schema.ConfigError, match="config.train.init_from"):
    trainer.Trainer(c, str(tmp_path / "post"), devices=one)


def test_keep_steps_survive_the_newest_n(tmp_path):
  """checkpoint.keep_steps: the listed steps stay besides the newest `keep` (a trend over training)."""
  d = str(tmp_path / "checkpoints")
  ck = ckpt_lib.Checkpointer(d, keep=1, async_save=False, keep_steps=(2, 4))
  it = _iterator()
  st = _state(1)
  for step in range(1, 7):
    next(it)
    ck.save(step, st, it, {"step": step})
  ck.close()
  kept = sorted(int(s) for s in os.listdir(d) if s.isdigit())
  assert kept == [2, 4, 6], kept
