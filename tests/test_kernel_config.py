"""experiments/kernel_config.py: kernel option specs in a run config (config.kernels) are checked
by validate, naming the key, and applied as the kernels' defaults."""
import pytest

from experiments import config_lib
from experiments import kernel_config
from pallas_kernels.delta_rule import config as dr_config
from pallas_kernels.kdn_gain import config as gain_config
from configs import mqar


@pytest.mark.parametrize("key,spec,match", [
    ("delta_rule", "cumsum_in_gain=maybe", "config.kernels.delta_rule item 'cumsum_in_gain=maybe'"),
    ("delta_rule", "no_such_field=1", "expected field=value with field in"),
    ("delta_rule", "block_v=48", "DeltaRuleConfig.block_v must be a power of two"),
    ("gain", "num_warps=two", "config.kernels.gain item 'num_warps=two': expected an integer"),
])
def test_validate_names_the_bad_spec(key, spec, match):
  config = mqar.get_config("smoke")
  config.kernels[key] = spec
  with pytest.raises(config_lib.ConfigError, match=match):
    config_lib.validate(config)


def test_apply_sets_the_kernel_defaults():
  config = mqar.get_config("smoke")
  d_before, g_before = dr_config.DEFAULT, gain_config.DEFAULT
  assert kernel_config.apply(config) == (None, None)   # '' leaves the defaults alone
  assert dr_config.DEFAULT is d_before and gain_config.DEFAULT is g_before
  config.kernels.delta_rule = "cumsum_in_gain=1/num_stages=2"
  config.kernels.gain = "num_stages_fwd=2"
  config_lib.validate(config)
  try:
    d, g = kernel_config.apply(config)
    assert dr_config.DEFAULT is d and gain_config.DEFAULT is g
    assert (d.cumsum_in_gain, d.num_stages, g.num_stages_fwd) == (True, 2, 2)
    assert d.block_v == d_before.block_v   # the other fields: the defaults it started from
  finally:
    dr_config.DEFAULT, gain_config.DEFAULT = d_before, g_before


def test_configs_without_the_key_apply_nothing():
  """A run config written before config.kernels existed (evaluate loads those too)."""
  config = mqar.get_config("smoke")
  plain = {k: v for k, v in config.to_dict().items() if k != "kernels"}
  import ml_collections   # pylint: disable=g-import-not-at-top
  assert kernel_config.apply(ml_collections.ConfigDict(plain)) == (None, None)
