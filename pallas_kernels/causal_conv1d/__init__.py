"""Causal depthwise conv1d (+ SiLU) with segment resets and a decode cache: Pallas kernels with a
custom VJP. The reference is kdn_jax.layers.short_conv.ShortConv (its plain-JAX composition)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import common, tuned
from pallas_kernels import sharding as _sharding
from pallas_kernels.causal_conv1d import kernel as _kernel

__all__ = ["causal_conv1d", "positions_in_segment", "L2_EPS"]

L2_EPS = _kernel.L2_EPS  # normalize=True: y / sqrt(|y|^2 + L2_EPS)

# (batch, head) dims for sharding.per_shard: x / dy / dx [B,T,H,K]; w [W,H,K];
# cache [B,W-1,H,K]; pos [B,T]; accumulators [B,NB,H,R,K].
_X, _W, _CACHE, _POS, _ACC = (0, 2), (None, 1), (0, 2), (0, None), (0, 2)


def positions_in_segment(segment_ids):
  """[B, T] int -> every token's position inside its (contiguous) segment."""
  t = jnp.arange(segment_ids.shape[1], dtype=jnp.int32)[None, :]
  prev = jnp.concatenate([segment_ids[:, :1], segment_ids[:, :-1]], axis=1)
  start = jax.lax.cummax(jnp.where((segment_ids != prev) | (t == 0), t, 0), axis=1)
  return t - start


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _conv(x, w, cache, pos, activation, normalize, interpret, cfg):
  body = lambda x, w, c, p: (
    _kernel.forward(
      x, w, c, p, activation=activation, normalize=normalize, interpret=interpret, cfg=cfg
    ),
  )
  return _sharding.per_shard(body, (_X, _W, _CACHE, _POS), (_X + (4,),), "causal_conv1d forward")(
    x, w, cache, pos
  )[0]


def _conv_fwd(x, w, cache, pos, activation, normalize, interpret, cfg):
  return _conv(x, w, cache, pos, activation, normalize, interpret, cfg), (x, w, cache, pos)


def _conv_bwd(activation, normalize, interpret, cfg, res, dy):
  x, w, cache, pos = res
  width = w.shape[0]
  body = lambda x, w, c, p, dy: _kernel.backward(
    x, w, c, p, dy, activation=activation, normalize=normalize, interpret=interpret, cfg=cfg
  )
  dx, acc = _sharding.per_shard(
    body, (_X, _W, _CACHE, _POS, _X), (_X + (4,), _ACC + (5,)), "causal_conv1d backward"
  )(x, w, cache, pos, dy)
  # row j of the accumulators is tap j, i.e. weight index W-1-j; sums over batch and blocks
  dw = jnp.flip(acc[:, :, :, :width].sum(axis=(0, 1)), axis=1)  # [H, W, K]
  dw = jnp.moveaxis(dw, 1, 0).astype(w.dtype)
  dcache = jnp.moveaxis(acc[:, :, :, width : 2 * width - 1].sum(axis=1), 2, 1)  # [B, W-1, H, K]
  # the layer rounds the cache to x's dtype before use: its gradient passes that cast
  dcache = dcache.astype(x.dtype).astype(cache.dtype)
  return dx, dw, dcache, None


_conv.defvjp(_conv_fwd, _conv_bwd)


def causal_conv1d(
  x,
  weight,
  cache,
  segment_ids=None,
  *,
  activation=True,
  normalize=False,
  interpret=None,
  config=None,
):
  """y_t = silu(sum_j weight[W-1-j] * x[t-j]) per channel (activation=False: no SiLU), the inputs
  before the sequence (and before every packed segment's start) taken from `cache`; normalize:
  then y_t / sqrt(|y_t|^2 + L2_EPS) over each head's K channels (of y_t rounded to x's dtype, in
  fp32, as ShortConv(normalize=True) composes it).

  x: [B,T,H,K]; weight: [W,H,K] (weight[W-1] on the current token); cache: [B,W-1,H,K], the W-1
  inputs before the sequence, oldest first (rounded to x's dtype, as the layer does);
  segment_ids: [B,T] or None. Returns y [B,T,H,K] in x's dtype (fp32 sums inside). Gradients
  flow to x, weight and cache. The new decode cache is the caller's (ShortConv computes it).
  config: a ConvConfig (static); None: the tuned one for the device (pallas_kernels/tuned.py).
  """
  interpret = common.resolve_interpret(interpret)
  bsz, t, nh, kd = x.shape
  width = weight.shape[0]
  if weight.shape != (width, nh, kd):
    raise ValueError(
      f"causal_conv1d: weight has shape {tuple(weight.shape)}; expected "
      f"({width}, {nh}, {kd}) (from x {tuple(x.shape)})"
    )
  if cache.shape != (bsz, width - 1, nh, kd):
    raise ValueError(
      f"causal_conv1d: cache has shape {tuple(cache.shape)}; expected {(bsz, width - 1, nh, kd)}"
    )
  if width < 2:
    raise NotImplementedError(
      "causal_conv1d: width 1 is a pointwise scale; use the layer's plain-JAX path"
    )
  cfg = tuned.config("conv", config, interpret)
  block_t = min(cfg.block_t, max(16, common.next_pow2(t)))
  cfg = dataclasses.replace(cfg, block_t=block_t)  # short sequences: one smaller block
  t_pad = -(-t // block_t) * block_t
  pos = None
  if segment_ids is not None:
    # padded tokens continue the last segment (their outputs are dropped)
    seg = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, t_pad - t)), mode="edge")
    pos = positions_in_segment(seg)
  y = _conv(
    common.pad_time(x, t_pad), weight, cache, pos, bool(activation), bool(normalize), interpret, cfg
  )
  return y[:, :t]
