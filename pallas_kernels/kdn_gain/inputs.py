"""The gain ops' inputs as the kernels take them: shapes checked (one error naming the argument),
time padded to whole chunks with values that leave the variance unchanged, mu and p0 in fp32."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import common

# Padded tokens must leave the variance unchanged (alpha = 1, omega = 0, k = 0): a very negative
# pre-activation has softplus 0 in fp32 (exp underflows) and sigmoid 0, so f and omega_raw are
# padded with it; r_raw pads with 0 (any finite r > 0 will do when k = 0).
PAD_PREACT = -1e4


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


def gain_chunk(t, chunk_size, cfg):
  """The gain kernels' chunk for T=t: chunk_size capped by cfg.max_chunk and by T's next power
  of two (16 at least). Not halved to fill the GPU at short T: that lost (docs/decisions.md,
  `min_programs`)."""
  return min(chunk_size, cfg.max_chunk, max(16, common.next_pow2(t)))


def chunking(t, chunk_size, batch, segment_ids, cfg):
  """(chunk, t padded to whole chunks, reset flags [B, t_pad])."""
  chunk = gain_chunk(t, chunk_size, cfg)
  t_pad = -(-t // chunk) * chunk
  reset = common.reset_flags(segment_ids, batch, t, t_pad)
  return chunk, t_pad, reset


def gain_dtype(dtype):
  """The gain's storage dtype: float32 or bfloat16 (a ValueError otherwise)."""
  dtype = jnp.dtype(dtype)
  if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
    raise ValueError(f"gain_dtype must be float32 or bfloat16, got {dtype}")
  return dtype
