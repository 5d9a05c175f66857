"""The gain's backward: the kernels' reverse pass (kernel.py; tpu.py where the Mosaic-TPU kernels
run) per (batch, head) shard, then the sums over batch (and the heads' shares of mu) outside the
shards."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import sharding
from pallas_kernels.kdn_gain import kernel as _kernel
from pallas_kernels.kdn_gain import tpu as _tpu
from pallas_kernels.kdn_gain.chunk_fwd import (
  BH,
  BT,
  BTH,
  LANES,
  PER_TOKEN,
  P,
  on_tpu_kernels,
  raw_dims,
)


def backward(raw, reset, pprev, dgain, dla, dpfin, diag, chunk, interpret, cfg, front, segmented):
  """The raw inputs' gradients (a tuple like raw; mu's summed to [H]) and p0's, from the forward's
  residual p_prev and the cotangents of the gain, of log_alpha (with a front, else None) and of
  p_final."""
  tpu = on_tpu_kernels(interpret, front)
  n = len(raw)

  def body(*args):
    raw, (reset, pprev, dgain, dpfin, *dla) = args[:n], args[n:]
    if tpu:  # (fp32 gradients: cast below)
      kernels, kw = _tpu, {}
    else:
      dla_out = dla[0] if dla else None
      kw = dict(front=front, dla_out=dla_out, dk_dtype=raw[0].dtype, segmented=segmented)
      kernels = _kernel
    d_raw, *rest = kernels.gain_backward(
      raw, reset, pprev, dgain, dpfin, diag=diag, chunk=chunk, interpret=interpret, cfg=cfg, **kw
    )
    return tuple(d_raw) + tuple(rest)  # (+ dt_bias's and A_log's partial sums with a front)

  # The per-token gradients: k's, then log_alpha's or f's, omega's, r's, mu's ([B,T,H]).
  per_token = (0, 1, 2, 3) if front is None else (0, 1, 4, 5)
  omega_dims = BTH + (raw[per_token[2]].ndim,)
  outs = (LANES, LANES, omega_dims, PER_TOKEN, PER_TOKEN, P)
  ins = raw_dims(front) + (BT, BTH, BTH, BH)
  cts = (dgain.astype(jnp.float32), dpfin.astype(jnp.float32))
  if front is not None:  # dt_bias [B,H,K] and A_log [B,H] partial sums; log_alpha's cotangent
    outs += (BH + (3,), BH + (2,))
    ins += (BTH,)
    cts += (dla.astype(jnp.float32),)
  name = "kdn_gain backward" if front is None else "kdn_gain_fused backward"
  shard = body if tpu else sharding.per_shard(body, ins, outs, name)
  grads = shard(*raw, reset, pprev, *cts)
  d_raw = [None] * n
  for i, g in zip(per_token, grads[:4]):
    d_raw[i] = g.astype(raw[i].dtype)
  d_raw[-1] = grads[4].sum(axis=(0, 1))
  if front is not None:
    d_raw[2] = grads[6].sum(axis=0).astype(raw[2].dtype)
    d_raw[3] = grads[7].sum(axis=0).astype(raw[3].dtype)
  return tuple(d_raw), grads[5]
