"""Sigmoid-gated RMSNorm (the recurrent mixers' output norm) as Pallas kernels with a custom VJP.
The reference is kdn_jax.layers.gated_norm.GatedRMSNorm (its plain-JAX composition)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import common, tuned
from pallas_kernels import sharding as _sharding
from pallas_kernels.gated_norm import kernel as _kernel

__all__ = ["gated_rms_norm"]

_X, _W = (0, 2), (None, None)  # (batch, head) dims: o / g / dy [B,T,H,V]; w [V]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _norm(o, g, w, eps, interpret, cfg):
  body = lambda o, g, w: (_kernel.forward(o, g, w, eps=eps, interpret=interpret, cfg=cfg),)
  return _sharding.per_shard(body, (_X, _X, _W), (_X + (4,),), "gated_norm forward")(o, g, w)[0]


def _norm_fwd(o, g, w, eps, interpret, cfg):
  return _norm(o, g, w, eps, interpret, cfg), (o, g, w)


def _norm_bwd(eps, interpret, cfg, res, dy):
  o, g, w = res
  body = lambda o, g, w, dy: _kernel.backward(o, g, w, dy, eps=eps, interpret=interpret, cfg=cfg)
  do, dg, dw = _sharding.per_shard(
    body, (_X, _X, _W, _X), (_X + (4,), _X + (4,), _X + (4,)), "gated_norm backward"
  )(o, g, w, dy)
  # the weight is shared by batch, time and heads: its sum stays outside the shards
  return do, dg, dw.sum(axis=(0, 1, 2)).astype(w.dtype)


_norm.defvjp(_norm_fwd, _norm_bwd)


def gated_rms_norm(o, gate, weight, eps, *, interpret=None, config=None):
  """RMSNorm(o) * weight * sigmoid(gate) over the last dim, computed in fp32.

  o, gate: [B,T,H,V]; weight: [V]; eps: a float. Returns [B,T,H,V] in o's dtype. config: a
  NormConfig (static); None: the tuned one for the device (pallas_kernels/tuned.py).
  """
  interpret = common.resolve_interpret(interpret)
  bsz, t, nh, vd = o.shape
  if gate.shape != o.shape:
    raise ValueError(
      f"gated_rms_norm: gate has shape {tuple(gate.shape)}; expected {tuple(o.shape)} (o's)"
    )
  if weight.shape != (vd,):
    raise ValueError(f"gated_rms_norm: weight has shape {tuple(weight.shape)}; expected ({vd},)")
  cfg = tuned.config("norm", config, interpret)
  cfg = dataclasses.replace(cfg, block_t=min(cfg.block_t, max(16, common.next_pow2(t))))
  t_pad = -(-t // cfg.block_t) * cfg.block_t
  y = _norm(
    common.pad_time(o, t_pad), common.pad_time(gate, t_pad), weight, float(eps), interpret, cfg
  )
  return y[:, :t]
