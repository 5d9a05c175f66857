"""Pallas kernels of the causal depthwise convolution (width W) with optional SiLU and an optional
L2 normalisation of each output row over its K channels (the recurrent layers' q and k:
y_t <- y_t / sqrt(|y_t|^2 + L2_EPS) in fp32, of y_t rounded to x's dtype first, as
kdn_jax.layers.short_conv composes it (the backward keeps the normalisation's cotangent in fp32,
where the composition rounds it); the bf16 layer check, experiments/benchmarks/check_fusion.py, found the
unrounded variant 4x further from the fp32 layer in the q/k gradients (kdn_iso, T=40), the
rounded one as close as the composition).

Per (batch, head) and channel i, with tap weights w[0..W-1] (w[W-1] on the current token):
    pre_t = sum_j w[W-1-j] * src_j(t),   y_t = silu(pre_t) (or pre_t),
    src_j(t) = x[t-j]                    if the token t-j is in t's segment (pos_t >= j),
             = cache[W-1 + pos_t - j]     otherwise (every segment starts from the given cache),
pos_t being t's position inside its segment (= t without segments): 0 at a segment start, else
pos_{t-1} + 1 (the kernels rely on that). This is kdn_jax.layers.short_conv.ShortConv's
convolution; the cache holds the W-1 inputs before the sequence, oldest first, rounded to x's
dtype as the layer does.

Grid (B, T / block_t, H); every program runs over its block's rows ([1, K] each, K = one head's
channels) with token_loop.blocked_loop (the loads of ConvConfig.load_block rows issued together,
the next block's ahead). Triton cannot slice or shift register tiles, so the rows a step shares
with its neighbours travel in the loop carry as separate [1, K] values (renaming them is free)
and every step reads one new x row at a dynamic offset:
  forward (ascending t): carries src_0..src_{W-2} of row t-1; row t's window is that shifted by
            one (or the cache rows at a segment start) plus x_t.
  backward (descending t): carries x_t..x_{t-W+2} (loads x_{t-W+1}), dpre of the W-1 rows after
            t, zeroed where those rows' segments start after t (so dx_t = sum_j w[W-1-j] *
            dpre_{t+j} with no per-term test; dpre_s = dy_s silu'(pre_s) is computed once per
            row), and the weight / cache gradients as W + (W-1) separate [1, K] f32 sums, written
            once per program as rows of [B, T / block_t, H, 2W-1, K] and summed outside.
            The W-1 rows after the block (the next block's) are recomputed before the loop.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import common
from pallas_kernels.kernel_math import exp_for, sigmoid
from pallas_kernels.token_loop import blocked_loop


def acc_rows(width):
  """Rows of the per-program gradient output: dw by tap j (rows 0..W-1), dcache (W..2W-2)."""
  return 2 * width - 1


L2_EPS = 1e-6  # (kdn_jax.layers.short_conv.l2_normalize, the reference, uses this one)


def _l2_inverse_norm(z):
  return lax.rsqrt(jnp.sum(z * z, axis=1, keepdims=True) + L2_EPS)


class _Rows:
  """Row access of one program (batch b, head h): x rows, positions, cache rows, weights."""

  def __init__(self, x_ref, w_ref, cache_ref, pos_ref, b, h, width, x_dtype):
    self.x_ref, self.pos_ref, self.b, self.h, self.width = x_ref, pos_ref, b, h, width
    # the layer rounds the cache to x's dtype before the products (ShortConv: xp's concat)
    self.cache = [
      cache_ref[b, c, pl.ds(h, 1), :].astype(x_dtype).astype(jnp.float32) for c in range(width - 1)
    ]
    self.w = [w_ref[i, pl.ds(h, 1), :].astype(jnp.float32) for i in range(width)]

  def pos(self, t):
    """[1, 1] position of token t inside its segment (t itself without segments)."""
    if self.pos_ref is None:
      return jnp.full((1, 1), t, jnp.int32)
    return self.pos_ref[self.b, pl.ds(t, 1)][:, None]

  def x(self, t):
    """x row max(t, 0) as f32 (a row before the sequence: row 0, then replaced by the cache)."""
    return self.x_raw(t).astype(jnp.float32)

  def x_raw(self, t):
    """x row max(t, 0) as loaded (the row loops convert it where they use it)."""
    return self.x_ref[self.b, pl.ds(jnp.maximum(t, 0), 1), self.h, :]

  def cache_row(self, c, lo=0):
    """Cache row c ([1, 1] int, in [lo, W-2] where used) as a [1, K] value: a select chain over
    the rows loaded once per program."""
    out = self.cache[lo]
    for i in range(lo + 1, self.width - 1):
      out = jnp.where(c == i, self.cache[i], out)
    return out

  def src(self, xr, pos, j, min_pos=0):
    """src_j(t) from xr = x[t-j]: the cache row instead before t's segment start (pos < j).
    With pos >= min_pos only cache rows from W-1+min_pos-j on are read: a shorter select chain."""
    if j <= min_pos:
      return xr
    lo = max(self.width - 1 + min_pos - j, 0)
    return jnp.where(pos >= j, xr, self.cache_row(self.width - 1 + pos - j, lo=lo))

  def pre(self, t, pos):
    """pre_t from W row loads (the rows next to a program's block only)."""
    acc = jnp.zeros_like(self.w[0])
    for j in range(self.width):
      acc = acc + self.w[self.width - 1 - j] * self.src(self.x(t - j), pos, j)
    return acc


def _forward_kernel(*refs, width, block_t, activation, has_pos, normalize, load_block):
  x_ref, w_ref, cache_ref = refs[:3]
  pos_ref = refs[3] if has_pos else None
  y_ref = refs[-1]
  b, i, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  rows = _Rows(x_ref, w_ref, cache_ref, pos_ref, b, h, width, x_ref.dtype)
  w = rows.w
  t0 = i * block_t
  # src_0..src_{W-2} of row t0-1; in front of the sequence a virtual row at position -1, whose
  # window is the cache (pos_{t0-1} <= t0-1 elsewhere)
  pos_prev = jnp.minimum(rows.pos(jnp.maximum(t0 - 1, 0)), t0 - 1)
  prev = tuple(rows.src(rows.x(t0 - 1 - j), pos_prev, j, min_pos=-1) for j in range(width - 1))

  def load(r):
    t = t0 + r
    return rows.x_raw(t), (rows.pos(t) if has_pos else None)

  def step(r, loaded, prev):
    t = t0 + r
    x_t, pos_t = loaded
    src = [x_t.astype(jnp.float32)] + list(prev)
    if has_pos:
      # a segment start reads the cache: src_j = cache[W-1-j]; elsewhere src_j(t) = src_{j-1}(t-1)
      start = pos_t == 0
      src[1:] = [jnp.where(start, rows.cache[width - 1 - j], src[j]) for j in range(1, width)]
    # (without segments only t = 0 starts one: t0 - 1's virtual window above)
    pre = w[width - 1] * src[0]
    for j in range(1, width):
      pre = pre + w[width - 1 - j] * src[j]
    y = pre * sigmoid(pre, exp_for(x_ref.dtype)) if activation else pre
    if normalize:  # the conv output rounded to x's dtype, as the layer's composition has it
      y = y.astype(x_ref.dtype).astype(jnp.float32)
      y = y * _l2_inverse_norm(y)
    y_ref[b, pl.ds(t, 1), h, :] = y.astype(y_ref.dtype)
    return tuple(src[: width - 1])

  blocked_loop(block_t, load_block, load, step, prev)


def _backward_kernel(*refs, width, block_t, activation, has_pos, normalize, load_block):
  x_ref, w_ref, cache_ref = refs[:3]
  pos_ref, rest = (refs[3], refs[4:]) if has_pos else (None, refs[3:])
  dy_ref, dx_ref, acc_ref = rest
  b, i, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  t_pad = x_ref.shape[1]
  rows = _Rows(x_ref, w_ref, cache_ref, pos_ref, b, h, width, x_ref.dtype)
  w = rows.w
  t_last = i * block_t + block_t - 1
  zero = jnp.zeros_like(w[0])

  def dpre(dy, pre):
    sg = sigmoid(pre, exp_for(x_ref.dtype)) if activation else None
    if normalize:  # dy -> the cotangent of z = silu(pre) (or pre) through y = z / |z|
      z = pre * sg if activation else pre
      z = z.astype(x_ref.dtype).astype(jnp.float32)  # the forward's rounding
      inv = _l2_inverse_norm(z)
      n = z * inv
      dy = inv * (dy - n * jnp.sum(dy * n, axis=1, keepdims=True))
    if not activation:
      return dy
    return dy * sg * (1.0 + pre * (1.0 - sg))

  # dpre of rows t_last+k (the next block's; 0 past the padded end), zeroed unless row t_last
  # is in their segment (pos >= k): exactly the terms dx_{t_last} takes from them
  after = []
  for k in range(1, width):
    s = jnp.minimum(t_last + k, t_pad - 1)
    pos_s = rows.pos(s)
    g = dpre(dy_ref[b, pl.ds(s, 1), h, :].astype(jnp.float32), rows.pre(s, pos_s))
    after.append(jnp.where(t_last + k < t_pad, jnp.where(pos_s >= k, g, 0.0), 0.0))
  xs = tuple(rows.x(t_last - j) for j in range(width - 1))  # x_t .. x_{t-W+2}

  def load(r):
    t = t_last - r
    return rows.pos(t), rows.x_raw(t - width + 1), dy_ref[b, pl.ds(t, 1), h, :]

  def step(r, loaded, carry):
    xs, after, dw, dc = carry
    t = t_last - r
    pos, x_new, dy = loaded
    xw = xs + (x_new.astype(jnp.float32),)
    src = [xw[0]] + [rows.src(xw[j], pos, j) for j in range(1, width)]
    pre = w[width - 1] * src[0]
    for j in range(1, width):
      pre = pre + w[width - 1 - j] * src[j]
    g = dpre(dy.astype(jnp.float32), pre)
    dx = w[width - 1] * g
    for k in range(1, width):
      dx = dx + w[width - 1 - k] * after[k - 1]
    dx_ref[b, pl.ds(t, 1), h, :] = dx.astype(dx_ref.dtype)
    dw = tuple(dw[j] + g * src[j] for j in range(width))
    # rows before t's segment start read cache row c = W-1+pos-j through tap j, i.e. weight
    # c - pos: a select of that weight (0 where pos > c)
    dc_new = []
    for c in range(width - 1):
      wc = zero
      for m in range(c + 1):
        wc = jnp.where(pos == c - m, w[m], wc)
      dc_new.append(dc[c] + g * wc)
    after = (g,) + after[: width - 2]
    if has_pos:
      # a segment starts at t: the rows after it do not read t-1 or earlier
      after = tuple(jnp.where(pos == 0, 0.0, a) for a in after)
    # (without segments only t = 0 starts one, the last step of block 0)
    return xw[1:], after, dw, tuple(dc_new)

  init = (xs, tuple(after), (zero,) * width, (zero,) * (width - 1))
  _, _, dw, dc = blocked_loop(block_t, load_block, load, step, init)
  for j, row in enumerate(dw + dc):
    acc_ref[b, i, h, pl.ds(j, 1), :] = row


def _params(interpret, cfg):
  return dict(
    interpret=interpret, compiler_params=common.compiler_params(cfg.num_warps, cfg.num_stages)
  )


def forward(x, w, cache, pos, *, activation, interpret, cfg, normalize=False):
  """x [B,T,H,K] (T a multiple of cfg.block_t), w [W,H,K], cache [B,W-1,H,K], pos [B,T] int32
  or None -> y [B,T,H,K] in x's dtype (normalize: each row L2-normalised over K)."""
  bsz, t, nh, _ = x.shape
  width = w.shape[0]
  kern = functools.partial(
    _forward_kernel,
    width=width,
    block_t=cfg.block_t,
    activation=activation,
    has_pos=pos is not None,
    normalize=normalize,
    load_block=cfg.load_block,
  )
  args = (x, w, cache) + (() if pos is None else (pos,))
  return pl.pallas_call(
    kern,
    out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
    grid=(bsz, t // cfg.block_t, nh),
    name="causal_conv1d_fwd",
    **_params(interpret, cfg),
  )(*args)


def backward(x, w, cache, pos, dy, *, activation, interpret, cfg, normalize=False):
  """-> (dx [B,T,H,K] x.dtype, per-program sums [B, T/block_t, H, 2W-1, K] f32: rows
  0..W-1 = dw by tap j (weight index W-1-j), rows W..2W-2 = dcache)."""
  bsz, t, nh, kd = x.shape
  width = w.shape[0]
  nb = t // cfg.block_t
  kern = functools.partial(
    _backward_kernel,
    width=width,
    block_t=cfg.block_t,
    activation=activation,
    has_pos=pos is not None,
    normalize=normalize,
    load_block=cfg.load_block,
  )
  args = (x, w, cache) + (() if pos is None else (pos,)) + (dy,)
  return pl.pallas_call(
    kern,
    out_shape=(
      jax.ShapeDtypeStruct(x.shape, x.dtype),
      jax.ShapeDtypeStruct((bsz, nb, nh, acc_rows(width), kd), jnp.float32),
    ),
    grid=(bsz, nb, nh),
    name="causal_conv1d_bwd",
    **_params(interpret, cfg),
  )(*args)
