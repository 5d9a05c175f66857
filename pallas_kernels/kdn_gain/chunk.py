"""The KDN gain ops (diagonal and isotropic, from the gates or with the gate front-end fused in)
as one custom VJP over the kernels: forward in chunk_fwd.py, backward in chunk_bwd.py."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import common, tuned
from pallas_kernels.kdn_gain import chunk_bwd, chunk_fwd, inputs


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7, 8, 9))
def _gain(raw, reset, p0, diag, chunk, interpret, cfg, front, gain_dtype, segmented):
  """(gain, log_alpha (with a front, else None), p_final) from the raw inputs (kernel.py), time
  already padded to the chunk; segmented: whether any token but the first resets (kernel.py,
  UNSEGMENTED)."""
  # Not differentiated: p_prev (the backward's residual) is not written.
  static = (diag, chunk, interpret, cfg, front, gain_dtype, segmented)
  gain, la, _, pfin = chunk_fwd.forward(raw, reset, p0, *static, save_pprev=False)
  return gain, la, pfin


def _gain_fwd(raw, reset, p0, diag, chunk, interpret, cfg, front, gain_dtype, segmented):
  static = (diag, chunk, interpret, cfg, front, gain_dtype, segmented)
  gain, la, pprev, pfin = chunk_fwd.forward(raw, reset, p0, *static, save_pprev=True)
  return (gain, la, pfin), (raw, reset, pprev)


def _gain_bwd(diag, chunk, interpret, cfg, front, gain_dtype, segmented, res, cts):
  del gain_dtype
  raw, reset, pprev = res
  dgain, dla, dpfin = cts
  static = (diag, chunk, interpret, cfg, front, segmented)
  d_raw, dp0 = chunk_bwd.backward(raw, reset, pprev, dgain, dla, dpfin, *static)
  return d_raw, None, dp0


_gain.defvjp(_gain_fwd, _gain_bwd)


def _run(
  diag, k, gate, info_scale, p0, segment_ids, chunk_size, interpret, gain_dtype, config, r_min=None
):
  """The gain over [B, T] (the checks, padding and chunking around _gain): gate as
  inputs.check_gate's, with the gate front-end when it holds the five pre-activations (r_min: a
  float > 0)."""
  interpret = common.resolve_interpret(interpret)
  cfg = tuned.config("gain", config, interpret)
  bsz, t = k.shape[:2]
  front = len(gate) == 5
  op = ("diag_gain" if diag else "iso_gain") + ("_fused" if front else "")
  inputs.check_gate(op, diag, front, k, gate, p0)
  common.check_chunk_width(op, "K", k.shape[-1])
  if front and not r_min > 0:
    raise ValueError(f"{op}: r_min must be > 0, got {r_min}")
  gain_dtype = inputs.gain_dtype(gain_dtype)
  chunk, t_pad, reset = inputs.chunking(t, chunk_size, bsz, segment_ids, cfg)
  k, gate, mu, p0 = inputs.kernel_inputs(k, gate, info_scale, p0, t_pad, diag, front)
  front = float(r_min) if front else None
  static = (diag, chunk, interpret, cfg, front, gain_dtype, segment_ids is not None)
  gain, la, pfin = _gain((k, *gate, mu), reset, p0, *static)
  gain = gain[:, :t] if diag else gain[:, :t, :, 0]
  pfin = pfin if diag else pfin[..., 0]
  return (gain, pfin) if la is None else (gain, la[:, :t], pfin)


def diag_gain(
  k,
  log_alpha,
  omega,
  r,
  info_scale,
  p0,
  segment_ids=None,
  *,
  chunk_size=256,
  interpret=None,
  gain_dtype=jnp.float32,
  config=None,
):
  """Diagonal KDN gain. k, log_alpha, omega: [B,T,H,K]; r: [B,T,H]; info_scale: [H]; p0: [B,H,K].

  Returns (kappa [B,T,H,K] in gain_dtype (float32, or bfloat16: the kernel stores it rounded,
  for a delta rule whose dots round it so: pallas_kernels.write_dtype), p_final [B,H,K] float32).
  config: a GainConfig (static); None: the tuned one for the device (pallas_kernels/tuned.py),
  likewise in iso_gain and the fused variants.
  """
  gate = (log_alpha, omega, r)
  return _run(True, k, gate, info_scale, p0, segment_ids, chunk_size, interpret, gain_dtype, config)


def iso_gain(
  k,
  log_alpha,
  omega,
  r,
  info_scale,
  b0,
  segment_ids=None,
  *,
  chunk_size=256,
  interpret=None,
  config=None,
):
  """Isotropic KDN gain. k, log_alpha: [B,T,H,K]; omega, r: [B,T,H]; info_scale: [H]; b0: [B,H].

  Returns (beta [B,T,H] float32, b_final [B,H] float32).
  """
  gate = (log_alpha, omega, r)
  return _run(
    False, k, gate, info_scale, b0, segment_ids, chunk_size, interpret, jnp.float32, config
  )


def diag_gain_fused(
  k,
  f,
  dt_bias,
  a_log,
  omega_raw,
  r_raw,
  r_min,
  info_scale,
  p0,
  segment_ids=None,
  *,
  chunk_size=256,
  interpret=None,
  gain_dtype=jnp.float32,
  config=None,
):
  """Diagonal KDN gain from the gate projections before their activations:
  log_alpha = -exp(a_log) softplus(f + dt_bias), omega = softplus(omega_raw),
  r = r_min + softplus(r_raw), applied inside the kernels.

  k, f, omega_raw: [B,T,H,K]; dt_bias [H,K]; a_log [H]; r_raw [B,T,H]; r_min a float > 0;
  info_scale [H] or a float; p0 [B,H,K]. Gradients flow to all but r_min.
  Returns (kappa [B,T,H,K] in gain_dtype (float32 or bfloat16), log_alpha [B,T,H,K] f32,
  p_final [B,H,K] f32).
  """
  gate = (f, dt_bias, a_log, omega_raw, r_raw)
  args = (info_scale, p0, segment_ids, chunk_size, interpret, gain_dtype, config)
  return _run(True, k, gate, *args, r_min=r_min)


def iso_gain_fused(
  k,
  f,
  dt_bias,
  a_log,
  omega_raw,
  r_raw,
  r_min,
  info_scale,
  b0,
  segment_ids=None,
  *,
  chunk_size=256,
  interpret=None,
  config=None,
):
  """Isotropic KDN gain from the gate projections (like diag_gain_fused; omega_raw [B,T,H],
  b0 [B,H]). Returns (beta [B,T,H] f32, log_alpha [B,T,H,K] f32, b_final [B,H] f32)."""
  gate = (f, dt_bias, a_log, omega_raw, r_raw)
  args = (info_scale, b0, segment_ids, chunk_size, interpret, jnp.float32, config)
  return _run(False, k, gate, *args, r_min=r_min)
