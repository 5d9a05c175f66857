"""The fused decode step (one token) for the delta-rule and KDN families: decay, Kalman gain
(variance step), erase / write and read in one pass over the state, updated in place.

  delta_rule_step(q, k, v, log_alpha, write, memory, scale)          write [B,H,K], or beta [B,H]
  kdn_step(q, k, v, log_alpha, omega, r, info_scale, memory, variance, scale, *, diag)
Forward only (decoding); kdn_jax.ops' `*_step` with impl='pallas' call these, the XLA steps are
their reference. Triton / interpret mode only (not the TPU kernels).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import common, tpu_common, tuned
from pallas_kernels.decode import kernel as _kernel

__all__ = ["delta_rule_step", "kdn_step"]


def _setup(op, k, v, memory, interpret, config):
  interpret = common.resolve_interpret(interpret)
  if tpu_common.use_tpu_kernels(interpret):
    raise NotImplementedError(
      f"{op}: the fused decode step has no TPU kernel; use impl='reference'"
    )
  kd, vd = k.shape[-1], v.shape[-1]
  common.check_width("K", kd)
  common.check_width("V", vd)
  if memory.shape != k.shape + (vd,):
    raise ValueError(
      f"{op}: memory has shape {tuple(memory.shape)}; expected "
      f"{tuple(k.shape) + (vd,)} ([B, H, K, V] from k and v)"
    )
  return interpret, tuned.config("decode", config, interpret)


def delta_rule_step(q, k, v, log_alpha, write, memory, scale, *, interpret=None, config=None):
  """S' = (I - w k^T) D S + w v^T,  o = scale S'^T q, one token.

  q, k: [B,H,K]; v: [B,H,V]; log_alpha: [B,H,K] or [B,H]; write: [B,H,K], or [B,H] (beta: w =
  beta k); memory: [B,H,K,V] (its buffer is reused for S' under jit with donation). Returns
  (o [B,H,V] in q's dtype, S' f32)."""
  interpret, cfg = _setup("decode.delta_rule_step", k, v, memory, interpret, config)
  kind = "beta" if write.ndim == 2 else "write"
  o, s = _kernel.decode_step(
    kind,
    q,
    k,
    v,
    log_alpha,
    (write,),
    memory.astype(jnp.float32),
    scale=scale,
    interpret=interpret,
    cfg=cfg,
  )
  return o, s


def kdn_step(
  q,
  k,
  v,
  log_alpha,
  omega,
  r,
  info_scale,
  memory,
  variance,
  scale,
  *,
  diag,
  interpret=None,
  config=None,
):
  """One token of the diagonal (diag=True) or isotropic KDN: the variance step's gain feeds the
  delta rule's write. omega: [B,H,K] (iso [B,H]); r: [B,H]; info_scale: [H] or a float;
  variance: [B,H,K] (iso [B,H]). Returns (o, S', new variance), the last two f32."""
  interpret, cfg = _setup("decode.kdn_step", k, v, memory, interpret, config)
  mu = jnp.broadcast_to(jnp.asarray(info_scale, jnp.float32), (k.shape[1],))
  gain = (omega, r, mu, variance.astype(jnp.float32))
  return _kernel.decode_step(
    "diag" if diag else "iso",
    q,
    k,
    v,
    log_alpha,
    gain,
    memory.astype(jnp.float32),
    scale=scale,
    interpret=interpret,
    cfg=cfg,
  )
