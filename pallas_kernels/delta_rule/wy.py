"""The WY stage of the precomputed-U forward (DeltaRuleConfig.precompute_u): per (batch, head,
chunk), from L (intra._pair_rows_kernel, fp32)

    A = (I + L)^-1,   W = A Kbar_c,   U = A V'   (Kbar_c = Kbar on the rows that continue the
                                                 chunk-start state; V' = V - Kbar_new S_init)

so that the serial pass carries Delta = U - W S_0 alone: two dots on its chain (W S_0, then
S <- exp(g_last) S_0 + Wt^T Delta) and no A V product inside the loop.

A is formed in fp32 in two steps: forward substitution on the S x S diagonal blocks (all of them
at once, one row of every block per step, elementwise: no rounded dot touches it), then their
merge into the C x C inverse, A = sum_n (-M)^n D^-1 with D^-1 the block-diagonal inverse and
M = D^-1 (L - blockdiag(L)), nilpotent of index C / S (the closed form of block forward
substitution, C / S fp32-accurate dots).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import common
from pallas_kernels.delta_rule.tiles import (
    dot, iota, tile, kernel_precision, operand_dtype, launch_params)


def unit_lower_inverse_sub_blocks(lmat, C, S, hi):
  """(I + L)^-1 for strictly lower L [C, C] (fp32), S-row diagonal blocks first."""
  row, col = iota(C, 0), iota(C, 1)
  eye = (row == col).astype(jnp.float32)
  same_blk = (row // S) == (col // S)
  lbd = jnp.where(same_blk, lmat, 0.0)
  rmod = row % S

  def sub_body(i, dinv):
    # Row i of every diagonal block at once: those rows of L have disjoint column supports,
    # so their sum over rows is each block's row, side by side; and D^-1 is block diagonal, so
    # new[n] = sum_m lrow[m] D^-1[m, n] is (L_bb D_bb^-1)[i, n] of n's own block b.
    lrow = jnp.sum(jnp.where(rmod == i, lbd, 0.0), axis=0)
    new = jnp.sum(lrow[:, None] * dinv, axis=0)
    return jnp.where((rmod == i) & same_blk, eye - new[None, :], dinv)

  dinv = lax.fori_loop(1, S, sub_body, eye)
  if C == S:
    return dinv
  mmat = dot(dinv, lmat - lbd, hi)
  amat, term = dinv, dinv
  for _ in range(C // S - 1):
    term = -dot(mmat, term, hi)
    amat = amat + term
  return amat


def _wy_kernel(*refs, chunk, sub, has_seg, block_v, prec, hi):
  names = ["l", "k", "g", "v", "h0"] + (["cont"] if has_seg else [])
  r = dict(zip(names, refs[:len(names)]))
  a_out, wk_out, u_out = refs[len(names):]
  b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  C = chunk
  t0 = c * C
  rows = pl.ds(t0, C)
  amat = unit_lower_inverse_sub_blocks(r["l"][b, h, rows, :], C, sub, hi)
  a_out[b, h, rows, :] = amat.astype(a_out.dtype)
  kbar = tile(r["k"], b, t0, C, h) * jnp.exp(tile(r["g"], b, t0, C, h))
  cont = r["cont"][b, rows][:, None] if has_seg else None
  wk_out[b, rows, h, :] = dot(amat, kbar * cont if has_seg else kbar, prec).astype(wk_out.dtype)
  # U in V blocks: only a [C, block_v] value tile (and S_init's [K, block_v]) live at a time.
  for vb in range(r["v"].shape[-1] // block_v):
    vs = pl.ds(vb * block_v, block_v)
    v = r["v"][b, rows, h, vs].astype(jnp.float32)
    if has_seg:   # rows after a reset inside the chunk start from S_init, known up front
      v = v - dot(kbar * (1.0 - cont), r["h0"][b, h, :, vs], prec)
    u_out[b, rows, h, vs] = dot(amat, v, prec).astype(u_out.dtype)


def wy_forward(lmat, k, v, g, h0, cont, *, chunk, sub, interpret, cfg, cfg_prec):
  """(A [B, H, T, C], W [B, T, H, K], U [B, T, H, V]), all in the dots' operand dtype (bf16
  under bf16-operand dots: they only ever enter dots that round them so)."""
  bsz, t, nh, kd = k.shape
  vd = v.shape[-1]
  has_seg = cont is not None
  prec = kernel_precision(cfg, cfg_prec, interpret)
  dt = operand_dtype(prec)
  hi = common.dot_precision("exact", interpret)
  out_shape = (jax.ShapeDtypeStruct((bsz, nh, t, chunk), dt),
               jax.ShapeDtypeStruct((bsz, t, nh, kd), dt),
               jax.ShapeDtypeStruct((bsz, t, nh, vd), dt))
  return pl.pallas_call(
      functools.partial(_wy_kernel, chunk=chunk, sub=sub, has_seg=has_seg,
                        block_v=min(cfg.block_v_parallel, vd), prec=prec, hi=hi),
      out_shape=out_shape, grid=(bsz, nh, t // chunk), name="delta_rule_wy",
      **launch_params(interpret, cfg.num_warps_intra, cfg),
  )(*([lmat, k, g, v, h0] + ([cont] if has_seg else [])))
