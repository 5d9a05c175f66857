"""Intra-chunk forward stage: per (batch, head, chunk), the decay-weighted pair products
L (strict) and P (inclusive, scaled), Wt = w exp(g_last - g), then A = (I + L)^-1, W = A Kbar
and U = A V' (the equations: __init__'s docstring). The pair products by one of two kernels:
_pair_token_loop_kernel (chunks of one 16-row block, the default: one program per token row and
cfg.pair_heads heads, the row's columns j <= r one per step) or _pair_rows_kernel, one program per (chunk, S-row block i): L and P of the block's rows against
the whole chunk (the diagonal S x S tile by an S-step column loop of exact exp(<= 0), the
earlier blocks as one [S, K] x [K, C] dot around g0 = g of row block i's first token,

    exp(g_r - g_c) = exp(g_r - g0) exp(g0 - g_c)   (both factors <= 1 for a same-segment pair)

stored by one masked row store) and Wt; then wy.wy_forward: A, W and U from L (no [C, K] tile of the pair products is live in
the inverse's kernel, and no inverse in the pair products' one). The token-parallel kernel can
also form g from log_alpha (cumsum_in_pairs; a forward-only call then keeps only g_last) and
write the decayed operands Kbar and Qbar (decayed_operands), both the default.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.delta_rule import wy as _wy
from pallas_kernels.delta_rule.tiles import (
  decay_to_last,
  dot_nt,
  kernel_precision,
  launch_params,
  masked_store,
  operand_dtype,
  ref_point,
  tile,
  times_beta,
  write_parts,
  write_rows,
)
from pallas_kernels.kernel_math import exp_for_mode


def _diag_columns(
  q, k, g, w_ref, k_ref, g_ref, pid_ref, pid_i, l_out, p_out, b, h, r0, col0, scale, S, exp
):
  """The diagonal S x S tile of L (strict) and P (scaled, inclusive) of the row block starting at
  token r0, one column per step stored straight to l_out / p_out (columns col0 + jj): exact
  exp(min(g_r - g_j, 0)). No [S, S] tile is carried through the loop: merging each step's
  column into one with selects cost a layout conversion per step (H200, T=4096: 1.8 ms for this
  loop that way; docs/decisions.md)."""
  row = lax.broadcasted_iota(jnp.int32, (S,), 0)

  def body(jj, carry):
    wj, beta = write_parts(w_ref, k_ref, b, r0 + jj, h)
    gj = g_ref[b, r0 + jj, h, :].astype(jnp.float32)
    e = exp(jnp.minimum(g - gj[None, :], 0.0)) * wj[None, :]
    kw = times_beta(jnp.sum(k * e, axis=1), beta)
    qw = times_beta(jnp.sum(q * e, axis=1), beta)
    keep_l, keep_p = row > jj, row >= jj
    if pid_i is not None:  # (pid_i: the row block's segment ids)
      same = pid_i == pid_ref[b, r0 + jj]
      keep_l, keep_p = keep_l & same, keep_p & same
    l_out[b, h, pl.ds(r0, S), col0 + jj] = jnp.where(keep_l, kw, 0.0).astype(l_out.dtype)
    p_out[b, h, pl.ds(r0, S), col0 + jj] = (scale * jnp.where(keep_p, qw, 0.0)).astype(p_out.dtype)
    return carry

  lax.fori_loop(0, S, body, 0)


def _pair_rows_kernel(*refs, chunk, sub, scale, has_seg, prec, exp):
  """Rows [i S, (i + 1) S) of L (f32, strict, zero above the diagonal) and of P (scaled), and
  their Wt rows; i = program_id(3). Every column of the row block is stored (zeros right of the
  diagonal tile), so the outputs need no initialisation."""
  n_in = 4 + (1 if has_seg else 0)
  q_ref, k_ref, w_ref, g_ref = refs[:4]
  pid_ref = refs[4] if has_seg else None
  l_out, p_out, wt_out = refs[n_in : n_in + 3]
  b, h, c, i = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)
  C, S = chunk, sub
  t0 = c * C
  r0 = t0 + i * S
  rows = pl.ds(r0, S)
  q, k, g = (tile(x, b, r0, S, h) for x in (q_ref, k_ref, g_ref))
  pid_i = pid_ref[b, rows] if has_seg else None
  if C > S:
    # The earlier row blocks as ONE [S, K] x [K, C] dot around g0 = g of the block's first
    # token (columns at and after the block zeroed in the column factor):
    #   exp(g_r - g_c) = exp(g_r - g0) exp(g0 - g_c), both factors <= 1 for the kept pairs
    # r >= g0's row > c; stored as one [S, C] row store that skips the diagonal tile (written
    # below). One dot instead of up to C/S - 1 small ones under pl.when: H200, chunk 64,
    # T=4096, 1.46 ms against 1.93 (docs/decisions.md).
    g0, xs = ref_point(g_ref, b, h, r0, S, 0, g, exp)
    col_t = lax.broadcasted_iota(jnp.int32, (C, 1), 0)
    y = jnp.where(
      col_t < i * S,
      write_rows(w_ref, k_ref, b, pl.ds(t0, C), h)
      * exp(jnp.minimum(g0 - tile(g_ref, b, t0, C, h), 0.0)),
      0.0,
    )
    lmat, pmat = dot_nt(k * xs, y, prec), dot_nt(q * xs, y, prec)
    if has_seg:
      same = pid_i[:, None] == pid_ref[b, pl.ds(t0, C)][None, :]
      lmat, pmat = jnp.where(same, lmat, 0.0), jnp.where(same, pmat, 0.0)
    off_diag = lax.broadcasted_iota(jnp.int32, (S, C), 1) // S != i
    idx = (b, h, rows, pl.ds(0, C))
    masked_store(l_out, idx, lmat, off_diag)
    masked_store(p_out, idx, (scale * pmat).astype(p_out.dtype), off_diag)
  _diag_columns(
    q, k, g, w_ref, k_ref, g_ref, pid_ref, pid_i, l_out, p_out, b, h, r0, i * S, scale, S, exp
  )
  g_last = g_ref[b, t0 + C - 1, h, :]
  e_last = decay_to_last(g, g_last, exp, pid_i, pid_ref[b, t0 + C - 1] if has_seg else None)
  wt_out[b, rows, h, :] = (write_rows(w_ref, k_ref, b, rows, h) * e_last).astype(wt_out.dtype)


def _pair_token_loop_kernel(
  *refs, chunk, sub, scale, has_seg, heads, from_la, write_g, decayed, exp
):
  """Row r = program_id(1) of L (strict) and P (scaled, inclusive) for `heads` heads, chunks of
  one S-row block (C = S), token-parallel: the row's columns j <= r one per step ([heads, K]
  each, no exps above the diagonal), zeros for the columns after r;
  and the row's Wt.

  from_la (DeltaRuleConfig.cumsum_in_pairs): the fourth input is log_alpha instead of its
  chunk-local cumsum g, and the kernel also writes g's row, so that no cumsum kernel runs before
  it. The columns go from r down to the chunk start with s = the sum of log_alpha over (j, r] in
  r's segment, which is g_r - g_j (summed directly, no difference of two cumsums); after the
  last column s is g_r. Wt's decay is the sum over (r, t_last], in a loop of loads and adds.
  write_g (from_la only): g's row is written; else only the chunk's last row, to g_last
  [B, T / C, H, K] (a forward-only call's state pass reads no other row).

  decayed (DeltaRuleConfig.decayed_operands): the kernel also writes the row's Kbar = k exp(g)
  and Qbar = scale q exp(g) in the dots' operand dtype (the type of those outputs), the same
  values the WY and output kernels would form from k, q and g and round for their dots."""
  n_in = 4 + (1 if has_seg else 0)
  q_ref, k_ref, w_ref, d_ref = refs[:4]  # d_ref: g, or log_alpha with from_la
  pid_ref = refs[4] if has_seg else None
  l_out, p_out, wt_out = refs[n_in : n_in + 3]
  extra_outs = list(refs[n_in + 3 :])
  g_out = extra_outs.pop(0) if from_la else None
  kbar_out, qbar_out = (extra_outs.pop(0), extra_outs.pop(0)) if decayed else (None, None)
  b, r, hb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  S = sub
  hs = pl.ds(hb * heads, heads)
  r0 = (r // S) * S
  t_last = r0 + S - 1
  q, k = (x[b, r, hs, :].astype(jnp.float32) for x in (q_ref, k_ref))
  w = write_rows(w_ref, k_ref, b, r, hs)
  pid_r = pid_ref[b, r] if has_seg else None
  d_row = lambda j: d_ref[b, j, hs, :].astype(jnp.float32)

  def pair(j, decay):
    """Column j's kept L and scaled P values, [heads] each; decay = g_r - g_j ([heads, K]).
    Without segments decay <= 0 as computed: g is a running sum of log_alpha <= 0 within the
    chunk, and fl(g + la) <= g for la <= 0, so no clamp (4 of the column step's 88 instructions;
    docs/decisions.md). With segments g restarts at a reset, and a masked pair across one could
    overflow exp: clamped."""
    wj, beta = write_parts(w_ref, k_ref, b, j, hs)  # (beta: applied after the sums)
    e = exp(jnp.minimum(decay, 0.0) if has_seg else decay) * wj
    kw, qw = (times_beta(jnp.sum(x * e, axis=1), beta) for x in (k, q))
    keep_l, keep_p = j < r, True
    if has_seg:
      same = pid_ref[b, j] == pid_r
      keep_l, keep_p = keep_l & same, same
    return jnp.where(keep_l, kw, 0.0), scale * jnp.where(keep_p, qw, 0.0)

  # The row's values gathered in registers by a select per column, one [heads, S] store each
  # (session 36, H200 diag KDN forward T=16384: 6.96 ms against 7.28-7.31 for a store per
  # column with the zeros after the diagonal one column per step, fla's way; that option,
  # pair_token_stores='columns', was removed in session 41).
  col = lax.broadcasted_iota(jnp.int32, (heads, S), 1)

  def gather(j, decay, acc):
    lv, pv = pair(j, decay)
    hit = col == j - r0
    return jnp.where(hit, lv[:, None], acc[0]), jnp.where(hit, pv[:, None], acc[1])

  zeros = jnp.zeros((heads, S), jnp.float32)
  if from_la:

    def down(i, carry):
      s, acc = carry
      j = r - i
      acc = gather(j, s, acc)
      la_j = d_row(j)
      s = jnp.where(pid_ref[b, j] == pid_r, s + la_j, s) if has_seg else s + la_j
      return s, acc

    g, (lrow, prow) = lax.fori_loop(0, r - r0 + 1, down, (jnp.zeros_like(q), (zeros, zeros)))
    if write_g:
      g_out[b, r, hs, :] = g
    else:

      @pl.when(r == t_last)
      def _():
        g_out[b, r // S, hs, :] = g

    to_last = lax.fori_loop(r + 1, t_last + 1, lambda j, s: s + d_row(j), jnp.zeros_like(q))
  else:
    g = d_row(r)
    lrow, prow = lax.fori_loop(
      r0, r + 1, lambda j, acc: gather(j, g - d_row(j), acc), (zeros, zeros)
    )
    to_last = d_row(t_last) - g
  row = (b, hs, r, pl.ds(0, S))
  l_out[row] = lrow.astype(l_out.dtype)
  p_out[row] = prow.astype(p_out.dtype)
  e_last = exp(jnp.minimum(to_last, 0.0))
  if has_seg:
    e_last = jnp.where(pid_r == pid_ref[b, t_last], e_last, 0.0)
  wt_out[b, r, hs, :] = (w * e_last).astype(wt_out.dtype)
  if decayed:  # (Qbar as tiles.decay_q forms it: (scale q) exp(g), one exp for both)
    e = exp(g)
    kbar_out[b, r, hs, :] = (k * e).astype(kbar_out.dtype)
    qbar_out[b, r, hs, :] = ((scale * q) * e).astype(qbar_out.dtype)


def sub_rows(cfg, chunk):
  """Row-block size of the pair and WY kernels: cfg.sub_block (16 when 0), at most C."""
  return min(cfg.sub_block or 16, chunk)


def token_parallel(cfg, chunk):
  """Whether the pair products run token-parallel (_pair_token_loop_kernel): pair_diag
  'token_loop' and chunks of one row block."""
  return cfg.pair_diag == "token_loop" and chunk == sub_rows(cfg, chunk)


class Pairs(NamedTuple):
  """The pair kernel's results. lmat: L [B, H, T, C] fp32 (the inverse is formed from it in
  fp32, wy.py); pmat: P [B, H, T, C] scaled; wt: Wt [B, T, H, K] (both in the operand dtype);
  g: the chunk-local decay cumsum [B, T, H, K] fp32 when the kernel formed it (from log_alpha)
  and wrote it; g_last: [B, T / C, H, K] fp32, g at each chunk's last row, when it formed g but did
  not write it; kbar, qbar: k exp(g), scale q exp(g) [B, T, H, K] in the operand dtype
  (decayed operands)."""

  lmat: jax.Array
  pmat: jax.Array
  wt: jax.Array
  g: jax.Array | None = None
  g_last: jax.Array | None = None
  kbar: jax.Array | None = None
  qbar: jax.Array | None = None


def operands(xbar, x, g):
  """A later stage's (x, g) operands: (xbar, None) when the pair kernel wrote the decayed
  operand xbar (Kbar for the WY kernel, Qbar for the output: DeltaRuleConfig.decayed_operands),
  else (x, g). The one place that choice is made (the op's stages, the mixer stage split)."""
  return (xbar, None) if xbar is not None else (x, g)


def pair_rows_forward(
  q, k, w, g, pid, *, chunk, scale, interpret, cfg, cfg_prec, la=None, write_g=True, decayed=False
):
  """The pair kernel (Pairs). With `la` (log_alpha, g None; token-parallel only) the kernel
  forms g itself and writes it (or, write_g=False, only its chunks' last rows: g_last); with
  `decayed` (token-parallel only) it also writes Kbar and Qbar."""
  bsz, t, nh, kd = k.shape
  has_seg = pid is not None
  prec = kernel_precision(cfg_prec, interpret)
  exp = exp_for_mode(cfg_prec)  # (the kernels' exp: kernel_math)
  dt = operand_dtype(prec)
  sub = sub_rows(cfg, chunk)
  out_shape = (
    jax.ShapeDtypeStruct((bsz, nh, t, chunk), jnp.float32),
    jax.ShapeDtypeStruct((bsz, nh, t, chunk), dt),
    jax.ShapeDtypeStruct((bsz, t, nh, kd), dt),
  )
  from_la = la is not None
  for name, on in (("log_alpha in place of g", from_la), ("decayed operands", decayed)):
    if on and not token_parallel(cfg, chunk):
      raise ValueError(
        f"pair_rows_forward: {name} needs the token-parallel kernel "
        f"(pair_diag='token_loop', chunks of one row block); chunk={chunk}, "
        f"pair_diag={cfg.pair_diag!r}"
      )
  args = [q, k, w, la if from_la else g] + ([pid] if has_seg else [])
  if token_parallel(cfg, chunk):
    heads = math.gcd(cfg.pair_heads, nh)  # (the largest power of two <= pair_heads dividing H)
    write_g = write_g or not from_la
    if from_la:
      g_rows = t if write_g else t // chunk
      out_shape += (jax.ShapeDtypeStruct((bsz, g_rows, nh, kd), jnp.float32),)
    if decayed:
      out_shape += (jax.ShapeDtypeStruct((bsz, t, nh, kd), dt),) * 2
    outs = list(
      pl.pallas_call(
        functools.partial(
          _pair_token_loop_kernel,
          chunk=chunk,
          sub=sub,
          scale=scale,
          has_seg=has_seg,
          heads=heads,
          from_la=from_la,
          write_g=write_g,
          decayed=decayed,
          exp=exp,
        ),
        out_shape=out_shape,
        grid=(bsz, t, nh // heads),
        name="delta_rule_pair_token_loop",
        **launch_params(interpret, cfg.num_warps_pairs, cfg),
      )(*args)
    )
    res = Pairs(*outs[:3])
    if from_la:
      res = res._replace(**{"g" if write_g else "g_last": outs[3]})
    if decayed:
      res = res._replace(kbar=outs[-2], qbar=outs[-1])
    return res
  # 'columns', and chunks of several row blocks under either option (the token-parallel kernel
  # covers one row block per chunk)
  return Pairs(
    *pl.pallas_call(
      functools.partial(
        _pair_rows_kernel, chunk=chunk, sub=sub, scale=scale, has_seg=has_seg, prec=prec, exp=exp
      ),
      out_shape=out_shape,
      grid=(bsz, nh, t // chunk, chunk // sub),
      name="delta_rule_pair_rows",
      **launch_params(interpret, cfg.num_warps_pairs, cfg),
    )(*args)
  )


class Intra(NamedTuple):
  """The intra stage's results: A [B, H, T, C], P (scaled), Wt, W = A Kbar, U = A V' (all in the
  operand dtype); g [B, T, H, K] fp32 (None when the pair kernel formed it and kept only g_last
  [B, T / C, H, K], a forward-only call's); qbar = scale q exp(g) in the operand dtype with
  decayed operands (the output's, in place of q and g), else None."""

  amat: jax.Array
  pmat: jax.Array
  wt: jax.Array
  wk: jax.Array
  u: jax.Array
  g: jax.Array | None
  g_last: jax.Array | None = None
  qbar: jax.Array | None = None


def decayed_operands(cfg, chunk):
  """Whether the pair kernel writes Kbar and Qbar (cfg.decayed_operands, token-parallel only)."""
  return cfg.decayed_operands and token_parallel(cfg, chunk)


def intra_forward(
  q, k, v, w, g, h0, pid, cont, *, chunk, scale, interpret, cfg, cfg_prec, la=None, keep_g=True
):
  """The intra stage (parallel over chunks, Intra): the pair kernel, then the WY kernel (wy.py).
  A, P, Wt, W and U only ever enter dots; with bf16-operand dots they are rounded to bf16 there,
  so they are stored in bf16. g is the one given, or with `la` (g None) the one the pair kernel
  formed from it; keep_g=False (a forward-only call) lets a pair kernel that forms g with
  decayed operands keep only g_last (nothing else reads g then)."""
  decayed = decayed_operands(cfg, chunk)
  pairs = pair_rows_forward(
    q,
    k,
    w,
    g,
    pid,
    chunk=chunk,
    scale=scale,
    interpret=interpret,
    cfg=cfg,
    cfg_prec=cfg_prec,
    la=la,
    decayed=decayed,
    write_g=keep_g or not decayed,
  )
  g = pairs.g if la is not None else g
  k_wy, g_wy = operands(pairs.kbar, k, g)
  amat, wk, u = _wy.wy_forward(
    lmat=pairs.lmat,
    k=k_wy,
    v=v,
    g=g_wy,
    h0=h0,
    cont=cont,
    chunk=chunk,
    sub=sub_rows(cfg, chunk),
    interpret=interpret,
    cfg=cfg,
    cfg_prec=cfg_prec,
  )
  return Intra(amat, pairs.pmat, pairs.wt, wk, u, g, pairs.g_last, pairs.qbar)
