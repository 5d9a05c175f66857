"""(I + L)^-1 for a strictly lower-triangular L [C, C] inside a kernel, by the methods that
DeltaRuleConfig.wy_inverse (the WY kernel, wy.py) names. Plain functions of in-register tiles: no
refs, no kernels."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels.delta_rule.tiles import dot, iota


def _unit_lower_inverse_doubling(lmat, C, hi):
  """(I + L)^-1 = (I + M)(I + M^2)(I + M^4)... with M = -L (nilpotent: M^C = 0): 2 log2(C) - 2
  dots, fp32-accurate (hi)."""
  row, col = iota(C, 0), iota(C, 1)
  m = -lmat
  amat = (row == col).astype(jnp.float32) + m
  for _ in range(C.bit_length() - 2):
    m = dot(m, m, hi)
    amat = amat + dot(amat, m, hi)
  return amat


def _unit_lower_inverse_blocked(lmat, C, block, hi):
  """(I + L)^-1 = sum_n (-M)^n D^-1 with D = I + blockdiag(L), M = D^-1 (L - blockdiag(L)).

  D^-1 by forward substitution run on all diagonal blocks at once (block - 1 matmul steps);
  M is nilpotent of index C / block, so the series is exact (block forward substitution)."""
  row, col = iota(C, 0), iota(C, 1)
  eye = (row == col).astype(jnp.float32)
  same_blk = (row // block) == (col // block)
  lbd = jnp.where(same_blk, lmat, 0.0)
  nmat = lmat - lbd
  rmod = row % block

  def sub_body(i, dinv):
    return jnp.where(rmod == i, eye - dot(lbd, dinv, hi), dinv)

  dinv = lax.fori_loop(1, block, sub_body, eye)
  if C == block:
    return dinv
  mmat = dot(dinv, nmat, hi)
  amat, term = dinv, dinv
  for _ in range(C // block - 1):
    term = -dot(mmat, term, hi)
    amat = amat + term
  return amat


def unit_lower_inverse(lmat, C, inverse, block, hi):
  """(I + L)^-1 by the DeltaRuleConfig.wy_inverse method named `inverse`."""
  if inverse == "doubling":
    return _unit_lower_inverse_doubling(lmat, C, hi)
  if inverse == "sub_rows":
    return _unit_lower_inverse_sub_rows(lmat, C, min(block, C), hi)
  return _unit_lower_inverse_blocked(lmat, C, min(block, C), hi)  # 'sub_dots'


def _unit_lower_inverse_sub_rows(lmat, C, S, hi):
  """(I + L)^-1 for strictly lower L [C, C]: forward substitution on the S x S diagonal blocks,
  one row of every block per step, elementwise in fp32 (no rounded dot touches it), then their
  merge as in _unit_lower_inverse_blocked (C / S fp32-accurate dots)."""
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
