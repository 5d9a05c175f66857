"""Pallas kernels for the Kalman gain recurrence, written over generic "lanes".

Per (batch, head) there are L lanes (L = K channels for the diagonal gain, L = 1 for the isotropic
one). Per token t and lane i the inputs are
    a   decay multiplier (alpha^2, or mean alpha^2),  om  process noise,  u  information gain,
    kx  numerator factor,  kk  quadratic weight,      r   observation noise (per token, shared by lanes)
and the recurrence is
    p_hat = a p + om;  den = r + sum_i p_hat_i kk_i;  gain = p_hat kx / den;  p = p_hat / (1 + u p_hat)
with p reset to p0 before every token whose reset flag is set (token 0 always resets).

The variance update is the Moebius map M_t = [[a, om], [u a, 1 + u om]] (a reset token uses M_t R, R
the constant map to p0). Forward = two kernels:
  1. `_reduce_kernel`: per chunk (grid (B, H, NC)), the renormalised product of the chunk's M_t.
  2. `_replay_kernel`: per chunk, the exclusive carry (the products of all earlier chunks applied to
     p0, serial over chunks but only a 2x2 map per step), then a token replay emitting the gain, the
     variance p_{t-1} each token started from (a residual for the backward) and the final variance.
Backward = two kernels over the linear adjoint recurrence dp_{t-1} = m_t dp_t + c_t:
  3. `_bwd_reduce_kernel`: per chunk, the composed affine map (m, c) from chunk-end to chunk-start.
  4. `_bwd_replay_kernel`: per chunk, the carry from later chunks, then a reverse token replay that
     emits every input gradient, plus each chunk's dp0 contribution (from its resets).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import common


def _row(ref, b, t, h):
  """Loads lane row [1, L] (4-D ref) or scalar row [1] (3-D ref) at (b, t, h)."""
  if len(ref.shape) == 4:
    return ref[b, pl.ds(t, 1), h, :].astype(jnp.float32)
  return ref[b, pl.ds(t, 1), h].astype(jnp.float32)


def _token_matrix(a, om, u, reset, p0):
  m11, m12 = a, om
  m21, m22 = u * a, 1.0 + u * om
  # Reset: M R with R = [[0, p0], [0, 1]].
  r12 = m11 * p0 + m12
  r22 = m21 * p0 + m22
  zero = jnp.zeros_like(a)
  return (jnp.where(reset, zero, m11), jnp.where(reset, r12, m12),
          jnp.where(reset, zero, m21), jnp.where(reset, r22, m22))


def _matmul2(x, y):
  """x @ y for 2x2 matrices stored as 4-tuples of lane vectors; renormalised by max |entry|."""
  x11, x12, x21, x22 = x
  y11, y12, y21, y22 = y
  n11 = x11 * y11 + x12 * y21
  n12 = x11 * y12 + x12 * y22
  n21 = x21 * y11 + x22 * y21
  n22 = x21 * y12 + x22 * y22
  s = jnp.maximum(jnp.maximum(jnp.abs(n11), jnp.abs(n12)),
                  jnp.maximum(jnp.abs(n21), jnp.abs(n22)))
  s = jnp.where(s > 0, s, 1.0)
  inv = 1.0 / s
  return n11 * inv, n12 * inv, n21 * inv, n22 * inv


def _reduce_kernel(a_ref, om_ref, u_ref, reset_ref, p0_ref, prod_ref, *, chunk):
  b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  p0 = p0_ref[b, h, :].astype(jnp.float32)[None, :]
  t0 = c * chunk

  def body(i, m):
    t = t0 + i
    a = _row(a_ref, b, t, h)
    om = _row(om_ref, b, t, h)
    u = _row(u_ref, b, t, h)
    reset = reset_ref[b, pl.ds(t, 1)][:, None] > 0
    return _matmul2(_token_matrix(a, om, u, reset, p0), m)

  one = jnp.ones_like(p0)
  zero = jnp.zeros_like(p0)
  m = lax.fori_loop(0, chunk, body, (one, zero, zero, one))
  for j in range(4):
    prod_ref[b, h, c, j, :] = m[j].reshape(-1)


def _carry_in(prod_ref, p0, b, h, c):
  """Variance at the start of chunk c: chunk maps 0..c-1 applied to p0."""
  def body(j, p):
    m11 = prod_ref[b, h, j, 0, :][None, :]
    m12 = prod_ref[b, h, j, 1, :][None, :]
    m21 = prod_ref[b, h, j, 2, :][None, :]
    m22 = prod_ref[b, h, j, 3, :][None, :]
    return (m11 * p + m12) / (m21 * p + m22)
  return lax.fori_loop(0, c, body, p0)


def _replay_kernel(kx_ref, kk_ref, a_ref, om_ref, u_ref, r_ref, reset_ref, p0_ref, prod_ref,
                   gain_ref, pprev_ref, pfin_ref, *, chunk, num_chunks):
  b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  p0 = p0_ref[b, h, :].astype(jnp.float32)[None, :]
  p = _carry_in(prod_ref, p0, b, h, c)
  t0 = c * chunk

  def body(i, p):
    t = t0 + i
    reset = reset_ref[b, pl.ds(t, 1)][:, None] > 0
    p = jnp.where(reset, p0, p)
    a, om, u, kx, kk, r = _token_inputs(
        (a_ref, om_ref, u_ref, kx_ref, kk_ref, r_ref), b, t, h)
    p_hat = a * p + om
    den = r + jnp.sum(p_hat * kk, axis=1, keepdims=True)
    gain = p_hat * kx / den
    gain_ref[b, pl.ds(t, 1), h, :] = gain.astype(gain_ref.dtype)
    pprev_ref[b, pl.ds(t, 1), h, :] = p
    return p_hat / (1.0 + u * p_hat)

  p = lax.fori_loop(0, chunk, body, p)

  @pl.when(c == num_chunks - 1)
  def _():
    pfin_ref[b, h, :] = p.reshape(-1)


def _token_inputs(refs, b, t, h):
  """Token t's rows of (a, omega, u, k-gain, k-info, r); r as a column."""
  *lanes, r_ref = refs
  return (*(_row(x, b, t, h) for x in lanes), _row(r_ref, b, t, h)[:, None])


def _bwd_token(t, b, h, refs, dp):
  """One reverse step. Returns (gradients..., m, c) where dp_prev = m * dp + c (before resets)."""
  kx_ref, kk_ref, a_ref, om_ref, u_ref, r_ref, pprev_ref, dgain_ref = refs
  a, om, u, kx, kk, r = _token_inputs(
      (a_ref, om_ref, u_ref, kx_ref, kk_ref, r_ref), b, t, h)
  p_prev = _row(pprev_ref, b, t, h)
  dgain = _row(dgain_ref, b, t, h)
  p_hat = a * p_prev + om
  den = r + jnp.sum(p_hat * kk, axis=1, keepdims=True)
  inv_den = 1.0 / den
  gain = p_hat * kx * inv_den
  dden = -jnp.sum(dgain * gain, axis=1, keepdims=True) * inv_den
  q = dgain * kx * inv_den + dden * kk          # dp_hat from the gain (independent of dp)
  s = 1.0 / (1.0 + u * p_hat)
  p_new = p_hat * s
  m = s * s                                      # dp_hat / dp_new
  dp_hat = m * dp + q
  grads = dict(
      kx=dgain * p_hat * inv_den,
      kk=dden * p_hat,
      r=dden.reshape(-1),
      u=-dp * p_new * p_new,
      a=dp_hat * p_prev,
      om=dp_hat,
  )
  return grads, dp_hat, a * m, a * q, a


def _bwd_reduce_kernel(kx_ref, kk_ref, a_ref, om_ref, u_ref, r_ref, pprev_ref, dgain_ref,
                       reset_ref, map_ref, *, chunk):
  b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  refs = (kx_ref, kk_ref, a_ref, om_ref, u_ref, r_ref, pprev_ref, dgain_ref)
  t_last = c * chunk + chunk - 1

  def body(i, mc):
    mm, cc = mc
    t = t_last - i
    # dp_t = mm * dp_out + cc  ->  dp_{t-1} = m_t dp_t + c_t.
    _, _, m_t, c_t, _ = _bwd_token(t, b, h, refs, jnp.zeros_like(mm))
    reset = reset_ref[b, pl.ds(t, 1)][:, None] > 0
    m_t = jnp.where(reset, 0.0, m_t)
    c_t = jnp.where(reset, 0.0, c_t)
    return m_t * mm, m_t * cc + c_t

  one = jnp.ones((1, a_ref.shape[-1]), jnp.float32)
  mm, cc = lax.fori_loop(0, chunk, body, (one, jnp.zeros_like(one)))
  map_ref[b, h, c, 0, :] = mm.reshape(-1)
  map_ref[b, h, c, 1, :] = cc.reshape(-1)


def _bwd_replay_kernel(kx_ref, kk_ref, a_ref, om_ref, u_ref, r_ref, pprev_ref, dgain_ref,
                       reset_ref, map_ref, dpfin_ref,
                       dkx_ref, dkk_ref, da_ref, dom_ref, du_ref, dr_ref, dp0_ref,
                       *, chunk, num_chunks):
  b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  refs = (kx_ref, kk_ref, a_ref, om_ref, u_ref, r_ref, pprev_ref, dgain_ref)
  dp_fin = dpfin_ref[b, h, :].astype(jnp.float32)[None, :]

  def carry_body(j, dp):
    jj = num_chunks - 1 - j
    return map_ref[b, h, jj, 0, :][None, :] * dp + map_ref[b, h, jj, 1, :][None, :]

  dp = lax.fori_loop(0, num_chunks - 1 - c, carry_body, dp_fin)
  t_last = c * chunk + chunk - 1

  def body(i, state):
    dp, dp0 = state
    t = t_last - i
    g, dp_hat, _, _, a = _bwd_token(t, b, h, refs, dp)
    for name, ref in (("kx", dkx_ref), ("kk", dkk_ref), ("a", da_ref), ("om", dom_ref),
                      ("u", du_ref)):
      ref[b, pl.ds(t, 1), h, :] = g[name]
    dr_ref[b, pl.ds(t, 1), h] = g["r"]
    reset = reset_ref[b, pl.ds(t, 1)][:, None] > 0
    dprev = a * dp_hat
    dp0 = dp0 + jnp.where(reset, dprev, 0.0)
    dp = jnp.where(reset, 0.0, dprev)
    return dp, dp0

  _, dp0 = lax.fori_loop(0, chunk, body, (dp, jnp.zeros_like(dp)))
  dp0_ref[b, h, c, :] = dp0.reshape(-1)


# ----------------------------------------------------------------------------------------------
# Wrappers (all arrays already padded to a multiple of the chunk).


def _launch(r, per_lane, chunk, interpret, cfg):
  """Sizes, grid (batch, head, chunk) and pallas_call options of one gain pass."""
  bsz, t, nh = r.shape
  params = dict(interpret=interpret,
                compiler_params=common.compiler_params(cfg.num_warps, cfg.num_stages))
  return bsz, nh, t // chunk, per_lane.shape[-1], (bsz, nh, t // chunk), params


def gain_forward(kx, kk, a, om, u, r, reset, p0, *, chunk, interpret, cfg):
  """Lane arrays [B,T,H,L] float32, r [B,T,H], reset [B,T], p0 [B,H,L]."""
  bsz, nh, nc, lanes, grid, params = _launch(r, p0, chunk, interpret, cfg)
  reset = reset.astype(jnp.int32)
  prod = pl.pallas_call(
      functools.partial(_reduce_kernel, chunk=chunk),
      out_shape=jax.ShapeDtypeStruct((bsz, nh, nc, 4, lanes), jnp.float32),
      grid=grid, name="kdn_gain_reduce", **params,
  )(a, om, u, reset, p0)
  lane_shape = kx.shape
  gain, pprev, pfin = pl.pallas_call(
      functools.partial(_replay_kernel, chunk=chunk, num_chunks=nc),
      out_shape=(jax.ShapeDtypeStruct(lane_shape, jnp.float32),
                 jax.ShapeDtypeStruct(lane_shape, jnp.float32),
                 jax.ShapeDtypeStruct((bsz, nh, lanes), jnp.float32)),
      grid=grid, name="kdn_gain_replay", **params,
  )(kx, kk, a, om, u, r, reset, p0, prod)
  return gain, pprev, pfin


def gain_backward(kx, kk, a, om, u, r, reset, pprev, dgain, dpfin, *, chunk, interpret, cfg):
  bsz, nh, nc, lanes, grid, params = _launch(r, dpfin, chunk, interpret, cfg)
  reset = reset.astype(jnp.int32)
  maps = pl.pallas_call(
      functools.partial(_bwd_reduce_kernel, chunk=chunk),
      out_shape=jax.ShapeDtypeStruct((bsz, nh, nc, 2, lanes), jnp.float32),
      grid=grid, name="kdn_gain_bwd_reduce", **params,
  )(kx, kk, a, om, u, r, pprev, dgain, reset)
  lane = jax.ShapeDtypeStruct(kx.shape, jnp.float32)
  outs = pl.pallas_call(
      functools.partial(_bwd_replay_kernel, chunk=chunk, num_chunks=nc),
      out_shape=(lane, lane, lane, lane, lane,
                 jax.ShapeDtypeStruct(r.shape, jnp.float32),
                 jax.ShapeDtypeStruct((bsz, nh, nc, lanes), jnp.float32)),
      grid=grid, name="kdn_gain_bwd_replay", **params,
  )(kx, kk, a, om, u, r, pprev, dgain, reset, maps, dpfin)
  dkx, dkk, da, dom, du, dr, dp0 = outs
  return dkx, dkk, da, dom, du, dr, dp0.sum(axis=2)
