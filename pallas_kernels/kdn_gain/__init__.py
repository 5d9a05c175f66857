"""KDN gain (diagonal and isotropic) as Pallas kernels with a custom VJP."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import common, tpu_common, tuned
from pallas_kernels import sharding as _sharding
from pallas_kernels.kdn_gain import kernel as _kernel
from pallas_kernels.kdn_gain import tpu as _tpu


def _kernels(interpret):
  """The Mosaic-TPU kernels on TPU (and in TPU interpret mode), else the Triton/generic ones."""
  return _tpu if tpu_common.use_tpu_kernels(interpret) else _kernel


__all__ = ["diag_gain", "iso_gain", "diag_gain_fused", "iso_gain_fused", "PAD_PREACT"]


# (batch, head) dims for sharding.per_shard: k, log_alpha, omega, r, per-token gains and
# gradients [B,T,H,...]; mu [H]; reset [B,T]; p0 / p_final [B,H,L]. Results: (batch, head, ndim).
_BTH, _MU, _BT, _BH = (0, 2), (None, 0), (0, None), (0, 1)
_RAW = (_BTH, _BTH, _BTH, _BTH, _MU)
_LANES, _PER_TOKEN, _P = _BTH + (4,), _BTH + (3,), _BH + (3,)


def _forward(raw, reset, p0, diag, chunk, interpret, cfg, save_pprev, gain_dtype, segmented):
  tpu = tpu_common.use_tpu_kernels(interpret)

  def body(k, la, om, r, mu, reset, p0):
    # (the TPU kernels always read the reset flags)
    kw = {} if tpu else dict(gain_dtype=gain_dtype, segmented=segmented)
    return _kernels(interpret).gain_forward(
      (k, la, om, r, mu),
      reset,
      p0,
      diag=diag,
      chunk=chunk,
      interpret=interpret,
      cfg=cfg,
      save_pprev=save_pprev,
      **kw,
    )[:3]

  outs = (_LANES, _LANES if save_pprev else None, _P)
  shard = tpu_common.per_shard(interpret, body, _RAW + (_BT, _BH), outs, "kdn_gain forward")
  gain, pprev, pfin = shard(*raw, reset, p0)
  return gain.astype(gain_dtype), pprev, pfin  # (the TPU kernels write fp32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10, 11, 12))
def _gain(k, la, om, r, mu, reset, p0, diag, chunk, interpret, cfg, gain_dtype, segmented):
  """The gain recurrence from the raw inputs (kernel.py), time already padded to the chunk;
  segmented: whether any token but the first resets (kernel.py, UNSEGMENTED)."""
  # Not differentiated: p_prev (the backward's residual) is not written.
  gain, _, pfin = _forward(
    (k, la, om, r, mu), reset, p0, diag, chunk, interpret, cfg, False, gain_dtype, segmented
  )
  return gain, pfin


def _gain_fwd(k, la, om, r, mu, reset, p0, diag, chunk, interpret, cfg, gain_dtype, segmented):
  raw = (k, la, om, r, mu)
  gain, pprev, pfin = _forward(
    raw, reset, p0, diag, chunk, interpret, cfg, True, gain_dtype, segmented
  )
  return (gain, pfin), (raw, reset, pprev)


def _gain_bwd(diag, chunk, interpret, cfg, gain_dtype, segmented, res, cts):
  del gain_dtype
  raw, reset, pprev = res
  dgain, dpfin = cts

  # (the Triton kernels store k's gradient in k's dtype, the TPU ones in fp32: cast below)
  kw = (
    {}
    if tpu_common.use_tpu_kernels(interpret)
    else dict(dk_dtype=raw[0].dtype, segmented=segmented)
  )

  def body(k, la, om, r, mu, reset, pprev, dgain, dpfin):
    d_raw, dp0 = _kernels(interpret).gain_backward(
      (k, la, om, r, mu),
      reset,
      pprev,
      dgain,
      dpfin,
      diag=diag,
      chunk=chunk,
      interpret=interpret,
      cfg=cfg,
      **kw,
    )
    return tuple(d_raw) + (dp0,)

  dk, dla, dom, dr, dmu, dp0 = tpu_common.per_shard(
    interpret,
    body,
    _RAW + (_BT, _BTH, _BTH, _BH),
    (_LANES, _LANES, _BTH + (raw[2].ndim,), _PER_TOKEN, _PER_TOKEN, _P),
    "kdn_gain backward",
  )(*raw, reset, pprev, dgain.astype(jnp.float32), dpfin.astype(jnp.float32))
  # mu's gradient per token ([B,T,H]) is summed here, outside the shards.
  return (
    dk.astype(raw[0].dtype),
    dla.astype(raw[1].dtype),
    dom.astype(raw[2].dtype),
    dr.astype(raw[3].dtype),
    dmu.sum(axis=(0, 1)),
    None,
    dp0,
  )


_gain.defvjp(_gain_fwd, _gain_bwd)


# ------------------------------------------------------------------------------------------
# The gain with the gate front-end fused in (kernel.py, `front`): it reads the layer's gate
# projections before their activations and emits log_alpha for the delta rule.

# Padded tokens must leave the variance unchanged (alpha = 1, omega = 0, k = 0): a very negative
# pre-activation has softplus 0 in fp32 (exp underflows) and sigmoid 0, so f and omega_raw are
# padded with it; r_raw pads with 0 (any finite r > 0 will do when k = 0).
PAD_PREACT = -1e4
# dims for per_shard: k, f, dt_bias [H,K], A_log [H], omega_raw, r_raw, mu [H]
_RAW_FRONT = (_BTH, _BTH, _MU, _MU, _BTH, _BTH, _MU)


def _front_forward(
  raw, reset, p0, diag, chunk, interpret, cfg, save_pprev, r_min, gain_dtype, segmented
):
  def body(k, f, dtb, alog, om, r, mu, reset, p0):
    gain, pprev, pfin, la = _kernel.gain_forward(
      (k, f, dtb, alog, om, r, mu),
      reset,
      p0,
      diag=diag,
      chunk=chunk,
      interpret=interpret,
      cfg=cfg,
      save_pprev=save_pprev,
      front=r_min,
      gain_dtype=gain_dtype,
      segmented=segmented,
    )
    return gain, la, pprev, pfin

  outs = (_LANES, _LANES, _LANES if save_pprev else None, _P)
  return _sharding.per_shard(body, _RAW_FRONT + (_BT, _BH), outs, "kdn_gain_fused forward")(
    *raw, reset, p0
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10, 11, 12, 13, 14, 15))
def _gain_front(
  k, f, dtb, alog, om, r, mu, reset, p0, diag, chunk, interpret, cfg, r_min, gain_dtype, segmented
):
  """(gain, log_alpha, p_final) from the pre-activations, time already padded to the chunk."""
  gain, la, _, pfin = _front_forward(
    (k, f, dtb, alog, om, r, mu),
    reset,
    p0,
    diag,
    chunk,
    interpret,
    cfg,
    False,
    r_min,
    gain_dtype,
    segmented,
  )
  return gain, la, pfin


def _gain_front_fwd(
  k, f, dtb, alog, om, r, mu, reset, p0, diag, chunk, interpret, cfg, r_min, gain_dtype, segmented
):
  raw = (k, f, dtb, alog, om, r, mu)
  gain, la, pprev, pfin = _front_forward(
    raw, reset, p0, diag, chunk, interpret, cfg, True, r_min, gain_dtype, segmented
  )
  return (gain, la, pfin), (raw, reset, pprev)


def _gain_front_bwd(diag, chunk, interpret, cfg, r_min, gain_dtype, segmented, res, cts):
  del gain_dtype
  raw, reset, pprev = res
  dgain, dla, dpfin = cts

  def body(k, f, dtb, alog, om, r, mu, reset, pprev, dgain, dpfin, dla):
    d_raw, dp0, ddt, dalog = _kernel.gain_backward(
      (k, f, dtb, alog, om, r, mu),
      reset,
      pprev,
      dgain,
      dpfin,
      diag=diag,
      chunk=chunk,
      interpret=interpret,
      cfg=cfg,
      front=r_min,
      dla_out=dla,
      dk_dtype=k.dtype,
      segmented=segmented,
    )
    return tuple(d_raw) + (dp0, ddt, dalog)

  om_dims = _BTH + (raw[4].ndim,)
  dk, df, dom, dr, dmu, dp0, ddt, dalog = _sharding.per_shard(
    body,
    _RAW_FRONT + (_BT, _BTH, _BTH, _BH, _BTH),
    (_LANES, _LANES, om_dims, _PER_TOKEN, _PER_TOKEN, _P, _BH + (3,), _BH + (2,)),
    "kdn_gain_fused backward",
  )(
    *raw,
    reset,
    pprev,
    dgain.astype(jnp.float32),
    dpfin.astype(jnp.float32),
    dla.astype(jnp.float32),
  )
  # sums over batch (and heads' shares of mu) stay outside the shards
  k, f, dtb, alog = raw[:4]
  return (
    dk,
    df,
    ddt.sum(axis=0).astype(dtb.dtype),
    dalog.sum(axis=0).astype(alog.dtype),
    dom,
    dr,
    dmu.sum(axis=(0, 1)),
    None,
    dp0,
  )


_gain_front.defvjp(_gain_front_fwd, _gain_front_bwd)


def check_gate(op, diag, front, k, gate, p0):
  """The gate inputs' shapes against k [B, T, H, K] (a ValueError naming the argument): gate =
  (log_alpha, omega, r), or with a front (f, dt_bias, a_log, omega_raw, r_raw); p0 the initial
  variance (b0 for iso)."""
  bsz, t, nh, kd = k.shape
  lane = (bsz, t, nh, kd) if diag else (bsz, t, nh)
  if front:
    names = ("f", "dt_bias", "a_log", "omega_raw", "r_raw")
    wants = ((bsz, t, nh, kd), (nh, kd), (nh,), lane, (bsz, t, nh))
  else:
    names, wants = ("log_alpha", "omega", "r"), ((bsz, t, nh, kd), lane, (bsz, t, nh))
  names += ("p0" if diag else "b0",)
  wants += ((bsz, nh, kd) if diag else (bsz, nh),)
  for name, x, want in zip(names, tuple(gate) + (p0,), wants):
    if tuple(x.shape) != want:
      raise ValueError(
        f"{op}: {name} has shape {tuple(x.shape)}; expected {want} (from k {tuple(k.shape)})"
      )


def kernel_inputs(k, gate, info_scale, p0, t_pad, diag, front):
  """(k, gate, mu [H], p0 [B, H, lanes]) as the kernels take them: time padded to t_pad with
  values that leave the variance unchanged (k = 0; alpha = 1 and omega = 0 through PAD_PREACT
  or 0; any r > 0), mu and p0 in fp32."""
  nh = k.shape[2]
  k = common.pad_time(k, t_pad)
  if front:
    f, dtb, alog, om, rr = gate
    gate = (
      common.pad_time(f, t_pad, PAD_PREACT),
      dtb,
      alog,
      common.pad_time(om, t_pad, PAD_PREACT),
      common.pad_time(rr, t_pad),
    )
  else:
    la, om, r = gate
    gate = (common.pad_time(la, t_pad), common.pad_time(om, t_pad), common.pad_time(r, t_pad, 1.0))
  mu = jnp.broadcast_to(jnp.asarray(info_scale, jnp.float32), (nh,))
  p0 = p0.astype(jnp.float32)
  return k, gate, mu, (p0 if diag else p0[..., None])


def _run_fused(
  diag,
  k,
  f,
  dt_bias,
  a_log,
  omega_raw,
  r_raw,
  r_min,
  info_scale,
  p0,
  segment_ids,
  chunk_size,
  interpret,
  gain_dtype=jnp.float32,
  config=None,
):
  interpret = common.resolve_interpret(interpret)
  cfg = tuned.config("gain", config, interpret)
  bsz, t = k.shape[:2]
  op = "diag_gain_fused" if diag else "iso_gain_fused"
  gate = (f, dt_bias, a_log, omega_raw, r_raw)
  check_gate(op, diag, True, k, gate, p0)
  if not r_min > 0:
    raise ValueError(f"{op}: r_min must be > 0, got {r_min}")
  chunk, t_pad, reset = _prep(t, chunk_size, bsz, segment_ids, cfg)
  k, gate, mu, p0 = kernel_inputs(k, gate, info_scale, p0, t_pad, diag, True)
  gain, la, pfin = _gain_front(
    k,
    *gate,
    mu,
    reset,
    p0,
    diag,
    chunk,
    interpret,
    cfg,
    float(r_min),
    _gain_dtype(gain_dtype),
    segment_ids is not None,
  )
  return gain[:, :t], la[:, :t], pfin


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
  return _run_fused(
    True,
    k,
    f,
    dt_bias,
    a_log,
    omega_raw,
    r_raw,
    r_min,
    info_scale,
    p0,
    segment_ids,
    chunk_size,
    interpret,
    gain_dtype,
    config,
  )


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
  beta, la, bfin = _run_fused(
    False,
    k,
    f,
    dt_bias,
    a_log,
    omega_raw,
    r_raw,
    r_min,
    info_scale,
    b0,
    segment_ids,
    chunk_size,
    interpret,
    config=config,
  )
  return beta[..., 0], la, bfin[..., 0]


def gain_chunk(t, chunk_size, cfg):
  """The gain kernels' chunk for T=t: chunk_size capped by cfg.max_chunk and by T's next power
  of two (16 at least). Not halved to fill the GPU at short T: that lost (docs/decisions.md,
  `min_programs`)."""
  return min(chunk_size, cfg.max_chunk, max(16, common.next_pow2(t)))


def _prep(t, chunk_size, batch, segment_ids, cfg):
  chunk = gain_chunk(t, chunk_size, cfg)
  t_pad = -(-t // chunk) * chunk
  reset = common.reset_flags(segment_ids, batch, t, t_pad)
  return chunk, t_pad, reset


def _gain_dtype(dtype):
  """The gain's storage dtype: float32 or bfloat16 (a ValueError otherwise)."""
  dtype = jnp.dtype(dtype)
  if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
    raise ValueError(f"gain_dtype must be float32 or bfloat16, got {dtype}")
  return dtype


def _run(
  diag,
  k,
  log_alpha,
  omega,
  r,
  info_scale,
  p0,
  segment_ids,
  chunk_size,
  interpret,
  gain_dtype=jnp.float32,
  config=None,
):
  interpret = common.resolve_interpret(interpret)
  cfg = tuned.config("gain", config, interpret)
  bsz, t = k.shape[:2]
  gate = (log_alpha, omega, r)
  check_gate("diag_gain" if diag else "iso_gain", diag, False, k, gate, p0)
  gain_dtype = _gain_dtype(gain_dtype)
  chunk, t_pad, reset = _prep(t, chunk_size, bsz, segment_ids, cfg)
  k, gate, mu, p0 = kernel_inputs(k, gate, info_scale, p0, t_pad, diag, False)
  return _gain(
    k,
    *gate,
    mu,
    reset,
    p0,
    diag,
    chunk,
    interpret,
    cfg,
    gain_dtype,
    segment_ids is not None,
  )


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
  t = k.shape[1]
  kappa, pfin = _run(
    True,
    k,
    log_alpha,
    omega,
    r,
    info_scale,
    p0,
    segment_ids,
    chunk_size,
    interpret,
    gain_dtype,
    config,
  )
  return kappa[:, :t], pfin


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
  t = k.shape[1]
  beta, bfin = _run(
    False, k, log_alpha, omega, r, info_scale, b0, segment_ids, chunk_size, interpret, config=config
  )
  return beta[:, :t, :, 0], bfin[..., 0]
