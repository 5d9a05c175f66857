"""Causal depthwise short convolution (width W) + SiLU with a decode cache.

The cache holds the last W-1 *inputs* (oldest first): shape [B, W-1, *channels].
With ``segment_ids`` every packed segment starts from the given cache, exactly as if the
segments were run as separate sequences.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from kdn_jax.layers.dense import make_param, normal_init


def positions_in_segment(segment_ids: jax.Array) -> jax.Array:
    """[B, T] int -> position of every token inside its (contiguous) segment."""
    B, T = segment_ids.shape
    t = jnp.arange(T, dtype=jnp.int32)[None, :]
    prev = jnp.concatenate([segment_ids[:, :1], segment_ids[:, :-1]], axis=1)
    is_start = (segment_ids != prev) | (t == 0)
    start = jax.lax.cummax(jnp.where(is_start, t, 0), axis=1)
    return t - start


class ShortConv(nnx.Module):
    def __init__(self, channels: tuple[int, ...], width: int = 4, *, names=('heads', 'kv'), activation=True,
                 dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.channels, self.width, self.dtype, self.activation = tuple(channels), int(width), dtype, activation
        if self.width < 1:
            raise ValueError(f'conv_size must be >= 1, got {width}')
        self.weight = make_param(rngs, normal_init(1.0 / math.sqrt(self.width)), (self.width,) + self.channels,
                                 param_dtype, ('conv',) + tuple(names))

    def init_cache(self, batch: int) -> jax.Array:
        return jnp.zeros((batch, self.width - 1) + self.channels, jnp.float32)  # caches are kept in f32

    def _act(self, y):
        return jax.nn.silu(y) if self.activation else y

    def __call__(self, x, cache=None, segment_ids=None):
        """x [B, T, *C] -> (y [B, T, *C], new_cache [B, W-1, *C])."""
        B, T = x.shape[:2]
        W = self.width
        if cache is None:
            cache = self.init_cache(B)
        x = x.astype(self.dtype)
        xp = jnp.concatenate([cache.astype(self.dtype), x], axis=1)  # [B, W-1+T, C]
        w = self.weight[...].astype(jnp.float32)
        extra = (1,) * len(self.channels)
        y = jnp.zeros(x.shape, jnp.float32)
        t = jnp.arange(T, dtype=jnp.int32)[None, :]
        if segment_ids is None:
            for j in range(W):  # tap j looks j steps back
                y = y + xp[:, W - 1 - j: W - 1 - j + T].astype(jnp.float32) * w[W - 1 - j]
            new_cache = xp[:, T:]
        else:
            pos = positions_in_segment(segment_ids)
            for j in range(W):
                idx = (W - 1) + jnp.where(pos >= j, t - j, pos - j)  # before the segment start -> cache
                idx = jnp.broadcast_to(idx, (B, T)).reshape((B, T) + extra)
                y = y + jnp.take_along_axis(xp, idx, axis=1).astype(jnp.float32) * w[W - 1 - j]
            pos_last = pos[:, -1:]
            cols = []
            for j in range(W - 2, -1, -1):  # oldest first
                idx = (W - 1) + jnp.where(pos_last >= j, T - 1 - j, pos_last - j)
                cols.append(jnp.take_along_axis(xp, idx.reshape((B, 1) + extra), axis=1))
            new_cache = jnp.concatenate(cols, axis=1) if cols else xp[:, :0]
        return self._act(y).astype(self.dtype), new_cache.astype(jnp.float32)

    def step(self, x_t, cache):
        """x_t [B, *C] -> (y_t, new_cache)."""
        window = jnp.concatenate([cache.astype(self.dtype), x_t.astype(self.dtype)[:, None]], axis=1)  # [B, W, C]
        y = jnp.sum(window.astype(jnp.float32) * self.weight[...].astype(jnp.float32)[None], axis=1)
        return self._act(y).astype(self.dtype), window[:, 1:].astype(jnp.float32)
