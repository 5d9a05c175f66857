"""experiments/runner/kernel_config.py: kernel option specs in a run config (config.kernels) are checked
by validate, naming the key, and applied as the kernels' defaults."""

import pytest

from configs import mqar
from experiments.runner import config_lib, kernel_config
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
  with pytest.raises(config_lib.ConfigError, match=match):
    config_lib.validate(config)


def test_applied_sets_the_package_defaults_with_the_specs_and_restores():
  config = mqar.get_config("smoke")
  with dr_config.overridden(block_v=32):  # a process's own setting (a test, a script)
    before = dr_config.DEFAULT, gain_config.DEFAULT, conv_config.DEFAULT
    assert kernel_config.apply(config) is None  # no spec: nothing changes
    assert (dr_config.DEFAULT, gain_config.DEFAULT, conv_config.DEFAULT) == before
    config.kernels.delta_rule = "bf16_states=0/num_stages=2"
    config.kernels.gain = "num_stages_fwd=2"
    config.kernels.conv = "load_block=2"
    config_lib.validate(config)
    with kernel_config.applied(config):
      d, g, c = dr_config.DEFAULT, gain_config.DEFAULT, conv_config.DEFAULT
      assert (d.bf16_states, d.num_stages, g.num_stages_fwd, c.load_block) == (False, 2, 2, 2)
      # the run config alone decides: the package default, not the process's block_v=32
      assert d.block_v == dr_config.DeltaRuleConfig().block_v != 32
    assert (dr_config.DEFAULT, gain_config.DEFAULT, conv_config.DEFAULT) == before


def test_configs_without_the_key_apply_nothing():
  """A run config written before config.kernels existed (evaluate loads those too)."""
  config = mqar.get_config("smoke")
  plain = {k: v for k, v in config.to_dict().items() if k != "kernels"}
  import ml_collections  # pylint: disable=g-import-not-at-top

  assert kernel_config.apply(ml_collections.ConfigDict(plain)) is None


def test_configs_before_the_conv_key_apply_their_specs():
  """A session-42 run config: config.kernels without 'conv' (the conv keeps its package default)."""
  import ml_collections  # pylint: disable=g-import-not-at-top

  config = ml_collections.ConfigDict(dict(kernels=dict(delta_rule="num_stages=2", gain="")))
  saved = conv_config.DEFAULT
  try:
    conv_config.DEFAULT = conv_config.ConvConfig(load_block=3)
    with kernel_config.applied(config):
      assert dr_config.DEFAULT.num_stages == 2
      assert conv_config.DEFAULT == conv_config.ConvConfig()
    assert conv_config.DEFAULT.load_block == 3
  finally:
    conv_config.DEFAULT = saved


def test_flags_set_the_defaults_and_name_the_bad_item(monkeypatch):
  from absl import flags  # pylint: disable=g-import-not-at-top

  for mod in (dr_config, gain_config, conv_config):
    monkeypatch.setattr(mod, "DEFAULT", mod.DEFAULT)  # restored after the test
  fv = flags.FlagValues()
  kernel_config.define_flags(fv)
  fv(["prog", "--conv_config=load_block=4", "--gain_config=num_stages_bwd=2"])
  got = kernel_config.apply_flags(fv)
  assert conv_config.DEFAULT.load_block == 4 and gain_config.DEFAULT.num_stages_bwd == 2
  assert "load_block=4" in got["conv_config"]
  fv.delta_rule_config = "block_v=48"
  before = conv_config.DEFAULT
  fv.conv_config = "load_block=8"
  with pytest.raises(ValueError, match="--delta_rule_config item"):
    kernel_config.apply_flags(fv)
  assert conv_config.DEFAULT is before  # nothing set when one spec is bad


def test_gain_config_checks_its_fields():
  with pytest.raises(ValueError, match="GainConfig.num_warps must be a power of two"):
    gain_config.GainConfig(num_warps=3)
  with pytest.raises(ValueError, match="GainConfig.num_stages_fwd must be >= 1"):
    gain_config.GainConfig(num_stages_fwd=0)


def test_removed_fields_of_earlier_runs_are_dropped(caplog):
  """A session-42 run's config.kernels.delta_rule='cumsum_in_gain=1/...' (the option is gone):
  validated and applied without it, with a warning, so that run still resumes and evaluates."""
  config = mqar.get_config("smoke")
  config.kernels.delta_rule = "cumsum_in_gain=1/num_stages=2"
  config_lib.validate(config)
  with kernel_config.applied(config):
    assert dr_config.DEFAULT.num_stages == 2
  assert "cumsum_in_gain=1" in caplog.text
  config.kernels.delta_rule = "cumsum_in_gain=0"  # only a removed field: nothing to apply
  assert kernel_config.apply(config) is None
  # session 41's fused-step trials, removed in session 44
  config.kernels.delta_rule = "prefetch_output_rows=0/output_after_update=1/block_v=32"
  config_lib.validate(config)
  with kernel_config.applied(config):
    assert dr_config.DEFAULT.block_v == 32
  assert "output_after_update=1" in caplog.text
