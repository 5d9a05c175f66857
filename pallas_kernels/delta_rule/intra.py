"""Intra-chunk forward stage: per (batch, head, chunk), the decay-weighted pair products
L (strict) and P (inclusive, scaled), Wt = w exp(g_last - g), then A = (I + L)^-1, W = A Kbar
and U = A V' (the equations: __init__'s docstring). The pair products by _pair_token_loop_kernel,
token-parallel: one program per token row and cfg.pair_heads heads, the row's columns j <= r one
per step. It also forms the chunk-local decay cumsum g from log_alpha (no cumsum kernel runs
before it; a forward-only call keeps only g's chunk-last rows) and writes the decayed operands
Kbar and Qbar, which the WY, state-pass and output kernels read in place of k, q and g. Then
wy.wy_forward: A, W and U from L (no [C, K] tile of the pair products is live in the inverse's
kernel, and no inverse in the pair products' one).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.delta_rule import stages as _stages
from pallas_kernels.delta_rule import wy as _wy
from pallas_kernels.delta_rule.tiles import (
  kernel_precision,
  key_tiles,
  launch_params,
  operand_dtype,
  times_beta,
  write_parts,
  write_rows,
)
from pallas_kernels.kernel_math import exp_for_mode


def _pair_token_loop_kernel(*refs, chunk, scale, has_seg, heads, write_g, exp, ktiles):
  """Row r = program_id(1) of L (strict) and P (scaled, inclusive) for `heads` heads: the row's
  columns j <= r one per step ([heads, K] each, no exps above the diagonal), zeros for the
  columns after r; and the row's Wt, g, Kbar and Qbar.

  The fourth input is log_alpha. The columns go from r down to the chunk start with s = the sum
  of log_alpha over (j, r] in r's segment, which is g_r - g_j (summed directly, no difference of
  two cumsums); after the last column s is g_r. Wt's decay is the sum over (r, t_last], in a
  loop of loads and adds. write_g: g's row is written (the backward reads it); else only the
  chunk's last row, to g_last [B, T / C, H, K] (a forward-only call's state pass reads no other
  row).

  ktiles (tiles.key_tiles): the key columns run tile by tile, each tile's column loop adding
  its share of the row's L and P sums; every other output is per channel.

  Kbar = k exp(g) and Qbar = scale q exp(g) are written in the dots' operand dtype (the type of
  those outputs): the values the WY and output kernels' dots would round them to."""
  n_in = 4 + (1 if has_seg else 0)
  pid_ref = refs[4] if has_seg else None
  b, r = pl.program_id(0), pl.program_id(1)
  C = chunk
  hs = pl.ds(pl.program_id(2) * heads, heads)
  r0 = (r // C) * C
  lrow = prow = None
  for ks in ktiles:
    parts = _pair_key_tile(refs, pid_ref, b, r, r0, hs, ks, C, scale, has_seg, heads, write_g, exp)
    lrow, prow = parts if lrow is None else (lrow + parts[0], prow + parts[1])
  l_out, p_out = refs[n_in : n_in + 2]
  row = (b, hs, r, pl.ds(0, C))
  l_out[row] = lrow.astype(l_out.dtype)
  p_out[row] = prow.astype(p_out.dtype)


def _pair_key_tile(refs, pid_ref, b, r, r0, hs, ks, C, scale, has_seg, heads, write_g, exp):
  """The pair kernel on the key columns ks: writes their Wt, g, Kbar and Qbar and returns their
  share of the row's (L, P) sums, [heads, C] each."""
  q_ref, k_ref, w_ref, la_ref = refs[:4]
  wt_out, g_out, kbar_out, qbar_out = refs[len(refs) - 4 :]
  t_last = r0 + C - 1
  q, k = (x[b, r, hs, ks].astype(jnp.float32) for x in (q_ref, k_ref))
  w = write_rows(w_ref, k_ref, b, r, hs, ks)
  pid_r = pid_ref[b, r] if has_seg else None
  la_row = lambda j: la_ref[b, j, hs, ks].astype(jnp.float32)

  def pair(j, decay):
    """Column j's kept L and scaled P values, [heads] each; decay = g_r - g_j ([heads, K]).
    Without segments decay <= 0 as computed: g is a running sum of log_alpha <= 0 within the
    chunk, and fl(g + la) <= g for la <= 0, so no clamp (4 of the column step's 88 instructions;
    docs/decisions.md). With segments g restarts at a reset, and a masked pair across one could
    overflow exp: clamped."""
    wj, beta = write_parts(w_ref, k_ref, b, j, hs, ks)  # (beta: applied after the sums)
    e = exp(jnp.minimum(decay, 0.0) if has_seg else decay) * wj
    kw, qw = (times_beta(jnp.sum(x * e, axis=1), beta) for x in (k, q))
    keep_l, keep_p = j < r, True
    if has_seg:
      same = pid_ref[b, j] == pid_r
      keep_l, keep_p = keep_l & same, same
    return jnp.where(keep_l, kw, 0.0), scale * jnp.where(keep_p, qw, 0.0)

  # The row's values gathered in registers by a select per column, one [heads, C] store each
  # (faster than a store per column: docs/decisions.md, `pair_token_stores`).
  col = lax.broadcasted_iota(jnp.int32, (heads, C), 1)

  def gather(j, decay, acc):
    lv, pv = pair(j, decay)
    hit = col == j - r0
    return jnp.where(hit, lv[:, None], acc[0]), jnp.where(hit, pv[:, None], acc[1])

  zeros = jnp.zeros((heads, C), jnp.float32)

  def down(i, carry):
    s, acc = carry
    j = r - i
    acc = gather(j, s, acc)
    la_j = la_row(j)
    s = jnp.where(pid_ref[b, j] == pid_r, s + la_j, s) if has_seg else s + la_j
    return s, acc

  g, rows = lax.fori_loop(0, r - r0 + 1, down, (jnp.zeros_like(q), (zeros, zeros)))
  if write_g:
    g_out[b, r, hs, ks] = g
  else:

    @pl.when(r == t_last)
    def _():
      g_out[b, r // C, hs, ks] = g

  to_last = lax.fori_loop(r + 1, t_last + 1, lambda j, s: s + la_row(j), jnp.zeros_like(q))
  e_last = exp(jnp.minimum(to_last, 0.0))
  if has_seg:
    e_last = jnp.where(pid_r == pid_ref[b, t_last], e_last, 0.0)
  wt_out[b, r, hs, ks] = (w * e_last).astype(wt_out.dtype)
  e = exp(g)  # (Qbar as (scale q) exp(g), one exp for both)
  kbar_out[b, r, hs, ks] = (k * e).astype(kbar_out.dtype)
  qbar_out[b, r, hs, ks] = ((scale * q) * e).astype(qbar_out.dtype)
  return rows


class Pairs(NamedTuple):
  """The pair kernel's results. lmat: L [B, H, T, C] fp32 (the inverse is formed from it in
  fp32, wy.py); pmat: P [B, H, T, C] scaled; wt: Wt [B, T, H, K] (both in the operand dtype);
  g: the chunk-local decay cumsum [B, T, H, K] fp32, or None when only g_last was written;
  g_last: [B, T / C, H, K] fp32, g at each chunk's last row (write_g=False), else None;
  kbar, qbar: k exp(g), scale q exp(g) [B, T, H, K] in the operand dtype."""

  lmat: jax.Array
  pmat: jax.Array
  wt: jax.Array
  g: jax.Array | None
  g_last: jax.Array | None
  kbar: jax.Array
  qbar: jax.Array


def pair_forward(q, k, w, la, pid, *, chunk, scale, interpret, cfg, cfg_prec, write_g=True):
  """The pair kernel (Pairs) from log_alpha `la`; write_g=False writes only g's chunk-last rows
  (g_last) instead of the whole g."""
  bsz, t, nh, kd = k.shape
  has_seg = pid is not None
  dt = operand_dtype(kernel_precision(cfg_prec, interpret))
  heads = math.gcd(cfg.pair_heads, nh)  # (the largest power of two <= pair_heads dividing H)
  out_shape = (
    jax.ShapeDtypeStruct((bsz, nh, t, chunk), jnp.float32),
    jax.ShapeDtypeStruct((bsz, nh, t, chunk), dt),
    jax.ShapeDtypeStruct((bsz, t, nh, kd), dt),
    jax.ShapeDtypeStruct((bsz, t if write_g else t // chunk, nh, kd), jnp.float32),
    jax.ShapeDtypeStruct((bsz, t, nh, kd), dt),
    jax.ShapeDtypeStruct((bsz, t, nh, kd), dt),
  )
  lmat, pmat, wt, g, kbar, qbar = pl.pallas_call(
    functools.partial(
      _pair_token_loop_kernel,
      chunk=chunk,
      scale=scale,
      has_seg=has_seg,
      heads=heads,
      write_g=write_g,
      exp=exp_for_mode(cfg_prec),  # (the kernels' exp: kernel_math)
      ktiles=key_tiles(kd, cfg),
    ),
    out_shape=out_shape,
    grid=(bsz, t, nh // heads),
    name="delta_rule_pair_token_loop",
    **launch_params(interpret, cfg.num_warps_pairs, cfg),
  )(*([q, k, w, la] + ([pid] if has_seg else [])))
  g, g_last = (g, None) if write_g else (None, g)
  return Pairs(lmat, pmat, wt, g, g_last, kbar, qbar)


class Intra(NamedTuple):
  """The intra stage's results: A [B, H, T, C], P (scaled), Wt, W = A Kbar, U = A V' (all in the
  operand dtype); g [B, T, H, K] fp32 (None when the pair kernel kept only g_last
  [B, T / C, H, K], a forward-only call's); qbar = scale q exp(g) in the operand dtype (the
  output's, in place of q and g)."""

  amat: jax.Array
  pmat: jax.Array
  wt: jax.Array
  wk: jax.Array
  u: jax.Array
  g: jax.Array | None
  g_last: jax.Array | None
  qbar: jax.Array


def intra_forward(
  q,
  k,
  v,
  w,
  la,
  h0,
  pid,
  cont,
  *,
  chunk,
  scale,
  interpret,
  cfg,
  cfg_prec,
  keep_g=True,
  run=_stages.call,
):
  """The intra stage (parallel over chunks, Intra): the pair kernel, then the WY kernel (wy.py).
  A, P, Wt, W and U only ever enter dots; with bf16-operand dots they are rounded to bf16 there,
  so they are stored in bf16. keep_g=False (a forward-only call) keeps only g_last (nothing
  else reads g then). run: the stage runner (stages.py)."""
  kw = dict(chunk=chunk, interpret=interpret, cfg=cfg, cfg_prec=cfg_prec)
  pairs = run("pairs", pair_forward, q, k, w, la, pid, scale=scale, write_g=keep_g, **kw)
  amat, wk, u = run("wy", _wy.wy_forward, pairs.lmat, pairs.kbar, v, h0, cont, **kw)
  return Intra(amat, pairs.pmat, pairs.wt, wk, u, pairs.g, pairs.g_last, pairs.qbar)
