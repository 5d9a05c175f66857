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


def check_info_scale_override(config, value) -> str:
  """``value`` as the model's ``info_scale`` for a run whose KDN layers keep mu fixed (a learned mu is a
  parameter: overriding it would change the parameters, not only mu)."""
  from kdn_jax.layers.kdn_mixer import INFO_SCALES, resolve_info_scale  # pylint: disable=g-import-not-at-top
  from kdn_jax.models.config import layer_mixers  # pylint: disable=g-import-not-at-top
  m = config.model
  if not any(x in ('kdn_diag', 'kdn_iso') for x in layer_mixers(m)):
    raise ValueError(f'--override_info_scale: the run has no KDN layer (mixers {sorted(set(layer_mixers(m)))})')
  if str(m.get('info_scale', 'k')) == 'learned':
    raise ValueError('--override_info_scale: the run learned mu (a parameter per head); the fixed-weight '
                     'probe needs a run trained with a fixed mu')
  text = str(value).strip().lower()
  if text not in INFO_SCALES:
    try:
      text = repr(float(text))  # as model_config keeps a number
    except ValueError:
      pass
  try:
    if text == 'learned' or resolve_info_scale(text, int(m.head_dim)) is None:
      raise ValueError
  except ValueError:
    raise ValueError(f'--override_info_scale: expected one of {[x for x in INFO_SCALES if x != "learned"]} or '
                     f'a positive number, got {value!r}') from None
  return text


def load(workdir: str, step: int | None = None, model_overrides: dict | None = None) -> EvalRun:
  """The run's model at ``step`` (latest: None). ``model_overrides``: model config keys replaced before the
  model is built (only ``info_scale``: mu, which is no parameter when fixed), the parameters unchanged."""
  root, step = find(workdir, step)
  record = ckpt_lib.Checkpointer(root, async_save=False).record(step)
  config = _config_from(record, workdir)
  for key, value in (model_overrides or {}).items():
    if key != 'info_scale':
      raise ValueError(f'model_overrides: only info_scale can be overridden, got {key!r}')
    config.model.info_scale = check_info_scale_override(config, value)
  cls = config_lib.import_object(config.model_factory)
  model = cls(config.model, rngs=nnx.Rngs(int(config.seed)))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                          nnx.to_pure_dict(params))
  restored, _ = ckpt_lib.restore_params(os.path.join(root, str(step)), abstract)
  nnx.replace_by_pure_dict(params, restored)
  return EvalRun(workdir, config, nnx.merge(graphdef, params, rest), step, os.path.join(root, str(step)))
