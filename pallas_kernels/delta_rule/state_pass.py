"""Serial state-pass stage (forward): per (batch, head, V block), over chunks in order,
Delta = U - W S_0 (U = A V' and W = A Kbar from wy.py) and S_C = exp(g_last) S_0 + Wt^T Delta,
the chain's only two dots. Saves the chunk-start states and Delta for the output stage.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.delta_rule.tiles import (
    dot, dot_tn, kernel_precision, operand_dtype, state_dtype, launch_params)


def _state_pass_kernel(*refs, chunk, num_chunks, has_seg, block_v, prec):
  """Serial over chunks with U = A V' precomputed (wy.py): Delta = U - W S_0 and
  S <- exp(g_last) S_base + Wt^T Delta, the chain's only two dots; Delta is stored for the
  output stage in the dots' operand dtype (it only enters P Delta there).

  Chunk c + 1's inputs are loaded before chunk c's dots and carried into the next step: ncu
  (H200, session 35) put half the loop's stall cycles on global-load waits, one warp per
  scheduler with nothing else to issue. Session 37, H200, diag KDN T=16384: this stage 2.48 ->
  1.77 ms, op fwd+bwd 20.27 -> 19.74 ms. (The same prefetch in the backward's dS chain lost,
  2.99 -> 3.36 ms, and was removed.)"""
  names = ["u", "wk", "wt", "g", "h0"] + (["cont"] if has_seg else [])
  r = dict(zip(names, refs[:len(names)]))
  delta_ref, sfin_ref, states_ref = refs[len(names):]
  b, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  C = chunk
  vs = pl.ds(vb * block_v, block_v)
  s_init = r["h0"][b, h, :, vs].astype(jnp.float32)

  def inputs(c):
    """Chunk c's loads: U, W, Wt, g_last (and cont_last with segments)."""
    t0 = c * C
    rows = pl.ds(t0, C)
    x = (r["u"][b, rows, h, vs], r["wk"][b, rows, h, :], r["wt"][b, rows, h, :],
         r["g"][b, t0 + C - 1, h, :])
    return x + ((r["cont"][b, t0 + C - 1],) if has_seg else ())

  def step(c, s, x):
    u, wk, wt, g_last = x[:4]
    rows = pl.ds(c * C, C)
    states_ref[b, h, c, :, vs] = s.astype(states_ref.dtype)
    delta = u.astype(jnp.float32) - dot(wk, s, prec)
    delta_ref[b, rows, h, vs] = delta.astype(delta_ref.dtype)
    e_last = jnp.exp(g_last)[:, None]
    if has_seg:   # the chunk's last token restarted from S_init inside the chunk
      cont_last = x[4]
      s = cont_last * s + (1.0 - cont_last) * s_init
    return e_last * s + dot_tn(wt, delta, prec)

  def body(c, carry):
    s, x = carry
    nxt = inputs(jnp.minimum(c + 1, num_chunks - 1))   # (the last step's reload goes unused)
    return step(c, s, x), nxt

  sfin = lax.fori_loop(0, num_chunks, body, (s_init, inputs(0)))[0]
  sfin_ref[b, h, :, vs] = sfin


def state_forward(u, wk, wt, g, h0, cont, *, chunk, interpret, cfg, cfg_prec):
  """The serial stage: (Delta [B, T, H, V] in the dots' operand dtype, S_final [B, H, K, V] f32,
  the chunk-start states [B, H, NC, K, V])."""
  bsz, t, nh, kd = wk.shape
  vd = u.shape[-1]
  nc = t // chunk
  has_seg = cont is not None
  prec = kernel_precision(cfg, cfg_prec, interpret)
  block_v = min(cfg.block_v, vd)
  return pl.pallas_call(
      functools.partial(_state_pass_kernel, chunk=chunk, num_chunks=nc, has_seg=has_seg,
                        block_v=block_v, prec=prec),
      out_shape=(jax.ShapeDtypeStruct(u.shape, operand_dtype(prec)),
                 jax.ShapeDtypeStruct((bsz, nh, kd, vd), jnp.float32),
                 jax.ShapeDtypeStruct((bsz, nh, nc, kd, vd), state_dtype(cfg, prec))),
      grid=(bsz, nh, vd // block_v), name="delta_rule_state_pass",
      **launch_params(interpret, cfg.num_warps_recur, cfg),
  )(*([u, wk, wt, g, h0] + ([cont] if has_seg else [])))
