"""The intra-chunk backward, token-parallel (DeltaRuleConfig.intra_bwd='tokens'): one program per
(batch, token row t, `heads` heads) turns the summed partial gradients of the partials kernel
(backward._bwd_partials_kernel: dP, dL, dWt, dKbar, dQbar, dg_last) into the token's dq, dk, dw,
dg and direct log-decay term, the same values as backward._intra_grads:

  row loop over the earlier tokens j of t's chunk (j < t):
    X_q += dP_tj w_j e_tj,  X_k += dL_tj w_j e_tj,  dla_x += dWt_j Wt_j
  column loop over the later tokens r (r > t):
    Y_w += (dP_rt q_r + dL_rt k_r) e_rt
  with e_rj = exp(min(g_r - g_j, 0)) (exact, as everywhere), dP scaled and both masked to the
  token's segment; then the per-token terms (tiles.intra_token_grads).

No step reduces over a tile's rows: each loop accumulates a [heads, K] row (the forward's
token_loop pair kernel has the same structure; backward._pairs_bwd's column loop reduces over the
chunk's rows once per column for Y_w).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.delta_rule.tiles import (
    INTRA_BWD_INPUTS, intra_token_grads, launch_params, vblock_sum)


def _token_kernel(*refs, chunk, scale, has_seg, num_vb, heads, dla_terms):
  names = INTRA_BWD_INPUTS + (("pid",) if has_seg else ())
  r = dict(zip(names, refs[:len(names)]))
  dq_ref, dk_ref, dw_ref, dg_ref, dla_ref = refs[len(names):]
  b, t, hb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  C = chunk
  hs = pl.ds(hb * heads, heads)
  c = lax.div(t, C)
  r0 = c * C
  t_last = r0 + C - 1
  i = t - r0
  f32 = jnp.float32

  def row(name, j):
    return r[name][b, j, hs, :].astype(f32)

  def vsum(name, *idx):
    return vblock_sum(r[name], b, hs, num_vb, *idx)

  pid_t = r["pid"][b, t] if has_seg else None
  pid_last = r["pid"][b, t_last] if has_seg else None

  def same(j, x):
    """x ([heads]) where token j shares token t's segment, else 0."""
    return jnp.where(r["pid"][b, j] == pid_t, x, 0.0) if has_seg else x

  g_last = row("g", t_last)

  def e_last(gj, j):
    """exp(g_last - g_j), zero outside the chunk's last segment."""
    e = jnp.exp(jnp.minimum(g_last - gj, 0.0))
    return jnp.where(r["pid"][b, j] == pid_last, e, 0.0) if has_seg else e

  q, k, w, g = row("q", t), row("k", t), row("w", t), row("g", t)

  def row_step(j, acc):
    dq_acc, dk_acc, dla = acc
    wj, gj = row("w", j), row("g", j)
    we = wj * jnp.exp(jnp.minimum(g - gj, 0.0))
    dpj = same(j, scale * vsum("dp", t, j - r0))[:, None]
    dlj = same(j, vsum("dl", t, j - r0))[:, None]
    if not dla_terms:
      dla = dla + vsum("dwt", j, slice(None)) * wj * e_last(gj, j)
    return dq_acc + dpj * we, dk_acc + dlj * we, dla

  def col_step(rr, dw_acc):
    e = jnp.exp(jnp.minimum(row("g", rr) - g, 0.0))
    dpv = same(rr, scale * vsum("dp", rr, i))[:, None]
    dlv = same(rr, vsum("dl", rr, i))[:, None]
    return dw_acc + (dpv * row("q", rr) + dlv * row("k", rr)) * e

  zeros = jnp.zeros_like(q)
  dq_acc, dk_acc, dla_x = lax.fori_loop(r0, t, row_step, (zeros, zeros, zeros))
  dw_acc = lax.fori_loop(t + 1, r0 + C, col_step, zeros)
  # P's diagonal (decay factor exactly 1) enters apart, as in backward._intra_grads
  p_diag = scale * vsum("dp", t, i)[:, None]
  dwt, dkbar, dqbar = (vsum(n, t, slice(None)) for n in ("dwt", "dkbar", "dqbar"))
  dq, dk, dw, dg = intra_token_grads(q, k, w, g, e_last(g, t), p_diag, dwt, dkbar, dqbar,
                                     (dq_acc, dk_acc, dw_acc), scale)
  out = (b, t, hs, slice(None))
  dq_ref[out] = dq
  dk_ref[out] = dk
  dw_ref[out] = dw
  dg_ref[out] = dg + jnp.where(t == t_last, vsum("dgl", c, slice(None)), 0.0)
  # dla_terms: the token's own term; its prefix over the chunk is summed by the reverse cumsum
  dla_ref[out] = dwt * w * e_last(g, t) if dla_terms else dla_x


def intra_backward_tokens(q, k, w, g, pid, partials, *, chunk, scale, interpret, cfg):
  """(dq, dk, dw, dg, dla) [B, T, H, K] fp32 from the partials kernel's outputs (dp, dl
  [B, H, NVB, T, C]; dwt, dkbar, dqbar [B, H, NVB, T, K]; dgl [B, H, NVB, NC, K]). dla is the
  direct log-decay term dla_x, or with cfg.token_dla == 'cumsum' its per-token terms
  dWt_t Wt_t, whose exclusive prefix within the chunk is dla_x."""
  bsz, t, nh, kd = k.shape
  heads = math.gcd(cfg.pair_heads, nh)
  has_seg = pid is not None
  lane = jax.ShapeDtypeStruct((bsz, t, nh, kd), jnp.float32)
  return pl.pallas_call(
      functools.partial(_token_kernel, chunk=chunk, scale=scale, has_seg=has_seg,
                        num_vb=partials[0].shape[2], heads=heads,
                        dla_terms=cfg.token_dla == "cumsum"),
      out_shape=(lane,) * 5, grid=(bsz, t, nh // heads), name="delta_rule_intra_bwd_tokens",
      **launch_params(interpret, cfg.num_warps_intra_bwd, cfg),
  )(q, k, w, g, *partials, *([pid] if has_seg else []))
