"""Pallas kernels for the chunked asymmetric delta rule with per-channel decay.

Per (batch, head) and chunk of C tokens with chunk-local log-decay cumsum g (restarted at segment
starts), state S_0 at the chunk start (S_init for rows whose segment starts inside the chunk):
    L_rj = sum_c k_rc w_jc exp(g_rc - g_jc)   (r > j, same segment)        A = (I + L)^-1
    P_rj = scale sum_c q_rc w_jc exp(g_rc - g_jc)   (r >= j, same segment)
    Kbar = k * exp(g), Qbar = scale q * exp(g), Wt_j = w_j exp(g_last - g_j) (same segment as last)
    U = V - Kbar S_0,  Delta = A U,  O = Qbar S_0 + P Delta,  S_C = exp(g_last) S_0 + Wt^T Delta.
Decay ratios are only ever formed as exp(min(g_r - g_j, 0)) of log DIFFERENCES, never exp(-g).

Kernels (options in config.DeltaRuleConfig; BV = block_v in the serial kernels, block_v_parallel
in the parallel ones):
  _intra_fwd   grid (B, H, NC): L, P (column loop over the chunk, or matmuls off the diagonal
               tiles with `blocked`), A (`inverse`), Wt, and with `wy` W = A Kbar, which turns
               the serial chain into Delta = A U' - W S_0 (U' = V minus the S_init rows).
  _recur_fwd   grid (B, H, V/BV): serial over chunks; S_final and the chunk-start states, and O
               (or, with `split_output`, Delta for _output_kernel).
  _output      grid (B, H, NC, V/BV): O = Qbar S_0 + P Delta from the saved states.
  _recur_bwd   grid (B, H, V/BV): serial over chunks in reverse; the dS chain alone, saving each
               chunk's dS (S_init's share of segments: seg_init_grad, in XLA).
  _bwd_partials grid (B, H, NC, V/BV): dV and per-V-block partial gradients of P, L, Wt, Kbar,
               Qbar, g_last.
  _intra_bwd   grid (B, H, NC): sums the partials, back-propagates through the decay-weighted
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


def _e_last(g, g_last, pid=None, pid_last=None):
  """exp(g_last - g) per row (the decay from each token to the chunk's last one), zero for rows
  outside the last token's segment (pid given)."""
  e_last = jnp.exp(jnp.minimum(g_last[None, :] - g, 0.0))
  if pid is not None:
    e_last = jnp.where((pid == pid_last)[:, None], e_last, 0.0)
  return e_last


# ------------------------------------------------------------------------------------ forward


def _block_rows(ref, b, h, t0, C, block, jj, cols=slice(None)):
  """[C, K] f32 (K: the `cols` columns): row r holds ref's row (r // block) * block + jj, the
  jj-th token of r's diagonal block (C // block single-row loads)."""
  out = None
  for ib in range(C // block):
    x = ref[b, pl.ds(t0 + ib * block + jj, 1), h, cols].astype(jnp.float32)
    if out is None:
      out = jnp.broadcast_to(x, (C, x.shape[1]))
    else:
      out = jnp.where(lax.broadcasted_iota(jnp.int32, out.shape, 0) >= ib * block, x, out)
  return out


def _diag_products(q, k, g, w_ref, g_ref, b, h, t0, C, block, cols=slice(None)):
  """L (strict) and P/scale (inclusive) inside the diagonal block x block tiles of the chunk (all
  of it when block == C), by a loop over the `block` columns of every tile at once: exact,
  exp(<= 0) only."""
  row, col = _iota(C, 0), _iota(C, 1)
  at0 = (row // block) * block
  rmod = row % block

  def col_body(jj, lp):
    lmat, pmat = lp
    we = _block_rows(w_ref, b, h, t0, C, block, jj, cols)
    we = we * jnp.exp(jnp.minimum(g - _block_rows(g_ref, b, h, t0, C, block, jj, cols), 0.0))
    kw = jnp.sum(k * we, axis=1)[:, None]
    qw = jnp.sum(q * we, axis=1)[:, None]
    at = col == at0 + jj
    lmat = jnp.where(at & (rmod > jj), kw, lmat)
    pmat = jnp.where(at & (rmod >= jj), qw, pmat)
    return lmat, pmat

  zeros = jnp.zeros((C, C), jnp.float32)
  return lax.fori_loop(0, block, col_body, (zeros, zeros))


def _offdiag_factors(g, w, g_ref, b, h, t0, C, block, js):
  """Column block [js, js + block) against the later rows, around the reference point g_n of the
  block's last token: exp(g_r - g_j) = exp(g_r - g_n) exp(g_n - g_j), both factors exp(<= 0).
  Returns (xs [C, K] row factors, y_t [C, K] w * column factors, zero outside the block, ys)."""
  row_k = lax.broadcasted_iota(jnp.int32, g.shape, 0)
  g_n = g_ref[b, pl.ds(t0 + js + block - 1, 1), h, :]
  xs = jnp.exp(jnp.minimum(g - g_n, 0.0))
  ys = jnp.exp(jnp.minimum(g_n - g, 0.0))
  y_t = jnp.where((row_k >= js) & (row_k < js + block), w * ys, 0.0)
  return xs, y_t, ys


def _pairs_blocked(q, k, w, g, refs, b, h, t0, C, block, prec):
  """L and P/scale with sub-blocks: off-diagonal blocks as tensor-core matmuls around a reference
  point; the diagonal blocks by a `block`-step column loop over all of them at once."""
  row = _iota(C, 0)
  lmat, pmat = _diag_products(q, k, g, refs[2], refs[3], b, h, t0, C, block)
  for js in range(0, C - block, block):
    xs, y_t, _ = _offdiag_factors(g, w, refs[3], b, h, t0, C, block, js)
    later = row >= js + block
    lmat = lmat + jnp.where(later, _dot_nt(k * xs, y_t, prec), 0.0)
    pmat = pmat + jnp.where(later, _dot_nt(q * xs, y_t, prec), 0.0)
  return lmat, pmat


def _unit_lower_inverse_rows(lmat, C):
  """(I + L)^-1 for strictly lower L, by forward substitution one row at a time."""
  row, col = _iota(C, 0), _iota(C, 1)
  eye = (row == col).astype(jnp.float32)

  def sub_body(i, amat):
    lrow = jnp.sum(jnp.where(row == i, lmat, 0.0), axis=0)          # L[i, :]
    new = jnp.sum(lrow[:, None] * amat, axis=0)                     # (L A)[i, :]
    return jnp.where(row == i, jnp.where(col == i, 1.0, 0.0) - new[None, :], amat)

  return lax.fori_loop(1, C, sub_body, eye)


def _unit_lower_inverse_rows_t(lmat, C):
  """(I + L)^-1 by forward substitution, built as its transpose one column at a time, so every
  reduction runs along axis 1 (within a row: no cross-warp reduction on a GPU)."""
  row, col = _iota(C, 0), _iota(C, 1)
  eye = (row == col).astype(jnp.float32)
  lt = jnp.transpose(lmat)

  def sub_body(i, at):
    li = jnp.sum(jnp.where(col == i, lt, 0.0), axis=1)[None, :]   # L[i, :] as a row
    new = jnp.sum(at * li, axis=1)[:, None]                       # (A^T L^T)[:, i]
    return jnp.where(col == i, jnp.where(row == i, 1.0, 0.0) - new, at)

  return jnp.transpose(lax.fori_loop(1, C, sub_body, eye))


def _unit_lower_inverse_doubling(lmat, C, hi):
  """(I + L)^-1 = (I + M)(I + M^2)(I + M^4)... with M = -L (nilpotent: M^C = 0): 2 log2(C) - 2
  dots, fp32-accurate (hi)."""
  row, col = _iota(C, 0), _iota(C, 1)
  m = -lmat
  amat = (row == col).astype(jnp.float32) + m
  for _ in range(C.bit_length() - 2):
    m = _dot(m, m, hi)
    amat = amat + _dot(amat, m, hi)
  return amat


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


def _unit_lower_inverse(lmat, C, inverse, block, hi):
  if inverse == "rows":
    return _unit_lower_inverse_rows(lmat, C)
  if inverse == "rows_t":
    return _unit_lower_inverse_rows_t(lmat, C)
  if inverse == "doubling":
    return _unit_lower_inverse_doubling(lmat, C, hi)
  return _unit_lower_inverse_blocked(lmat, C, min(block, C), hi)


def _split_products(refs, b, h, t0, C, k_split):
  """_diag_products over the whole chunk, K in k_split column slices one after another: exact
  (L and P are sums over K), and only [C, K / k_split] tiles are live in the loop."""
  kd = refs[0].shape[-1]
  lmat = pmat = None
  for i in range(k_split):
    cols = pl.ds(i * (kd // k_split), kd // k_split)
    q, k, g = (refs[n][b, pl.ds(t0, C), h, cols].astype(jnp.float32) for n in (0, 1, 3))
    lp = _diag_products(q, k, g, refs[2], refs[3], b, h, t0, C, C, cols)
    lmat, pmat = lp if lmat is None else (lmat + lp[0], pmat + lp[1])
  return lmat, pmat


def _intra_fwd_kernel(*refs, chunk, scale, has_seg, blocked, block, k_split, wy, inverse,
                      prec, hi):
  n_in = 4 + (2 if has_seg else 0)
  q_ref, k_ref, w_ref, g_ref = refs[:4]
  pid_ref, cont_ref = refs[4:n_in] if has_seg else (None, None)
  a_out, p_out, wt_out = refs[n_in:n_in + 3]
  b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  C = chunk
  t0 = c * C
  if blocked:
    q, k, w, g = (_tile(x, b, t0, C, h) for x in refs[:4])
    lmat, pmat = _pairs_blocked(q, k, w, g, refs, b, h, t0, C, block, prec)
  else:
    lmat, pmat = _split_products(refs, b, h, t0, C, k_split)
    # Loaded after the pair loops, so these full-K tiles are not live inside them.
    k, w, g = (_tile(x, b, t0, C, h) for x in (k_ref, w_ref, g_ref))
  pid = None
  if has_seg:
    same, pid = _same_seg(pid_ref, b, t0, C)
    lmat = lmat * same
    pmat = pmat * same
  e_last = _e_last(g, g_ref[b, t0 + C - 1, h, :], pid,
                   pid_ref[b, t0 + C - 1] if has_seg else None)
  pmat = pmat * scale
  amat = _unit_lower_inverse(lmat, C, inverse, block, hi)
  a_out[b, h, pl.ds(t0, C), :] = amat.astype(a_out.dtype)
  p_out[b, h, pl.ds(t0, C), :] = pmat.astype(p_out.dtype)
  wt_out[b, pl.ds(t0, C), h, :] = (w * e_last).astype(wt_out.dtype)
  if wy:
    # Compact WY: W = A Kbar (rows continuing the chunk-start state only), so the serial kernels
    # form Delta = A U' - W S_0 with one dot on the state chain instead of two.
    kbar = k * jnp.exp(g)
    if has_seg:
      kbar = kbar * cont_ref[b, pl.ds(t0, C)][:, None]
    wk_out = refs[n_in + 3]
    wk_out[b, pl.ds(t0, C), h, :] = _dot(amat, kbar, prec).astype(wk_out.dtype)


def _chunk_common(refs, b, h, t0, C, scale, has_seg, need_k=True, need_q=True):
  """Per-chunk, V-independent quantities of the recurrent kernels: Kbar, Qbar (None unless
  needed: the serial kernels load only what their chain uses), e_last, and the segment masks."""
  g = _tile(refs["g"], b, t0, C, h) if need_k or need_q else None
  kbar = _tile(refs["k"], b, t0, C, h) * jnp.exp(g) if need_k else None
  qbar = (scale * _tile(refs["q"], b, t0, C, h)) * jnp.exp(g) if need_q else None
  e_last = jnp.exp(refs["g"][b, t0 + C - 1, h, :])[:, None]     # [K, 1]
  if has_seg:
    cont = refs["cont"][b, pl.ds(t0, C)][:, None]               # [C, 1] float
    cont_last = refs["cont"][b, t0 + C - 1]
  else:
    cont, cont_last = None, None
  return kbar, qbar, e_last, cont, cont_last


def _recur_fwd_kernel(*refs, chunk, num_chunks, scale, has_seg, block_v, prec, save_states,
                      split, wy):
  """Serial over chunks. split=False: emits O itself. split=True: emits Delta instead, and O is
  formed by _output_kernel. The dependent chain per chunk is 3 dots (U, Delta, S), 2 with wy."""
  names = ["q", "k", "v", "g", "a", "p", "wt", "h0"] + (["cont"] if has_seg else []) + (
      ["wk"] if wy else [])
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
      states_ref[b, h, c, :, pl.ds(v0, block_v)] = s.astype(states_ref.dtype)
    kbar, qbar, e_last, cont, cont_last = _chunk_common(
        r, b, h, t0, C, scale, has_seg, need_k=has_seg or not wy, need_q=not split)
    v = r["v"][b, pl.ds(t0, C), h, pl.ds(v0, block_v)].astype(jnp.float32)
    amat = r["a"][b, h, pl.ds(t0, C), :]
    wt = r["wt"][b, pl.ds(t0, C), h, :]
    wk = r["wk"][b, pl.ds(t0, C), h, :] if wy else None
    s_base, delta = _delta(kbar, v, amat, wk, s, s_init, cont, cont_last, has_seg, prec)
    if split:
      o_ref[b, pl.ds(t0, C), h, pl.ds(v0, block_v)] = delta.astype(o_ref.dtype)
    else:
      o = _output(qbar, cont, s, s_init, r["p"][b, h, pl.ds(t0, C), :], delta, has_seg, prec)
      o_ref[b, pl.ds(t0, C), h, pl.ds(v0, block_v)] = o.astype(o_ref.dtype)
    return e_last * s_base + _dot_tn(wt, delta, prec)

  s = lax.fori_loop(0, num_chunks, body, s_init)
  sfin_ref[b, h, :, pl.ds(v0, block_v)] = s


def _delta(kbar, v, amat, wk, s, s_init, cont, cont_last, has_seg, prec):
  """Delta = A U with U = V - Kbar S_0, and the state the chunk's decay applies to (S_init when
  the chunk's last token starts a new segment inside the chunk).

  wk = A Kbar (rows with cont) or None: then Delta = A (V - Kbar_new S_init) - wk S_0, whose
  only dot on the serial state chain is wk S_0."""
  s_base = cont_last * s + (1.0 - cont_last) * s_init if has_seg else s
  if wk is not None:
    u_off = v - _dot(kbar * (1.0 - cont), s_init, prec) if has_seg else v
    return s_base, _dot(amat, u_off, prec) - _dot(wk, s, prec)
  if has_seg:
    u = v - _dot(kbar * cont, s, prec) - _dot(kbar * (1.0 - cont), s_init, prec)
  else:
    u = v - _dot(kbar, s, prec)
  return s_base, _dot(amat, u, prec)


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
  o = _output(qbar, cont, r["states"][b, h, c, :, vs].astype(jnp.float32),
              r["h0"][b, h, :, vs].astype(jnp.float32),
              r["p"][b, h, pl.ds(t0, C), :], r["delta"][b, pl.ds(t0, C), h, vs], has_seg, prec)
  o_ref[b, pl.ds(t0, C), h, vs] = o.astype(o_ref.dtype)


# ----------------------------------------------------------------------------------- backward


_BWD_IN = ["q", "k", "v", "g", "a", "p", "wt", "h0", "do"]


def _bwd_names(has_seg, wy, extra):
  return _BWD_IN + extra + (["cont"] if has_seg else []) + (["wk"] if wy else [])


def _bwd_chain(r, b, h, t0, C, scale, has_seg, vs, ds, prec, wy):
  """One chunk of the reverse state chain, given dS (the gradient of the state after the chunk):
  dDelta = P^T dO + Wt dS, dU = A^T dDelta and dS_prev (S_init's share of segments that start
  inside the chunk is seg_init_grad's, outside the kernels).

  Kbar_c^T dU = (A Kbar_c)^T dDelta: with wy the chain dS -> dDelta -> dS_prev is 2 dots."""
  kbar, qbar, e_last, cont, cont_last = _chunk_common(r, b, h, t0, C, scale, has_seg,
                                                      need_k=has_seg or not wy)
  do = r["do"][b, pl.ds(t0, C), h, vs].astype(jnp.float32)
  amat = r["a"][b, h, pl.ds(t0, C), :]
  d_delta = _dot_tn(r["p"][b, h, pl.ds(t0, C), :], do, prec) + _dot(
      r["wt"][b, pl.ds(t0, C), h, :], ds, prec)
  du = _dot_tn(amat, d_delta, prec)
  ds_decayed = e_last * ds
  cq = qbar * cont if has_seg else qbar
  if wy:
    chain = _dot_tn(r["wk"][b, pl.ds(t0, C), h, :], d_delta, prec)
  else:
    chain = _dot_tn(kbar * cont if has_seg else kbar, du, prec)
  ds_prev = (cont_last * ds_decayed if has_seg else ds_decayed) + _dot_tn(cq, do, prec) - chain
  return ds_prev, dict(kbar=kbar, cont=cont, cont_last=cont_last, do=do, amat=amat, du=du)


def _bwd_partials(r, outs, b, h, c, vb, C, has_seg, vs, s, ds, s_init, x, prec, wy):
  """The chunk's dV and per-V-block partial gradients of P, L, Wt, Kbar, Qbar and g_last."""
  dv_ref, dp_ref, dl_ref, dwt_ref, dkbar_ref, dqbar_ref, dgl_ref = outs
  t0 = c * C
  v = r["v"][b, pl.ds(t0, C), h, vs].astype(jnp.float32)
  wk = r["wk"][b, pl.ds(t0, C), h, :] if wy else None
  s_base, delta = _delta(x["kbar"], v, x["amat"], wk, s, s_init, x["cont"], x["cont_last"],
                         has_seg, prec)
  do, du, cont = x["do"], x["du"], x["cont"]
  dv_ref[b, pl.ds(t0, C), h, vs] = du.astype(dv_ref.dtype)
  dp_ref[b, h, vb, pl.ds(t0, C), :] = _dot_nt(do, delta, prec)
  dl_ref[b, h, vb, pl.ds(t0, C), :] = -_dot_nt(du, delta, prec)
  dwt_ref[b, h, vb, pl.ds(t0, C), :] = _dot_nt(delta, ds, prec)
  e_last_row = jnp.exp(r["g"][b, t0 + C - 1, h, :])
  dgl_ref[b, h, vb, c, :] = e_last_row * jnp.sum(ds * s_base, axis=1)
  if has_seg:
    dkbar = -(_dot_nt(du * cont, s, prec) + _dot_nt(du * (1.0 - cont), s_init, prec))
    dqbar = _dot_nt(do * cont, s, prec) + _dot_nt(do * (1.0 - cont), s_init, prec)
  else:
    dkbar = -_dot_nt(du, s, prec)
    dqbar = _dot_nt(do, s, prec)
  dkbar_ref[b, h, vb, pl.ds(t0, C), :] = dkbar
  dqbar_ref[b, h, vb, pl.ds(t0, C), :] = dqbar


def _recur_bwd_kernel(*refs, chunk, num_chunks, scale, has_seg, block_v, prec, wy):
  """Serial over chunks in reverse: the state-gradient chain alone, saving each chunk's dS for
  _bwd_partials_kernel. One loop carry (see _SEG_NOTE)."""
  names = _bwd_names(has_seg, wy, ["dsfin"])
  n_in = len(names)
  r = dict(zip(names, refs[:n_in]))
  dh0_ref, ds_ref = refs[n_in], refs[n_in + 1]
  b, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  C = chunk
  vs = pl.ds(vb * block_v, block_v)

  def body(i, ds):
    c = num_chunks - 1 - i
    ds_ref[b, h, c, :, vs] = ds.astype(ds_ref.dtype)
    return _bwd_chain(r, b, h, c * C, C, scale, has_seg, vs, ds, prec, wy)[0]

  dh0_ref[b, h, :, vs] = lax.fori_loop(0, num_chunks, body,
                                       r["dsfin"][b, h, :, vs].astype(jnp.float32))


def _bwd_partials_kernel(*refs, chunk, scale, has_seg, block_v, prec, wy):
  """Parallel over (chunk, V block): _bwd_partials from the saved states and state gradients."""
  names = _bwd_names(has_seg, wy, ["states", "dstates"])
  r = dict(zip(names, refs[:len(names)]))
  outs = refs[len(names):]
  b, h, c, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)
  C = chunk
  vs = pl.ds(vb * block_v, block_v)
  s_init = r["h0"][b, h, :, vs].astype(jnp.float32)
  ds = r["dstates"][b, h, c, :, vs].astype(jnp.float32)
  _, x = _bwd_chain(r, b, h, c * C, C, scale, has_seg, vs, ds, prec, wy)
  _bwd_partials(r, outs, b, h, c, vb, C, has_seg, vs,
                r["states"][b, h, c, :, vs].astype(jnp.float32), ds, s_init, x,
                prec, wy)


def _diag_pairs_bwd(q, k, g, dpm, dlm, r, b, h, t0, C, block, cols=slice(None)):
  """Pair accumulators (see _intra_bwd_epilogue) of the diagonal block x block tiles (the whole
  chunk when block == C), by a `block`-step column loop over all tiles at once."""
  row, col = _iota(C, 0), _iota(C, 1)
  row_k = lax.broadcasted_iota(jnp.int32, q.shape, 0)
  at0 = (row // block) * block

  def col_body(jj, acc):
    dq_acc, dk_acc, dw_acc = acc
    wj = _block_rows(r["w"], b, h, t0, C, block, jj, cols)
    e = jnp.exp(jnp.minimum(g - _block_rows(r["g"], b, h, t0, C, block, jj, cols), 0.0))
    at = col == at0 + jj
    pj = jnp.sum(jnp.where(at, dpm, 0.0), axis=1)[:, None]     # dP[r, j(r)] (scaled)
    lj = jnp.sum(jnp.where(at, dlm, 0.0), axis=1)[:, None]     # dL[r, j(r)]
    we = wj * e
    dq_acc = dq_acc + pj * we
    dk_acc = dk_acc + lj * we
    m = (pj * q + lj * k) * e
    for ib in range(C // block):
      in_blk = (row_k >= ib * block) & (row_k < (ib + 1) * block)
      dwj = jnp.sum(jnp.where(in_blk, m, 0.0), axis=0)[None, :]
      dw_acc = dw_acc + jnp.where(row_k == ib * block + jj, dwj, 0.0)
    return dq_acc, dk_acc, dw_acc

  zeros = jnp.zeros_like(q)
  return lax.fori_loop(0, block, col_body, (zeros, zeros, zeros))


def _pairs_bwd_blocked(q, k, w, g, dpm, dlm, r, b, h, t0, C, block, prec):
  """_diag_pairs_bwd on the diagonal tiles plus the off-diagonal blocks as matmuls."""
  row, col = _iota(C, 0), _iota(C, 1)
  dq_acc, dk_acc, dw_acc = _diag_pairs_bwd(q, k, g, dpm, dlm, r, b, h, t0, C, block)
  for js in range(0, C - block, block):
    xs, y_t, ys = _offdiag_factors(g, w, r["g"], b, h, t0, C, block, js)
    sel = (row >= js + block) & (col >= js) & (col < js + block)
    gp = jnp.where(sel, dpm, 0.0)
    gl = jnp.where(sel, dlm, 0.0)
    dq_acc = dq_acc + xs * _dot(gp, y_t, prec)
    dk_acc = dk_acc + xs * _dot(gl, y_t, prec)
    dw_acc = dw_acc + ys * (_dot_tn(gp, q * xs, prec) + _dot_tn(gl, k * xs, prec))
  return dq_acc, dk_acc, dw_acc


def _intra_bwd_epilogue(q, k, w, g, acc, p_diag, dwt, dkbar, dqbar, dgl, e_last, scale, hi,
                        dla_prefix=None, with_dgl=True):
  """Per-token gradients from the pair accumulators; works on any slice of the K columns, and on
  a block of the chunk's rows (intra_sub): dla_prefix [1, K] = sum of dWt * Wt over the chunk's
  earlier rows, with_dgl = the block holds the chunk's last row.

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
  if dla_prefix is not None:
    dla_x = dla_x + dla_prefix
  dg = q * dq_acc + k * dk_acc - w * dw_acc + dqbar * qbar + dkbar * kbar
  if with_dgl:
    dg = dg + jnp.where(row_k == C - 1, dgl[None, :], 0.0)
  return dq, dk, dw, dg, dla_x


def _vsum(ref, b, h, num_vb, *idx):
  """Sum over the V blocks (axis 2) of a per-V-block partial: ref[b, h, :, *idx]."""
  acc = ref[(b, h, 0) + idx]
  for j in range(1, num_vb):
    acc = acc + ref[(b, h, j) + idx]
  return acc


def _intra_bwd_refs(refs, has_seg):
  """The intra backward kernels' inputs by name, and their output refs (dq, dk, dw, dg, dla_x)."""
  names = ["q", "k", "w", "g", "dp", "dl", "dwt", "dkbar", "dqbar", "dgl"] + (
      ["pid"] if has_seg else [])
  return dict(zip(names, refs[:len(names)])), refs[len(names):]


def _intra_bwd_kernel(*refs, chunk, scale, has_seg, num_vb, blocked, block, k_split, prec,
                      hi):
  r, outs = _intra_bwd_refs(refs, has_seg)
  b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  C = chunk
  t0 = c * C
  kd = r["q"].shape[-1]
  row, col = _iota(C, 0), _iota(C, 1)
  rows = pl.ds(t0, C)

  def vsum(name, cols):
    return _vsum(r[name], b, h, num_vb, rows, cols)

  def dgl_sum(cols):
    return _vsum(r["dgl"], b, h, num_vb, c, cols)

  def e_last_of(g, cols):
    return _e_last(g, r["g"][b, t0 + C - 1, h, cols], pid,
                   r["pid"][b, t0 + C - 1] if has_seg else None)

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

  def kslice(cols, pairs):
    q, k, w, g = (r[n][b, rows, h, cols].astype(jnp.float32) for n in ("q", "k", "w", "g"))
    acc = pairs(q, k, w, g, cols)
    store(_intra_bwd_epilogue(q, k, w, g, acc, p_diag, vsum("dwt", cols), vsum("dkbar", cols),
                              vsum("dqbar", cols), dgl_sum(cols), e_last_of(g, cols), scale, hi),
          cols)

  if blocked:
    kslice(pl.ds(0, kd), lambda q, k, w, g, _: _pairs_bwd_blocked(q, k, w, g, dpm, dlm, r, b, h, t0,
                                                                  C, block, prec))
  else:
    # K slices one after another: the pair accumulators are per K column, so slices are exact.
    for i in range(k_split):
      kslice(pl.ds(i * (kd // k_split), kd // k_split),
             lambda q, k, w, g, cols: _diag_pairs_bwd(q, k, g, dpm, dlm, r, b, h, t0, C, C, cols))


# ----------------------------------------------------------------------------------- wrappers


def _precision(cfg, cfg_prec, interpret):
  """The kernels' dot precision: 'fast' means bf16 operands (cfg.fast_dots='bf16') or TF32."""
  if cfg_prec == "fast" and cfg.fast_dots == "bf16":
    return BF16_OPERANDS
  return common.dot_precision(cfg_prec, interpret)


def _operand_dtype(prec):
  """Storage dtype of arrays that are only dot operands: bf16 when the dots round to bf16."""
  return jnp.bfloat16 if prec == BF16_OPERANDS else jnp.float32


def _state_dtype(cfg, prec):
  """Storage of the saved chunk-start states and state gradients: bf16 with cfg.bf16_states under
  bf16-operand dots (their dots round to bf16 anyway; the elementwise uses see the rounding: the
  g_last decay gradient and, with segments, seg_init_grad's chunk-end term), else fp32."""
  return jnp.bfloat16 if cfg.bf16_states and prec == BF16_OPERANDS else jnp.float32


def _use_sub(cfg, chunk):
  """The intra kernels work on cfg.sub_block-row blocks (intra_sub.py) for longer chunks."""
  return bool(cfg.sub_block) and chunk > cfg.sub_block


def _k_split(cfg, kd):
  """Sequential K slices of the intra column loops, capped so a slice is >= 16 columns."""
  return max(1, min(cfg.k_split, kd // 16))


def _params(interpret, num_warps, cfg):
  return dict(interpret=interpret,
              compiler_params=common.compiler_params(num_warps, cfg.num_stages))


# _SEG_NOTE: the reverse serial kernel once also carried S_init's gradient (a second [K, BV]
# array) when there were segments. On the H200 (jax 0.11.2, Triton 3.6, num_stages=2, 4 warps,
# chunk 16) every dS it saved was then wrong (relative 0.125) while interpret mode on the same GPU
# was exact; num_stages=1 brought the error down to 4e-6 (dS_init 1.5e-4), not to zero. Likely a
# Triton pipelining miscompile of the two-carry loop; the kernel now carries dS alone and
# seg_init_grad forms S_init's share in XLA (docs/benchmark_mixers.md, fifth session).


def intra_forward(q, k, w, g, pid, cont, *, chunk, scale, interpret, cfg, cfg_prec):
  """Stage 1 (parallel over chunks): A = (I + L)^-1, P (scaled), Wt, and with cfg.wy W = A Kbar
  (else None)."""
  bsz, t, nh, kd = k.shape
  nc = t // chunk
  has_seg = pid is not None
  prec = _precision(cfg, cfg_prec, interpret)
  intra_in = [q, k, w, g] + ([pid, cont] if has_seg else [])
  # A, P, Wt and W only ever enter dots; with bf16-operand dots they are rounded to bf16 there,
  # so storing them in bf16 is exact and halves their bytes.
  dt = _operand_dtype(prec)
  lane = jax.ShapeDtypeStruct((bsz, t, nh, kd), dt)
  out_shape = [jax.ShapeDtypeStruct((bsz, nh, t, chunk), dt),
               jax.ShapeDtypeStruct((bsz, nh, t, chunk), dt), lane] + ([lane] if cfg.wy else [])
  hi = common.dot_precision("exact", interpret)
  if _use_sub(cfg, chunk):
    from pallas_kernels.delta_rule import intra_sub  # pylint: disable=g-import-not-at-top
    body = functools.partial(intra_sub.intra_fwd_sub_kernel, chunk=chunk, sub=cfg.sub_block,
                             scale=scale, has_seg=has_seg, wy=cfg.wy, inverse=cfg.inverse,
                             block=cfg.block, prec=prec, hi=hi)
  else:
    body = functools.partial(_intra_fwd_kernel, chunk=chunk, scale=scale, has_seg=has_seg,
                             blocked=cfg.blocked and chunk > cfg.block, block=cfg.block,
                             k_split=_k_split(cfg, kd), wy=cfg.wy, inverse=cfg.inverse,
                             prec=prec, hi=hi)
  outs = pl.pallas_call(
      body,
      out_shape=tuple(out_shape), grid=(bsz, nh, nc), name="delta_rule_intra_fwd",
      **_params(interpret, cfg.num_warps_intra, cfg),
  )(*intra_in)
  return tuple(outs) + (() if cfg.wy else (None,))


def recur_forward(q, k, v, g, h0, cont, amat, pmat, wt, wk, *, chunk, scale, interpret, cfg,
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
    out_shape.append(jax.ShapeDtypeStruct((bsz, nh, nc, kd, vd), _state_dtype(cfg, prec)))
  recur_in = [q, k, v, g, amat, pmat, wt, h0] + ([cont] if has_seg else []) + (
      [wk] if wk is not None else [])
  outs = pl.pallas_call(
      functools.partial(_recur_fwd_kernel, chunk=chunk, num_chunks=nc, scale=scale,
                        has_seg=has_seg, block_v=block_v, prec=prec, save_states=keep_states,
                        split=split, wy=wk is not None),
      out_shape=tuple(out_shape), grid=(bsz, nh, vd // block_v), name="delta_rule_recur_fwd",
      **_params(interpret, cfg.num_warps_recur, cfg),
  )(*recur_in)
  o, sfin = outs[0], outs[1]
  states = outs[2] if keep_states else None
  if split:
    out_in = [q, g, pmat, o, states, h0] + ([cont] if has_seg else [])
    bv_par = min(cfg.block_v_parallel, vd)
    o = pl.pallas_call(
        functools.partial(_output_kernel, chunk=chunk, scale=scale, has_seg=has_seg,
                          block_v=bv_par, prec=prec),
        out_shape=jax.ShapeDtypeStruct(v.shape[:3] + (vd,), q.dtype),
        grid=(bsz, nh, nc, vd // bv_par), name="delta_rule_output",
        **_params(interpret, cfg.num_warps_parallel, cfg),
    )(*out_in)
  return o, sfin, states if save_states else None


def forward(q, k, v, w, g, h0, cont, pid, *, chunk, scale, interpret, cfg, cfg_prec,
            save_states):
  """q, k, w: [B,T,H,K]; v: [B,T,H,V]; g: [B,T,H,K] f32 chunk-local cumsum; h0 [B,H,K,V] f32.

  cont: [B,T] f32 or None; pid: [B,T] int32 or None (both None without segments).
  """
  kw = dict(chunk=chunk, scale=scale, interpret=interpret, cfg=cfg, cfg_prec=cfg_prec)
  amat, pmat, wt, wk = intra_forward(q, k, w, g, pid, cont, **kw)
  o, sfin, states = recur_forward(q, k, v, g, h0, cont, amat, pmat, wt, wk,
                                  save_states=save_states, **kw)
  return o, sfin, (amat, pmat, wt, wk, states)


def recur_backward(q, k, v, g, h0, cont, res, do, dsfin, *, chunk, scale, interpret, cfg,
                   cfg_prec):
  """Backward stage 1: the reverse dS chain (serial over chunks, saving each chunk's dS), then,
  parallel over (chunk, V block), dV and the per-V-block partial gradients; with segments,
  S_init's share of the segments that restart from it (seg_init_grad, XLA). Returns
  (dV, dS_init, partials...)."""
  amat, pmat, wt, wk, states = res
  bsz, t, nh, kd = k.shape
  vd = v.shape[-1]
  nc = t // chunk
  has_seg = cont is not None
  wy = wk is not None
  prec = _precision(cfg, cfg_prec, interpret)
  f32 = jnp.float32
  block_v = min(cfg.block_v, vd)
  bv_part = min(cfg.block_v_parallel, vd)
  nvb = vd // bv_part
  opt = ([cont] if has_seg else []) + ([wk] if wy else [])
  common_in = [q, k, v, g, amat, pmat, wt, h0, do]
  kw = dict(chunk=chunk, scale=scale, has_seg=has_seg, prec=prec, wy=wy)
  dh0, dstates = pl.pallas_call(
      functools.partial(_recur_bwd_kernel, num_chunks=nc, block_v=block_v, **kw),
      out_shape=(jax.ShapeDtypeStruct((bsz, nh, kd, vd), f32),
                 jax.ShapeDtypeStruct(states.shape, states.dtype)),
      grid=(bsz, nh, vd // block_v), name="delta_rule_recur_bwd",
      **_params(interpret, cfg.num_warps_recur, cfg),
  )(*common_in, dsfin, *opt)
  cc = jax.ShapeDtypeStruct((bsz, nh, nvb, t, chunk), f32)
  ck = jax.ShapeDtypeStruct((bsz, nh, nvb, t, kd), f32)
  partial_shapes = (jax.ShapeDtypeStruct(v.shape, f32), cc, cc, ck, ck, ck,
                    jax.ShapeDtypeStruct((bsz, nh, nvb, nc, kd), f32))
  dv, *partials = pl.pallas_call(
      functools.partial(_bwd_partials_kernel, block_v=bv_part, **kw),
      out_shape=partial_shapes, grid=(bsz, nh, nc, nvb), name="delta_rule_bwd_partials",
      **_params(interpret, cfg.num_warps_parallel, cfg),
  )(*common_in, states, dstates, *opt)
  if has_seg:
    dh0 = dh0 + seg_init_grad(q, k, g, cont, do, dv, dstates, chunk=chunk, scale=scale,
                              exact=cfg_prec == "exact")
  return (dv, dh0, *partials)


def seg_init_grad(q, k, g, cont, do, dv, dstates, *, chunk, scale, exact):
  """S_init's gradient from the rows that restart from it after a reset inside a chunk
  (cont == 0): sum over chunks of (1 - cont_last) e_last dS + Qbar_new^T dO - Kbar_new^T dU,
  with dU = dV. Plain XLA: three contractions over time, off the serial chain."""
  f32 = jnp.float32
  prec = lax.Precision.HIGHEST if exact else lax.Precision.DEFAULT
  e = jnp.exp(g)
  new = (1.0 - cont)[:, :, None, None]
  qn = (scale * q.astype(f32)) * e * new
  kn = k.astype(f32) * e * new
  d = (jnp.einsum("bthk,bthv->bhkv", qn, do.astype(f32), precision=prec)
       - jnp.einsum("bthk,bthv->bhkv", kn, dv, precision=prec))
  last = slice(chunk - 1, None, chunk)
  w_last = (1.0 - cont[:, last])[:, :, None, None] * jnp.exp(g[:, last])    # [B, NC, H, K]
  # (Written as a broadcast-multiply-sum over chunks instead, this gave garbage on XLA:CPU
  # behind the interpret-mode kernels, jax 0.10.2; the einsum is exact.)
  return d + jnp.einsum("bchk,bhckv->bhkv", w_last, dstates, precision=prec)


def intra_backward(q, k, w, g, pid, partials, *, chunk, scale, interpret, cfg, cfg_prec):
  """Backward stage 2 (parallel over chunks): dq, dk, dw, dg and the direct log-decay term."""
  bsz, t, nh, kd = k.shape
  nc = t // chunk
  has_seg = pid is not None
  nvb = partials[0].shape[2]
  prec = _precision(cfg, cfg_prec, interpret)
  intra_in = [q, k, w, g, *partials] + ([pid] if has_seg else [])
  lane = jax.ShapeDtypeStruct((bsz, t, nh, kd), jnp.float32)
  hi = common.dot_precision("exact", interpret)
  if _use_sub(cfg, chunk):
    from pallas_kernels.delta_rule import intra_sub  # pylint: disable=g-import-not-at-top
    body = functools.partial(intra_sub.intra_bwd_sub_kernel, chunk=chunk, sub=cfg.sub_block,
                             scale=scale, has_seg=has_seg, num_vb=nvb, prec=prec, hi=hi)
  else:
    body = functools.partial(_intra_bwd_kernel, chunk=chunk, scale=scale, has_seg=has_seg,
                             num_vb=nvb, blocked=cfg.blocked and chunk > cfg.block,
                             block=cfg.block, k_split=_k_split(cfg, kd), prec=prec, hi=hi)
  return pl.pallas_call(
      body,
      out_shape=(lane, lane, lane, lane, lane), grid=(bsz, nh, nc), name="delta_rule_intra_bwd",
      **_params(interpret, cfg.num_warps_intra_bwd, cfg),
  )(*intra_in)


def backward(q, k, v, w, g, h0, cont, pid, res, do, dsfin, *, chunk, scale, interpret, cfg,
             cfg_prec):
  kw = dict(chunk=chunk, scale=scale, interpret=interpret, cfg=cfg, cfg_prec=cfg_prec)
  dv, dh0, *partials = recur_backward(q, k, v, g, h0, cont, res, do, dsfin, **kw)
  dq, dk, dw, dg, dla_x = intra_backward(q, k, w, g, pid, partials, **kw)
  return dq, dk, dv, dw, dg, dla_x, dh0
