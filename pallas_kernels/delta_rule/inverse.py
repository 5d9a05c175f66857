"""(I + L)^-1 for a strictly lower-triangular L [C, C] inside a kernel (the WY kernel, wy.py).
Plain functions of in-register tiles: no refs, no kernels."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels.delta_rule.tiles import dot, iota


def unit_lower_inverse(lmat, C, block, hi):
  """(I + L)^-1 by row-wise forward substitution on the diagonal blocks of min(block, C) rows,
  then their merge (_sub_rows): the fastest form measured (docs/decisions.md)."""
  return _sub_rows(lmat, C, min(block, C), hi)


def _sub_rows(lmat, C, S, hi):
  """(I + L)^-1 for strictly lower L [C, C]: forward substitution on the S x S diagonal blocks,
  one row of every block per step, elementwise in fp32 (no rounded dot touches it), then their
  merge, A = sum_n (-M)^n D^-1 with D^-1 the block-diagonal inverse and M = D^-1 (L - blockdiag(L)),
  nilpotent of index C / S (block forward substitution in closed form: C / S fp32-accurate dots)."""
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
