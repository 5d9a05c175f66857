"""Defaults are written once: a config saved before a key existed reads the schema's default (run
config: schema.setting; model config: kdn_jax.layers.options.option), and the layers build from
it."""

from __future__ import annotations

import ml_collections
from flax import nnx

from experiments import schema
from kdn_jax.layers.mamba2 import Mamba2
from kdn_jax.layers.options import DEFAULTS, option
from kdn_jax.layers.registry import make_mixer
from kdn_jax.models.config import model_config


def test_run_config_setting_falls_back_to_the_schema():
  defaults = schema.base_config()
  assert schema.setting({"train": {}}, "train.seeds") == defaults.train.seeds
  assert schema.setting({"train": {"seeds": "0,1"}}, "train.seeds") == "0,1"
  assert schema.setting({}, "checkpoint.keep_steps") == defaults.checkpoint.keep_steps
  defaults.data.mqar.mixture = "64:4"
  assert schema.setting(defaults, "data.mqar.mixture") == "64:4"
  assert schema.base_config().data.mqar.mixture == ""  # the cached defaults stay untouched


def test_model_config_without_a_key_builds_with_its_default():
  full = model_config("tiny", mixer="mamba2")
  old = ml_collections.ConfigDict(
    {k: v for k, v in full.items() if k not in ("mamba2_variant", "rope_theta", "num_v_heads")}
  )
  assert option(old, "mamba2_variant") == DEFAULTS["mamba2_variant"] == full.mamba2_variant
  mixer = nnx.eval_shape(lambda: make_mixer("mamba2", old, rngs=nnx.Rngs(0)))
  assert isinstance(mixer, Mamba2) and mixer.variant == DEFAULTS["mamba2_variant"]
