"""The fused decode step: one token of the delta-rule family, and of the KDN family with its
Kalman gain, in one pass over the state (forward only; the reference is kdn_jax.ops' `*_step`).

Grid (B, H, V / block_v). Each program owns a [K, block_v] column block of one head's state S and
is the only program that reads or writes it: the erase term S^T k is per value column, so the V
split is exact. It loads its state block first (the one long-latency read; the gain math below
runs while it is in flight), reads its head's q, k, v block, decay and gain inputs, forms the
write direction w (given; beta k; or the KDN gain from the variance: diag
p_hat = alpha^2 p + omega, w = p_hat k / (r + sum p_hat k^2), p' = p_hat / (1 + mu k^2 p_hat / r);
iso the same with one variance per head, mean alpha^2 and mu |k|^2 / K), then
    S_hat = D S,  delta = v - S_hat^T k,  S' = S_hat + w delta^T,
    o = scale S'^T q = scale (S_hat^T q + (w . q) delta),
the two reductions over K both read S_hat, so neither waits on the other or on the update, and
writes S' over S (the caller aliases them) and o. The gain is recomputed by every V block of a
head (O(K) against the block's O(K block_v)); only block 0 writes the new variance, into its own
output (reading and writing one aliased variance across programs would race). Arithmetic in the
state's dtype: float32, or float64 under x64 (interpret mode).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import common

KINDS = ("write", "beta", "diag", "iso")


def _names(kind):
  gain = {
    "write": ["w"],
    "beta": ["beta"],
    "diag": ["om", "r", "mu", "p"],
    "iso": ["om", "r", "mu", "p"],
  }[kind]
  return ["q", "k", "v", "la"] + gain + ["s"]


def _kernel(*refs, kind, scalar_decay, block_v, scale, key_dim):
  names = _names(kind)
  r = dict(zip(names, refs[: len(names)]))
  outs = refs[len(names) :]
  o_ref, s_out = outs[0], outs[1]
  b, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  vs = pl.ds(vb * block_v, block_v)
  acc = s_out.dtype
  s = r["s"][b, h, :, vs].astype(acc)  # [K, block_v], issued before the gain math
  k = r["k"][b, h, :].astype(acc)  # [K]
  q = r["q"][b, h, :].astype(acc)
  v = r["v"][b, h, vs].astype(acc)
  la = r["la"][b, h].astype(acc) if scalar_decay else r["la"][b, h, :].astype(acc)
  if kind == "write":
    w = r["w"][b, h, :].astype(acc)
  elif kind == "beta":
    w = r["beta"][b, h].astype(acc) * k
  else:
    rr = r["r"][b, h].astype(acc)
    mu = r["mu"][h].astype(acc)
    if kind == "diag":
      p_hat = jnp.exp(2.0 * la) * r["p"][b, h, :].astype(acc) + r["om"][b, h, :].astype(acc)
      k2 = k * k
      w = p_hat * k / (rr + jnp.sum(p_hat * k2))
      p_new = p_hat / (1.0 + (mu * k2 / rr) * p_hat)
    else:
      decay2 = jnp.exp(2.0 * la) if scalar_decay else jnp.mean(jnp.exp(2.0 * la))
      b_hat = decay2 * r["p"][b, h].astype(acc) + r["om"][b, h].astype(acc)
      k2 = jnp.sum(k * k)
      w = (b_hat / (rr + b_hat * k2)) * k
      p_new = b_hat / (1.0 + (mu * k2 / (key_dim * rr)) * b_hat)

    @pl.when(vb == 0)
    def _():
      if kind == "diag":
        outs[2][b, h, :] = p_new.astype(outs[2].dtype)
      else:
        outs[2][b, h] = p_new.astype(outs[2].dtype)

  alpha = jnp.exp(la)
  wq = jnp.sum(w * q)
  s = alpha * s if scalar_decay else alpha[:, None] * s
  delta = v - jnp.sum(s * k[:, None], axis=0)
  read = jnp.sum(s * q[:, None], axis=0)
  s_out[b, h, :, vs] = s + w[:, None] * delta[None, :]
  o_ref[b, h, vs] = (scale * (read + wq * delta)).astype(o_ref.dtype)


def decode_step(kind, q, k, v, la, gain, memory, *, scale, interpret, cfg):
  """One fused step. gain: (w,) / (beta,) / (omega, r, mu, variance) by kind; memory in the
  arithmetic dtype (float32, or float64 under x64). Returns (o [B, H, V] in q's dtype, S'
  [B, H, K, V] written over memory's buffer, and for the KDN kinds the new variance), the states
  in memory's dtype."""
  bsz, nh, kd = k.shape
  vd = v.shape[-1]
  block_v = min(cfg.block_v, vd)
  args = [q, k, v, la, *gain, memory]
  out_shape = [
    jax.ShapeDtypeStruct((bsz, nh, vd), q.dtype),
    jax.ShapeDtypeStruct(memory.shape, memory.dtype),
  ]
  if kind in ("diag", "iso"):
    out_shape.append(jax.ShapeDtypeStruct(gain[3].shape, memory.dtype))
  return pl.pallas_call(
    functools.partial(
      _kernel, kind=kind, scalar_decay=la.ndim == 2, block_v=block_v, scale=float(scale), key_dim=kd
    ),
    out_shape=tuple(out_shape),
    grid=(bsz, nh, vd // block_v),
    input_output_aliases={len(args) - 1: 1},
    name=f"decode_step_{kind}",
    interpret=interpret,
    compiler_params=common.compiler_params(cfg.num_warps, cfg.num_stages),
  )(*args)
