"""Shared scaffolding of the recurrent (delta-rule family) mixers.

x -> q, k, v projections [B,T,H_k|H,K|V] -> causal depthwise short conv + SiLU (own decode cache
each) -> L2-normalised q, k -> recurrence (subclass) -> sigmoid-gated RMSNorm (low-rank gate) ->
o_proj. Subclasses may keep q, k unnormalised (`normalize_qk`) and replace the output gate
(`_init_output_gate`, `_out`).

Heads: H = cfg.num_v_heads value heads (0: cfg.num_heads) carry v, the gates, the state and the
output; q and k have H_k = cfg.num_heads heads, each serving H / H_k consecutive value heads
(grouped value heads, flash-linear-attention's GVA; Mamba-2's B/C groups). q and k are repeated
to H heads after their convs, so the subclasses see H heads throughout.

State contract (a dict pytree, all float32):
  'memory'   [B, H, K, V]
  'variance' [B, H, K] (diag KDN) or [B, H] (iso KDN)   -- KDN only
  'conv'     {'q': [B, W-1, H_k, K], 'k': [B, W-1, H_k, K], 'v': [B, W-1, H, V]}
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kdn_jax.layers.context_conv import short_conv
from kdn_jax.layers.dense import Dense, LowRank
from kdn_jax.layers.gated_norm import GatedRMSNorm
from kdn_jax.layers.options import option
from kdn_jax.layers.short_conv import ShortConv, l2_normalize
from kdn_jax.ops import context_sharding, dispatch


def get_dtype(name) -> jnp.dtype:
  if not isinstance(name, str):
    return jnp.dtype(name)
  table = {
    "float32": jnp.float32,
    "fp32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "bf16": jnp.bfloat16,
    "float16": jnp.float16,
  }
  if name not in table:
    raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(table)}")
  return jnp.dtype(table[name])


def value_heads(cfg) -> int:
  """The value heads H of a recurrent mixer: cfg.num_v_heads, 0 (or absent) meaning num_heads."""
  return int(option(cfg, "num_v_heads") or 0) or int(cfg.num_heads)


def lowrank_dim(cfg) -> int:
  r = int(option(cfg, "lowrank_dim") or 0)
  return r if r > 0 else int(cfg.head_dim)


def states_kw(positions) -> dict:
  """The ops' keyword for a mixer's _core positions (none when None)."""
  return {} if positions is None else {"output_states_at": positions}


def memory_outputs(o, memory, at) -> tuple:
  """A memory-only mixer's _core result from an op's (o, memory, *memory at positions)."""
  return (o, {"memory": memory}) + tuple({"memory": a} for a in at)


class RecurrentMixer(nnx.Module):
  """Base class. Subclasses implement _init_gates, _gates, _core, _core_step, _init_core."""

  has_variance = False
  # q/k/v short convs with the Pallas kernel (pallas_kernels.causal_conv1d) when the impl resolves
  # to pallas; on for the KDN mixers, off here
  fuse_conv = False
  fuse_norm = False  # likewise the sigmoid-gated output RMSNorm (pallas_kernels.gated_norm)
  normalize_qk = True  # q, k L2-normalised after their convs (off: Mamba-2's raw B, C)

  def __init__(self, cfg, *, rngs: nnx.Rngs, kernel_config=None):
    # the Pallas kernels' configs (pallas_kernels.KernelConfigs, frozen: static metadata of the
    # module), passed to every op and glue kernel; None: the kernels' tuned ones
    self.kernel_config = kernel_config
    d, Hk, K = int(cfg.d_model), int(cfg.num_heads), int(cfg.head_dim)
    H, V = value_heads(cfg), K
    if H % Hk:
      raise ValueError(f"num_v_heads = {H} must be a multiple of num_heads = {Hk}")
    # num_heads: the recurrence's (value) heads, which the subclasses' gates and state use
    self.d_model, self.num_heads, self.key_dim, self.value_dim = d, H, K, V
    self.num_key_heads = Hk
    self.dtype = get_dtype(cfg.dtype)
    self.param_dtype = get_dtype(cfg.param_dtype)
    self.chunk_size = int(cfg.chunk_size)
    self.impl = str(cfg.impl)
    self.rank = lowrank_dim(cfg)
    kw = dict(dtype=self.dtype, param_dtype=self.param_dtype, rngs=rngs)
    self.q_proj = Dense(d, (Hk, K), ("embed", "heads", "kv"), **kw)
    self.k_proj = Dense(d, (Hk, K), ("embed", "heads", "kv"), **kw)
    self.v_proj = Dense(d, (H, V), ("embed", "heads", "kv"), **kw)
    W = int(cfg.conv_size)
    self.q_conv = ShortConv((Hk, K), W, **kw)
    self.k_conv = ShortConv((Hk, K), W, **kw)
    self.v_conv = ShortConv((H, V), W, **kw)
    self._init_gates(cfg, rngs)
    self._init_output_gate(cfg, kw)
    self.o_proj = Dense((H, V), d, ("heads", "kv", "embed"), **kw)

  # ---- subclass hooks -------------------------------------------------------------------------
  def _init_gates(self, cfg, rngs):
    pass

  def _init_output_gate(self, cfg, kw):
    """The output path before o_proj: a low-rank sigmoid gate and a per-head RMSNorm (`_out`)."""
    self.g_proj = LowRank(
      self.d_model,
      self.rank,
      (self.num_heads, self.value_dim),
      ("heads", "kv"),
      use_bias=True,
      **kw,
    )
    self.o_norm = GatedRMSNorm(
      self.value_dim, eps=float(cfg.norm_eps), dtype=self.dtype, param_dtype=self.param_dtype
    )

  def _gates(self, x) -> dict:
    """x [..., d] -> dict of per-token recurrence inputs (float32)."""
    return {}

  def _init_core(self, batch: int) -> dict:
    return {"memory": jnp.zeros((batch, self.num_heads, self.key_dim, self.value_dim), jnp.float32)}

  def _core(self, q, k, v, gates, state, segment_ids, positions=None):
    """-> (o, final core state); with positions (static [P]) a third entry: the core state
    after each position (leaves [B, P, ...]; the ops' output_states_at)."""
    raise NotImplementedError

  def _core_step(self, q, k, v, gates, state):
    raise NotImplementedError

  # ---- shared ---------------------------------------------------------------------------------
  def init_state(self, batch: int) -> dict:
    st = self._init_core(batch)
    st["conv"] = {
      "q": self.q_conv.init_cache(batch),
      "k": self.k_conv.init_cache(batch),
      "v": self.v_conv.init_cache(batch),
    }
    return st

  def init_cache(self, batch: int, max_len: int | None = None) -> dict:
    """Decode cache; for recurrent mixers it is the state."""
    del max_len
    return self.init_state(batch)

  def prefill(self, x, cache):
    """Decode-path prefill: the chunked forward from ``cache`` -> (y, new_cache)."""
    return self(x, initial_state=cache)

  def _out(self, o, x):
    norm_config = dispatch.family_config(self.kernel_config, "norm")
    return self.o_proj(self.o_norm(o, self.g_proj(x), fused=self._fused_norm(), config=norm_config))

  def _glue_kernels(self) -> bool:
    """Whether the fused glue kernels (conv, norm, gate front-end) may run: the pallas impl, not
    on a TPU (they are written for the Triton lowering; the TPU kernels cover the ops only), T
    not split over devices (they are not wrapped for it: per_shard would gather the sequence),
    and K, V widths the kernels take as they are (their rows are not padded, as the ops pad
    the recurrence's: Triton's arrays are powers of two)."""
    return (
      dispatch.resolve_impl("recurrent_mixer", self.impl) == "pallas"
      and jax.default_backend() != "tpu"
      and context_sharding.active_setting() is None
      and dispatch.native_width(self.key_dim)
      and dispatch.native_width(self.value_dim)
    )

  def _step_impl(self) -> str:
    """The impl of the decode step ops (`*_step`): the layer's, so a layer built with 'pallas'
    decodes with the fused step (pallas_kernels.decode) and 'auto' follows
    dispatch.resolve_step_impl; 'pallas' where the fused step cannot run (a TPU; K or V not a
    kernel width: the chunked kernels pad widths, one token's state is not worth padding) runs
    the XLA step."""
    if self.impl == "pallas" and not (
      jax.default_backend() != "tpu"
      and dispatch.native_width(self.key_dim)
      and dispatch.native_width(self.value_dim)
    ):
      return "reference"
    return self.impl

  def _fused_conv(self) -> bool:
    return self.fuse_conv and self._glue_kernels()

  def _fused_norm(self) -> bool:
    return self.fuse_norm and self._glue_kernels()

  def project(self, x, conv, segment_ids=None, positions=None):
    """x [B, T, d] -> (q, k, v after short conv, q/k L2-normalised; the new conv caches), and
    with positions ([P], static) the conv caches after each position ({'q', 'k', 'v'}:
    [B, P, W-1, H, K|V])."""
    # short_conv: the plain call (the Pallas conv when fused), or a halo exchange when T is split
    # (context parallelism)
    fused = self._fused_conv()
    conv_config = dispatch.family_config(self.kernel_config, "conv")
    xq, xk, xv = self.q_proj(x), self.k_proj(x), self.v_proj(x)
    if fused:  # (no context split then) the L2 normalisation inside the conv kernels
      kw = dict(fused=True, normalize=self.normalize_qk, config=conv_config)
      q, cq = self.q_conv(xq, conv["q"], segment_ids, **kw)
      k, ck = self.k_conv(xk, conv["k"], segment_ids, **kw)
    else:
      q, cq = short_conv(self.q_conv, xq, conv["q"], segment_ids)
      k, ck = short_conv(self.k_conv, xk, conv["k"], segment_ids)
      q, k = self._normalize(q), self._normalize(k)
    v, cv = short_conv(self.v_conv, xv, conv["v"], segment_ids, fused=fused, config=conv_config)
    q, k = self._to_value_heads(q, k)
    out = (q.astype(self.dtype), k.astype(self.dtype), v, (cq, ck, cv))
    if positions is None:
      return out
    at = {
      name: mod.caches_at(xx, conv[name], positions, segment_ids)
      for name, mod, xx in (("q", self.q_conv, xq), ("k", self.k_conv, xk), ("v", self.v_conv, xv))
    }
    return out + (at,)

  def _normalize(self, a):
    return l2_normalize(a) if self.normalize_qk else a

  def _to_value_heads(self, q, k):
    """q, k [..., H_k, K] -> [..., H, K]: key head i serves value heads i * G .. i * G + G - 1
    (G = H / H_k; kdn_jax/ops/heads.py's order, autodiff sums the gradients back)."""
    group = self.num_heads // self.num_key_heads
    if group == 1:
      return q, k
    return jnp.repeat(q, group, axis=-2), jnp.repeat(k, group, axis=-2)

  def __call__(self, x, *, initial_state=None, segment_ids=None, states_at=None):
    """x [B, T, d] -> (y [B, T, d], final_state). states_at: None, or positions [P] (ints known
    when tracing, sorted, in [1, T]): a third entry, the state after each position p (what
    final_state is for x[:, :p]; leaves [B, P, ...])."""
    B = x.shape[0]
    if initial_state is None:
      initial_state = self.init_state(B)
    q, k, v, (cq, ck, cv), *conv_at = self.project(x, initial_state["conv"], segment_ids, states_at)
    gates = self._gates(x)
    core_in = {kk: vv for kk, vv in initial_state.items() if kk != "conv"}
    o, core, *core_at = self._core(q, k, v, gates, core_in, segment_ids, states_at)
    y = self._out(o.astype(self.dtype), x)
    core["conv"] = {"q": cq, "k": ck, "v": cv}
    if states_at is None:
      return y, core
    return y, core, dict(core_at[0], conv=conv_at[0])

  def step(self, x_t, state):
    """x_t [B, d] -> (y_t [B, d], new_state)."""
    conv = state["conv"]
    q, cq = self.q_conv.step(self.q_proj(x_t), conv["q"])
    k, ck = self.k_conv.step(self.k_proj(x_t), conv["k"])
    v, cv = self.v_conv.step(self.v_proj(x_t), conv["v"])
    q, k = self._to_value_heads(self._normalize(q), self._normalize(k))
    q, k = q.astype(self.dtype), k.astype(self.dtype)
    gates = self._gates(x_t)
    core_in = {kk: vv for kk, vv in state.items() if kk != "conv"}
    o, core = self._core_step(q, k, v, gates, core_in)
    y = self._out(o.astype(self.dtype), x_t)
    core["conv"] = {"q": cq, "k": ck, "v": cv}
    return y, core
