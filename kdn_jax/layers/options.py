"""The model config's keys and their defaults, written once: ``model_config`` starts from them, and
every reader of a key a config may lack (one saved before the key existed) goes through
:func:`option`."""

from __future__ import annotations

DEFAULTS = dict(
  vocab_size=32000,
  num_layers=2,
  d_model=64,
  num_heads=2,
  head_dim=32,
  mixer="kdn_diag",
  layer_pattern="",
  mlp_hidden=192,
  tie_embeddings=True,
  swa_window=512,
  conv_size=4,
  info_scale="k",
  noise="learned",
  chunk_size=64,
  impl="auto",
  dtype="float32",
  param_dtype="float32",
  r_min=0.01,
  norm_eps=1e-6,
  lowrank_dim=0,
  rope_theta=10000.0,
  remat=False,
  match_params=True,
  mlp_multiple=64,
  scan_layers=False,
  num_v_heads=0,
  mlp_reference=0,
  mlp_matched=0,  # set by model_config; see effective_mlp_hidden
  dt_min=1e-3,
  dt_max=1e-1,
  a_min=1.0,
  a_max=16.0,
  mamba2_variant="normalized",
)


def option(cfg, key: str):
  """``cfg[key]``, or its default when the config lacks the key."""
  return cfg.get(key, DEFAULTS[key])
