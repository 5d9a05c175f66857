"""The serial pass's operands for a longer chunk, merged from the token-parallel pair kernel's
chunks (DeltaRuleConfig.serial_chunk; calls that are not differentiated and have no segment_ids).

The pair products stay token-parallel at C = 16 rows (intra._pair_token_loop_kernel, the fast
one), while the serial pass steps over C' = n C tokens at a time: 1/n of the dependent chunk
steps that bound it (1024 at T=16384 and C = 16; issue 18: fla's chain runs at chunk 64). This
kernel (per batch, head and merged chunk) is the WY stage of the merged chunk, built from the
blocks m = 0..n-1 of C rows the pair kernel wrote, with g local to each block:

    gl_m = g at block m's last row,  G_m = gl_0 + ... + gl_m (relative to the merged chunk's
    start; G_-1 = 0),  Kbar_m = k exp(g),  Qbar_m = scale q exp(g),  Wt_m = w exp(gl_m - g),
    L_mm, P_mm: the pair kernel's diagonal blocks.
    L_ij = (Kbar_i exp(G_{i-1} - G_j)) Wt_j^T,  P_ij = (Qbar_i exp(G_{i-1} - G_j)) Wt_j^T  (i > j)
    A = (I + L)^-1 by blocks: A_ii = (I + L_ii)^-1,  A_ij = -A_ii sum_{j <= m < i} L_im A_mj
    W_i = sum_{j <= i} A_ij Kbar_j exp(G_{j-1}),   U_i = sum_{j <= i} A_ij V_j
    Wt'_j = Wt_j exp(G_{n-1} - G_j),   Qbar'_i = Qbar_i exp(G_{i-1}),   g_last' = G_{n-1}

which are W = A Kbar, U = A V, Wt, Qbar and P of the merged chunk (__init__'s docstring), every
exponent <= 0. The inverse's blocks are fp32 (fp32-accurate dots, as the WY kernel's merge);
the L and P blocks and W, U are dots at the kernels' precision, as the 'columns' pair kernel
forms a long chunk's off-diagonal blocks.
"""
from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import common
from pallas_kernels.delta_rule.inverse import unit_lower_inverse
from pallas_kernels.delta_rule.tiles import (
    dot, dot_nt, tile, kernel_precision, operand_dtype, launch_params)
from pallas_kernels.kernel_math import exp_for_mode


def _merge_kernel(l_ref, kbar_ref, wt_ref, qbar_ref, p_ref, v_ref, gl_ref,
                  w_out, u_out, wt_out, qbar_out, p_out, gl_out, *, n, S, block_v, inverse,
                  prec, hi, exp):
  b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  t0 = c * n * S
  row0 = [t0 + m * S for m in range(n)]
  rows = [pl.ds(r, S) for r in row0]
  G = list(itertools.accumulate(gl_ref[b, c * n + m, h, :].astype(jnp.float32)
                                for m in range(n)))
  # decay[i][j] = exp(G_{i-1} - G_j) for j < i: from block j's last row to block i's start
  decay = {(i, j): exp(G[i - 1] - G[j])[None, :] for i in range(1, n) for j in range(i)}
  blk = lambda ref, m: tile(ref, b, row0[m], S, h)

  lmat = {(i, j): dot_nt(blk(kbar_ref, i) * decay[i, j], blk(wt_ref, j), prec)
          for i in range(1, n) for j in range(i)}
  amat = {}
  for i in range(n):
    amat[i, i] = unit_lower_inverse(l_ref[b, h, rows[i], :], S, inverse, S, hi)
    for j in range(i):
      acc = sum(dot(lmat[i, m], amat[m, j], hi) for m in range(j, i))
      amat[i, j] = -dot(amat[i, i], acc, hi)

  kbar_rel = lambda j: blk(kbar_ref, j) * (exp(G[j - 1])[None, :] if j else 1.0)
  for i in range(n):
    w_out[b, rows[i], h, :] = sum(dot(amat[i, j], kbar_rel(j), prec)
                                  for j in range(i + 1)).astype(w_out.dtype)
  for vb in range(v_ref.shape[-1] // block_v):
    vs = pl.ds(vb * block_v, block_v)
    for i in range(n):
      u_out[b, rows[i], h, vs] = sum(
          dot(amat[i, j], v_ref[b, rows[j], h, vs].astype(jnp.float32), prec)
          for j in range(i + 1)).astype(u_out.dtype)

  for m in range(n):
    wt = blk(wt_ref, m)
    wt_out[b, rows[m], h, :] = (wt if m == n - 1 else
                                wt * exp(G[n - 1] - G[m])[None, :]).astype(wt_out.dtype)
    qbar = blk(qbar_ref, m)
    qbar_out[b, rows[m], h, :] = (qbar * exp(G[m - 1])[None, :] if m else qbar).astype(
        qbar_out.dtype)
  zeros = jnp.zeros((S, S), p_out.dtype)
  for i in range(n):
    for j in range(n):
      if j == i:
        pij = p_ref[b, h, rows[i], :]
      elif j < i:
        pij = dot_nt(blk(qbar_ref, i) * decay[i, j], blk(wt_ref, j), prec)
      else:
        pij = zeros
      p_out[b, h, rows[i], pl.ds(j * S, S)] = pij.astype(p_out.dtype)
  gl_out[b, c, h, :] = G[n - 1]


def merge_forward(lmat, kbar, wt, qbar, pmat, v, g_last, *, chunk, serial_chunk, interpret, cfg,
                  cfg_prec):
  """The merged chunk's (W [B, T, H, K], U [B, T, H, V], Wt [B, T, H, K], Qbar [B, T, H, K],
  P [B, H, T, C'], g_last [B, T / C', H, K] fp32), the first five in the operand dtype, from the
  pair kernel's chunks of C = `chunk` rows: L, P [B, H, T, C], Kbar, Qbar, Wt and g_last
  [B, T / C, H, K] (intra.Pairs) and V; C' = serial_chunk, a multiple of C dividing T."""
  bsz, t, nh, kd = kbar.shape
  vd = v.shape[-1]
  if serial_chunk % chunk or t % serial_chunk:
    raise ValueError(f"merge_forward: serial_chunk={serial_chunk} must be a multiple of "
                     f"chunk={chunk} and divide T={t}")
  n = serial_chunk // chunk
  prec = kernel_precision(cfg, cfg_prec, interpret)
  dt = operand_dtype(prec)
  hi = common.dot_precision("exact", interpret)
  out_shape = (jax.ShapeDtypeStruct((bsz, t, nh, kd), dt),
               jax.ShapeDtypeStruct((bsz, t, nh, vd), dt),
               jax.ShapeDtypeStruct((bsz, t, nh, kd), dt),
               jax.ShapeDtypeStruct((bsz, t, nh, kd), dt),
               jax.ShapeDtypeStruct((bsz, nh, t, serial_chunk), dt),
               jax.ShapeDtypeStruct((bsz, t // serial_chunk, nh, kd), jnp.float32))
  return pl.pallas_call(
      functools.partial(_merge_kernel, n=n, S=chunk, block_v=min(cfg.block_v_parallel, vd),
                        inverse=cfg.wy_inverse, prec=prec, hi=hi, exp=exp_for_mode(cfg_prec)),
      out_shape=out_shape, grid=(bsz, nh, t // serial_chunk), name="delta_rule_merge",
      **launch_params(interpret, cfg.num_warps_merge, cfg),
  )(lmat, kbar, wt, qbar, pmat, v, g_last)
