"""The kernels' configs: one frozen config per kernel family, passed down explicitly, and the tuned
values per device kind in one table.

Every op takes its family's config as an argument (`config=`, a static argument: part of jit's
cache key). None means the table's entry for the device the op runs on, looked up here and
nowhere else. A run's overrides (experiments/kernel_config.py) are applied to a table
entry and passed down through the model's layers into the ops; nothing is set globally.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from pallas_kernels.causal_conv1d.config import ConvConfig
from pallas_kernels.decode.config import DecodeConfig
from pallas_kernels.delta_rule.config import DeltaRuleConfig
from pallas_kernels.gated_norm.config import NormConfig
from pallas_kernels.kdn_gain.config import GainConfig

__all__ = ["FAMILIES", "KernelConfigs", "TUNED", "FALLBACK", "config", "device_kind", "tuned"]


@dataclasses.dataclass(frozen=True)
class KernelConfigs:
  """One config per kernel family (None: the tuned entry for the device). Hashable: a layer keeps
  it as static metadata and the ops take its members as static arguments."""

  delta_rule: DeltaRuleConfig | None = None
  gain: GainConfig | None = None
  conv: ConvConfig | None = None
  norm: NormConfig | None = None
  decode: DecodeConfig | None = None

  def get(self, family):
    """This bundle's config for `family`, the tuned one where it holds None."""
    return config(family, getattr(self, family))


# family name -> its config class
FAMILIES = {
  "delta_rule": DeltaRuleConfig,
  "gain": GainConfig,
  "conv": ConvConfig,
  "norm": NormConfig,
  "decode": DecodeConfig,
}

# The config classes' defaults are the values measured on the H100 and the H200 (each field's
# comment and docs/decisions.md give the measurement); both GPUs chose the same values.
# DecodeConfig's are chosen from the program count and not yet timed (its docstring). The delta
# rule's K > 128 tiles (block_k, wide_block_v, wide_block_v_parallel) are sized to hold a
# K = 128 program's elements, not yet timed (`gpu_measurements.sh wide` sweeps them).
_MEASURED = KernelConfigs(**{name: cls() for name, cls in FAMILIES.items()})

# Device kind (a substring of jax's device_kind, or 'interpret') -> the tuned configs.
TUNED = {
  "H100": _MEASURED,
  "H200": _MEASURED,
}
# Devices without measurements of their own (other GPUs, TPUs, CPU interpret mode): the GPU values.
# (The TPU kernels read only the chunk lengths, max_chunk of delta_rule and gain.)
FALLBACK = _MEASURED


@functools.cache
def _entry(kind):
  for key, entry in TUNED.items():
    if key in kind:
      return entry
  return FALLBACK


def device_kind(interpret=False):
  """The key the table is read with: 'interpret' for interpret-mode kernels, else the first
  device's kind (e.g. 'NVIDIA H100 80GB HBM3', 'TPU v5 lite')."""
  if interpret:
    return "interpret"
  return jax.devices()[0].device_kind


def tuned(family, interpret=False):
  """The tuned config of `family` ('delta_rule', 'gain', 'conv', 'norm', 'decode') here."""
  if family not in FAMILIES:
    raise ValueError(f"kernel family: expected one of {sorted(FAMILIES)}, got {family!r}")
  return getattr(_entry(device_kind(interpret)), family)


def config(family, given, interpret=False):
  """`given` (an op's config argument) when not None, else the tuned config of `family`."""
  if given is None:
    return tuned(family, interpret)
  if not isinstance(given, FAMILIES[family]):
    raise TypeError(
      f"config: expected a {FAMILIES[family].__name__} or None for the {family} kernels, "
      f"got {type(given).__name__}"
    )
  return given
