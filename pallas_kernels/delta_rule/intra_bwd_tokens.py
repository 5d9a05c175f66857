"""The intra-chunk backward, token-parallel: one program per (batch, token row t, `heads` heads)
turns the summed partial gradients of the partials kernel (backward._bwd_partials_kernel: dP,
dL, dWt, dKbar, dQbar, dg_last, one copy per V block) into the token's dq, dk, dw, dg and its
direct log-decay term:

  row loop over the earlier tokens j of t's chunk (j < t):
    X_q += dP_tj w_j e_tj,  X_k += dL_tj w_j e_tj
  column loop over the later tokens r (r > t):
    Y_w += (dP_rt q_r + dL_rt k_r) e_rt
  with e_rj = exp(min(g_r - g_j, 0)) (exact, as everywhere), dP scaled and both masked to the
  token's segment; then the per-token terms below.

No step reduces over a tile's rows: each loop accumulates a [heads, K] row (the forward's
token_loop pair kernel has the same structure). The direct log-decay term
dla_x_t = sum_{j<t} dWt_j Wt_j (Wt_j = w_j exp(g_last - g_j)) is a prefix over the chunk: the
kernel writes token t's own term and the reverse cumsum adds the exclusive prefix, in token
order (faster than a row loop summing it here: docs/decisions.md). Emitting the
prefix rather than +t at the chunk's last row and -t at j avoids cancelling O(1) terms where
exp(g_last - g_j) == 1 (e.g. padded tails).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.delta_rule.tiles import key_tiles, launch_params, times_beta, write_parts
from pallas_kernels.kernel_math import exp_for_mode

# The kernel's inputs, in order (then pid with segments): q, k, w, g and the partials.
_INPUTS = ("q", "k", "w", "g", "dp", "dl", "dwt", "dkbar", "dqbar", "dgl")


def _vblock_sum(ref, b, h, num_vb, *idx):
  """Sum over the V blocks (axis 2) of a per-V-block partial: ref[b, h, :, *idx]."""
  acc = ref[(b, h, 0) + idx]
  for j in range(1, num_vb):
    acc = acc + ref[(b, h, j) + idx]
  return acc


def _token_kernel(*refs, chunk, scale, has_seg, num_vb, heads, exp, ktiles):
  """Token t = program_id(1)'s gradients for `heads` heads, key tile by key tile (ktiles:
  tiles.key_tiles; every term is per channel but a scalar write's gradient, a sum over K)."""
  names = _INPUTS + (("pid",) if has_seg else ())
  r = dict(zip(names, refs[: len(names)]))
  outs = refs[len(names) :]
  b, t = pl.program_id(0), pl.program_id(1)
  hs = pl.ds(pl.program_id(2) * heads, heads)
  kw = dict(chunk=chunk, scale=scale, has_seg=has_seg, num_vb=num_vb, exp=exp)
  dbeta = None
  for ks in ktiles:
    part = _token_key_tile(r, outs, b, t, hs, ks, **kw)
    dbeta = part if dbeta is None else dbeta + part
  if dbeta is not None:  # a scalar write: its gradient <dw, k>, summed over the key tiles
    outs[2][b, t, hs] = dbeta


def _token_key_tile(r, outs, b, t, hs, ks, *, chunk, scale, has_seg, num_vb, exp):
  """Token t's dq, dk, dw, dg and direct log-decay term on the key columns ks; with a scalar
  write, returns the columns' share of its gradient (None otherwise)."""
  dq_ref, dk_ref, dw_ref, dg_ref, dla_ref = outs
  C = chunk
  c = lax.div(t, jnp.asarray(C, t.dtype))  # (C as t's int32: under x64 a Python int is int64)
  r0 = c * C
  t_last = r0 + C - 1
  i = t - r0
  f32 = jnp.float32

  def row(name, j):
    return r[name][b, j, hs, ks].astype(f32)

  def vsum(name, *idx):
    return _vblock_sum(r[name], b, hs, num_vb, *idx)

  pid_t = r["pid"][b, t] if has_seg else None

  def same(j, x):
    """x ([heads]) where token j shares token t's segment, else 0."""
    return jnp.where(r["pid"][b, j] == pid_t, x, 0.0) if has_seg else x

  q, k, g = row("q", t), row("k", t), row("g", t)
  # a scalar write (write = beta_t k): k's row, already loaded, times beta_t
  beta_t = None if len(r["w"].shape) == 4 else r["w"][b, t, hs].astype(f32)
  w = row("w", t) if beta_t is None else beta_t[:, None] * k

  def row_step(j, acc):
    dq_acc, dk_acc = acc
    wj, beta = write_parts(r["w"], r["k"], b, j, hs, ks)  # (beta: folded into dP and dL)
    we = wj * exp(jnp.minimum(g - row("g", j), 0.0))
    dpj = times_beta(same(j, scale * vsum("dp", t, j - r0)), beta)[:, None]
    dlj = times_beta(same(j, vsum("dl", t, j - r0)), beta)[:, None]
    return dq_acc + dpj * we, dk_acc + dlj * we

  def col_step(rr, dw_acc):
    e = exp(jnp.minimum(row("g", rr) - g, 0.0))
    dpv = same(rr, scale * vsum("dp", rr, i))[:, None]
    dlv = same(rr, vsum("dl", rr, i))[:, None]
    return dw_acc + (dpv * row("q", rr) + dlv * row("k", rr)) * e

  zeros = jnp.zeros_like(q)
  dq_acc, dk_acc = lax.fori_loop(r0, t, row_step, (zeros, zeros))
  dw_acc = lax.fori_loop(t + 1, r0 + C, col_step, zeros)
  # P's diagonal (decay factor exactly 1) enters apart: its contributions to dg cancel exactly,
  # and leaving them in the loops would swamp tiny decay gradients with rounding noise.
  p_diag = scale * vsum("dp", t, i)[:, None]
  dwt, dkbar, dqbar = (vsum(n, t, ks) for n in ("dwt", "dkbar", "dqbar"))
  # exp(g_last - g_t), zero outside the chunk's last segment
  e_last = exp(jnp.minimum(row("g", t_last) - g, 0.0))
  if has_seg:
    e_last = jnp.where(r["pid"][b, t_last] == pid_t, e_last, 0.0)
  e0 = exp(g)
  out = (b, t, hs, ks)
  dq_ref[out] = (dq_acc + p_diag * w + scale * dqbar * e0).astype(dq_ref.dtype)
  dw = dw_acc + p_diag * q + dwt * e_last
  dk = dk_acc + dkbar * e0
  dbeta = None
  if beta_t is not None:  # through write = beta k: d beta = <dw, k>, and k's share beta dw
    dk = dk + beta_t[:, None] * dw
    dbeta = jnp.sum(dw * k, axis=1)
  else:
    dw_ref[out] = dw
  dk_ref[out] = dk.astype(dk_ref.dtype)
  dg = q * dq_acc + k * dk_acc - w * dw_acc + dqbar * ((scale * q) * e0) + dkbar * (k * e0)
  dg_ref[out] = dg + jnp.where(t == t_last, vsum("dgl", c, ks), 0.0)
  dla_ref[out] = dwt * w * e_last
  return dbeta


def intra_backward_tokens(
  q,
  k,
  w,
  g,
  pid,
  partials,
  *,
  chunk,
  scale,
  interpret,
  cfg,
  cfg_prec,
  dq_dtype=jnp.float32,
  dk_dtype=jnp.float32,
):
  """(dq, dk, dw, dg, dla_terms) [B, T, H, K] (dq, dk in their dtypes, the rest fp32; with a
  per-token scalar write w [B, T, H] (write = w k) dw is that scalar's gradient, [B, T, H], and
  dk includes the write's share) from the
  partials kernel's outputs (dp, dl [B, H, NVB, T, C]; dwt, dkbar, dqbar [B, H, NVB, T, K]; dgl
  [B, H, NVB, NC, K]); dg is the gradient of the chunk-local cumsum g, and the direct log-decay
  term is the exclusive prefix of dla_terms within each chunk."""
  bsz, t, nh, kd = k.shape
  heads = math.gcd(cfg.pair_heads, nh)
  has_seg = pid is not None
  lane = lambda dtype=jnp.float32: jax.ShapeDtypeStruct((bsz, t, nh, kd), dtype)
  return pl.pallas_call(
    functools.partial(
      _token_kernel,
      chunk=chunk,
      scale=scale,
      has_seg=has_seg,
      num_vb=partials[0].shape[2],
      heads=heads,
      exp=exp_for_mode(cfg_prec),
      ktiles=key_tiles(kd, cfg),
    ),
    out_shape=(lane(dq_dtype), lane(dk_dtype), jax.ShapeDtypeStruct(w.shape, jnp.float32))
    + (lane(),) * 2,
    grid=(bsz, t, nh // heads),
    name="delta_rule_intra_bwd_tokens",
    **launch_params(interpret, cfg.num_warps_intra_bwd, cfg),
  )(q, k, w, g, *partials, *([pid] if has_seg else []))
