"""Pallas kernel configurations from specs: 'field=value' items joined by '/' over the fields of
pallas_kernels' DeltaRuleConfig or GainConfig, e.g. 'fuse_output=all/num_stages=2'. The
benchmarks' --sweep / --gain_sweep / --delta_rule_config take them, and a run config's
config.kernels.delta_rule / config.kernels.gain (applied by the Trainer and by evaluate before
anything is traced). Every option is exact; they change speed only."""
from __future__ import annotations

import contextlib
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
    return dataclasses.replace(base, **kw)   # (the dataclass checks the values)
  except ValueError as e:
    raise ValueError(f"{what} in {spec!r}: {e}") from None


def _modules():
  from pallas_kernels.delta_rule import config as dcfg  # pylint: disable=g-import-not-at-top
  from pallas_kernels.kdn_gain import config as gcfg  # pylint: disable=g-import-not-at-top
  return dcfg, gcfg


def resolve(delta_rule="", gain="", what="config.kernels"):
  """(DeltaRuleConfig, GainConfig): the package defaults with the specs' overrides, or
  (None, None) when both specs are empty. Raises ValueError naming what.delta_rule / what.gain."""
  if not delta_rule and not gain:
    return None, None
  dcfg, gcfg = _modules()
  d = config_from_spec(dcfg.DeltaRuleConfig(), delta_rule, f"{what}.delta_rule item")
  g = config_from_spec(gcfg.GainConfig(), gain, f"{what}.gain item")
  return d, g


def apply(config):
  """A run config's config.kernels as the kernels' defaults: with any spec, both configs are set
  to the package defaults with its overrides (the run config alone decides them); without any
  (or in configs older than the key) nothing changes. Returns what restore() needs to put the
  previous defaults back, or None when nothing changed."""
  kernels = config.get("kernels") or {}
  d, g = resolve(kernels.get("delta_rule", ""), kernels.get("gain", ""))
  if d is None:
    return None
  dcfg, gcfg = _modules()
  previous = (dcfg.DEFAULT, gcfg.DEFAULT)
  dcfg.DEFAULT, gcfg.DEFAULT = d, g
  return previous


def restore(previous):
  """Undoes apply() (previous: its result; None: nothing to undo)."""
  if previous is not None:
    dcfg, gcfg = _modules()
    dcfg.DEFAULT, gcfg.DEFAULT = previous


@contextlib.contextmanager
def applied(config):
  """apply(config) for the block, restore() after it (also when it raises)."""
  previous = apply(config)
  try:
    yield
  finally:
    restore(previous)


# Benchmarks and GPU checks: the same specs as process-wide flags.
_FLAG_MODULES = (("delta_rule_config", "DeltaRuleConfig", "pallas_kernels.delta_rule.config"),
                 ("gain_config", "GainConfig", "pallas_kernels.kdn_gain.config"),
                 ("conv_config", "ConvConfig", "pallas_kernels.causal_conv1d.config"))


def define_flags(flag_values):
  """--delta_rule_config, --gain_config, --conv_config on `flag_values`: overrides of the
  kernels' package defaults for the whole process (apply_flags sets them)."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  for name, cls, _ in _FLAG_MODULES:
    flags.DEFINE_string(name, "", f"{cls} overrides for the Pallas kernels, 'field=value/"
                        "field=value' (benchmark_mixers' --sweep syntax); '' = the default",
                        flag_values=flag_values)


def apply_flags(flag_values):
  """Sets the package defaults from define_flags' flags; every spec is parsed (a ValueError
  naming the flag and item) before any default changes. Returns {flag: the config's repr}."""
  import importlib  # pylint: disable=g-import-not-at-top
  mods = {name: importlib.import_module(path) for name, _, path in _FLAG_MODULES}
  new = {name: config_from_spec(mod.DEFAULT, getattr(flag_values, name), f"--{name} item")
         for name, mod in mods.items()}
  for name, mod in mods.items():
    mod.DEFAULT = new[name]
  return {name: repr(cfg) for name, cfg in new.items()}
