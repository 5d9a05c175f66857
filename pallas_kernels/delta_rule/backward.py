"""Backward stages of the chunked delta rule.

  _recur_bwd_kernel    grid (B, H, V/BV): serial over chunks in reverse; the dS chain alone,
                       saving each chunk's dS (S_init's share of segments: seg_init_grad, XLA).
  _bwd_partials_kernel grid (B, H, NC, V/BV): dV and per-V-block partial gradients of P, L, Wt,
                       Kbar, Qbar, g_last.
Then the intra-chunk backward (intra_bwd_tokens.py, token-parallel) turns the partials into dq,
dk, dw, dg and the direct log-decay terms. With segments, the partials kernel runs its
segment-free body on chunks without a reset (tiles.by_reset). The token-parallel intra backward
beat the per-chunk one, alone and fused with the partials kernel, in every cell timed
(docs/decisions.md, `intra_bwd`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.delta_rule import stages as _stages
from pallas_kernels.delta_rule.intra_bwd_tokens import intra_backward_tokens
from pallas_kernels.delta_rule.tiles import (
  by_reset,
  dot,
  dot_nt,
  dot_tn,
  kernel_precision,
  launch_params,
  value_block,
)
from pallas_kernels.kernel_math import exp_for_mode


def _chain_loads(r, b, h, t0, C, has_seg, vs):
  """Chunk t0's inputs to the reverse chain and the partials, as loaded (none depends on dS)."""
  rows = pl.ds(t0, C)
  x = dict(
    g=r["g"][b, rows, h, :],
    q=r["q"][b, rows, h, :],
    g_last=r["g"][b, t0 + C - 1, h, :],
    do=r["do"][b, rows, h, vs],
    a=r["a"][b, h, rows, :],
    p=r["p"][b, h, rows, :],
    wt=r["wt"][b, rows, h, :],
    wk=r["wk"][b, rows, h, :],
  )
  if has_seg:
    x.update(k=r["k"][b, rows, h, :], cont=r["cont"][b, rows], cont_last=r["cont"][b, t0 + C - 1])
  return x


def _chunk_common(x, scale, has_seg, exp):
  """Per-chunk, V-independent quantities of the backward's chain and partials: Kbar (None
  without segments: only the segment terms use it), Qbar, e_last, and the segment masks."""
  g = x["g"].astype(jnp.float32)
  kbar = x["k"].astype(jnp.float32) * exp(g) if has_seg else None
  qbar = (scale * x["q"].astype(jnp.float32)) * exp(g)
  e_last = exp(x["g_last"])[:, None]  # [K, 1]
  if has_seg:
    cont = x["cont"][:, None]  # [C, 1] float
    cont_last = x["cont_last"]
  else:
    cont, cont_last = None, None
  return kbar, qbar, e_last, cont, cont_last


def _delta_rows(kbar, v, amat, wk, s, s_init, cont, cont_last, has_seg, prec):
  """Delta = A U with U = V - Kbar S_0 (compact WY: wk = A Kbar over the rows with cont, so
  Delta = A (V - Kbar_new S_init) - wk S_0, whose only dot on the chain is wk S_0), and the
  state the chunk's decay applies to (S_init when the chunk's last token starts a new segment
  inside the chunk). kbar is used only with segments (None otherwise)."""
  s_base = cont_last * s + (1.0 - cont_last) * s_init if has_seg else s
  u_off = v - dot(kbar * (1.0 - cont), s_init, prec) if has_seg else v
  return s_base, dot(amat, u_off, prec) - dot(wk, s, prec)


_BWD_IN = ["q", "k", "v", "g", "a", "p", "wt", "h0", "do"]


def _bwd_names(has_seg, extra):
  return _BWD_IN + extra + (["cont"] if has_seg else []) + ["wk"]


def _bwd_chain(x, scale, has_seg, ds, prec, exp):
  """One chunk of the reverse state chain from its loads x (_chain_loads), given dS (the gradient
  of the state after the chunk): dDelta = P^T dO + Wt dS, dU = A^T dDelta and dS_prev (S_init's
  share of segments that start inside the chunk is seg_init_grad's, outside the kernels).

  Kbar_c^T dU = (A Kbar_c)^T dDelta = W^T dDelta: the chain dS -> dDelta -> dS_prev is 2 dots."""
  kbar, qbar, e_last, cont, cont_last = _chunk_common(x, scale, has_seg, exp)
  do = x["do"].astype(jnp.float32)
  amat = x["a"]
  d_delta = dot_tn(x["p"], do, prec) + dot(x["wt"], ds, prec)
  du = dot_tn(amat, d_delta, prec)
  ds_decayed = e_last * ds
  cq = qbar * cont if has_seg else qbar
  chain = dot_tn(x["wk"], d_delta, prec)
  ds_prev = (cont_last * ds_decayed if has_seg else ds_decayed) + dot_tn(cq, do, prec) - chain
  return ds_prev, dict(kbar=kbar, cont=cont, cont_last=cont_last, do=do, amat=amat, du=du)


def _partials_values(r, b, h, c, C, has_seg, vs, s, ds, s_init, x, prec, exp):
  """The chunk's dV and (this V block's share of) the partial gradients of P, L, Wt, Kbar, Qbar
  and g_last, as values: (dv, dp, dl, dwt, dkbar, dqbar, dgl [K])."""
  t0 = c * C
  v = r["v"][b, pl.ds(t0, C), h, vs].astype(jnp.float32)
  wk = r["wk"][b, pl.ds(t0, C), h, :]
  s_base, delta = _delta_rows(
    x["kbar"], v, x["amat"], wk, s, s_init, x["cont"], x["cont_last"], has_seg, prec
  )
  do, du, cont = x["do"], x["du"], x["cont"]
  e_last_row = exp(r["g"][b, t0 + C - 1, h, :])
  dgl = e_last_row * jnp.sum(ds * s_base, axis=1)
  if has_seg:
    dkbar = -(dot_nt(du * cont, s, prec) + dot_nt(du * (1.0 - cont), s_init, prec))
    dqbar = dot_nt(do * cont, s, prec) + dot_nt(do * (1.0 - cont), s_init, prec)
  else:
    dkbar = -dot_nt(du, s, prec)
    dqbar = dot_nt(do, s, prec)
  return (
    du,
    dot_nt(do, delta, prec),
    -dot_nt(du, delta, prec),
    dot_nt(delta, ds, prec),
    dkbar,
    dqbar,
    dgl,
  )


def _bwd_partials(r, outs, b, h, c, vb, C, has_seg, vs, s, ds, s_init, x, prec, exp):
  """Writes _partials_values to the per-V-block partial outputs."""
  dv_ref, dp_ref, dl_ref, dwt_ref, dkbar_ref, dqbar_ref, dgl_ref = outs
  dv, dp, dl, dwt, dkbar, dqbar, dgl = _partials_values(
    r, b, h, c, C, has_seg, vs, s, ds, s_init, x, prec, exp
  )
  rows = pl.ds(c * C, C)
  dv_ref[b, rows, h, vs] = dv.astype(dv_ref.dtype)
  dp_ref[b, h, vb, rows, :] = dp
  dl_ref[b, h, vb, rows, :] = dl
  dwt_ref[b, h, vb, rows, :] = dwt
  dgl_ref[b, h, vb, c, :] = dgl
  dkbar_ref[b, h, vb, rows, :] = dkbar
  dqbar_ref[b, h, vb, rows, :] = dqbar


def _recur_bwd_kernel(*refs, chunk, num_chunks, scale, has_seg, block_v, prec, exp, has_ext=False):
  """Serial over chunks in reverse: the state-gradient chain alone, saving each chunk's dS for
  _bwd_partials_kernel. One loop carry (see _SEG_NOTE). Each chunk's inputs are loaded in its
  own step: loading them a step ahead, as the forward's state pass does, lost here
  (docs/decisions.md).
  has_ext: a "dext" input [B, H, NC, K, V], a cotangent of the state after each chunk from outside
  the op (the chunk-start states as an output: delta_rule's output_chunk_states), added to dS
  where the chain reaches that state."""
  names = _bwd_names(has_seg, ["dsfin", "dext"] if has_ext else ["dsfin"])
  n_in = len(names)
  r = dict(zip(names, refs[:n_in]))
  dh0_ref, ds_ref = refs[n_in], refs[n_in + 1]
  b, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  C = chunk
  vs = pl.ds(vb * block_v, block_v)

  def body(i, ds):
    c = num_chunks - 1 - i
    if has_ext:
      ds = ds + r["dext"][b, h, c, :, vs].astype(jnp.float32)
    ds_ref[b, h, c, :, vs] = ds.astype(ds_ref.dtype)
    return _bwd_chain(_chain_loads(r, b, h, c * C, C, has_seg, vs), scale, has_seg, ds, prec, exp)[
      0
    ]

  dh0_ref[b, h, :, vs] = lax.fori_loop(
    0, num_chunks, body, r["dsfin"][b, h, :, vs].astype(jnp.float32)
  )


def _bwd_partials_kernel(*refs, chunk, scale, has_seg, block_v, prec, exp):
  """Parallel over (chunk, V block): _bwd_partials from the saved states and state gradients."""
  names = _bwd_names(has_seg, ["states", "dstates"])
  r = dict(zip(names, refs[: len(names)]))
  outs = refs[len(names) :]
  b, h, c, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)
  vs = pl.ds(vb * block_v, block_v)
  by_reset(
    r.get("cont"),
    b,
    c * chunk + chunk - 1,
    lambda seg: _bwd_partials(
      r,
      outs,
      b,
      h,
      c,
      vb,
      chunk,
      seg,
      vs,
      *_chunk_states(r, b, h, c, chunk, scale, seg, vs, prec, exp),
      prec,
      exp,
    ),
  )


def _chunk_states(r, b, h, c, C, scale, has_seg, vs, prec, exp):
  """(S_0, dS, S_init, the chain's values) of chunk c's V block vs, for _partials_values."""
  s_init = r["h0"][b, h, :, vs].astype(jnp.float32)
  ds = r["dstates"][b, h, c, :, vs].astype(jnp.float32)
  _, x = _bwd_chain(_chain_loads(r, b, h, c * C, C, has_seg, vs), scale, has_seg, ds, prec, exp)
  return r["states"][b, h, c, :, vs].astype(jnp.float32), ds, s_init, x


# _SEG_NOTE: the reverse serial kernel once also carried S_init's gradient (a second [K, BV]
# array) when there were segments. On the H200 (jax 0.11.2, Triton 3.6, num_stages=2, 4 warps,
# chunk 16) every dS it saved was then wrong (relative 0.125) while interpret mode on the same GPU
# was exact; num_stages=1 brought the error down to 4e-6 (dS_init 1.5e-4), not to zero. Likely a
# Triton pipelining miscompile of the two-carry loop; the kernel now carries dS alone and
# seg_init_grad forms S_init's share in XLA (docs/decisions.md).


def _bwd_inputs(q, k, v, g, h0, cont, res, do, cfg, cfg_prec, interpret, chunk, scale):
  """The serial and partials kernels' shared inputs (in _bwd_names order), their optional tail
  (cont, W) and their static arguments (exp: kernel_math.exp_for_mode of the data's precision)."""
  amat, pmat, wt, wk, _ = res
  prec = kernel_precision(cfg_prec, interpret)
  kw = dict(
    chunk=chunk, scale=scale, has_seg=cont is not None, prec=prec, exp=exp_for_mode(cfg_prec)
  )
  return [q, k, v, g, amat, pmat, wt, h0, do], ([cont] if cont is not None else []) + [wk], kw


def state_grads(
  q, k, v, g, h0, cont, res, do, dsfin, dext=None, *, chunk, scale, interpret, cfg, cfg_prec
):
  """The reverse dS chain, serial over chunks: (dS_init's chain share [B, H, K, V] fp32, each
  chunk's dS [B, H, T/C, K, V] in the states' dtype). dext: None, or [B, H, T/C, K, V] f32, a
  cotangent of the state after each chunk from outside the op (_recur_bwd_kernel)."""
  states = res[4]
  bsz, _, nh, kd = k.shape
  vd = v.shape[-1]
  block_v = value_block(cfg, kd, vd, parallel=False)
  common_in, opt, kw = _bwd_inputs(
    q, k, v, g, h0, cont, res, do, cfg, cfg_prec, interpret, chunk, scale
  )
  return pl.pallas_call(
    functools.partial(
      _recur_bwd_kernel,
      num_chunks=k.shape[1] // chunk,
      block_v=block_v,
      has_ext=dext is not None,
      **kw,
    ),
    out_shape=(
      jax.ShapeDtypeStruct((bsz, nh, kd, vd), jnp.float32),
      jax.ShapeDtypeStruct(states.shape, states.dtype),
    ),
    grid=(bsz, nh, vd // block_v),
    name="delta_rule_recur_bwd",
    **launch_params(interpret, cfg.num_warps_recur, cfg),
  )(*common_in, dsfin, *([] if dext is None else [dext]), *opt)


def bwd_partials(
  q,
  k,
  v,
  g,
  h0,
  cont,
  res,
  do,
  dstates,
  *,
  chunk,
  scale,
  interpret,
  cfg,
  cfg_prec,
  dv_dtype=jnp.float32,
):
  """Parallel over (chunk, V block): dV (in dv_dtype) and the per-V-block partial gradients of
  P, L, Wt, Kbar, Qbar and g_last, from the saved states and state gradients."""
  states = res[4]
  bsz, t, nh, kd = k.shape
  vd = v.shape[-1]
  nc = t // chunk
  f32 = jnp.float32
  bv_part = value_block(cfg, kd, vd, parallel=True)
  nvb = vd // bv_part
  common_in, opt, kw = _bwd_inputs(
    q, k, v, g, h0, cont, res, do, cfg, cfg_prec, interpret, chunk, scale
  )
  cc = jax.ShapeDtypeStruct((bsz, nh, nvb, t, chunk), f32)
  ck = jax.ShapeDtypeStruct((bsz, nh, nvb, t, kd), f32)
  partial_shapes = (
    jax.ShapeDtypeStruct(v.shape, dv_dtype),
    cc,
    cc,
    ck,
    ck,
    ck,
    jax.ShapeDtypeStruct((bsz, nh, nvb, nc, kd), f32),
  )
  return pl.pallas_call(
    functools.partial(_bwd_partials_kernel, block_v=bv_part, **kw),
    out_shape=partial_shapes,
    grid=(bsz, nh, nc, nvb),
    name="delta_rule_bwd_partials",
    **launch_params(interpret, cfg.num_warps_parallel, cfg),
  )(*common_in, states, dstates, *opt)


def recur_backward(
  q,
  k,
  v,
  g,
  h0,
  cont,
  res,
  do,
  dsfin,
  dext=None,
  *,
  chunk,
  scale,
  interpret,
  cfg,
  cfg_prec,
  dv_dtype=jnp.float32,
  run=_stages.call,
):
  """Backward stage 1: the reverse dS chain (state_grads), then dV and the per-V-block partial
  gradients (bwd_partials); with segments, S_init's share of the segments that restart from it
  (seg_init_grad, XLA, from the fp32 dV: dv_dtype applies only without segments). Returns
  (dV, dS_init, partials...). run: the stage runner (stages.py)."""
  kw = dict(chunk=chunk, scale=scale, interpret=interpret, cfg=cfg, cfg_prec=cfg_prec)
  dh0, dstates = run("state_grads", state_grads, q, k, v, g, h0, cont, res, do, dsfin, dext, **kw)
  dv_dtype = jnp.float32 if cont is not None else dv_dtype
  dv, *partials = run(
    "partials", bwd_partials, q, k, v, g, h0, cont, res, do, dstates, dv_dtype=dv_dtype, **kw
  )
  if cont is not None:
    exact = cfg_prec == "exact"
    seg = run(
      "seg_init",
      seg_init_grad,
      q,
      k,
      g,
      cont,
      do,
      dv,
      dstates,
      chunk=chunk,
      scale=scale,
      exact=exact,
    )
    dh0 = dh0 + seg
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
  d = jnp.einsum("bthk,bthv->bhkv", qn, do.astype(f32), precision=prec) - jnp.einsum(
    "bthk,bthv->bhkv", kn, dv, precision=prec
  )
  last = slice(chunk - 1, None, chunk)
  w_last = (1.0 - cont[:, last])[:, :, None, None] * jnp.exp(g[:, last])  # [B, NC, H, K]
  # (Written as a broadcast-multiply-sum over chunks instead, this gave garbage on XLA:CPU
  # behind the interpret-mode kernels, jax 0.10.2; the einsum is exact.)
  return d + jnp.einsum("bchk,bhckv->bhkv", w_last, dstates, precision=prec)


def backward(
  q,
  k,
  v,
  w,
  g,
  h0,
  cont,
  pid,
  res,
  do,
  dsfin,
  dext=None,
  *,
  chunk,
  scale,
  interpret,
  cfg,
  cfg_prec,
  grad_dtypes=(jnp.float32,) * 3,
  run=_stages.call,
):
  """(dq, dk, dv, dw, dg, dla_terms, dh0): the direct log-decay term dla_x is the exclusive
  prefix of dla_terms within chunks (the reverse cumsum sums it). grad_dtypes: what the kernels
  store dq, dk and dv in (the caller's dtypes: no fp32 copy and cast pass through memory; dv
  stays fp32 with segments, where S_init's gradient reads it); the rest are fp32. dext: a
  cotangent of the state after each chunk ([B, H, T/C, K, V] f32) or None (state_grads). run:
  the stage runner (stages.py)."""
  dq_dtype, dk_dtype, dv_dtype = grad_dtypes
  kw = dict(chunk=chunk, scale=scale, interpret=interpret, cfg=cfg, cfg_prec=cfg_prec)
  dv, dh0, *partials = recur_backward(
    q, k, v, g, h0, cont, res, do, dsfin, dext, dv_dtype=dv_dtype, run=run, **kw
  )
  dq, dk, dw, dg, dla_terms = run(
    "intra_tokens",
    intra_backward_tokens,
    q,
    k,
    w,
    g,
    pid,
    partials,
    dq_dtype=dq_dtype,
    dk_dtype=dk_dtype,
    **kw,
  )
  return dq, dk, dv, dw, dg, dla_terms, dh0
