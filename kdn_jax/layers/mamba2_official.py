"""mamba_ssm's Mamba2 block (`mamba2` with mamba2_variant='official'), written from its equations.

Shapes: d_inner = EXPAND * d_model, H = d_inner / HEADDIM heads of P = HEADDIM channels, state size
N = D_STATE, one group (B and C shared by all heads; dt, A and D per head). Per token:

    [z, x, B, C, dt] = in_proj(u)                        no bias; z, x: d_inner, B, C: N, dt: H
    [x, B, C]        = SiLU(conv1d([x, B, C]) + bias)    depthwise, causal, width conv_size (4)
    dt_h             = softplus(dt_h + dt_bias_h),   A_h = -exp(A_log_h)
    h_t              = exp(dt A) h_{t-1} + dt B_t x_t^T   per head: [N, P]
    y_t              = C_t^T h_t + D x_t
    out              = out_proj(RMSNorm_{d_inner}(y * SiLU(z)) * w)   eps 1e-5, gate first

Initialisation as mamba_ssm: dt_bias = softplus^-1(logU(dt_min, dt_max) floored at 1e-4) (the
model config's dt_min / dt_max), A_log = log U(a_min, a_max) (default [1, 16]), D = 1, norm w = 1;
in_proj, out_proj and the conv's weight and bias PyTorch's default U(+-fan_in^-1/2), out_proj then
divided by sqrt(num_layers) (mamba_ssm's rescale of a prenorm residual branch, one per layer: its LM
has no MLP, see kdn_jax/models/lm.py). A_log, D and dt_bias take no weight decay: the optimizer's
mask excludes them by name (config.optim.no_decay).

The recurrence is `ops.gla` (the scalar-decay linear recurrence of the scaffold Mamba-2, mamba2.py)
with q = C, k = B as one key head serving all H value heads (the ops' grouped value heads) and
v = dt x: dt B x^T = B (dt x)^T. The D skip carries no state.

State (the recurrent mixers' contract): {'memory': [B, H, N, P], 'conv': {'xBC': [B, W-1, d_inner
+ 2N]}}, float32.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from kdn_jax import ops
from kdn_jax.layers.context_conv import short_conv
from kdn_jax.layers.decay import DT_FLOOR, a_log_init, decay_ranges, dt_bias_init
from kdn_jax.layers.dense import Dense, make_param, ones_init, uniform_init
from kdn_jax.layers.gated_norm import silu_gated_rms_norm
from kdn_jax.layers.recurrent import get_dtype, states_kw
from kdn_jax.layers.short_conv import ShortConv

EXPAND = 2
D_STATE = 128
HEADDIM = 64
NORM_EPS = 1e-5  # the gated norm's, and mamba_ssm's LM norms' (norm_epsilon)


def torch_default_init(fan_in: int, scale: float = 1.0):
  """PyTorch's default nn.Linear / nn.Conv1d initialisation, U(+-fan_in^-1/2), times scale."""
  return uniform_init(scale / math.sqrt(fan_in))


def inner_width(d_model: int) -> int:
  """d_inner = EXPAND * d_model; ValueError naming d_model unless it splits into HEADDIM heads."""
  d_inner = EXPAND * int(d_model)
  if d_inner % HEADDIM:
    raise ValueError(
      f"d_model: the official Mamba-2 block needs {EXPAND} * d_model to be a multiple of "
      f"headdim {HEADDIM}, got d_model = {d_model}"
    )
  return d_inner


class Mamba2Official(nnx.Module):
  def __init__(self, cfg, *, rngs: nnx.Rngs, kernel_config=None):
    self.kernel_config = kernel_config
    d, L = int(cfg.d_model), int(cfg.num_layers)
    self.d_model, self.d_inner = d, inner_width(d)
    self.num_heads, self.head_dim, self.d_state = self.d_inner // HEADDIM, HEADDIM, D_STATE
    H, N = self.num_heads, self.d_state
    self.conv_dim = self.d_inner + 2 * N
    self.dtype, self.param_dtype = get_dtype(cfg.dtype), get_dtype(cfg.param_dtype)
    self.chunk_size, self.impl = int(cfg.chunk_size), str(cfg.impl)
    kw = dict(dtype=self.dtype, param_dtype=self.param_dtype, rngs=rngs)
    self.in_proj = Dense(
      d,
      2 * self.d_inner + 2 * N + H,
      ("embed", None),  # [z, x, B, C, dt]: not one head axis, so not split over devices
      kernel_init=torch_default_init(d),
      **kw,
    )
    W = int(cfg.conv_size)
    self.conv = ShortConv(
      (self.conv_dim,),
      W,
      names=(None,),
      use_bias=True,
      weight_init=torch_default_init(W),
      bias_init=torch_default_init(W),
      **kw,
    )
    ranges = decay_ranges(cfg)
    pd = self.param_dtype
    self.dt_bias = make_param(
      rngs, dt_bias_init(*ranges["dt_range"], floor=DT_FLOOR), (H,), pd, ("heads",)
    )
    self.A_log = make_param(rngs, a_log_init(*ranges["a_range"]), (H,), pd, ("heads",))
    self.D = make_param(rngs, ones_init, (H,), pd, ("heads",))
    self.norm_weight = make_param(None, ones_init, (H, HEADDIM), pd, ("heads", "kv"))
    self.out_proj = Dense(
      (H, HEADDIM),
      d,
      ("heads", "kv", "embed"),
      kernel_init=torch_default_init(self.d_inner, 1.0 / math.sqrt(L)),
      **kw,
    )

  # ---- state ----------------------------------------------------------------------------------
  def init_state(self, batch: int) -> dict:
    memory = jnp.zeros((batch, self.num_heads, self.d_state, self.head_dim), jnp.float32)
    return {"memory": memory, "conv": {"xBC": self.conv.init_cache(batch)}}

  def init_cache(self, batch: int, max_len: int | None = None) -> dict:
    """Decode cache: the state."""
    del max_len
    return self.init_state(batch)

  def prefill(self, x, cache):
    return self(x, initial_state=cache)

  # ---- pieces shared by the sequence and the step -------------------------------------------
  def _split_in(self, u):
    """u [..., d] -> (z, xBC before the conv, dt before its bias), the in_proj's [z, xBC, dt]."""
    zxbcdt = self.in_proj(u)
    e = self.d_inner
    return zxbcdt[..., :e], zxbcdt[..., e : e + self.conv_dim], zxbcdt[..., e + self.conv_dim :]

  def _ssm_inputs(self, xbc, dt_raw):
    """Conv output [..., conv_dim] and dt [..., H] -> (x [..., H, P], B and C [..., 1, N], v = dt x
    in the compute dtype, log decay dt A [..., H] float32)."""
    e, N = self.d_inner, self.d_state
    x = xbc[..., :e].reshape(xbc.shape[:-1] + (self.num_heads, self.head_dim))
    B, C = xbc[..., None, e : e + N], xbc[..., None, e + N :]
    dt = jax.nn.softplus(dt_raw.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
    log_alpha = -jnp.exp(self.A_log[...].astype(jnp.float32)) * dt
    v = (dt[..., None] * x.astype(jnp.float32)).astype(self.dtype)
    return x, B.astype(self.dtype), C.astype(self.dtype), v, log_alpha

  def _out(self, o, x, z):
    """o = C^T h [..., H, P] -> out_proj(RMSNorm((o + D x) * SiLU(z)) * w)."""
    y = o.astype(jnp.float32) + self.D[...].astype(jnp.float32)[:, None] * x.astype(jnp.float32)
    z = z.reshape(z.shape[:-1] + (self.num_heads, self.head_dim))
    y = silu_gated_rms_norm(y, z, self.norm_weight[...], NORM_EPS, axes=(-2, -1))
    return self.out_proj(y.astype(self.dtype))

  # ---- the mixer ------------------------------------------------------------------------------
  def __call__(self, u, *, initial_state=None, segment_ids=None, states_at=None):
    """u [B, T, d] -> (y [B, T, d], final state); states_at (positions [P], static, sorted, in
    [1, T]): a third entry, the state after each position (leaves [B, P, ...])."""
    if initial_state is None:
      initial_state = self.init_state(u.shape[0])
    z, xbc_in, dt_raw = self._split_in(u)
    cache = initial_state["conv"]["xBC"]
    xbc, new_cache = short_conv(self.conv, xbc_in, cache, segment_ids)
    x, B, C, v, log_alpha = self._ssm_inputs(xbc, dt_raw)
    o, memory, *at = ops.gla(
      C,
      B,
      v,
      log_alpha,
      scale=1.0,
      initial_state=initial_state["memory"],
      output_final_state=True,
      segment_ids=segment_ids,
      impl=self.impl,
      chunk_size=self.chunk_size,
      kernel_config=self.kernel_config,
      **states_kw(states_at),
    )
    y = self._out(o, x, z)
    state = {"memory": memory, "conv": {"xBC": new_cache}}
    if states_at is None:
      return y, state
    conv_at = self.conv.caches_at(xbc_in, cache, states_at, segment_ids)
    return y, state, {"memory": at[0], "conv": {"xBC": conv_at}}

  def step(self, u_t, state):
    """u_t [B, d] -> (y_t [B, d], new state)."""
    z, xbc_in, dt_raw = self._split_in(u_t)
    xbc, cache = self.conv.step(xbc_in, state["conv"]["xBC"])
    x, B, C, v, log_alpha = self._ssm_inputs(xbc, dt_raw)
    o, memory = ops.gla_step(
      C, B, v, log_alpha, state["memory"], scale=1.0, kernel_config=self.kernel_config
    )
    return self._out(o, x, z), {"memory": memory, "conv": {"xBC": cache}}
