"""Restores a trained run for evaluation: its config (from the checkpoint record, else config.json) and
parameters (one checkpoint, the latest by default), as an NNX model on one device."""
from __future__ import annotations

import dataclasses
import json
import os

import jax
import ml_collections
from flax import nnx

from experiments.runner import checkpoint as ckpt_lib
from experiments.runner import config_lib


@dataclasses.dataclass
class EvalRun:
  workdir: str
  config: ml_collections.ConfigDict
  model: nnx.Module
  step: int
  checkpoint: str  # the step directory the parameters came from


def _config_from(record: dict, workdir: str) -> ml_collections.ConfigDict:
  cfg = record.get('config')
  if cfg is None:
    path = os.path.join(workdir, 'config.json')
    if not os.path.exists(path):
      raise FileNotFoundError(f'--workdir: {workdir!r} has no run config (config.json or a checkpoint record '
                              'with one); was it written by experiments.train?')
    with open(path, encoding='utf-8') as f:
      cfg = json.load(f)
  return ml_collections.ConfigDict(cfg)


def find(workdir: str, step: int | None = None) -> tuple[str, int]:
  """(checkpoints dir, step) of a run; ``step`` None = latest. Clear errors name the flag."""
  try:
    root, latest = ckpt_lib.find_checkpoint(workdir)
  except FileNotFoundError as e:
    raise FileNotFoundError(f'--workdir: {e}') from e
  if step is None:
    return root, latest
  if not os.path.isdir(os.path.join(root, str(step), 'state')):
    have = sorted(int(s) for s in os.listdir(root) if s.isdigit())
    raise FileNotFoundError(f'--step: no checkpoint for step {step} in {root} (have {have})')
  return root, step


def load(workdir: str, step: int | None = None) -> EvalRun:
  root, step = find(workdir, step)
  record = ckpt_lib.read_record(os.path.join(root, str(step)))
  config = _config_from(record, workdir)
  cls = config_lib.import_object(config.model_factory)
  model = cls(config.model, rngs=nnx.Rngs(int(config.seed)))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                          nnx.to_pure_dict(params))
  restored, _ = ckpt_lib.restore_params(os.path.join(root, str(step)), abstract)
  nnx.replace_by_pure_dict(params, restored)
  return EvalRun(workdir, config, nnx.merge(graphdef, params, rest), step, os.path.join(root, str(step)))
