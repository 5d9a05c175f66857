"""Serial state-pass stage (forward): per (batch, head, V block), over chunks in order,
S_C = exp(g_last) S_0 + Wt^T Delta with Delta = A U (U = V - Kbar S_0; with compact WY
Delta = A U' - W S_0, one dot of the chain on S). Saves the chunk-start states; with
split_output it emits Delta for the output stage, else O itself.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.delta_rule.tiles import (
    dot, dot_tn, tile, kernel_precision, operand_dtype, state_dtype, launch_params)
from pallas_kernels.delta_rule.output import output_rows


def chunk_common(refs, b, h, t0, C, scale, has_seg, need_k=True, need_q=True):
  """Per-chunk, V-independent quantities of the recurrent kernels: Kbar, Qbar (None unless
  needed: the serial kernels load only what their chain uses), e_last, and the segment masks."""
  g = tile(refs["g"], b, t0, C, h) if need_k or need_q else None
  kbar = tile(refs["k"], b, t0, C, h) * jnp.exp(g) if need_k else None
  qbar = (scale * tile(refs["q"], b, t0, C, h)) * jnp.exp(g) if need_q else None
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
    kbar, qbar, e_last, cont, cont_last = chunk_common(
        r, b, h, t0, C, scale, has_seg, need_k=has_seg or not wy, need_q=not split)
    v = r["v"][b, pl.ds(t0, C), h, pl.ds(v0, block_v)].astype(jnp.float32)
    amat = r["a"][b, h, pl.ds(t0, C), :]
    wt = r["wt"][b, pl.ds(t0, C), h, :]
    wk = r["wk"][b, pl.ds(t0, C), h, :] if wy else None
    s_base, delta = delta_rows(kbar, v, amat, wk, s, s_init, cont, cont_last, has_seg, prec)
    if split:
      o_ref[b, pl.ds(t0, C), h, pl.ds(v0, block_v)] = delta.astype(o_ref.dtype)
    else:
      o = output_rows(qbar, cont, s, s_init, r["p"][b, h, pl.ds(t0, C), :], delta, has_seg, prec)
      o_ref[b, pl.ds(t0, C), h, pl.ds(v0, block_v)] = o.astype(o_ref.dtype)
    return e_last * s_base + dot_tn(wt, delta, prec)

  s = lax.fori_loop(0, num_chunks, body, s_init)
  sfin_ref[b, h, :, pl.ds(v0, block_v)] = s


def delta_rows(kbar, v, amat, wk, s, s_init, cont, cont_last, has_seg, prec):
  """Delta = A U with U = V - Kbar S_0, and the state the chunk's decay applies to (S_init when
  the chunk's last token starts a new segment inside the chunk).

  wk = A Kbar (rows with cont) or None: then Delta = A (V - Kbar_new S_init) - wk S_0, whose
  only dot on the serial state chain is wk S_0."""
  s_base = cont_last * s + (1.0 - cont_last) * s_init if has_seg else s
  if wk is not None:
    u_off = v - dot(kbar * (1.0 - cont), s_init, prec) if has_seg else v
    return s_base, dot(amat, u_off, prec) - dot(wk, s, prec)
  if has_seg:
    u = v - dot(kbar * cont, s, prec) - dot(kbar * (1.0 - cont), s_init, prec)
  else:
    u = v - dot(kbar, s, prec)
  return s_base, dot(amat, u, prec)


def _state_pass_u_kernel(*refs, chunk, num_chunks, has_seg, block_v, prec):
  """Serial over chunks with U = A V' precomputed (wy.py): Delta = U - W S_0 and
  S <- exp(g_last) S_base + Wt^T Delta, the chain's only two dots; Delta is stored for the
  output stage in the dots' operand dtype (it only enters P Delta there)."""
  names = ["u", "wk", "wt", "g", "h0"] + (["cont"] if has_seg else [])
  r = dict(zip(names, refs[:len(names)]))
  delta_ref, sfin_ref, states_ref = refs[len(names):]
  b, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  C = chunk
  vs = pl.ds(vb * block_v, block_v)
  s_init = r["h0"][b, h, :, vs].astype(jnp.float32)

  def body(c, s):
    t0 = c * C
    rows = pl.ds(t0, C)
    states_ref[b, h, c, :, vs] = s.astype(states_ref.dtype)
    delta = r["u"][b, rows, h, vs].astype(jnp.float32) - dot(r["wk"][b, rows, h, :], s, prec)
    delta_ref[b, rows, h, vs] = delta.astype(delta_ref.dtype)
    e_last = jnp.exp(r["g"][b, t0 + C - 1, h, :])[:, None]
    if has_seg:   # the chunk's last token restarted from S_init inside the chunk
      cont_last = r["cont"][b, t0 + C - 1]
      s = cont_last * s + (1.0 - cont_last) * s_init
    return e_last * s + dot_tn(r["wt"][b, rows, h, :], delta, prec)

  sfin_ref[b, h, :, vs] = lax.fori_loop(0, num_chunks, body, s_init)


def state_forward(q, k, v, g, h0, cont, amat, pmat, wt, wk, u, *, chunk, scale, interpret,
                  cfg, cfg_prec, save_states):
  """The serial stage: (Delta with cfg.split_output (f32; with U given, as U's dtype), else O;
  S_final; chunk-start states, None unless saved or needed by the output stage)."""
  bsz, t, nh, kd = k.shape
  vd = v.shape[-1]
  nc = t // chunk
  has_seg = cont is not None
  prec = kernel_precision(cfg, cfg_prec, interpret)
  f32 = jnp.float32
  block_v = min(cfg.block_v, vd)
  if u is not None:
    return pl.pallas_call(
        functools.partial(_state_pass_u_kernel, chunk=chunk, num_chunks=nc, has_seg=has_seg,
                          block_v=block_v, prec=prec),
        out_shape=(jax.ShapeDtypeStruct(v.shape, operand_dtype(prec)),
                   jax.ShapeDtypeStruct((bsz, nh, kd, vd), f32),
                   jax.ShapeDtypeStruct((bsz, nh, nc, kd, vd), state_dtype(cfg, prec))),
        grid=(bsz, nh, vd // block_v), name="delta_rule_state_pass_u",
        **launch_params(interpret, cfg.num_warps_recur, cfg),
    )(*([u, wk, wt, g, h0] + ([cont] if has_seg else [])))
  split = cfg.split_output
  keep_states = save_states or split
  out_shape = [jax.ShapeDtypeStruct(v.shape[:3] + (vd,), f32 if split else q.dtype),
               jax.ShapeDtypeStruct((bsz, nh, kd, vd), f32)]
  if keep_states:
    out_shape.append(jax.ShapeDtypeStruct((bsz, nh, nc, kd, vd), state_dtype(cfg, prec)))
  recur_in = [q, k, v, g, amat, pmat, wt, h0] + ([cont] if has_seg else []) + (
      [wk] if wk is not None else [])
  outs = pl.pallas_call(
      functools.partial(_recur_fwd_kernel, chunk=chunk, num_chunks=nc, scale=scale,
                        has_seg=has_seg, block_v=block_v, prec=prec, save_states=keep_states,
                        split=split, wy=wk is not None),
      out_shape=tuple(out_shape), grid=(bsz, nh, vd // block_v), name="delta_rule_recur_fwd",
      **launch_params(interpret, cfg.num_warps_recur, cfg),
  )(*recur_in)
  return outs[0], outs[1], outs[2] if keep_states else None
