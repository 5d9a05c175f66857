"""Any head width on the Pallas kernels: K and V padded with zeros to a kernel width, V wider
than the widest one split into column tiles.

The kernels take K, V in pallas_kernels.common.CHUNK_WIDTHS (powers of two: Triton's arrays
must be). The ops run other widths on them with the same math:

- Delta rule: q, k, the write and a per-channel log_alpha padded with zeros (log_alpha 0) to
  the next kernel width, v and the initial state likewise. Zero k and write channels make the
  erase (I - w k^T) and the write w v^T leave the state's padded rows untouched, the decay only
  scales them, and they start at zero: they stay zero, and zero q channels read nothing from
  them. Padded value columns stay zero. Outputs and states are sliced back.
- V wider than the widest kernel width runs as independent column tiles: given k, the write and
  the decay, each value column of the state evolves on its own.
- Diag gain (docs/math.md section 2): a zero k channel has zero gain and gets no information;
  the denominator's channel sum gains nothing from it. Its variance (padded with 1) is cut off.
- Iso gain: a_t = mean_i alpha_i^2 and the information term mu |k|^2 / (K r) both divide by the
  true K. The padded channels get log alpha = (1/2) log a_t, so that their alpha^2 is the true
  mean and the mean over the padded width is a_t again, and mu is scaled by K_pad / K.

Gradients are autodiff's through the pads and slices, exact like the values.
"""

import jax
import jax.numpy as jnp


def kernel_width(n, widths):
  """The smallest kernel width >= n, or None when n is wider than all of them."""
  return next((w for w in sorted(widths) if w >= n), None)


def value_tiles(vd, widths):
  """The (start, width) column ranges V runs in: all of V when it fits the widest kernel width,
  else tiles of the widest width (the last one narrower)."""
  top = max(widths)
  return [(s, min(top, vd - s)) for s in range(0, vd, top)]


def pad_to(x, n, axis=-1, value=0.0):
  """x padded with `value` along `axis` to length n."""
  extra = n - x.shape[axis]
  if extra == 0:
    return x
  pads = [(0, 0)] * x.ndim
  pads[axis] = (0, extra)
  return jnp.pad(x, pads, constant_values=value)


def delta_rule(kernels, q, k, v, log_alpha, write, scale, memory0, segment_ids, **kwargs):
  """kernels.delta_rule (same arguments) at any K up to the widest kernel width and any V.

  write: [B, T, H, K] or a scalar beta [B, T, H]; log_alpha: [B, T, H, K] or [B, T, H].
  """
  widths = kernels.common.CHUNK_WIDTHS
  kd, vd = k.shape[-1], v.shape[-1]
  kp = kernel_width(kd, widths)
  q, k = pad_to(q, kp), pad_to(k, kp)
  write = pad_to(write, kp) if write.ndim == 4 else write
  log_alpha = pad_to(log_alpha, kp) if log_alpha.ndim == 4 else log_alpha
  memory0 = pad_to(memory0, kp, axis=-2)
  outs, states = [], []
  for start, width in value_tiles(vd, widths):
    vp = kernel_width(width, widths)
    cols = slice(start, start + width)
    o, s = kernels.delta_rule(
      q,
      k,
      pad_to(v[..., cols], vp),
      log_alpha,
      write,
      scale,
      pad_to(memory0[..., cols], vp),
      segment_ids,
      **kwargs,
    )
    outs.append(o[..., :width])
    states.append(s[..., :kd, :width])
  if len(outs) == 1:
    return outs[0], states[0]
  return jnp.concatenate(outs, axis=-1), jnp.concatenate(states, axis=-1)


def diag_gain(kernels, k, log_alpha, omega, r, mu, p0, segment_ids, **kwargs):
  """kernels.diag_gain at any K up to the widest kernel width: (kappa, p_final)."""
  kd = k.shape[-1]
  kp = kernel_width(kd, kernels.common.CHUNK_WIDTHS)
  kappa, p_final = kernels.diag_gain(
    pad_to(k, kp),
    pad_to(log_alpha, kp),
    pad_to(omega, kp),
    r,
    mu,
    pad_to(p0, kp, value=1.0),
    segment_ids,
    **kwargs,
  )
  return kappa[..., :kd], p_final[..., :kd]


def iso_gain(kernels, k, log_alpha, omega, r, mu, b0, segment_ids, **kwargs):
  """kernels.iso_gain at any K up to the widest kernel width: (beta [B, T, H], b_final)."""
  kd = k.shape[-1]
  kp = kernel_width(kd, kernels.common.CHUNK_WIDTHS)
  if kp != kd:
    # (fp32 at least: the kernels compute in fp32, and a 16-bit (1/2) log a_t would move a_t)
    la = log_alpha.astype(jnp.promote_types(log_alpha.dtype, jnp.float32))
    half_log_mean = 0.5 * (jax.nn.logsumexp(2.0 * la, axis=-1, keepdims=True) - jnp.log(kd))
    log_alpha = jnp.concatenate(
      [la, jnp.broadcast_to(half_log_mean, la.shape[:-1] + (kp - kd,))], axis=-1
    )
    k, mu = pad_to(k, kp), mu * (kp / kd)
  return kernels.iso_gain(k, log_alpha, omega, r, mu, b0, segment_ids, **kwargs)
