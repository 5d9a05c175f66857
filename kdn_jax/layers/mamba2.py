"""Mamba-2 (SSD) as a linear-attention mixer on the shared scaffold (`mamba2`).

Mamba-2's names -> the scaffold's: C = q, B = k, x = v; each head has its own B/C (ngroups = H).
Per token and head, with a scalar step size and decay (Decay, per_channel=False):

    dt_t    = softplus(f(x_t) + dt_bias)          f: d -> H;  dt_bias = softplus^-1(logU(1e-3, 1e-1))
    alpha_t = exp(-exp(A_log) * dt_t)             A_log = log U(1, 16)
    S_t     = alpha_t S_{t-1} + dt_t k_t v_t^T    (ZOH-style discretisation: the input is scaled by dt; no erase)
    o_t     = scale * S_t^T q_t + D * v_t         (D: learned per-head skip, init 1)

then the shared sigmoid-gated RMSNorm and o_proj (instead of Mamba-2's SiLU(z) gate; this keeps the
output path identical to the other mixers so only the recurrence differs).

Choices:
  * q, k, v come from the scaffold: linear -> causal depthwise conv (width 4) + SiLU, and q, k are
    L2-normalised as for the other mixers (Mamba-2 leaves B, C unnormalised). The normalisation does
    not change the form of the recurrence.
  * scale = K (not the scaffold's default K^-1/2): with unit q, k this is the read of RMS-normalised
    B, C (unit-RMS entries, as in a B/C-norm), i.e. C^T B = K cos(q, k). The dt scaling makes the
    memory an average of total weight ~1/A <= 1, so with scale K^-1/2 the recurrent read is ~500x
    smaller than the D skip at initialisation (measured: 125m, K = 128, random inputs); with scale K
    it is ~3x larger, the same order as in Mamba-2.
  * The recurrence is `ops.gla` with the write direction dt_t k_t (erase key zero) and the scalar
    per-head log decay [B, T, H], so the chunked / Pallas paths, packed segments and initial states
    are those of the op. The D skip is per token and carries no state.

Variants (model config key ``mamba2_variant``):
  * 'normalized' (the default): as above, L2-normalised q, k, read scale K, the scaffold's output
    gate, so only the recurrence differs from the other mixers.
  * 'faithful': Mamba-2's own block around the same recurrence: B, C unnormalised (only conv +
    SiLU), read scale 1 (y = C^T h), and its gated RMSNorm over all heads together,
    o_proj(RMSNorm_{H*V}(y * SiLU(z)) * w) with z a full-rank projection of x. The length study
    needs it: without the normalisations the state's scale follows the inputs' statistics over
    length, as in Mamba-2.
  * 'official': mamba_ssm's Mamba2 block itself (expand 2, d_state 128, headdim 64, one B/C group,
    one conv over x, B, C) and its LM (no MLP): layers/mamba2_official.py, which
    registry.MIXERS['mamba2'] builds for this variant.

State: {'memory': [B, H, K, V], 'conv': {...}} as for the other recurrent mixers.
"""

from __future__ import annotations

import jax.numpy as jnp

from kdn_jax import ops
from kdn_jax.layers.decay import Decay, decay_ranges
from kdn_jax.layers.dense import Dense, make_param, ones_init
from kdn_jax.layers.gated_norm import silu_gated_rms_norm
from kdn_jax.layers.options import option
from kdn_jax.layers.recurrent import RecurrentMixer, memory_outputs, states_kw

MAMBA2_VARIANTS = ("normalized", "faithful", "official")  # 'official': layers/mamba2_official.py


class Mamba2(RecurrentMixer):
  """Mamba-2 / SSD mixer: scalar per-head decay, dt-scaled input, no erase, per-head D skip."""

  def _init_gates(self, cfg, rngs):
    H = self.num_heads
    self.variant = str(option(cfg, "mamba2_variant"))
    if self.variant not in ("normalized", "faithful"):
      raise ValueError(
        f"mamba2_variant: got {self.variant!r}; this class builds 'normalized' and 'faithful' "
        f"(of {list(MAMBA2_VARIANTS)}; 'official' is Mamba2Official, registry.MIXERS['mamba2'])"
      )
    self.faithful = self.variant == "faithful"
    self.normalize_qk = not self.faithful
    self.decay = Decay(
      self.d_model,
      H,
      self.key_dim,
      per_channel=False,
      dtype=self.dtype,
      param_dtype=self.param_dtype,
      rngs=rngs,
      **decay_ranges(cfg),
    )
    self.D = make_param(rngs, ones_init, (H,), self.param_dtype, ("heads",))
    self.scale = 1.0 if self.faithful else float(self.key_dim)

  def _init_output_gate(self, cfg, kw):
    if not self.faithful:
      return super()._init_output_gate(cfg, kw)
    H, V = self.num_heads, self.value_dim
    self.eps = float(cfg.norm_eps)
    self.z_proj = Dense(self.d_model, (H, V), ("embed", "heads", "kv"), **kw)
    self.norm_weight = make_param(None, ones_init, (H, V), self.param_dtype, ("heads", "kv"))

  def _out(self, o, x):
    if not self.faithful:
      return super()._out(o, x)
    return self.o_proj(self.gated_norm(o, self.z_proj(x)).astype(self.dtype))

  def gated_norm(self, o, z):
    """Mamba-2's RMSNormGated (gate first): RMSNorm over all heads of o * SiLU(z), float32."""
    return silu_gated_rms_norm(o, z, self.norm_weight[...], self.eps, axes=(-2, -1))

  def _gates(self, x):
    g, dt = self.decay.log_alpha_and_dt(x)  # [..., H] each
    return {"g": g, "dt": dt}

  @staticmethod
  def _write(k, gates):
    """dt_t k_t in k's dtype (bf16 runs keep the ops' fast 16-bit dot path; the op computes in fp32)."""
    return (gates["dt"][..., None] * k.astype(jnp.float32)).astype(k.dtype)

  def _skip(self, o, v):
    return o.astype(jnp.float32) + self.D[...].astype(jnp.float32)[:, None] * v.astype(jnp.float32)

  def _core(self, q, k, v, gates, state, segment_ids, positions=None):
    write = self._write(k, gates)
    o, m, *at = ops.gla(
      q,
      write,
      v,
      gates["g"],
      scale=self.scale,
      initial_state=state["memory"],
      output_final_state=True,
      segment_ids=segment_ids,
      impl=self.impl,
      chunk_size=self.chunk_size,
      kernel_config=self.kernel_config,
      **states_kw(positions),
    )
    return memory_outputs(self._skip(o, v), m, at)

  def _core_step(self, q, k, v, gates, state):
    write = self._write(k, gates)
    o, m = ops.delta_rule_step(
      q,
      jnp.zeros_like(write),
      v,
      gates["g"],
      write,
      state["memory"],
      scale=self.scale,
      impl=self._step_impl(),
      kernel_config=self.kernel_config,
    )
    return self._skip(o, v), {"memory": m}
