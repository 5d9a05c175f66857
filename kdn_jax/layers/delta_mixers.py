"""Baseline recurrent mixers on kdn_jax.ops, sharing the KDN scaffolding (projections, short conv,
L2-normalised q/k, low-rank sigmoid output gate + RMSNorm, o_proj), so only the recurrence differs.

  kda            S = (I - beta k k^T) diag(alpha) S + beta k v^T     per-channel KDA decay, beta = sigmoid(d -> H)
  gated_deltanet S = (I - beta k k^T) alpha S + beta k v^T           scalar decay per head (d -> H)
  deltanet       S = (I - beta k k^T) S + beta k v^T
  gdn2           S = (I - k (b*k)^T) diag(alpha) S + k (w*v)^T       b = sigmoid(low rank -> H*K), w = sigmoid(low rank -> H*V)
  gla            S = diag(alpha) S + k v^T                           per-channel KDA decay, no erase
  (mamba2        S = alpha S + dt k v^T, o += D v                    scalar decay, dt-scaled input: layers/mamba2.py)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kdn_jax import ops
from kdn_jax.layers.decay import Decay, decay_ranges
from kdn_jax.layers.dense import Dense, LowRank
from kdn_jax.layers.recurrent import RecurrentMixer, memory_outputs, states_kw
from kdn_jax.ops import context_sharding


def _memory_core(mixer, op, q, k, v, gate_args, state, segment_ids, positions):
  """A memory-only mixer's _core: the op `op` (a context_sharding.op name) on q, k, v and its
  gate arguments, from the layer's memory."""
  o, m, *at = context_sharding.op(op)(
    q,
    k,
    v,
    *gate_args,
    initial_state=state["memory"],
    output_final_state=True,
    segment_ids=segment_ids,
    impl=mixer.impl,
    chunk_size=mixer.chunk_size,
    kernel_config=mixer.kernel_config,
    **states_kw(positions),
  )
  return memory_outputs(o, m, at)


class _BetaMixin:
  def _init_beta(self, rngs):
    self.b_proj = Dense(
      self.d_model,
      self.num_heads,
      ("embed", "heads"),
      use_bias=True,
      dtype=self.dtype,
      param_dtype=self.param_dtype,
      rngs=rngs,
    )

  def beta(self, x):
    return jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32))

  def _beta_step(self, q, k, v, g, beta, state):
    """One token of the delta rule with log decay g and write beta * k."""
    o, m = ops.delta_rule_step(
      q,
      k,
      v,
      g,
      beta[..., None] * k.astype(jnp.float32),
      state["memory"],
      impl=self._step_impl(),
      kernel_config=self.kernel_config,
    )
    return o, {"memory": m}


class KDA(_BetaMixin, RecurrentMixer):
  """Kimi Delta Attention: per-channel decay, write beta * k."""

  PER_CHANNEL_DECAY = True
  OP = "kda"  # a context_sharding.op name

  def _init_gates(self, cfg, rngs):
    rank = {"rank": self.rank} if self.PER_CHANNEL_DECAY else {}
    self.decay = Decay(
      self.d_model,
      self.num_heads,
      self.key_dim,
      per_channel=self.PER_CHANNEL_DECAY,
      dtype=self.dtype,
      param_dtype=self.param_dtype,
      rngs=rngs,
      **rank,
      **decay_ranges(cfg),
    )
    self._init_beta(rngs)

  def _gates(self, x):
    return {"g": self.decay(x), "beta": self.beta(x)}

  def _core(self, q, k, v, gates, state, segment_ids, positions=None):
    return _memory_core(
      self, self.OP, q, k, v, (gates["g"], gates["beta"]), state, segment_ids, positions
    )

  def _core_step(self, q, k, v, gates, state):
    return self._beta_step(q, k, v, gates["g"], gates["beta"], state)


class GatedDeltaNet(KDA):
  """Gated DeltaNet: KDA with one scalar decay per head."""

  PER_CHANNEL_DECAY = False
  OP = "gated_delta_rule"


class DeltaNet(_BetaMixin, RecurrentMixer):
  def _init_gates(self, cfg, rngs):
    self._init_beta(rngs)

  def _gates(self, x):
    return {"beta": self.beta(x)}

  def _core(self, q, k, v, gates, state, segment_ids, positions=None):
    return _memory_core(self, "delta_net", q, k, v, (gates["beta"],), state, segment_ids, positions)

  def _core_step(self, q, k, v, gates, state):
    beta = gates["beta"]
    return self._beta_step(q, k, v, jnp.zeros_like(beta), beta, state)


class GDN2(RecurrentMixer):
  def _init_gates(self, cfg, rngs):
    kw = dict(dtype=self.dtype, param_dtype=self.param_dtype, rngs=rngs)
    H, K, V = self.num_heads, self.key_dim, self.value_dim
    self.decay = Decay(
      self.d_model, H, K, per_channel=True, rank=self.rank, **kw, **decay_ranges(cfg)
    )
    self.b_proj = LowRank(self.d_model, self.rank, (H, K), ("heads", "kv"), use_bias=True, **kw)
    self.w_proj = LowRank(self.d_model, self.rank, (H, V), ("heads", "kv"), use_bias=True, **kw)

  def _gates(self, x):
    return {
      "g": self.decay(x),
      "b": jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32)),
      "w": jax.nn.sigmoid(self.w_proj(x).astype(jnp.float32)),
    }

  def _core(self, q, k, v, gates, state, segment_ids, positions=None):
    return _memory_core(
      self, "gdn2", q, k, v, (gates["g"], gates["b"], gates["w"]), state, segment_ids, positions
    )

  def _core_step(self, q, k, v, gates, state):
    # read/erase key b*k, write direction k, value w*v
    kf = k.astype(jnp.float32)
    o, m = ops.delta_rule_step(
      q,
      gates["b"] * kf,
      gates["w"] * v.astype(jnp.float32),
      gates["g"],
      kf,
      state["memory"],
      impl=self._step_impl(),
      kernel_config=self.kernel_config,
    )
    return o, {"memory": m}


class GLA(RecurrentMixer):
  def _init_gates(self, cfg, rngs):
    self.decay = Decay(
      self.d_model,
      self.num_heads,
      self.key_dim,
      per_channel=True,
      rank=self.rank,
      dtype=self.dtype,
      param_dtype=self.param_dtype,
      rngs=rngs,
      **decay_ranges(cfg),
    )

  def _gates(self, x):
    return {"g": self.decay(x)}

  def _core(self, q, k, v, gates, state, segment_ids, positions=None):
    return _memory_core(self, "gla", q, k, v, (gates["g"],), state, segment_ids, positions)

  def _core_step(self, q, k, v, gates, state):
    # S = diag(alpha) S + k v^T ; o = K^-1/2 S^T q   (no erase, so no delta-rule op needed)
    qf, kf, vf = (a.astype(jnp.float32) for a in (q, k, v))
    S = jnp.exp(gates["g"])[..., None] * state["memory"] + kf[..., :, None] * vf[..., None, :]
    o = jnp.einsum("bhkv,bhk->bhv", S, qf) * (self.key_dim**-0.5)
    return o, {"memory": S}
