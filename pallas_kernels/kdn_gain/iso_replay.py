"""The isotropic gain's forward replay over per-token scalars (always, on the Triton/interpret path).

The isotropic gain has one lane per (batch, head): each token enters only through the scalars
    a = mean_K exp(2 log_alpha),  kk = |k|^2,  omega,  r
(kernel.py's _lanes; MATH.md). The lane replay (kernel._replay_kernel) re-reads the token's k and
log_alpha rows ([1, K] each, 2 x 268 MB at B=4, T=16k, H=16, K=128 in bf16) to form a and kk again,
one one-warp program per (batch, head, chunk). Here the reduce writes a and kk ([B, T, H] fp32,
kernel._reduce_kernel with `scalars`) and this replay reads only [B, T, H] scalars, one program per
(batch, chunk) with the heads as the lanes of a [1, H] row: 1/H of the programs, no K-wide loads.

Same recurrence and arithmetic as the lane replay, per head:
    p_hat = a p + omega;  den = r + p_hat kk;  beta = p_hat (1 / den);
    p = p_hat / (1 + u p_hat),  u = mu kk / (K r)
with p reset to p0 before every token whose reset flag is set. The carry-in applies the reduce's
chunk maps (kernel._carry_in, all heads at once). The [1, H] row is a Triton block, so a head
count that is not a power of two (the 125m preset's 6) is padded to the next one: the reduce
writes a and kk that wide, the small per-head and [B, T, H] inputs are padded in XLA and the
outputs sliced back; the padded lanes compute values nothing reads.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import kernel_math
from pallas_kernels.kdn_gain import moebius


def _kernel(
  a_ref,
  kk_ref,
  om_ref,
  r_ref,
  mu_ref,
  reset_ref,
  p0_ref,
  prod_ref,
  *outs,
  chunk,
  num_chunks,
  kd,
  save_pprev,
  front,
  data_dtype,
  segmented,
):
  gain_ref, pprev_ref, pfin_ref = outs if save_pprev else (outs[0], None, outs[1])
  b, c = pl.program_id(0), pl.program_id(1)
  row = lambda ref, t: ref[b, pl.ds(t, 1), :].astype(jnp.float32)  # [1, H]
  p0 = p0_ref[b, :, 0].astype(jnp.float32)[None, :]
  mu = mu_ref[:].astype(jnp.float32)[None, :]
  softplus = kernel_math.softplus_for(data_dtype)

  # the carry-in: chunks 0..c-1's maps, every head at once (kernel._carry_in per head)
  p = moebius.apply_maps(lambda j: tuple(prod_ref[b, :, j, i, 0][None, :] for i in range(4)), p0, c)

  def body(i, p):
    t = c * chunk + i
    if segmented:
      p = jnp.where(reset_ref[b, pl.ds(t, 1)][:, None] > 0, p0, p)
    a, kk = row(a_ref, t), row(kk_ref, t)
    om, r = row(om_ref, t), row(r_ref, t)
    if front is not None:  # omega = softplus(omega_raw), r = r_min + softplus(r_raw)
      om, r = softplus(om), front + softplus(r)
    p_hat = a * p + om
    den = r + p_hat * kk
    gain_ref[b, pl.ds(t, 1), :, 0] = (p_hat * (1.0 / den)).astype(gain_ref.dtype)
    if save_pprev:
      pprev_ref[b, pl.ds(t, 1), :, 0] = p
    u = mu * kk / (kd * r)
    return p_hat / (1.0 + u * p_hat)

  p = lax.fori_loop(0, chunk, body, p)

  @pl.when(c == num_chunks - 1)
  def _():
    pfin_ref[b, :, 0] = p.reshape(-1)


def replay(
  a,
  kk,
  om,
  r,
  mu,
  reset,
  p0,
  prod,
  *,
  chunk,
  kd,
  save_pprev,
  front,
  data_dtype,
  gain_dtype,
  segmented,
  params,
):
  """(gain [B, T, H, 1] in gain_dtype, p_prev [B, T, H, 1] f32 or None, p_final [B, H, 1] f32)
  from the reduce's a, kk [B, T, Hp] fp32 (Hp = common.next_pow2(H); the columns past H unread)
  and chunk maps prod [B, H, NC, 4, 1]; om, r: [B, T, H] raw (with `front`, r_min: the
  pre-activations); mu [H]; reset [B, T]; p0 [B, H, 1]; kd: K; data_dtype: the projections'
  dtype (picks softplus as the lane kernels do); params: the gain kernels' pallas_call options
  (interpret, compiler_params)."""
  nh, hp = om.shape[2], a.shape[2]
  if hp != nh:  # pad the heads to the row's width (any finite value: those lanes are dropped)
    pad = lambda x, axis: jnp.pad(
      x, [(0, hp - nh if i == axis else 0) for i in range(x.ndim)], constant_values=1
    )
    om, r, mu, p0, prod = pad(om, 2), pad(r, 2), pad(mu, 0), pad(p0, 1), pad(prod, 1)
  outs = _call(
    a,
    kk,
    om,
    r,
    mu,
    reset,
    p0,
    prod,
    chunk=chunk,
    kd=kd,
    save_pprev=save_pprev,
    front=front,
    data_dtype=data_dtype,
    gain_dtype=gain_dtype,
    segmented=segmented,
    params=params,
  )
  if hp != nh:
    outs = tuple(None if x is None else x[:, :nh] if x.ndim == 3 else x[:, :, :nh] for x in outs)
  return outs


def _call(
  a,
  kk,
  om,
  r,
  mu,
  reset,
  p0,
  prod,
  *,
  chunk,
  kd,
  save_pprev,
  front,
  data_dtype,
  gain_dtype,
  segmented,
  params,
):
  bsz, t, nh = a.shape
  nc = t // chunk
  lane = jax.ShapeDtypeStruct((bsz, t, nh, 1), jnp.float32)
  out_shape = (
    (jax.ShapeDtypeStruct(lane.shape, gain_dtype),)
    + ((lane,) if save_pprev else ())
    + (jax.ShapeDtypeStruct((bsz, nh, 1), jnp.float32),)
  )
  outs = pl.pallas_call(
    functools.partial(
      _kernel,
      chunk=chunk,
      num_chunks=nc,
      kd=kd,
      save_pprev=save_pprev,
      front=front,
      data_dtype=data_dtype,
      segmented=segmented,
    ),
    out_shape=out_shape,
    grid=(bsz, nc),
    name="kdn_gain_iso_replay",
    **params,
  )(a, kk, om, r, mu, reset, p0, prod)
  return (outs[0], outs[1], outs[2]) if save_pprev else (outs[0], None, outs[1])
