"""(I + L)^-1 for a strictly lower-triangular L [C, C] inside a kernel (the WY kernel, wy.py).
A plain function of an in-register tile: no refs, no kernels."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels.delta_rule.tiles import iota


def unit_lower_inverse(lmat, C):
  """(I + L)^-1 for strictly lower L [C, C] by row-wise forward substitution, elementwise in fp32
  (no rounded dot touches it): the fastest form measured (docs/decisions.md, `wy_inverse`).
  The block masks (one block of C rows: all true) stay in the expressions: without them XLA and
  Triton compile a different program, whose fp32 roundings differ from the ones checked."""
  row, col = iota(C, 0), iota(C, 1)
  eye = (row == col).astype(jnp.float32)
  same_blk = (row // C) == (col // C)
  lbd = jnp.where(same_blk, lmat, 0.0)
  rmod = row % C

  def sub_body(i, dinv):
    # Row i of A: new[n] = sum_m L[i, m] A[m, n] over the rows m < i already formed.
    lrow = jnp.sum(jnp.where(rmod == i, lbd, 0.0), axis=0)
    new = jnp.sum(lrow[:, None] * dinv, axis=0)
    return jnp.where((rmod == i) & same_blk, eye - new[None, :], dinv)

  return lax.fori_loop(1, C, sub_body, eye)
