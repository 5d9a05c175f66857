"""Causal depthwise short convolution (width W) + SiLU with a decode cache.

The cache holds the last W-1 *inputs* (oldest first): shape [B, W-1, *channels].
With ``segment_ids`` every packed segment starts from the given cache, exactly as if the
segments were run as separate sequences.

``fused=True`` computes the convolution + SiLU with the Pallas kernel
(pallas_kernels.causal_conv1d, for which the plain-JAX sums below are the reference); the new
cache is formed here either way. ``normalize=True`` L2-normalises each output row over its last
axis (the recurrent mixers' q and k) in float32, after the rounding to the conv's dtype; the
fused kernel does the same inside (no pass over the conv output through memory).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from kdn_jax.layers.dense import make_param, normal_init, zeros_init

# (defined with the conv kernel, the lowest package that needs them; re-exported here)
from pallas_kernels.causal_conv1d import L2_EPS, causal_conv1d, positions_in_segment


def l2_normalize(x, eps=L2_EPS):
  """x / sqrt(|x|^2 + eps) over the last axis, in float32 (the fused conv kernel's eps)."""
  xf = x.astype(jnp.float32)
  return xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + eps)


class ShortConv(nnx.Module):
  def __init__(
    self,
    channels: tuple[int, ...],
    width: int = 4,
    *,
    names=("heads", "kv"),
    activation=True,
    use_bias=False,
    weight_init=None,
    bias_init=zeros_init,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    rngs: nnx.Rngs,
  ):
    """weight_init: None = N(0, 1/W); use_bias: a per-channel bias added before the activation
    (mamba_ssm's conv1d has one; the fused kernel has none, so such a conv runs the plain path)."""
    self.channels, self.width, self.dtype, self.activation = (
      tuple(channels),
      int(width),
      dtype,
      activation,
    )
    if self.width < 1:
      raise ValueError(f"conv_size must be >= 1, got {width}")
    self.weight = make_param(
      rngs,
      weight_init or normal_init(1.0 / math.sqrt(self.width)),
      (self.width,) + self.channels,
      param_dtype,
      ("conv",) + tuple(names),
    )
    self.bias = (
      make_param(rngs, bias_init, self.channels, param_dtype, tuple(names)) if use_bias else None
    )

  def init_cache(self, batch: int) -> jax.Array:
    return jnp.zeros((batch, self.width - 1) + self.channels, jnp.float32)  # caches are kept in f32

  def _act(self, y):
    """The activation of the causal sums y (float32), after the bias when there is one."""
    if self.bias is not None:
      y = y + self.bias[...].astype(jnp.float32)
    return jax.nn.silu(y) if self.activation else y

  def fusable(self) -> bool:
    """Whether the Pallas kernel covers this conv: channels (H, K), width >= 2, no bias."""
    return len(self.channels) == 2 and self.width >= 2 and self.bias is None

  def __call__(self, x, cache=None, segment_ids=None, *, fused=False, normalize=False, config=None):
    """x [B, T, *C] -> (y [B, T, *C], new_cache [B, W-1, *C]); normalize: y L2-normalised over
    its last axis (float32 on the plain path, the conv's dtype from the kernel); config: the
    kernel's ConvConfig (None: the tuned one)."""
    B, T = x.shape[:2]
    if cache is None:
      cache = self.init_cache(B)
    x = x.astype(self.dtype)
    xp = jnp.concatenate([cache.astype(self.dtype), x], axis=1)  # [B, W-1+T, C]
    pos = None if segment_ids is None else positions_in_segment(segment_ids)
    if fused and self.fusable():
      y = causal_conv1d(
        x,
        self.weight[...],
        cache,
        segment_ids,
        activation=self.activation,
        normalize=normalize,
        config=config,
      )
    else:
      y = self._act(self._conv(xp, T, pos)).astype(self.dtype)
      y = l2_normalize(y) if normalize else y
    return y, self._new_cache(xp, T, pos)

  def _conv(self, xp, T, pos):
    """The causal sums in fp32 (before the activation): the kernel's reference."""
    B, W = xp.shape[0], self.width
    w = self.weight[...].astype(jnp.float32)
    extra = (1,) * len(self.channels)
    y = jnp.zeros((B, T) + self.channels, jnp.float32)
    t = jnp.arange(T, dtype=jnp.int32)[None, :]
    for j in range(W):  # tap j looks j steps back
      if pos is None:
        y = y + xp[:, W - 1 - j : W - 1 - j + T].astype(jnp.float32) * w[W - 1 - j]
      else:
        idx = (W - 1) + jnp.where(pos >= j, t - j, pos - j)  # before the segment start -> cache
        idx = jnp.broadcast_to(idx, (B, T)).reshape((B, T) + extra)
        y = y + jnp.take_along_axis(xp, idx, axis=1).astype(jnp.float32) * w[W - 1 - j]
    return y

  def _new_cache(self, xp, T, pos):
    """The last W-1 inputs of every sequence's last segment (oldest first), float32."""
    B, W = xp.shape[0], self.width
    if pos is None:
      return xp[:, T:].astype(jnp.float32)
    extra = (1,) * len(self.channels)
    pos_last = pos[:, -1:]
    cols = []
    for j in range(W - 2, -1, -1):  # oldest first
      idx = (W - 1) + jnp.where(pos_last >= j, T - 1 - j, pos_last - j)
      cols.append(jnp.take_along_axis(xp, idx.reshape((B, 1) + extra), axis=1))
    new_cache = jnp.concatenate(cols, axis=1) if cols else xp[:, :0]
    return new_cache.astype(jnp.float32)

  def caches_at(self, x, cache, positions, segment_ids=None):
    """The cache after each position p (the last W-1 inputs before p of p - 1's segment, its
    earlier part from ``cache`` where that segment began less than W-1 tokens before):
    x [B, T, *C], positions [P] ints in [1, T] -> [B, P, W-1, *C] float32."""
    B, T = x.shape[:2]
    W = self.width
    if cache is None:
      cache = self.init_cache(B)
    xp = jnp.concatenate([cache.astype(self.dtype), x.astype(self.dtype)], axis=1)
    last = jnp.asarray(positions, jnp.int32)[None, :] - 1  # [1, P]
    pos = last if segment_ids is None else positions_in_segment(segment_ids)[:, last[0]]
    extra = (1,) * len(self.channels)
    cols = []
    for j in range(W - 2, -1, -1):  # oldest first
      idx = (W - 1) + jnp.where(pos >= j, last - j, pos - j)
      idx = jnp.broadcast_to(idx, (B, last.shape[1])).reshape((B, -1) + extra)
      cols.append(jnp.take_along_axis(xp, idx, axis=1))
    if not cols:
      return jnp.zeros((B, last.shape[1], 0) + self.channels, jnp.float32)
    return jnp.stack(cols, axis=2).astype(jnp.float32)

  def step(self, x_t, cache):
    """x_t [B, *C] -> (y_t, new_cache)."""
    window = jnp.concatenate(
      [cache.astype(self.dtype), x_t.astype(self.dtype)[:, None]], axis=1
    )  # [B, W, C]
    y = jnp.sum(window.astype(jnp.float32) * self.weight[...].astype(jnp.float32)[None], axis=1)
    return self._act(y).astype(self.dtype), window[:, 1:].astype(jnp.float32)
