"""Defaults are written once: a config saved before a key existed reads the schema's default (run
config: config_lib.setting; model config: kdn_jax.layers.options.option), and the layers build from
it."""

from __future__ import annotations

import ml_collections
from flax import nnx

from experiments.runner import config_lib
from kdn_jax.layers.mamba2 import Mamba2
from kdn_jax.layers.options import DEFAULTS, option
from kdn_jax.layers.registry import make_mixer
from kdn_jax.models.config import model_config


def test_run_config_setting_falls_back_to_the_schema():
  schema = config_lib.base_config()
  assert config_lib.setting({"train": {}}, "train.seeds") == schema.train.seeds
  assert config_lib.setting({"train": {"seeds": "0,1"}}, "train.seeds") == "0,1"
  assert config_lib.setting({}, "checkpoint.keep_steps") == schema.checkpoint.keep_steps
  schema.data.mqar.mixture = "64:4"
  assert config_lib.setting(schema, "data.mqar.mixture") == "64:4"
  assert config_lib.base_config().data.mqar.mixture == ""  # the cached defaults stay untouched


def test_model_config_without_a_key_builds_with_its_default():
  full = model_config("tiny", mixer="mamba2")
  old = ml_collections.ConfigDict(
    {k: v for k, v in full.items() if k not in ("mamba2_variant", "rope_theta", "num_v_heads")}
  )
  assert option(old, "mamba2_variant") == DEFAULTS["mamba2_variant"] == full.mamba2_variant
  mixer = nnx.eval_shape(lambda: make_mixer("mamba2", old, rngs=nnx.Rngs(0)))
  assert isinstance(mixer, Mamba2) and mixer.variant == DEFAULTS["mamba2_variant"]
