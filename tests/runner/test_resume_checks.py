"""What a resume checks before it trusts a workdir: a checkpoint of another model or config is refused
before anything is moved or written; the data iterator's state is covered by the checkpoint's record and
must sit at its step; a record that does not read is named by its file; set-aside checkpoints, changed
seeds and a warm-up longer than the run are said; orbax's unretrieved write tasks stay quiet."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os

import grain
import jax
import jax.numpy as jnp
import pytest
from runner_helpers import tiny_config

from experiments.runner import checkpoint as ckpt_lib
from experiments.runner import trainer


def _state(seed, extra=True):
  k = jax.random.split(jax.random.PRNGKey(seed), 2)
  params = {"w": jax.random.normal(k[0], (8, 4))}
  if extra:  # a mixer with one more projection
    params["proj"] = jax.random.normal(k[1], (4, 4))
  return {"params": params, "step": jnp.asarray(seed, jnp.int32)}


def _abstract(state):
  dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=dev), state)


def _iterator():
  return iter(grain.MapDataset.range(64).batch(4).to_iter_dataset())


def _saved(d, steps=(1, 2)):
  ck = ckpt_lib.Checkpointer(d, keep=3, async_save=False)
  it = _iterator()
  for step in steps:
    next(it)
    ck.save(step, _state(step), it, {"step": step})
  ck.close()


def _listing(root):
  return sorted(os.path.relpath(os.path.join(p, f), root) for p, _, fs in os.walk(root) for f in fs)


def test_a_smaller_parameter_tree_is_refused_before_anything_moves(tmp_path):
  """A checkpoint whose arrays are a superset of the model's (another mixer with fewer parameters) is a
  changed config: refused naming the extra arrays, every checkpoint left where it was."""
  d = str(tmp_path / "checkpoints")
  _saved(d)
  before = _listing(tmp_path)
  ck = ckpt_lib.Checkpointer(d, keep=3, async_save=False)
  try:
    with pytest.raises(
      ckpt_lib.CheckpointMismatchError, match=r"1 not in this model.*params\|proj"
    ):
      ck.restore_latest(_abstract(_state(0, extra=False)), _iterator())
  finally:
    ck.close()
  assert _listing(tmp_path) == before and not os.path.exists(f"{d}.unreadable")


@pytest.mark.parametrize("how", ["edited", "unchecked"])
def test_an_edited_data_state_is_set_aside(tmp_path, capsys, how):
  """The data iterator's saved position is checked: against its checksum in the record, and (also for a
  record without one) against the step it belongs to; the step falls back like damaged arrays."""
  d = str(tmp_path / "checkpoints")
  _saved(d)
  if how == "unchecked":  # a record from before the data state had a checksum
    rec = os.path.join(d, "2", "record", "metadata")
    with open(rec, encoding="utf-8") as f:
      record = json.load(f)
    record.pop("data_checksums", None)
    with open(rec, "w", encoding="utf-8") as f:
      json.dump(record, f)
  with open(os.path.join(d, "2", "data", "process_0-of-1.json"), "w", encoding="utf-8") as f:
    json.dump({"next_index": 0}, f)
  it = _iterator()
  ck = ckpt_lib.Checkpointer(d, keep=3, async_save=False)
  step, _, record = ck.restore_latest(_abstract(_state(0)), it)
  ck.close()
  assert step == 1 and record["step"] == 1 and it.get_state() == {"next_index": 1}
  err = capsys.readouterr().err
  want = "differs from its saved checksum" if how == "edited" else "at batch 0, not at its step 2"
  assert "Checkpoint step 2" in err and want in err, err
  assert os.path.isdir(f"{d}.unreadable/2")


def test_a_garbage_record_is_named_by_its_file(tmp_path, capsys):
  d = str(tmp_path / "checkpoints")
  _saved(d)
  rec = os.path.join(d, "2", "record", "metadata")
  with open(rec, "w", encoding="utf-8") as f:
    f.write("garbage")
  with pytest.raises(ckpt_lib.CheckpointCorruptError, match=f"{rec}: not a readable checkpoint"):
    ckpt_lib.read_record(os.path.join(d, "2"))
  ck = ckpt_lib.Checkpointer(d, keep=3, async_save=False)
  step, _ = ck.latest_record()
  ck.close()
  assert step == 1 and f"{rec}: not a readable checkpoint record" in capsys.readouterr().err


def test_unretrieved_orbax_write_tasks_are_not_logged(tmp_path, caplog):
  """A failed save's sibling write tasks, collected unretrieved, log nothing (the save raised once)."""
  ckpt_lib.Checkpointer(str(tmp_path / "checkpoints"), async_save=False).close()
  src = "async def write_fragment():\n  raise ValueError('No space left on device')\n"
  scope = {}
  exec(compile(src, os.path.join(os.sep, "site", "orbax", "serialization.py"), "exec"), scope)  # pylint: disable=exec-used

  async def main():
    asyncio.get_running_loop().create_task(scope["write_fragment"]())
    await asyncio.sleep(0)

  with caplog.at_level(logging.ERROR, logger="asyncio"):
    asyncio.run(main())
    gc.collect()
  assert not [r for r in caplog.records if "never retrieved" in r.getMessage()], caplog.text


def _cfg(**model):
  c = tiny_config()
  c.checkpoint.enabled = True
  c.train.num_steps = 2
  c.mesh.data = 1
  for k, v in model.items():
    c.model[k] = v
  return c


def test_a_refused_resume_writes_nothing_and_notes_are_said_once(tmp_path, capsys):
  """Another mixer or width: refused at construction, config.json and checkpoints untouched. Another
  seed, set-aside checkpoints and a warm-up past the last step: one line each."""
  one = jax.devices()[:1]
  wd = tmp_path / "run"
  tr = trainer.Trainer(_cfg(), str(wd), devices=one)
  tr.run()
  tr.close()
  config_json, before = (wd / "config.json").read_bytes(), _listing(wd / "checkpoints")
  for change in ({"layer_pattern": "gla,attention"}, {"d_model": 48}):
    with pytest.raises(ckpt_lib.CheckpointMismatchError, match="saved by another model"):
      trainer.Trainer(_cfg(**change), str(wd), devices=one)
    assert (wd / "config.json").read_bytes() == config_json
    assert _listing(wd / "checkpoints") == before and not os.path.exists(wd / "run.lock")
  os.makedirs(wd / "checkpoints.unreadable" / "1")
  capsys.readouterr()
  c = _cfg()
  c.seed, c.train.num_steps, c.optim.warmup_steps = 5, 3, 9
  tr = trainer.Trainer(c, str(wd), devices=one)
  tr.run()
  tr.close()
  out = capsys.readouterr().out
  assert out.count("Note: config.seed=5 differs from 0") == 1, out
  assert "checkpoint(s) set aside as unreadable by an earlier run" in out, out
  assert "config.optim.warmup_steps=9 exceeds config.train.num_steps=3" in out, out
  assert json.load(open(wd / "config.json"))["seed"] == 5  # written once the run started
