"""The WY stage of the forward (the second kernel of intra.intra_forward): per (batch, head,
chunk), from L (the pair kernel's, fp32) and Kbar

    A = (I + L)^-1,   W = A Kbar_c,   U = A V'   (Kbar_c = Kbar on the rows that continue the
                                                 chunk-start state; V' = V - Kbar_new S_init)

so that the serial pass carries Delta = U - W S_0 alone: two dots on its chain (W S_0, then
S <- exp(g_last) S_0 + Wt^T Delta) and no A V product inside the loop. A is formed in fp32 by
forward substitution (inverse.py): elementwise, no rounded dot touches it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.delta_rule.inverse import unit_lower_inverse
from pallas_kernels.delta_rule.tiles import (
  by_reset,
  dot,
  kernel_precision,
  key_tiles,
  launch_params,
  operand_dtype,
  tile,
  value_block,
)


def _wy_kernel(*refs, chunk, has_seg, block_v, prec, ktiles):
  names = ["l", "kbar", "v", "h0"] + (["cont"] if has_seg else [])
  r = dict(zip(names, refs[: len(names)]))
  a_out, wk_out, u_out = refs[len(names) :]
  b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  C = chunk
  t0 = c * C
  rows = pl.ds(t0, C)
  amat = unit_lower_inverse(r["l"][b, h, rows, :], C)
  a_out[b, h, rows, :] = amat.astype(a_out.dtype)
  # Kbar key tile by key tile (tiles.key_tiles): only a [C, block_k] tile live at a time; one
  # tile (K <= block_k) is loaded once for both products.
  whole = tile(r["kbar"], b, t0, C, h) if len(ktiles) == 1 else None

  def kbar(ks):
    return whole if whole is not None else r["kbar"][b, rows, h, ks].astype(jnp.float32)

  by_reset(
    r.get("cont"),
    b,
    t0 + C - 1,
    lambda seg: _wk_u(r, wk_out, u_out, amat, kbar, ktiles, b, h, t0, C, seg, block_v, prec),
  )


def _wk_u(r, wk_out, u_out, amat, kbar, ktiles, b, h, t0, C, seg, block_v, prec):
  """W and U of the chunk (kbar(ks): Kbar's key columns ks, fp32); seg: the chunk holds a reset
  (rows after it: Kbar_c = 0 and V' = V - Kbar S_init)."""
  rows = pl.ds(t0, C)
  cont = r["cont"][b, rows][:, None] if seg else None
  for ks in ktiles:
    kb = kbar(ks)
    wk_out[b, rows, h, ks] = dot(amat, kb * cont if seg else kb, prec).astype(wk_out.dtype)
  # U in V blocks: only a [C, block_v] value tile (and S_init's [block_k, block_v]) live at a time.
  for vb in range(r["v"].shape[-1] // block_v):
    vs = pl.ds(vb * block_v, block_v)
    v = r["v"][b, rows, h, vs].astype(jnp.float32)
    if seg:  # rows after a reset inside the chunk start from S_init, known up front
      for ks in ktiles:
        v = v - dot(kbar(ks) * (1.0 - cont), r["h0"][b, h, ks, vs], prec)
    u_out[b, rows, h, vs] = dot(amat, v, prec).astype(u_out.dtype)


def wy_forward(lmat, kbar, v, h0, cont, *, chunk, interpret, cfg, cfg_prec):
  """(A [B, H, T, C], W [B, T, H, K], U [B, T, H, V]), all in the dots' operand dtype, from L
  and Kbar = k exp(g) (the pair kernel's). A and W only ever enter dots, which round them so
  anyway; U is the first term of Delta = U - W S_0, so storing it in bf16 (fla's choice too) is
  one more bf16 rounding of Delta, for bf16 data only (tests: within the bf16 bounds)."""
  bsz, t, nh, kd = kbar.shape
  vd = v.shape[-1]
  has_seg = cont is not None
  prec = kernel_precision(cfg_prec, interpret)
  dt = operand_dtype(prec)
  out_shape = (
    jax.ShapeDtypeStruct((bsz, nh, t, chunk), dt),
    jax.ShapeDtypeStruct((bsz, t, nh, kd), dt),
    jax.ShapeDtypeStruct((bsz, t, nh, vd), dt),
  )
  return pl.pallas_call(
    functools.partial(
      _wy_kernel,
      chunk=chunk,
      has_seg=has_seg,
      block_v=value_block(cfg, kd, vd, parallel=True),
      ktiles=key_tiles(kd, cfg),
      prec=prec,
    ),
    out_shape=out_shape,
    grid=(bsz, nh, t // chunk),
    name="delta_rule_wy",
    **launch_params(interpret, cfg.num_warps_intra, cfg),
  )(*([lmat, kbar, v, h0] + ([cont] if has_seg else [])))
