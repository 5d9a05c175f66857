"""Pallas kernels of the sigmoid-gated RMSNorm over the value dim (per token and head):
    n = o / sqrt(mean(o^2) + eps),   y = n * w * sigmoid(g)          (w [V], shared by heads)
Grid (B, T / block_t, H): each program normalises one head's [block_t, V] tile in fp32.
Backward, per row (s = sigmoid(g), dn = dy * s * w):
    dg = dy * n * w * s * (1 - s),   do = (dn - n * mean(dn * n)) / sqrt(mean(o^2) + eps),
    dw = sum over rows of dy * s * n   (per-program partials, summed outside)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import common
from pallas_kernels.kernel_math import exp_for, sigmoid


def _tile(ref, b, i, h, block_t):
  return ref[b, pl.ds(i * block_t, block_t), h, :].astype(jnp.float32)


def _normed(o, eps):
  inv = lax.rsqrt(jnp.mean(o * o, axis=1, keepdims=True) + eps)
  return o * inv, inv


def _forward_kernel(o_ref, g_ref, w_ref, y_ref, *, eps, block_t):
  b, i, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  n, _ = _normed(_tile(o_ref, b, i, h, block_t), eps)
  w = w_ref[...].astype(jnp.float32)[None, :]
  y = n * w * sigmoid(_tile(g_ref, b, i, h, block_t), exp_for(o_ref.dtype))
  y_ref[b, pl.ds(i * block_t, block_t), h, :] = y.astype(y_ref.dtype)


def _backward_kernel(o_ref, g_ref, w_ref, dy_ref, do_ref, dg_ref, dw_ref, *, eps, block_t):
  b, i, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  n, inv = _normed(_tile(o_ref, b, i, h, block_t), eps)
  w = w_ref[...].astype(jnp.float32)[None, :]
  s = sigmoid(_tile(g_ref, b, i, h, block_t), exp_for(o_ref.dtype))
  dy = _tile(dy_ref, b, i, h, block_t)
  dys = dy * s
  dn = dys * w
  do = inv * (dn - n * jnp.mean(dn * n, axis=1, keepdims=True))
  rows = pl.ds(i * block_t, block_t)
  do_ref[b, rows, h, :] = do.astype(do_ref.dtype)
  dg_ref[b, rows, h, :] = (dn * n * (1.0 - s)).astype(dg_ref.dtype)
  dw_ref[b, i, h, :] = jnp.sum(dys * n, axis=0)


def _params(interpret, cfg):
  return dict(
    interpret=interpret, compiler_params=common.compiler_params(cfg.num_warps, cfg.num_stages)
  )


def forward(o, g, w, *, eps, interpret, cfg):
  """o, g [B,T,H,V] (T a multiple of cfg.block_t), w [V] -> y [B,T,H,V] in o's dtype."""
  bsz, t, nh, _ = o.shape
  return pl.pallas_call(
    functools.partial(_forward_kernel, eps=eps, block_t=cfg.block_t),
    out_shape=jax.ShapeDtypeStruct(o.shape, o.dtype),
    grid=(bsz, t // cfg.block_t, nh),
    name="gated_norm_fwd",
    **_params(interpret, cfg),
  )(o, g, w)


def backward(o, g, w, dy, *, eps, interpret, cfg):
  """-> (do o.dtype, dg g.dtype, dw partials [B, T/block_t, H, V] f32)."""
  bsz, t, nh, vd = o.shape
  nb = t // cfg.block_t
  return pl.pallas_call(
    functools.partial(_backward_kernel, eps=eps, block_t=cfg.block_t),
    out_shape=(
      jax.ShapeDtypeStruct(o.shape, o.dtype),
      jax.ShapeDtypeStruct(g.shape, g.dtype),
      jax.ShapeDtypeStruct((bsz, nb, nh, vd), jnp.float32),
    ),
    grid=(bsz, nb, nh),
    name="gated_norm_bwd",
    **_params(interpret, cfg),
  )(o, g, w, dy)
