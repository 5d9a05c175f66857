"""Mixer registry: name -> class (or a function choosing one by config). Every entry is built as
``cls(cfg, *, rngs)`` and implements
``__call__(x, *, initial_state=None, segment_ids=None) -> (y, final_state)``, ``step(x_t, state)``,
``init_state(batch)``, ``init_cache(batch, max_len)`` and ``prefill(x, cache)``."""

from __future__ import annotations

from kdn_jax.layers.attention import FullAttention, SlidingWindowAttention
from kdn_jax.layers.delta_mixers import GDN2, GLA, KDA, DeltaNet, GatedDeltaNet
from kdn_jax.layers.kdn_mixer import KDNDiag, KDNIso
from kdn_jax.layers.mamba2 import Mamba2
from kdn_jax.layers.mamba2_official import Mamba2Official
from kdn_jax.layers.options import option


def mamba2(cfg, *, rngs, kernel_config=None):
  """The `mamba2` mixer: mamba_ssm's block (Mamba2Official) for mamba2_variant='official', else
  the scaffold's Mamba-2 (layers/mamba2.py) in the named variant."""
  official = option(cfg, "mamba2_variant") == "official"
  return (Mamba2Official if official else Mamba2)(cfg, rngs=rngs, kernel_config=kernel_config)


MIXERS = {
  "kdn_diag": KDNDiag,
  "kdn_iso": KDNIso,
  "kda": KDA,
  "gated_deltanet": GatedDeltaNet,
  "deltanet": DeltaNet,
  "gdn2": GDN2,
  "gla": GLA,
  "mamba2": mamba2,
  "attention": FullAttention,
  "swa": SlidingWindowAttention,
}

ATTENTION_MIXERS = ("attention", "swa")


def is_recurrent(name: str) -> bool:
  return name not in ATTENTION_MIXERS


def make_mixer(name: str, cfg, *, rngs, kernel_config=None):
  """kernel_config (a pallas_kernels.KernelConfigs or None: the kernels' tuned configs) goes to
  the recurrent mixers, whose ops and glue kernels take it; attention runs no Pallas kernel."""
  if name not in MIXERS:
    raise ValueError(f"mixer: unknown mixer {name!r}; expected one of {sorted(MIXERS)}")
  if is_recurrent(name):
    return MIXERS[name](cfg, rngs=rngs, kernel_config=kernel_config)
  return MIXERS[name](cfg, rngs=rngs)
