"""Intra-chunk delta-rule kernels on S-row sub-blocks, for chunks longer than S
(DeltaRuleConfig.sub_block).

The plain intra kernels hold [C, K] fp32 tiles and run C-step column loops, so their cost per
token grows with the chunk C while the serial kernels' cost per token shrinks with it. Here a
chunk of C = nb * S tokens is handled as nb row blocks of S tokens: [S, K] tiles only, the
diagonal S x S tiles by an S-step column loop (kernel._diag_products / _diag_pairs_bwd), every
pair of blocks (i > j) by matmuls around the reference point g0 = g of block i's first token:

    exp(g_r - g_c) = exp(g_r - g0) exp(g0 - g_c)   (r in block i, c in block j; both <= 1 for a
                                                    same-segment pair, clamped otherwise)

and A = (I + L)^-1 by block forward substitution, A_ij = -A_ii sum_{j <= m < i} L_im A_mj.
Outputs are those of kernel._intra_fwd_kernel / _intra_bwd_kernel, bit for bit in layout.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.delta_rule import kernel as _k


def _blocks(ref, b, h, t0, S, nb):
  return [_k._tile(ref, b, t0 + i * S, S, h) for i in range(nb)]


def _ref_point(g_ref, b, h, t0, S, i, g_i):
  """(g0 [1, K], row factors exp(min(g_i - g0, 0))) of block i."""
  g0 = g_ref[b, pl.ds(t0 + i * S, 1), h, :].astype(jnp.float32)
  return g0, jnp.exp(jnp.minimum(g_i - g0, 0.0))


def _seg_masks(pid_ref, b, t0, S, nb):
  pids = [pid_ref[b, pl.ds(t0 + i * S, S)] for i in range(nb)]
  same = {(i, j): (pids[i][:, None] == pids[j][None, :]).astype(jnp.float32)
          for i in range(nb) for j in range(i + 1)}
  return pids, same


def intra_fwd_sub_kernel(*refs, chunk, sub, scale, has_seg, wy, inverse, block, prec, hi):
  n_in = 4 + (2 if has_seg else 0)
  q_ref, k_ref, w_ref, g_ref = refs[:4]
  pid_ref, cont_ref = refs[4:n_in] if has_seg else (None, None)
  a_out, p_out, wt_out = refs[n_in:n_in + 3]
  b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  C, S = chunk, sub
  nb = C // S
  t0 = c * C
  q, k, w, g = (_blocks(x, b, h, t0, S, nb) for x in (q_ref, k_ref, w_ref, g_ref))
  lmat, pmat = {}, {}
  for i in range(nb):
    lmat[i, i], pmat[i, i] = _k._diag_products(q[i], k[i], g[i], w_ref, g_ref, b, h,
                                               t0 + i * S, S, S)
    if i:
      g0, xs = _ref_point(g_ref, b, h, t0, S, i, g[i])
      kx, qx = k[i] * xs, q[i] * xs
      for j in range(i):
        y = w[j] * jnp.exp(jnp.minimum(g0 - g[j], 0.0))
        lmat[i, j] = _k._dot_nt(kx, y, prec)
        pmat[i, j] = _k._dot_nt(qx, y, prec)
  g_last = g_ref[b, t0 + C - 1, h, :]
  pids, pid_last = [None] * nb, None
  if has_seg:
    pids, same = _seg_masks(pid_ref, b, t0, S, nb)
    lmat = {ij: m * same[ij] for ij, m in lmat.items()}
    pmat = {ij: m * same[ij] for ij, m in pmat.items()}
    pid_last = pid_ref[b, t0 + C - 1]
  # Block forward substitution for A = (I + L)^-1.
  amat = {}
  for i in range(nb):
    amat[i, i] = _k._unit_lower_inverse(lmat[i, i], S, inverse, block, hi)
    for j in range(i):
      acc = None
      for m in range(j, i):
        term = _k._dot(lmat[i, m], amat[m, j], hi)
        acc = term if acc is None else acc + term
      amat[i, j] = -_k._dot(amat[i, i], acc, hi)
  zero = jnp.zeros((S, S), jnp.float32)
  for i in range(nb):
    rows = pl.ds(t0 + i * S, S)
    for j in range(nb):
      cols = pl.ds(j * S, S)
      a_out[b, h, rows, cols] = amat.get((i, j), zero).astype(a_out.dtype)
      p_out[b, h, rows, cols] = (scale * pmat.get((i, j), zero)).astype(p_out.dtype)
    wt_out[b, rows, h, :] = (w[i] * _k._e_last(g[i], g_last, pids[i], pid_last)).astype(
        wt_out.dtype)
  if wy:
    wk_out = refs[n_in + 3]
    kbar = [k[j] * jnp.exp(g[j]) for j in range(nb)]
    if has_seg:
      kbar = [kb * cont_ref[b, pl.ds(t0 + j * S, S)][:, None] for j, kb in enumerate(kbar)]
    for i in range(nb):
      wk = None
      for j in range(i + 1):
        term = _k._dot(amat[i, j], kbar[j], prec)
        wk = term if wk is None else wk + term
      wk_out[b, pl.ds(t0 + i * S, S), h, :] = wk.astype(wk_out.dtype)


def intra_bwd_sub_kernel(*refs, chunk, sub, scale, has_seg, num_vb, prec, hi):
  r, outs = _k._intra_bwd_refs(refs, has_seg)
  b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  C, S = chunk, sub
  nb = C // S
  t0 = c * C
  row, col = _k._iota(S, 0), _k._iota(S, 1)

  def vsum(name, rows, cols):
    return _k._vsum(r[name], b, h, num_vb, rows, cols)

  q, k, w, g = (_blocks(r[n], b, h, t0, S, nb) for n in ("q", "k", "w", "g"))
  pids, pid_last = [None] * nb, None
  if has_seg:
    pids, same = _seg_masks(r["pid"], b, t0, S, nb)
    pid_last = r["pid"][b, t0 + C - 1]
  dpm, dlm, p_diag = {}, {}, []
  for i in range(nb):
    for j in range(i + 1):
      rows, cols = pl.ds(t0 + i * S, S), pl.ds(j * S, S)
      dp = vsum("dp", rows, cols) * scale
      dl = vsum("dl", rows, cols)
      if i == j:
        dp = jnp.where(row >= col, dp, 0.0)
        dl = jnp.where(row > col, dl, 0.0)
      if has_seg:
        dp, dl = dp * same[i, j], dl * same[i, j]
      if i == j:
        # P's diagonal is split off as in kernel._intra_bwd_kernel (exact cancellation in dg).
        p_diag.append(jnp.sum(jnp.where(row == col, dp, 0.0), axis=1)[:, None])
        dp = jnp.where(row > col, dp, 0.0)
      dpm[i, j], dlm[i, j] = dp, dl
  dq_acc, dk_acc, dw_acc = [], [], []
  for i in range(nb):
    a_q, a_k, a_w = _k._diag_pairs_bwd(q[i], k[i], g[i], dpm[i, i], dlm[i, i], r, b, h,
                                       t0 + i * S, S, S)
    dq_acc.append(a_q)
    dk_acc.append(a_k)
    dw_acc.append(a_w)
  for i in range(1, nb):
    g0, xs = _ref_point(r["g"], b, h, t0, S, i, g[i])
    qx, kx = q[i] * xs, k[i] * xs
    for j in range(i):
      ys = jnp.exp(jnp.minimum(g0 - g[j], 0.0))
      wy = w[j] * ys
      dq_acc[i] = dq_acc[i] + xs * _k._dot(dpm[i, j], wy, prec)
      dk_acc[i] = dk_acc[i] + xs * _k._dot(dlm[i, j], wy, prec)
      dw_acc[j] = dw_acc[j] + ys * (_k._dot_tn(dpm[i, j], qx, prec)
                                    + _k._dot_tn(dlm[i, j], kx, prec))
  dgl = _k._vsum(r["dgl"], b, h, num_vb, c, slice(None))
  g_last = r["g"][b, t0 + C - 1, h, :]
  prefix = jnp.zeros((1, q[0].shape[1]), jnp.float32)
  for i in range(nb):
    rows = pl.ds(t0 + i * S, S)
    e_last = _k._e_last(g[i], g_last, pids[i], pid_last)
    dwt = vsum("dwt", rows, slice(None))
    vals = _k._intra_bwd_epilogue(
        q[i], k[i], w[i], g[i], (dq_acc[i], dk_acc[i], dw_acc[i]), p_diag[i], dwt,
        vsum("dkbar", rows, slice(None)), vsum("dqbar", rows, slice(None)), dgl, e_last, scale,
        hi, dla_prefix=prefix, with_dgl=i == nb - 1)
    prefix = prefix + jnp.sum(dwt * w[i] * e_last, axis=0, keepdims=True)
    for ref, val in zip(outs, vals):
      ref[b, rows, h, :] = val
