"""Model configs: size presets, validation, parameter counting and cross-mixer parameter matching.

``model_config(size, **overrides) -> ml_collections.ConfigDict``. Keys:
  vocab_size, num_layers, d_model, num_heads, head_dim, mixer, layer_pattern ('' = all `mixer`,
  else comma-separated mixer names cycled over layers, e.g. 'kdn_diag,swa'), mlp_hidden,
  tie_embeddings, swa_window, conv_size, info_scale, noise, chunk_size, impl, dtype ('float32' |
  'bfloat16' compute), param_dtype ('float32'), r_min, norm_eps, plus lowrank_dim (0 = head_dim),
  rope_theta, remat, match_params, scan_layers (run repeated layers as one lax.scan: compiles once),
  num_v_heads (the recurrent mixers' value heads, a multiple of num_heads, which then counts their
  query/key heads: grouped value heads, layers/recurrent.py; 0 = num_heads; attention ignores it),
  dt_min, dt_max, a_min, a_max (every mixer's Decay initialisation: dt ~ logU(dt_min, dt_max),
  A ~ U(a_min, a_max); layers/decay.py), mamba2_variant ('normalized' | 'faithful';
  layers/mamba2.py; 'official': mamba_ssm's Mamba2 block and LM, layers/mamba2_official.py and
  `official_mamba2_lm`).

mlp_hidden = 0 builds blocks without an MLP (norm -> mixer -> residual, mamba_ssm's LM with
d_intermediate = 0); the official Mamba-2 LM always has none.

Parameter matching: unless ``mlp_hidden`` is given (or match_params=False), the SwiGLU width is
re-solved so that the model's non-embedding parameter count equals that of the reference
(`kdn_diag`, default options, preset mlp_hidden) of the same size, rounded to ``mlp_multiple``.
"""

from __future__ import annotations

import functools
import math

import jax
import ml_collections
import numpy as np
from flax import nnx

from kdn_jax.layers.options import DEFAULTS, option

REFERENCE_MIXER = "kdn_diag"

# mlp_hidden is the reference (kdn_diag) width; other mixers get it re-solved.
SIZES = {
  "tiny": dict(
    vocab_size=256,
    num_layers=2,
    d_model=64,
    num_heads=2,
    head_dim=32,
    mlp_hidden=192,
    swa_window=16,
    chunk_size=16,
    mlp_multiple=1,
  ),
  "20m": dict(
    vocab_size=32000,
    num_layers=12,
    d_model=256,
    num_heads=4,
    head_dim=64,
    mlp_hidden=704,
    mlp_multiple=8,
  ),
  "30m": dict(
    vocab_size=16384,
    num_layers=6,
    d_model=512,
    num_heads=4,
    head_dim=128,
    mlp_hidden=1408,
    mlp_multiple=64,
  ),
  "125m": dict(
    vocab_size=32000,
    num_layers=12,
    d_model=768,
    num_heads=6,
    head_dim=128,
    mlp_hidden=2048,
    mlp_multiple=64,
  ),
  "350m": dict(
    vocab_size=32000,
    num_layers=24,
    d_model=1024,
    num_heads=8,
    head_dim=128,
    mlp_hidden=2752,
    mlp_multiple=64,
  ),
  "750m": dict(
    vocab_size=32000,
    num_layers=16,
    d_model=2048,
    num_heads=16,
    head_dim=128,
    mlp_hidden=4096,
    mlp_multiple=64,
  ),
  "1.3b": dict(
    vocab_size=32000,
    num_layers=18,
    d_model=2304,
    num_heads=18,
    head_dim=128,
    mlp_hidden=6144,
    mlp_multiple=64,
  ),
}

_DTYPES = ("float32", "bfloat16")


class ModelConfigError(ValueError):
  """An invalid model config value; ``key`` names it, ``msg`` says what was expected."""

  def __init__(self, key, msg):
    super().__init__(f"model config key {key!r}: {msg}")
    self.key, self.msg = key, msg


def _err(key, msg):
  return ModelConfigError(key, msg)


def layer_mixers(cfg) -> list[str]:
  """Mixer name of every layer (layer_pattern cycled; '' = all cfg.mixer)."""
  pattern = str(cfg.layer_pattern).strip()
  names = [cfg.mixer] if not pattern else [p.strip() for p in pattern.split(",")]
  return [names[i % len(names)] for i in range(int(cfg.num_layers))]


def validate_config(cfg) -> None:
  """Raises ModelConfigError naming the first invalid key."""
  from kdn_jax.layers.kdn_mixer import INFO_SCALES, NOISE_MODES, resolve_info_scale
  from kdn_jax.layers.mamba2 import MAMBA2_VARIANTS
  from kdn_jax.layers.registry import MIXERS
  from kdn_jax.ops.validation import IMPLS

  for key in (
    "vocab_size",
    "num_layers",
    "d_model",
    "num_heads",
    "head_dim",
    "conv_size",
    "chunk_size",
    "swa_window",
  ):
    v = cfg[key]
    if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
      raise _err(key, f"must be a positive int, got {v!r}")
  h = cfg.mlp_hidden
  if not isinstance(h, (int, np.integer)) or isinstance(h, bool) or h < 0:
    raise _err("mlp_hidden", f"must be an int >= 0 (0: blocks without an MLP), got {h!r}")
  if cfg.chunk_size > 16 and cfg.chunk_size % 16:
    raise _err("chunk_size", f"must be <= 16 or a multiple of 16, got {cfg.chunk_size}")
  if cfg.mixer not in MIXERS:
    raise _err("mixer", f"unknown mixer {cfg.mixer!r}; expected one of {sorted(MIXERS)}")
  pattern = str(cfg.layer_pattern).strip()
  if pattern:
    for p in pattern.split(","):
      if p.strip() not in MIXERS:
        raise _err(
          "layer_pattern",
          f"unknown mixer {p.strip()!r} in {pattern!r}; expected names from {sorted(MIXERS)}",
        )
  if any(m in ("attention", "swa") for m in layer_mixers(cfg)) and cfg.head_dim % 2:
    raise _err("head_dim", f"must be even for RoPE attention, got {cfg.head_dim}")
  try:
    resolve_info_scale(cfg.info_scale, int(cfg.head_dim))
  except ValueError:
    raise _err(
      "info_scale",
      f"got {cfg.info_scale!r}; expected one of {INFO_SCALES} or a positive finite float",
    ) from None
  if cfg.noise not in NOISE_MODES:
    raise _err("noise", f"got {cfg.noise!r}; expected one of {NOISE_MODES}")
  if cfg.dtype not in _DTYPES:
    raise _err("dtype", f"got {cfg.dtype!r}; expected one of {_DTYPES}")
  if cfg.param_dtype not in _DTYPES:
    raise _err("param_dtype", f"got {cfg.param_dtype!r}; expected one of {_DTYPES}")
  for key in ("r_min", "norm_eps", "rope_theta"):
    if not (cfg[key] > 0 and math.isfinite(cfg[key])):
      raise _err(key, f"must be > 0 and finite, got {cfg[key]}")
  num_v_heads = option(cfg, "num_v_heads")
  if (
    not isinstance(num_v_heads, (int, np.integer))
    or isinstance(num_v_heads, bool)
    or num_v_heads < 0
    or num_v_heads % cfg.num_heads
  ):
    raise _err(
      "num_v_heads",
      f"must be 0 (= num_heads) or a positive multiple of num_heads = "
      f"{cfg.num_heads}, got {num_v_heads!r}",
    )
  if cfg.lowrank_dim < 0:
    raise _err("lowrank_dim", f"must be >= 0 (0 = head_dim), got {cfg.lowrank_dim}")
  if not isinstance(option(cfg, "scan_layers"), bool):
    raise _err("scan_layers", f"must be a bool, got {cfg.scan_layers!r}")
  if cfg.impl not in IMPLS:
    raise _err("impl", f"got {cfg.impl!r}; expected one of {list(IMPLS)}")
  _check_decay(cfg)
  variant = option(cfg, "mamba2_variant")
  if variant not in MAMBA2_VARIANTS:
    raise _err("mamba2_variant", f"got {variant!r}; expected one of {list(MAMBA2_VARIANTS)}")
  _check_official(cfg)


def _check_official(cfg) -> None:
  """mamba2_variant='official' builds mamba_ssm's LM: every layer mamba2 (or none: the variant is
  then unused), d_model splitting into its heads."""
  from kdn_jax.layers.mamba2_official import inner_width

  mixers = layer_mixers(cfg)
  if option(cfg, "mamba2_variant") != "official" or "mamba2" not in mixers:
    return
  if any(m != "mamba2" for m in mixers):
    raise _err(
      "mamba2_variant",
      f"'official' is mamba_ssm's Mamba-2 LM (blocks without an MLP) and needs every layer to be "
      f"mamba2, got layers {mixers}",
    )
  try:
    inner_width(cfg.d_model)
  except ValueError as e:
    raise _err("d_model", str(e).removeprefix("d_model: ")) from None


def official_mamba2_lm(cfg) -> bool:
  """Whether the model is mamba_ssm's Mamba-2 LM (mamba2_variant='official', every layer mamba2):
  blocks without an MLP, norms with eps 1e-5, the embedding N(0, 0.02) read out tied unscaled."""
  return option(cfg, "mamba2_variant") == "official" and all(
    m == "mamba2" for m in layer_mixers(cfg)
  )


def _check_decay(cfg) -> None:
  """The decay initialisation ranges: positive finite numbers, each minimum below its maximum."""
  from kdn_jax.layers.decay import DECAY_KEYS

  vals = {k: option(cfg, k) for k in DECAY_KEYS}
  for key, v in vals.items():
    if not (
      isinstance(v, (int, float, np.integer, np.floating))
      and not isinstance(v, bool)
      and math.isfinite(v)
      and v > 0
    ):
      raise _err(key, f"must be a positive finite number, got {v!r}")
  for lo, hi in (("dt_min", "dt_max"), ("a_min", "a_max")):
    if not vals[lo] < vals[hi]:
      raise _err(lo, f"must be below {hi} = {vals[hi]:g}, got {vals[lo]:g}")


# ---------------------------------------------------------------- parameter counting ---------------
def _tree_size(tree) -> int:
  return int(sum(math.prod(x.shape) for x in jax.tree.leaves(tree)))


def _mixer_key(name, cfg):
  keys = (
    "d_model",
    "num_heads",
    "head_dim",
    "conv_size",
    "info_scale",
    "noise",
    "lowrank_dim",
    "swa_window",
    "num_v_heads",
    "mamba2_variant",
  )
  return (name,) + tuple((k, str(option(cfg, k))) for k in keys)


@functools.lru_cache(maxsize=512)
def _mixer_params_cached(key):
  from kdn_jax.layers.registry import make_mixer

  name = key[0]
  cfg = ml_collections.ConfigDict(dict(DEFAULTS))
  for k, v in key[1:]:
    cfg[k] = type(DEFAULTS[k])(v) if not isinstance(DEFAULTS[k], str) else v
  mixer = nnx.eval_shape(lambda: make_mixer(name, cfg, rngs=nnx.Rngs(0)))
  return _tree_size(nnx.state(mixer, nnx.Param))


def mixer_param_count(name: str, cfg) -> int:
  """Parameters of one mixer layer (no params are materialised)."""
  return _mixer_params_cached(_mixer_key(name, cfg))


def analytic_non_embedding(cfg, mlp_hidden=None) -> int:
  """Non-embedding params: mixers + per layer a SwiGLU (3*d*h) and 2 block norms (h = 0: no MLP
  and one norm) + final norm."""
  h = effective_mlp_hidden(cfg) if mlp_hidden is None else int(mlp_hidden)
  return _beside_mlp(cfg, with_mlp=h > 0) + int(cfg.num_layers) * 3 * int(cfg.d_model) * h


def _beside_mlp(cfg, with_mlp: bool) -> int:
  """Mixers + block norms (two per layer with an MLP, else one) + final norm."""
  d = int(cfg.d_model)
  mix = sum(mixer_param_count(m, cfg) for m in layer_mixers(cfg))
  return mix + int(cfg.num_layers) * (2 if with_mlp else 1) * d + d


def matched_mlp_hidden(cfg, reference_mlp_hidden: int) -> int:
  """SwiGLU width that makes non-embedding params equal the reference (kdn_diag, default options)."""
  ref = ml_collections.ConfigDict(cfg).copy_and_resolve_references()  # also from a FrozenConfigDict
  with ref.unlocked():
    ref.mixer, ref.layer_pattern, ref.info_scale, ref.noise = REFERENCE_MIXER, "", "k", "learned"
  target = analytic_non_embedding(ref, reference_mlp_hidden)
  d, L = int(cfg.d_model), int(cfg.num_layers)
  rest = _beside_mlp(cfg, with_mlp=True)
  ideal = (target - rest) / (3 * d * L)
  m = max(int(cfg.mlp_multiple), 1)
  return max(m, int(round(ideal / m)) * m)


def model_config(size: str = "tiny", **overrides) -> ml_collections.ConfigDict:
  from kdn_jax.layers.kdn_mixer import info_scale_text

  if size not in SIZES:
    raise ValueError(f"model size {size!r} unknown; expected one of {sorted(SIZES)}")
  for k in overrides:
    if k not in DEFAULTS:
      raise _err(k, f"unknown config key; known keys: {sorted(DEFAULTS)}")
  d = dict(DEFAULTS)
  d.update(SIZES[size])
  d.update(overrides)
  d["info_scale"] = info_scale_text(d["info_scale"])
  cfg = ml_collections.ConfigDict(d)
  validate_config(cfg)
  if cfg.match_params and "mlp_hidden" not in overrides:
    ref = SIZES[size]["mlp_hidden"]
    cfg.mlp_hidden = 0 if official_mamba2_lm(cfg) else matched_mlp_hidden(cfg, ref)
    cfg.mlp_reference, cfg.mlp_matched = ref, cfg.mlp_hidden
  return cfg


def effective_mlp_hidden(cfg) -> int:
  """The SwiGLU width the model builds.

  ``cfg.mlp_hidden``, except when model_config matched it and the config was edited afterwards
  (``--config.model.mixer=kda``, a new layer_pattern, ...) while mlp_hidden itself was left at the
  matched value: then it is re-matched for the edited config, so flag overrides keep mixers
  parameter-matched. An explicitly set mlp_hidden (any other value) is kept. The official
  Mamba-2 LM has none: 0."""
  if official_mamba2_lm(cfg):
    return 0
  ref, matched = int(option(cfg, "mlp_reference")), int(option(cfg, "mlp_matched"))
  if cfg.match_params and ref and int(cfg.mlp_hidden) == matched:
    return matched_mlp_hidden(cfg, ref)
  return int(cfg.mlp_hidden)


def resolve_mlp_hidden(cfg) -> int:
  """Writes effective_mlp_hidden back into a (mutable) model config, so that saved configs and
  summaries show the width the model has; returns it. The runner calls this at start."""
  width = effective_mlp_hidden(cfg)
  if int(option(cfg, "mlp_matched")) == int(cfg.mlp_hidden):
    cfg.mlp_matched = width
  cfg.mlp_hidden = width
  return width
