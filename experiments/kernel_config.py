"""Pallas kernel configurations from specs: 'field=value' items joined by '/' over the fields of
pallas_kernels' DeltaRuleConfig, GainConfig or ConvConfig, e.g. 'num_stages=2/block_v=32'.
The benchmarks' --sweep / --gain_sweep / --delta_rule_config / --gain_config / --conv_config
take them, and a run config's config.kernels.delta_rule / .gain / .conv. Specs become a frozen
pallas_kernels.KernelConfigs (each family's tuned config for the device with the overrides) that
the model is built with and passes down to the ops: nothing is set globally. Every option
changes speed only, but DeltaRuleConfig.bf16_states, which rounds the saved states to bf16 for
bf16 data."""

from __future__ import annotations

import dataclasses

_BOOLS = {"1": True, "true": True, "True": True, "0": False, "false": False, "False": False}


def config_from_spec(base, spec, what="--sweep item"):
  """`base` (a config dataclass) with the overrides of `spec`; '' or 'default' gives `base`.
  A ValueError names `what` and the item when a field or value is bad."""
  if spec in ("", "default"):
    return base
  fields = {f.name: f.type for f in dataclasses.fields(base)}
  kw = {}
  for item in spec.split("/"):
    name, sep, val = item.partition("=")
    if not sep or name not in fields:
      raise ValueError(f"{what} {item!r}: expected field=value with field in {sorted(fields)}")
    typ = fields[name] if isinstance(fields[name], str) else fields[name].__name__
    if typ == "bool" and val not in _BOOLS:
      raise ValueError(f"{what} {item!r}: expected one of {sorted(_BOOLS)}")
    try:
      kw[name] = _BOOLS[val] if typ == "bool" else int(val) if typ == "int" else val
    except ValueError:
      raise ValueError(f"{what} {item!r}: expected an integer") from None
  try:
    return dataclasses.replace(base, **kw)  # (the dataclass checks the values)
  except ValueError as e:
    raise ValueError(f"{what} in {spec!r}: {e}") from None


# The families a run config and the flags name: config.kernels key = pallas_kernels.tuned family.
FAMILIES = ("delta_rule", "gain", "conv")


def _tuned(family):
  from pallas_kernels import tuned  # pylint: disable=g-import-not-at-top

  return tuned.tuned(family)


def _bundle(configs):
  from pallas_kernels import KernelConfigs  # pylint: disable=g-import-not-at-top

  return KernelConfigs(**configs)


def resolve(specs, what="config.kernels"):
  """A pallas_kernels.KernelConfigs from specs (a mapping family -> spec; a missing key is ''):
  each family with a spec is its tuned config for this device with the overrides, the others None
  (tuned); None when every spec is empty. Raises a ValueError naming what.<family> and the item
  (also for an option that no longer exists: docs/decisions.md gives each one's measurement)."""
  specs = {key: specs.get(key, "") or "" for key in FAMILIES}
  if not any(s not in ("", "default") for s in specs.values()):
    return None
  return _bundle(
    {
      key: config_from_spec(_tuned(key), spec, f"{what}.{key} item")
      for key, spec in specs.items()
      if spec not in ("", "default")
    }
  )


def model_kwargs(config):
  """The keyword arguments a run's model factory gets for config.kernels: {'kernel_config':
  KernelConfigs} with any spec, else {} (the kernels' tuned configs; also for configs older than
  the key and factories that take no kernel configs)."""
  kernels = resolve(config.get("kernels") or {})
  return {} if kernels is None else {"kernel_config": kernels}


# Benchmarks and GPU checks: the same specs as flags (--delta_rule_config, ...).


def define_flags(flag_values):
  """--delta_rule_config, --gain_config, --conv_config on `flag_values`: overrides of the
  kernels' tuned configs for the script's calls (from_flags builds them)."""
  from absl import flags  # pylint: disable=g-import-not-at-top

  for key, cls in zip(FAMILIES, ("DeltaRuleConfig", "GainConfig", "ConvConfig")):
    flags.DEFINE_string(
      f"{key}_config",
      "",
      f"{cls} overrides for the Pallas kernels, "
      "'field=value/field=value' (the mixers benchmark's --sweep syntax); '' = the "
      "tuned config",
      flag_values=flag_values,
    )


def from_flags(flag_values):
  """The KernelConfigs of define_flags' flags: every family (delta_rule, gain, conv) its tuned
  config with the flag's overrides, norm and decode tuned. A ValueError names the flag and
  item."""
  return _bundle(
    {
      key: config_from_spec(
        _tuned(key), getattr(flag_values, f"{key}_config"), f"--{key}_config item"
      )
      for key in FAMILIES
    }
  )


def describe(kernels):
  """{'<family>_config': repr of the config each family runs with} (for results JSON);
  kernels: a KernelConfigs or None (tuned)."""
  return {
    f"{key}_config": repr(_tuned(key) if kernels is None else kernels.get(key)) for key in FAMILIES
  }
