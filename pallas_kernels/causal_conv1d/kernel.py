"""Pallas kernels of the causal depthwise convolution (width W) with optional SiLU.

Per (batch, head) and channel i, with tap weights w[0..W-1] (w[W-1] on the current token):
    pre_t = sum_j w[W-1-j] * src_j(t),   y_t = silu(pre_t) (or pre_t),
    src_j(t) = x[t-j]                    if the token t-j is in t's segment (pos_t >= j),
             = cache[W-1 + pos_t - j]     otherwise (every segment starts from the given cache),
pos_t being t's position inside its segment (= t without segments). This is
kdn_jax.layers.short_conv.ShortConv's convolution; the cache holds the W-1 inputs before the
sequence, oldest first, rounded to x's dtype as the layer does.

Grid (B, T / block_t, H); every program runs over its block's rows ([1, K] each, K = one head's
channels) with a `lax.fori_loop`: row loads at (clamped) dynamic row offsets, so no shifted
register blocks (which Triton cannot slice) and no padded copy of x in front of the sequence.
  forward:  y_t from W row loads.
  backward: dx_t = sum_j [pos_{t+j} >= j] w[W-1-j] * dpre_{t+j}, dpre_s = dy_s silu'(pre_s)
            recomputed at the W rows s = t..t+W-1 (no dpre array in HBM, no serial carry of rows);
            the weight and cache gradients accumulate per program in ONE carried [R, K] array
            (rows 0..W-1: dw[W-1-j] by tap j; rows W..2W-2: dcache) and are summed outside.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import common


def acc_rows(width):
  """Rows of the per-program gradient accumulator: W taps + W-1 cache rows, to a power of 2."""
  return 1 << (2 * width - 2).bit_length()


def _sigmoid(x):
  return 1.0 / (1.0 + jnp.exp(-x))


class _Rows:
  """Row access of one program (batch b, head h): x rows, positions, cache rows, weights."""

  def __init__(self, x_ref, w_ref, cache_ref, pos_ref, b, h, t_pad, width, x_dtype):
    self.x_ref, self.pos_ref, self.b, self.h, self.t_pad, self.width = x_ref, pos_ref, b, h, t_pad, width
    # the layer rounds the cache to x's dtype before the products (ShortConv: xp's concat)
    self.cache = [cache_ref[b, c, pl.ds(h, 1), :].astype(x_dtype).astype(jnp.float32)
                  for c in range(width - 1)]
    self.w = [w_ref[i, pl.ds(h, 1), :].astype(jnp.float32) for i in range(width)]

  def pos(self, t):
    """[1, 1] position of token t inside its segment (t itself without segments)."""
    if self.pos_ref is None:
      return jnp.full((1, 1), t, jnp.int32)
    return self.pos_ref[self.b, pl.ds(t, 1)][:, None]

  def x(self, t):
    return self.x_ref[self.b, pl.ds(t, 1), self.h, :].astype(jnp.float32)

  def cache_row(self, c):
    """Cache row c ([1, 1] int in [0, W-2] where used) as a [1, K] value: a select chain over
    the W-1 rows loaded once per program."""
    out = jnp.zeros_like(self.cache[0])
    for i, row in enumerate(self.cache):
      out = jnp.where(c == i, row, out)
    return out

  def src(self, t, pos, j):
    """src_j(t): x[t-j] inside the segment, else the cache row it starts from."""
    xr = self.x(jnp.maximum(t - j, 0))
    if j == 0:
      return xr
    return jnp.where(pos >= j, xr, self.cache_row(self.width - 1 + pos - j))

  def pre(self, t, pos):
    acc = jnp.zeros_like(self.w[0])
    for j in range(self.width):
      acc = acc + self.w[self.width - 1 - j] * self.src(t, pos, j)
    return acc


def _forward_kernel(*refs, width, block_t, activation, has_pos):
  x_ref, w_ref, cache_ref = refs[:3]
  pos_ref = refs[3] if has_pos else None
  y_ref = refs[-1]
  b, i, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  rows = _Rows(x_ref, w_ref, cache_ref, pos_ref, b, h, x_ref.shape[1], width, x_ref.dtype)

  def body(r, carry):
    t = i * block_t + r
    pre = rows.pre(t, rows.pos(t))
    y = pre * _sigmoid(pre) if activation else pre
    y_ref[b, pl.ds(t, 1), h, :] = y.astype(y_ref.dtype)
    return carry

  lax.fori_loop(0, block_t, body, jnp.int32(0))


def _backward_kernel(*refs, width, block_t, activation, has_pos):
  x_ref, w_ref, cache_ref = refs[:3]
  pos_ref, rest = (refs[3], refs[4:]) if has_pos else (None, refs[3:])
  dy_ref, dx_ref, acc_ref = rest
  b, i, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  t_pad = x_ref.shape[1]
  rows = _Rows(x_ref, w_ref, cache_ref, pos_ref, b, h, t_pad, width, x_ref.dtype)
  n_acc = acc_ref.shape[3]
  row_id = jnp.arange(n_acc, dtype=jnp.int32)[:, None]   # 1-D iota: what every backend lowers

  def dpre(s, pos):
    """dL/dpre at row s (0 past the padded end: those rows do not exist)."""
    sc = jnp.minimum(s, t_pad - 1)
    dy = dy_ref[b, pl.ds(sc, 1), h, :].astype(jnp.float32)
    if activation:
      pre = rows.pre(sc, pos)
      sg = _sigmoid(pre)
      dy = dy * sg * (1.0 + pre * (1.0 - sg))
    return jnp.where(s < t_pad, dy, 0.0)

  def body(r, acc):
    t = i * block_t + r
    pos_t = rows.pos(t)
    dx = jnp.zeros_like(rows.w[0])
    for j in range(width):
      s = t + j
      pos_s = rows.pos(jnp.minimum(s, t_pad - 1))
      g = dpre(s, pos_s)
      if j == 0:
        g_t = g
      # token t feeds row s through tap j only when s's segment started at or before t
      dx = dx + jnp.where(pos_s >= j, rows.w[width - 1 - j] * g, 0.0)
    dx_ref[b, pl.ds(t, 1), h, :] = dx.astype(dx_ref.dtype)
    for j in range(width):
      acc = acc + jnp.where(row_id == j, g_t * rows.src(t, pos_t, j), 0.0)
      if j > 0:
        # rows before the segment start read cache row W-1+pos-j: its gradient
        c = width - 1 + pos_t - j
        share = jnp.where(pos_t < j, rows.w[width - 1 - j] * g_t, 0.0)
        acc = acc + jnp.where(row_id == width + c, share, 0.0)
    return acc

  acc = lax.fori_loop(0, block_t, body, jnp.zeros((n_acc, x_ref.shape[-1]), jnp.float32))
  acc_ref[b, i, h, :, :] = acc


def _params(interpret, cfg):
  return dict(interpret=interpret,
              compiler_params=common.compiler_params(cfg.num_warps, cfg.num_stages))


def forward(x, w, cache, pos, *, activation, interpret, cfg):
  """x [B,T,H,K] (T a multiple of cfg.block_t), w [W,H,K], cache [B,W-1,H,K], pos [B,T] int32
  or None -> y [B,T,H,K] in x's dtype."""
  bsz, t, nh, _ = x.shape
  width = w.shape[0]
  kern = functools.partial(_forward_kernel, width=width, block_t=cfg.block_t,
                           activation=activation, has_pos=pos is not None)
  args = (x, w, cache) + (() if pos is None else (pos,))
  return pl.pallas_call(kern, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                        grid=(bsz, t // cfg.block_t, nh), name="causal_conv1d_fwd",
                        **_params(interpret, cfg))(*args)


def backward(x, w, cache, pos, dy, *, activation, interpret, cfg):
  """-> (dx [B,T,H,K] x.dtype, per-program accumulators [B, T/block_t, H, R, K] f32: rows
  0..W-1 = dw by tap j (weight index W-1-j), rows W..2W-2 = dcache)."""
  bsz, t, nh, kd = x.shape
  width = w.shape[0]
  nb = t // cfg.block_t
  kern = functools.partial(_backward_kernel, width=width, block_t=cfg.block_t,
                           activation=activation, has_pos=pos is not None)
  args = (x, w, cache) + (() if pos is None else (pos,)) + (dy,)
  return pl.pallas_call(
      kern, out_shape=(jax.ShapeDtypeStruct(x.shape, x.dtype),
                       jax.ShapeDtypeStruct((bsz, nb, nh, acc_rows(width), kd), jnp.float32)),
      grid=(bsz, nb, nh), name="causal_conv1d_bwd", **_params(interpret, cfg))(*args)
