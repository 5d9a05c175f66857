"""Pallas kernels for the chunked asymmetric delta rule with per-channel decay.

Per (batch, head) and chunk of C tokens with chunk-local log-decay cumsum g (restarted at segment
starts), state S_0 at the chunk start (S_init for rows whose segment starts inside the chunk):
    L_rj = sum_c k_rc w_jc exp(g_rc - g_jc)   (r > j, same segment)        A = (I + L)^-1
    P_rj = scale sum_c q_rc w_jc exp(g_rc - g_jc)   (r >= j, same segment)
    Kbar = k * exp(g), Qbar = scale q * exp(g), Wt_j = w_j exp(g_last - g_j) (same segment as last)
    U = V - Kbar S_0,  Delta = A U,  O = Qbar S_0 + P Delta,  S_C = exp(g_last) S_0 + Wt^T Delta.
Decay ratios are only ever formed as exp(min(g_r - g_j, 0)) of log DIFFERENCES, never exp(-g).

Kernels:
  _intra_fwd  grid (B, H, NC): L, P by a column loop, A by forward substitution, Wt.
  _recur_fwd  grid (B, H, V/BV): serial over chunks; emits O, S_final, and chunk-start states.
  _recur_bwd  grid (B, H, V/BV): serial over chunks in reverse; dV, dS_0, dS_init and per-V-block
              partial gradients of P, L, Wt, Kbar, Qbar, g_last.
  _intra_bwd  grid (B, H, NC): sums the partials, back-propagates through the decay-weighted
              products; emits dq, dk, dw and dg (gradient w.r.t. the chunk-local cumsum).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import common

_NT = (((1,), (1,)), ((), ()))   # x @ y^T
_TN = (((0,), (0,)), ((), ()))   # x^T @ y


BF16_OPERANDS = "bf16_operands"   # a `prec` value: round both operands to bf16, accumulate in fp32


def _dims(x, y, dims, prec):
  if prec == BF16_OPERANDS:
    x, y, prec = x.astype(jnp.bfloat16), y.astype(jnp.bfloat16), lax.Precision.DEFAULT
  return lax.dot_general(x, y, dims, precision=prec, preferred_element_type=jnp.float32)


def _dot(x, y, prec):
  return _dims(x, y, (((1,), (0,)), ((), ())), prec)


def _dot_nt(x, y, prec):
  return _dims(x, y, _NT, prec)


def _dot_tn(x, y, prec):
  return _dims(x, y, _TN, prec)


def _iota(c, axis):
  return lax.broadcasted_iota(jnp.int32, (c, c), axis)


def _tile(ref, b, t0, c, h, f32=True):
  x = ref[b, pl.ds(t0, c), h, :]
  return x.astype(jnp.float32) if f32 else x


def _same_seg(pid_ref, b, t0, c):
  pid = pid_ref[b, pl.ds(t0, c)]
  return (pid[:, None] == pid[None, :]).astype(jnp.float32), pid


# ------------------------------------------------------------------------------------ forward


def _column_products(q, k, g, w_ref, g_ref, b, h, t0, n):
  """[n, n] L (strict) and P/scale (inclusive) of the n tokens from t0 (q, k, g: their [n, K]
  rows) by a loop over the n columns: exact, O(n^2 K) exps."""
  row, col = _iota(n, 0), _iota(n, 1)

  def col_body(j, lp):
    lmat, pmat = lp
    wj = w_ref[b, pl.ds(t0 + j, 1), h, :].astype(jnp.float32)
    gj = g_ref[b, pl.ds(t0 + j, 1), h, :]
    we = wj * jnp.exp(jnp.minimum(g - gj, 0.0))
    kw = jnp.sum(k * we, axis=1)[:, None]
    qw = jnp.sum(q * we, axis=1)[:, None]
    lmat = jnp.where((col == j) & (row > j), kw, lmat)
    pmat = jnp.where((col == j) & (row >= j), qw, pmat)
    return lmat, pmat

  zeros = jnp.zeros((n, n), jnp.float32)
  return lax.fori_loop(0, n, col_body, (zeros, zeros))


def _pairs_kblock(refs, b, h, t0, C, kd, bk):
  """L (strict) and P/scale (inclusive) as [C, C, bk] decay-weighted products, summed over K in
  kd / bk steps: every (r, j) pair of the chunk at once, instead of C dependent column steps."""
  q_ref, k_ref, w_ref, g_ref = refs[:4]
  row, col = _iota(C, 0), _iota(C, 1)

  def body(i, lp):
    lmat, pmat = lp
    ks = pl.ds(i * bk, bk)
    kb = k_ref[b, pl.ds(t0, C), h, ks].astype(jnp.float32)
    qb = q_ref[b, pl.ds(t0, C), h, ks].astype(jnp.float32)
    wb = w_ref[b, pl.ds(t0, C), h, ks].astype(jnp.float32)
    gb = g_ref[b, pl.ds(t0, C), h, ks]
    we = wb[None, :, :] * jnp.exp(jnp.minimum(gb[:, None, :] - gb[None, :, :], 0.0))  # [r, j, c]
    return (lmat + jnp.sum(kb[:, None, :] * we, axis=2),
            pmat + jnp.sum(qb[:, None, :] * we, axis=2))

  zeros = jnp.zeros((C, C), jnp.float32)
  lmat, pmat = lax.fori_loop(0, kd // bk, body, (zeros, zeros))
  return jnp.where(row > col, lmat, 0.0), jnp.where(row >= col, pmat, 0.0)


def _select(block, C, js):
  """[block, C] 0/1 matrix E with E[a, js + a] = 1 (embeds a diagonal block by E^T X E)."""
  r = lax.broadcasted_iota(jnp.int32, (block, C), 0)
  c = lax.broadcasted_iota(jnp.int32, (block, C), 1)
  return (c == r + js).astype(jnp.float32)


def _pairs_blocked(q, k, w, g, refs, b, h, t0, C, block, prec, hi):
  """L and P/scale with sub-blocks: off-diagonal blocks as matmuls around a reference point
  (the last token of the column block, so both factors are exp(<= 0)); diagonal blocks by a
  column loop over `block` rows only."""
  q_ref, k_ref, w_ref, g_ref = refs[:4]
  row = _iota(C, 0)
  row_k = lax.broadcasted_iota(jnp.int32, g.shape, 0)
  lmat = jnp.zeros((C, C), jnp.float32)
  pmat = jnp.zeros((C, C), jnp.float32)
  for jb in range(C // block):
    js = jb * block
    if js + block < C:
      g_r = g_ref[b, pl.ds(t0 + js + block - 1, 1), h, :]
      xs = jnp.exp(jnp.minimum(g - g_r, 0.0))
      ys = jnp.exp(jnp.minimum(g_r - g, 0.0))
      y_t = jnp.where((row_k >= js) & (row_k < js + block), w * ys, 0.0)
      later = row >= js + block
      lmat = lmat + jnp.where(later, _dot_nt(k * xs, y_t, prec), 0.0)
      pmat = pmat + jnp.where(later, _dot_nt(q * xs, y_t, prec), 0.0)
    kj = k_ref[b, pl.ds(t0 + js, block), h, :].astype(jnp.float32)
    qj = q_ref[b, pl.ds(t0 + js, block), h, :].astype(jnp.float32)
    gjb = g_ref[b, pl.ds(t0 + js, block), h, :]
    dl, dp = _column_products(qj, kj, gjb, w_ref, g_ref, b, h, t0 + js, block)
    sel = _select(block, C, js)
    lmat = lmat + _dot_tn(sel, _dot(dl, sel, hi), hi)
    pmat = pmat + _dot_tn(sel, _dot(dp, sel, hi), hi)
  return lmat, pmat


def _unit_lower_inverse_rows(lmat, C):
  """(I + L)^-1 for strictly lower L, by forward substitution one row at a time."""
  row, col = _iota(C, 0), _iota(C, 1)
  eye = (row == col).astype(jnp.float32)

  def sub_body(i, amat):
    lrow = jnp.sum(jnp.where(row == i, lmat, 0.0), axis=0)          # L[i, :]
    new = jnp.sum(lrow[:, None] * amat, axis=0)                     # (L A)[i, :]
    erow = jnp.sum(jnp.where(row == i, eye, 0.0), axis=0)
    return jnp.where(row == i, (erow - new)[None, :], amat)

  return lax.fori_loop(1, C, sub_body, eye)


def _unit_lower_inverse_blocked(lmat, C, block, hi):
  """(I + L)^-1 = sum_n (-M)^n D^-1 with D = I + blockdiag(L), M = D^-1 (L - blockdiag(L)).

  D^-1 by forward substitution run on all diagonal blocks at once (block - 1 matmul steps);
  M is nilpotent of index C / block, so the series is exact (block forward substitution)."""
  row, col = _iota(C, 0), _iota(C, 1)
  eye = (row == col).astype(jnp.float32)
  same_blk = (row // block) == (col // block)
  lbd = jnp.where(same_blk, lmat, 0.0)
  nmat = lmat - lbd
  rmod = row % block

  def sub_body(i, dinv):
    return jnp.where(rmod == i, eye - _dot(lbd, dinv, hi), dinv)

  dinv = lax.fori_loop(1, block, sub_body, eye)
  if C == block:
    return dinv
  mmat = _dot(dinv, nmat, hi)
  amat, term = dinv, dinv
  for _ in range(C // block - 1):
    term = -_dot(mmat, term, hi)
    amat = amat + term
  return amat


def _intra_fwd_kernel(*refs, chunk, scale, has_seg, blocked, block, kblock, prec, hi):
  if has_seg:
    q_ref, k_ref, w_ref, g_ref, pid_ref, a_out, p_out, wt_out = refs
  else:
    q_ref, k_ref, w_ref, g_ref, a_out, p_out, wt_out = refs
  b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  C = chunk
  t0 = c * C
  q = _tile(q_ref, b, t0, C, h)
  k = _tile(k_ref, b, t0, C, h)
  w = _tile(w_ref, b, t0, C, h)
  g = _tile(g_ref, b, t0, C, h)
  row, col = _iota(C, 0), _iota(C, 1)
  if kblock:
    lmat, pmat = _pairs_kblock(refs, b, h, t0, C, q.shape[1], kblock)
  elif blocked:
    lmat, pmat = _pairs_blocked(q, k, w, g, refs, b, h, t0, C, block, prec, hi)
  else:
    lmat, pmat = _column_products(q, k, g, refs[2], refs[3], b, h, t0, C)
  g_last = g_ref[b, t0 + C - 1, h, :]
  e_last = jnp.exp(jnp.minimum(g_last[None, :] - g, 0.0))
  if has_seg:
    same, pid = _same_seg(pid_ref, b, t0, C)
    lmat = lmat * same
    pmat = pmat * same
    pid_last = pid_ref[b, t0 + C - 1]
    e_last = jnp.where((pid == pid_last)[:, None], e_last, 0.0)
  pmat = pmat * scale
  if blocked:
    amat = _unit_lower_inverse_blocked(lmat, C, block, hi)
  else:
    amat = _unit_lower_inverse_rows(lmat, C)
  a_out[b, h, pl.ds(t0, C), :] = amat
  p_out[b, h, pl.ds(t0, C), :] = pmat
  wt_out[b, pl.ds(t0, C), h, :] = w * e_last


def _chunk_common(refs, b, h, t0, C, scale, has_seg):
  """Loads k, q (decayed), v-independent per-chunk quantities for the recurrent kernels."""
  k = _tile(refs["k"], b, t0, C, h)
  q = _tile(refs["q"], b, t0, C, h)
  g = _tile(refs["g"], b, t0, C, h)
  e = jnp.exp(g)
  kbar = k * e
  qbar = (scale * q) * e
  e_last = jnp.exp(refs["g"][b, t0 + C - 1, h, :])[:, None]     # [K, 1]
  if has_seg:
    cont = refs["cont"][b, pl.ds(t0, C)][:, None]               # [C, 1] float
    cont_last = refs["cont"][b, t0 + C - 1]
  else:
    cont, cont_last = None, None
  return kbar, qbar, e_last, cont, cont_last


def _recur_fwd_kernel(*refs, chunk, num_chunks, scale, has_seg, block_v, prec, save_states,
                      split):
  """Serial over chunks. split=False: emits O itself. split=True: emits Delta instead, so the
  dependent chain per chunk is 3 dots (U, Delta, S) and O is formed by _output_kernel."""
  names = ["q", "k", "v", "g", "a", "p", "wt", "h0"] + (["cont"] if has_seg else [])
  n_in = len(names)
  r = dict(zip(names, refs[:n_in]))
  o_ref, sfin_ref = refs[n_in], refs[n_in + 1]    # o_ref holds Delta when split
  states_ref = refs[n_in + 2] if save_states else None
  b, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  C = chunk
  v0 = vb * block_v
  s_init = r["h0"][b, h, :, pl.ds(v0, block_v)].astype(jnp.float32)

  def body(c, s):
    t0 = c * C
    if save_states:
      states_ref[b, h, c, :, pl.ds(v0, block_v)] = s
    kbar, qbar, e_last, cont, cont_last = _chunk_common(r, b, h, t0, C, scale, has_seg)
    v = r["v"][b, pl.ds(t0, C), h, pl.ds(v0, block_v)].astype(jnp.float32)
    amat = r["a"][b, h, pl.ds(t0, C), :]
    wt = r["wt"][b, pl.ds(t0, C), h, :]
    u, s_base, delta = _delta(kbar, v, amat, s, s_init, cont, cont_last, has_seg, prec)
    if split:
      o_ref[b, pl.ds(t0, C), h, pl.ds(v0, block_v)] = delta
    else:
      o = _output(qbar, cont, s, s_init, r["p"][b, h, pl.ds(t0, C), :], delta, has_seg, prec)
      o_ref[b, pl.ds(t0, C), h, pl.ds(v0, block_v)] = o.astype(o_ref.dtype)
    return e_last * s_base + _dot_tn(wt, delta, prec)

  s = lax.fori_loop(0, num_chunks, body, s_init)
  sfin_ref[b, h, :, pl.ds(v0, block_v)] = s


def _delta(kbar, v, amat, s, s_init, cont, cont_last, has_seg, prec):
  """U = V - Kbar S_0, Delta = A U, and the state the chunk's decay applies to (S_init when the
  chunk's last token starts a new segment inside the chunk)."""
  if has_seg:
    u = v - _dot(kbar * cont, s, prec) - _dot(kbar * (1.0 - cont), s_init, prec)
    s_base = cont_last * s + (1.0 - cont_last) * s_init
  else:
    u = v - _dot(kbar, s, prec)
    s_base = s
  return u, s_base, _dot(amat, u, prec)


def _output(qbar, cont, s, s_init, pmat, delta, has_seg, prec):
  """O = Qbar S_0 (S_init for rows whose segment starts in the chunk) + P Delta."""
  if has_seg:
    o = _dot(qbar * cont, s, prec) + _dot(qbar * (1.0 - cont), s_init, prec)
  else:
    o = _dot(qbar, s, prec)
  return o + _dot(pmat, delta, prec)


def _output_kernel(*refs, chunk, scale, has_seg, block_v, prec):
  """Parallel over (chunk, V block): O from the saved chunk-start state and Delta."""
  names = ["q", "g", "p", "delta", "states", "h0"] + (["cont"] if has_seg else [])
  r = dict(zip(names, refs[:len(names)]))
  o_ref = refs[len(names)]
  b, h, c, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)
  C = chunk
  t0 = c * C
  vs = pl.ds(vb * block_v, block_v)
  qbar = (scale * _tile(r["q"], b, t0, C, h)) * jnp.exp(_tile(r["g"], b, t0, C, h))
  cont = r["cont"][b, pl.ds(t0, C)][:, None] if has_seg else None
  o = _output(qbar, cont, r["states"][b, h, c, :, vs], r["h0"][b, h, :, vs].astype(jnp.float32),
              r["p"][b, h, pl.ds(t0, C), :], r["delta"][b, pl.ds(t0, C), h, vs], has_seg, prec)
  o_ref[b, pl.ds(t0, C), h, vs] = o.astype(o_ref.dtype)


# ----------------------------------------------------------------------------------- backward


def _recur_bwd_kernel(*refs, chunk, num_chunks, scale, has_seg, block_v, prec):
  names = ["q", "k", "v", "g", "a", "p", "wt", "h0", "states", "do", "dsfin"] + (
      ["cont"] if has_seg else [])
  n_in = len(names)
  r = dict(zip(names, refs[:n_in]))
  dv_ref, dh0_ref, dp_ref, dl_ref, dwt_ref, dkbar_ref, dqbar_ref, dgl_ref = refs[n_in:]
  b, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  C = chunk
  v0 = vb * block_v
  vs = pl.ds(v0, block_v)
  s_init = r["h0"][b, h, :, vs].astype(jnp.float32)

  def body(i, carry):
    ds, ds_init = carry
    c = num_chunks - 1 - i
    t0 = c * C
    s = r["states"][b, h, c, :, vs]
    kbar, qbar, e_last, cont, cont_last = _chunk_common(r, b, h, t0, C, scale, has_seg)
    v = r["v"][b, pl.ds(t0, C), h, vs].astype(jnp.float32)
    do = r["do"][b, pl.ds(t0, C), h, vs].astype(jnp.float32)
    amat = r["a"][b, h, pl.ds(t0, C), :]
    pmat = r["p"][b, h, pl.ds(t0, C), :]
    wt = r["wt"][b, pl.ds(t0, C), h, :]
    u, s_base, delta = _delta(kbar, v, amat, s, s_init, cont, cont_last, has_seg, prec)
    d_delta = _dot_tn(pmat, do, prec) + _dot(wt, ds, prec)
    du = _dot_tn(amat, d_delta, prec)
    dv_ref[b, pl.ds(t0, C), h, vs] = du.astype(dv_ref.dtype)
    dp_ref[b, h, vb, pl.ds(t0, C), :] = _dot_nt(do, delta, prec)
    dl_ref[b, h, vb, pl.ds(t0, C), :] = -_dot_nt(du, delta, prec)
    dwt_ref[b, h, vb, pl.ds(t0, C), :] = _dot_nt(delta, ds, prec)
    e_last_row = jnp.exp(r["g"][b, t0 + C - 1, h, :])
    dgl_ref[b, h, vb, c, :] = e_last_row * jnp.sum(ds * s_base, axis=1)
    ds_decayed = e_last * ds
    if has_seg:
      dkbar = -(_dot_nt(du * cont, s, prec) + _dot_nt(du * (1.0 - cont), s_init, prec))
      dqbar = _dot_nt(do * cont, s, prec) + _dot_nt(do * (1.0 - cont), s_init, prec)
      ds_prev = (cont_last * ds_decayed + _dot_tn(qbar * cont, do, prec)
                 - _dot_tn(kbar * cont, du, prec))
      ds_init = ds_init + ((1.0 - cont_last) * ds_decayed
                           + _dot_tn(qbar * (1.0 - cont), do, prec)
                           - _dot_tn(kbar * (1.0 - cont), du, prec))
    else:
      dkbar = -_dot_nt(du, s, prec)
      dqbar = _dot_nt(do, s, prec)
      ds_prev = ds_decayed + _dot_tn(qbar, do, prec) - _dot_tn(kbar, du, prec)
    dkbar_ref[b, h, vb, pl.ds(t0, C), :] = dkbar
    dqbar_ref[b, h, vb, pl.ds(t0, C), :] = dqbar
    return ds_prev, ds_init

  ds0 = r["dsfin"][b, h, :, vs].astype(jnp.float32)
  ds, ds_init = lax.fori_loop(0, num_chunks, body, (ds0, jnp.zeros_like(ds0)))
  dh0_ref[b, h, :, vs] = ds + ds_init


def _pairs_bwd_loop(q, k, g, dpm, dlm, r, b, h, t0, C):
  row, col = _iota(C, 0), _iota(C, 1)
  row_k = lax.broadcasted_iota(jnp.int32, q.shape, 0)

  def col_body(j, acc):
    dq_acc, dk_acc, dw_acc = acc
    wj = r["w"][b, pl.ds(t0 + j, 1), h, :].astype(jnp.float32)
    gj = r["g"][b, pl.ds(t0 + j, 1), h, :]
    e = jnp.exp(jnp.minimum(g - gj, 0.0))
    pj = jnp.sum(jnp.where(col == j, dpm, 0.0), axis=1)[:, None]     # dP[:, j] (scaled)
    lj = jnp.sum(jnp.where(col == j, dlm, 0.0), axis=1)[:, None]     # dL[:, j]
    we = wj * e
    dq_acc = dq_acc + pj * we
    dk_acc = dk_acc + lj * we
    dwj = jnp.sum((pj * q + lj * k) * e, axis=0)
    dw_acc = jnp.where(row_k == j, dwj[None, :], dw_acc)
    return dq_acc, dk_acc, dw_acc

  zeros = jnp.zeros_like(q)
  return lax.fori_loop(0, C, col_body, (zeros, zeros, zeros))


def _pairs_bwd_blocked(q, k, w, g, dpm, dlm, r, b, h, t0, C, block, prec, hi, scale, has_seg,
                       num_vb):
  row, col = _iota(C, 0), _iota(C, 1)
  row_k = lax.broadcasted_iota(jnp.int32, q.shape, 0)
  r16, c16 = _iota(block, 0), _iota(block, 1)
  r16k = lax.broadcasted_iota(jnp.int32, (block, q.shape[1]), 0)
  dq_acc = jnp.zeros_like(q)
  dk_acc = jnp.zeros_like(q)
  dw_acc = jnp.zeros_like(q)
  for jb in range(C // block):
    js = jb * block
    if js + block < C:
      g_r = r["g"][b, pl.ds(t0 + js + block - 1, 1), h, :]
      xs = jnp.exp(jnp.minimum(g - g_r, 0.0))
      ys = jnp.exp(jnp.minimum(g_r - g, 0.0))
      y_t = jnp.where((row_k >= js) & (row_k < js + block), w * ys, 0.0)
      sel = (row >= js + block) & (col >= js) & (col < js + block)
      gp = jnp.where(sel, dpm, 0.0)
      gl = jnp.where(sel, dlm, 0.0)
      dq_acc = dq_acc + xs * _dot(gp, y_t, prec)
      dk_acc = dk_acc + xs * _dot(gl, y_t, prec)
      dw_acc = dw_acc + ys * (_dot_tn(gp, q * xs, prec) + _dot_tn(gl, k * xs, prec))
    rows = pl.ds(t0 + js, block)
    cols = pl.ds(js, block)
    gpd = r["dp"][b, h, 0, rows, cols]
    gld = r["dl"][b, h, 0, rows, cols]
    for j in range(1, num_vb):
      gpd = gpd + r["dp"][b, h, j, rows, cols]
      gld = gld + r["dl"][b, h, j, rows, cols]
    gpd = jnp.where(r16 > c16, gpd, 0.0) * scale   # P's diagonal is handled by the caller
    gld = jnp.where(r16 > c16, gld, 0.0)
    if has_seg:
      pidb = r["pid"][b, rows]
      sameb = pidb[:, None] == pidb[None, :]
      gpd = jnp.where(sameb, gpd, 0.0)
      gld = jnp.where(sameb, gld, 0.0)
    qj = r["q"][b, rows, h, :].astype(jnp.float32)
    kj = r["k"][b, rows, h, :].astype(jnp.float32)
    gjb = r["g"][b, rows, h, :]

    def col_body(jj, acc, js=js, qj=qj, kj=kj, gjb=gjb, gpd=gpd, gld=gld):
      dqb, dkb, dwb = acc
      wj = r["w"][b, pl.ds(t0 + js + jj, 1), h, :].astype(jnp.float32)
      gj = r["g"][b, pl.ds(t0 + js + jj, 1), h, :]
      e = jnp.exp(jnp.minimum(gjb - gj, 0.0))
      pj = jnp.sum(jnp.where(c16 == jj, gpd, 0.0), axis=1)[:, None]
      lj = jnp.sum(jnp.where(c16 == jj, gld, 0.0), axis=1)[:, None]
      we = wj * e
      dqb = dqb + pj * we
      dkb = dkb + lj * we
      dwj = jnp.sum((pj * qj + lj * kj) * e, axis=0)
      dwb = jnp.where(r16k == jj, dwj[None, :], dwb)
      return dqb, dkb, dwb

    zb = jnp.zeros((block, q.shape[1]), jnp.float32)
    dqb, dkb, dwb = lax.fori_loop(0, block, col_body, (zb, zb, zb))
    selm = _select(block, C, js)
    dq_acc = dq_acc + _dot_tn(selm, dqb, hi)
    dk_acc = dk_acc + _dot_tn(selm, dkb, hi)
    dw_acc = dw_acc + _dot_tn(selm, dwb, hi)
  return dq_acc, dk_acc, dw_acc


def _intra_bwd_epilogue(q, k, w, g, acc, p_diag, dwt, dkbar, dqbar, dgl, e_last, scale, hi):
  """Per-token gradients from the pair accumulators; works on any slice of the K columns.

  acc = (X_q, X_k, Y_w): X_r = sum_j G_rj y_j e_rj (G = dP or dL, y = w) and
  Y_j = sum_r (dP_rj q_r + dL_rj k_r) e_rj."""
  dq_acc, dk_acc, dw_acc = acc
  C = q.shape[0]
  row, col = _iota(C, 0), _iota(C, 1)
  row_k = lax.broadcasted_iota(jnp.int32, q.shape, 0)
  e0 = jnp.exp(g)
  qbar = (scale * q) * e0
  kbar = k * e0
  wt = w * e_last
  dq = dq_acc + p_diag * w + scale * dqbar * e0
  dk = dk_acc + dkbar * e0
  dw = dw_acc + p_diag * q + dwt * e_last
  # Wt_j = w_j exp(g_last - g_j): its log-decay gradient t_j reaches log_alpha_s exactly for
  # j < s <= last. Emitting that directly (dla_x = strict-lower-ones @ t) instead of +t at `last`
  # and -t at j avoids cancelling O(1) terms when exp(g_last - g_j) == 1 (e.g. padded tails).
  twt = dwt * wt
  dla_x = _dot((row > col).astype(jnp.float32), twt, hi)
  dg = q * dq_acc + k * dk_acc - w * dw_acc + dqbar * qbar + dkbar * kbar
  dg = dg + jnp.where(row_k == C - 1, dgl[None, :], 0.0)
  return dq, dk, dw, dg, dla_x


def _pairs_bwd_kblock(q, k, w, g, dpm, dlm):
  """The pair accumulators of one [C, bk] column block, all (r, j) pairs at once."""
  e = jnp.exp(jnp.minimum(g[:, None, :] - g[None, :, :], 0.0))          # [r, j, c]
  we = w[None, :, :] * e
  dq_acc = jnp.sum(dpm[:, :, None] * we, axis=1)
  dk_acc = jnp.sum(dlm[:, :, None] * we, axis=1)
  dw_acc = jnp.sum((dpm[:, :, None] * q[:, None, :] + dlm[:, :, None] * k[:, None, :]) * e, axis=0)
  return dq_acc, dk_acc, dw_acc


def _intra_bwd_kernel(*refs, chunk, scale, has_seg, num_vb, blocked, block, kblock, prec, hi):
  names = ["q", "k", "w", "g", "dp", "dl", "dwt", "dkbar", "dqbar", "dgl"] + (
      ["pid"] if has_seg else [])
  n_in = len(names)
  r = dict(zip(names, refs[:n_in]))
  outs = refs[n_in:]
  b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  C = chunk
  t0 = c * C
  kd = r["q"].shape[-1]
  row, col = _iota(C, 0), _iota(C, 1)
  rows = pl.ds(t0, C)

  def vsum(name, cols):
    acc = r[name][b, h, 0, rows, cols]
    for j in range(1, num_vb):
      acc = acc + r[name][b, h, j, rows, cols]
    return acc

  def dgl_sum(cols):
    acc = r["dgl"][b, h, 0, c, cols]
    for j in range(1, num_vb):
      acc = acc + r["dgl"][b, h, j, c, cols]
    return acc

  def e_last_of(g, cols):
    g_last = r["g"][b, t0 + C - 1, h, cols]
    e_last = jnp.exp(jnp.minimum(g_last[None, :] - g, 0.0))
    if has_seg:
      e_last = jnp.where((pid == r["pid"][b, t0 + C - 1])[:, None], e_last, 0.0)
    return e_last

  dpm = jnp.where(row >= col, vsum("dp", pl.ds(0, C)), 0.0) * scale
  dlm = jnp.where(row > col, vsum("dl", pl.ds(0, C)), 0.0)
  pid = None
  if has_seg:
    same, pid = _same_seg(r["pid"], b, t0, C)
    dpm = dpm * same
    dlm = dlm * same
  # P's diagonal (r == j: decay factor exactly 1) is split off: its contributions to dg cancel
  # exactly, and leaving them in would swamp tiny decay gradients with rounding noise.
  p_diag = jnp.sum(jnp.where(row == col, dpm, 0.0), axis=1)[:, None]
  dpm = jnp.where(row > col, dpm, 0.0)

  def store(vals, cols):
    for ref, val in zip(outs, vals):
      ref[b, rows, h, cols] = val

  if kblock:
    def kbody(i, carry):
      cols = pl.ds(i * kblock, kblock)
      q, k, w, g = (r[n][b, rows, h, cols].astype(jnp.float32) for n in ("q", "k", "w", "g"))
      acc = _pairs_bwd_kblock(q, k, w, g, dpm, dlm)
      store(_intra_bwd_epilogue(q, k, w, g, acc, p_diag, vsum("dwt", cols), vsum("dkbar", cols),
                                vsum("dqbar", cols), dgl_sum(cols), e_last_of(g, cols), scale, hi),
            cols)
      return carry

    lax.fori_loop(0, kd // kblock, kbody, 0)
    return
  allk = pl.ds(0, kd)
  q = _tile(r["q"], b, t0, C, h)
  k = _tile(r["k"], b, t0, C, h)
  w = _tile(r["w"], b, t0, C, h)
  g = _tile(r["g"], b, t0, C, h)
  if blocked:
    acc = _pairs_bwd_blocked(q, k, w, g, dpm, dlm, r, b, h, t0, C, block, prec, hi, scale,
                             has_seg, num_vb)
  else:
    acc = _pairs_bwd_loop(q, k, g, dpm, dlm, r, b, h, t0, C)
  store(_intra_bwd_epilogue(q, k, w, g, acc, p_diag, vsum("dwt", allk), vsum("dkbar", allk),
                            vsum("dqbar", allk), dgl_sum(allk), e_last_of(g, allk), scale, hi),
        allk)


# ----------------------------------------------------------------------------------- wrappers


def _precision(cfg, cfg_prec, interpret):
  """The kernels' dot precision: 'fast' means TF32, or bf16 operands with cfg.fast_dots='bf16'."""
  if cfg_prec == "fast" and cfg.fast_dots == "bf16":
    return BF16_OPERANDS
  return common.dot_precision(cfg_prec, interpret)


def _kblock(cfg, kd):
  """K-column block of the pair products (0: column loop), capped at K."""
  return min(cfg.kblock, kd) if cfg.kblock else 0


def _params(interpret, num_warps, cfg):
  return dict(interpret=interpret,
              compiler_params=common.compiler_params(num_warps, cfg.num_stages))


def intra_forward(q, k, w, g, pid, *, chunk, scale, interpret, cfg, cfg_prec):
  """Stage 1 (parallel over chunks): A = (I + L)^-1, P (scaled) and Wt."""
  bsz, t, nh, kd = k.shape
  nc = t // chunk
  has_seg = pid is not None
  prec = _precision(cfg, cfg_prec, interpret)
  f32 = jnp.float32
  intra_in = [q, k, w, g] + ([pid] if has_seg else [])
  amat, pmat, wt = pl.pallas_call(
      functools.partial(_intra_fwd_kernel, chunk=chunk, scale=scale, has_seg=has_seg,
                        blocked=cfg.blocked and chunk > cfg.block, block=cfg.block,
                        kblock=_kblock(cfg, kd), prec=prec,
                        hi=common.dot_precision("exact", interpret)),
      out_shape=(jax.ShapeDtypeStruct((bsz, nh, t, chunk), f32),
                 jax.ShapeDtypeStruct((bsz, nh, t, chunk), f32),
                 jax.ShapeDtypeStruct((bsz, t, nh, kd), f32)),
      grid=(bsz, nh, nc), name="delta_rule_intra_fwd",
      **_params(interpret, cfg.num_warps_intra, cfg),
  )(*intra_in)
  return amat, pmat, wt


def recur_forward(q, k, v, g, h0, cont, amat, pmat, wt, *, chunk, scale, interpret, cfg,
                  cfg_prec, save_states):
  """Stage 2 (serial over chunks): outputs, final state and (optionally) chunk-start states.

  With cfg.split_output the serial kernel emits Delta and the chunk-start states, and a parallel
  kernel forms the outputs (the states are then materialised also when not saved)."""
  bsz, t, nh, kd = k.shape
  vd = v.shape[-1]
  nc = t // chunk
  has_seg = cont is not None
  prec = _precision(cfg, cfg_prec, interpret)
  f32 = jnp.float32
  block_v = min(cfg.block_v, vd)
  split = cfg.split_output
  keep_states = save_states or split
  out_shape = [jax.ShapeDtypeStruct(v.shape[:3] + (vd,), f32 if split else q.dtype),
               jax.ShapeDtypeStruct((bsz, nh, kd, vd), f32)]
  if keep_states:
    out_shape.append(jax.ShapeDtypeStruct((bsz, nh, nc, kd, vd), f32))
  recur_in = [q, k, v, g, amat, pmat, wt, h0] + ([cont] if has_seg else [])
  outs = pl.pallas_call(
      functools.partial(_recur_fwd_kernel, chunk=chunk, num_chunks=nc, scale=scale,
                        has_seg=has_seg, block_v=block_v, prec=prec, save_states=keep_states,
                        split=split),
      out_shape=tuple(out_shape), grid=(bsz, nh, vd // block_v), name="delta_rule_recur_fwd",
      **_params(interpret, cfg.num_warps_recur, cfg),
  )(*recur_in)
  o, sfin = outs[0], outs[1]
  states = outs[2] if keep_states else None
  if split:
    out_in = [q, g, pmat, o, states, h0] + ([cont] if has_seg else [])
    o = pl.pallas_call(
        functools.partial(_output_kernel, chunk=chunk, scale=scale, has_seg=has_seg,
                          block_v=block_v, prec=prec),
        out_shape=jax.ShapeDtypeStruct(v.shape[:3] + (vd,), q.dtype),
        grid=(bsz, nh, nc, vd // block_v), name="delta_rule_output",
        **_params(interpret, cfg.num_warps_intra, cfg),
    )(*out_in)
  return o, sfin, states if save_states else None


def forward(q, k, v, w, g, h0, cont, pid, *, chunk, scale, interpret, cfg, cfg_prec,
            save_states):
  """q, k, w: [B,T,H,K]; v: [B,T,H,V]; g: [B,T,H,K] f32 chunk-local cumsum; h0 [B,H,K,V] f32.

  cont: [B,T] f32 or None; pid: [B,T] int32 or None (both None without segments).
  """
  kw = dict(chunk=chunk, scale=scale, interpret=interpret, cfg=cfg, cfg_prec=cfg_prec)
  amat, pmat, wt = intra_forward(q, k, w, g, pid, **kw)
  o, sfin, states = recur_forward(q, k, v, g, h0, cont, amat, pmat, wt, save_states=save_states,
                                  **kw)
  return o, sfin, (amat, pmat, wt, states)


def recur_backward(q, k, v, g, h0, cont, res, do, dsfin, *, chunk, scale, interpret, cfg,
                   cfg_prec):
  """Backward stage 1 (serial over chunks, reversed): dV, dS_init and per-V-block partials."""
  amat, pmat, wt, states = res
  bsz, t, nh, kd = k.shape
  vd = v.shape[-1]
  nc = t // chunk
  has_seg = cont is not None
  prec = _precision(cfg, cfg_prec, interpret)
  f32 = jnp.float32
  block_v = min(cfg.block_v, vd)
  nvb = vd // block_v
  recur_in = [q, k, v, g, amat, pmat, wt, h0, states, do, dsfin] + ([cont] if has_seg else [])
  cc = jax.ShapeDtypeStruct((bsz, nh, nvb, t, chunk), f32)
  ck = jax.ShapeDtypeStruct((bsz, nh, nvb, t, kd), f32)
  return pl.pallas_call(
      functools.partial(_recur_bwd_kernel, chunk=chunk, num_chunks=nc, scale=scale,
                        has_seg=has_seg, block_v=block_v, prec=prec),
      out_shape=(jax.ShapeDtypeStruct(v.shape, f32),
                 jax.ShapeDtypeStruct((bsz, nh, kd, vd), f32),
                 cc, cc, ck, ck, ck,
                 jax.ShapeDtypeStruct((bsz, nh, nvb, nc, kd), f32)),
      grid=(bsz, nh, nvb), name="delta_rule_recur_bwd",
      **_params(interpret, cfg.num_warps_recur, cfg),
  )(*recur_in)


def intra_backward(q, k, w, g, pid, partials, *, chunk, scale, interpret, cfg, cfg_prec):
  """Backward stage 2 (parallel over chunks): dq, dk, dw, dg and the direct log-decay term."""
  bsz, t, nh, kd = k.shape
  nc = t // chunk
  has_seg = pid is not None
  nvb = partials[0].shape[2]
  prec = _precision(cfg, cfg_prec, interpret)
  intra_in = [q, k, w, g, *partials] + ([pid] if has_seg else [])
  lane = jax.ShapeDtypeStruct((bsz, t, nh, kd), jnp.float32)
  return pl.pallas_call(
      functools.partial(_intra_bwd_kernel, chunk=chunk, scale=scale, has_seg=has_seg,
                        num_vb=nvb, blocked=cfg.blocked and chunk > cfg.block, block=cfg.block,
                        kblock=_kblock(cfg, kd), prec=prec,
                        hi=common.dot_precision("exact", interpret)),
      out_shape=(lane, lane, lane, lane, lane), grid=(bsz, nh, nc), name="delta_rule_intra_bwd",
      **_params(interpret, cfg.num_warps_intra, cfg),
  )(*intra_in)


def backward(q, k, v, w, g, h0, cont, pid, res, do, dsfin, *, chunk, scale, interpret, cfg,
             cfg_prec):
  kw = dict(chunk=chunk, scale=scale, interpret=interpret, cfg=cfg, cfg_prec=cfg_prec)
  dv, dh0, *partials = recur_backward(q, k, v, g, h0, cont, res, do, dsfin, **kw)
  dq, dk, dw, dg, dla_x = intra_backward(q, k, w, g, pid, partials, **kw)
  return dq, dk, dv, dw, dg, dla_x, dh0
