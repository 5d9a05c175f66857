"""Pallas kernel configurations from specs: 'field=value' items joined by '/' over the fields of
pallas_kernels' DeltaRuleConfig, GainConfig or ConvConfig, e.g. 'fuse_output=all/num_stages=2'.
The benchmarks' --sweep / --gain_sweep / --delta_rule_config / --gain_config / --conv_config
take them, and a run config's config.kernels.delta_rule / .gain / .conv (applied by the Trainer
and by evaluate before anything is traced). Every option is exact and changes speed only, but
DeltaRuleConfig.bf16_write, which also rounds the KDN gain kappa to bf16 for bf16 data."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging

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


# The kernel families: config.kernels key, config class, its module (DEFAULT lives there).
FAMILIES = (
  ("delta_rule", "DeltaRuleConfig", "pallas_kernels.delta_rule.config"),
  ("gain", "GainConfig", "pallas_kernels.kdn_gain.config"),
  ("conv", "ConvConfig", "pallas_kernels.causal_conv1d.config"),
)


# Fields that run configs of earlier versions may name and that no longer exist (speed-only
# options removed after they lost on the GPU): dropped from config.kernels specs with a warning,
# so those runs still resume and evaluate. (Benchmark flags refuse them like any unknown field.)
REMOVED = {
  "delta_rule": (
    "cumsum_in_gain",
    "prefetch_output_rows",
    "output_after_update",
    "state_step_chunks",
  )
}


def _modules():
  return {key: importlib.import_module(path) for key, _, path in FAMILIES}


def _without_removed(key, spec, what):
  if spec in ("", "default"):
    return spec
  items = spec.split("/")
  kept = [item for item in items if item.partition("=")[0] not in REMOVED.get(key, ())]
  if len(kept) < len(items):
    logging.warning(
      "%s.%s: %s no longer exist (removed speed-only options); ignored",
      what,
      key,
      sorted(set(items) - set(kept)),
    )
  return "/".join(kept)


def resolve(specs, what="config.kernels"):
  """{family: config}: each family's package default (its class's defaults) with the overrides
  of specs[family] (a mapping; a missing key is ''; REMOVED fields are dropped), or None when
  every spec is empty. Raises a ValueError naming what.<family> and the item."""
  specs = {key: _without_removed(key, specs.get(key, "") or "", what) for key, _, _ in FAMILIES}
  if not any(specs.values()):
    return None
  mods = _modules()
  return {
    key: config_from_spec(getattr(mods[key], cls)(), specs[key], f"{what}.{key} item")
    for key, cls, _ in FAMILIES
  }


def apply(config):
  """A run config's config.kernels as the kernels' defaults: with any spec, every family is set
  to its package default with its overrides (the run config alone decides them); without any
  (or in configs older than the key) nothing changes. Returns what restore() needs to put the
  previous defaults back, or None when nothing changed."""
  new = resolve(config.get("kernels") or {})
  if new is None:
    return None
  mods = _modules()
  previous = {key: mod.DEFAULT for key, mod in mods.items()}
  for key, mod in mods.items():
    mod.DEFAULT = new[key]
  return previous


def restore(previous):
  """Undoes apply() (previous: its result; None: nothing to undo)."""
  if previous is not None:
    for key, mod in _modules().items():
      mod.DEFAULT = previous[key]


@contextlib.contextmanager
def applied(config):
  """apply(config) for the block, restore() after it (also when it raises)."""
  previous = apply(config)
  try:
    yield
  finally:
    restore(previous)


# Benchmarks and GPU checks: the same specs as process-wide flags (--delta_rule_config, ...).


def define_flags(flag_values):
  """--delta_rule_config, --gain_config, --conv_config on `flag_values`: overrides of the
  kernels' package defaults for the whole process (apply_flags sets them)."""
  from absl import flags  # pylint: disable=g-import-not-at-top

  for key, cls, _ in FAMILIES:
    flags.DEFINE_string(
      f"{key}_config",
      "",
      f"{cls} overrides for the Pallas kernels, "
      "'field=value/field=value' (benchmark_mixers' --sweep syntax); '' = the "
      "default",
      flag_values=flag_values,
    )


def current():
  """{'<family>_config': repr of the family's current DEFAULT} (for results JSON)."""
  return {f"{key}_config": repr(mod.DEFAULT) for key, mod in _modules().items()}


def apply_flags(flag_values):
  """Sets the package defaults from define_flags' flags (over the current defaults); every spec
  is parsed (a ValueError naming the flag and item) before any default changes. Returns
  current()."""
  mods = _modules()
  new = {
    key: config_from_spec(
      mod.DEFAULT, getattr(flag_values, f"{key}_config"), f"--{key}_config item"
    )
    for key, mod in mods.items()
  }
  for key, mod in mods.items():
    mod.DEFAULT = new[key]
  return current()
