"""Kernel configs: experiments/kernel_config.py turns specs in a run config (config.kernels)
and in flags into a frozen pallas_kernels.KernelConfigs (bad specs named by validate); the model
passes it down to its layers; pallas_kernels/tuned.py gives the tuned configs when none is given."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import pytest
from flax import nnx

from configs import mqar
from experiments import kernel_config, schema
from kdn_jax.models.config import model_config
from kdn_jax.models.lm import LanguageModel
from pallas_kernels import KernelConfigs, tuned
from pallas_kernels.causal_conv1d import config as conv_config
from pallas_kernels.delta_rule import config as dr_config
from pallas_kernels.kdn_gain import config as gain_config


@pytest.mark.parametrize(
  "key,spec,match",
  [
    ("delta_rule", "bf16_states=maybe", "config.kernels.delta_rule item 'bf16_states=maybe'"),
    ("delta_rule", "no_such_field=1", "expected field=value with field in"),
    ("delta_rule", "block_v=48", "DeltaRuleConfig.block_v must be a power of two"),
    ("gain", "num_warps=two", "config.kernels.gain item 'num_warps=two': expected an integer"),
    ("conv", "load_block=0", "config.kernels.conv item in 'load_block=0': ConvConfig.load_block"),
  ],
)
def test_validate_names_the_bad_spec(key, spec, match):
  config = mqar.get_config("smoke")
  config.kernels[key] = spec
  with pytest.raises(schema.ConfigError, match=match):
    schema.validate(config)


def test_specs_become_frozen_configs_over_the_tuned_ones():
  config = mqar.get_config("smoke")
  assert kernel_config.resolve(config.kernels) is None  # no spec: the tuned configs
  assert kernel_config.model_kwargs(config) == {}
  config.kernels.delta_rule = "bf16_states=0/num_stages=2"
  config.kernels.gain = "num_stages_fwd=2"
  config.kernels.conv = "load_block=2"
  schema.validate(config)
  got = kernel_config.resolve(config.kernels)
  d, g, c = got.delta_rule, got.gain, got.conv
  assert (d.bf16_states, d.num_stages, g.num_stages_fwd, c.load_block) == (False, 2, 2, 2)
  assert d == dataclasses.replace(tuned.tuned("delta_rule"), bf16_states=False, num_stages=2)
  assert got.norm is None and got.get("norm") == tuned.tuned("norm")
  assert hash(got) == hash(kernel_config.resolve(config.kernels))  # hashable, by value
  assert kernel_config.model_kwargs(config) == {"kernel_config": got}
  with pytest.raises(dataclasses.FrozenInstanceError):
    d.num_stages = 3


def test_configs_without_the_key_give_nothing():
  """A run config written before config.kernels existed (evaluate loads those too)."""
  config = mqar.get_config("smoke")
  plain = {k: v for k, v in config.to_dict().items() if k != "kernels"}
  assert kernel_config.model_kwargs(ml_collections.ConfigDict(plain)) == {}


def test_configs_before_the_conv_key_give_their_specs():
  """A run config with config.kernels without 'conv' (the conv keeps its tuned config)."""
  config = ml_collections.ConfigDict(dict(kernels=dict(delta_rule="num_stages=2", gain="")))
  got = kernel_config.resolve(config.kernels)
  assert got.delta_rule.num_stages == 2 and got.gain is None and got.conv is None


def test_flags_give_configs_and_name_the_bad_item():
  from absl import flags  # pylint: disable=g-import-not-at-top

  fv = flags.FlagValues()
  kernel_config.define_flags(fv)
  fv(["prog", "--conv_config=load_block=4", "--gain_config=num_stages_bwd=2"])
  got = kernel_config.from_flags(fv)
  assert got.conv.load_block == 4 and got.gain.num_stages_bwd == 2
  assert got.delta_rule == tuned.tuned("delta_rule")
  assert "load_block=4" in kernel_config.describe(got)["conv_config"]
  fv.delta_rule_config = "block_v=48"
  with pytest.raises(ValueError, match="--delta_rule_config item"):
    kernel_config.from_flags(fv)


def test_gain_config_checks_its_fields():
  with pytest.raises(ValueError, match="GainConfig.num_warps must be a power of two"):
    gain_config.GainConfig(num_warps=3)
  with pytest.raises(ValueError, match="GainConfig.num_stages_fwd must be >= 1"):
    gain_config.GainConfig(num_stages_fwd=0)


def test_a_removed_option_in_an_old_run_config_fails_in_one_line():
  """An earlier run's config.kernels naming an option that no longer exists (its measurement is
  in docs/decisions.md) fails at validation, in one line naming the family and the item."""
  config = mqar.get_config("smoke")
  config.kernels.delta_rule = "num_stages=2/cumsum_in_gain=1"
  with pytest.raises(ValueError) as e:
    schema.validate(config)
  assert "config.kernels.delta_rule item 'cumsum_in_gain=1'" in str(e.value)
  assert "\n" not in str(e.value)


def test_tuned_table_lookup():
  """One table: GPU kinds by substring, everything else the fallback; the classes' defaults are
  the measured values (the default path is what it was before the table)."""
  assert tuned._entry("NVIDIA H100 80GB HBM3") is tuned.TUNED["H100"]
  assert tuned._entry("NVIDIA H200") is tuned.TUNED["H200"]
  assert tuned._entry("cpu") is tuned.FALLBACK and tuned._entry("interpret") is tuned.FALLBACK
  assert tuned.tuned("delta_rule", interpret=True) == dr_config.DeltaRuleConfig()
  assert tuned.tuned("conv") == conv_config.ConvConfig()
  given = dr_config.DeltaRuleConfig(block_v=32)
  assert tuned.config("delta_rule", given) is given
  with pytest.raises(TypeError, match="expected a DeltaRuleConfig or None"):
    tuned.config("delta_rule", gain_config.GainConfig())
  with pytest.raises(ValueError, match="kernel family"):
    tuned.tuned("no_such_family")


def test_model_passes_its_configs_to_every_recurrent_layer():
  cfg = model_config("tiny", num_layers=3, layer_pattern="kdn_diag,swa,kda")
  kernels = KernelConfigs(conv=conv_config.ConvConfig(load_block=2))
  model = LanguageModel(cfg, rngs=nnx.Rngs(0), kernel_config=kernels)
  got = [getattr(blk.mixer, "kernel_config", "attention") for blk in model.blocks]
  assert got == [kernels, "attention", kernels]
  plain = LanguageModel(cfg, rngs=nnx.Rngs(0))
  assert plain.blocks[0].mixer.kernel_config is None
  # the configs are static: two models differing only in them have different graphdefs
  assert nnx.graphdef(model) != nnx.graphdef(plain)


def test_config_is_part_of_the_jit_cache_key():
  """A config passed as a static argument traces again when it changes (no stale trace)."""
  from pallas_kernels.causal_conv1d import causal_conv1d  # pylint: disable=g-import-not-at-top

  traces = []

  def body(x, w, c, config):
    traces.append(config)
    return causal_conv1d(x, w, c, config=config)

  conv = jax.jit(body, static_argnums=3)
  x = jnp.ones((1, 20, 1, 16), jnp.float32)
  w, c = jnp.ones((4, 1, 16), jnp.float32), jnp.zeros((1, 3, 1, 16), jnp.float32)
  a = conv(x, w, c, conv_config.ConvConfig())
  b = conv(x, w, c, conv_config.ConvConfig(load_block=1))
  conv(x, w, c, conv_config.ConvConfig())
  assert len(traces) == 2 and traces[0] != traces[1]
  assert jnp.array_equal(a, b)  # load_block changes the loads, not the values
