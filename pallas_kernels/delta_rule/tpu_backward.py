"""The chunked delta rule's backward as one Mosaic-TPU kernel: chunks in reverse order (the index
maps run backwards), dS carried in VMEM scratch over the sequential chunk axis.

Per chunk, from its tiles and the saved chunk-start state S_0 (tpu_forward's residual), the
state-free terms are recomputed (tpu_forward.chunk_terms: g, A, P, Wt, ...) rather than stored,
then with dS = the gradient of the chunk-end state:
    dDelta = P^T dO + Wt dS,   dU = A^T dDelta,   dL = -(A^T dDelta U^T A^T) (strict, same seg),
    dP = dO Delta^T (same seg),  dWt = Delta dS^T,  dV = dU,
    dKbar = -dU S_0^T,  dQbar = dO S_0^T   (S_init for rows whose segment began in the chunk),
    dS_0 = exp(g_last) dS + Qbar^T dO - Kbar^T dU   (carried to the chunk before),
and S_init collects the same terms of the rows (and chunk ends) that restart from it. The pair
products L, P are differentiated by the same column loop as the forward forms them; the
log-decay gradients go through the chunk-local cumsum's transpose (a 0/1 matmul), except those
of Wt's and exp(g_last)'s decay, which are emitted straight in log_alpha space (a difference
g_last - g_j would cancel O(1) terms).

  grid = (B*H, T/C), semantics ('parallel', 'arbitrary'); one program covers all V columns (the
  K-side gradients are sums over V: a V split would need a cross-program sum), so its tiles are
  (C, K), (C, V), (K, V).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import common, tpu_common
from pallas_kernels.delta_rule import tpu_forward as fwd

__all__ = ["delta_rule_backward", "backward_blocks"]

F32 = jnp.float32
HIGHEST = lax.Precision.HIGHEST


def _column(x, j):
  """Column j of a [C, C] value as [C, 1] (a masked lane sum: no dynamic lane slicing)."""
  col = lax.broadcasted_iota(jnp.int32, x.shape, 1)
  return jnp.sum(jnp.where(col == j, x, 0.0), axis=1, keepdims=True)


def _pair_grads(q, k, w, g, dlm, dpm):
  """Gradients of L_rj = sum_c k_rc w_jc E_rjc and P_rj / scale (E = exp(g_r - g_j), masked
  like dlm / dpm, which already hold the masks and the scale; P's diagonal is left out of dpm).
  Returns (dq, dk, dw, dg) of those products alone."""
  c = q.shape[0]
  row_k = lax.broadcasted_iota(jnp.int32, q.shape, 0)
  dq = jnp.zeros_like(q)
  dk, dw = dq, dq
  for j in range(c):
    at = slice(j, j + 1)
    ej = jnp.exp(jnp.minimum(g - g[at], 0.0))
    dl_j, dp_j = _column(dlm, j), _column(dpm, j)
    dk = dk + dl_j * (w[at] * ej)
    dq = dq + dp_j * (w[at] * ej)
    dw_j = jnp.sum((dl_j * k + dp_j * q) * ej, axis=0, keepdims=True)
    dw = jnp.where(row_k == j, dw_j, dw)
  # E_rjc depends on g_rc (+) and g_jc (-).
  return dq, dk, dw, q * dq + k * dk - w * dw


def _backward_kernel(*refs, scale, has_seg, prec):
  q_ref, k_ref, w_ref, la_ref, v_ref, h0_ref, s0_ref, do_ref, dsfin_ref = refs[:9]
  lp_ref = refs[9] if has_seg else None
  dq_ref, dk_ref, dw_ref, dla_ref, dv_ref, dh0_ref, ds_scr, dinit_scr = refs[9 + has_seg :]
  step = pl.program_id(1)

  @pl.when(step == 0)
  def _():
    ds_scr[...] = dsfin_ref[...]
    dinit_scr[...] = jnp.zeros(dinit_scr.shape, F32)

  q, k, w, la = (r[...].astype(F32) for r in (q_ref, k_ref, w_ref, la_ref))
  v, do = v_ref[...].astype(F32), do_ref[...].astype(F32)
  ct = fwd.chunk_terms(q, k, w, la, lp_ref[...] if has_seg else None, scale)
  cont = ct["cont"]
  s0, s_init, ds = s0_ref[...], h0_ref[...], ds_scr[...]
  c, kd = q.shape
  u = v - fwd.rows_from(ct["kbar"], cont, s0, s_init, prec)
  amat, pmat, wt = ct["amat"], ct["pmat"], ct["wt"]
  delta = fwd._dot(amat, u, prec)
  ddelta = fwd._dot_tn(pmat, do, prec) + fwd._dot(wt, ds, prec)
  du = fwd._dot_tn(amat, ddelta, prec)
  dlm = -fwd._dot_nt(fwd._dot_tn(amat, fwd._dot_nt(ddelta, u, prec), prec), amat, prec)
  dlm = jnp.where(ct["strict"], dlm, 0.0)
  dpm = jnp.where(ct["incl"], fwd._dot_nt(do, delta, prec), 0.0) * scale
  row = lax.broadcasted_iota(jnp.int32, (c, c), 0)
  col = lax.broadcasted_iota(jnp.int32, (c, c), 1)
  # P's diagonal (decay factor exactly 1) apart: its dg terms would cancel only up to rounding.
  p_diag = jnp.sum(jnp.where(row == col, dpm, 0.0), axis=1, keepdims=True)
  dpm = jnp.where(row > col, dpm, 0.0)
  dq, dk, dw, dg = _pair_grads(q, k, w, ct["g"], dlm, dpm)
  # Through Kbar, Qbar (rows reading S_0 or S_init) and Wt.
  if cont is None:
    dkbar = -fwd._dot_nt(du, s0, prec)
    dqbar = fwd._dot_nt(do, s0, prec)
  else:
    dkbar = -(fwd._dot_nt(du, s0, prec) * cont + fwd._dot_nt(du, s_init, prec) * (1.0 - cont))
    dqbar = fwd._dot_nt(do, s0, prec) * cont + fwd._dot_nt(do, s_init, prec) * (1.0 - cont)
  dwt = fwd._dot_nt(delta, ds, prec)
  e = ct["e"]
  dq = dq + p_diag * w + dqbar * scale * e
  dk = dk + dkbar * e
  dw = dw + p_diag * q + dwt * ct["decay_to_last"]
  dg = dg + dqbar * ct["qbar"] + dkbar * ct["kbar"]
  # g = M la with M the (same-segment) inclusive lower-triangular 0/1 matrix: dla = M^T dg.
  dla = fwd._dot_tn(ct["incl"].astype(F32), dg, HIGHEST)
  # Wt_j's decay exp(g_last - g_j) = exp(sum of la_s, j < s <= last): emitted per s directly.
  dla = dla + fwd._dot(ct["strict"].astype(F32), dwt * wt, HIGHEST)
  # exp(g_last) scales the chunk-end state: g_last sums la over the last token's segment.
  s_base = fwd.chunk_base(ct, s0, s_init)
  de_col = jnp.sum(ds * s_base, axis=1, keepdims=True)  # [K, 1]
  eye = (
    lax.broadcasted_iota(jnp.int32, (kd, kd), 0) == lax.broadcasted_iota(jnp.int32, (kd, kd), 1)
  ).astype(F32)
  de_row = fwd._dot_tn(de_col, eye, HIGHEST) * ct["e_last"]  # [1, K]
  dla = dla + (de_row if ct["in_last"] is None else ct["in_last"] * de_row)
  for ref, val in ((dq_ref, dq), (dk_ref, dk), (dw_ref, dw), (dla_ref, dla), (dv_ref, du)):
    ref[...] = val
  # The state gradients: dS_0 to the chunk before; S_init's share accumulates.
  e_ds = ct["e_col"] * ds
  if cont is None:
    ds_new = e_ds + fwd._dot_tn(ct["qbar"], do, prec) - fwd._dot_tn(ct["kbar"], du, prec)
  else:
    cont_last = cont[-1:]
    ds_new = (
      cont_last * e_ds
      + fwd._dot_tn(ct["qbar"] * cont, do, prec)
      - fwd._dot_tn(ct["kbar"] * cont, du, prec)
    )
    dinit_scr[...] += (
      (1.0 - cont_last) * e_ds
      + fwd._dot_tn(ct["qbar"] * (1.0 - cont), do, prec)
      - fwd._dot_tn(ct["kbar"] * (1.0 - cont), du, prec)
    )
  ds_scr[...] = ds_new

  @pl.when(step == pl.num_programs(1) - 1)
  def _():
    dh0_ref[...] = ds_new + dinit_scr[...]


def _plan(bsz, t, nh, kd, vd, chunk, dtypes, has_seg):
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top

  nc = t // chunk
  blocks = []

  def spec(name, shape, dtype, index_map):
    blocks.append(tpu_common.Block(name, shape, dtype))
    return pl.BlockSpec((None,) + shape, index_map)

  rev = lambda c: nc - 1 - c
  key = lambda n, dt: spec(n, (chunk, kd), dt, lambda bh, c: (bh // nh, rev(c), bh % nh))
  val = lambda n, dt: spec(n, (chunk, vd), dt, lambda bh, c: (bh // nh, rev(c), bh % nh))
  state = lambda n: spec(n, (kd, vd), F32, lambda bh, c: (bh, 0, 0))
  qdt, kdt, vdt, wdt, ladt, dodt = dtypes
  in_specs = [
    key("q", qdt),
    key("k", kdt),
    key("w", wdt),
    key("log_alpha", ladt),
    val("v", vdt),
    state("S_init"),
  ]
  blocks.append(tpu_common.Block("chunk-start S", (kd, vd), F32))
  in_specs.append(pl.BlockSpec((None, None, kd, vd), lambda bh, c: (bh, rev(c), 0, 0)))
  in_specs += [val("dO", dodt), state("dS_final")]
  if has_seg:
    in_specs.append(spec("resets in chunk", (chunk, 1), F32, lambda bh, c: (bh // nh, rev(c), 0)))
  out_specs = [
    key("dq", F32),
    key("dk", F32),
    key("dw", F32),
    key("dlog_alpha", F32),
    val("dv", F32),
    state("dS_init"),
  ]
  lane_k = jax.ShapeDtypeStruct((bsz, t, nh * kd), F32)
  out_shape = (lane_k,) * 4 + (
    jax.ShapeDtypeStruct((bsz, t, nh * vd), F32),
    jax.ShapeDtypeStruct((bsz * nh, kd, vd), F32),
  )
  scratch = [pltpu.VMEM((kd, vd), F32), pltpu.VMEM((kd, vd), F32)]
  blocks += [
    tpu_common.Block("dS carry", (kd, vd), F32, pipelined=False),
    tpu_common.Block("dS_init sum", (kd, vd), F32, pipelined=False),
  ]
  return in_specs, out_specs, out_shape, scratch, blocks


def backward_blocks(bsz, t, nh, kd, vd, chunk, dtype, has_seg=True):
  """The backward's VMEM Blocks for inputs of one `dtype` (dO in it too)."""
  return _plan(bsz, t, nh, kd, vd, chunk, (dtype,) * 6, has_seg)[4]


def delta_rule_backward(
  q, k, v, w, la, h0, pid, states, do, dsfin, *, chunk, scale, interpret, prec
):
  """Gradients (dq, dk, dv, dw, dla [B,T,H,*], dh0 [B,H,K,V]; float32) of tpu_forward's
  delta_rule_forward; states: its saved chunk-start states, pid as given to it."""
  bsz, t, nh, kd = k.shape
  vd = v.shape[-1]
  has_seg = pid is not None
  in_specs, out_specs, out_shape, scratch, _ = _plan(
    bsz, t, nh, kd, vd, chunk, tuple(x.dtype for x in (q, k, v, w, la, do)), has_seg
  )
  flat = lambda x: x.reshape(bsz, t, nh * x.shape[-1])
  args = [
    flat(q),
    flat(k),
    flat(w),
    flat(la),
    flat(v),
    h0.reshape(bsz * nh, kd, vd),
    states,
    flat(do),
    dsfin.astype(F32).reshape(bsz * nh, kd, vd),
  ]
  if has_seg:
    args.append(fwd.local_reset_count(pid, chunk))
  kw = {} if interpret is False or interpret is None else dict(interpret=interpret)
  dq, dk, dw, dla, dv, dh0 = pl.pallas_call(
    functools.partial(
      _backward_kernel, scale=scale, has_seg=has_seg, prec=common.dot_precision(prec, interpret)
    ),
    grid=(bsz * nh, t // chunk),
    in_specs=in_specs,
    out_specs=out_specs,
    out_shape=out_shape,
    scratch_shapes=scratch,
    name="delta_rule_tpu_bwd",
    compiler_params=tpu_common.compiler_params(("parallel", "arbitrary")),
    **kw,
  )(*args)
  shape_k = (bsz, t, nh, kd)
  return (
    dq.reshape(shape_k),
    dk.reshape(shape_k),
    dv.reshape(bsz, t, nh, vd),
    dw.reshape(shape_k),
    dla.reshape(shape_k),
    dh0.reshape(bsz, nh, kd, vd),
  )
