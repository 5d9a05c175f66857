"""KDN gain (diagonal and isotropic) as Pallas kernels with a custom VJP."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import common
from pallas_kernels.kdn_gain import config as _config
from pallas_kernels.kdn_gain import kernel as _kernel

__all__ = ["diag_gain", "iso_gain", "gain_lanes"]


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10))
def gain_lanes(kx, kk, a, om, u, r, reset, p0, chunk, interpret, cfg):
  """Generic lane recurrence (see kernel.py). All float32, time already padded to the chunk."""
  gain, _, pfin = _kernel.gain_forward(kx, kk, a, om, u, r, reset, p0, chunk=chunk,
                                       interpret=interpret, cfg=cfg)
  return gain, pfin


def _gain_fwd(kx, kk, a, om, u, r, reset, p0, chunk, interpret, cfg):
  gain, pprev, pfin = _kernel.gain_forward(kx, kk, a, om, u, r, reset, p0, chunk=chunk,
                                           interpret=interpret, cfg=cfg)
  return (gain, pfin), (kx, kk, a, om, u, r, reset, pprev)


def _gain_bwd(chunk, interpret, cfg, res, cts):
  kx, kk, a, om, u, r, reset, pprev = res
  dgain, dpfin = cts
  dkx, dkk, da, dom, du, dr, dp0 = _kernel.gain_backward(
      kx, kk, a, om, u, r, reset, pprev, dgain.astype(jnp.float32),
      dpfin.astype(jnp.float32), chunk=chunk, interpret=interpret, cfg=cfg)
  return dkx, dkk, da, dom, du, dr, None, dp0


gain_lanes.defvjp(_gain_fwd, _gain_bwd)


def _prep(t, chunk_size, batch, segment_ids):
  chunk = min(chunk_size, _config.DEFAULT.max_chunk, max(16, 1 << (t - 1).bit_length()))
  t_pad = -(-t // chunk) * chunk
  reset = common.reset_flags(segment_ids, batch, t, t_pad)
  return chunk, t_pad, reset


def diag_gain(k, log_alpha, omega, r, info_scale, p0, segment_ids=None, *, chunk_size=256,
              interpret=None):
  """Diagonal KDN gain. k, log_alpha, omega: [B,T,H,K]; r: [B,T,H]; info_scale: [H]; p0: [B,H,K].

  Returns (kappa [B,T,H,K] float32, p_final [B,H,K] float32).
  """
  interpret = common.resolve_interpret(interpret)
  bsz, t, nh, kd = k.shape
  chunk, t_pad, reset = _prep(t, chunk_size, bsz, segment_ids)
  f32 = jnp.float32
  k = common.pad_time(k.astype(f32), t_pad)
  la = common.pad_time(log_alpha.astype(f32), t_pad)
  om = common.pad_time(omega.astype(f32), t_pad)
  rr = common.pad_time(r.astype(f32), t_pad, 1.0)
  mu = jnp.broadcast_to(jnp.asarray(info_scale, f32), (nh,)).reshape(1, 1, nh, 1)
  kk = k * k
  u = mu * kk / rr[..., None]
  a = jnp.exp(2.0 * la)
  cfg = _config.DEFAULT
  kappa, pfin = gain_lanes(k, kk, a, om, u, rr, reset, p0.astype(f32), chunk, interpret, cfg)
  return kappa[:, :t], pfin


def iso_gain(k, log_alpha, omega, r, info_scale, b0, segment_ids=None, *, chunk_size=256,
             interpret=None):
  """Isotropic KDN gain. k, log_alpha: [B,T,H,K]; omega, r: [B,T,H]; info_scale: [H]; b0: [B,H].

  Returns (beta [B,T,H] float32, b_final [B,H] float32).
  """
  interpret = common.resolve_interpret(interpret)
  bsz, t, nh, kd = k.shape
  chunk, t_pad, reset = _prep(t, chunk_size, bsz, segment_ids)
  f32 = jnp.float32
  k = common.pad_time(k.astype(f32), t_pad)
  la = common.pad_time(log_alpha.astype(f32), t_pad)
  om = common.pad_time(omega.astype(f32), t_pad)[..., None]
  rr = common.pad_time(r.astype(f32), t_pad, 1.0)
  mu = jnp.broadcast_to(jnp.asarray(info_scale, f32), (nh,)).reshape(1, 1, nh, 1)
  kk = jnp.sum(k * k, axis=-1, keepdims=True)
  a = jnp.mean(jnp.exp(2.0 * la), axis=-1, keepdims=True)
  u = mu * kk / (kd * rr[..., None])
  kx = jnp.ones_like(kk)
  cfg = _config.DEFAULT
  beta, bfin = gain_lanes(kx, kk, a, om, u, rr, reset, b0.astype(f32)[..., None], chunk,
                          interpret, cfg)
  return beta[:, :t, :, 0], bfin[..., 0]
