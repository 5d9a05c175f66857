"""The fused decode step (one token) for the delta-rule and KDN families: decay, Kalman gain
(variance step), erase / write and read in one pass over the state, updated in place.

  delta_rule_step(q, k, v, log_alpha, write, memory, scale)          write [B,H,K], or beta [B,H]
  kdn_step(q, k, v, log_alpha, omega, r, info_scale, memory, variance, scale, *, diag)
Forward only (decoding); kdn_jax.ops' `*_step` with impl='pallas' call these, the XLA steps are
their reference. Triton / interpret mode only (not the TPU kernels). The states are computed in
float32 (float64 when any input is float64, under x64) and a state already in that dtype goes to
the kernel as is, so under jit with the state donated the step reads and writes it in place with
no other op touching it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import common, tpu_common, tuned
from pallas_kernels import sharding as _sharding
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


def _state_dtype(*arrays):
  """The kernel's arithmetic and state dtype: float64 if any input is float64, else float32."""
  wide = any(jnp.dtype(a.dtype) == jnp.float64 for a in arrays)
  return jnp.float64 if wide else jnp.float32


_BH = (0, 1)  # (batch, head) dims of a [B, H, ...] operand


def _run(kind, q, k, v, la, gain, gain_dims, memory, *, scale, interpret, cfg):
  """The kernel per (batch, head) shard under a sharded jit (every program reads one batch entry
  and head)."""
  body = lambda *a: _kernel.decode_step(
    kind, *a[:4], a[4:-1], a[-1], scale=scale, interpret=interpret, cfg=cfg
  )
  outs = [(0, 1, 3), (0, 1, 4)]
  if kind in ("diag", "iso"):
    outs.append((0, 1, gain[-1].ndim))
  ins = (_BH,) * 4 + tuple(gain_dims) + (_BH,)
  return _sharding.per_shard(body, ins, tuple(outs), f"decode step ({kind})")(
    q, k, v, la, *gain, memory
  )


def delta_rule_step(q, k, v, log_alpha, write, memory, scale, *, interpret=None, config=None):
  """S' = (I - w k^T) D S + w v^T,  o = scale S'^T q, one token.

  q, k: [B,H,K]; v: [B,H,V]; log_alpha: [B,H,K] or [B,H]; write: [B,H,K], or [B,H] (beta: w =
  beta k); memory: [B,H,K,V] (its buffer is reused for S' under jit with donation). Returns
  (o [B,H,V] in q's dtype, S' in the state dtype)."""
  interpret, cfg = _setup("decode.delta_rule_step", k, v, memory, interpret, config)
  kind = "beta" if write.ndim == 2 else "write"
  acc = _state_dtype(q, k, v, log_alpha, write, memory)
  o, s = _run(
    kind,
    q,
    k,
    v,
    log_alpha,
    (write,),
    (_BH,),
    memory.astype(acc),
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
  variance: [B,H,K] (iso [B,H]). Returns (o, S', new variance), the last two in the state dtype."""
  interpret, cfg = _setup("decode.kdn_step", k, v, memory, interpret, config)
  acc = _state_dtype(q, k, v, log_alpha, omega, r, memory, variance)
  mu = jnp.broadcast_to(jnp.asarray(info_scale, acc), (k.shape[1],))
  gain = (omega, r, mu, variance.astype(acc))
  return _run(
    "diag" if diag else "iso",
    q,
    k,
    v,
    log_alpha,
    gain,
    (_BH, _BH, (None, 0), _BH),
    memory.astype(acc),
    scale=scale,
    interpret=interpret,
    cfg=cfg,
  )
