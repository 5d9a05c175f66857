"""Pallas kernels for kdn_jax (Triton lowering on GPU, interpret mode on CPU).

Public API (all arrays in [B, T, H, *] layout):
  diag_gain(k, log_alpha, omega, r, info_scale, p0, segment_ids=None, *, chunk_size=256, interpret=None,
            gain_dtype=float32)
  iso_gain(k, log_alpha, omega, r, info_scale, b0, segment_ids=None, *, chunk_size=256, interpret=None)
  delta_rule(q, k, v, log_alpha, write, scale, initial_state, segment_ids=None, *, chunk_size=64,
             precision=None, interpret=None)
  precision_for(dtype) -> 'fast' | 'exact' (the dot precision delta_rule picks for that dtype)
  write_dtype(dtype) -> the dtype to store a computed write in for delta_rule on that data
             (diag_gain's gain_dtype: bfloat16 under bf16 dots)
  warm_imports(interpret=None): lower one tiny kernel before your first jit (warmup.py says why)
  KernelConfigs: one frozen config per kernel family (tuned.py); every op takes its family's as
             `config=` (None: the tuned entry for the device, tuned.TUNED)
Decode: decode.delta_rule_step / decode.kdn_step, one token fused in one pass over the state
(forward only; kdn_jax.ops' *_step with impl='pallas').
Layer glue (import from their folders): kdn_gain.diag_gain_fused / iso_gain_fused (the gain with
the gate front-end), causal_conv1d.causal_conv1d, gated_norm.gated_rms_norm.
"""

from pallas_kernels import decode
from pallas_kernels.common import precision_for
from pallas_kernels.delta_rule import delta_rule, write_dtype
from pallas_kernels.kdn_gain import diag_gain, iso_gain
from pallas_kernels.tuned import KernelConfigs
from pallas_kernels.warmup import warm_imports

__all__ = [
  "decode",
  "diag_gain",
  "iso_gain",
  "delta_rule",
  "KernelConfigs",
  "precision_for",
  "warm_imports",
  "write_dtype",
]
