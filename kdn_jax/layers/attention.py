"""Softmax attention with RoPE: full causal (`attention`) and sliding window (`swa`).

Training/chunked path: ``__call__(x, *, initial_state=None, segment_ids=None) -> (y, None)``
(attention carries nothing across training chunks; ``initial_state`` must be None).
Decoding uses a separate KV cache: ``init_cache(batch, max_len)`` ->
``{'k': [B, L, H, D], 'v': [B, L, H, D], 'pos': int32 [L], 'index': int32 []}``; ``prefill(x, cache)`` and
``step(x_t, cache)``. Full attention: L = max_len, slot = position (outputs past max_len are
NaN). `swa`: a ring buffer of
L = window slots (slot = position mod L), so decoding memory is O(window), not O(length);
``pos`` holds each slot's absolute position (-1: empty).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kdn_jax.layers.dense import Dense
from kdn_jax.layers.options import option
from kdn_jax.layers.recurrent import get_dtype
from kdn_jax.layers.short_conv import positions_in_segment


def rope(x, positions, theta: float = 10000.0):
  """x [B, T, H, D], positions [B, T] or [T] int -> rotated x (half-split convention), computed in f32."""
  D = x.shape[-1]
  half = D // 2
  freq = theta ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / D)
  pos = jnp.asarray(positions, jnp.float32)
  if pos.ndim == 1:
    pos = pos[None]
  ang = pos[..., None] * freq  # [B, T, half]
  cos, sin = jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]
  xf = x.astype(jnp.float32)
  x1, x2 = xf[..., :half], xf[..., half:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


class Attention(nnx.Module):
  def __init__(self, cfg, *, window: int | None = None, rngs: nnx.Rngs):
    d, H, D = int(cfg.d_model), int(cfg.num_heads), int(cfg.head_dim)
    if D % 2:
      raise ValueError(f"head_dim must be even for RoPE, got {D}")
    self.d_model, self.num_heads, self.head_dim = d, H, D
    self.window = None if window is None else int(window)
    if self.window is not None and self.window < 1:
      raise ValueError(f"swa_window must be >= 1, got {window}")
    self.theta = float(option(cfg, "rope_theta"))
    self.dtype = get_dtype(cfg.dtype)
    kw = dict(dtype=self.dtype, param_dtype=get_dtype(cfg.param_dtype), rngs=rngs)
    self.q_proj = Dense(d, (H, D), ("embed", "heads", "kv"), **kw)
    self.k_proj = Dense(d, (H, D), ("embed", "heads", "kv"), **kw)
    self.v_proj = Dense(d, (H, D), ("embed", "heads", "kv"), **kw)
    self.o_proj = Dense((H, D), d, ("heads", "kv", "embed"), **kw)

  def init_state(self, batch: int):
    return None

  def init_cache(self, batch: int, max_len: int) -> dict:
    L = int(max_len) if self.window is None else self.window
    shape = (batch, L, self.num_heads, self.head_dim)
    return {
      "k": jnp.zeros(shape, self.dtype),
      "v": jnp.zeros(shape, self.dtype),
      "pos": jnp.full((L,), -1, jnp.int32),
      "index": jnp.zeros((), jnp.int32),
    }

  def _qkv(self, x, positions):
    q = rope(self.q_proj(x), positions, self.theta)
    k = rope(self.k_proj(x), positions, self.theta)
    return q, k, self.v_proj(x)

  def __call__(self, x, *, initial_state=None, segment_ids=None):
    if initial_state is not None:
      raise ValueError("attention carries no state across chunks; initial_state must be None")
    B, T, _ = x.shape
    if segment_ids is None:
      q, k, v = self._qkv(x, jnp.arange(T, dtype=jnp.int32))
      lws = None if self.window is None else (self.window - 1, 0)
      o = jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=lws)
    else:
      pos = positions_in_segment(segment_ids)
      q, k, v = self._qkv(x, pos)
      t = jnp.arange(T)
      mask = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (t[:, None] >= t[None, :])
      if self.window is not None:
        mask = mask & (t[:, None] - t[None, :] < self.window)
      o = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None])
    return self.o_proj(o.astype(self.dtype)), None

  def prefill(self, x, cache):
    """Attend from x [B, T, d] (positions index..index+T-1) over the cache and x -> (y, new_cache)."""
    B, T, _ = x.shape
    L = cache["k"].shape[1]
    idx = cache["index"]
    qpos = idx + jnp.arange(T, dtype=jnp.int32)
    q, k, v = self._qkv(x, qpos)
    if self.window is None:  # full cache: write first, then attend over every slot
      if T > L:
        raise ValueError(f"attention.prefill: {T} tokens do not fit a KV cache of max_len={L}")
      ck = jax.lax.dynamic_update_slice(cache["k"], k.astype(cache["k"].dtype), (0, idx, 0, 0))
      cv = jax.lax.dynamic_update_slice(cache["v"], v.astype(cache["v"].dtype), (0, idx, 0, 0))
      kpos = jnp.where(jnp.arange(L) < idx + T, jnp.arange(L, dtype=jnp.int32), -1)
      new = {"k": ck, "v": cv, "pos": kpos, "index": idx + T}
      keys, vals = ck, cv
      # Past max_len, dynamic_update_slice clamps the write onto the last slots and the
      # outputs would look plausible but be wrong; the index is traced, so they become NaN.
      fits = idx + T <= L
    else:  # ring: attend over (old slots, new tokens), then keep the newest L tokens
      keys = jnp.concatenate([cache["k"], k.astype(cache["k"].dtype)], axis=1)
      vals = jnp.concatenate([cache["v"], v.astype(cache["v"].dtype)], axis=1)
      kpos = jnp.concatenate([cache["pos"], qpos])
      n = min(T, L)
      slots = qpos[T - n :] % L
      new = {
        "k": cache["k"].at[:, slots].set(k[:, T - n :].astype(cache["k"].dtype)),
        "v": cache["v"].at[:, slots].set(v[:, T - n :].astype(cache["v"].dtype)),
        "pos": cache["pos"].at[slots].set(qpos[T - n :]),
        "index": idx + T,
      }
    mask = (kpos[None, :] >= 0) & (kpos[None, :] <= qpos[:, None])
    if self.window is not None:
      mask = mask & (qpos[:, None] - kpos[None, :] < self.window)
    o = jax.nn.dot_product_attention(
      q, keys.astype(self.dtype), vals.astype(self.dtype), mask=mask[None, None]
    )
    if self.window is None:
      o = jnp.where(fits, o, jnp.nan)
    return self.o_proj(o.astype(self.dtype)), new

  def step(self, x_t, cache):
    y, cache = self.prefill(x_t[:, None], cache)
    return y[:, 0], cache


class FullAttention(Attention):
  """Registry entry `attention`: full causal softmax attention."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    super().__init__(cfg, window=None, rngs=rngs)


class SlidingWindowAttention(Attention):
  """Registry entry `swa`: sliding-window attention, window = cfg.swa_window (token + window-1 previous)."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    super().__init__(cfg, window=int(cfg.swa_window), rngs=rngs)
